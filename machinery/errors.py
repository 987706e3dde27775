"""The one error a user sees: UserError, and the one place each command turns it into an `error:` line.

Bad input (a config value, a file, a folder, data) and a run that cannot go on (a checkpoint that cannot be
written, a loss that stays non-finite) raise UserError with a message that says what happened and what was
kept. Each command's main wraps its work in `reported()`, which prints that message as one line on stderr
and exits with the error's status: 2 for bad input, 1 for a run that had to stop. Never a traceback.
"""
import contextlib
import os
import sys

BAD_INPUT, RUN_STOPPED = 2, 1  # exit statuses


class UserError(Exception):
    """Something the user can act on, told in one line; `status` is the command's exit status."""

    def __init__(self, message, status=BAD_INPUT):
        super().__init__(message)
        self.status = status


def first_line(e):
    """An exception's message, first line only (possibly empty): for the one-line errors every CLI prints."""
    return (str(e).strip().splitlines() or [""])[0]


@contextlib.contextmanager
def reported():
    """Each command's main runs inside this: a UserError becomes one `error:` line and its exit status.
    Under torchrun the line names the rank that raised it. Output goes out line by line, off a terminal too
    (a batch job's log sees the start line at the start, not when a 8 KiB buffer fills)."""
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    try:
        yield
    except UserError as e:
        rank = f"[rank {os.environ.get('RANK')}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        print(f"{rank}error: {e}", file=sys.stderr)
        sys.exit(e.status)

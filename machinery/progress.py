"""How far long work is (statistics, decoding, sampling, rebuilds): tqdm's bar on a terminal, and where the
output is a file (a batch job's log) a plain line every few percent or every minute, on rank 0 only.

    with Progress("FID reference statistics", total=10_000, unit="images") as bar:
        for x in batches:
            ...
            bar.update(len(x))

In a log this reads, a line each EVERY_PERCENT done or EVERY_S seconds (whichever comes first), then one
when the work is done (none when it fails):

    FID reference statistics: 2,500/10,000 images (25%), 6.1 min, ~18 min left
    FID reference statistics: 10,000 images in 24.8 min
"""
import sys
import time

from tqdm import tqdm

from machinery import group


def duration(seconds):
    """'42 s' below a minute, '6.1 min' below ten, '18 min' from there."""
    if seconds < 59.5:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 600 else f"{seconds / 60:.0f} min"


class Progress:
    """Counts work done towards `total` (None: unknown, lines by the minute only). Under torchrun only rank 0
    shows anything: its own share; with `what` None nothing is shown. `file`: where the lines go (stdout);
    `clock`: seconds, for tests."""
    EVERY_PERCENT = 5  # a line each time this much more of the total is done
    EVERY_S = 60  # and a line at least this often

    def __init__(self, what, total=None, unit="images", file=None, clock=time.monotonic):
        self.what, self.total, self.unit, self.clock = what, total, unit, clock
        self.file = sys.stdout if file is None else file
        lead = what is not None and group.rank_world()[0] == 0
        self.lines = lead and not getattr(self.file, "isatty", lambda: False)()  # off a terminal
        # the bar as before: drawn where stderr is a terminal (tqdm's disable=None), on rank 0
        self.bar = tqdm(total=total, desc=what, unit=f" {unit}", disable=None, leave=False) if lead else None
        self.done, self.start = 0, clock()
        self.last, self.mark = self.start, self.EVERY_PERCENT  # the last line's time, the next line's percent

    def update(self, n=1):
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        if self.lines:
            now = self.clock()
            if self.due(now):
                print(self.line(now), file=self.file, flush=True)

    def due(self, now):
        """A line now: EVERY_PERCENT more done or EVERY_S passed since the last one; never at the end (the
        final line says it)."""
        percent = 100 * self.done // self.total if self.total else None
        if percent is not None and self.done >= self.total:
            return False
        if now - self.last < self.EVERY_S and (percent is None or percent < self.mark):
            return False
        self.last = now
        if percent is not None:
            self.mark = (percent // self.EVERY_PERCENT + 1) * self.EVERY_PERCENT
        return True

    def line(self, now):
        elapsed = now - self.start
        if not self.total:
            return f"{self.what}: {self.done:,} {self.unit}, {duration(elapsed)}"
        left = elapsed * (self.total - self.done) / max(self.done, 1)
        return (f"{self.what}: {self.done:,}/{self.total:,} {self.unit} ({100 * self.done // self.total}%), "
                f"{duration(elapsed)}, ~{duration(left)} left")

    def close(self, finished=True):
        """The bar closed and, where the work finished (and any was done), the final line."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.lines and finished and self.done:
            print(f"{self.what}: {self.done:,} {self.unit} in {duration(self.clock() - self.start)}",
                  file=self.file, flush=True)
        self.lines = False  # closed: nothing more

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        self.close(finished=kind is None)

"""Flat `--field=value` command lines over config dataclasses: fields declared with their range or choices,
each value parsed to its field's type and checked, and --help written from the fields' comments.

    @dataclass
    class Config:
        lr: float = ranged(2e-4, 0)            # learning rate: in [0, inf)
        loader: str = chosen("torch", TABLE)   # a key of TABLE (looked up when checked)
    fields, preset = flat_args(sys.argv[1:], (Config,), "usage text", PRESETS, default_preset="ho")
    check_fields(Config(**fields))           # every range and choice, NaN and inf included

A field typed `X | None` with default None means "decided later" (sample.py: the run's own value): it parses
as X when given, and None passes its checks.
"""
import dataclasses
import inspect
import math
import re
import sys
import types
import typing
from typing import Literal

from machinery.errors import UserError


def ranged(default, lo, hi=None, closed=False):
    """A numeric field whose value must lie in [lo, hi) ([lo, hi] if closed; hi None: no upper bound);
    check_fields checks it."""
    return dataclasses.field(default=default, metadata={"range": (lo, hi), "closed": closed})


def chosen(default, table):
    """A field whose value is a key of `table`, looked up when checked: a sampler registered later counts."""
    return dataclasses.field(default=default, metadata={"choices": table})


def optional_of(typ):
    """X for a hint `X | None` (or Optional[X]), else None."""
    if typing.get_origin(typ) in (typing.Union, types.UnionType) and type(None) in typing.get_args(typ):
        rest = [a for a in typing.get_args(typ) if a is not type(None)]
        return rest[0] if len(rest) == 1 else None
    return None


def check_fields(cfg):
    """Each field of a config against its choices (a Literal, or a table's keys) and its range; None passes
    for a field typed `X | None`."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        v, hint = getattr(cfg, f.name), hints[f.name]
        if v is None and optional_of(hint) is not None:
            continue
        hint = optional_of(hint) or hint
        choices = (typing.get_args(hint) if typing.get_origin(hint) is Literal
                   else f.metadata.get("choices"))
        if choices is not None and v not in choices:  # Literal fields set from Python too, and table keys
            raise UserError(f"{f.name}='{v}': choose one of {', '.join(choices)}")
        if "range" in f.metadata:  # every number in range, NaN and inf included; a bool is not a number
            (lo, hi), closed = f.metadata["range"], f.metadata.get("closed")
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                    and lo <= v and (hi is None or v < hi or (closed and v == hi))):
                bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}{']' if closed else ')'}"
                raise UserError(f"{f.name}={v}: must be {bounds}")


def flat_args(argv, classes, usage, presets=None, default_preset=None, aliases=None):
    """argv -> ({field: value parsed to its type}, preset name). --name=value, --name value, a bare --flag for
    true; --preset=NAME picks a preset (where there are presets); `aliases` maps another name to a field's;
    -h/--help prints the fields and exits. Anything else: one line."""
    hints = {k: optional_of(v) or v for cls in classes for k, v in typing.get_type_hints(cls).items()}
    aliases = aliases or {}
    pairs, preset = [], default_preset
    it = iter(argv)
    for a in it:
        if a in ("-h", "--help"):
            print_help(classes, usage, presets, default_preset)
            sys.exit(0)
        if not a.startswith("--"):
            raise UserError(f"unexpected argument '{a}'; fields are given as --name=value")
        name, eq, text = a[2:].partition("=")
        name = aliases.get(name, name)
        flag = hints.get(name) is bool or "true" in typing.get_args(hints.get(name))  # takes a bare --name
        if not eq and not flag:  # '--name value'; a bare '--flag' means true
            text = next(it, None)
            if text is None:
                raise UserError(f"--{name} needs a value")
        if name == "preset" and presets is not None:
            preset = text
        else:
            pairs.append((name, text if eq or not flag else "true"))
    if presets is not None and preset not in presets:
        raise UserError(f"unknown preset '{preset}'; choose one of {', '.join(presets)}")
    fields = {}
    for name, text in pairs:
        if name not in hints:
            raise UserError(f"unknown field --{name} (see --help)")
        fields[name] = parse_value(name, text, hints[name])
    return fields, preset


def parse_value(name, text, typ):
    """Convert one CLI string to a field's type, or raise UserError naming the field."""
    truthy, falsy = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
    try:
        if typing.get_origin(typ) is Literal:
            choices = typing.get_args(typ)
            # e.g. channels_last: auto, true or false
            if "true" in choices and text.lower() in truthy + falsy:
                text = "true" if text.lower() in truthy else "false"
            if text not in choices:
                raise ValueError(f"choose one of {', '.join(choices)}")
            return text
        if typ is bool:
            if text.lower() not in truthy + falsy:
                raise ValueError("expected true or false")
            return text.lower() in truthy
        if typing.get_origin(typ) is tuple:
            item = typing.get_args(typ)[0]  # tuple[int, ...] or tuple[float, ...]
            return tuple(item(v) for v in text.split(",") if v.strip())
        return typ(text)
    except ValueError as e:
        raise UserError(f"--{name}={text}: {e}") from None


def print_help(classes, usage, presets, default_preset):
    print(usage)
    if presets is not None:
        print(f"--preset=NAME  one of: {', '.join(presets)} (default {default_preset}); later --fields "
              "override it\n")
    for cls in classes:
        print(f"{cls.__name__}:")
        comments = field_comments(cls)
        for f in dataclasses.fields(cls):
            default = f.default if not isinstance(f.default, tuple) else ",".join(map(str, f.default))
            default = "" if default is None else default
            print(f"  {f'--{f.name}={default}':<34} {comments.get(f.name, '')}")
        print()


def field_comments(cls):
    """The '# ...' comment of each dataclass field, with the comment-only lines under it: the source of
    --help."""
    comments, name = {}, None
    for line in inspect.getsource(cls).splitlines():
        field = re.match(r"^\s+(\w+):[^#\n]*#\s*(.*)$", line)
        more = re.match(r"^\s+#\s*(.*)$", line)
        if field:
            name, comments[field.group(1)] = field.group(1), field.group(2)
        elif more and name:
            comments[name] += " " + more.group(1)
        else:
            name = None
    return comments

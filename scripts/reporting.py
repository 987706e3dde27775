"""The report half of every comparison, as cpu_timing.py is the timing half: medians, ours / theirs ratios,
mean ± s.d. verdicts, markdown tables and the files they are written to, for scripts/*_vs_*.py, levers.py and
vs_diffusers_train.py.

A row is a dict with at least config (name), family ('ours' or 'theirs') and batch; the timing that fills
it in is cpu_timing's on the CPU (step_ms, img_per_s, gflops, steps_used) and gpu_vs_diffusers.run_rows'
StepTimer on a GPU (timed_medians). A ratio ours / theirs is of img/s, so it reads the same at any two
batches; against_theirs stores it in our row as vs_theirs_<ref>, the key ratio_cells prints.
"""
import json
import math
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from machinery import files  # noqa: E402

# ----------------------------------------------------------------------------- rows and ratios


def timed_medians(rows, peak):
    """Rows timed by a StepTimer (`_timer`, with their step `_run`) -> the rows with timed steps, the two
    dropped, each with its median step in ms (and min, max), img/s, TFLOP/s of row['flops_per_image'] and
    MFU against `peak` (bf16 FLOP/s)."""
    for row in rows:
        row["_times"] = row.pop("_timer").read_ms()
        row.pop("_run")
    rows = [r for r in rows if r["_times"]]
    for row in rows:
        times = row.pop("_times")
        ms = statistics.median(times)
        row.update(timed_steps=len(times), step_ms=ms, step_ms_min=min(times), step_ms_max=max(times),
                   img_per_s=row["batch"] / ms * 1e3, tflops=row["flops_per_image"] * row["batch"] / ms / 1e9)
        row["mfu_bf16"] = row["tflops"] * 1e12 / peak
    return rows


def against_theirs(rows, refs, same):
    """Each of our rows against the first of theirs that same(their row, ref, our row) accepts, for each ref
    of `refs`: our row['vs_theirs_<ref>'] = our img/s / theirs' -> [(our row, ref, their row)], in order."""
    pairs = []
    for row in (r for r in rows if r["family"] == "ours"):
        for ref in refs:
            theirs = next((r for r in rows if r["family"] == "theirs" and same(r, ref, row)), None)
            if theirs is not None:
                row[f"vs_theirs_{ref}"] = row["img_per_s"] / theirs["img_per_s"]
                pairs.append((row, ref, theirs))
    return pairs


def ratio_entry(ours, theirs):
    """One comparison of two cpu_timing rows as the JSON reports keep it: the img/s and counted FLOP/s ratios,
    and whether either median is over contended steps."""
    return {"img_per_s_ratio": ours["img_per_s"] / theirs["img_per_s"],
            "flops_ratio": ours["gflops"] / theirs["gflops"],
            "noisy": "all" in (ours["steps_used"], theirs["steps_used"])}


# ----------------------------------------------------------------------------- mean ± s.d. over seeds


def summary(values):
    """-> (mean, s.d.) of the values; the s.d. is NaN for one value."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else math.nan)


def format_summary(values):
    """mean ± s.d., or the one value where there is one seed (no s.d.)."""
    return "{:.2f} ± {:.2f}".format(*summary(values)) if len(values) > 1 else f"{values[0]:.2f}"


def verdict(mine, reference):
    """A (mean, s.d.) against the reference's, lower is better: the difference, and whether it exceeds 2 s.d.
    (the larger of the two). A side of one seed has no s.d. of its own: it is read against the reference's,
    on the assumption that seeds scatter alike on every side, and marked so."""
    diff = mine[0] - reference[0]
    if math.isnan(reference[1]):
        return f"{diff:+.2f} (one seed of the base: no s.d.)"
    noise, note = (2 * reference[1], " (the base's s.d.)") if math.isnan(mine[1]) else \
        (2 * max(mine[1], reference[1]), "")
    reading = "within 2 s.d." if abs(diff) <= noise else "better" if diff < 0 else "worse"
    return f"{diff:+.2f}: {reading}{note}"


# ----------------------------------------------------------------------------- tables and files


def table(heads, lines):
    """A markdown table: the header row of `heads`, its rule, then one row per list of cells (no final
    newline)."""
    return "\n".join(["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads),
                      *("| " + " | ".join(cells) + " |" for cells in lines)])


def spread(row, digits=0, scale=1):
    """The 'median (min-max)' cell of a row's step time: step_ms, step_ms_min and step_ms_max / scale."""
    median, low, high = (row[k] / scale for k in ("step_ms", "step_ms_min", "step_ms_max"))
    return f"{median:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def ratio_cells(row, refs):
    """The 'ours / theirs <ref>' cells of a row: '1.23x' in our rows, empty in theirs."""
    return [f"{row[f'vs_theirs_{ref}']:.2f}x" if f"vs_theirs_{ref}" in row else "" for ref in refs]


def write_json(path, record):
    """`record` to `path` as indented JSON, created fresh and renamed into place (files.created: never
    written through a link)."""
    with files.created(path, "w") as f:
        json.dump(record, f, indent=2)


def write_text(path, text):
    """`text` to `path`, created fresh and renamed into place."""
    with files.created(path, "w") as f:
        f.write(text)

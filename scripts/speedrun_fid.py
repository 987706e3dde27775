"""The speedrun's table from what scripts/gpu_speedrun.sh brought back: FID of each minute's EMA and of the
final one against a reference, beside the minute's clock, kimg, img/s and MFU, and eager against CUDA-graphed
DDIM samples of the final EMA.

    python scripts/speedrun_fid.py RESULTS --reference folder:cifar10/train --floor folder:cifar10/test

RESULTS is the folder holding results.tar.gz, final_a.npz, final_b.npz, minutes.npz and graphs.npz. Each
sample set is scored by `python evaluate.py --fid` (the Inception weights this machine has, n as brought
back: 10,000 for the final EMA, fewer for the minutes, each stated); --floor scores that image set (the JPEG
copy's own test split) against the reference too, the FID that real images of the same source get.
Writes RESULTS/speedrun.md and RESULTS/speedrun.json.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from machinery import files
from machinery.errors import UserError, reported  # noqa: E402


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="the folder gpu_speedrun.sh's files came back to")
    p.add_argument("--reference", required=True, help="evaluate.py's B: e.g. folder:cifar10/train")
    p.add_argument("--floor", default="", help="real images scored against the reference too (a test split)")
    p.add_argument("--inception_weights", default="", help="passed to evaluate.py")
    return p.parse_args(argv)


def unpack(results, tmp):
    """-> (the run's metrics.jsonl rows, {name: .npz path}) from the files brought back; a file missing is
    a set not scored, said in the table."""
    archive = os.path.join(results, "results.tar.gz")
    if not files.is_regular(archive):
        raise UserError(f"{archive}: not there, or not a regular file (is {results} gpu_speedrun.sh's?)")
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")  # no links out, no absolute paths: it came from another machine
    metrics = os.path.join(tmp, "speedrun", "metrics.jsonl")
    rows = ([json.loads(line) for line in open(metrics) if line.strip().startswith("{")]
            if files.is_regular(metrics) else [])
    sets = {}
    halves = [os.path.join(results, f"final_{p}.npz") for p in "ab"]
    if all(files.is_regular(h) for h in halves):
        sets["final"] = os.path.join(tmp, "final.npz")
        np.savez(sets["final"], arr_0=np.concatenate([np.load(h)["arr_0"] for h in halves]))
    for bundle in ("minutes.npz", "graphs.npz"):
        path = os.path.join(results, bundle)
        if files.is_regular(path):
            with np.load(path) as z:
                for key in z.files:
                    sets[key] = os.path.join(tmp, f"{key}.npz")
                    np.savez(sets[key], arr_0=z[key])
    return rows, sets


def fid_of(spec, args, tmp):
    """evaluate.py --fid spec REFERENCE -> its JSON result."""
    out = os.path.join(tmp, f"fid-{abs(hash(spec))}.json")
    cmd = [sys.executable, os.path.join(ROOT, "evaluate.py"), "--fid", spec, args.reference, "--out", out]
    if args.inception_weights:
        cmd += ["--inception_weights", args.inception_weights]
    done = subprocess.run(cmd, cwd=ROOT)
    if done.returncode != 0:
        raise UserError(f"evaluate.py failed on {spec} (exit {done.returncode})")
    with open(out) as f:
        return json.load(f)


def table(rows, scores, floor):
    """The markdown table: one line per minute and the final EMA, then the sampler pair and the floor."""
    train = [r for r in rows if "img_per_s" in r and r.get("img_per_s")]
    speed = (f"{statistics.median(r['img_per_s'] for r in train):,.0f} img/s, MFU "
             f"{100 * statistics.median(r['mfu'] for r in train):.1f}% (medians of {len(train)} log rows)"
             if train else "no training rows")
    marks = {f"min{r['minute']:03d}": r for r in rows if "minute" in r}
    marks.update({"final": r for r in rows if "budget_s" in r})
    lines = [f"Training: {speed}.", "", "| EMA | clock (s) | step | kimg | FID | n |",
             "|---|---|---|---|---|---|"]
    for name in [*sorted(k for k in marks if k.startswith("min")), "final"]:
        r, s = marks.get(name, {}), scores.get(name)
        fid_cell = f"{s['fid']:.2f}" if s and s.get("fid") is not None else "not scored"
        lines.append(f"| {name} | {r.get('clock_s', float('nan')):.1f} | {r.get('step', '')} | "
                     f"{r.get('kimg', float('nan')):.1f} | {fid_cell} | {s['n'] if s else ''} |")
    for name in ("eager", "graphed", "floor"):
        s = scores.get(name) if name != "floor" else floor
        if s:
            lines.append(f"\n{name}: FID {s['fid']:.2f} (n = {s['n']}, {s['samples']})")
    return "\n".join(lines)


def main(argv=None):
    with reported():
        args = parse(argv)
        with tempfile.TemporaryDirectory() as tmp:
            rows, sets = unpack(args.results, tmp)
            scores = {name: fid_of(path, args, tmp) for name, path in sets.items()}
            floor = fid_of(args.floor, args, tmp) if args.floor else None
        text = table(rows, scores, floor)
        print(text)
        with files.created(os.path.join(args.results, "speedrun.md"), "w") as f:
            f.write(text + "\n")
        with files.created(os.path.join(args.results, "speedrun.json"), "w") as f:
            json.dump({"scores": scores, "floor": floor, "marks": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""Shared by the scripts/cpu_vs_*.py comparisons: contention-aware, interleaved timing of training steps on
the CPU.

A comparison builds one row per configuration, a dict with at least
    config (name), family ('ours' or 'theirs'), batch, precision ('fp32' or 'bf16'), flops_per_image,
    timed (uncontended steps wanted), warmup (untimed steps), _build (-> (step function, parameter count)),
then calls
    warm_up(rows)                        builds every row's step and runs its untimed steps
    run_interleaved(rows, contended, budget_s)
    peaks32, peaks16 = summarize(rows, contended, peaks32, peaks16)
and prints the table from the keys summarize adds (step_ms, img_per_s, gflops, frac_of_peak, ...).

Timing: the timed rounds interleave the configurations (ABCABC...), so slow drift and load from other
processes fall on all of them alike. Each step records how many cores other processes kept busy meanwhile
(/proc/stat minus this process's CPU time). On 2 cores one busy neighbour makes the 2-thread step several
times slower (each parallel region waits for a descheduled thread), so a step with others > `contended` cores
counts as contended: after `timed` rounds, the configurations short of `timed` uncontended steps run again
(within `budget_s`), and the median is taken over the uncontended steps where there are two or more, else over
all of them (flagged).
"""
import datetime
import importlib
import importlib.metadata
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import reporting  # noqa: E402
from machinery import mfu  # noqa: E402

CPU = torch.device("cpu")


def version(pkg):
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


class LoadMeter:
    """Cores kept busy by other processes between start() and stop(): all busy jiffies minus our own CPU
    time."""

    HZ = os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _busy():
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
            return (sum(v[:8]) - v[3] - v[4]) / LoadMeter.HZ  # all minus idle and iowait, seconds
        except OSError:
            return float("nan")

    def start(self):
        t = os.times()
        self.t0, self.cpu0, self.busy0 = time.perf_counter(), t.user + t.system, self._busy()

    def stop(self):
        """-> (wall seconds, our cores used, other processes' cores used)."""
        wall = time.perf_counter() - self.t0
        t = os.times()
        own = t.user + t.system - self.cpu0
        return wall, own / wall, max(0.0, (self._busy() - self.busy0 - own) / wall)


def importable(package, hint):
    """True if `package` imports; else one 'skipped:' line with `hint` (how to install it) and False: a
    comparison without its peer has nothing to measure, and exits 0."""
    try:
        importlib.import_module(package)
        return True
    except ImportError as e:
        print(f"skipped: {package} is not importable ({e}); {hint}")
        return False


def measure(fn):
    """Run fn() once under a LoadMeter -> (wall seconds, our cores, other processes' cores)."""
    m = LoadMeter()
    m.start()
    fn()
    return m.stop()


def git_state():
    """HEAD and whether tracked files differ from it (read-only git calls): what 'ours' was measured at."""
    try:
        def run(*a):
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,
                                  timeout=10).stdout.strip()

        return {"head": run("rev-parse", "HEAD") or None,
                "dirty": bool(run("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return None


def environment(threads, packages):
    """Date, git state, CPU, threads, torch and the given packages' versions."""
    return {"date": str(datetime.date.today()),
            "utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "git": git_state(), "cpu": mfu.device_name(CPU), "cores": os.cpu_count(), "threads": threads,
            "cpu_bf16_hardware": mfu.cpu_has_bf16(), "torch": torch.__version__,
            **{k: version(k) for k in packages}}


def count_flops(fn, per):
    """FLOPs torch.utils.flop_counter counts while fn() runs, divided by `per` (the batch it ran)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as c:
        fn()
    return c.get_total_flops() / per


def measure_peaks():
    """-> ([fp32 matmul FLOP/s], [bf16 matmul FLOP/s]) as mfu.measure_matmul_flops measures them; summarize
    measures each again after the timed steps and keeps the better."""
    return [mfu.measure_matmul_flops(CPU, torch.float32)], [mfu.measure_matmul_flops(CPU, torch.bfloat16)]


def warm_up(rows):
    """Build every row's step (row['_build']() -> (step, parameter count)) and run its row['warmup'] untimed
    steps."""
    for row in rows:
        row["_step"], row["params"] = row.pop("_build")()
        row["warmup_s"] = [measure(row["_step"])[0] for _ in range(row["warmup"])]
        row.update(steps_s=[], own_cores=[], other_cores=[])
        print(f"warm-up {row['config']}: " + ", ".join(f"{w:.1f}" for w in row["warmup_s"]) + " s",
              flush=True)


def run_interleaved(rows, contended, budget_s):
    """Timed rounds, interleaved; past row['timed'] rounds, only the rows short of row['timed'] uncontended
    steps run again, while the budget_s of the timed phase lasts."""
    t_timed, r = time.time(), 0
    while True:
        ran = False
        for row in rows:
            clean = sum(o <= contended for o in row["other_cores"])
            if r >= row["timed"] and (clean >= row["timed"] or time.time() - t_timed > budget_s):
                continue
            wall, own, other = measure(row["_step"])
            row["steps_s"].append(wall)
            row["own_cores"].append(own)
            row["other_cores"].append(other)
            ran = True
            print(f"round {r}: {row['config']}: {wall:.2f} s (cores: ours {own:.2f}, others {other:.2f})",
                  flush=True)
        if not ran:
            return
        r += 1


def summarize(rows, contended, peaks32, peaks16):
    """Measure the matmul peaks again (a neighbour may have slowed the first measurement) and keep the best;
    add each row's median step (uncontended steps where there are two or more), img/s, counted GFLOP/s and
    fraction of the peak in its precision. Drops the step functions. -> (peaks32, peaks16) with the second
    measurement appended."""
    peaks32 = peaks32 + [mfu.time_matmuls(CPU, torch.float32)]
    peaks16 = peaks16 + [mfu.time_matmuls(CPU, torch.bfloat16)]
    peak32, peak16 = max(peaks32), max(peaks16)
    for row in rows:
        row.pop("_step", None)
        clean = [w for w, o in zip(row["steps_s"], row["other_cores"]) if o <= contended]
        used = clean if len(clean) >= 2 else row["steps_s"]
        row["steps_used"] = "uncontended" if used is clean else "all"
        row["n_clean"], row["n_steps"] = len(clean), len(row["steps_s"])
        ms = statistics.median(used) * 1e3
        row["step_ms_all_steps"] = statistics.median(row["steps_s"]) * 1e3
        peak = peak16 if row["precision"] == "bf16" else peak32
        row.update(step_ms=ms, step_ms_min=min(used) * 1e3, step_ms_max=max(used) * 1e3,
                   img_per_s=row["batch"] / ms * 1e3, gflops=row["flops_per_image"] * row["batch"] / ms / 1e6,
                   peak_gflops=peak / 1e9, other_cores_median=statistics.median(row["other_cores"]))
        row["frac_of_peak"] = row["gflops"] * 1e9 / peak
        row["frac_of_fp32_peak"] = row["gflops"] * 1e9 / peak32
    return peaks32, peaks16


def steps_used(row):
    """The table's 'steps used' cell."""
    if row["steps_used"] == "uncontended":
        return f"{row['n_clean']} clean of {row['n_steps']}"
    return f"all {row['n_steps']} (contended)"


def peak_cell(row):
    """The table's 'of matmul peak' cell: the fraction of the peak in the row's precision (and of fp32 for
    bf16)."""
    cell = f"{100 * row['frac_of_peak']:.0f}% ({row['precision']})"
    if row["precision"] == "bf16":
        cell += f", {100 * row['frac_of_fp32_peak']:.0f}% of fp32"
    return cell


def add_args(p):
    """The options every comparison has: --warmup, --timed, --contended, --budget_s, --threads, --json."""
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps per configuration (compilation included)")
    p.add_argument("--timed", type=int, default=5, help="timed, interleaved rounds")
    p.add_argument("--contended", type=float, default=0.25,
                   help="a timed step during which other processes kept more than this many cores busy is "
                        "contended")
    p.add_argument("--budget_s", type=float, default=300,
                   help="seconds the timed phase may run on past --timed rounds, re-running configurations "
                        "that have fewer than --timed uncontended steps")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--json", help="write every measurement to this file")


def print_counts(env, peaks32, peaks16, theirs_flops, ours_flops, ours_meta_flops):
    print(f"fp32 matmul peak (measured): {peaks32[0] / 1e9:.1f} GFLOP/s; "
          f"bf16: {peaks16[0] / 1e9:.2f} GFLOP/s "
          f"(bf16 hardware: {env['cpu_bf16_hardware']})")
    print(f"counted training GFLOP/image: theirs {theirs_flops / 1e9:.2f}, ours {ours_flops / 1e9:.2f} "
          f"(mfu.train_flops_per_image: {ours_meta_flops / 1e9:.2f})", flush=True)


def finish(args, t_start, env, peaks32, peaks16, flops, rows, **extra):
    """A note naming the rows timed under contention; every measurement to args.json (when given), created
    fresh and renamed into place (reporting.write_json).
    flops = (theirs, ours, ours by mfu.train_flops_per_image), per image."""
    noisy = [row["config"] for row in rows if row["steps_used"] == "all"]
    if noisy:
        print(f"\nnote: fewer than 2 uncontended steps (others <= {args.contended} cores), median over all "
              f"steps, for: {', '.join(noisy)}: treat those as noisy")
    if args.json:
        reporting.write_json(args.json, {
            "environment": env, "peak_fp32_flops": max(peaks32), "peak_bf16_flops": max(peaks16),
            "peak_fp32_flops_start_end": peaks32, "peak_bf16_flops_start_end": peaks16,
            "theirs_flops_per_image": flops[0], "ours_flops_per_image": flops[1],
            "ours_train_flops_per_image_meta": flops[2], "warmup": args.warmup, "timed": args.timed,
            "contended_threshold_cores": args.contended, "argv": sys.argv, "rows": rows, **extra,
            "wall_s": time.time() - t_start})

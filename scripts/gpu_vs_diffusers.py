"""Training-step speed on a GPU, side by side: ours against diffusers on the very same network (issue 16).

    python scripts/gpu_vs_diffusers.py --json gpu_vs_diffusers.json      # one GPU, about 2 minutes
    python scripts/gpu_vs_diffusers.py --device cpu --batch 2 --ours eager --warmup 1 --timed 2  # plumbing

The two steps are scripts/cpu_vs_diffusers.py's, built on --device (its docstring has them in full): theirs
is diffusers' train_unconditional.py step on UNet2DModel in google/ddpm-cifar10-32's configuration, in fp32
and with bf16 autocast as accelerate runs it; ours is `python ddpm.py`'s defaults (ddpm.iteration, the
step train() runs), eager and torch.compile'd. Both are Ho et al.'s CIFAR-10 network, 35.7M parameters and
the same counted FLOPs. Issue 16's target: ours compiled at >= 1.5x the img/s of theirs in bf16, same batch.

Timing: --warmup untimed steps per configuration (compilation included), then --timed rounds that
interleave the configurations, each step timed by mfu.StepTimer (CUDA events on a GPU, read once at the
end); the median step. Counted FLOPs per image are torch.utils.flop_counter's (count_theirs, count_ours);
MFU is against the datasheet's dense bf16 peak (on a CPU, the measured bf16 matmul rate). Without diffusers
it prints one line and exits 0 (scripts/gpu_bench.sh carries diffusers and importlib_metadata as wheels).
"""
import argparse
import datetime
import itertools
import sys

import cpu_timing  # puts the repository root on sys.path
import reporting
from cpu_vs_ddpm_pytorch import count_ours
from cpu_vs_diffusers import OUR_MODES, THEIR_MODES, build_ours, build_theirs, count_theirs, parse_list
from machinery import errors

import torch


def parse_args(argv):
    """-> (args, batches, our modes, their modes); a bad value exits with one `error:` line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (to test the plumbing)")
    p.add_argument("--batch", default="128", help="batch sizes, comma-separated (Ho et al.'s is 128)")
    p.add_argument("--dropout", type=float, default=0.1, help="dropout of both networks (Ho's: 0.1)")
    p.add_argument("--ours", default="eager,compile", help=f"ours, comma-separated: {', '.join(OUR_MODES)}")
    p.add_argument("--theirs", default="fp32,bf16", help=f"theirs: {', '.join(THEIR_MODES)}")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per configuration (compiling too)")
    p.add_argument("--timed", type=int, default=20, help="timed, interleaved rounds")
    p.add_argument("--json", help="write every measurement to this file")
    p.add_argument("--profile", action="store_true",
                   help="then profile two more steps of each row: its GPU time's share per kind of kernel")
    args = p.parse_args(argv)
    batches = parse_list(args.batch, int, "--batch")
    ours = parse_list(args.ours, str, "--ours", OUR_MODES)
    theirs = parse_list(args.theirs, str, "--theirs", THEIR_MODES)
    if args.warmup < 0 or args.timed < 1 or min(batches) < 1:
        raise errors.UserError("need --warmup >= 0, --timed >= 1 and batches >= 1")
    return args, batches, ours, theirs


def open_device(name):
    """The device (made current on a GPU, for StepTimer's events and syncs); a bad name raises UserError."""
    from machinery import group

    device = group.resolve_device(name)  # a bad name: its UserError
    if device.type == "cuda":
        # StepTimer's events and syncs use the current device; 'cuda' alone names the current one (torch 2.11
        # refuses a device without an index here)
        torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
    return device


def environment(device):
    """Date, device, torch, diffusers and git state, printed as the header line."""
    from machinery import mfu

    name = mfu.device_name(device)
    env = {"date": str(datetime.date.today()), "device": name, "torch": torch.__version__,
           "diffusers": cpu_timing.version("diffusers"), "git": cpu_timing.git_state()}
    print(f"# {env['date']} · {name} · torch {env['torch']} · diffusers {env['diffusers']}", flush=True)
    return env


def peak_flops(device):
    """The datasheet's dense bf16 peak on a GPU; else (or unknown) the measured bf16 matmul rate."""
    from machinery import mfu

    peak = mfu.datasheet_peak(device, "bf16") if device.type == "cuda" else None
    return peak or mfu.measure_matmul_flops(device, torch.bfloat16)


def build_rows(args, batches, ours, theirs, device, flops):
    """One row per batch and configuration, each with its step (`_run`) and its StepTimer (`_timer`);
    configurations of one side (and, for ours, mode) share one model. flops: counted per image, by side."""
    from machinery import mfu, runs

    steps, rows = {}, []
    for batch, (family, mode) in itertools.product(batches, [("theirs", m) for m in theirs] +
                                                   [("ours", m) for m in ours]):
        key = (family, mode if family == "ours" else "")  # theirs: one model for both precisions
        if key not in steps:
            steps[key] = (build_theirs(args.dropout, device) if family == "theirs"
                          else build_ours(args.dropout, mode, device))[0]
        step = steps[key]
        # each side with its own TF32 settings: theirs torch's defaults (as their example runs), ours
        # runs.set_matmul_precision's for its precision
        if family == "theirs":
            def run(s=step, b=batch, bf16=mode == "bf16"):
                torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
                s(b, bf16)
        else:
            def run(s=step, b=batch, p="fp32" if mode == "fp32" else runs.resolve_precision("auto", device)):
                runs.set_matmul_precision(p)
                s(b)
        rows.append({"config": f"{family} {mode}", "family": family, "mode": mode, "batch": batch,
                     "flops_per_image": flops[family], "_run": run, "_timer": mfu.StepTimer(device)})
    return rows


def run_rows(rows, warmup, timed):
    """Warm-up steps per row (what the last one returns, if anything, kept as row['_images']), then `timed`
    interleaved rounds (ABCD ABCD ...). -> whether it was cut short."""
    try:  # cut short (Ctrl-C, or gpu_bench.sh's cap), the table still has what was measured
        for row in rows:  # warm-up, compilation included
            for _ in range(warmup):
                out = row["_run"]()
                if out is not None:
                    row["_images"] = out
            print(f"warmed up: {row['config']} b{row['batch']}", flush=True)
        for _ in range(timed):  # interleaved: ABCD ABCD ...
            for row in rows:
                row["_timer"].start()
                row["_run"]()
                row["_timer"].stop()
    except KeyboardInterrupt:
        print("\ninterrupted: the configurations with timed steps so far follow")
        return True
    return False


def profile_rows(rows, device):
    """--profile: two more steps of each row under torch.profiler (mfu.kernel_profile), as row['profile'];
    one line each. -> whether it was cut short."""
    from machinery import mfu

    try:
        for row in rows:
            row["profile"] = mfu.kernel_profile(row["_run"], device, steps=2)
            print(f"profile {row['config']} b{row['batch']}: {mfu.profile_line(row['profile'])}", flush=True)
    except KeyboardInterrupt:
        print("\ninterrupted while profiling: the rows profiled so far keep their profile")
        return True
    return False


def summarize(rows, peak, theirs):
    """-> the rows with timed steps, each with its median step, img/s, TFLOP/s, MFU and ratios to theirs."""
    rows = reporting.timed_medians(rows, peak)
    reporting.against_theirs(rows, theirs, lambda t, ref, o: (t["mode"], t["batch"]) == (ref, o["batch"]))
    return rows


def report(args, rows, flops, peak, gpu, theirs):
    """The counts line and the table."""
    what = "datasheet" if gpu else "measured matmul"
    print(f"\ncounted GFLOP per training image: theirs {flops['theirs'] / 1e9:.2f}, "
          f"ours {flops['ours'] / 1e9:.2f}; MFU against {peak / 1e12:.3g} TFLOP/s bf16 ({what}); "
          f"median of up to {args.timed} interleaved steps after {args.warmup} warm-up\n")
    print(reporting.table(
        ["config", "batch", "median ms/step (min-max)", "img/s", "TFLOP/s", "MFU (bf16)",
         *(f"ours / theirs {m}" for m in theirs)],
        [[r["config"], f"{r['batch']}", reporting.spread(r, 1), f"{r['img_per_s']:.1f}", f"{r['tflops']:.2f}",
          f"{100 * r['mfu_bf16']:.1f}%", *reporting.ratio_cells(r, theirs)] for r in rows]))


def save(args, env, interrupted, peak, rows, **fields):
    """Every measurement to --json (when given), created fresh and renamed into place: env, then `fields`
    (what the run was: its dropout, ...), then the timing settings and the rows."""
    if args.json:
        reporting.write_json(args.json, {**env, **fields, "warmup": args.warmup, "timed": args.timed,
                                         "interrupted": interrupted, "peak_bf16_tflops": peak / 1e12,
                                         "rows": rows})


def main(argv=None):
    with errors.reported():  # a bad argument: one error line
        args, batches, ours, theirs = parse_args(argv)
    if not cpu_timing.importable("diffusers", "carry its wheel (scripts/gpu_bench.sh)"):
        return None
    with errors.reported():
        device = open_device(args.device)
        env = environment(device)
        flops = {"theirs": count_theirs(), "ours": count_ours()[0]}
        peak = peak_flops(device)
        rows = build_rows(args, batches, ours, theirs, device, flops)
        interrupted = run_rows(rows, args.warmup, args.timed)
        if args.profile and not interrupted:
            interrupted = profile_rows(rows, device)
        rows = summarize(rows, peak, theirs)
        report(args, rows, flops, peak, device.type == "cuda", theirs)
        save(args, env, interrupted, peak, rows, dropout=args.dropout)
    if interrupted:
        sys.exit(130)
    return rows


if __name__ == "__main__":
    main()

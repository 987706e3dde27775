"""Sampling speed on a GPU, side by side: our sampler eager, compiled and as CUDA graphs, against diffusers'
DDIMPipeline on the very same network and weights (issue 25).

    python scripts/gpu_vs_diffusers_sampling.py --json gpu_sampling.json      # one GPU
    python scripts/gpu_vs_diffusers_sampling.py --device cpu --base_channels 64 --batch 2 --steps 2 \\
        --ours eager,graphed --warmup 1 --timed 1                              # the plumbing, on a CPU

The rows are scripts/cpu_vs_diffusers_sampling.py's, built on --device. Theirs: DDIMPipeline (eta 0, linear
betas, 1000 steps) with UNet2DModel in fp32 ('fp32') or under bf16 autocast ('bf16'). Ours: sample.py's
network (sampling.sampling_network: bf16 weights under autocast, --precision=auto) and ddpm.sample's DDIM,
each image's noise from its own generator, with sample.py's --compile false ('eager'), default
('compiled') or reduce-overhead ('graphed': the whole sampler step replayed as CUDA graphs); 'fp32 eager' and
'fp32 graphed' in fp32. One timed step = one batch of --batch images through --steps steps, ending in uint8
images on the host. Ho et al.'s CIFAR-10 network (35.7M parameters at --base_channels 128).

Timing: --warmup untimed steps per row (compiling and graph capture included), then --timed rounds that
interleave the rows, each timed by mfu.StepTimer (CUDA events on a GPU); the median. Each compiled or graphed
row's images are compared with its precision's eager row (the same noise): bitwise identical, or the share
of uint8 values that differ, their mean and largest difference in levels (at DDIM's first steps
x̂₀ = (z - √(1-ᾱ) ε̂)/√ᾱ magnifies rounding by up to 1/√ᾱ_T ≈ 156: a pixel near the clipping edge can flip).
Issue 25's GPU target: ours >= 2x theirs in the same precision. Without diffusers it prints one line and
exits 0.
"""
import argparse
import sys

import cpu_timing  # puts the repository root on sys.path
import reporting
from cpu_vs_diffusers import parse_list
from cpu_vs_diffusers_sampling import build_ours, build_theirs, networks
from gpu_vs_diffusers import environment, open_device, peak_flops, profile_rows, run_rows, save
from machinery import errors

import numpy as np

# ours: name -> (precision, sample.py --compile)
OURS = {"eager": ("auto", "false"), "compiled": ("auto", "default"), "graphed": ("auto", "reduce-overhead"),
        "fp32 eager": ("fp32", "false"), "fp32 graphed": ("fp32", "reduce-overhead")}
THEIRS = ("fp32", "bf16")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (to test the plumbing)")
    p.add_argument("--batch", default="256", help="batch sizes, comma-separated")
    p.add_argument("--steps", type=int, default=10, help="DDIM steps (network evaluations per image)")
    p.add_argument("--base_channels", type=int, default=128, help="the network's width (Ho's: 128)")
    p.add_argument("--ours", default="eager,graphed,compiled", help=f"comma-separated: {', '.join(OURS)}")
    p.add_argument("--theirs", default="bf16,fp32", help=f"comma-separated: {', '.join(THEIRS)}")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per row (compiling too)")
    p.add_argument("--timed", type=int, default=10, help="timed, interleaved rounds")
    p.add_argument("--json", help="write every measurement to this file")
    p.add_argument("--profile", action="store_true",
                   help="then profile two more batches of each row: its GPU time's share per kind of kernel")
    args = p.parse_args(argv)
    args.batches = parse_list(args.batch, int, "--batch")
    args.ours = parse_list(args.ours, str, "--ours", OURS)
    args.theirs = parse_list(args.theirs, str, "--theirs", THEIRS)
    if args.warmup < 1 or args.timed < 1 or min(args.batches) < 1 or not 1 <= args.steps <= 1000:
        raise errors.UserError("need --warmup >= 1, --timed >= 1, batches >= 1 and --steps in [1, 1000]")
    if not 64 <= args.base_channels <= 1024 or args.base_channels % 32:  # 32 groups in every GroupNorm
        raise errors.UserError("--base_channels must be a multiple of 32 in [64, 1024] (diffusers' "
                               "UNet2DModel has one GroupNorm group count)")
    return args


def build_rows(args, device):
    """One row per batch and configuration, theirs first, each with its step (`_run`) and StepTimer."""
    import unet
    from machinery import mfu, runs

    ours_net, theirs_net, mc = networks(base_channels=args.base_channels)
    theirs_net.to(device)
    flops = mfu.forward_flops_per_image(unet.UNet, mc) * args.steps
    rows = []
    for batch in args.batches:
        for mode in args.theirs:
            run = build_theirs(theirs_net, "ddim", mode == "bf16", batch, args.steps, device)
            rows.append({"config": f"theirs {mode}", "family": "theirs", "precision": mode, "batch": batch,
                         "_run": run})
        for name in args.ours:
            precision, compile = OURS[name]
            precision = runs.resolve_precision(precision, device)
            run = build_ours(ours_net, mc, "ddim", precision, batch, args.steps, compile, device)
            rows.append({"config": f"ours {name}", "family": "ours", "precision": precision, "batch": batch,
                         "compile": compile, "_run": run})
    for row in rows:
        row.update(flops_per_image=flops, _timer=mfu.StepTimer(device))
    return rows, flops


def same_images(rows):
    """Each compiled or graphed row's images against its precision's eager row's, same batch."""
    for row in rows:
        eager = [r for r in rows if r["family"] == "ours" and r.get("compile") == "false" and "_images" in r
                 and (r["precision"], r["batch"]) == (row["precision"], row["batch"])]
        if row.get("compile", "false") == "false" or not eager or "_images" not in row:
            continue
        diff = np.abs(row["_images"].astype(np.int16) - eager[0]["_images"].astype(np.int16))
        row.update(identical_to_eager=bool(diff.max() == 0), max_diff_levels=int(diff.max()),
                   mean_diff_levels=float(diff.mean()), share_differing=float((diff > 0).mean()))


def summarize(rows, peak):
    """-> the rows with timed steps: median step, img/s, TFLOP/s, MFU, ratios to theirs in each precision."""
    same_images(rows)
    for row in rows:
        row.pop("_images", None)
    rows = reporting.timed_medians(rows, peak)
    reporting.against_theirs(rows, THEIRS,
                             lambda t, ref, o: (t["precision"], t["batch"]) == (ref, o["batch"]))
    return rows


def report(args, rows, flops, peak):
    print(f"\ncounted GFLOP per image: {flops / 1e9:.1f} ({args.steps} DDIM steps); MFU against "
          f"{peak / 1e12:.3g} TFLOP/s bf16; median of up to {args.timed} interleaved batches after "
          f"{args.warmup} warm-up\n")
    lines = []
    for r in rows:
        same = ("identical" if r.get("identical_to_eager") else
                f"{100 * r['share_differing']:.2f}% differ, mean {r['mean_diff_levels']:.3f} levels, "
                f"max {r['max_diff_levels']}"
                if "max_diff_levels" in r else "")
        lines.append([r["config"], f"{r['batch']}", reporting.spread(r, 1), f"{r['img_per_s']:.1f}",
                      f"{r['tflops']:.2f}", f"{100 * r['mfu_bf16']:.1f}%", *reporting.ratio_cells(r, THEIRS),
                      same])
    print(reporting.table(["config", "batch", "median ms/batch (min-max)", "img/s", "TFLOP/s", "MFU (bf16)",
                           *(f"ours / theirs {m}" for m in THEIRS), "images against eager"], lines))


def main(argv=None):
    with errors.reported():  # a bad argument: one error line
        args = parse_args(argv)
    if not cpu_timing.importable("diffusers", "carry its wheel (scripts/gpu_bench.sh)"):
        return None
    with errors.reported():
        device = open_device(args.device)
        env = environment(device)
        peak = peak_flops(device)
        rows, flops = build_rows(args, device)
        interrupted = run_rows(rows, args.warmup, args.timed)
        if args.profile and not interrupted:
            interrupted = profile_rows(rows, device)
        rows = summarize(rows, peak)
        report(args, rows, flops, peak)
        save(args, env, interrupted, peak, rows, steps=args.steps, base_channels=args.base_channels,
             dropout=0.0)  # sampling runs without dropout
    if interrupted:
        sys.exit(130)
    return rows


if __name__ == "__main__":
    main()

"""The efficiency ladder: training throughput and MFU, one optimisation added per row.

    # preset 'seed' on the current device (the reference repo's UNet)
    python benchmark.py
    python benchmark.py --preset ho --json ho.json
    # a reduced ladder: small batches and iteration counts (~2 min)
    python benchmark.py --device cpu
    python benchmark.py --loaders /path/to/cifar10-jpeg/train   # FFCV against the torch DataLoader, img/s

Rows, each adding one change to the row above (a skipped or failed row adds nothing):
  baseline (fp32, batch 128, eager, math attention, NCHW, a typical torch DataLoader) -> scale up batch
  -> PyTorch SDPA -> bf16 autocast -> channels_last -> torch.compile -> FFCV loading
  -> device-resident data (the whole dataset on the device, against FFCV) -> compile max-autotune
  (--autotune) -> CUDA graphs (compile mode reduce-overhead) -> patch_size Q (--patch_size, 2; the preset's
  attention resolutions r become r * P / Q, benchmark.repatched).
Rows that vary the row above them alone, not carried on: fp16 autocast with loss scaling (for GPUs without
bf16), grad accumulation x4 (the same batch as 4 micro-batches), activation checkpointing at the same batch
and at the largest batch that fits, and the largest batch at patch size Q: against the largest batch of the
scaled-up rows, the paper's memory claim. Largest-batch rows search on a GPU only.

Every row builds its run with `ddpm.build` (the row's settings as a TrainerConfig) and times the training
step that ddpm.py runs (`ddpm.iteration`, data loading included), with CUDA events on a GPU
(mfu.StepTimer): the median over `--iters` iterations after `--warmup` (compilation and warm-up stay off
the clock). FLOPs are counted by torch.utils.flop_counter (mfu.train_flops_per_image, attention included);
the torchinfo x 3 column is the reference repo's estimate, which misses the attention matmuls. MFU =
counted FLOP/s / peak: the datasheet peak for the row's precision (A100/H100/H200; fp32 rows use the
non-tensor-core fp32 peak) and the matmul rate measured on the device in the row's dtype.

    python benchmark.py --sample --preset lsun-p4 --patch_sizes 1,2,4,8   # sampling speed at each P

--sample: images/s, s/image, network evaluations per image and per second, counted GFLOP per image and peak
memory of the preset's sampler (its steps, guidance and thresholding), the preset rebuilt at each Q, as
sample.py reports them. Any ModelConfig field as --field=value changes the preset's network, as in ddpm.py
(--patch_size is benchmark.py's own: the rows' Q); with --sample, so do --sampler=, --guidance= and
--threshold=. The rest of TrainerConfig is what the rows set, and is refused.

Measured (2026-12-02, seed, reduced ladder, medians of 3 runs): on 2 AVX512-BF16 CPU cores SDPA 2.51x and
SDPA + bf16 3.05x the baseline's TFLOP/s; on 2 AVX2 cores SDPA 2.24x and SDPA + channels_last 2.45x. Every
result with its machine and date is in BENCHMARKS.md.
"""
import argparse
import datetime
import json
import os
import statistics
import sys

import torch

import data
import ddpm
import sampling
import unet
from ladder import TYPICAL_TRANSFORM, InMemoryPIL, free_memory, ladder, repatched
from machinery import errors, files, group, mfu, runs

# -----------------------------------------------------------------------------
# The loader benchmark (--loaders): FFCV against the torch DataLoader


def loader_bench(folder, image_size=32, batch_size=512, num_workers=2, epochs=3, beton_dir=data.BETON_DIR):
    """Images/s of FFCV against the torch DataLoader on the same images, augmentation and workers.

    Each loader runs `epochs` epochs; the first (worker start-up, FFCV's numba JIT) is reported
    apart, the rate is the median of the rest. Every loader ends with [-1, 1] float batches with
    random horizontal flips, on the CPU.
    """
    import time

    import torchvision

    def torch_epochs(ds):
        dl = torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=num_workers,
                                         drop_last=True)
        return [timed(lambda: iter(dl), len(dl)) for _ in range(epochs)]

    def ours_epochs(loader):
        per_epoch = loader.n // loader.batch_size
        return [timed(lambda: (loader.next() for _ in range(per_epoch)), per_epoch) for _ in range(epochs)]

    def timed(make_iter, n_batches):
        t = time.perf_counter()
        for _ in make_iter():
            pass
        return n_batches * batch_size / (time.perf_counter() - t)

    t = time.perf_counter()
    images, labels, _ = data.image_folder(folder, image_size)
    print(f"decoded {len(images)} images in {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    path, _ = data.beton_for("folder", folder, image_size, beton_dir)
    print(f"beton ready in {time.perf_counter() - t:.1f} s: {path}")
    rows = {
        "torch DataLoader, ImageFolder (JPEG decode + per-sample transforms)":
            torch_epochs(torchvision.datasets.ImageFolder(folder, transform=TYPICAL_TRANSFORM())),
        "torch DataLoader, uint8 arrays in memory + per-sample transforms (as torchvision CIFAR10)":
            torch_epochs(InMemoryPIL(images, labels)),
        "ddpm Loader (uint8 tensor in memory, batched gather)":
            ours_epochs(data.Loader(images, labels, batch_size, 0, "cpu")),
        "ddpm FFCVLoader (.beton, raw pixels)":
            ours_epochs(data.FFCVLoader(path, batch_size, 0, "cpu", num_workers=num_workers)),
    }
    base = statistics.median(
        rows["torch DataLoader, uint8 arrays in memory + per-sample transforms (as torchvision CIFAR10)"][1:])
    print(f"\n{len(images)} images {image_size}px, batch {batch_size}, {num_workers} workers, "
          f"{epochs} epochs each, {os.cpu_count()} CPUs\n")
    print("| loader | first epoch img/s | img/s (median of later epochs) | vs in-memory DataLoader |\n"
          "|---|---|---|---|")
    for name, rates in rows.items():
        med = statistics.median(rates[1:])
        print(f"| {name} | {rates[0]:,.0f} | {med:,.0f} | {med / base:.2f}x |")
    return rows


# -----------------------------------------------------------------------------
# Sampling speed (--sample)

SAMPLING_FIELDS = {"sampler", "guidance", "threshold"}  # TrainerConfig fields --sample takes as --field=value


def sampling_table(mc, tc, device, patch_sizes, batch, steps):
    """Sampling speed of the preset rebuilt at each patch size Q (benchmark.repatched: the same widths,
    attention over the same image regions), with its sampler, guidance and thresholding: what sample.py
    reports, per Q, plus the counted forward FLOPs per image. Random weights (speed does not depend on them),
    eager, under the autocast sample.py uses. One untimed 2-step warm-up per Q; the clock stops after the
    device has finished. -> (rows, whether it was cut short)."""
    precision = runs.resolve_precision("auto", device)
    rows, interrupted = [], False
    for q in patch_sizes:
        mcq = repatched(mc, q)
        try:
            ddpm.validate(mcq, tc)
        except errors.UserError as e:
            print(f"P = {q}: {e}")
            rows.append({"patch_size": q, "skipped": str(e)})
            continue
        try:
            speed = sampling.time_sampling(mcq, tc, device, precision, batch, steps)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            reason = f"failed: {type(e).__name__}: {errors.first_line(e)[:200]}"
            print(f"P = {q}: {reason}")
            rows.append({"patch_size": q, "skipped": reason})
            free_memory(device)
            continue
        except KeyboardInterrupt:  # Ctrl-C, or gpu_bench.sh's cap: the table of the sizes measured so far
            interrupted = True
            print(f"\ninterrupted at P = {q}: the table has the patch sizes before it")
            break
        free_memory(device)
        row = {"patch_size": q, "batch": batch, "sampler": tc.sampler, "steps": steps or mcq.timesteps,
               "guidance": tc.guidance, "threshold": tc.threshold, "autocast": precision, **speed,
               "gflop_per_image": mfu.forward_flops_per_image(unet.UNet, mcq) * speed["nfe_per_image"] / 1e9}
        rows.append(row)
        print(f"P = {q}: {row['img_per_s']:.3g} img/s, {row['s_per_img']:.3g} s/image, "
              f"{row['gflop_per_image']:,.1f} GFLOP/image", flush=True)
    print_sampling_table(rows)
    return rows, interrupted


def print_sampling_table(rows):
    """The table; each measured row is given its speedup and FLOPs ratio against P = 1 (or the first
    measured)."""
    measured = [r for r in rows if "skipped" not in r]
    base = next((r for r in measured if r["patch_size"] == 1), measured[0] if measured else None)
    print(f"\n| P | batch | steps | img/s | s/image | NFE/image | NFE/s | GFLOP/image | img/s vs P = "
          f"{base['patch_size'] if base else 1} | FLOPs ratio | peak memory |\n" + "|---" * 11 + "|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['patch_size']} | skipped: {r['skipped']} | | | | | | | | | |")
            continue
        r["speedup"] = r["img_per_s"] / base["img_per_s"]
        r["flops_ratio"] = base["gflop_per_image"] / r["gflop_per_image"]
        mem = f"{r['peak_memory_bytes'] / 2**30:.2f} GB" if r["peak_memory_bytes"] is not None else "n/a"
        print(f"| {r['patch_size']} | {r['batch']} | {r['steps']} | {r['img_per_s']:.3g} | "
              f"{r['s_per_img']:.3g} | {r['nfe_per_image']:.0f} | {r['nfe_per_s']:.3g} | "
              f"{r['gflop_per_image']:,.1f} | {r['speedup']:.2f}x | {r['flops_ratio']:.2f}x | {mem} |")


def sampling_command(args, overrides, mc, tc, device, patch_sizes):
    """--sample: the table at each of --patch_sizes, written to --json (also when cut short).
    -> (rows, whether it was cut short)."""
    name = mfu.device_name(device)
    print(f"# sampling, {args.preset} at P = {args.patch_sizes}, on {name}, "
          f"torch {torch.__version__}, {datetime.date.today()}\n")
    steps = tc.sample_steps if args.sample_steps < 0 else args.sample_steps
    batch = args.sample_batch or (64 if device.type == "cuda" else 2)
    rows, interrupted = sampling_table(mc, tc, device, patch_sizes, batch, steps)
    if args.json:
        with files.created(args.json, "w") as f:
            json.dump({"preset": args.preset, "overrides": overrides, "device": name,
                       "torch": torch.__version__, "date": str(datetime.date.today()),
                       "interrupted": interrupted, "rows": rows}, f, indent=2)
    return rows, interrupted


# -----------------------------------------------------------------------------
# The command line


def parser():
    p = argparse.ArgumentParser(description="The efficiency ladder with MFU. Any ModelConfig --field=value "
                                            "changes the preset's network, as in ddpm.py (--patch_size is "
                                            "benchmark.py's own); with --sample also --sampler=, "
                                            "--guidance=, --threshold=.",
                                allow_abbrev=False)
    p.add_argument("--preset", default="seed", choices=list(ddpm.PRESETS))
    p.add_argument("--device", default="auto", help="'auto', 'cuda', 'cpu', ...")
    p.add_argument("--batch", type=int, default=0,
                   help="batch for the scaled-up rows; 0 = search the largest that fits (GPU)")
    p.add_argument("--base_batch", type=int, default=0, help="baseline batch; 0 = 128 on a GPU, 4 on the CPU")
    p.add_argument("--iters", type=int, default=0,
                   help="timed iterations per row; 0 = 50 on a GPU, 3 on the CPU")
    p.add_argument("--warmup", type=int, default=0,
                   help="untimed iterations per row (compilation included); 0 = 10 on a GPU, 1 on the CPU")
    p.add_argument("--max_batch", type=int, default=16384, help="upper limit of the batch search")
    p.add_argument("--skip", default="", help="comma-separated row names to skip, e.g. 'torch.compile'")
    p.add_argument("--rows", default="", help="comma-separated row names to run, the rest skipped; '' = all")
    p.add_argument("--start", default="",
                   help="the row to start at: the rows above it are not run, their settings taken as given "
                        "(the batch is --batch, or the baseline's until a row searches)")
    p.add_argument("--profile", action="store_true",
                   help="also profile 3 more iterations of each measured row: the share of its time in "
                        "matmuls and convolutions, attention, fused kernels, the optimizer, ...")
    p.add_argument("--patch_size", type=int, default=2,
                   help="P of the last row, compared with P = 1 at the same width and batch")
    p.add_argument("--cpu_compile", action="store_true", help="also run the torch.compile row on the CPU")
    p.add_argument("--autotune", action="store_true",
                   help="also run the compile max-autotune row (many minutes of compiling)")
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--loaders", metavar="DIR", default="",
                   help="instead of the ladder: FFCV against the torch DataLoader on an image folder, img/s")
    p.add_argument("--loader_batch", type=int, default=512, help="--loaders: batch size")
    p.add_argument("--loader_workers", type=int, default=2, help="--loaders: worker threads/processes")
    p.add_argument("--epochs", type=int, default=3,
                   help="--loaders: epochs per loader (the first reported apart)")
    p.add_argument("--sample", action="store_true",
                   help="instead of the ladder: sampling speed at each of --patch_sizes, as sample.py has it")
    p.add_argument("--patch_sizes", default="1,2,4,8", help="--sample: the patch sizes Q, comma-separated")
    p.add_argument("--sample_batch", type=int, default=0,
                   help="--sample: images per batch; 0 = 64 on a GPU, 2 on the CPU")
    p.add_argument("--sample_steps", type=int, default=-1,
                   help="--sample: sampler steps; 0 = all T; -1 = the preset's sample_steps")
    return p


def loaders(args):
    """--loaders: the loader benchmark on an image folder."""
    for name in ("loader_batch", "loader_workers", "epochs"):
        if getattr(args, name) < 1:
            raise errors.UserError(f"--{name} {getattr(args, name)}: must be >= 1")
    return loader_bench(args.loaders, 32, args.loader_batch, args.loader_workers, args.epochs)


def checked(args, overrides):
    """The ladder's and --sample's arguments, checked before minutes of measuring.
    -> (device, ModelConfig, TrainerConfig, the patch sizes of --sample)."""
    for name in ("batch", "base_batch", "iters", "warmup", "max_batch", "patch_size"):
        lo = 1 if name in ("max_batch", "patch_size") else 0
        if getattr(args, name) < lo:
            raise errors.UserError(f"--{name} {getattr(args, name)}: must be >= {lo}")
    if args.json:
        folder = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK) or os.path.isdir(args.json):
            raise errors.UserError(f"--json {args.json}: cannot write there (does its folder exist?)")
    device = group.resolve_device(args.device)
    # the rows set how the step runs; what the preset may change is the network and, for --sample, how it
    # samples
    allowed = set(ddpm.ModelConfig.__dataclass_fields__) | (SAMPLING_FIELDS if args.sample else set())
    for o in overrides:
        field = o[2:].partition("=")[0]
        if not o.startswith("--") or "=" not in o:
            raise errors.UserError(f"unrecognised argument {o}: preset fields are given as --field=value")
        if field in ddpm.TrainerConfig.__dataclass_fields__ and field not in allowed:
            also = ", ".join(sorted(SAMPLING_FIELDS))
            raise errors.UserError(f"--{field}: here only ModelConfig fields change the preset (with "
                                   f"--sample also {also}); the rows set the rest")
    mc, tc, _ = ddpm.parse_args(["--preset", args.preset, *overrides])
    patch_sizes = [q.strip() for q in args.patch_sizes.split(",")]
    if not all(q.isdigit() and int(q) >= 1 for q in patch_sizes):
        raise errors.UserError(f"--patch_sizes {args.patch_sizes}: give integers >= 1, e.g. 1,2,4,8")
    if args.sample_batch < 0 or not -1 <= args.sample_steps <= mc.timesteps:
        raise errors.UserError(f"--sample: need --sample_batch >= 0 and -1 <= --sample_steps <= "
                               f"timesteps = {mc.timesteps}")
    return device, mc, tc, [int(q) for q in patch_sizes]


def main(argv=None):
    """-> the rows measured. Bad arguments: one `error:` line, exit status 2; a ladder or table cut short
    (Ctrl-C, or `timeout -s INT`) prints and saves what it measured, then exits with 130."""
    args, overrides = parser().parse_known_args(argv)
    with errors.reported():
        if args.loaders:
            return loaders(args)
        device, mc, tc, patch_sizes = checked(args, overrides)
        if device.type != "cuda":
            mfu.keep_freed_memory()  # as train() does on a CPU (runs.set_up_cpu)
        if args.sample:
            rows, interrupted = sampling_command(args, overrides, mc, tc, device, patch_sizes)
        else:
            rows, interrupted = ladder(args, mc, device)
    if interrupted:
        sys.exit(130)  # an incomplete ladder or table is not a success
    return rows


if __name__ == "__main__":
    main()

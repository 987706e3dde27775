"""Training-step speed on the CPU, side by side: this repo against diffusers, on the very same network.

    # ~4 min on 2 AVX512-BF16 cores
    .venv/bin/python scripts/cpu_vs_diffusers.py --json cpu_vs_diffusers.json
    # both dropouts, 7 min (433 s)
    .venv/bin/python scripts/cpu_vs_diffusers.py --dropout 0.1,0 --json cpu_vs_diffusers.json
    # + torch.compile (3-5 min more)
    .venv/bin/python scripts/cpu_vs_diffusers.py --ours eager,compile

Without diffusers the script prints one line and exits 0 (diffusers is in requirements.txt, as a test
oracle).

The network: Ho et al.'s CIFAR-10 UNet (35.7M parameters), which is diffusers' UNet2DModel in the
google/ddpm-cifar10-32 configuration. Theirs is built from
unet.diffusers_config(UNet(ModelConfig(dropout=P))), so both sides compute the same function
(tests/test_diffusers.py checks the outputs agree in float64) with the same dropout P (--dropout; Ho's is 0.1,
ModelConfig's default; UNet2DModel's own default, and what a config.json without the field gives, is 0.0).
Configurations, all at 32x32, batches --batch, in one process, with torch.set_num_threads(--threads):
  theirs fp32       the step of diffusers' examples/unconditional_image_generation/train_unconditional.py:
                    DDPMScheduler(num_train_timesteps=1000, beta_schedule='linear'); noise = randn,
                    t = randint, noisy = scheduler.add_noise(clean, noise, t), model(noisy, t).sample,
                    F.mse_loss(pred.float(), noise.float()), backward, clip_grad_norm_(params, 1.0), AdamW(lr
                    1e-4, betas (0.95, 0.999), weight_decay 1e-6, eps 1e-8; torch's default implementation,
                    i.e. the per-tensor loop on a CPU), step, cosine LR scheduler step, zero_grad,
                    EMAModel(params, decay 0.9999, use_ema_warmup=True, inv_gamma 1.0, power
                    0.75).step(params) (its default foreach=False: a per-tensor loop), loss.item().
  theirs bf16       the same with --mixed_precision=bf16: the images and the noise in bf16 (the example's
                    weight_dtype), the forward under torch.autocast('cpu', bfloat16) with its output in fp32
                    (what accelerate wraps model.forward in), the loss outside it.
  ours eager        `python ddpm.py`'s defaults (compile auto: eager on a CPU): precision auto (bf16 autocast
                    on a CPU with AVX512-BF16/AMX, else fp32), channels_last auto (NCHW for bf16 on a CPU and
                    for an eager bf16 step on a GPU, else NHWC), SDPA, the model, EMA and fused optimizer
                    from ddpm.build, and per step what ddpm.train runs: ddpm.iteration (the LR into the
                    param groups, ddpm.train_step, the EMA at its warm-up decay where the step was applied).
  ours compile      the same with torch.compile (ddpm.py's default; minutes to compile on a CPU, in the
                    warm-up).
  ours fp32         ours eager with --precision=fp32 (and so NHWC).
Not timed on either side: the data loader (a fixed batch in [-1, 1]).

FLOPs are counted by torch.utils.flop_counter on a real forward + backward of each side's training loss at
batch 2 (per image = total / 2), with math attention in both (the counter does not see the CPU flash-SDPA
kernel). Counted GFLOP/s = counted FLOPs per step / median step time; the table gives it as a fraction of the
best square bf16 (and fp32) matmul rate measured by mfu.measure_matmul_flops before and after the timed steps
(the better of the two). Ratios ours/theirs are of img/s (= theirs' step time / ours), between rows of the
same batch and dropout.

Measured (2026-12-03, torch 2.14.1, diffusers 0.42.1; both 35.7M parameters and 37.32 counted GFLOP per
training image; 2 cores AMD EPYC with AVX512-BF16, 5 uncontended steps per row; every run in BENCHMARKS.md):
after issue 16's changes (the CPU dropout mask, glibc keeping freed memory, which in one process helps both
sides), ours eager (bf16, NCHW) 2099 ms/step at batch 16 and 4296 at 32 with dropout 0.1, 71-77% of the
measured bf16 matmul rate; ours / theirs bf16 1.03x-1.12x, ours / theirs fp32 1.81x-2.09x. Before them:
1.01x-1.15x and 1.80x-2.34x, 63-73%. Same network, same oneDNN convolutions (~1.8 s of the ~2.4 s step on both
sides, torch.profiler); theirs spends more in its per-tensor AdamW, its NHWC convolutions and GroupNorms after
each attention block, and casts.

Timing (scripts/cpu_timing.py, shared with cpu_vs_ddpm_pytorch.py): --warmup untimed steps per configuration
(compilation included), then --timed rounds that interleave the configurations (ABCABC...). Each step records
how many cores other processes kept busy meanwhile (/proc/stat minus this process's CPU time); a step with
others > --contended counts as contended: after --timed rounds, the configurations short of --timed
uncontended steps run again (within --budget_s), and the median is taken over the uncontended steps where
there are two or more, else over all of them (flagged in the table). Configurations of one side and dropout
(and, for ours, mode) share one model, optimizer and EMA (the batch and the autocast differ per step, the
weights' values do not matter to the time).
"""
import argparse
import itertools
import time

import cpu_timing
import reporting
from cpu_timing import CPU, count_flops
from cpu_vs_ddpm_pytorch import count_ours
from machinery import errors

import torch
import torch.nn.functional as F

IMAGE_SIZE = 32
OUR_MODES = ("eager", "compile", "fp32")
THEIR_MODES = ("fp32", "bf16")


def model_config(dropout):
    """ddpm.ModelConfig of the 'ho' preset (Ho et al.'s CIFAR-10 network) with this dropout."""
    import ddpm

    return ddpm.ModelConfig(dropout=dropout)


def their_config(dropout):
    """UNet2DModel's config for the same network: google/ddpm-cifar10-32's, with this dropout."""
    import unet

    config = unet.diffusers_config(unet.UNet(model_config(dropout)))
    return {k: v for k, v in config.items() if not k.startswith("_")}


# ----------------------------------------------------------------------------- theirs


def build_theirs(dropout, device=CPU):
    """-> step(batch, bf16) of train_unconditional.py's loop, and the parameter count."""
    from diffusers import DDPMScheduler, UNet2DModel
    from diffusers.optimization import get_scheduler
    from diffusers.training_utils import EMAModel

    torch.manual_seed(0)
    model = UNet2DModel(**their_config(dropout)).to(device).train()
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.95, 0.999), weight_decay=1e-6, eps=1e-8)
    lr_scheduler = get_scheduler("cosine", optimizer=opt, num_warmup_steps=500, num_training_steps=10**6)
    ema = EMAModel(model.parameters(), decay=0.9999, use_ema_warmup=True, inv_gamma=1.0, power=0.75,
                   model_cls=UNet2DModel, model_config=model.config)
    data = {}

    def step(batch, bf16):
        weight_dtype = torch.bfloat16 if bf16 else torch.float32
        if batch not in data:
            # Normalize([.5], [.5])
            data[batch] = torch.rand(batch, 3, IMAGE_SIZE, IMAGE_SIZE, device=device) * 2 - 1
        clean = data[batch].to(weight_dtype)
        noise = torch.randn(clean.shape, dtype=weight_dtype, device=clean.device)
        t = torch.randint(0, scheduler.config.num_train_timesteps, (batch,), device=clean.device).long()
        noisy = scheduler.add_noise(clean, noise, t)
        # accelerate's wrapper of forward
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            pred = model(noisy, t).sample
        loss = F.mse_loss(pred.float(), noise.float())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # accelerator.clip_grad_norm_ on one process
        opt.step()
        lr_scheduler.step()
        opt.zero_grad()
        ema.step(model.parameters())
        loss.detach().item()  # its progress-bar log, every step

    return step, sum(p.numel() for p in model.parameters())


def count_theirs():
    """Counted training FLOPs per image of UNet2DModel forward + backward of the MSE, math attention."""
    from diffusers import UNet2DModel
    from diffusers.models.attention_processor import Attention, AttnProcessor

    torch.manual_seed(0)
    model = UNet2DModel(**their_config(0.0))
    for m in model.modules():
        if isinstance(m, Attention):
            m.set_processor(AttnProcessor())  # baddbmm and softmax, not SDPA
    x, t = torch.rand(2, 3, IMAGE_SIZE, IMAGE_SIZE) * 2 - 1, torch.randint(0, 1000, (2,))
    return count_flops(lambda: F.mse_loss(model(x, t).sample, x).backward(), 2)


# ----------------------------------------------------------------------------- ours


def build_ours(dropout, mode, device=CPU):
    """-> step(batch) of ddpm.train's loop with `python ddpm.py`'s defaults (compile only in mode 'compile',
    precision fp32 in mode 'fp32'), on ddpm.build's model, EMA, optimizer and forward, and the parameter
    count."""
    import ddpm

    torch.manual_seed(0)
    mc = model_config(dropout)
    tc = ddpm.TrainerConfig(compile="true" if mode == "compile" else "false",
                            precision="fp32" if mode == "fp32" else "auto", channels_last="auto")
    b = ddpm.build(mc, tc, device)
    steps, data = itertools.count(), {}

    def step(batch):
        if batch not in data:
            data[batch] = torch.rand(batch, mc.channels, mc.image_size, mc.image_size, device=device) * 2 - 1
        ddpm.iteration(b, data[batch], None, tc, next(steps))  # what ddpm.train runs per step

    return step, sum(p.numel() for p in b.model.parameters())


# ----------------------------------------------------------------------------- main


def parse_list(spec, typ, name, choices=None):
    try:
        out = [typ(s.strip()) for s in spec.split(",") if s.strip()]
    except ValueError:
        what = f"expected a comma-separated list of {typ.__name__}"
        raise errors.UserError(f"{name} '{spec}': {what}") from None
    bad = [v for v in out if choices is not None and v not in choices]
    if not out or bad:
        raise errors.UserError(f"{name} '{spec}': expected one or more of "
                               f"{', '.join(map(str, choices or []))}")
    return out


def shared(cache, key, build):
    """One model, optimizer and EMA per side, dropout and mode, shared by its batches (and, for theirs,
    precisions)."""
    if key not in cache:
        cache[key] = build()
    return cache[key]


def parse_args(argv):
    """-> (args, batches, dropouts, our modes, their modes); a bad value exits with one `error:` line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="16,32", help="batch sizes, comma-separated")
    p.add_argument("--dropout", default="0.1",
                   help="dropout of both networks, comma-separated values (each one a pair of sides); "
                        "Ho's and ModelConfig's is 0.1, UNet2DModel's 0.0")
    p.add_argument("--ours", default="eager",
                   help=f"our configurations, comma-separated: {', '.join(OUR_MODES)}")
    p.add_argument("--theirs", default="fp32,bf16", help=f"their configurations: {', '.join(THEIR_MODES)}")
    p.add_argument("--glibc_default", action="store_true",
                   help="leave glibc's malloc as it is; by default the process keeps freed memory as "
                        "ddpm.py's training does (mfu.keep_freed_memory), which speeds up both sides alike")
    cpu_timing.add_args(p)
    args = p.parse_args(argv)
    batches = parse_list(args.batch, int, "--batch")
    dropouts = parse_list(args.dropout, float, "--dropout")
    ours_modes = parse_list(args.ours, str, "--ours", OUR_MODES)
    their_modes = parse_list(args.theirs, str, "--theirs", THEIR_MODES)
    return args, batches, dropouts, ours_modes, their_modes


def prepare(args):
    """Threads and malloc set, the header printed, the matmul peaks measured and the FLOPs counted ->
    (t_start, env, peaks32, peaks16, (theirs, ours, ours by mfu.train_flops_per_image))."""
    from machinery import mfu

    torch.set_num_threads(args.threads)
    kept = not args.glibc_default and mfu.keep_freed_memory()  # process-wide: theirs gains from it as well
    print(f"# glibc malloc: {'keeps freed memory (as ddpm.py trains)' if kept else 'its defaults'}",
          flush=True)
    t_start = time.time()
    env = cpu_timing.environment(args.threads, ("diffusers",))
    print(f"# {env['utc']} UTC · {env['cpu']}, {env['cores']} cores, {args.threads} threads · "
          f"torch {env['torch']} · "
          f"diffusers {env['diffusers']} · git {env['git']}", flush=True)
    peaks32, peaks16 = cpu_timing.measure_peaks()
    theirs_flops = count_theirs()
    ours_flops, ours_meta_flops = count_ours()
    cpu_timing.print_counts(env, peaks32, peaks16, theirs_flops, ours_flops, ours_meta_flops)
    return t_start, env, peaks32, peaks16, (theirs_flops, ours_flops, ours_meta_flops)


def build_rows(args, batches, dropouts, ours_modes, their_modes, flops):
    """One row per batch, dropout and configuration (cpu_timing's rows), theirs first."""
    from machinery import runs

    cache, rows = {}, []

    def add(family, mode, dropout, batch, precision, build):
        rows.append({"config": f"{family} {mode}", "family": family, "mode": mode, "dropout": dropout,
                     "batch": batch, "precision": precision,
                     "flops_per_image": flops[0] if family == "theirs" else flops[1],
                     "timed": args.timed, "warmup": args.warmup, "_build": build})

    for batch, dropout in itertools.product(batches, dropouts):
        for mode in their_modes:
            def build(b=batch, d=dropout, bf16=mode == "bf16"):
                step, n = shared(cache, ("theirs", d), lambda: build_theirs(d))
                return (lambda: step(b, bf16)), n
            add("theirs", mode, dropout, batch, mode, build)
        for mode in ours_modes:
            def build(b=batch, d=dropout, m=mode):
                step, n = shared(cache, ("ours", d, m), lambda: build_ours(d, m))
                return (lambda: step(b)), n
            add("ours", mode, dropout, batch,
                "fp32" if mode == "fp32" else runs.resolve_precision("auto", CPU), build)
    for row in rows:
        row["config"] += f" p{row['dropout']:g} b{row['batch']}"
    return rows


def compare(rows, their_modes, peak16):
    """Each row's fraction of the bf16 peak, and ours against theirs of the same batch and dropout
    -> ratios."""
    for row in rows:
        row["frac_of_bf16_peak"] = row["gflops"] * 1e9 / peak16
    pairs = reporting.against_theirs(rows, their_modes, lambda theirs, ref, ours: (
        theirs["mode"], theirs["batch"], theirs["dropout"]) == (ref, ours["batch"], ours["dropout"]))
    return {f"{ours['config']} / {theirs['config']}": reporting.ratio_entry(ours, theirs)
            for ours, _, theirs in pairs}


def report(args, rows, their_modes, t_start, peaks32, peaks16, flops):
    """The peaks and counts line, and the table."""
    peak32, peak16 = max(peaks32), max(peaks16)
    print(f"\nmeasured matmul peak (best of start and end): bf16 {peak16 / 1e9:.1f} GFLOP/s "
          f"({', '.join(f'{v / 1e9:.1f}' for v in peaks16)}), fp32 {peak32 / 1e9:.1f} GFLOP/s "
          f"({', '.join(f'{v / 1e9:.1f}' for v in peaks32)}); median of the uncontended timed steps "
          f"(others <= {args.contended} cores); 'others' = cores other processes kept busy, median over all "
          f"timed steps; "
          f"counted GFLOP/image: theirs {flops[0] / 1e9:.2f}, ours {flops[1] / 1e9:.2f}; "
          f"total wall {time.time() - t_start:.0f} s\n")
    lines = []
    for row in rows:
        frac = f"{100 * row['frac_of_bf16_peak']:.0f}% of bf16"
        if row["precision"] == "fp32":
            frac += f", {100 * row['frac_of_fp32_peak']:.0f}% of fp32"
        lines.append([f"{row['family']} {row['mode']}", f"{row['dropout']:g}", f"{row['batch']}",
                      reporting.spread(row), cpu_timing.steps_used(row), f"{row['img_per_s']:.2f}",
                      f"{row['gflops']:.1f}", frac, *reporting.ratio_cells(row, their_modes),
                      f"{row['other_cores_median']:.2f}"])
    print(reporting.table(["config", "dropout", "batch", "median ms/step (min-max)", "steps used", "img/s",
                           "counted GFLOP/s", "of measured matmul peak",
                           *(f"ours / theirs {m} (img/s)" for m in their_modes), "others"], lines))


def main(argv=None):
    with errors.reported():  # a bad argument: one error line
        args, batches, dropouts, ours_modes, their_modes = parse_args(argv)
    if not cpu_timing.importable("diffusers", "pip install diffusers"):
        return None
    with errors.reported():
        t_start, env, peaks32, peaks16, flops = prepare(args)
        rows = build_rows(args, batches, dropouts, ours_modes, their_modes, flops)
        cpu_timing.warm_up(rows)
        cpu_timing.run_interleaved(rows, args.contended, args.budget_s)
        peaks32, peaks16 = cpu_timing.summarize(rows, args.contended, peaks32, peaks16)
        ratios = compare(rows, their_modes, max(peaks16))
        report(args, rows, their_modes, t_start, peaks32, peaks16, flops)
        cpu_timing.finish(args, t_start, env, peaks32, peaks16, flops, rows, ratios=ratios)
    return rows


if __name__ == "__main__":
    main()

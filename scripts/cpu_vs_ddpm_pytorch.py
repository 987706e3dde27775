"""Training-step FLOP/s on the CPU, side by side: this repo against denoising-diffusion-pytorch (lucidrains).

    pip install --no-deps denoising-diffusion-pytorch einops ema-pytorch accelerate pytorch-fid
    pip install --no-deps safetensors pyyaml
    # ~3 min on 2 AVX512-BF16 cores
    .venv/bin/python scripts/cpu_vs_ddpm_pytorch.py --json cpu_vs_ddpm_pytorch.json
    # fp32 only (on CPUs without bf16)
    .venv/bin/python scripts/cpu_vs_ddpm_pytorch.py --ours eager:16,cl:16 --no_bf16

(Minutes more with a 'compile' configuration: the first torch.compile of the UNet takes 3-5 min on 2 cores;
and contention from other processes lengthens a run by up to --budget_s.)

(--no-deps each time, so the installed torch is never replaced.) Without denoising_diffusion_pytorch the
script prints one line and exits 0.

Configurations, all at 32x32 (CIFAR-10), in one process, with torch.set_num_threads(--threads):
  theirs fp32       Unet(dim=64, dim_mults=(1, 2, 4, 8), flash_attn=True) and GaussianDiffusion(image_size=32,
                    timesteps=1000) as in the package README (its defaults: pred_v, sigmoid schedule), trained
                    as its Trainer's defaults do: batch 16, amp=False, Adam(lr 1e-4, betas (0.9, 0.99)),
                    loss.item() every step, clip_grad_norm_ 1.0, opt.step, zero_grad, ema_pytorch.EMA(beta
                    0.995, update_every 10).update(). Not timed: its DataLoader (ours is not timed either).
  theirs fp32+cl    the same with the model and input in channels_last.
  theirs bf16+cl    the same under torch.autocast('cpu', bfloat16) (what Trainer(amp=True,
                    mixed_precision_type='bf16') does on a CPU); without AVX512-BF16/AMX, where bf16 is
                    emulated and slow, with fewer timed steps (--bf16_timed).
  ours MODE:BATCH   ddpm.iteration (train()'s step) on UNet(ModelConfig()) (Ho et al., 35.7M, dropout 0.1),
                    SDPA, the model, EMA and fused optimizer of ddpm.build. MODE is eager (fp32, NCHW) or
                    any of cl (channels_last), bf16 (autocast, as --precision=bf16) and compile
                    (torch.compile(model)) joined by '+', e.g. bf16+cl.

FLOPs are counted by torch.utils.flop_counter on a real forward + backward of each package's training loss on
the CPU at batch 2 (per image = total / 2), with math attention in both, because the counter does not see the
CPU flash-SDPA kernel (the counted model is otherwise identical to the timed one). FLOP/s = counted FLOPs per
step / median step time; "of peak" is against the best square fp32 (or bf16) matmul rate
(mfu.measure_matmul_flops), measured before and after the timed steps, the better of the two. Without bf16
hardware, oneDNN's bf16 convolutions (~7 GFLOP/s on an AVX2 CPU) outrun its emulated bf16 matmul (~1.3
GFLOP/s), so the bf16 row's fraction of the bf16 peak can pass 100%; its fraction of the fp32 peak is printed
beside it.

Measured (2026-12-02, torch 2.14.1, denoising-diffusion-pytorch 2.3.4; both models 35.7M parameters; theirs
10.9, ours 37.3 counted GFLOP per training image; every run in BENCHMARKS.md):
  2 cores AMD EPYC with AVX512-BF16, four runs: theirs fp32 104-131 GFLOP/s, theirs bf16+cl 155-178; ours
  bf16 (NCHW) 265-300 at batch 16 and 277-308 at batch 32, ours fp32 (channels_last) 164-175: ours bf16 b32
  2.52-2.95x theirs fp32 (goal 2.5x; b16 2.29-2.57x), our best 1.69-1.84x theirs bf16+cl (goal 1.2x).
  2 cores AMD EPYC AVX2 only, two runs: theirs fp32 52-54, theirs bf16+cl 5.6 (emulated); ours fp32 73-80:
  1.4-1.5x theirs fp32.

Timing (scripts/cpu_timing.py, shared with cpu_vs_diffusers.py): --warmup untimed steps per configuration
(compilation included; its time is printed), then --timed rounds that interleave the configurations
(ABCABC...). Each step records how many cores other processes kept busy meanwhile (/proc/stat minus this
process's CPU time); a step with others > --contended counts as contended: after --timed rounds, the
configurations short of --timed uncontended steps run again (within --budget_s), and the median is taken over
the uncontended steps where there are two or more, else over all of them (flagged in the table).
"""
import argparse
import itertools
import time

import cpu_timing
import reporting
from cpu_timing import CPU, count_flops
from machinery import errors

import torch

IMAGE_SIZE = 32


# ----------------------------------------------------------------------------- theirs


def build_theirs(batch, channels_last, bf16, flash=True):
    from denoising_diffusion_pytorch import GaussianDiffusion, Unet
    from ema_pytorch import EMA

    torch.manual_seed(0)
    unet = Unet(dim=64, dim_mults=(1, 2, 4, 8), flash_attn=flash)  # the README's model
    # the README's; its defaults pred_v, sigmoid schedule
    diffusion = GaussianDiffusion(unet, image_size=IMAGE_SIZE, timesteps=1000)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    diffusion = diffusion.to(memory_format=fmt)
    opt = torch.optim.Adam(diffusion.parameters(), lr=1e-4, betas=(0.9, 0.99))  # Trainer defaults
    ema = EMA(diffusion, beta=0.995, update_every=10)  # Trainer defaults
    data = torch.rand(batch, 3, IMAGE_SIZE, IMAGE_SIZE).contiguous(memory_format=fmt)  # Trainer feeds [0, 1]

    def step():  # Trainer.train's body with gradient_accumulate_every = 1 on one process
        diffusion.train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = diffusion(data)
            loss.item()  # Trainer: total_loss += loss.item()
        loss.backward()
        # accelerator.clip_grad_norm_ on one CPU process
        torch.nn.utils.clip_grad_norm_(diffusion.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        ema.update()

    n_params = sum(p.numel() for p in unet.parameters())
    return step, n_params


def count_theirs():
    """Counted training FLOPs per image (forward + backward of GaussianDiffusion's loss), math attention."""
    from denoising_diffusion_pytorch import GaussianDiffusion, Unet

    torch.manual_seed(0)
    diffusion = GaussianDiffusion(Unet(dim=64, dim_mults=(1, 2, 4, 8), flash_attn=False),
                                  image_size=IMAGE_SIZE, timesteps=1000)
    x = torch.rand(2, 3, IMAGE_SIZE, IMAGE_SIZE)
    return count_flops(lambda: diffusion(x).backward(), 2)


# ----------------------------------------------------------------------------- ours


def build_ours(batch, channels_last, compile_model, precision, attention="sdpa"):
    """-> step() of ddpm.iteration (train()'s step) on the 'ho' network, with model, EMA, optimizer and
    forward from ddpm.build (compile: torch.compile in the default mode), and the parameter count."""
    import ddpm
    from machinery import runs

    torch.manual_seed(0)
    mc = ddpm.ModelConfig()  # preset 'ho'
    tc = ddpm.TrainerConfig(batch_size=batch, compile="true" if compile_model else "false",
                            precision=precision, channels_last="true" if channels_last else "false",
                            attention=attention)
    b = ddpm.build(mc, tc, CPU)
    x0 = torch.rand(batch, mc.channels, mc.image_size, mc.image_size) * 2 - 1
    x0 = x0.contiguous(memory_format=runs.memory_format(b.channels_last))

    steps = itertools.count()

    def step():  # what ddpm.train runs per step
        ddpm.iteration(b, x0, None, tc, next(steps))

    return step, sum(p.numel() for p in b.model.parameters())


def count_ours():
    """Counted training FLOPs per image of Diffusion.loss forward + backward on the CPU, math attention;
    and mfu.train_flops_per_image (the meta-device count ddpm.py reports) beside it."""
    import ddpm
    from machinery import mfu
    from unet import UNet

    torch.manual_seed(0)
    mc = ddpm.ModelConfig()
    model, diffusion = UNet(mc, attention="math"), ddpm.Diffusion(mc)
    x = torch.rand(2, mc.channels, mc.image_size, mc.image_size) * 2 - 1
    counted = count_flops(lambda: diffusion.loss(model, x)[0].mean().backward(), 2)
    return counted, mfu.train_flops_per_image(UNet, mc, "sdpa")


# ----------------------------------------------------------------------------- main


OUR_MODES = ("eager", "cl", "compile", "bf16")  # MODE is one of these or several joined by '+', e.g. bf16+cl


def parse_ours(spec):
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        mode, _, batch = item.partition(":")
        if not set(mode.split("+")) <= set(OUR_MODES) or not batch.isdigit():
            raise errors.UserError(f"--ours item '{item}': expected MODE:BATCH, MODE one or more of "
                                   f"{', '.join(OUR_MODES)} joined by '+'")
        out.append((mode, int(batch)))
    return out


def parse_args(argv):
    """The command line; --ours is parsed by build_rows (parse_ours)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ours", default="eager:16,cl:16,bf16:16,bf16+cl:16",
                   help="our configurations, MODE:BATCH, comma-separated; MODE: one or more of eager, cl "
                        "(channels_last), compile, bf16 (autocast) joined by '+'")
    p.add_argument("--theirs_batch", type=int, default=16, help="their batch (Trainer default 16)")
    p.add_argument("--bf16_timed", type=int, default=0,
                   help="timed rounds of 'theirs bf16+cl'; 0 = --timed on a CPU with bf16 hardware, else 2 "
                        "(emulated bf16 is slow)")
    p.add_argument("--no_bf16", action="store_true", help="leave 'theirs bf16+cl' out")
    cpu_timing.add_args(p)
    return p.parse_args(argv)


def prepare(args):
    """Threads set, the header printed, the matmul peaks measured and the FLOPs counted ->
    (t_start, env, peaks32, peaks16, (theirs, ours, ours by mfu.train_flops_per_image))."""
    torch.set_num_threads(args.threads)
    t_start = time.time()
    env = cpu_timing.environment(args.threads,
                                 ("denoising-diffusion-pytorch", "einops", "ema-pytorch", "accelerate"))
    print(f"# {env['date']} · {env['cpu']}, {env['cores']} cores, {args.threads} threads · "
          f"torch {env['torch']} · "
          f"denoising-diffusion-pytorch {env['denoising-diffusion-pytorch']} (einops {env['einops']}, "
          f"ema-pytorch {env['ema-pytorch']}, accelerate {env['accelerate']}) · git {env['git']}",
          flush=True)

    peaks32, peaks16 = cpu_timing.measure_peaks()
    theirs_flops = count_theirs()
    ours_flops, ours_meta_flops = count_ours()
    cpu_timing.print_counts(env, peaks32, peaks16, theirs_flops, ours_flops, ours_meta_flops)
    return t_start, env, peaks32, peaks16, (theirs_flops, ours_flops, ours_meta_flops)


def build_rows(args, env, flops):
    """cpu_timing's rows: theirs fp32, fp32+cl and (unless --no_bf16) bf16+cl, then each of --ours."""
    tb = args.theirs_batch
    bf16_timed = args.bf16_timed or (args.timed if env["cpu_bf16_hardware"] else 2)
    bf16_warmup = args.warmup if env["cpu_bf16_hardware"] else min(args.warmup, 1)

    def make_row(name, family, build, batch, precision):
        return {"config": name, "family": family, "batch": batch, "precision": precision, "_build": build,
                "flops_per_image": flops[0] if family == "theirs" else flops[1],
                "timed": args.timed if precision == "fp32" else bf16_timed,
                "warmup": args.warmup if precision == "fp32" else bf16_warmup}

    rows = [make_row("theirs fp32", "theirs", lambda: build_theirs(tb, False, False), tb, "fp32"),
            make_row("theirs fp32+cl", "theirs", lambda: build_theirs(tb, True, False), tb, "fp32")]
    if not args.no_bf16:
        rows.append(make_row("theirs bf16+cl", "theirs", lambda: build_theirs(tb, True, True), tb, "bf16"))
    for mode, batch in parse_ours(args.ours):
        parts = mode.split("+")
        cl, comp, prec = "cl" in parts, "compile" in parts, "bf16" if "bf16" in parts else "fp32"
        if prec == "bf16" and args.no_bf16:
            continue
        rows.append(make_row(f"ours {mode} b{batch}", "ours",
                             (lambda b=batch, cl=cl, comp=comp, prec=prec: build_ours(b, cl, comp, prec)),
                             batch, prec))
    return rows


def report(args, rows, t_start, peaks32, peaks16):
    """The peaks line and the table."""
    peak32, peak16 = max(peaks32), max(peaks16)
    print(f"\nmeasured matmul peak (best of start and end): fp32 {peak32 / 1e9:.1f} GFLOP/s "
          f"({', '.join(f'{v / 1e9:.1f}' for v in peaks32)}), bf16 {peak16 / 1e9:.2f} GFLOP/s; "
          f"median of the uncontended timed steps (others <= {args.contended} cores); "
          f"'others' = cores other processes kept busy, median over all timed steps; "
          f"total wall {time.time() - t_start:.0f} s\n")
    ref32 = next((row for row in rows if row["config"] == "theirs fp32"), None)
    print(reporting.table(
        ["config", "params", "GFLOP/img (counted)", "batch", "median ms/step (min)", "steps used", "img/s",
         "GFLOP/s", "of matmul peak", "FLOP/s vs theirs fp32", "others"],
        [[row["config"], f"{row['params'] / 1e6:.2f}M", f"{row['flops_per_image'] / 1e9:.2f}",
          f"{row['batch']}", f"{row['step_ms']:.0f} ({row['step_ms_min']:.0f})", cpu_timing.steps_used(row),
          f"{row['img_per_s']:.2f}", f"{row['gflops']:.1f}", cpu_timing.peak_cell(row),
          f"{row['gflops'] / ref32['gflops'] if ref32 else float('nan'):.2f}x",
          f"{row['other_cores_median']:.2f}"] for row in rows]))


def best_ratios(rows):
    """Our fastest row (by FLOP/s) against each of theirs, printed with the goals -> ratios by their
    config."""
    by = {row["config"]: row for row in rows}
    ours_rows = [row for row in rows if row["family"] == "ours"]
    ratios = {}
    if ours_rows:
        best = max(ours_rows, key=lambda row: row["gflops"])
        print(f"\nbest of ours: {best['config']}, {best['gflops']:.1f} GFLOP/s")
        for ref, goal in (("theirs fp32", 2.5), ("theirs fp32+cl", None), ("theirs bf16+cl", 1.2)):
            if ref in by:
                ratios[ref] = r = {**reporting.ratio_entry(best, by[ref]), "goal": goal}
                fl = r["flops_ratio"]
                verdict = f" (goal >= {goal}x: {'met' if fl >= goal else 'NOT met'})" if goal else ""
                print(f"  vs {ref}: {fl:.2f}x FLOP/s{verdict}, {r['img_per_s_ratio']:.2f}x img/s"
                      + (" [NOISY: contended steps]" if r["noisy"] else ""))
    return ratios


def main(argv=None):
    args = parse_args(argv)
    if not cpu_timing.importable("denoising_diffusion_pytorch",
                                 "pip install --no-deps denoising-diffusion-pytorch einops ema-pytorch "
                                 "accelerate pytorch-fid safetensors pyyaml"):
        return None
    with errors.reported():
        t_start, env, peaks32, peaks16, flops = prepare(args)
        rows = build_rows(args, env, flops)
        cpu_timing.warm_up(rows)
        cpu_timing.run_interleaved(rows, args.contended, args.budget_s)
        peaks32, peaks16 = cpu_timing.summarize(rows, args.contended, peaks32, peaks16)
        report(args, rows, t_start, peaks32, peaks16)
        ratios = best_ratios(rows)
        cpu_timing.finish(args, t_start, env, peaks32, peaks16, flops, rows, ratios_best_ours=ratios)
    return rows


if __name__ == "__main__":
    main()

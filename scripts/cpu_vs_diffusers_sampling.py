"""Sampling speed on the CPU, side by side: our sampler against diffusers' pipelines, on the very same network
and weights.

    .venv/bin/python scripts/cpu_vs_diffusers_sampling.py --json sampling.json        # ~5 min on 2 cores
    .venv/bin/python scripts/cpu_vs_diffusers_sampling.py --batch 16 --steps 10 --timed 5

The network: Ho et al.'s CIFAR-10 UNet (35.7M parameters; `ho`), random weights drawn once, copied into
diffusers' UNet2DModel through unet.diffusers_state_dict (tests/test_diffusers.py checks the two compute the
same function). One timed step = one batch of --batch images through --steps sampler steps, ending in uint8
images on the host, as each side's user gets them:
  theirs ddim fp32   DDIMPipeline(unet, DDIMScheduler(linear betas, 1000 steps))(batch_size,
                     num_inference_steps, eta=0, output_type="np"), the UNet in fp32.
  theirs ddim bf16   the same call under torch.autocast('cpu', bfloat16) (a UNet cast to bf16 breaks their
                     pipeline: its scheduler arithmetic meets bf16 tensors).
  theirs ddpm fp32 / bf16   DDPMPipeline likewise (ancestral, respaced to --steps).
  ours ddim / ddpm   Diffusion.sample(sampler=...) as sample.py runs it: the EMA network under autocast at
                     --precision=auto (bf16 on AVX512-BF16 CPUs), no gradient state, then to uint8.
  ours ... fp32      the same in fp32.
Timing, contention handling and the matmul peaks: scripts/cpu_timing.py (interleaved rounds, medians of the
uncontended steps). Counted GFLOP per image = mfu.forward_flops_per_image x network evaluations.
Without diffusers the script prints one line and exits 0.
"""
import argparse
import time

import cpu_timing
import errors
from cpu_timing import CPU

import torch

SAMPLERS = ("ddim", "ddpm")


def networks():
    """-> (our UNet, their UNet2DModel with the same weights, ModelConfig), both eval, no gradients."""
    import ddpm
    import unet
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    mc = ddpm.ModelConfig(dropout=0.0)
    ours = unet.UNet(mc).eval().requires_grad_(False)
    config = {k: v for k, v in unet.diffusers_config(ours).items() if not k.startswith("_")}
    theirs = UNet2DModel(**config).eval().requires_grad_(False)
    theirs.load_state_dict(unet.diffusers_state_dict(ours))
    return ours, theirs, mc


def build_theirs(theirs, sampler, bf16, batch, steps):
    from diffusers import DDIMPipeline, DDIMScheduler, DDPMPipeline, DDPMScheduler

    kw = dict(num_train_timesteps=1000, beta_schedule="linear", beta_start=1e-4, beta_end=0.02)
    if sampler == "ddim":
        pipe = DDIMPipeline(unet=theirs, scheduler=DDIMScheduler(**kw))
        extra = {"eta": 0.0}
    else:
        pipe = DDPMPipeline(unet=theirs, scheduler=DDPMScheduler(**kw))
        extra = {}
    pipe.set_progress_bar_config(disable=True)

    def step():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            images = pipe(batch_size=batch, num_inference_steps=steps, output_type="np",
                          generator=torch.Generator().manual_seed(0), **extra).images
        return (images * 255).round().astype("uint8")

    return step


def build_ours(ours, mc, sampler, precision, batch, steps):
    import ddpm
    import runs

    precision = runs.resolve_precision(precision, CPU)
    diffusion = ddpm.Diffusion(mc)
    net = ddpm.autocast_model(ours, CPU, precision)
    shape = (batch, mc.channels, mc.image_size, mc.image_size)

    def step():
        x = diffusion.sample(net, shape, sampler=sampler, steps=steps,
                             generator=torch.Generator().manual_seed(0))
        return ((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()

    return step, precision


def build_rows(args, flops_per_eval):
    import runs

    ours, theirs, mc = networks()
    n = sum(p.numel() for p in ours.parameters())
    rows = []

    def add(family, sampler, precision, build):
        rows.append({"config": f"{family} {sampler} {precision}", "family": family, "sampler": sampler,
                     "precision": precision, "batch": args.batch, "steps": args.steps,
                     "flops_per_image": flops_per_eval * args.steps, "timed": args.timed,
                     "warmup": args.warmup, "_build": lambda: (build(), n)})

    auto = runs.resolve_precision("auto", CPU)
    for sampler in args.samplers:
        for precision in ("fp32", "bf16"):
            add("theirs", sampler, precision,
                lambda s=sampler, b=precision == "bf16": build_theirs(theirs, s, b, args.batch, args.steps))
        for precision in dict.fromkeys((auto, "fp32")):
            add("ours", sampler, precision,
                lambda s=sampler, p=precision: build_ours(ours, mc, s, p, args.batch, args.steps)[0])
    return rows


def report(rows, args, peak16):
    print("\n| config | batch x steps | median s/batch (min-max) | steps used | img/s | counted GFLOP/s | "
          "of bf16 matmul peak | ours / theirs fp32 | ours / theirs bf16 | others |\n" + "|---" * 10 + "|")
    ratios = {}
    for row in rows:
        cells = []
        for ref in ("fp32", "bf16"):
            theirs = next(r for r in rows if r["family"] == "theirs" and r["sampler"] == row["sampler"]
                          and r["precision"] == ref)
            if row["family"] == "ours":
                ratio = theirs["step_ms"] / row["step_ms"]
                ratios[f"{row['config']} / {theirs['config']}"] = ratio
                cells.append(f"{ratio:.2f}x")
            else:
                cells.append("")
        print(f"| {row['config']} | {args.batch} x {args.steps} | {row['step_ms'] / 1e3:.2f} "
              f"({row['step_ms_min'] / 1e3:.2f}-{row['step_ms_max'] / 1e3:.2f}) | "
              f"{cpu_timing.steps_used(row)} | "
              f"{row['img_per_s']:.2f} | {row['gflops']:.1f} | {100 * row['gflops'] * 1e9 / peak16:.0f}% | "
              f"{' | '.join(cells)} | {row['other_cores_median']:.2f} |")
    return ratios


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16, help="images per sampled batch")
    p.add_argument("--steps", type=int, default=10, help="sampler steps (network evaluations per image)")
    p.add_argument("--samplers", default="ddim", help=f"comma-separated: {', '.join(SAMPLERS)}")
    cpu_timing.add_args(p)
    p.set_defaults(warmup=1, timed=5)
    args = p.parse_args(argv)
    args.samplers = [s for s in args.samplers.split(",") if s]
    if not args.samplers or any(s not in SAMPLERS for s in args.samplers):
        p.error(f"--samplers: choose from {', '.join(SAMPLERS)}")
    if args.batch < 1 or not 1 <= args.steps <= 1000:
        p.error("--batch must be >= 1 and --steps in [1, 1000]")
    return args


def main(argv=None):
    args = parse_args(argv)
    if not cpu_timing.importable("diffusers", "pip install diffusers"):
        return None
    import mfu

    with errors.reported():
        torch.set_num_threads(args.threads)
        mfu.keep_freed_memory()  # process-wide, as ddpm.py and sample.py run: both sides gain alike
        t_start = time.time()
        env = cpu_timing.environment(args.threads, ("diffusers",))
        print(f"# {env['utc']} UTC · {env['cpu']}, {args.threads} threads · torch {env['torch']} · "
              f"diffusers {env['diffusers']} · git {env['git']}", flush=True)
        peaks32, peaks16 = cpu_timing.measure_peaks()
        import ddpm

        flops_per_eval = mfu.forward_flops_per_image(ddpm.ModelConfig(dropout=0.0))
        rows = build_rows(args, flops_per_eval)
        cpu_timing.warm_up(rows)
        cpu_timing.run_interleaved(rows, args.contended, args.budget_s)
        peaks32, peaks16 = cpu_timing.summarize(rows, args.contended, peaks32, peaks16)
        ratios = report(rows, args, max(peaks16))
        flops = (flops_per_eval * args.steps,) * 3
        cpu_timing.finish(args, t_start, env, peaks32, peaks16, flops, rows, ratios=ratios)
    return rows


if __name__ == "__main__":
    main()

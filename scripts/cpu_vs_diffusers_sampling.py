"""Sampling speed on the CPU, side by side: our sampler against diffusers' pipelines, on the very same network
and weights.

    .venv/bin/python scripts/cpu_vs_diffusers_sampling.py --json sampling.json        # ~6 min on 2 cores
    .venv/bin/python scripts/cpu_vs_diffusers_sampling.py --batch 16 --steps 10 --timed 5

The network: Ho et al.'s CIFAR-10 UNet (35.7M parameters; `ho`), random weights drawn once (Ho's
initialisation plus N(0, 0.02^2): his zero-initialised last layers would leave the images the noise's),
copied into diffusers' UNet2DModel through unet.diffusers_state_dict (tests/test_diffusers.py checks the two
compute the same function). One timed step = one batch of --batch images through --steps sampler steps,
ending in uint8 images on the host, as each side's user gets them:
  theirs ddim fp32   DDIMPipeline(unet, DDIMScheduler(linear betas, 1000 steps))(batch_size,
                     num_inference_steps, eta=0, output_type="np"), the UNet in fp32.
  theirs ddim bf16   the same call under torch.autocast('cpu', bfloat16) (a UNet cast to bf16 breaks their
                     pipeline: its scheduler arithmetic meets bf16 tensors).
  theirs ddpm fp32 / bf16   DDPMPipeline likewise (ancestral, respaced to --steps).
  ours ddim / ddpm   ddpm.sample(sampler=...) as sample.py runs it (sampling.sampling_network, each
                     image's noise from its own generator): autocast at --precision=auto (bf16 on
                     AVX512-BF16 CPUs) over bf16 conv and dense weights, no gradient state, then to uint8.
  ours ... compiled  the same with sample.py --compile default: each sampler step compiled whole
                     (torch.compile, channels_last weights); compiling is in the warm-up.
  ours ... fp32      eager, in fp32.
--profile adds, for each row, one profiled batch: the share of its CPU time in the convolutions (oneDNN's, by
op name), as BENCHMARKS.md reports it (the profiler's own overhead falls on the many small ops outside them).
Timing, contention handling and the matmul peaks: scripts/cpu_timing.py (interleaved rounds, medians of the
uncontended steps). Counted GFLOP per image = mfu.forward_flops_per_image x network evaluations.
Without diffusers the script prints one line and exits 0.
"""
import argparse
import copy
import time

import cpu_timing
import reporting
from cpu_timing import CPU
from machinery import errors

import torch

SAMPLERS = ("ddim", "ddpm")


def networks(base_channels=128):
    """-> (our UNet, their UNet2DModel with the same weights, ModelConfig), both eval, no gradients: Ho's
    network, or narrower for plumbing tests."""
    import ddpm
    import unet
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    mc = ddpm.ModelConfig(dropout=0.0, base_channels=base_channels)
    ours = unet.UNet(mc).eval().requires_grad_(False)
    for p in ours.parameters():  # Ho's last layers start at ~0: this makes the images depend on the network
        p.add_(0.02 * torch.randn_like(p))
    config = {k: v for k, v in unet.diffusers_config(ours).items() if not k.startswith("_")}
    theirs = UNet2DModel(**config).eval().requires_grad_(False)
    theirs.load_state_dict(unet.diffusers_state_dict(ours))
    return ours, theirs, mc


def build_theirs(theirs, sampler, bf16, batch, steps, device=CPU):
    from diffusers import DDIMPipeline, DDIMScheduler, DDPMPipeline, DDPMScheduler

    kw = dict(num_train_timesteps=1000, beta_schedule="linear", beta_start=1e-4, beta_end=0.02)
    if sampler == "ddim":
        pipe = DDIMPipeline(unet=theirs, scheduler=DDIMScheduler(**kw))
        extra = {"eta": 0.0}
    else:
        pipe = DDPMPipeline(unet=theirs, scheduler=DDPMScheduler(**kw))
        extra = {}
    pipe.set_progress_bar_config(disable=True)
    pipe.to(device)

    def step():
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            images = pipe(batch_size=batch, num_inference_steps=steps, output_type="np",
                          generator=torch.Generator().manual_seed(0), **extra).images
        return (images * 255).round().astype("uint8")

    return step


def build_ours(ours, mc, sampler, precision, batch, steps, compile="false", device=CPU):
    """-> a step drawing one batch to uint8 as sample.py does, --compile `compile` (false: eager)."""
    import ddpm
    import evaluate
    import sampling

    diffusion = ddpm.Diffusion(mc).to(device)
    options = argparse.Namespace(compile=compile, guidance=1.0)
    # a copy: sampling_network stores the weights in bf16 (and channels_last when compiling)
    net, capture = sampling.sampling_network(options, copy.deepcopy(ours).to(device), mc, device, precision)
    shape = (batch, mc.channels, mc.image_size, mc.image_size)

    def step():
        x = ddpm.sample(diffusion, net, shape, sampler=sampler, steps=steps, capture=capture,
                        noise=sampling.ImageNoise(0, range(batch)))
        return evaluate.to_uint8(x).permute(0, 2, 3, 1).cpu().numpy()

    return step


def build_rows(args, flops_per_eval):
    from machinery import runs

    ours, theirs, mc = networks()
    n = sum(p.numel() for p in ours.parameters())
    rows = []

    def add(family, sampler, precision, build, compiled=False):
        rows.append({"config": f"{family} {sampler} {precision}" + " compiled" * compiled, "family": family,
                     "sampler": sampler, "precision": precision, "compiled": compiled,
                     "batch": args.batch, "steps": args.steps,
                     "flops_per_image": flops_per_eval * args.steps, "timed": args.timed,
                     "warmup": args.warmup, "_build": lambda: (build(), n)})

    auto = runs.resolve_precision("auto", CPU)
    for sampler in args.samplers:
        for precision in ("fp32", "bf16"):
            add("theirs", sampler, precision,
                lambda s=sampler, b=precision == "bf16": build_theirs(theirs, s, b, args.batch, args.steps))
        for precision, compile in dict.fromkeys([(auto, "false"), (auto, "default"), ("fp32", "false")]):
            build = lambda s=sampler, p=precision, c=compile: build_ours(  # noqa: E731
                ours, mc, s, p, args.batch, args.steps, c)
            add("ours", sampler, precision, build, compiled=compile != "false")
    return rows


def conv_shares(rows):
    """One profiled batch of each row: the share of its CPU time spent in convolutions (row['conv_share'])."""
    from torch.profiler import ProfilerActivity, profile

    for row in rows:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            row["_step"]()
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        row["conv_share"] = sum(e.self_cpu_time_total for e in events if "convolution" in e.key) / total
        print(f"profile {row['config']}: {100 * row['conv_share']:.0f}% of {total / 1e6:.2f} s in "
              "convolutions", flush=True)


def report(rows, args, peak16):
    """The table, ours against theirs of the same sampler in fp32 and bf16 -> the ratios (img/s)."""
    refs = ("fp32", "bf16")
    pairs = reporting.against_theirs(rows, refs, lambda theirs, ref, ours: (
        theirs["sampler"], theirs["precision"], theirs["compiled"]) == (ours["sampler"], ref, False))
    lines = [[row["config"], f"{args.batch} x {args.steps}", reporting.spread(row, 2, 1e3),
              cpu_timing.steps_used(row), f"{row['img_per_s']:.2f}", f"{row['gflops']:.1f}",
              f"{100 * row['gflops'] * 1e9 / peak16:.0f}%", *reporting.ratio_cells(row, refs),
              f"{100 * row['conv_share']:.0f}%" if "conv_share" in row else "",
              f"{row['other_cores_median']:.2f}"] for row in rows]
    heads = ["config", "batch x steps", "median s/batch (min-max)", "steps used", "img/s", "counted GFLOP/s",
             "of bf16 matmul peak", *(f"ours / theirs {m}" for m in refs), "in convolutions", "others"]
    print("\n" + reporting.table(heads, lines))
    return {f"{ours['config']} / {theirs['config']}": ours[f"vs_theirs_{ref}"] for ours, ref, theirs in pairs}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16, help="images per sampled batch")
    p.add_argument("--steps", type=int, default=10, help="sampler steps (network evaluations per image)")
    p.add_argument("--samplers", default="ddim", help=f"comma-separated: {', '.join(SAMPLERS)}")
    p.add_argument("--profile", action="store_true",
                   help="also profile one batch of each row: its share of time in the convolutions")
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
    with errors.reported():  # a bad argument: one error line
        args = parse_args(argv)
    if not cpu_timing.importable("diffusers", "pip install diffusers"):
        return None
    import unet
    from machinery import mfu

    with errors.reported():
        torch.set_num_threads(args.threads)
        mfu.keep_freed_memory()  # process-wide, as ddpm.py and sample.py run: both sides gain alike
        t_start = time.time()
        env = cpu_timing.environment(args.threads, ("diffusers",))
        print(f"# {env['utc']} UTC · {env['cpu']}, {args.threads} threads · torch {env['torch']} · "
              f"diffusers {env['diffusers']} · git {env['git']}", flush=True)
        peaks32, peaks16 = cpu_timing.measure_peaks()
        import ddpm

        flops_per_eval = mfu.forward_flops_per_image(unet.UNet, ddpm.ModelConfig(dropout=0.0))
        rows = build_rows(args, flops_per_eval)
        cpu_timing.warm_up(rows)
        cpu_timing.run_interleaved(rows, args.contended, args.budget_s)
        if args.profile:
            conv_shares(rows)
        peaks32, peaks16 = cpu_timing.summarize(rows, args.contended, peaks32, peaks16)
        ratios = report(rows, args, max(peaks16))
        flops = (flops_per_eval * args.steps,) * 3
        cpu_timing.finish(args, t_start, env, peaks32, peaks16, flops, rows, ratios=ratios)
    return rows


if __name__ == "__main__":
    main()

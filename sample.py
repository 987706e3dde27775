"""Generate images from a trained run: a PNG grid and an .npz of uint8 samples, from the EMA weights.

    python sample.py --ckpt runs/demo-.../ema.pt --n 64 --sampler dpm++ --steps 20 --guidance 2 --out grid.png
    python sample.py --ckpt runs/x/ckpt.pt --n 10000 --batch 500 --out samples.png   # writes samples.npz too

--ckpt takes either checkpoint a run writes (ckpt.pt, the resumable state, or ema.pt, the export);
both hold the EMA weights and the model config, and load with weights_only=True. Class-conditional
models cycle through the classes unless --label fixes one. The network runs under bf16 autocast
where the hardware has it (GPUs, CPUs with AVX512-BF16/AMX), as --precision=auto does in training.

Measured: see README.md (the demo grid) -- sampling cost is the network's forward FLOPs x steps.
"""
import argparse
import dataclasses
import os
import sys

import numpy as np
import torch

import ddpm
from unet import UNet


def load_ema(path, device):
    """-> (UNet with the EMA weights, ModelConfig, the run's TrainerConfig fields or {}).
    Raises ddpm.ConfigError with one clear line."""
    ckpt = ddpm.load_checkpoint(path, device)
    try:
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in ckpt["model_config"].items()}
        state = ckpt["ema"]
    except (KeyError, TypeError, AttributeError) as e:  # a torch file, but not one of ours
        raise ddpm.ConfigError(f"{path} is not a ddpm checkpoint (no {e})") from None
    try:
        mc = ddpm.ModelConfig(**fields)
        model = UNet(mc).to(device)
        model.load_state_dict(state)
    except (TypeError, RuntimeError) as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise ddpm.ConfigError(f"{path}: its weights do not match its model config ({first})") from None
    return model.eval().requires_grad_(False), mc, ckpt.get("trainer_config", {})


def main(argv=None):
    p = argparse.ArgumentParser(description="Sample images from a trained ddpm run.")
    p.add_argument("--ckpt", required=True, help="a run's ckpt.pt or ema.pt")
    p.add_argument("--ckpt_high", default="", help="with model splitting: the t >= S expert (--ckpt is then the t < S one)")
    p.add_argument("--n", type=int, default=64, help="number of images")
    p.add_argument("--sampler", choices=["ddpm", "ddim", "dpm++"], default="dpm++")
    p.add_argument("--steps", type=int, default=20, help="sampler steps; 0 = all T")
    p.add_argument("--eta", type=float, default=0.0, help="DDIM noise; 0 = deterministic")
    p.add_argument("--guidance", type=float, default=1.0, help="classifier-free guidance weight w; 1 = none")
    p.add_argument("--threshold", choices=["static", "dynamic", "none"], default="static",
                   help="x0 clipping: static [-1, 1], dynamic (Saharia et al. 2022), or none")
    p.add_argument("--percentile", type=float, default=0.995, help="dynamic thresholding percentile")
    p.add_argument("--label", type=int, default=-1, help="class to sample; -1 = cycle through all classes")
    p.add_argument("--batch", type=int, default=256, help="images per network call (memory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="samples.png", help="grid PNG; the .npz (or, with --eval bpd, a .json) is written beside it")
    p.add_argument("--eval", choices=["samples", "bpd"], default="samples",
                   help="samples: draw --n images; bpd: bits/dim of --n held-out images (Diffusion.bpd)")
    p.add_argument("--strata", type=int, default=0, help="bpd: estimate from 2*strata+1 network calls; 0 = all T (exact)")
    p.add_argument("--dataset", help="bpd: held-out data; default: the run's own dataset (test split)")
    p.add_argument("--data_dir", help="bpd: default: the run's own data_dir")
    args = p.parse_args(argv)
    try:
        device = ddpm.resolve_device(args.device)
        model, mc, run = load_ema(args.ckpt, device)
        if args.ckpt_high:  # model splitting: two experts, each used for its own timesteps
            high, mc_high, _ = load_ema(args.ckpt_high, device)
            same = {k: v for k, v in dataclasses.asdict(mc).items() if k != "split_part"}
            if same != {k: v for k, v in dataclasses.asdict(mc_high).items() if k != "split_part"}:
                raise ddpm.ConfigError("--ckpt and --ckpt_high differ in more than split_part")
            if (mc.split_part, mc_high.split_part) != ("low", "high") or not ddpm.split_timestep(mc):
                raise ddpm.ConfigError("--ckpt must be a split model's 'low' expert and --ckpt_high its 'high' one")
            model = ddpm.SplitModel(model, high, ddpm.split_timestep(mc))
        elif ddpm.split_timestep(mc):
            raise ddpm.ConfigError(f"{args.ckpt} is one expert of a split model: give the other with --ckpt_high")
        if not (0 <= args.steps <= mc.timesteps) or args.n < 1 or args.batch < 1:
            raise ddpm.ConfigError(f"need n >= 1, batch >= 1 and 0 <= steps <= {mc.timesteps}")
        if args.label >= mc.num_classes or (args.label >= 0 and mc.num_classes == 0):
            raise ddpm.ConfigError(f"--label {args.label}: the model has {mc.num_classes} classes")
    except ddpm.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

    diffusion = ddpm.Diffusion(mc).to(device)
    if args.eval == "bpd":
        return evaluate_bpd(args, model, mc, run, diffusion, device)
    precision = ddpm.resolve_precision("auto", device)  # bf16 where the hardware has it, as in training

    def net(z, t, y):
        with ddpm.autocast(device, precision):
            return model(z, t, y)

    if mc.num_classes > 0:
        labels = torch.full((args.n,), args.label) if args.label >= 0 else torch.arange(args.n) % mc.num_classes
    else:
        labels = None
    g = torch.Generator().manual_seed(args.seed)  # one CPU stream for all batches: reproducible on any device
    images = []
    for start in range(0, args.n, args.batch):
        b = min(args.batch, args.n - start)
        y = labels[start : start + b].to(device) if labels is not None else None
        x = diffusion.sample(net, (b, mc.channels, mc.image_size, mc.image_size), sampler=args.sampler,
                             steps=args.steps or None, y=y, guidance=args.guidance, generator=g, eta=args.eta,
                             threshold=args.threshold, percentile=args.percentile)
        images.append(((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).cpu())
        print(f"{start + b}/{args.n} images", flush=True)
    images = torch.cat(images)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    ddpm.save_grid(images[:256].float() / 127.5 - 1, args.out)
    npz = os.path.splitext(args.out)[0] + ".npz"
    np.savez(npz, images=images.permute(0, 2, 3, 1).numpy(),
             labels=labels.numpy() if labels is not None else np.zeros(0, np.int64))
    print(f"wrote {args.out} and {npz}: {args.n} images, {args.sampler} {args.steps or mc.timesteps} steps, "
          f"guidance {args.guidance}")


def evaluate_bpd(args, model, mc, run, diffusion, device):
    """Bits/dim of the first --n images of the held-out split, in fp32 (the bound sums T terms)."""
    import json

    import data

    dataset, data_dir = args.dataset or run.get("dataset"), args.data_dir or run.get("data_dir")
    if not dataset:
        print("error: --eval bpd needs --dataset (and --data_dir): this checkpoint does not record its run's data",
              file=sys.stderr)
        sys.exit(2)
    try:
        images, labels, _ = data.load_dataset(dataset, data_dir, mc.image_size, run.get("shapes_count", 50_000), train=False)
    except data.DataError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    n = min(args.n, len(images))
    g = torch.Generator().manual_seed(args.seed)
    bits, est_var = [], 0.0
    for start in range(0, n, args.batch):
        x0 = images[start : start + args.batch].to(device).double() / 127.5 - 1
        y = labels[start : start + args.batch].to(device) if mc.num_classes > 0 else None
        if args.strata:
            b, se = diffusion.bpd_estimate(model, x0, y, strata=args.strata, threshold=args.threshold, generator=g)
            est_var += (se**2).sum().item()
        else:
            b = diffusion.bpd(model, x0, y, threshold=args.threshold, generator=g)
        bits.append(b.cpu())
        print(f"{start + len(x0)}/{n} images", flush=True)
    bits = torch.cat(bits)
    result = {"bpd": bits.mean().item(), "sem": (bits.std() / n**0.5).item() if n > 1 else None, "n": n,
              "dataset": dataset, "split": "test", "strata": args.strata or None,
              "estimator_se": est_var**0.5 / n if args.strata else None, "reverse_variance": mc.reverse_variance}
    path = os.path.splitext(args.out)[0] + ".json"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    extra = f", estimator s.e. {result['estimator_se']:.4f}" if args.strata else ""
    print(f"bits/dim {result['bpd']:.4f} ± {result['sem'] or 0:.4f} (s.e.m. over {n} {dataset} test images{extra}); wrote {path}")
    return result


if __name__ == "__main__":
    main()

"""Generate images from a trained run: a PNG grid and an .npz of uint8 samples, from the EMA weights.

    python sample.py --ckpt runs/demo-.../ema.pt --n 64 --sampler dpm++ --steps 20 --guidance 2 --out grid.png
    python sample.py --ckpt runs/x/ckpt.pt --n 10000 --batch 500 --out samples.png   # writes samples.npz too
    # + FID, IS, precision/recall
    python sample.py --ckpt runs/x/ema.pt --eval fid --n 50000 --out fid/samples.png
    # bits/dim of the test split
    python sample.py --ckpt runs/x/ema.pt --eval bpd --n 10000 --out bpd/test.png
    # diffusers' copy of Ho's weights
    python sample.py --ckpt ddpm-cifar10-32 --eval fid --n 50000 --out fid/ho.png
    # a folder diffusers loads
    python sample.py --ckpt runs/x/ema.pt --export_diffusers hub/x

--ckpt takes either checkpoint a run writes (ckpt.pt, the resumable state, or ema.pt, the export);
both hold the EMA weights and the model config, and load with weights_only=True. It also takes a
diffusers model folder (config.json + safetensors or .bin, and scheduler_config.json for the schedule),
or a pipeline folder holding them in unet/ and scheduler/ (diffusers_io.py). Class-conditional
models cycle through the classes unless --label fixes one. The sampler, its steps, the guidance and the
thresholding default to the run's own grid settings (its preset's; for a diffusers folder, TrainerConfig's
defaults: all T ancestral steps). --sampler takes any sampler of ddpm.SAMPLERS (ddpm, ddim, dpm++, heun, and
one registered with @ddpm.sampler before the arguments are parsed; --help lists them). The network runs
under bf16 autocast where the hardware has it (GPUs, CPUs with AVX512-BF16/AMX), as --precision=auto does
in training.

--eval fid scores the samples with torch-fidelity's InceptionV3 against the run's training set, whose
statistics are computed once and cached (--stats_dir). The results go to a .json beside --out.

Bad input (a flag out of range, an unreadable checkpoint, missing data) is one `error:` line on stderr and
exit status 2, before any sampling where it can be known then (errors.reported).

Measured: see README.md (the demo grid) -- sampling cost is the network's forward FLOPs x steps.
"""
import argparse
import dataclasses
import json
import math
import os
import time

import numpy as np
import torch

import data
import ddpm
import diffusers_io
import errors
import evaluate
import files
import runs
from errors import UserError


def main(argv=None):
    """The command: each step below in turn, inside the one place a UserError becomes an `error:` line."""
    with errors.reported():
        args = parse_args(argv)
        device = runs.resolve_device(args.device)
        model, mc, run = load_models(args, device)
        choose_settings(args, mc, run)  # every check before any sampling
        if args.export_diffusers:
            return export_diffusers(args, model, mc)
        diffusion = ddpm.Diffusion(mc).to(device)
        if args.eval == "bpd":
            return evaluate_bpd(args, model, mc, run, diffusion, device)
        # the Inception weights and the reference statistics first: fail before sampling
        reference = fid_reference(args, mc, run, device) if args.eval == "fid" else None
        images, labels, record = generate(args, model, mc, diffusion, device)
        write_outputs(args, images, labels, record)
        if reference is None:
            write_json(record, args.out)
            return record
        return evaluate_fid(args, images, record, reference, device)


def parse_args(argv):
    """The command line. --sampler's choices are ddpm.SAMPLERS as it stands now, when the arguments are
    parsed, so a sampler registered after this module was imported is one too."""
    p = argparse.ArgumentParser(description="Sample images from a trained ddpm run.")
    p.add_argument("--ckpt", required=True,
                   help="a run's ckpt.pt or ema.pt, or a diffusers model or pipeline folder")
    p.add_argument("--ckpt_high", default="",
                   help="with model splitting: the t >= S expert (--ckpt is then the t < S one)")
    p.add_argument("--n", type=int, default=64, help="number of images")
    # --sampler, --steps, --guidance and --threshold default to what the run's config says for its grids
    # (the preset's sampling settings; TrainerConfig's defaults for a diffusers folder)
    p.add_argument("--sampler", choices=ddpm.SAMPLERS, help=sampler_help())
    p.add_argument("--steps", type=int,
                   help="sampler steps; 0 = all T; default: the run's sample_steps (with another sampler: "
                        "all T; dpm++: the run's eval_sample_steps)")
    p.add_argument("--eta", type=float, default=0.0, help="DDIM noise; 0 = deterministic")
    p.add_argument("--guidance", type=float,
                   help="classifier-free guidance weight w; 1 = none; default: the run's guidance")
    p.add_argument("--threshold", choices=["static", "dynamic", "none"],
                   help="x0 clipping: static [-1, 1], dynamic (Saharia et al. 2022), or none; default: the "
                        "run's threshold (static for --eval bpd)")
    p.add_argument("--percentile", type=float, default=0.995, help="dynamic thresholding percentile")
    p.add_argument("--label", type=int, default=-1, help="class to sample; -1 = cycle through all classes")
    p.add_argument("--batch", type=int, default=256, help="images per network call (memory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="samples.png",
                   help="grid PNG; the .npz (and, with --eval, a .json of the results) is written beside it")
    p.add_argument("--eval", choices=["samples", "fid", "bpd"], default="samples",
                   help="samples: draw --n images; fid: also FID/IS/precision/recall of them against the "
                        "training set; bpd: bits/dim of --n held-out images (Diffusion.bpd)")
    p.add_argument("--strata", type=int, default=0,
                   help="bpd: estimate from 2*strata+1 network calls; 0 = all T (exact)")
    p.add_argument("--dataset", help="fid: the reference (train split), bpd: held-out data (test split); "
                                     "default: the run's own dataset")
    p.add_argument("--data_dir", help="fid, bpd: default: the run's own data_dir")
    p.add_argument("--stats_dir", default=ddpm.TrainerConfig.fid_stats_dir,
                   help="fid: where the reference statistics are cached")
    p.add_argument("--export_diffusers", metavar="DIR", default="",
                   help="write the EMA model as a diffusers folder (UNet2DModel + DDPMScheduler config) "
                        "and exit")
    return p.parse_args(argv)


def sampler_help():
    """--sampler's help: each sampler of ddpm.SAMPLERS with its one-line summary."""
    listed = "; ".join(f"{name}: {s.summary.rstrip('.')}" for name, s in ddpm.SAMPLERS.items())
    return f"default: the run's sampler. {listed}.".replace("%", "%%")  # argparse %-formats help


def load_models(args, device):
    """-> (the EMA network, its ModelConfig, its run's TrainerConfig fields or {}); with --ckpt_high, the
    two experts of a split model as one network, each used for its own timesteps."""
    model, mc, run = ddpm.load_ema(args.ckpt, device)
    if not args.ckpt_high:
        if ddpm.split_timestep(mc):
            raise UserError(f"{args.ckpt} is one expert of a split model: give the other with --ckpt_high")
        return model, mc, run
    high, mc_high, _ = ddpm.load_ema(args.ckpt_high, device)
    same = {k: v for k, v in dataclasses.asdict(mc).items() if k != "split_part"}
    if same != {k: v for k, v in dataclasses.asdict(mc_high).items() if k != "split_part"}:
        raise UserError("--ckpt and --ckpt_high differ in more than split_part")
    if (mc.split_part, mc_high.split_part) != ("low", "high") or not ddpm.split_timestep(mc):
        raise UserError("--ckpt must be a split model's 'low' expert and --ckpt_high its 'high' one")
    return ddpm.SplitModel(model, high, ddpm.split_timestep(mc)), mc, run


def run_default(run, field):
    """The run's own value of a TrainerConfig field; TrainerConfig's default where the run has none."""
    return run.get(field, getattr(ddpm.TrainerConfig, field))


def default_steps(sampler, run):
    """--steps for a --sampler other than the run's, when --steps is not given (the run's sample_steps are
    its own sampler's): DPM-Solver++ takes the run's FID-sampling steps (eval_sample_steps), every other
    sampler, one registered later included, all T (0), which any sampler takes."""
    return run_default(run, "eval_sample_steps") if sampler == "dpm++" else 0


def choose_settings(args, mc, run):
    """Fill in --sampler, --steps, --guidance and --threshold from the run, then refuse, before any
    sampling, values out of range, an --out that cannot be written and a --label the model does not have."""
    if args.eval == "bpd" and args.threshold is None:
        args.threshold = "static"  # the bound as the literature has it, whatever the run samples with
    if args.steps is None and args.sampler not in (None, run_default(run, "sampler")):
        args.steps = default_steps(args.sampler, run)
    for name, field in (("sampler", "sampler"), ("steps", "sample_steps"), ("guidance", "guidance"),
                        ("threshold", "threshold")):
        if getattr(args, name) is None:
            setattr(args, name, run_default(run, field))
    if args.sampler not in ddpm.SAMPLERS:  # the run's own, registered where it trained but not here
        raise UserError(f"the run's sampler '{args.sampler}' is not one of {', '.join(ddpm.SAMPLERS)}: "
                        "choose one with --sampler")
    if not (0 <= args.steps <= mc.timesteps) or args.n < 1 or args.batch < 1:
        raise UserError(f"need n >= 1, batch >= 1 and 0 <= steps <= {mc.timesteps}")
    for name, ok in (("guidance", 0 <= args.guidance < math.inf), ("eta", 0 <= args.eta <= 1),
                     ("percentile", 0 < args.percentile <= 1), ("seed", 0 <= args.seed < 2**63),
                     ("strata", 0 <= args.strata < mc.timesteps)):
        if not ok:  # NaN fails every comparison
            raise UserError(f"--{name} {getattr(args, name)} is out of range")
    if not args.export_diffusers:  # the outputs are checked before any sampling
        check_output(args.out)
    if args.label >= mc.num_classes or (args.label >= 0 and mc.num_classes == 0):
        raise UserError(f"--label {args.label}: the model has {mc.num_classes} classes")


def export_diffusers(args, model, mc):
    """--export_diffusers: the EMA model as a folder diffusers loads. -> that folder."""
    if args.ckpt_high:
        raise UserError("--export_diffusers: diffusers has no two-expert (split) model")
    try:
        diffusers_io.write(args.export_diffusers, model, mc)
    except ValueError as e:
        raise UserError(f"--export_diffusers: {e}") from None
    print(f"wrote {args.export_diffusers}: UNet2DModel.from_pretrained and DDPMScheduler.from_pretrained "
          "load it")
    return args.export_diffusers


def class_labels(args, mc):
    """The --n images' classes: --label, else cycling through the classes; None for an unconditional model."""
    if mc.num_classes == 0:
        return None
    return torch.full((args.n,), args.label) if args.label >= 0 else torch.arange(args.n) % mc.num_classes


def generate(args, model, mc, diffusion, device):
    """Draw the --n images, timed. -> (uint8 (N, C, H, W) on the CPU, their labels or None, the settings and
    the sampling speed, as the .json records them)."""
    precision = runs.resolve_precision("auto", device)  # bf16 where the hardware has it, as in training
    net = ddpm.autocast_model(model, device, precision)
    labels = class_labels(args, mc)
    g = torch.Generator().manual_seed(args.seed)  # one CPU stream for all batches: reproducible on any device
    counted, evaluated = counting(net)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    images, t0 = [], time.perf_counter()
    for x in evaluate.generate(diffusion, counted, args.n, mc, batch=args.batch, generator=g, labels=labels,
                               sampler=args.sampler, steps=args.steps or None, guidance=args.guidance,
                               eta=args.eta, threshold=args.threshold, percentile=args.percentile):
        images.append(x)  # on the CPU: generate() has waited for the device
        print(f"{sum(map(len, images))}/{args.n} images", flush=True)
    speed = sampling_speed(args.n, evaluated[0], time.perf_counter() - t0, device)
    record = {"n": args.n, "sampler": args.sampler, "steps": args.steps or mc.timesteps,
              "guidance": args.guidance, "threshold": args.threshold, "batch": args.batch,
              "device": str(device), "autocast": precision, **speed}
    return torch.cat(images), labels, record


def write_outputs(args, images, labels, record):
    """The grid (the first 256 images) at --out and all the images, with their labels, in the .npz beside
    it; then what was drawn and how fast."""
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    runs.save_grid(images[:256].float() / 127.5 - 1, args.out)
    npz = os.path.splitext(args.out)[0] + ".npz"
    with files.created(npz) as f:
        np.savez(f, images=images.permute(0, 2, 3, 1).numpy(),
                 labels=labels.numpy() if labels is not None else np.zeros(0, np.int64))
    print(f"wrote {args.out} and {npz}: {record['n']} images, {record['sampler']} {record['steps']} steps, "
          f"guidance {record['guidance']}, {record['threshold']} thresholding")
    print(f"sampling: {record['img_per_s']:.3g} img/s, {record['s_per_img']:.3g} s/image, "
          f"{record['nfe_per_image']:.0f} network evaluations per image ({record['nfe_per_s']:.3g}/s), "
          f"peak memory {record['peak_memory_bytes'] / 2**20:.0f} MiB ({record['peak_memory']})")


def counting(net):
    """-> (net, counting the images it evaluates, a guided step twice; a one-element list with the count)"""
    evaluated = [0]

    def counted(z, t, y=None):
        evaluated[0] += len(z)
        return net(z, t, y)

    return counted, evaluated


def sampling_speed(n, evaluated, seconds, device):
    """img/s, s/image, network evaluations (images through the network) per image and per second, and the
    peak memory: the device's allocations on a GPU, the process's resident set on a CPU."""
    if device.type == "cuda":
        peak, what = torch.cuda.max_memory_allocated(device), "CUDA allocated"
    else:
        import resource

        peak, what = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process max RSS"
    return {"seconds": seconds, "img_per_s": n / seconds, "s_per_img": seconds / n,
            "nfe_per_image": evaluated / n, "nfe_per_s": evaluated / seconds, "peak_memory_bytes": peak,
            "peak_memory": what}


def check_output(out):
    """The grid's format from its extension, and a folder it can be written into (made now if missing)."""
    from PIL import Image

    ext = os.path.splitext(out)[1].lower()
    if ext not in Image.registered_extensions():
        raise UserError(f"--out {out}: give the grid an image extension such as .png")
    folder = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot make the folder {folder} ({e.strerror or e})") from None
    if not os.access(folder, os.W_OK) or os.path.isdir(out):
        raise UserError(f"--out {out}: cannot write there")


def run_data(args, run):
    """The held-out/reference data: --dataset/--data_dir, else what the checkpoint's run trained on."""
    dataset, data_dir = args.dataset or run.get("dataset"), args.data_dir or run.get("data_dir")
    if not dataset:
        raise UserError(f"--eval {args.eval} needs --dataset (and --data_dir): this checkpoint does not "
                        "record its run's data")
    return dataset, data_dir


def write_json(result, out):
    path = os.path.splitext(out)[0] + ".json"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with files.created(path, "w") as f:
        json.dump(result, f, indent=2)
    return path


def fid_reference(args, mc, run, device):
    """--eval fid, before any sampling: -> (the Inception network, the training set's statistics, its name)"""
    dataset, data_dir = run_data(args, run)
    extractor = evaluate.inception(device)
    ref = evaluate.reference_stats(extractor, dataset, data_dir, mc.image_size,
                                   run_default(run, "shapes_count"), device, cache_dir=args.stats_dir)
    return extractor, ref, dataset


def evaluate_fid(args, images, record, reference, device):
    """FID, Inception Score and precision/recall of the drawn images, into the .json beside --out."""
    extractor, ref, dataset = reference
    feats, logits = evaluate.features(extractor, images.split(args.batch), device)
    result = {**evaluate.fid_metrics(feats, logits, ref),
              "reference": f"{dataset} train, {int(ref['n'])} images", **record,
              "feature_extractor": "torch-fidelity inception-v3-compat"}
    path = write_json(result, args.out)
    extra = "".join(f", {k} {result[k]:.4f}" for k in ("inception_score", "precision", "recall")
                    if k in result)
    print(f"FID {result['fid']:.3f} ({args.n} samples vs {result['reference']}){extra}; wrote {path}")
    return result


def evaluate_bpd(args, model, mc, run, diffusion, device):
    """Bits/dim of the first --n images of the held-out split, in fp32 (the bound sums T terms)."""
    dataset, data_dir = run_data(args, run)
    images, labels, _ = data.load_dataset(dataset, data_dir, mc.image_size, run_default(run, "shapes_count"),
                                          train=False)
    n = min(args.n, len(images))
    g = torch.Generator().manual_seed(args.seed)
    bits, est_var = evaluate.held_out_bits(diffusion, model, images[:n], labels[:n], mc.num_classes, device,
                                           args.batch, args.strata, args.threshold, g, progress=True)
    result = {"bpd": bits.mean().item(), "sem": (bits.std() / n**0.5).item() if n > 1 else None, "n": n,
              "dataset": dataset, "split": "test", "strata": args.strata or None,
              "estimator_se": est_var**0.5 / n if args.strata else None,
              "reverse_variance": mc.reverse_variance}
    path = write_json(result, args.out)
    extra = f", estimator s.e. {result['estimator_se']:.4f}" if args.strata else ""
    print(f"bits/dim {result['bpd']:.4f} ± {result['sem'] or 0:.4f} "
          f"(s.e.m. over {n} {dataset} test images{extra}); wrote {path}")
    return result


if __name__ == "__main__":
    main()

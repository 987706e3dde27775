"""Generate images from a trained run: a PNG grid and an .npz of uint8 samples, from the EMA weights.

    python sample.py --ckpt runs/demo-.../ema.pt --n 64 --sampler dpm++ --steps 20 --guidance 2 --out grid.png
    # + FID, IS, precision/recall; on 8 GPUs; resumable: the same command continues after an interruption
    torchrun --nproc_per_node=8 sample.py --ckpt runs/x/ema.pt --eval fid --num_images 50000 --out fid/s.png
    python sample.py --ckpt runs/x/ema.pt --n 50000 --png_dir fid/png --out fid/samples.png  # + one PNG each
    python sample.py --ckpt runs/x/ema.pt --eval bpd --n 10000 --out bpd/test.png   # bits/dim, test split
    python sample.py --ckpt ddpm-cifar10-32 --eval fid --n 50000 --out fid/ho.png   # diffusers' Ho weights
    python sample.py --ckpt runs/x/ema-sigma_rel0.0800.pt --eval fid --out ema/s.png  # a post-hoc EMA's
    python sample.py --ckpt runs/x/ema.pt --export_diffusers hub/x                  # a folder diffusers loads

--ckpt: a run's ckpt.pt or ema.pt, a post-hoc EMA's weights (`python -m machinery.phema` writes them, in
ema.pt's format), all read with weights_only=True, or a diffusers model or pipeline folder (diffusers_io).
Conditional models cycle through the classes (image i: label i % classes) unless --label fixes one. The
sampler, steps, eta, guidance and thresholding default to the run's grid settings; another --sampler brings
its own steps and eta (ddpm.SAMPLERS). The network runs under bf16 autocast where the hardware has it.

Seeds: image i of a --seed s run draws all its noise from its own CPU generator, seeded from (s, i)
(sampling.image_seed): independent of the other images, the number of processes and interruptions; --batch
and --compile change it only by float rounding. --batch 0 fills the device; --compile captures each sampler
step whole, as CUDA graphs on a GPU.

The images are drawn in shards of --shard_size into <out>.shards/ (shards.py); the same command continues
from them after a crash or SIGTERM. Under torchrun every rank draws its share; rank 0 writes the .npz (arr_0
uint8 (N, H, W, 3), arr_1 labels: guided-diffusion's evaluator's layout), the grid (256 images), the PNGs
(--png_dir) and <out>.json (settings, protocol, speed), scores the images once (--eval fid: against the run's
training set, statistics cached in --stats_dir) and removes the shards (unless --keep_shards). Bad input is
one `error:` line and exit status 2, before any sampling where it can be known.
"""
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

import ddpm
import evaluate
import sampling
import unet
from machinery import cli, diffusers_io, errors, fid, files, group, runs, shards
from machinery.cli import chosen, ranged
from machinery.errors import RUN_STOPPED, UserError
from machinery.progress import Progress

GRID = 256  # images in the grid PNG
EVAL_BATCH = 256  # images per Inception or bits/dim call at most: not what --batch 0 probes
SHARD_IMAGES = 1000  # the default shard: about this many images, a whole number of batches
# how image i's noise and label are made: recorded in every shard and result; a change of it changes images
NOISE_RULE = ("per image: torch.Generator('cpu').manual_seed(image_seed(seed, i)); "
              "label i % classes or --label")


@dataclass(frozen=True)
class Settings:  # the command line, flat: --name=value or --name value; parsed once, never changed after
    ckpt: str = ""                                  # a run folder (its ema.pt), its ckpt.pt or ema.pt, a
                                                    # post-hoc EMA's weights (python -m machinery.phema), or
                                                    # a diffusers model or pipeline folder; required
    ckpt_high: str = ""                             # with model splitting: the t >= S expert (--ckpt is then
                                                    # the t < S one)
    n: int = ranged(64, 1, shards.MAX_IMAGES, True)  # images (also --num_images: under torchrun, which reads
                                                    # --n as an abbreviation of its own options)
    sampler: str | None = chosen(None, ddpm.SAMPLERS)  # a key of ddpm.SAMPLERS (above); default: the run's
                                                    # (TrainerConfig's for a diffusers folder)
    steps: int | None = ranged(None, 0, 10**6)      # sampler steps; 0 = all T; default: the run's, or another
                                                    # sampler's own
    eta: float | None = ranged(None, 0, 1, closed=True)  # noise of a sampler that takes it (DDIM: 0 =
                                                    # deterministic); default: the run's, or the sampler's
    guidance: float | None = ranged(None, 0, 100, closed=True)  # classifier-free guidance weight w; 1 =
                                                    # none; default: the run's
    threshold: Literal["static", "dynamic", "none"] | None = None  # x0 clipping: static [-1, 1], dynamic
                                                    # (Saharia et al. 2022) or none; default: the run's
                                                    # (static for --eval bpd)
    percentile: float = ranged(0.995, 1e-6, 1, closed=True)  # dynamic thresholding's percentile
    label: int = ranged(-1, -1, 2**31)              # the class to sample; -1 = cycle through all classes
    batch: int = ranged(0, 0, 2**16, True)           # images per network call; 0 = fill the device
                                                    # (sampling.device_batch); bpd: 256
    compile: Literal["auto", "false", "default", "reduce-overhead", "max-autotune"] = "auto"  # each sampler
                                                    # step compiled whole in this torch.compile mode
                                                    # (reduce-overhead: CUDA graphs); auto = reduce-overhead
                                                    # on a GPU, false on a CPU
    seed: int = ranged(0, 0, 2**63)                 # image i's noise: from (seed, i) alone
    device: str = "auto"                            # auto, cpu, cuda, cuda:N
    out: str = "samples.png"                        # the grid PNG; the .npz (and, with --eval, a .json of the
                                                    # results) beside it
    eval: Literal["samples", "fid", "bpd"] = "samples"  # samples: draw --n images; fid: also FID, IS and
                                                    # precision/recall against the training set; bpd:
                                                    # bits/dim of --n held-out images
    strata: int = ranged(0, 0, 10**6)               # bpd: estimate from 2*strata+1 network calls; 0 = all T
    dataset: str = ""                               # fid: the reference (train split), bpd: held-out data
                                                    # (test split); '' = the run's own
    data_dir: str = ""                              # fid, bpd: '' = the run's own
    stats_dir: str = ddpm.TrainerConfig.fid_stats_dir  # fid: the reference statistics' cache
    fid_ref_images: int | None = ranged(None, 0, shards.MAX_IMAGES, True)  # fid: the reference's images, a
                                                    # fixed draw from the train split; 0 = all; default:
                                                    # the run's
    shard_size: int = ranged(0, 0, shards.MAX_IMAGES, True)  # images per shard (written as done; a rerun
                                                    # continues from them); 0 = the shard folder's, else
                                                    # about 1000, a whole number of batches
    keep_shards: bool = False                       # keep <out>.shards/ once the outputs exist
    png_dir: str = ""                               # also one PNG per image into this (empty or new) folder
    inception_weights: str = ""                     # fid: a local copy of torch-fidelity's Inception weights
                                                    # (also $DDPM_INCEPTION_WEIGHTS); '' = torch.hub's cache
    export_diffusers: str = ""                      # write the EMA model as a diffusers folder
                                                    # (UNet2DModel + DDPMScheduler config) and exit


def main(argv=None):
    """The command, inside the one place a UserError becomes an `error:` line (and torchrun's group)."""
    with errors.reported():
        args = parse_args(argv)
        rank, world, device = group.join(args.device)
        try:
            with group.sigterm_interrupts():
                return command(args, rank, world, device)
        except KeyboardInterrupt:
            raise UserError(f"stopped by a signal; the finished shards are kept in "
                            f"{shards.folder_of(args.out)}: the same command continues from them",
                            RUN_STOPPED) from None
        finally:
            group.leave()


def command(args, rank, world, device):
    """Load, check everything, draw the missing shards, then write and score the images once."""
    args = dataclasses.replace(args, ckpt=checkpoint_of(args.ckpt))
    model, mc, run = load_models(args, device)
    args = resolved(args, mc, run, world)  # every check before any sampling
    if args.export_diffusers:
        return diffusers_io.export(args.export_diffusers, model, mc, unet)
    diffusion = ddpm.Diffusion(mc).to(device)
    if args.eval == "bpd":
        args = dataclasses.replace(args, batch=args.batch or EVAL_BATCH)
        return evaluate_bpd(args, model, mc, run, diffusion, device)
    batch = args.batch or sampling.device_batch(model, mc, device, args.n, args.guidance)
    args = dataclasses.replace(args, batch=batch)
    # the Inception weights and the reference statistics first: fail before sampling
    reference = (evaluate.sample_reference(*run_data(args, run), mc.image_size, device,
                                           args.inception_weights, args.stats_dir, args.fid_ref_images)
                 if args.eval == "fid" else None)
    checkpoints = sampling.checkpoint_records(model, args.ckpt, args.ckpt_high)
    plan = plan_shards(args, mc, checkpoints, rank, world)
    if reference is not None and rank == 0 and evaluate.small_n_warning(args.n):
        print(evaluate.small_n_warning(args.n), flush=True)
    record = draw_shards(args, plan, model, mc, diffusion, device, checkpoints)
    return finish(args, plan, record, reference, device)


def parse_args(argv):
    """The command line -> Settings, every field checked (cli.check_fields); --sampler's choices are
    ddpm.SAMPLERS as it stands when the arguments are parsed, so a sampler registered later is one too."""
    usage = __doc__.split("\n\n")[1] + "\n\n" + sampler_help()
    fields, _ = cli.flat_args(sys.argv[1:] if argv is None else argv, (Settings,), usage,
                              aliases={"num_images": "n"})
    args = Settings(**fields)
    cli.check_fields(args)
    if not args.ckpt:
        raise UserError("--ckpt is required: a run folder, a weights file or a diffusers folder")
    return args


def sampler_help():
    """--sampler's choices: ddpm.SAMPLERS, each with its summary."""
    return "--sampler: " + "; ".join(f"{name}: {s.summary.rstrip('.')}" for name, s in ddpm.SAMPLERS.items())


def checkpoint_of(ckpt):
    """A run folder holding an ema.pt -> that ema.pt; anything else as given."""
    return os.path.join(ckpt, "ema.pt") if os.path.isdir(ckpt) and files.is_regular(
        os.path.join(ckpt, "ema.pt")) else ckpt


def load_models(args, device):
    """-> (the EMA network, its ModelConfig, its run's TrainerConfig fields or {}) of --ckpt (a run folder:
    its ema.pt); with --ckpt_high, the two experts of a split model as one network, each for its timesteps."""
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


def resolved(args, mc, run, world=1):
    """The settings with the run's filled in where None (a sampler other than the run's brings its own steps
    and eta), as a new Settings; then refuse, before any sampling, what the model does not allow (steps
    beyond T, a --label it does not have), an --out or --png_dir that cannot be written."""
    spec, fill = ddpm.SAMPLERS.get(args.sampler), {}
    if args.eval == "bpd" and args.threshold is None:
        fill["threshold"] = "static"  # the bound as the literature has it, whatever the run samples with
    if spec is not None and args.sampler != run_default(run, "sampler"):
        fill.update(steps=spec.steps if args.steps is None else args.steps,
                    eta=(spec.eta or 0.0) if args.eta is None else args.eta)
    for name, field in (("sampler", "sampler"), ("steps", "sample_steps"), ("eta", "eta"),
                        ("guidance", "guidance"), ("threshold", "threshold"), ("fid_ref_images",) * 2):
        if getattr(args, name) is None and name not in fill:
            fill[name] = run_default(run, field)
    args = dataclasses.replace(args, **fill)
    if args.sampler not in ddpm.SAMPLERS:  # the run's own, registered where it trained but not here
        raise UserError(f"the run's sampler '{args.sampler}' is not one of {', '.join(ddpm.SAMPLERS)}: "
                        "choose one with --sampler")
    if args.eta and ddpm.SAMPLERS[args.sampler].eta is None:
        raise UserError(f"--eta {args.eta}: the sampler '{args.sampler}' takes no eta")
    cli.check_fields(args)  # the run's values too
    bounds = (("n", 1 + (args.eval == "fid"), shards.MAX_IMAGES), ("steps", 0, mc.timesteps),
              ("strata", 0, mc.timesteps - 1), ("label", -1, max(mc.num_classes - 1, -1)))
    why = {"label": f" (the model has {mc.num_classes} classes; -1 cycles)",
           "n": "; FID needs at least 2 (a covariance)" if args.eval == "fid" else ""}
    for name, lo, hi in bounds:
        if not lo <= (value := getattr(args, name)) <= hi:
            raise UserError(f"--{name} {value} is out of range: [{lo}, {hi}]{why.get(name, '')}")
    if world > 1 and (args.export_diffusers or args.eval == "bpd"):
        raise UserError("--export_diffusers and --eval bpd run in one process: start them without torchrun")
    if not args.export_diffusers:  # the outputs are checked before any sampling
        check_output(args.out)
    if not args.export_diffusers and args.eval != "bpd":
        if args.png_dir:
            shards.check_png_dir(args.png_dir, args.n, args.out)
        images = args.n * mc.image_size**2 * mc.channels  # bytes; the shards and the .npz stay to the end
        files.check_space([(args.out, 2 * images), (args.png_dir, images)], "draw fewer (--n), or free space")
    return args


# -----------------------------------------------------------------------------
# Image i: its own noise and label


def image_labels(args, mc, start, end):
    """Images start..end-1's classes: --label, else i % classes; None for an unconditional model."""
    if mc.num_classes == 0:
        return None
    if args.label >= 0:
        return torch.full((end - start,), args.label)
    return torch.arange(start, end) % mc.num_classes


def draw_batches(args, net, capture, mc, diffusion, device, start, end):
    """Yields images start..end-1 as uint8 (B, H, W, C) numpy batches of --batch, with their labels. A
    compiled step sees capture.width images only: a short batch is filled with copies of its last image."""
    labels = image_labels(args, mc, start, end)
    for a in range(start, end, args.batch):
        b = min(end, a + args.batch)
        capture.padding = capture.width - (b - a) if capture.compiled else 0
        rows = [*range(a, b), *[b - 1] * capture.padding]
        y = labels[torch.tensor(rows) - start].to(device) if labels is not None else None
        x = ddpm.sample(diffusion, net, (len(rows), mc.channels, mc.image_size, mc.image_size),
                        noise=sampling.ImageNoise(args.seed, rows), sampler=args.sampler,
                        steps=args.steps or None, y=y, guidance=args.guidance, eta=args.eta,
                        threshold=args.threshold, percentile=args.percentile, capture=capture)[: b - a]
        yield (evaluate.to_uint8(x).permute(0, 2, 3, 1).numpy(),
               y[: b - a].cpu().numpy() if y is not None else np.zeros(0, np.int64))


# -----------------------------------------------------------------------------
# The draw loop: the shards still missing (shards.py), each drawn in batches and written when done


def sampling_settings(args, mc, checkpoints, shard_size):
    """Everything that decides the images: shards of other settings are never mixed in."""
    s = {"checkpoint": checkpoints[0]["sha256"], "checkpoint_high": checkpoints[1]["sha256"] if args.ckpt_high
         else None, "sampler": args.sampler, "steps": args.steps or mc.timesteps, "eta": args.eta,
         "guidance": args.guidance, "threshold": args.threshold, "percentile": args.percentile,
         "seed": args.seed, "n": args.n, "label": args.label, "num_classes": mc.num_classes,
         "image_shape": [mc.image_size, mc.image_size, mc.channels], "shard_size": shard_size,
         "noise": NOISE_RULE}
    return json.loads(json.dumps(s))  # as the manifest holds it


def plan_shards(args, mc, checkpoints, rank, world):
    """The shards of these settings (shards.plan): --shard_size, else the folder's own, else about
    SHARD_IMAGES images, a whole number of batches."""
    default = min(args.n, args.batch * max(1, round(SHARD_IMAGES / args.batch)))
    return shards.plan(args.out, args.n, lambda size: sampling_settings(args, mc, checkpoints, size),
                       args.shard_size, default, rank, world, args.png_dir)


def draw_shards(args, plan, model, mc, diffusion, device, checkpoints):
    """This rank's share of the missing shards, each written when done. -> the settings and speed, as the
    .json records them (the speed of the images drawn by this run, over all ranks)."""
    precision = runs.resolve_precision("auto", device)  # bf16 where the hardware has it, as in training
    missing = sum(plan.ranges[k][1] - plan.ranges[k][0] for k in plan.missing)
    mine = sum(plan.ranges[k][1] - plan.ranges[k][0] for k in plan.mine(plan.missing))
    net, capture = sampling.sampling_network(args, model, mc, device, precision)
    capture.width = min(args.batch, plan.settings["shard_size"])
    if capture.compiled and mine and plan.rank == 0:
        print(f"compiling the sampler step (torch.compile, {capture.mode})", flush=True)
    made = {"batch": args.batch, "device": device.type, "autocast": precision, "torch": torch.__version__,
            "compile": capture.mode or "false"}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = args.n - missing
    who = f"rank {plan.rank}: " if plan.world > 1 else ""
    drawn, t0 = 0, time.perf_counter()
    bar = Progress(f"{who}sampling", mine, "images drawn")  # rank 0's share: a bar, or lines in a log
    for k in plan.mine(plan.missing):
        images, labels = [], []
        for x, y in draw_batches(args, net, capture, mc, diffusion, device, *plan.ranges[k]):
            images.append(x)
            labels.append(y)
            drawn += len(x)
            bar.update(len(x))
        shards.save(plan, k, np.concatenate(images), np.concatenate(labels), made)
    bar.close()
    if drawn:
        print(f"{who}{before + drawn}/{args.n} images" if plan.world == 1 else f"{who}{drawn} images drawn",
              flush=True)
    group.barrier()
    seconds = time.perf_counter() - t0
    (total,) = group.all_reduce_sum(torch.tensor([drawn, capture.evaluated], dtype=torch.float64))
    drawn_all, evaluated_all = int(total[0]), int(total[1])
    speed = sampling.sampling_speed(drawn_all, evaluated_all, seconds, device)
    same = ("n", "sampler", "steps", "guidance", "threshold", "eta", "percentile", "seed", "label", "noise")
    return {**{k: plan.settings[k] for k in same},
            "weights": checkpoints[0]["weights"], "checkpoint": checkpoints[0],
            **({"checkpoint_high": checkpoints[1]} if args.ckpt_high else {}),
            "batch": args.batch, "device": str(device), "autocast": precision, "compile": made["compile"],
            "world_size": plan.world,
            "drawn": drawn_all, "resumed": before, "shard_size": plan.settings["shard_size"], **speed}


# -----------------------------------------------------------------------------
# The outputs: PNGs and Inception features shared by the ranks, then rank 0's .npz, grid and result


def finish(args, plan, record, reference, device):
    """Every rank: the PNGs and Inception features of its share of the shards; then rank 0 alone writes the
    .npz and the grid, scores the images once, writes the .json and removes the shards. -> the result on
    rank 0, None on the others."""
    extractor = reference[0] if reference is not None else None
    local = export_shards(args, plan, extractor, device)
    group.barrier()
    group.leave()  # rank 0 finishes alone
    if plan.rank != 0:
        return None
    write_outputs(args, plan, record)
    result = (evaluate.score_samples(*shards.all_features(plan, local), reference, record)
              if reference is not None else record)
    path = write_json(result, args.out)
    if reference is not None:
        fid = f"{result['fid']:.3f}" if result["fid"] is not None else "not a number"
        print(f"FID {fid} ({args.n} samples vs {result['reference']}){evaluate.other_scores(result)}; "
              f"wrote {path}")
    if not args.keep_shards:
        shards.remove(plan)
    return result


def export_shards(args, plan, extractor, device):
    """This rank's share of all shards: one PNG per image (--png_dir) and the Inception features, kept
    in memory alone, else written beside the shards for rank 0. -> {shard: (features, logits)}."""
    local = {}
    if not args.png_dir and extractor is None:
        return local
    for k in plan.mine(range(len(plan.ranges))):
        images, _ = shards.load(plan, k)
        if args.png_dir:
            shards.write_pngs(args.png_dir, images, plan.ranges[k][0], args.n)
        if extractor is not None:
            x = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()
            feats, logits = fid.features(extractor, x.split(min(args.batch, EVAL_BATCH)), device,
                                         desc=f"Inception features, shard {k}", total=len(x))
            if plan.world == 1:
                local[k] = feats, logits
            else:
                shards.save_features(plan, k, feats.numpy(), logits.numpy())
    return local


def write_outputs(args, plan, record):
    """The .npz of all the images and the grid (shards.write_outputs); then what was drawn and how fast."""
    npz = shards.write_outputs(plan, args.out, args.n, GRID)
    record["npz"] = os.path.abspath(npz)
    pngs = f" and {args.n} PNGs in {args.png_dir}" if args.png_dir else ""
    print(f"wrote {args.out} and {npz}{pngs}: {record['n']} images, {record['sampler']} {record['steps']} "
          f"steps, guidance {record['guidance']}, {record['threshold']} thresholding")
    if record["img_per_s"] is None:
        print(f"sampling: nothing to draw, all {args.n} images were on disk")
        return
    print(f"sampling: {record['img_per_s']:.3g} img/s, {record['s_per_img']:.3g} s/image, "
          f"{record['nfe_per_image']:.0f} network evaluations per image ({record['nfe_per_s']:.3g}/s), "
          f"peak memory {record['peak_memory_bytes'] / 2**20:.0f} MiB ({record['peak_memory']})"
          + (f", {record['drawn']} drawn by this run" if record["resumed"] else ""))


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
    """-> the data to evaluate against (dataset, data_dir, shapes_count): given, else the run's own."""
    dataset, data_dir = args.dataset or run.get("dataset"), args.data_dir or run.get("data_dir")
    if not dataset:
        raise UserError(f"--eval {args.eval} needs --dataset (and --data_dir): this checkpoint does not "
                        "record its run's data")
    return dataset, data_dir, run_default(run, "shapes_count")


def write_json(result, out):
    path = os.path.splitext(out)[0] + ".json"  # beside --out, whose folder check_output made
    with files.created(path, "w") as f:
        json.dump(result, f, indent=2)
    return path


def evaluate_bpd(args, model, mc, run, diffusion, device):
    """--eval bpd: bits/dim of the first --n images of the held-out split (evaluate.held_out_result)."""
    dataset, data_dir, shapes_count = run_data(args, run)
    result = evaluate.held_out_result(diffusion, model, mc, dataset, data_dir, shapes_count, args.n,
                                      args.seed, args.batch, args.strata, args.threshold, device)
    path = write_json(result, args.out)
    extra = f", estimator s.e. {result['estimator_se']:.4f}" if args.strata else ""
    print(f"bits/dim {result['bpd']:.4f} ± {result['sem'] or 0:.4f} "
          f"(s.e.m. over {result['n']} {dataset} test images{extra}); wrote {path}")
    return result


if __name__ == "__main__":
    main()

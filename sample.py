"""Generate images from a trained run: a PNG grid and an .npz of uint8 samples, from the EMA weights.

    python sample.py --ckpt runs/demo-.../ema.pt --n 64 --sampler dpm++ --steps 20 --guidance 2 --out grid.png
    python sample.py --ckpt runs/x/ckpt.pt --n 10000 --batch 500 --out samples.png   # writes samples.npz too
    # + FID, IS, precision/recall; on 8 GPUs; resumable: the same command continues after an interruption
    torchrun --nproc_per_node=8 sample.py --ckpt runs/x/ema.pt --eval fid --num_images 50000 --out fid/s.png
    # one PNG per image as well, for other FID tools
    python sample.py --ckpt runs/x/ema.pt --n 50000 --png_dir fid/png --out fid/samples.png
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
models cycle through the classes (image i has label i % classes) unless --label fixes one. The sampler, its
steps, the guidance and the thresholding default to the run's own grid settings (its preset's; for a
diffusers folder, TrainerConfig's defaults: all T ancestral steps). --sampler takes any sampler of
ddpm.SAMPLERS (ddpm, ddim, dpm++, heun, and one registered with @ddpm.sampler before the arguments are
parsed; --help lists them). The network runs under bf16 autocast where the hardware has it (GPUs, CPUs with
AVX512-BF16/AMX), as --precision=auto does in training.

Seeds: image i of a --seed s run draws all its noise (z_T, then each stochastic step's) from its own CPU
generator, seeded from (s, i) (image_seed), so image i does not depend on the other images, on how many
processes draw them, or on interruptions; --batch and --compile change it only by the network's float
rounding (kernels differ with the batch size and when compiled), and within one --batch, --compile and device
type it is bitwise the same.

Speed: --batch 0 (the default) fills the device; the conv and dense weights are stored in bf16 where autocast
would cast them at every call (the same bits); --compile captures each sampler step whole (network,
guidance, thresholding; a split model's breaks at its expert switch) with torch.compile, on a GPU as CUDA
graphs (auto: there only), a short batch padded so that one graph serves every batch.

Shards: the images are drawn in shards of --shard_size consecutive indices, each written, as soon as it is
done, to <out>.shards/shard-NNNNNN.npz (fresh file, renamed into place) with the settings that made it;
<out>.shards/manifest.json records those settings. Re-running the same command after a crash, Ctrl-C,
SIGTERM or preemption continues from the shards on disk; a folder of other settings (checkpoint weights,
sampler, steps, eta, guidance, threshold, percentile, seed, n, label, shard size) is refused in one line.
Under torchrun every rank draws its share of the missing shards, then of the Inception features and PNGs;
rank 0 writes the .npz by streaming the shards (memory: one shard), scores it once, and removes the shard
folder (--keep_shards keeps it).

Outputs: the grid (first 256 images) at --out; <out>.npz with arr_0 = uint8 images (N, H, W, 3) and arr_1 =
int64 labels (empty for an unconditional model), the layout of guided-diffusion's evaluator; with --png_dir,
one PNG per image (NNNNNN.png); <out>.json with the settings, the protocol and the speed.

--eval fid scores the samples with torch-fidelity's InceptionV3 against the run's training set, whose
statistics are computed once and cached (--stats_dir); --inception_weights (or $DDPM_INCEPTION_WEIGHTS) gives
a local weights file. The .json records what a reader needs to compare two FIDs (evaluate.py --fid scores
any .npz, folder or dataset split against another).

Bad input (a flag out of range, an unreadable checkpoint, missing data, shards of other settings) is one
`error:` line on stderr and exit status 2, before any sampling where it can be known then (errors.reported).

Measured: see README.md (the demo grid) -- sampling cost is the network's forward FLOPs x steps.
"""
import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import signal
import time
import zipfile

import numpy as np
import torch
from tqdm import tqdm

import data
import ddpm
import diffusers_io
import errors
import evaluate
import files
import runs
from errors import RUN_STOPPED, UserError, first_line

GRID = 256  # images in the grid PNG
CPU_BATCH = 32  # --batch 0 on a CPU: 16-64 ran alike per image, 128 slower (BENCHMARKS.md)
GPU_MAX_BATCH = 1024  # --batch 0 on a GPU at most: shards (about SHARD_IMAGES) stay spread over the ranks
EVAL_BATCH = 256  # images per Inception or bits/dim call at most: not what --batch 0 probes
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")  # torch.compile's
SHARD_IMAGES = 1000  # the default shard: about this many images, a whole number of batches
# how image i's noise and label are made: recorded in every shard and result; a change of it changes images
NOISE_RULE = ("per image: torch.Generator('cpu').manual_seed(image_seed(seed, i)); "
              "label i % classes or --label")


def main(argv=None):
    """The command: each step below in turn, inside the one place a UserError becomes an `error:` line; under
    torchrun, inside this process's membership of the group."""
    with errors.reported():
        args = parse_args(argv)
        rank, world, device = join_group(args.device)
        try:
            with signals_interrupt():
                return command(args, rank, world, device)
        except KeyboardInterrupt:
            raise UserError(f"stopped by a signal; the finished shards are kept in {shard_folder(args.out)}: "
                            "the same command continues from them", RUN_STOPPED) from None
        finally:
            leave_group()


def command(args, rank, world, device):
    """Load, check everything, draw the missing shards, then write and score the images once."""
    model, mc, run = load_models(args, device)
    choose_settings(args, mc, run, world)  # every check before any sampling
    if args.export_diffusers:
        return export_diffusers(args, model, mc)
    diffusion = ddpm.Diffusion(mc).to(device)
    if args.eval == "bpd":
        args.batch = args.batch or EVAL_BATCH
        return evaluate_bpd(args, model, mc, run, diffusion, device)
    args.batch = args.batch or device_batch(args, model, mc, device, world)
    # the Inception weights and the reference statistics first: fail before sampling
    reference = fid_reference(args, mc, run, device) if args.eval == "fid" else None
    plan = plan_shards(args, mc, checkpoints_of(args, model), rank, world)
    if reference is not None and rank == 0 and evaluate.small_n_warning(args.n):
        print(evaluate.small_n_warning(args.n), flush=True)
    record = draw_shards(args, plan, model, mc, diffusion, device)
    return finish(args, plan, record, reference, device)


def parse_args(argv):
    """The command line. --sampler's choices are ddpm.SAMPLERS as it stands now, when the arguments are
    parsed, so a sampler registered after this module was imported is one too."""
    p = argparse.ArgumentParser(description="Sample images from a trained ddpm run.")
    p.add_argument("--ckpt", required=True,
                   help="a run's ckpt.pt or ema.pt, or a diffusers model or pipeline folder")
    p.add_argument("--ckpt_high", default="",
                   help="with model splitting: the t >= S expert (--ckpt is then the t < S one)")
    p.add_argument("--n", "--num_images", dest="n", type=int, default=64,
                   help="number of images (under torchrun write --num_images: torchrun takes --n for an "
                        "abbreviation of its own options)")
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
    p.add_argument("--batch", type=int, default=0,
                   help="images per network call; 0 = fill the device: on a CPU %d (the fastest per image "
                        "measured), on a GPU the largest power of two up to %d whose forward pass fits in "
                        "half its memory (probed); bpd: %d" % (CPU_BATCH, GPU_MAX_BATCH, EVAL_BATCH))
    p.add_argument("--compile", choices=["auto", "false", *COMPILE_MODES], default="auto",
                   help="capture each sampler step whole (network, guidance, thresholding) with "
                        "torch.compile in this mode (reduce-overhead: as CUDA graphs); auto = "
                        "reduce-overhead on a GPU, false on a CPU (there it compiled for 30-70 s to "
                        "run 2-5%% faster, BENCHMARKS.md)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="samples.png",
                   help="grid PNG; the .npz (and, with --eval, a .json of the results) is written beside it")
    p.add_argument("--eval", choices=["samples", "fid", "bpd"], default="samples",
                   help="samples: draw --n images; fid: also FID/IS/precision/recall of them against the "
                        "training set; bpd: bits/dim of --n held-out images (evaluate.bpd)")
    p.add_argument("--strata", type=int, default=0,
                   help="bpd: estimate from 2*strata+1 network calls; 0 = all T (exact)")
    p.add_argument("--dataset", help="fid: the reference (train split), bpd: held-out data (test split); "
                                     "default: the run's own dataset")
    p.add_argument("--data_dir", help="fid, bpd: default: the run's own data_dir")
    p.add_argument("--stats_dir", default=ddpm.TrainerConfig.fid_stats_dir,
                   help="fid: where the reference statistics are cached")
    p.add_argument("--shard_size", type=int, default=0,
                   help="images per shard (written as they are done; a rerun continues from them); default: "
                        "the shard folder's, else about 1000, a whole number of batches")
    p.add_argument("--keep_shards", action="store_true",
                   help="keep <out>.shards/ once the outputs are written (default: removed)")
    p.add_argument("--png_dir", default="",
                   help="also write one PNG per image into this (empty or new) folder")
    p.add_argument("--inception_weights", default="",
                   help="fid: a local copy of torch-fidelity's Inception weights file (also "
                        "$DDPM_INCEPTION_WEIGHTS); default: torch.hub's cache, downloaded once")
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


def choose_settings(args, mc, run, world=1):
    """Fill in --sampler, --steps, --guidance and --threshold from the run, then refuse, before any
    sampling, values out of range, an --out or --png_dir that cannot be written and a --label the model
    does not have."""
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
    if not (0 <= args.steps <= mc.timesteps) or args.n < 1 or args.batch < 0 or args.shard_size < 0:
        raise UserError(f"need n >= 1, batch >= 0, shard_size >= 0 and 0 <= steps <= {mc.timesteps}")
    for name, ok in (("guidance", 0 <= args.guidance < math.inf), ("eta", 0 <= args.eta <= 1),
                     ("percentile", 0 < args.percentile <= 1), ("seed", 0 <= args.seed < 2**63),
                     ("strata", 0 <= args.strata < mc.timesteps)):
        if not ok:  # NaN fails every comparison
            raise UserError(f"--{name} {getattr(args, name)} is out of range")
    if world > 1 and (args.export_diffusers or args.eval == "bpd"):
        raise UserError("--export_diffusers and --eval bpd run in one process: start them without torchrun")
    if not args.export_diffusers:  # the outputs are checked before any sampling
        check_output(args.out)
        if args.png_dir and args.eval != "bpd":
            check_png_dir(args.png_dir, args.n)
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


# -----------------------------------------------------------------------------
# Processes: torchrun's ranks share the work; signals stop the run between shards' writes


def join_group(device_name):
    """-> (rank, world, device). Under torchrun (WORLD_SIZE > 1) this process joins the group: NCCL
    between GPUs (one per process: LOCAL_RANK), gloo between CPU processes."""
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    if world > 1 and device_name in ("auto", "cuda") and torch.cuda.is_available():
        torch.cuda.set_device(local)  # before any CUDA work: each rank's context on its own GPU only
    device = runs.resolve_device(device_name)
    if world == 1:
        return 0, 1, device
    import torch.distributed as dist

    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        join_group.owned = True
    return dist.get_rank(), dist.get_world_size(), device


def barrier():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def leave_group():
    """Leave the group this command joined (never one its caller had made)."""
    import torch.distributed as dist

    if getattr(join_group, "owned", False) and dist.is_initialized():
        dist.destroy_process_group()
    join_group.owned = False


@contextlib.contextmanager
def signals_interrupt():
    """SIGTERM (a scheduler's preemption, torchrun passing one on) stops the run as Ctrl-C does: the shard
    being written is dropped whole (files.created), the finished ones stay."""
    def stop(signum, frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: leave signals alone
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


# -----------------------------------------------------------------------------
# Image i: its own noise and label


def image_seed(seed, i):
    """Image i's own seed in a --seed run: 63 bits of SHA-256 of 'seed/i' (two seeds share no image)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{i}".encode()).digest()[:8], "little") >> 1


class ImageNoise:
    """noise(shape) -> N(0, I) draws of shape (B, ...): row j from image indices[j]'s own CPU generator, so
    each image's draws (z_T, then one per stochastic step, in the sampler's order) are its own."""

    def __init__(self, seed, indices):
        self.generators = [torch.Generator().manual_seed(image_seed(seed, int(i))) for i in indices]

    def __call__(self, shape):
        if shape[0] != len(self.generators):
            raise ValueError(f"noise for {shape[0]} images asked of {len(self.generators)} generators")
        return torch.stack([torch.randn(tuple(shape[1:]), generator=g) for g in self.generators])


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
        x = diffusion.sample(net, (len(rows), mc.channels, mc.image_size, mc.image_size),
                             noise=ImageNoise(args.seed, rows), sampler=args.sampler,
                             steps=args.steps or None, y=y, guidance=args.guidance, eta=args.eta,
                             threshold=args.threshold, percentile=args.percentile, capture=capture)[: b - a]
        yield (evaluate.to_uint8(x).permute(0, 2, 3, 1).numpy(),
               y[: b - a].cpu().numpy() if y is not None else np.zeros(0, np.int64))


# -----------------------------------------------------------------------------
# The network as the samplers call it: the batch that fills the device, bf16 weights, the step compiled


def device_batch(args, model, mc, device, world):
    """--batch 0: CPU_BATCH on a CPU; on a GPU the largest power of two (at most GPU_MAX_BATCH and --n) whose
    forward pass, as measured on 8 images, takes at most half the device's memory; the smallest over the
    ranks."""
    if device.type != "cuda":
        return CPU_BATCH
    probe, passes = 8, 2 if mc.num_classes and args.guidance != 1 else 1
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    z = torch.randn(probe * passes, mc.channels, mc.image_size, mc.image_size, device=device)
    y = torch.zeros(len(z), dtype=torch.long, device=device) if mc.num_classes else None
    with torch.no_grad():
        ddpm.autocast_model(model, device, runs.resolve_precision("auto", device))(
            z, torch.zeros(len(z), dtype=torch.long, device=device), y)
    per_image = max(1, torch.cuda.max_memory_allocated(device) - before) / probe
    fits = max(1, int(torch.cuda.get_device_properties(device).total_memory / 2 / per_image))
    mine = torch.zeros(world, dtype=torch.float64)
    rank = torch.distributed.get_rank() if world > 1 else 0
    mine[rank] = min(2 ** int(math.log2(fits)), GPU_MAX_BATCH, args.n)
    batch = int(evaluate.all_reduce_sum(mine)[0].min())
    if rank == 0:
        print(f"--batch {batch}: at most half the GPU's memory ({per_image / 2**20:.1f} MiB an image, probed "
              f"with fp32 weights under autocast), at most {GPU_MAX_BATCH}", flush=True)
    return batch


@dataclasses.dataclass
class Capture:
    """capture(step) for Diffusion.sample: the step compiled in `mode` (None: as it is; on a GPU,
    reduce-overhead and max-autotune replay it as CUDA graphs), counting the images that go through the
    network (`evaluated`: a guided step's twice, the `padding` copies of a short batch not at all)."""
    mode: str | None
    passes: int
    graphs: bool
    evaluated: int = 0
    width: int = 0    # the one batch size a compiled step sees (draw_shards: --batch, or a shorter shard)
    padding: int = 0

    @property
    def compiled(self):
        return self.mode is not None

    def __call__(self, step):
        if self.compiled:  # one shape: a short batch is padded (draw_batches), never compiled again
            step = torch.compile(step, mode=self.mode, dynamic=False)

        def counted(z, t):
            self.evaluated += (len(z) - self.padding) * self.passes
            if self.graphs:  # a replay overwrites the last one's outputs, which the samplers keep: copies
                torch.compiler.cudagraph_mark_step_begin()
                return tuple(out.clone() for out in step(z, t))
            return step(z, t)
        return counted


def sampling_network(args, model, mc, device, precision):
    """-> (the network the samplers call, the Capture of their step). bf16 weights for the convolutions and
    dense layers where autocast would cast them to bf16 at every call (the same bits, tested); compiled, the
    weights in channels_last."""
    nets = [model.low, model.high] if isinstance(model, ddpm.SplitModel) else [model]
    mode = args.compile if args.compile != "auto" else "reduce-overhead" if device.type == "cuda" else "false"
    for net in nets:
        for layer in net.modules():
            if precision == "bf16" and isinstance(layer, (torch.nn.Conv2d, torch.nn.Linear)):
                layer.to(torch.bfloat16)
        if mode != "false":
            net.to(memory_format=torch.channels_last)
    passes = 2 if mc.num_classes and args.guidance != 1 else 1
    graphs = device.type == "cuda" and mode in ("reduce-overhead", "max-autotune")
    capture = Capture(None if mode == "false" else mode, passes, graphs)
    return ddpm.autocast_model(model, device, precision), capture


# -----------------------------------------------------------------------------
# Shards: <out>.shards/manifest.json and shard-NNNNNN.npz, each a contiguous range of image indices


@dataclasses.dataclass
class Plan:
    folder: str     # <out>.shards
    settings: dict  # what made the images: in the manifest and in every shard
    ranges: list    # (start, end) of each shard, in index order
    missing: list   # the shards not on disk when this run started
    rank: int
    world: int
    checkpoints: list  # checkpoints_of(): what the result records of the weights

    def path(self, k, kind="shard"):
        return os.path.join(self.folder, f"{kind}-{k:06d}.npz")

    def mine(self, shards):
        """This rank's share of a list of shards."""
        return list(shards)[self.rank :: self.world]


def shard_folder(out):
    return os.path.splitext(out)[0] + ".shards"


def npz_path(out):
    return os.path.splitext(out)[0] + ".npz"


def weights_sha256(model):
    """SHA-256 of a network's weights (names, dtypes, shapes and bytes, in state-dict order)."""
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        v = v.detach().cpu().contiguous()
        h.update(f"{k}:{v.dtype}:{tuple(v.shape)};".encode())
        h.update(v.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def checkpoints_of(args, model):
    """What the result records of each checkpoint: its path, the weights (EMA, or a diffusers folder's as
    published), their hash and the training step it was saved at (None where unknown)."""
    nets = [(args.ckpt, model.low if args.ckpt_high else model)]
    if args.ckpt_high:
        nets.append((args.ckpt_high, model.high))
    out = []
    for path, net in nets:
        step = None
        if not diffusers_io.is_folder(path) and files.is_regular(os.path.realpath(path)):
            with contextlib.suppress(Exception):  # only for the record: load_ema has read the file already
                step = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("step")
        out.append({"path": os.path.abspath(path), "step": step, "sha256": weights_sha256(net),
                    "weights": "diffusers folder (as published)" if diffusers_io.is_folder(path) else "EMA"})
    return out


def sampling_settings(args, mc, checkpoints, shard_size):
    """Everything that decides the images: shards of other settings are never mixed in."""
    s = {"checkpoint": checkpoints[0]["sha256"], "checkpoint_high": checkpoints[1]["sha256"] if args.ckpt_high
         else None, "sampler": args.sampler, "steps": args.steps or mc.timesteps, "eta": args.eta,
         "guidance": args.guidance, "threshold": args.threshold, "percentile": args.percentile,
         "seed": args.seed, "n": args.n, "label": args.label, "num_classes": mc.num_classes,
         "image_shape": [mc.image_size, mc.image_size, mc.channels], "shard_size": shard_size,
         "noise": NOISE_RULE}
    return json.loads(json.dumps(s))  # as the manifest holds it


def compare_settings(where, saved, settings):
    """One line naming what differs between the settings on disk and these."""
    diff = [f"{k} {saved.get(k)!r} there, {v!r} here" for k, v in settings.items() if saved.get(k) != v]
    diff += [f"{k} {saved[k]!r} there" for k in saved if k not in settings]
    if diff:
        raise UserError(f"{where} holds images of other settings ({'; '.join(diff[:4])}): never mixed in; "
                        "delete it to start afresh, or choose another --out")


def read_manifest(folder):
    """The manifest's contents, or None when there is none yet."""
    path = os.path.join(folder, "manifest.json")
    if not os.path.lexists(path):
        return None
    try:
        with files.open_regular(path, "r") as f:
            manifest = json.load(f)
        if not isinstance(manifest, dict) or not isinstance(manifest.get("settings"), dict):
            raise ValueError("no settings in it")
        return manifest
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is not a manifest sample.py wrote ({type(e).__name__}: {first_line(e)}): "
                        f"delete {folder}, or choose another --out") from None


def plan_shards(args, mc, checkpoints, rank, world):
    """The shard folder, checked against these settings (refused in one line if they differ), made with its
    manifest where new, and the shards still to draw. Every rank looks before any rank draws."""
    folder = shard_folder(args.out)
    manifest = read_manifest(folder)
    size = (args.shard_size or (manifest or {}).get("settings", {}).get("shard_size")
            or min(args.n, args.batch * max(1, round(SHARD_IMAGES / args.batch))))
    if not isinstance(size, int) or size < 1:
        raise UserError(f"{folder}/manifest.json: shard_size {size!r} is not a number of images: delete "
                        f"{folder}, or choose another --out")
    settings = sampling_settings(args, mc, checkpoints, size)
    if manifest is not None:
        compare_settings(folder, manifest["settings"], settings)
    if rank == 0:
        prepare_folder(folder, settings, manifest is None, args.png_dir)
    barrier()
    ranges = [(s, min(s + size, args.n)) for s in range(0, args.n, size)]
    plan = Plan(folder, settings, ranges, [], rank, world, checkpoints)
    plan.missing = [k for k in range(len(ranges)) if not shard_on_disk(plan, k)]
    barrier()  # no rank writes a shard before every rank has listed the missing ones
    done = sum(e - s for k, (s, e) in enumerate(ranges) if k not in plan.missing)
    if done and rank == 0:
        print(f"resuming: {done}/{args.n} images already drawn in {folder}", flush=True)
    return plan


def prepare_folder(folder, settings, new, png_dir):
    """Rank 0: the shard folder and its manifest; temporary files a killed run left behind are removed."""
    try:
        os.makedirs(folder, exist_ok=True)
        stale = re.compile(r"\.(shard|features)-\d+\.npz\.tmp-.*|\.manifest\.json\.tmp-.*|\.\d+\.png\.tmp-.*")
        for where in [folder] + ([png_dir] if png_dir else []):
            for name in os.listdir(where):
                if stale.fullmatch(name):
                    os.remove(os.path.join(where, name))
    except OSError as e:
        raise files.os_error(e, folder) from None
    if new:
        with files.created(os.path.join(folder, "manifest.json"), "w") as f:
            json.dump({"settings": settings, "written_by": "sample.py", "shards": "shard-NNNNNN.npz: images "
                       "k*shard_size .. (k+1)*shard_size-1"}, f, indent=2)


def shard_on_disk(plan, k):
    """Whether shard k is on disk, whole, from these settings; a shard of others is refused in one line,
    an unreadable one drawn again."""
    path = plan.path(k)
    if not os.path.lexists(path):
        return False
    try:
        with files.open_regular(path) as f, np.load(f) as z:
            saved, span = json.loads(str(z["settings"])), z["range"].tolist()
    except Exception as e:
        if plan.rank == 0:
            print(f"warning: {path} is unreadable ({type(e).__name__}): it is drawn again", flush=True)
        return False
    compare_settings(path, saved, plan.settings)
    return span == list(plan.ranges[k])


def save_shard(plan, k, images, labels, made):
    with files.created(plan.path(k), kept="the shards written before it are kept") as f:
        np.savez(f, images=images, labels=labels, settings=np.array(json.dumps(plan.settings)),
                 range=np.array(plan.ranges[k]), made=np.array(json.dumps(made)))


def load_shard(plan, k):
    """-> (uint8 images (B, H, W, C), labels) of shard k, checked against the plan."""
    path, (start, end) = plan.path(k), plan.ranges[k]
    try:
        with files.open_regular(path) as f, np.load(f) as z:
            saved, span = json.loads(str(z["settings"])), z["range"].tolist()
            images, labels = z["images"], z["labels"]
    except Exception as e:
        raise UserError(f"cannot read the shard {path} ({type(e).__name__}: {first_line(e)}); if the "
                        "ranks do not share one file system, give --out on one they share; else delete the "
                        "shard and run the same command again") from None
    shape = (end - start, *plan.settings["image_shape"])
    if (saved != plan.settings or span != [start, end] or images.shape != shape or images.dtype != np.uint8
            or len(labels) != (end - start if plan.settings["num_classes"] else 0)):
        raise UserError(f"{path} is not shard {k} of these settings: delete it and run the same command "
                        "again")
    return images, labels


def draw_shards(args, plan, model, mc, diffusion, device):
    """This rank's share of the missing shards, each written when done. -> the settings and speed, as the
    .json records them (the speed of the images drawn by this run, over all ranks)."""
    precision = runs.resolve_precision("auto", device)  # bf16 where the hardware has it, as in training
    missing = sum(plan.ranges[k][1] - plan.ranges[k][0] for k in plan.missing)
    mine = sum(plan.ranges[k][1] - plan.ranges[k][0] for k in plan.mine(plan.missing))
    net, capture = sampling_network(args, model, mc, device, precision)
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
    # the time left, on a terminal only (tqdm's disable=None); each rank's own share under torchrun
    bar = tqdm(total=mine, desc=f"{who}sampling", unit="img", disable=None, leave=False)
    for k in plan.mine(plan.missing):
        images, labels = [], []
        for x, y in draw_batches(args, net, capture, mc, diffusion, device, *plan.ranges[k]):
            images.append(x)
            labels.append(y)
            drawn += len(x)
            bar.update(len(x))
        save_shard(plan, k, np.concatenate(images), np.concatenate(labels), made)
    bar.close()
    if drawn:
        print(f"{who}{before + drawn}/{args.n} images" if plan.world == 1 else f"{who}{drawn} images drawn",
              flush=True)
    barrier()
    seconds = time.perf_counter() - t0
    (total,) = evaluate.all_reduce_sum(torch.tensor([float(drawn), float(capture.evaluated)],
                                                    dtype=torch.float64))
    drawn_all, evaluated_all = int(total[0]), int(total[1])
    speed = (sampling_speed(drawn_all, evaluated_all, seconds, device) if drawn_all else
             {"seconds": seconds, "img_per_s": None, "s_per_img": None, "nfe_per_image": None,
              "nfe_per_s": None, "peak_memory_bytes": None, "peak_memory": "nothing drawn: all on disk"})
    return {"n": args.n, "sampler": args.sampler, "steps": args.steps or mc.timesteps,
            "guidance": args.guidance, "threshold": args.threshold, "eta": args.eta,
            "percentile": args.percentile, "seed": args.seed, "label": args.label, "noise": NOISE_RULE,
            "weights": plan.checkpoints[0]["weights"], "checkpoint": plan.checkpoints[0],
            **({"checkpoint_high": plan.checkpoints[1]} if args.ckpt_high else {}),
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
    barrier()
    leave_group()  # rank 0 finishes alone
    if plan.rank != 0:
        return None
    write_outputs(args, plan, record)
    result = evaluate_fid(args, plan, record, reference, local) if reference is not None else record
    path = write_json(result, args.out)
    if reference is not None:
        extra = "".join(f", {k} {result[k]:.4f}" for k in ("inception_score", "precision", "recall")
                        if result.get(k) is not None)
        fid = f"{result['fid']:.3f}" if result["fid"] is not None else "not a number"
        print(f"FID {fid} ({args.n} samples vs {result['reference']}){extra}; wrote {path}")
    if not args.keep_shards:
        remove_shards(plan)
    return result


def export_shards(args, plan, extractor, device):
    """This rank's share of all shards: one PNG per image (--png_dir) and the Inception features, kept
    in memory alone, else written beside the shards for rank 0. -> {shard: (features, logits)}."""
    local = {}
    if not args.png_dir and extractor is None:
        return local
    for k in plan.mine(range(len(plan.ranges))):
        images, _ = load_shard(plan, k)
        if args.png_dir:
            write_pngs(args.png_dir, images, plan.ranges[k][0], args.n)
        if extractor is not None:
            x = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()
            feats, logits = evaluate.features(extractor, x.split(min(args.batch, EVAL_BATCH)), device,
                                              desc=f"Inception features, shard {k}", total=len(x))
            if plan.world == 1:
                local[k] = feats, logits
            else:
                with files.created(plan.path(k, "features")) as f:
                    np.savez(f, features=feats.numpy(), logits=logits.numpy())
    return local


def write_pngs(folder, images, start, n):
    """Images start.. as NNNNNN.png files (as wide as n needs, at least 6 digits), each created fresh."""
    from PIL import Image

    width = max(6, len(str(n - 1)))
    for i, img in enumerate(images, start):
        with files.created(os.path.join(folder, f"{i:0{width}d}.png")) as f:
            Image.fromarray(img).save(f, format="PNG")


def write_npz(path, shape, chunks):
    """arr_0: uint8 images `shape` (N, H, W, C), streamed from `chunks` ((images, labels) in index order:
    one chunk in memory at a time), and arr_1: the labels, as np.savez lays them out (uncompressed .npy
    entries) but with fixed timestamps, so the same images give the same bytes."""
    def entry(name):
        info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type, info.external_attr = zipfile.ZIP_STORED, 0o644 << 16
        return info

    labels, count = [], 0
    with files.created(path, kept="the shards are kept: run the same command again") as f:
        with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            with zf.open(entry("arr_0.npy"), "w", force_zip64=True) as out:
                np.lib.format.write_array_header_1_0(out, {"descr": np.lib.format.dtype_to_descr(np.dtype(
                    np.uint8)), "fortran_order": False, "shape": tuple(shape)})
                for images, y in chunks:
                    out.write(memoryview(np.ascontiguousarray(images, np.uint8)).cast("B"))
                    labels.append(np.asarray(y, np.int64))
                    count += len(images)
            if count != shape[0]:
                raise UserError(f"{count} images in the shards, {shape[0]} expected")
            with zf.open(entry("arr_1.npy"), "w", force_zip64=True) as out:
                np.lib.format.write_array(out, np.concatenate(labels), allow_pickle=False)


def write_outputs(args, plan, record):
    """The .npz of all the images (streamed from the shards) and the grid of the first 256; then what
    was drawn and how fast."""
    first = []

    def chunks():
        for k in range(len(plan.ranges)):
            images, labels = load_shard(plan, k)
            kept = sum(map(len, first))
            if kept < GRID:
                first.append(images[: GRID - kept])
            yield images, labels

    npz = npz_path(args.out)
    write_npz(npz, (args.n, *plan.settings["image_shape"]), chunks())
    grid = torch.from_numpy(np.concatenate(first)).permute(0, 3, 1, 2)
    runs.save_grid(grid.float() / 127.5 - 1, args.out)
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


def remove_shards(plan):
    """The shard folder, once the outputs are written: only the files this program names are removed, and the
    folder only if nothing else is left in it."""
    names = ["manifest.json"] + [os.path.basename(plan.path(k, kind)) for k in range(len(plan.ranges))
                                 for kind in ("shard", "features")]
    with contextlib.suppress(OSError):
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(plan.folder, name))
        os.rmdir(plan.folder)


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


def check_png_dir(folder, n):
    """--png_dir: made if missing; it may hold only this run's own PNGs (NNNNNN.png, below n: a run
    continued), so that a tool scoring the folder sees these n images and no others."""
    try:
        os.makedirs(folder, exist_ok=True)
        names = os.listdir(folder)
    except OSError as e:
        raise UserError(f"--png_dir {folder}: cannot use it ({e.strerror or e})") from None
    ours = re.compile(r"\d{6,}\.png|\.\d{6,}\.png\.tmp-.*")
    others = [f for f in names if not (ours.fullmatch(f) and int(f.strip(".").split(".")[0]) < n)]
    if others:
        raise UserError(f"--png_dir {folder} holds {len(others)} other files ({sorted(others)[0]}, ...): "
                        f"give an empty or new folder, so that whoever scores it sees these {n} images only")


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
    """--eval fid, before any sampling: -> (the Inception network, the training set's statistics, what the
    result records of them)."""
    dataset, data_dir = run_data(args, run)
    extractor = evaluate.inception(device, args.inception_weights)
    shapes = run_default(run, "shapes_count")
    ref = evaluate.reference_stats(extractor, dataset, data_dir, mc.image_size, shapes, device,
                                   cache_dir=args.stats_dir)
    record = {"dataset": dataset, "data_dir": data_dir, "split": "train", "images": int(ref["n"]),
              "image_size": mc.image_size, "sha256": evaluate.stats_sha256(ref),
              "cache": os.path.abspath(evaluate.reference_path(extractor, dataset, data_dir, mc.image_size,
                                                               shapes, args.stats_dir))}
    return extractor, ref, record


def load_features(plan, k):
    path = plan.path(k, "features")
    try:
        with files.open_regular(path) as f, np.load(f) as z:
            return torch.from_numpy(z["features"]), torch.from_numpy(z["logits"])
    except Exception as e:
        raise UserError(f"cannot read {path} ({type(e).__name__}: {first_line(e)}): do the ranks share one "
                        "file system? run the same command again") from None


def evaluate_fid(args, plan, record, reference, local):
    """FID, Inception Score and precision/recall of the images (their features, shard by shard in index
    order, from this process or the files the other ranks wrote), with the protocol: the reference, the
    network's weights, torch-fidelity's version and the settings."""
    extractor, ref, ref_record = reference
    parts = [local[k] if k in local else load_features(plan, k) for k in range(len(plan.ranges))]
    feats, logits = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    warning = evaluate.small_n_warning(args.n)
    return {**evaluate.json_safe(evaluate.fid_metrics(feats, logits, ref)),
            "reference": f"{ref_record['dataset']} train, {ref_record['images']} images",
            "reference_stats": ref_record, **record,
            "feature_extractor": "torch-fidelity inception-v3-compat",
            "inception": evaluate.extractor_record(extractor),
            "fid_note": warning.removeprefix("warning: ") or None}


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

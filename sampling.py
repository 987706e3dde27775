"""How sample.py calls the network, and how fast: each image's own noise, the network with bf16 weights,
the sampler's step compiled (on a GPU, replayed as CUDA graphs), and the speed figures sample.py and
benchmark.py --sample report.

    net, capture = sampling_network(options, model, mc, device, precision)   # options: .compile, .guidance
    x = ddpm.sample(diffusion, net, shape, noise=ImageNoise(seed, range(B)), capture=capture, ...)
    sampling_speed(B, capture.evaluated, seconds, device)   # img/s, NFE, peak memory
"""
import argparse
import contextlib
import dataclasses
import hashlib
import os
import math
import time

import torch

import ddpm
import unet
from machinery import diffusers_io, files, group, runs

CPU_BATCH = 32  # sample.py --batch 0 on a CPU: 16-64 ran alike per image, 128 slower (BENCHMARKS.md)
GPU_MAX_BATCH = 1024  # --batch 0 on a GPU at most: shards (about 1,000 images) stay spread over the ranks

# -----------------------------------------------------------------------------
# Image i: its own noise


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


# -----------------------------------------------------------------------------
# The network as the samplers call it: bf16 weights, the step compiled


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
    dense layers where autocast would cast them to bf16 at every call (the same bits, tested), but for the
    magnitude-preserving ones, which normalise their float32 weights first; compiled, the weights in
    channels_last."""
    nets = [model.low, model.high] if isinstance(model, ddpm.SplitModel) else [model]
    mode = args.compile if args.compile != "auto" else "reduce-overhead" if device.type == "cuda" else "false"
    for net in nets:
        for layer in net.modules():
            if (precision == "bf16" and isinstance(layer, (torch.nn.Conv2d, torch.nn.Linear))
                    and not isinstance(layer, (unet.MPConv, unet.MPDense))):
                layer.to(torch.bfloat16)
        if mode != "false":
            net.to(memory_format=torch.channels_last)
    passes = 2 if mc.num_classes and args.guidance != 1 else 1
    graphs = device.type == "cuda" and mode in ("reduce-overhead", "max-autotune")
    capture = Capture(None if mode == "false" else mode, passes, graphs)
    return ddpm.autocast_model(model, device, precision), capture


def device_batch(model, mc, device, n, guidance):
    """--batch 0: CPU_BATCH on a CPU; on a GPU the largest power of two (at most GPU_MAX_BATCH and n) whose
    forward pass, as measured on 8 images, takes at most half the device's memory; the smallest over the
    ranks."""
    if device.type != "cuda":
        return CPU_BATCH
    probe, passes = 8, 2 if mc.num_classes and guidance != 1 else 1
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
    rank, world = group.rank_world()
    mine = torch.zeros(world, dtype=torch.float64)
    mine[rank] = min(2 ** int(math.log2(fits)), GPU_MAX_BATCH, n)
    batch = int(group.all_reduce_sum(mine)[0].min())
    if rank == 0:
        print(f"--batch {batch}: at most half the GPU's memory ({per_image / 2**20:.1f} MiB an image, probed "
              f"with fp32 weights under autocast), at most {GPU_MAX_BATCH}", flush=True)
    return batch


# -----------------------------------------------------------------------------
# What a result records of the weights


def weights_sha256(model):
    """SHA-256 of a network's weights (names, dtypes, shapes and bytes, in state-dict order)."""
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        v = v.detach().cpu().contiguous()
        h.update(f"{k}:{v.dtype}:{tuple(v.shape)};".encode())
        h.update(v.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def checkpoint_records(model, ckpt, ckpt_high=""):
    """What sample.py's result records of each checkpoint (ckpt_high: a split model's second): its path, the
    weights (EMA, a post-hoc EMA rebuilt from the snapshots with its record, or a diffusers folder's as
    published), their hash and the training step it was saved at (None where unknown)."""
    nets = [(ckpt, model.low if ckpt_high else model)] + ([(ckpt_high, model.high)] if ckpt_high else [])
    out = []
    for path, net in nets:
        saved = {}
        if not diffusers_io.is_folder(path) and files.is_regular(os.path.realpath(path)):
            with contextlib.suppress(Exception):  # only for the record: load_ema has read the file already
                saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        saved = saved if isinstance(saved, dict) else {}
        record = {"path": os.path.abspath(path), "step": saved.get("step"), "sha256": weights_sha256(net),
                  "weights": "diffusers folder (as published)" if diffusers_io.is_folder(path) else "EMA"}
        if isinstance(saved.get("post_hoc_ema"), dict):  # python -m machinery.phema's weights
            record.update(weights="post-hoc EMA (machinery/phema.py)", post_hoc_ema=saved["post_hoc_ema"])
        out.append(record)
    return out


# -----------------------------------------------------------------------------
# How fast


def sampling_speed(n, evaluated, seconds, device):
    """img/s, s/image, network evaluations (images through the network) per image and per second, and the
    peak memory: the device's allocations on a GPU, the process's resident set on a CPU. n = 0: None."""
    if n == 0:
        return {"seconds": seconds, "img_per_s": None, "s_per_img": None, "nfe_per_image": None,
                "nfe_per_s": None, "peak_memory_bytes": None, "peak_memory": "nothing drawn: all on disk"}
    if device.type == "cuda":
        peak, what = torch.cuda.max_memory_allocated(device), "CUDA allocated"
    else:
        import resource

        peak, what = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process max RSS"
    return {"seconds": seconds, "img_per_s": n / seconds, "s_per_img": seconds / n,
            "nfe_per_image": evaluated / n, "nfe_per_s": evaluated / seconds, "peak_memory_bytes": peak,
            "peak_memory": what}


def time_sampling(mc, tc, device, precision, batch, steps):
    """sample.py's speed figures for one batch of the sampler of `tc` with a random network of `mc`, through
    sample.py's network (bf16 weights where autocast is bf16), eager (--compile false)."""
    torch.manual_seed(0)
    model = unet.UNet(mc).to(device).eval().requires_grad_(False)
    options = argparse.Namespace(compile="false", guidance=tc.guidance)
    net, capture = sampling_network(options, model, mc, device, precision)
    diffusion = ddpm.Diffusion(mc).to(device)
    y = (torch.arange(batch) % mc.num_classes).to(device) if mc.num_classes else None
    shape = (batch, mc.channels, mc.image_size, mc.image_size)
    kw = dict(sampler=tc.sampler, y=y, guidance=tc.guidance, threshold=tc.threshold, capture=capture)
    ddpm.sample(diffusion, net, shape, steps=min(2, steps or mc.timesteps), **kw)  # warm-up
    capture.evaluated = 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    ddpm.sample(diffusion, net, shape, steps=steps or None, generator=torch.Generator().manual_seed(0), **kw)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    speed = sampling_speed(batch, capture.evaluated, time.perf_counter() - t0, device)
    if device.type != "cuda":  # the process's max RSS spans every row before this one: not per row
        speed.update(peak_memory_bytes=None, peak_memory="n/a on the CPU")
    return speed

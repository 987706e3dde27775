"""Train a pixel-space diffusion model (Ho et al. 2020, "Denoising Diffusion Probabilistic Models").

    python ddpm.py                                  # the paper's CIFAR-10 run (preset 'ho')
    python ddpm.py --preset demo                    # a small model on built-in data, minutes on a CPU
    python ddpm.py --preset seed --batch_size=1024  # any field of either config, flat
    python ddpm.py --out_dir=runs/x --resume        # continue a run from its ckpt.pt
    python ddpm.py --help                           # every field with its default and meaning

Read top to bottom, in the file's order: the two configs, their presets and validation; the diffusion
maths (Diffusion: schedule, loss, samplers, bits/dim); FLOP counting and MFU; the train step and the EMA
update shared with benchmark.py; the run folder (environment, checkpoints, grids, the loss plot, diffusers
folders via load_ema); scale-out and survival (torchrun/DDP, the run lock, preemption, resume); the training
loop; the CLI. The network is in unet.py and knows nothing of the noise schedule; data is in data.py; the
evaluation (FID, bits/dim) in evaluate.py.

Measured (2026-12-03, torch 2.14.1): the demo preset learns recognisable 16x16 shapes in 1 min 45 s on
2 AVX512-BF16 CPU cores (bf16, 375 img/s); 4 min 35 s in fp32 on 2 AVX2 cores (2026-12-02). No GPU figures
yet: BENCHMARKS.md.
"""
import contextlib
import copy
import dataclasses
import inspect
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import typing
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn.functional as F

import diffusers_io
import evaluate
import unet
import data
from data import DataError, first_line, make_loader
from unet import UNet

# -----------------------------------------------------------------------------
# Configuration: every hyperparameter is spelled once, here. Presets override fields;
# the CLI and --help are generated from these fields and their comments.


@dataclass
class ModelConfig:  # the network and the diffusion process
    image_size: int = 32                                # training resolution in pixels (square)
    channels: int = 3                                   # image channels
    patch_size: int = 1                                 # P: fold PxP patches into channels (Luhman & Luhman 2022); 1 = off
    pos_emb: bool = False                               # add a fixed 2D sinusoidal position embedding after the input conv
    base_channels: int = 128                            # width of the first UNet level
    channel_mult: tuple[float, ...] = (1, 2, 2, 2)      # width multiplier per level (width = int(base x mult)); one level per entry
    num_res_blocks: int = 2                             # residual blocks per level on the way down
    attn_resolutions: tuple[int, ...] = (16,)           # resolutions of the patched grid that get self-attention
    attn_heads: int = 1                                 # attention heads; 0 = as many as the block's width / attn_head_dim
    attn_head_dim: int = 0                              # channels per head; 0 = the block's width / attn_heads
    dropout: float = 0.1                                # dropout in the residual blocks
    num_classes: int = 0                                # class-conditional with this many classes; 0 = unconditional
    p_uncond: float = 0.1                               # probability of dropping the label in training (for guidance)
    prediction: Literal["eps", "x", "v"] = "eps"        # network output: noise eps, clean image x, or v = sqrt(ab)eps - sqrt(1-ab)x
    schedule: Literal["linear", "cosine"] = "linear"    # beta_t schedule: Ho et al. linear, or Nichol & Dhariwal cosine
    timesteps: int = 1000                               # T, number of diffusion steps
    beta_start: float = 1e-4                            # beta_1 of the linear schedule
    beta_end: float = 0.02                              # beta_T of the linear schedule
    loss_weighting: Literal["none", "sqrt_snr", "min_snr"] = "none"  # none = MSE on the target; sqrt_snr / min_snr: see Diffusion
    min_snr_gamma: float = 5.0                          # gamma of the min_snr weighting (Hang et al. 2023)
    reverse_variance: Literal["large", "small"] = "large"  # sigma_t^2 of ancestral sampling: large = beta_t, small = posterior beta~_t
    split_timestep: int = 0                             # model splitting (Luhman & Luhman §3.3): experts for t < S and t >= S; 0 = one model
    split_snr: float = 0.0                              # alternative to split_timestep: S = first t with SNR(t) < split_snr (paper: 0.25); 0 = unused
    split_part: Literal["low", "high"] = "low"          # which expert this model is: 'low' trains t < S, 'high' t >= S


@dataclass
class TrainerConfig:  # the run
    dataset: Literal["cifar10", "folder", "shapes"] = "cifar10"  # training data; 'shapes' is built in and offline
    data_dir: str = "data"                              # download folder ('cifar10') or the image folder ('folder')
    shapes_count: int = data.SHAPES_COUNT               # images in the built-in 'shapes' dataset
    loader: Literal["ffcv", "torch", "resident"] = "ffcv"  # FFCV from a cached .beton; gathers from uint8 tensors in host memory; or on the device
    beton_dir: str = data.BETON_DIR                     # where .beton files are written once and reused
    fid_stats_dir: str = "data/fid_stats"               # where the training set's FID reference statistics are cached
    num_workers: int = 2                                # FFCV loader threads
    batch_size: int = 128                               # global batch size, images per optimizer step
    grad_accum_steps: int = 1                           # micro-batches per optimizer step and rank (the batch is split, not grown)
    max_steps: int = 800_000                            # optimizer steps to train for
    lr: float = 2e-4                                    # peak AdamW learning rate
    warmup_steps: int = 5000                            # linear LR warm-up, in steps; 0 = none
    lr_schedule: Literal["constant", "cosine"] = "constant"  # after warm-up: hold the LR, or cosine-decay it to 0 at max_steps
    weight_decay: float = 0.0                           # AdamW decoupled weight decay
    adam_beta1: float = 0.9                             # AdamW beta1
    adam_beta2: float = 0.999                           # AdamW beta2
    grad_clip: float = 1.0                              # max global gradient norm; 0 = no clipping
    max_nonfinite_steps: int = 20                       # steps with a non-finite loss or gradient are skipped; stop after this many in a row
    ema_decay: float = 0.9999                           # EMA of the weights, per step; 0 = the EMA is a copy of the model
    ema_warmup: bool = True                             # ramp the EMA decay as min(ema_decay, (1+step)/(10+step))
    hflip: bool = True                                  # random horizontal flips
    precision: Literal["auto", "bf16", "fp16", "tf32", "fp32"] = "auto"  # bf16 / fp16 (+ loss scaling) autocast, fp32 with TF32, true fp32; auto = bf16 where the hardware has it, fp16 on older GPUs
    compile: Literal["auto", "true", "false"] = "auto"  # torch.compile the network; auto = on a GPU, not on a CPU (minutes to compile, slower there)
    compile_mode: Literal["default", "max-autotune", "reduce-overhead"] = "default"  # torch.compile mode; reduce-overhead = CUDA graphs
    channels_last: Literal["auto", "true", "false"] = "auto"  # NHWC activations and weights; auto = true, except bf16 on a CPU (NCHW is faster there)
    cpu_threads: int = 0                                # CPU: intra-op threads for the step; 0 = torch's default (one per core)
    attention: Literal["sdpa", "math"] = "sdpa"         # attention kernel: F.scaled_dot_product_attention, or explicit softmax
    activation_checkpointing: bool = False              # recompute each residual/attention block in the backward pass: less memory, ~1 more forward
    out_dir: str = ""                                   # run folder; '' = runs/<preset>-<date>-<time>
    resume: bool = False                                # continue from out_dir/ckpt.pt
    init_from: str = ""                                 # start model and EMA weights from this checkpoint (e.g. the other expert's); '' = fresh
    log_every_steps: int = 100                          # steps between metrics.jsonl lines (each is a GPU->CPU sync)
    sample_every_steps: int = 10_000                    # steps between EMA sample grids; 0 = only at the end
    ckpt_every_steps: int = 5000                        # steps between checkpoints; 0 = only at the end
    num_samples: int = 64                               # images per sample grid
    sampler: Literal["ddpm", "ddim", "dpm++"] = "ddpm"  # sampler for the grids
    sample_steps: int = 0                               # sampler steps for the grids; 0 = all T
    guidance: float = 1.0                               # classifier-free guidance weight w for the grids and the FID samples; 1 = none
    threshold: Literal["static", "dynamic", "none"] = "static"  # x0 clipping when sampling: static [-1, 1], dynamic (Saharia et al. 2022, p99.5), none
    eval_every_steps: int = 0                           # steps between evaluations (FID, bits/dim) logged to metrics.jsonl; 0 = never
    eval_fid_samples: int = 5000                        # EMA samples for that FID, against the training set (torch-fidelity); 0 = no FID
    eval_sample_steps: int = 20                         # DPM-Solver++ steps for those samples
    eval_bpd_images: int = 1000                         # held-out images for bits/dim (the test split; 'folder': its own images); 0 = none
    eval_bpd_strata: int = 8                            # bits/dim estimated from 2 x strata + 1 network calls (Diffusion.bpd_estimate)
    seed: int = 0                                       # seeds the weights, the data order, the noise and the grids
    device: str = "auto"                                # 'auto' = cuda if present, else cpu; or 'cpu', 'cuda', 'cuda:1', ...


# What every model of Luhman & Luhman 2022 shares in the authors' code: a fixed position embedding, 64-channel
# heads at the 16x16 and 8x8 patched grids, x-prediction with the sqrt_snr weighting, AdamW at 1e-4 with no
# warm-up, no clipping and a constant 0.9999 EMA, and 250 respaced ancestral steps for sampling.
PAPER = dict(dataset="folder", pos_emb=True, attn_resolutions=(16, 8), attn_heads=0, attn_head_dim=64,
             dropout=0.0, prediction="x", loss_weighting="sqrt_snr", lr=1e-4, warmup_steps=0, grad_clip=0.0,
             ema_warmup=False, sampler="ddpm", sample_steps=250)

PRESETS = {
    # Ho et al. 2020, CIFAR-10: 35.7M parameters, the defaults above
    "ho": {},
    # the reference efficiency repo's UNet: narrow, attention everywhere, big batches
    "seed": dict(base_channels=32, channel_mult=(1, 2, 4, 8), num_res_blocks=2,
                 attn_resolutions=(32, 16, 8, 4), attn_heads=4, attn_head_dim=32, dropout=0.0,
                 batch_size=3072),
    # Luhman & Luhman 2022, as their public code (ericl122333/PatchDiffusion-Pytorch) trains and samples:
    # PAPER below, then each model's shapes from its README and th_configs.py. They train on
    # --dataset=folder --data_dir=<images>. README.md lists what remains different (ADM's learned variance
    # and scale-shift norm, the class gate, the time-embedding width) and why.
    "lsun-p2": dict(PAPER, image_size=256, patch_size=2, base_channels=128, channel_mult=(1, 2, 2, 4, 4),
                    num_res_blocks=2, batch_size=128),
    "lsun-p4": dict(PAPER, image_size=256, patch_size=4, base_channels=256, channel_mult=(1, 1, 2, 2),
                    num_res_blocks=2, batch_size=128),
    "lsun-p8": dict(PAPER, image_size=256, patch_size=8, base_channels=256, channel_mult=(1, 1.5, 2),
                    num_res_blocks=3, batch_size=128),
    # ImageNet-256: class-conditional, split at SNR 0.25 (train --split_part=low and =high, 500k steps each);
    # sampled with guidance 1.5 and dynamic thresholding, as their image_sample.py does when guided
    "imagenet-p4": dict(PAPER, image_size=256, patch_size=4, base_channels=256, channel_mult=(1, 2, 2, 2),
                        num_res_blocks=3, num_classes=1000, p_uncond=0.1, split_snr=0.25,
                        batch_size=256, max_steps=500_000, guidance=1.5, threshold="dynamic"),
    # FFHQ-1024: their 'linear0.025' schedule, Ho's linear betas ending at 0.025
    "ffhq-p4": dict(PAPER, image_size=1024, patch_size=4, base_channels=128, channel_mult=(1, 2, 2, 4, 4, 4),
                    num_res_blocks=2, beta_end=0.025, batch_size=32),
    # small enough to learn the built-in shapes at 16x16 on 2 CPU cores in 1.5 (bf16) to 5 (fp32) minutes:
    # 2x2 patches, v-prediction on the cosine schedule, class labels with guidance, a high LR and small
    # batches
    "demo": dict(dataset="shapes", image_size=16, patch_size=2, base_channels=64, channel_mult=(1, 2),
                 num_res_blocks=1, attn_resolutions=(4,), dropout=0.0, num_classes=4, prediction="v",
                 schedule="cosine", batch_size=32, max_steps=900, lr=2e-3, warmup_steps=100, ema_decay=0.999,
                 compile="false", log_every_steps=50, sample_every_steps=450, ckpt_every_steps=450,
                 sampler="ddim", sample_steps=50, guidance=2.0,
                 loader="torch"),  # in-memory shapes: no beton to write inside the 5-minute budget
}


class ConfigError(Exception):
    """An invalid config value or combination: reported to the user as one line."""


def field_comments(cls):
    """The trailing '# ...' comment of each dataclass field: the single source of --help."""
    src = inspect.getsource(cls)
    return dict(re.findall(r"^\s+(\w+):[^#\n]*#\s*(.*)$", src, flags=re.M))


def parse_value(name, text, typ):
    """Convert one CLI string to a field's type, or raise ConfigError naming the field."""
    truthy, falsy = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
    try:
        if typing.get_origin(typ) is Literal:
            choices = typing.get_args(typ)
            # e.g. channels_last: auto, true or false
            if "true" in choices and text.lower() in truthy + falsy:
                text = "true" if text.lower() in truthy else "false"
            if text not in choices:
                raise ValueError(f"choose one of {', '.join(choices)}")
            return text
        if typ is bool:
            if text.lower() not in truthy + falsy:
                raise ValueError("expected true or false")
            return text.lower() in truthy
        if typing.get_origin(typ) is tuple:
            item = typing.get_args(typ)[0]  # tuple[int, ...] or tuple[float, ...]
            return tuple(item(v) for v in text.split(",") if v.strip())
        return typ(text)
    except ValueError as e:
        raise ConfigError(f"--{name}={text}: {e}") from None


# the range of every numeric field, [lo, hi) (hi None: no upper bound); validate() adds the relations
BOUNDS = {
    "image_size": (1, None), "channels": (1, None), "patch_size": (1, None), "base_channels": (4, None),
    "num_res_blocks": (1, None), "attn_heads": (0, None), "attn_head_dim": (0, None), "dropout": (0, 1),
    "num_classes": (0, None), "p_uncond": (0, 1), "timesteps": (2, None), "beta_start": (0, 1),
    "beta_end": (0, 1), "min_snr_gamma": (1e-12, None), "split_timestep": (0, None), "split_snr": (0, None),
    "shapes_count": (1, None), "num_workers": (1, None), "batch_size": (1, None),
    "grad_accum_steps": (1, None), "max_steps": (0, None),
    "lr": (0, None), "warmup_steps": (0, None), "weight_decay": (0, None), "adam_beta1": (0, 1),
    "adam_beta2": (0, 1), "grad_clip": (0, None), "max_nonfinite_steps": (1, None), "ema_decay": (0, 1),
    "cpu_threads": (0, None), "log_every_steps": (1, None), "sample_every_steps": (0, None),
    "ckpt_every_steps": (0, None), "num_samples": (0, None), "sample_steps": (0, None), "guidance": (0, None),
    "eval_every_steps": (0, None), "eval_fid_samples": (0, None), "eval_sample_steps": (1, None),
    "eval_bpd_images": (0, None), "eval_bpd_strata": (1, None), "seed": (0, 2**63 - 1024),
}


def validate(mc, tc):
    """Catch impossible values and combinations before anything is built."""
    def check(ok, msg):
        if not ok:
            raise ConfigError(msg)

    for cfg in (mc, tc):  # Literal fields set from Python rather than the CLI
        hints = typing.get_type_hints(type(cfg))
        for f in dataclasses.fields(cfg):
            typ = hints[f.name]
            if typing.get_origin(typ) is Literal:
                v = getattr(cfg, f.name)
                check(v in typing.get_args(typ),
                      f"{f.name}='{v}': choose one of {', '.join(typing.get_args(typ))}")
    for cfg in (mc, tc):  # every number in range, NaN and inf included; relations between fields follow
        for f in dataclasses.fields(cfg):
            v = getattr(cfg, f.name)
            if f.name in BOUNDS and isinstance(v, (int, float)) and not isinstance(v, bool):
                lo, hi = BOUNDS[f.name]
                check(math.isfinite(v) and lo <= v and (hi is None or v < hi),
                      f"{f.name}={v}: must be " + (f">= {lo}" if hi is None else f"in [{lo}, {hi})"))
    check(0 <= mc.split_timestep < mc.timesteps, f"split_timestep must lie in [0, timesteps={mc.timesteps})")
    check(not (mc.split_timestep and mc.split_snr), "give split_timestep or split_snr, not both")
    try:
        split_timestep(mc)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check(len(mc.channel_mult) >= 1 and all(math.isfinite(m) and m > 0 for m in mc.channel_mult),
          "channel_mult needs one or more positive entries")
    levels = len(mc.channel_mult)
    factor = mc.patch_size * 2 ** (levels - 1)
    check(mc.image_size % factor == 0,
          f"image_size {mc.image_size} is not divisible by patch_size x 2^(levels-1) = "
          f"{mc.patch_size} x {2 ** (levels - 1)}")
    grid = [mc.image_size // mc.patch_size // 2**i for i in range(levels)]
    for r in mc.attn_resolutions:
        check(r in grid, f"attn_resolutions: {r} never occurs; the patched grid has resolutions {grid}")
    widths = [int(mc.base_channels * m) for m in mc.channel_mult]
    check(min(widths) >= 2, f"channel_mult gives widths {widths}: each must be >= 2 channels")
    check(mc.attn_heads or mc.attn_head_dim, "attn_heads=0 needs attn_head_dim > 0")
    if mc.attn_head_dim == 0:
        check(all(w % mc.attn_heads == 0 for w in widths),
              f"attn_heads {mc.attn_heads} does not divide the widths {widths}")
    if mc.attn_heads == 0:
        check(all(w % mc.attn_head_dim == 0 for w in widths),
              f"attn_head_dim {mc.attn_head_dim} does not divide the widths {widths}")
    check(0 < mc.beta_start < mc.beta_end < 1, "need 0 < beta_start < beta_end < 1")
    check(0 <= tc.sample_steps <= mc.timesteps, f"sample_steps must lie in [0, timesteps={mc.timesteps}]")
    check(not tc.resume or tc.out_dir, "--resume needs --out_dir, the run folder to continue")
    check(1 <= tc.eval_sample_steps <= mc.timesteps,
          f"eval_sample_steps must lie in [1, timesteps={mc.timesteps}]")
    check(1 <= tc.eval_bpd_strata <= mc.timesteps - 1,
          f"eval_bpd_strata must lie in [1, timesteps-1={mc.timesteps - 1}]")
    check(tc.eval_fid_samples != 1, "eval_fid_samples must be 0 or >= 2 (a covariance needs two samples)")
    check(tc.batch_size % tc.grad_accum_steps == 0,
          f"batch_size {tc.batch_size} does not divide into grad_accum_steps={tc.grad_accum_steps} "
          "micro-batches")


def parse_args(argv):
    """-> (ModelConfig, TrainerConfig, preset name). Flat: every field is --name=value."""
    hints = {**typing.get_type_hints(ModelConfig), **typing.get_type_hints(TrainerConfig)}
    args, preset = [], "ho"
    it = iter(argv)
    for a in it:
        if a in ("-h", "--help"):
            print_help()
            sys.exit(0)
        if not a.startswith("--"):
            raise ConfigError(f"unexpected argument '{a}'; fields are given as --name=value")
        name, eq, text = a[2:].partition("=")
        flag = hints.get(name) is bool or "true" in typing.get_args(hints.get(name))  # takes a bare --name
        if not eq and not flag:  # '--name value'; a bare '--flag' means true
            text = next(it, None)
            if text is None:
                raise ConfigError(f"--{name} needs a value")
        if name == "preset":
            preset = text
        else:
            args.append((name, text if eq or not flag else "true"))
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset '{preset}'; choose one of {', '.join(PRESETS)}")
    overrides = dict(PRESETS[preset])
    for name, text in args:
        if name not in hints:
            raise ConfigError(f"unknown field --{name} (see --help)")
        overrides[name] = parse_value(name, text, hints[name])
    mc = ModelConfig(**{k: v for k, v in overrides.items() if k in ModelConfig.__dataclass_fields__})
    tc = TrainerConfig(**{k: v for k, v in overrides.items() if k in TrainerConfig.__dataclass_fields__})
    validate(mc, tc)
    return mc, tc, preset


def print_help():
    print(__doc__.split("\n\n")[1])
    print(f"--preset=NAME  one of: {', '.join(PRESETS)} (default ho); later --fields override it\n")
    for cls in (ModelConfig, TrainerConfig):
        print(f"{cls.__name__}:")
        comments = field_comments(cls)
        for f in dataclasses.fields(cls):
            default = f.default if not isinstance(f.default, tuple) else ",".join(map(str, f.default))
            print(f"  {f'--{f.name}={default}':<34} {comments.get(f.name, '')}")
        print()


# -----------------------------------------------------------------------------
# The diffusion process. Notation of Ho et al. 2020: t = 0..T-1 here is the paper's t = 1..T
# (t = 0 the least noisy); alpha_bar[t] is the paper's ᾱ_t = prod_{s<=t} (1 - β_s).


def beta_schedule(cfg):
    """β_t for t = 0..T-1, in float64."""
    T = cfg.timesteps
    if cfg.schedule == "linear":  # Ho et al. §4: linear from β_1 = 1e-4 to β_T = 0.02
        return torch.linspace(cfg.beta_start, cfg.beta_end, T, dtype=torch.float64)
    # cosine, Nichol & Dhariwal 2021 eq. 17: ᾱ_t = f(t)/f(0), f(t) = cos(((t/T + s)/(1 + s)) π/2)², s = 0.008;
    # β_t = 1 - ᾱ_t/ᾱ_{t-1}, clipped to 0.999 to avoid the singularity at t = T
    s = 0.008
    f = torch.cos((torch.arange(T + 1, dtype=torch.float64) / T + s) / (1 + s) * math.pi / 2) ** 2
    return (1 - f[1:] / f[:-1]).clamp(max=0.999)


def split_timestep(cfg, snr=None):
    """S of model splitting: split_timestep, or the first t whose SNR falls below split_snr; 0 = no split."""
    if cfg.split_snr > 0:
        snr = snr if snr is not None else (lambda ab: ab / (1 - ab))(torch.cumprod(1 - beta_schedule(cfg), 0))
        below = (snr < cfg.split_snr).nonzero()
        if len(below) == 0 or below[0].item() == 0:
            raise ValueError(f"split_snr={cfg.split_snr} does not split the schedule's SNR range")
        return int(below[0].item())
    return cfg.split_timestep


class SplitModel:
    """Two experts as one `model(z_t, t, y)` for the samplers: t < S goes to `low`, t >= S to `high`."""

    def __init__(self, low, high, split):
        self.low, self.high, self.split = low, high, split

    def __call__(self, z, t, y=None):
        high = t >= self.split
        if high.all():
            return self.high(z, t, y)
        if not high.any():
            return self.low(z, t, y)
        out_low = self.low(z[~high], t[~high], y[~high] if y is not None else None)
        out_high = self.high(z[high], t[high], y[high] if y is not None else None)
        out = torch.empty(z.shape, dtype=torch.promote_types(out_low.dtype, out_high.dtype), device=z.device)
        out[~high], out[high] = out_low, out_high
        return out


def extract(buf, t, x):
    """buf[t] for a batch of timesteps t: (B,), shaped (B, 1, 1, 1) in x's dtype to broadcast against x."""
    return buf[t].to(x.dtype).view(-1, *([1] * (x.dim() - 1)))


class Diffusion(torch.nn.Module):
    """The forward process q, the training loss and the samplers, for any `model(z_t, t, y)`.

    The model returns the configured target: ε (Ho et al.), x₀, or v = √ᾱ·ε − √(1−ᾱ)·x₀
    (Salimans & Ho 2022). All three are converted exactly to (x̂₀, ε̂) by `predict_x0_eps`.
    A Module only so that .to(device) moves the float64 schedule buffers.
    """

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        betas = beta_schedule(cfg)
        alpha_bar = torch.cumprod(1 - betas, dim=0)
        snr = alpha_bar / (1 - alpha_bar)  # SNR(t) = ᾱ_t / (1 - ᾱ_t)
        buffers = {
            "betas": betas,                                    # β_t
            "alpha_bar": alpha_bar,                            # ᾱ_t
            "alpha_bar_prev": torch.cat([torch.ones(1, dtype=torch.float64),
                                         alpha_bar[:-1]]),             # ᾱ_{t-1}, ᾱ_0 = 1
            "sqrt_alpha_bar": alpha_bar.sqrt(),                # √ᾱ_t
            "sqrt_one_minus_alpha_bar": (1 - alpha_bar).sqrt(),  # √(1 - ᾱ_t)
            "loss_weight": self._loss_weight(snr),             # w_t multiplying the per-sample MSE
            "posterior_variance": (1 - torch.cat([torch.ones(1, dtype=torch.float64), alpha_bar[:-1]]))
                                  / (1 - alpha_bar) * betas,   # β̃_t = (1 - ᾱ_{t-1}) / (1 - ᾱ_t) β_t (eq. 7)
        }
        for name, value in buffers.items():
            self.register_buffer(name, value, persistent=False)
        self.split = split_timestep(cfg, snr)
        # the timesteps this model is trained on: all of them, or its expert's share [lo, hi)
        lo, hi = (0, self.split) if cfg.split_part == "low" else (self.split, cfg.timesteps)
        self.t_range = (lo, hi) if self.split else (0, cfg.timesteps)

    def _loss_weight(self, snr):
        """Per-timestep weight on the MSE of the configured target.

        The weightings are defined on the x₀-MSE, λ(t), and converted exactly to the target:
        ‖ε̂−ε‖² = SNR·‖x̂₀−x₀‖² and ‖v̂−v‖² = (SNR+1)·‖x̂₀−x₀‖², so w_t = λ(t)/c(t) with
        c = 1, SNR, SNR+1 for x, ε, v. Then
          'none':     w_t = 1 (Ho et al.'s L_simple on whichever target);
          'sqrt_snr': λ = γ_t = √SNR (Luhman & Luhman 2022 §3.2, their x-prediction loss);
          'min_snr':  λ = min(SNR, γ), γ = min_snr_gamma (Hang et al. 2023 eq. 9).
        """
        cfg = self.cfg
        if cfg.loss_weighting == "none":
            return torch.ones_like(snr)
        lam = snr.sqrt() if cfg.loss_weighting == "sqrt_snr" else snr.clamp(max=cfg.min_snr_gamma)
        c = {"x": torch.ones_like(snr), "eps": snr, "v": snr + 1}[cfg.prediction]
        return lam / c

    def q_sample(self, x0, t, noise):
        """z_t ~ q(x_t | x_0) = N(√ᾱ_t x_0, (1 - ᾱ_t) I)  (Ho et al. eq. 4)."""
        return (extract(self.sqrt_alpha_bar, t, x0) * x0
                + extract(self.sqrt_one_minus_alpha_bar, t, x0) * noise)

    def target(self, x0, noise, t):
        """What the network is trained to output at (x0, noise, t)."""
        if self.cfg.prediction == "eps":
            return noise
        if self.cfg.prediction == "x":
            return x0
        return (extract(self.sqrt_alpha_bar, t, x0) * noise
                - extract(self.sqrt_one_minus_alpha_bar, t, x0) * x0)  # v

    def predict_x0_eps(self, out, z, t, threshold="static", percentile=0.995):
        """Network output at (z_t, t) -> (x̂₀, ε̂), using z_t = √ᾱ x₀ + √(1-ᾱ) ε.

        threshold: 'static' clips x̂₀ to [-1, 1]; 'dynamic' is Saharia et al. 2022's dynamic thresholding
        (per sample, s = max(1, the `percentile` quantile of |x̂₀|), x̂₀ <- clip(x̂₀, -s, s) / s); 'none'
        leaves x̂₀ alone. After thresholding ε̂ is recomputed from x̂₀, so the pair stays consistent with z_t
        (as in Ho et al.'s and DDIM's samplers).
        """
        a, s = extract(self.sqrt_alpha_bar, t, z), extract(self.sqrt_one_minus_alpha_bar, t, z)
        if self.cfg.prediction == "eps":
            x0, eps = (z - s * out) / a, out
        elif self.cfg.prediction == "x":
            x0, eps = out, (z - a * out) / s
        else:  # v = √ᾱ ε − √(1−ᾱ) x₀  =>  x₀ = √ᾱ z − √(1−ᾱ) v,  ε = √(1−ᾱ) z + √ᾱ v
            x0, eps = a * z - s * out, s * z + a * out
        if threshold == "none":
            return x0, eps
        if threshold == "static":
            x0 = x0.clamp(-1, 1)
        elif threshold == "dynamic":
            x0 = dynamic_threshold(x0, percentile)
        else:
            raise ValueError(f"unknown threshold '{threshold}'")
        return x0, (z - a * x0) / s

    def draw(self, x0, labels, shard=(0, 1)):
        """The loss's randomness for this rank's rows of the global batch (x0 holds them): t ~ U{t_range},
        ε ~ N(0, I), and with labels the uniforms of the label dropout (else None). Drawn for the whole global
        batch from the same stream on every rank, keeping rows rank::world."""
        rank, world = shard
        B = x0.shape[0] * world
        # a split expert sees only its own range
        t = torch.randint(*self.t_range, (B,), device=x0.device)[rank::world]
        noise = torch.randn((B, *x0.shape[1:]), device=x0.device, dtype=x0.dtype)[rank::world]
        u = torch.rand(B, device=x0.device)[rank::world] if labels and self.cfg.p_uncond > 0 else None
        return t, noise, u

    def loss(self, model, x0, y=None, shard=(0, 1), draws=None):
        """L = mean_b w_t ‖target − model(z_t, t, y)‖² / D, t ~ U{0..T-1}, ε ~ N(0, I)
        (Ho et al. Algorithm 1).

        Labels are replaced by the null class with probability p_uncond, so one network learns
        both p(x|y) and p(x) for classifier-free guidance (Ho & Salimans 2022).
        Under DDP, shard = (rank, world): every rank draws t, ε and the label dropout for the whole
        global batch from the same seeded stream and keeps rows rank::world, the rows of its own images
        (data.shard), so a run does not depend on how many processes share it.
        draws: (t, ε, dropout uniforms) from self.draw for exactly these rows (micro-batches of one batch);
        None draws them here. Afterwards self.last_t and self.last_losses hold the timesteps and the
        per-sample losses (detached) for per-quartile logging.
        """
        t, noise, u = draws if draws is not None else self.draw(x0, y is not None, shard)
        z = self.q_sample(x0, t, noise)
        if u is not None:
            y = torch.where(u < self.cfg.p_uncond, torch.full_like(y, self.cfg.num_classes), y)
        out = model(z, t, y).float()
        mse = (out - self.target(x0, noise, t)).pow(2).flatten(1).mean(1)  # (B,)
        losses = self.loss_weight[t].float() * mse
        self.last_t, self.last_losses = t, losses.detach()
        return losses.mean()

    def q_posterior(self, x0, z, ab_t, ab_s):
        """Mean and variance of q(x_s | x_t, x_0) for s < t, from ᾱ_t and ᾱ_s (Ho et al. eq. 6-7).

        With α_{t|s} = ᾱ_t/ᾱ_s and β_{t|s} = 1 - α_{t|s}:
            μ̃ = √ᾱ_s β_{t|s} / (1-ᾱ_t) · x_0 + √α_{t|s} (1-ᾱ_s) / (1-ᾱ_t) · x_t,
            β̃ = (1-ᾱ_s) / (1-ᾱ_t) · β_{t|s}.
        For s = t-1 these are eq. 7 exactly; for s further back they serve respaced sampling.
        """
        beta_ts = 1 - ab_t / ab_s
        mean = (ab_s**0.5 * beta_ts / (1 - ab_t)) * x0 + ((1 - beta_ts) ** 0.5 * (1 - ab_s) / (1 - ab_t)) * z
        return mean, (1 - ab_s) / (1 - ab_t) * beta_ts

    def q_posterior_mean_variance(self, x0, z, t):
        """q(x_{t-1} | x_t, x_0) for a batch of timesteps t: (B,)  (Ho et al. eq. 7)."""
        return self.q_posterior(x0, z, extract(self.alpha_bar, t, z), extract(self.alpha_bar_prev, t, z))

    def timestep_sequence(self, steps=None, spacing="time"):
        """Descending timesteps to sample with: all T, or `steps` of them from T-1 to 0, evenly spaced
        in t ('time') or in λ = log(α/σ) = ½ log SNR ('logsnr', Lu et al. 2022's choice for
        pixel-space DPM-Solver); timesteps that coincide after rounding are taken once."""
        T = self.cfg.timesteps
        if not steps or steps == T:
            return list(range(T - 1, -1, -1))
        if not 1 <= steps <= T:
            raise ValueError(f"steps must lie in [1, {T}], got {steps}")
        if spacing == "time":
            return sorted({round(i * (T - 1) / max(steps - 1, 1)) for i in range(steps)}, reverse=True)
        lam = 0.5 * torch.log(self.alpha_bar / (1 - self.alpha_bar)).cpu()  # increasing as t falls
        targets = torch.linspace(lam[-1].item(), lam[0].item(), steps, dtype=torch.float64)
        return sorted({int((lam - v).abs().argmin()) for v in targets}, reverse=True)

    def guided(self, model, z, t, y, guidance):
        """The model output with classifier-free guidance: out_u + w (out_c - out_u)
        (Ho & Salimans 2022 eq. 6).

        Every target (ε, x, v) is affine in the output at fixed z_t, so guiding the output
        guides x̂₀ and ε̂ identically. w = 1 is plain conditional sampling: one call, no null pass.
        """
        if y is None or guidance == 1.0:
            return model(z, t, y).float()
        null = torch.full_like(y, self.cfg.num_classes)
        out_c, out_u = model(torch.cat([z, z]), torch.cat([t, t]), torch.cat([y, null])).float().chunk(2)
        return out_u + guidance * (out_c - out_u)

    @torch.no_grad()
    def sample(self, model, shape, *, sampler="ddpm", steps=None, y=None, guidance=1.0, generator=None,
               eta=0.0, threshold="static", percentile=0.995):
        """Draw images in [-1, 1] of `shape` = (B, C, H, W), starting from z_T ~ N(0, I).

        'ddpm':  ancestral sampling (Ho et al. Algorithm 2) through the posterior of eq. 7 with x̂₀
                 plugged in, and σ² = β_t ('large') or β̃_t ('small'); with `steps` < T it runs on
                 the respaced chain of those timesteps (Nichol & Dhariwal 2021 §4).
        'ddim':  Song et al. 2021 eq. 12 on `steps` evenly spaced timesteps, with
                 σ = η √((1-ᾱ_s)/(1-ᾱ_t)) √(1 - ᾱ_t/ᾱ_s); η = 0 is deterministic.
        'dpm++': DPM-Solver++(2M) (Lu et al. 2022, Algorithm 2): with α = √ᾱ, σ = √(1-ᾱ),
                 λ = log(α/σ) and h = λ_s - λ_t, z_s = (σ_s/σ_t) z_t - α_s (e^{-h} - 1) D, where
                 D = x̂₀ on the first step and (1 + 1/2r) x̂₀ - (1/2r) x̂₀_prev after, r = h_prev/h;
                 its `steps` are evenly spaced in λ (timestep_sequence 'logsnr').
        Every sampler ends with x̂₀ at t = 0, honours guidance and `threshold` (see predict_x0_eps).
        `generator` (on any device) makes the noise, and so the samples, reproducible.
        """
        device = self.alpha_bar.device
        gen_device = generator.device if generator is not None else device

        def randn():
            return torch.randn(shape, generator=generator, device=gen_device).to(device)

        ts = self.timestep_sequence(steps, spacing="logsnr" if sampler == "dpm++" else "time")
        alpha_bar = self.alpha_bar.tolist()  # python floats: the coefficients below are computed in float64
        z, x0_prev, h_prev = randn(), None, None
        for i, t in enumerate(ts):
            s = ts[i + 1] if i + 1 < len(ts) else -1  # -1: the clean image, ᾱ = 1
            ab_t, ab_s = alpha_bar[t], (alpha_bar[s] if s >= 0 else 1.0)
            tt = torch.full((shape[0],), t, device=device, dtype=torch.long)
            x0, eps = self.predict_x0_eps(self.guided(model, z, tt, y, guidance), z, tt, threshold,
                                          percentile)
            if s < 0:  # the last step lands on x̂₀ for every sampler
                z = x0
            elif sampler == "ddpm":
                mean, var_small = self.q_posterior(x0, z, ab_t, ab_s)
                var = var_small if self.cfg.reverse_variance == "small" else 1 - ab_t / ab_s
                z = mean + var**0.5 * randn()
            elif sampler == "ddim":
                sigma = eta * ((1 - ab_s) / (1 - ab_t) * (1 - ab_t / ab_s)) ** 0.5
                z = ab_s**0.5 * x0 + (1 - ab_s - sigma**2) ** 0.5 * eps
                if sigma > 0:
                    z = z + sigma * randn()
            elif sampler == "dpm++":
                lam = lambda ab: 0.5 * math.log(ab / (1 - ab))  # noqa: E731  λ = log(α/σ)
                h = lam(ab_s) - lam(ab_t)
                D = x0 if x0_prev is None else (1 + h / (2 * h_prev)) * x0 - h / (2 * h_prev) * x0_prev
                z = ((1 - ab_s) / (1 - ab_t)) ** 0.5 * z - ab_s**0.5 * math.expm1(-h) * D
                x0_prev, h_prev = x0, h
            else:
                raise ValueError(f"unknown sampler '{sampler}'")
        return z.clamp(-1, 1)


    @torch.no_grad()
    def bpd(self, model, x0, y=None, threshold="static", generator=None):
        """Bits per dimension of the full variational bound (Ho et al. eq. 5), one value per image: (B,).

        L = L_T + sum_{t>1} L_{t-1} + L_0, in nats, divided by D ln 2 (D = C·H·W), for 8-bit data in [-1, 1]:
          L_T     = KL(q(x_T|x_0) || N(0, I)), in closed form;
          L_{t-1} = KL(q(x_{t-1}|x_t, x_0) || p(x_{t-1}|x_t)) at one x_t ~ q(x_t|x_0) per t, where p
                    has the posterior mean with x̂₀ plugged in and variance β̃_t ('small') or β_t ('large');
          L_0     = -log p(x_0|x_1), a Gaussian at x̂₀ discretised into 256 bins of width 2/255, the
                    edge bins open-ended (eq. 13).
        The decoder's variance is β̃ of the paper's t = 2 for both choices, as β̃_1 = 0 (Ho et al.'s code
        does the same). T network calls per batch; `generator` fixes the x_t draws.
        """
        x0 = x0.double()
        nats = self._prior_nats(x0) + sum(self._vb_term(model, x0, t, y, threshold, generator)
                                          for t in range(self.cfg.timesteps - 1, -1, -1))
        return nats / (x0[0].numel() * math.log(2))

    @torch.no_grad()
    def bpd_estimate(self, model, x0, y=None, strata=50, threshold="static", generator=None):
        """The bound of `bpd` from 2·strata + 1 network calls instead of T: -> (bits/dim, standard error),
        each (B,).

        The KL terms t = 1..T-1 are cut into `strata` contiguous strata of n_k timesteps; two timesteps
        drawn uniformly in each give the stratified estimate Σ_k n_k (L_a + L_b)/2 of their sum, with
        variance Σ_k n_k² (L_a - L_b)²/4. The prior and decoder terms are computed exactly. Every image
        draws its own timesteps, so the images' errors are independent and their standard errors combine
        as such (one draw shared by the batch would correlate them).
        """
        x0, T = x0.double(), self.cfg.timesteps
        if not 1 <= strata <= T - 1:
            raise ValueError(f"strata must lie in [1, {T - 1}]")
        nats = self._prior_nats(x0) + self._vb_term(model, x0, 0, y, threshold, generator)
        var = torch.zeros_like(nats)
        edges = torch.linspace(1, T, strata + 1).round().long().tolist()
        for lo, hi in zip(edges[:-1], edges[1:]):
            draws = torch.randint(lo, hi, (2, x0.shape[0]), generator=generator,
                                  device=generator.device if generator else "cpu")
            a, b = (self._vb_term(model, x0, t.to(x0.device), y, threshold, generator) for t in draws)
            nats += (hi - lo) * (a + b) / 2
            var += (hi - lo) ** 2 * (a - b) ** 2 / 4
        scale = x0[0].numel() * math.log(2)
        return nats / scale, var.sqrt() / scale

    def _prior_nats(self, x0):
        """L_T = KL(q(x_T|x_0) || N(0, I)) per image, in nats."""
        ab_T = self.alpha_bar[-1].item()
        return normal_kl(ab_T**0.5 * x0, 1 - ab_T, 0.0, 1.0).flatten(1).sum(1)

    def _vb_term(self, model, x0, t, y, threshold, generator):
        """L_{t-1} of eq. 5 per image, in nats, at one x_t ~ q(x_t|x_0); t: one timestep for the batch, or
        (B,) timesteps >= 1, one per image; t = 0 is the decoder L_0."""
        tt = torch.full((x0.shape[0],), t, device=x0.device, dtype=torch.long) if isinstance(t, int) else t
        noise = torch.randn(x0.shape, generator=generator,
                            device=generator.device if generator else x0.device)
        z = self.q_sample(x0, tt, noise.to(x0.device, torch.float64))
        x0_hat, _ = self.predict_x0_eps(model(z.float(), tt, y).double(), z, tt, threshold)
        mean_p, _ = self.q_posterior_mean_variance(x0_hat, z, tt)
        if isinstance(t, int) and t == 0:  # the discretised decoder
            return -discretized_gaussian_log_likelihood(x0, mean_p,
                                                        self.posterior_variance[1].item()).flatten(1).sum(1)
        mean_q, var_q = self.q_posterior_mean_variance(x0, z, tt)
        var_p = extract(self.posterior_variance if self.cfg.reverse_variance == "small" else self.betas,
                        tt, x0)
        return normal_kl(mean_q, var_q, mean_p, var_p).flatten(1).sum(1)


def normal_kl(mean1, var1, mean2, var2):
    """KL(N(mean1, var1) || N(mean2, var2)) per element, in nats."""
    var1, var2 = torch.as_tensor(var1, dtype=torch.float64), torch.as_tensor(var2, dtype=torch.float64)
    return 0.5 * (torch.log(var2 / var1) + (var1 + (mean1 - mean2) ** 2) / var2 - 1)


def discretized_gaussian_log_likelihood(x, mean, var):
    """log P(x) for x in {-1, ..., 1} (256 levels) under N(mean, var) integrated over each pixel's bin
    [x - 1/255, x + 1/255]; the bins of -1 and 1 extend to -inf and +inf (Ho et al. eq. 13)."""
    std = var**0.5
    cdf = lambda v: 0.5 * (1 + torch.erf((v - mean) / (std * math.sqrt(2))))  # noqa: E731
    upper = torch.where(x > 0.999, torch.ones_like(x), cdf(x + 1 / 255))
    lower = torch.where(x < -0.999, torch.zeros_like(x), cdf(x - 1 / 255))
    return torch.log((upper - lower).clamp(min=1e-12))


def dynamic_threshold(x0, percentile=0.995):
    """Saharia et al. 2022 §2.3: s = max(1, quantile_p |x̂₀|) per sample; x̂₀ <- clip(x̂₀, -s, s) / s."""
    s = torch.quantile(x0.abs().flatten(1).float(), percentile, dim=1).clamp(min=1.0).to(x0.dtype)
    s = s.view(-1, *([1] * (x0.dim() - 1)))
    return torch.maximum(torch.minimum(x0, s), -s) / s


# -----------------------------------------------------------------------------
# FLOPs and MFU. FLOPs are counted, not estimated: torch.utils.flop_counter sees every
# matmul, convolution and attention call (a multiply-add counts as 2 FLOPs).

# Dense peak FLOP/s by precision, from the vendors' datasheets (no sparsity). 'fp32' is the
# non-tensor-core rate, 'tf32' the tensor-core rate with fp32 inputs. Matched by name, in order.
PEAK_FLOPS = [
    ("H200", {"bf16": 989e12, "fp16": 989e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12}),
    ("H100", {"bf16": 989e12, "fp16": 989e12, "tf32": 494.7e12, "fp32": 66.9e12}),  # SXM
    ("A100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    # SXM2; no bf16 and no TF32 ('tf32' is its plain fp32 rate), as on the T4 and P100
    ("V100", {"fp16": 125e12, "tf32": 15.7e12, "fp32": 15.7e12}),
    ("T4", {"fp16": 65e12, "tf32": 8.1e12, "fp32": 8.1e12}),
    ("P100", {"fp16": 21.2e12, "tf32": 10.6e12, "fp32": 10.6e12}),  # SXM2
]


def datasheet_peak(device, precision):
    """Datasheet peak FLOP/s of a CUDA device at `precision`, or None when the device is not in the table."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peaks.get(precision) for key, peaks in PEAK_FLOPS if key in name), None)


_matmul_cache = {}


def measure_matmul_flops(device, dtype):
    """The best FLOP/s of square matmuls in `dtype` on `device`: the practical peak MFU is measured against.

    The size grows until one matmul takes >= 50 ms (or n = 8192), so slow paths stay quick to measure.
    The best of two sweeps: on a shared machine one sweep can land in a slow spell (seen once on the CPU:
    half the usual rate, which would have doubled every MFU figure of that run).
    """
    key = (str(device), dtype)
    if key not in _matmul_cache:
        _matmul_cache[key] = max(_time_matmuls(device, dtype) for _ in range(2))
    return _matmul_cache[key]


def _time_matmuls(device, dtype):
    g = torch.Generator(device).manual_seed(0)  # its own generator: measuring never moves the training RNG
    n, best = 256, 0.0
    while True:
        a, b = (torch.randn(n, n, device=device, generator=g).to(dtype) for _ in range(2))
        timer = StepTimer(device)
        for _ in range(5):
            timer.start()
            a @ b
            timer.stop()
        sec = min(timer.read_ms()[1:]) / 1e3  # the first call is warm-up
        best = max(best, 2 * n**3 / sec)
        if sec >= 0.05 or n >= 8192:
            return best
        n *= 2


def cpu_has_bf16():
    """True where bf16 matmuls run on hardware (AVX512-BF16 or AMX); elsewhere they are emulated, ~100x
    slower."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_precision(precision, device):
    """'auto' -> 'bf16' on CUDA devices with bf16 and on CPUs with AVX512-BF16/AMX; 'fp16' (with loss
    scaling) on older GPUs (V100, T4, P100), whose fp16 tensor cores are their fast path; else 'fp32'."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    return "bf16" if device.type == "cpu" and cpu_has_bf16() else "fp32"


def peak_flops(device, precision):
    """-> (peak FLOP/s, where it came from). CUDA: the datasheet (measured when the device is unknown);
    CPU: the measured matmul rate in the compute dtype."""
    peak = datasheet_peak(device, precision)
    if peak is not None:
        return peak, f"datasheet {torch.cuda.get_device_name(device)} {precision}"
    dtype = AUTOCAST_DTYPES.get(precision, torch.float32)
    return measure_matmul_flops(device, dtype), f"measured {dtype} matmul on {device.type}"


def train_flops_per_image(mc, attention="sdpa"):
    """FLOPs of one training image, forward + backward, counted by torch.utils.flop_counter.

    Counted on the meta device (no memory, no compute) at batch 1; every op in the UNet is
    linear in the batch, so a step costs batch_size times this.
    """
    return counted_flops(mc, attention, backward=True)


def forward_flops_per_image(mc, attention="sdpa"):
    """FLOPs of one network evaluation of one image (a sampler step), counted as train_flops_per_image."""
    return counted_flops(mc, attention, backward=False)


def counted_flops(mc, attention, backward):
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = UNet(mc, attention=attention)
        x = torch.zeros(1, mc.channels, mc.image_size, mc.image_size)
        t = torch.zeros(1, dtype=torch.long)
        y = torch.zeros(1, dtype=torch.long) if mc.num_classes > 0 else None
    with FlopCounterMode(display=False) as counter:
        out = model(x, t, y)
        if backward:
            out.sum().backward()
    return counter.get_total_flops()


def mfu(flops_per_step, step_seconds, peak):
    """Model FLOPs utilisation = (FLOPs per step / seconds per step) / peak FLOP/s.

    FLOPs per step = batch_size x train_flops_per_image (forward + backward, attention included).
    """
    return flops_per_step / step_seconds / peak


class StepTimer:
    """Times code between start() and stop() without syncing: CUDA events on a GPU,
    perf_counter elsewhere (CPU ops are synchronous). read_ms() is the sync point."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.pending = []

    def start(self):
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self):
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pending.append((self._start, end))
        else:
            self.pending.append((time.perf_counter() - self._start) * 1e3)

    def read_ms(self):
        """Milliseconds of every start/stop pair since the last read. Note: a CPU-GPU sync point."""
        if self.cuda:
            torch.cuda.synchronize()
            out = [s.elapsed_time(e) for s, e in self.pending]
        else:
            out = self.pending
        self.pending = []
        return out


# -----------------------------------------------------------------------------
# One optimisation step: shared by the training loop and benchmark.py.


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # the precisions that run under autocast


def autocast(device, precision):
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES.get(precision, torch.float32),
                          enabled=precision in AUTOCAST_DTYPES)


def grad_scaler(device, precision):
    """fp16 needs loss scaling (its range ends at 65504; small gradients underflow): torch.amp.GradScaler,
    dynamic. None for the other precisions. Its state is part of the checkpoint."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None


def keep_freed_memory():
    """On a CPU with glibc: keep freed memory in the process. By default glibc hands large blocks back to the
    OS (and trims the heap) as soon as they are freed, so every training step page-faults its activations
    and gradients in afresh: ~77k minor faults per 'ho' step at batch 16 on 2 cores, ~400 with this; the
    step measured 3% to 17% faster with it, depending on what else the process allocates (BENCHMARKS.md).
    mmap threshold 32 MiB (glibc's largest), trim threshold 2 GiB. The process keeps its peak memory; blocks
    over 32 MiB are still returned. Process-wide: -> whether it took effect (False off glibc)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
        return libc.mallopt(-3, 32 << 20) == 1 and libc.mallopt(-1, 2**31 - 1) == 1
    except (OSError, AttributeError):
        return False


def autocast_model(model, device, precision):
    """model(z, t, y) under autocast: the callable the samplers are given, in training and in sample.py."""
    def net(z, t, y=None):
        with autocast(device, precision):
            return model(z, t, y)
    return net


def set_matmul_precision(precision):
    """'fp32' is true fp32 everywhere; the others let fp32 matmuls and convs use TF32 tensor cores."""
    tf32 = precision != "fp32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def resolve_channels_last(channels_last, device, precision):
    """'auto' -> NHWC, the layout tensor-core and oneDNN fp32 convolutions want, except for bf16 on a CPU:
    there the convolutions run as fast in NCHW, and ATen's NHWC GroupNorm is ~6x slower than its NCHW one
    (measured on an AVX512-BF16 CPU: the 'ho' step 5-10% faster in NCHW; BENCHMARKS.md)."""
    if channels_last != "auto":
        return channels_last == "true"
    return not (device.type == "cpu" and precision == "bf16")


def memory_format(channels_last):
    return torch.channels_last if channels_last else torch.contiguous_format


def resolve_compile(compile, device):
    """'auto' -> compile on a GPU only. On a CPU, compiling the 'ho' step took 3.6 minutes on 2 AVX512-BF16
    cores and the compiled step ran 0.89x eager's speed (and 0.96-0.98x in earlier runs; BENCHMARKS.md)."""
    if compile != "auto":
        return compile == "true"
    return device.type == "cuda"


def compiled(model, tc, device):
    """torch.compile (where resolve_compile says so) in tc.compile_mode: 'max-autotune' searches kernel
    configurations (minutes more to compile), 'reduce-overhead' replays the step's kernels as CUDA graphs.
    Inductor fuses each GroupNorm with the SiLU after it. The UNet has no graph breaks (a test checks)."""
    if not resolve_compile(tc.compile, device):
        return model
    return torch.compile(model, mode=None if tc.compile_mode == "default" else tc.compile_mode)


def make_optimizer(model, tc, device):
    fused = device.type in ("cuda", "cpu")  # fused AdamW kernels exist for both since torch 2.4
    return torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=(tc.adam_beta1, tc.adam_beta2),
                             weight_decay=tc.weight_decay, fused=fused)


def train_step(model, diffusion, opt, x0, y, precision, grad_clip, shard=(0, 1), channels_last=False,
               accum_steps=1, scaler=None):
    """Forward, backward, clip, AdamW step, all without a host sync. Returns (loss, grad norm, ok) as
    device tensors. A non-finite loss or gradient (on any rank) skips the update: `ok` is then 0, and
    the fused AdamW kernel leaves weights, moments and its step count untouched (its found_inf input).

    accum_steps k: the rank's batch runs as k micro-batches, each loss scaled by 1/k, gradients summed, and
    under DDP all-reduced once, after the last (no_sync before it). The noise, timesteps and label dropout
    are drawn once for the whole batch, so k micro-batches train as one big batch does, to float rounding.
    scaler (fp16): the loss is scaled before backward and the gradients unscaled before clipping; an
    overflow shows as a non-finite gradient norm, so it is skipped by the same `ok` (one skip mechanism),
    and the scaler then lowers its scale."""
    # a new iteration for CUDA graphs (compile_mode reduce-overhead)
    torch.compiler.cudagraph_mark_step_begin()
    # a no-op where the loader's layout is the model's
    x0 = x0.contiguous(memory_format=memory_format(channels_last))
    backward = (lambda loss: scaler.scale(loss).backward()) if scaler else (lambda loss: loss.backward())
    if accum_steps == 1:
        with autocast(x0.device, precision):
            loss = diffusion.loss(model, x0, y, shard)
        backward(loss)
    else:
        draws, m = diffusion.draw(x0, y is not None, shard), len(x0) // accum_steps
        parts, ts, losses = [], [], []
        for i in range(accum_steps):
            rows = slice(i * m, (i + 1) * m)
            last = i == accum_steps - 1
            with contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync():
                with autocast(x0.device, precision):
                    part = diffusion.loss(model, x0[rows], y[rows] if y is not None else None, shard,
                                          [d[rows] if d is not None else None for d in draws])
                backward(part / accum_steps)
            parts.append(part.detach())
            ts.append(diffusion.last_t)
            losses.append(diffusion.last_losses)
        loss = torch.stack(parts).mean()
        diffusion.last_t, diffusion.last_losses = torch.cat(ts), torch.cat(losses)
    if scaler:
        scaler.unscale_(opt)
    params = [p for g in opt.param_groups for p in g["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    ok = (torch.isfinite(loss) & torch.isfinite(grad_norm)).float()
    # DDP already agrees on the gradients; this also covers a loss that is inf on one rank only
    if shard[1] > 1:
        torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
    if opt.defaults.get("fused"):
        opt.found_inf = 1 - ok
        opt.step()
    elif ok.item():  # unfused optimizers cannot skip on the device
        opt.step()
    if scaler:
        scaler.update()  # from the overflow check unscale_ recorded: lower the scale, or grow it in time
    opt.zero_grad(set_to_none=True)
    return loss.detach(), grad_norm, ok


@torch.no_grad()
def ema_update(ema, model, decay, ok=None):
    """θ_ema <- decay θ_ema + (1 - decay) θ, as one foreach lerp over all parameters; no change where ok = 0.

    ok stays on the device: _foreach_lerp_ would read a single tensor weight with .item() (a host sync every
    step), so it gets a list of 0-dim weights, which on a CPU is as fast as the scalar form."""
    ema_params, params = list(ema.parameters()), list(model.parameters())
    weight = 1 - decay if ok is None else [(1 - decay) * ok] * len(params)
    torch._foreach_lerp_(ema_params, params, weight)


def lr_at(step, tc):
    """Linear warm-up over warmup_steps, then constant or cosine decay to 0 at max_steps."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    if tc.lr_schedule == "cosine":
        progress = (step - tc.warmup_steps) / max(1, tc.max_steps - tc.warmup_steps)
        return tc.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return tc.lr


def ema_decay_at(step, tc):
    return min(tc.ema_decay, (1 + step) / (10 + step)) if tc.ema_warmup else tc.ema_decay


# -----------------------------------------------------------------------------
# The run folder: config.json, metrics.jsonl, sample grids, loss.png, ckpt.pt (resumable) and ema.pt (export)


def environment(device):
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=os.path.dirname(os.path.abspath(__file__)),
                                  capture_output=True, text=True, timeout=10).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None

    import numpy
    import torchvision

    return {
        "git_hash": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "numpy": numpy.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "cpu_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
        "hostname": platform.node(),
        "argv": sys.argv,
    }


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


def load_checkpoint(path, device):
    """torch.load with weights_only=True (a checkpoint can never run code); a bad file is one ConfigError
    line."""
    if not os.path.exists(path):
        raise ConfigError(f"no checkpoint at {path}")
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # truncated, corrupt, or not a torch file
        raise ConfigError(f"cannot read checkpoint {path} ({type(e).__name__}: {first_line(e)})") from None


def load_ema(path, device):
    """-> (UNet with the EMA weights, ModelConfig, the run's TrainerConfig fields or {}), from a run's ckpt.pt
    or ema.pt, or from a diffusers model or pipeline folder (diffusers_io). Raises ConfigError with one clear
    line."""
    if diffusers_io.is_folder(path):
        try:
            fields, state, notes = diffusers_io.read(path)
            mc = ModelConfig(**fields)
            validate(mc, TrainerConfig())
            model = UNet(mc)
            diffusers_io.check(model, path)
            unet.load_diffusers_state_dict(model, state)
        except ValueError as e:
            raise ConfigError(f"{path}: {e}") from None
        for note in notes:
            print(f"note: {note}")
        return model.to(device).eval().requires_grad_(False), mc, {}
    ckpt = load_checkpoint(path, device)
    try:
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in ckpt["model_config"].items()}
        state = ckpt["ema"]
    except (KeyError, TypeError, AttributeError) as e:  # a torch file, but not one of ours
        raise ConfigError(f"{path} is not a ddpm checkpoint (no {e})") from None
    try:
        mc = ModelConfig(**fields)
        model = UNet(mc).to(device)
        model.load_state_dict(state)
    except (TypeError, RuntimeError) as e:
        first = first_line(e)
        raise ConfigError(f"{path}: its weights do not match its model config ({first})") from None
    return model.eval().requires_grad_(False), mc, ckpt.get("trainer_config", {})


def atomic_save(obj, path, keep_previous=False):
    """torch.save to a temporary file, fsync, rename: a crash mid-write never leaves a broken `path`.
    keep_previous: the file it replaces survives as *.prev.pt. A failed write (a full disk) removes the
    temporary file, leaves `path` as it was, and raises TrainingError."""
    tmp = f"{path}.tmp"
    try:
        torch.save(obj, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:  # torch.save reports some write failures as RuntimeError
        with contextlib.suppress(OSError):
            os.remove(tmp)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else first_line(e)
        raise TrainingError(f"could not write {path} ({reason}); the previous checkpoint is intact") from None
    if keep_previous and os.path.exists(path):
        os.replace(path, previous_path(path))
    os.replace(tmp, path)


def save_grid(images, path):
    """images in [-1, 1], (B, C, H, W) -> a square PNG grid; small images are enlarged to be visible."""
    import torchvision

    x = (images.float() + 1) / 2
    if x.shape[-1] < 64:
        x = F.interpolate(x, scale_factor=64 // x.shape[-1], mode="nearest")
    torchvision.utils.save_image(x, path, nrow=math.ceil(math.sqrt(len(x))), padding=2)


def plot_losses(metrics_path, png_path):
    try:
        import matplotlib
    except ImportError:  # a bare machine (e.g. a lent GPU box) may lack it: no plot, said once
        if not getattr(plot_losses, "warned", False):
            print("note: matplotlib is not installed; loss.png is not drawn (metrics.jsonl has the numbers)")
            plot_losses.warned = True
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in map(json.loads, open(metrics_path)) if "loss" in r]  # not the evaluation rows
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="loss")
    for q in range(4):
        ax.plot([r["step"] for r in rows], [r[f"loss_q{q}"] for r in rows], lw=0.8, alpha=0.7,
                label=f"t quartile {q}")
    ax.set(xlabel="step", ylabel="loss", yscale="log", title="training loss")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def resolve_device(name):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device={name}: not a device name") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device={name}: no CUDA device is available")
    try:  # any other missing device (mps on a machine without it, cuda:7 of 1 GPU) fails here, not mid-run
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError, ValueError) as e:
        raise ConfigError(f"--device={name}: not available here ({first_line(e)})") from None
    return device


# -----------------------------------------------------------------------------
# Scale-out and survival: torchrun/DDP, checkpoints that are never lost, preemption


class TrainingError(Exception):
    """A run that cannot go on (a checkpoint that cannot be written, a loss that stays non-finite)."""


def distributed_setup(tc):
    """-> (rank, world, device). Under torchrun (WORLD_SIZE > 1) this process joins the group, NCCL
    between GPUs (one per process: LOCAL_RANK) and gloo between CPU processes."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(tc.device)
    if world == 1:
        return 0, 1, device
    if tc.batch_size % world:
        raise ConfigError(f"batch_size {tc.batch_size} does not divide by the {world} processes "
                          "(it is the global batch, split evenly across them)")
    if tc.batch_size // world % tc.grad_accum_steps:
        raise ConfigError(f"each process's batch of {tc.batch_size // world} does not divide into "
                          f"grad_accum_steps={tc.grad_accum_steps} micro-batches")
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


def gather_rows(x, rank, world):
    """Rows rank::world of a tensor from every rank -> the whole tensor in the original order (CPU)."""
    if world == 1:
        return x.cpu()
    parts = [None] * world
    torch.distributed.all_gather_object(parts, x.cpu())
    out = torch.empty((sum(map(len, parts)), *x.shape[1:]), dtype=x.dtype)
    for r, p in enumerate(parts):
        out[r::world] = p
    return out


class Preemption:
    """SIGTERM or SIGINT asks the run to stop: the current step finishes, a checkpoint is written, and
    train() returns. Under DDP the ranks agree through an asynchronous all-reduce on a gloo group
    (host memory: no GPU sync), read one step later, so all of them stop after the same step."""

    def __init__(self, world):
        self.signal, self.work, self.previous = None, None, {}
        # Python delivers signals to the main thread only
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        self.group = torch.distributed.new_group(backend="gloo") if world > 1 else None

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.signal == "SIGINT":
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the checkpoint
        self.signal = signal.Signals(signum).name

    def requested(self):
        if self.group is None:
            return self.signal is not None
        agreed = False
        if self.work is not None:
            self.work.wait()
            agreed = bool(self.flag.item())
        self.flag = torch.tensor([float(self.signal is not None)])
        self.work = torch.distributed.all_reduce(self.flag, op=torch.distributed.ReduceOp.MAX,
                                                 group=self.group, async_op=True)
        if agreed and self.signal is None:
            self.signal = "a signal to another rank"
        return agreed

    def close(self):
        if self.work is not None:
            self.work.wait()
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def previous_path(path):
    """ckpt.pt -> ckpt.prev.pt, in the same folder, whatever the folder is called."""
    root, ext = os.path.splitext(path)
    return root + ".prev" + ext


HELD_LOCKS = set()  # the tokens of the run-folder locks this process holds


def lock_run_folder(out_dir):
    """One run per folder: out_dir/run.lock names its owner's host and pid, and a second run is refused in one
    line. A lock left by a run that is gone (same host and that pid no longer alive, or this process's own
    from a run that already ended) is stale and taken over. -> (path, token) for unlock_run_folder."""
    path = os.path.join(out_dir, "run.lock")
    me = {"host": platform.node(), "pid": os.getpid(), "token": os.urandom(8).hex(),
          "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                with open(path) as f:
                    owner = json.load(f)
            except (OSError, ValueError):  # being written this instant, or garbage: live if fresh
                fresh = time.time() - os.path.getmtime(path) < 10 if os.path.exists(path) else False
                owner = {"host": "?", "pid": "?"} if fresh else {"host": me["host"], "pid": -1}
            if not (owner.get("host") == me["host"]
                    and not process_alive(owner.get("pid"), owner.get("token"))):
                raise ConfigError(f"{out_dir} is in use by another run "
                                  f"(pid {owner.get('pid')} on {owner.get('host')}, "
                                  f"since {owner.get('since', '?')}); if that run has ended, delete {path}")
            print(f"note: taking over the stale lock of pid {owner.get('pid')}, which has ended")
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        HELD_LOCKS.add(me["token"])
        return path, me["token"]
    raise ConfigError(f"could not take the lock {path}")


def process_alive(pid, token):
    if pid == os.getpid():  # this process: alive, but the lock is stale unless a run in it still holds it
        return token in HELD_LOCKS
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError, OverflowError):
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def unlock_run_folder(lock):
    if lock is None:
        return
    path, token = lock
    HELD_LOCKS.discard(token)
    with contextlib.suppress(OSError, ValueError):
        with open(path) as f:
            mine = json.load(f).get("token") == token
        if mine:
            os.remove(path)


def load_resume_checkpoint(out_dir, device):
    """The newest readable of ckpt.pt and ckpt.prev.pt; a corrupt or missing newest one is said in one
    line."""
    path = os.path.join(out_dir, "ckpt.pt")
    try:
        return load_checkpoint(path, device), path
    except ConfigError as e:
        prev = previous_path(path)
        if not os.path.exists(prev):
            raise
        print(f"warning: {e}; resuming from the previous checkpoint {prev}")
        return load_checkpoint(prev, device), prev


def restore(ckpt, path, mc, model, ema, opt, loader, world, scaler=None):
    """Load a resumable checkpoint into the run's objects: weights, EMA, optimizer, data position, RNG
    states. -> its step. A checkpoint of a different model is one ConfigError line."""
    try:
        saved = ckpt["model_config"]
        as_list = lambda v: list(v) if isinstance(v, (tuple, list)) else v  # noqa: E731
        changed = [k for k, v in asdict(mc).items() if as_list(saved.get(k)) != as_list(v)]
        states = (ckpt["model"], ckpt["ema"], ckpt["optimizer"], dict(ckpt["loader"]), ckpt["rng"],
                  ckpt["step"])
    except (KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{path} is not a resumable ddpm checkpoint (no {e})") from None
    if changed:
        raise ConfigError(f"--resume: the model config differs from the checkpoint's in {', '.join(changed)}")
    model_state, ema_state, opt_state, position, rng, step = states
    model.load_state_dict(model_state)
    ema.load_state_dict(ema_state)
    opt.load_state_dict(opt_state)
    # fp16's loss scale goes on where it was: resume stays bitwise
    if scaler is not None and ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    saved_world = ckpt.get("world_size", 1)
    if saved_world != world:  # the position counts per-rank images: keep the same place in the epoch
        per_rank = position["index"] * saved_world // world
        position["index"] = per_rank - per_rank % loader.batch_size
        print(f"note: resuming {saved_world}-process training with {world}: the same epoch and place in it, "
              "but not bitwise the run it would have been")
    loader.load_state_dict(position)
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available() and rng["cuda"]:
        torch.cuda.set_rng_state_all(rng["cuda"])
    return step


# -----------------------------------------------------------------------------
# Training


def due(every, step):
    """An interval setting's test: every > 0 steps, and this step is one of them (0 = never)."""
    return every > 0 and step % every == 0


class Tally:
    """One log interval's loss sums and skipped steps, accumulated on the device: no host sync per step."""

    def __init__(self, device):
        # [loss, steps, 4 x loss per t quartile, 4 x samples per quartile]
        self.sums = torch.zeros(10, device=device)
        self.loss, self.steps, self.q_loss, self.q_count = (self.sums[0], self.sums[1], self.sums[2:6],
                                                            self.sums[6:10])
        self.skipped = torch.zeros((), device=device)  # steps skipped in this interval
        self.run = torch.zeros((), device=device)  # the current run of skipped steps
        self.longest = torch.zeros((), device=device)  # the longest run in this interval

    def add(self, loss, losses, quartile, ok):
        good = ok > 0  # torch.where, not x * ok: a skipped step's NaN x 0 would still be NaN
        self.loss += torch.where(good, loss, 0.0)
        self.steps += ok
        self.q_loss.index_add_(0, quartile, torch.where(good, losses, 0.0))
        self.q_count.index_add_(0, quartile, torch.ones_like(losses) * ok)
        self.skipped += 1 - ok
        self.run.mul_(1 - ok).add_(1 - ok)  # +1 on a skip, back to 0 on an applied step
        torch.maximum(self.longest, self.run, out=self.longest)

    def read(self, world):
        """-> the interval's means and counts (a host sync), and starts the next interval. The longest run of
        skips carries over: a run that spans two intervals is counted whole."""
        if world > 1:
            torch.distributed.all_reduce(self.sums)
        s, skipped, longest = self.sums.tolist(), int(self.skipped.item()), int(self.longest.item())
        out = {"loss": s[0] / s[1] if s[1] else None, "skipped": skipped, "longest_run": longest,
               "loss_q": [s[2 + q] / s[6 + q] if s[6 + q] else None for q in range(4)]}
        self.sums.zero_()
        self.skipped.zero_()
        self.longest.copy_(self.run)
        return out


def train(mc, tc, preset="custom"):
    """Train from scratch or resume; returns the run folder. Fixed sections each step:
    LR -> samples/checkpoint/eval -> forward/backward/step -> EMA -> timing/log -> stop requests.
    Under torchrun every rank runs this; rank 0 alone writes the run folder."""
    # ---- setup
    validate(mc, tc)  # as parse_args does, for configs built in Python
    rank, world, device = distributed_setup(tc)
    lead = rank == 0  # rank 0 writes the run folder and prints
    say = print if lead else (lambda *args, **kwargs: None)
    precision = resolve_precision(tc.precision, device)
    if lead and precision == "bf16" and device.type == "cpu" and not cpu_has_bf16():
        print("warning: this CPU has no AVX512-BF16/AMX; bf16 will run far slower than --precision=fp32")
    if lead and precision == "fp16" and device.type == "cpu":
        print("note: fp16 on a CPU runs for testing the loss-scaling path; it is not faster than fp32 there")
    if lead and resolve_compile(tc.compile, device) and device.type == "cpu":
        print("note: torch.compile takes minutes on a CPU and measured no faster than eager there "
              "(BENCHMARKS.md); --compile=auto or false skips it")
    set_matmul_precision(precision)
    out_dir = tc.out_dir or os.path.join("runs", f"{preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    have_ckpt = os.path.exists(ckpt_path) or os.path.exists(previous_path(ckpt_path))
    if tc.resume and not have_ckpt:
        raise ConfigError(f"--resume: no checkpoint at {ckpt_path}")
    if not tc.resume and have_ckpt:
        raise ConfigError(f"{out_dir} already holds a checkpoint: pass --resume to continue it, "
                          "or choose another --out_dir")
    if world > 1 and not tc.out_dir:
        raise ConfigError("under torchrun, give --out_dir (every rank must name the same run folder)")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:  # a path through a file, a read-only place
        raise ConfigError(f"--out_dir={out_dir}: cannot make it ({e.strerror or e})") from None

    loader, data_classes = make_loader(tc.loader, tc.dataset, tc.data_dir, mc.image_size,
                                       tc.batch_size // world, tc.seed, device, hflip=tc.hflip,
                                       with_labels=mc.num_classes > 0, shapes_count=tc.shapes_count,
                                       beton_dir=tc.beton_dir, num_workers=tc.num_workers)
    if mc.num_classes > 0 and mc.num_classes != data_classes:
        raise ConfigError(f"num_classes={mc.num_classes}, but dataset '{tc.dataset}' has "
                          f"{data_classes} classes")

    # after the data set-up, whose libraries may draw from the global RNG; same on every rank
    torch.manual_seed(tc.seed)
    if device.type == "cpu" and tc.cpu_threads:
        torch.set_num_threads(tc.cpu_threads)
    if device.type == "cpu" and not keep_freed_memory():
        say("note: not glibc: freed memory goes back to the OS, and each CPU step page-faults it in again")
    channels_last = resolve_channels_last(tc.channels_last, device, precision)
    model = UNet(mc, attention=tc.attention, activation_checkpointing=tc.activation_checkpointing)
    model = model.to(device, memory_format=memory_format(channels_last))
    ema = copy.deepcopy(model).requires_grad_(False).eval()
    diffusion = Diffusion(mc).to(device)
    opt = make_optimizer(model, tc, device)
    scaler = grad_scaler(device, precision)  # fp16 only
    step = 0
    if tc.init_from and not tc.resume:  # warm start, e.g. one expert from the other's checkpoint
        src, src_mc, _ = load_ema(tc.init_from, device)  # the averaged weights are the better starting point
        try:
            model.load_state_dict(src.state_dict())
            ema.load_state_dict(src.state_dict())
        except RuntimeError as e:
            raise ConfigError(f"--init_from {tc.init_from}: weights do not fit this model "
                              f"({first_line(e)})") from None
        differ = [f"{k}={v!r}" for k, v in asdict(src_mc).items() if getattr(mc, k) != v]
        say(f"initialised from {tc.init_from}" + (f" (a model with {', '.join(differ)})" if differ else ""))
    if tc.resume:
        ckpt, path = load_resume_checkpoint(out_dir, device)
        step = restore(ckpt, path, mc, model, ema, opt, loader, world, scaler)
        say(f"resumed {out_dir} from {os.path.basename(path)} at step {step}")
    net = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    forward = compiled(net, tc, device)
    evaluator = None
    if tc.eval_every_steps:  # built now: missing Inception weights or data fail before training, not hours in
        try:
            evaluator = evaluate.TrainingEval(mc, tc, diffusion, device)
        except evaluate.EvalError as e:
            raise ConfigError(str(e)) from None

    flops_per_step = train_flops_per_image(mc, tc.attention) * tc.batch_size
    peak, peak_source = peak_flops(device, precision)
    n_params = sum(p.numel() for p in model.parameters())

    # ---- the run's state, then what it does at intervals
    from tqdm import tqdm

    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    timer = StepTimer(device)
    # the first steps after (re)start (compilation, allocator warm-up) stay off the clock
    timing_warmup = step + 5
    tally = Tally(device)  # the log interval's loss sums and skipped steps, on the device
    # over the whole run, up to this interval
    skipped_total = ckpt.get("nonfinite_skipped", 0) if tc.resume else 0
    start_step, t_start = step, time.time()

    def save_samples(step):
        """Each rank draws its share of the grid, rank 0 saves it: no rank idles while another samples."""
        mine = torch.arange(rank, tc.num_samples, world)
        y = (mine % mc.num_classes).to(device) if mc.num_classes > 0 else None
        # the same noise every time: grids are comparable across steps
        g = torch.Generator().manual_seed(tc.seed + rank)
        x = diffusion.sample(autocast_model(ema, device, precision),
                             (len(mine), mc.channels, mc.image_size, mc.image_size),
                             sampler=tc.sampler, steps=tc.sample_steps or None, y=y, guidance=tc.guidance,
                             threshold=tc.threshold, generator=g)
        x = gather_rows(x, rank, world)
        if lead:
            save_grid(x, os.path.join(out_dir, f"samples_{step:07d}.png"))
            if os.path.exists(metrics_path):  # not before the first log line
                plot_losses(metrics_path, os.path.join(out_dir, "loss.png"))

    def save_checkpoint(step):
        if not lead:  # written once; the other ranks hold the same state
            return
        finite = torch.stack([torch.isfinite(p).all()
                              for p in [*model.parameters(), *ema.parameters()]]).all()
        # a sync, once per checkpoint; a finite step can still overflow the weights (huge lr)
        if not finite.item():
            raise TrainingError(f"the weights are no longer finite at step {step}; "
                                f"{ckpt_path} is left as it was (lower --lr, then --resume)")
        rng = {"torch": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state_all() if device.type == "cuda" else []}
        state = {"model": model.state_dict(), "ema": ema.state_dict(), "optimizer": opt.state_dict(),
                 "scaler": scaler.state_dict() if scaler else None,
                 "loader": loader.state_dict(), "world_size": world, "step": step, "rng": rng,
                 "nonfinite_skipped": skipped_total + int(tally.skipped.item()),
                 "model_config": asdict(mc), "trainer_config": asdict(tc)}
        atomic_save(state, ckpt_path, keep_previous=True)  # the one before survives as ckpt.prev.pt
        atomic_save({"ema": ema.state_dict(), "model_config": asdict(mc), "trainer_config": asdict(tc),
                     "step": step}, os.path.join(out_dir, "ema.pt"))

    def log(row):
        if lead:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")

    # ---- the loop
    lock = lock_run_folder(out_dir) if lead else None  # one run per folder: a second one is refused here
    preempt = Preemption(world)
    pbar = tqdm(total=tc.max_steps, initial=step, dynamic_ncols=True, desc="train", disable=not lead)
    try:
        if lead:
            info = {
                "preset": preset, "model": asdict(mc), "trainer": asdict(tc),
                "resolved": {"out_dir": out_dir, "device": str(device), "world_size": world,
                             "precision": precision, "channels_last": channels_last,
                             "compile": resolve_compile(tc.compile, device), "parameters": n_params,
                             "train_flops_per_image": flops_per_step // tc.batch_size,
                             "peak_flops_per_device": peak, "peak_source": peak_source,
                             "dataset_images": loader.n, "loader": type(loader).__name__},
                "environment": environment(device),
            }
            with open(os.path.join(out_dir, "config.json" if not tc.resume else f"config-resume-{step}.json"),
                      "w") as f:
                json.dump(info, f, indent=2)
            print(f"{out_dir}: {n_params / 1e6:.2f}M parameters, {loader.n} images "
                  f"({type(loader).__name__}), "
                  f"{world} x {device} {precision} {'NHWC' if channels_last else 'NCHW'}, "
                  f"{flops_per_step / tc.batch_size / 1e9:.3g} GFLOP/image fwd+bwd counted, "
                  f"MFU against {peak / 1e12:.3g} TFLOP/s per device ({peak_source})")
        if step >= tc.max_steps:
            say(f"note: {out_dir} is at step {step}, which is --max_steps={tc.max_steps} or past it: "
                "nothing to train")
        while True:
            last_step = step >= tc.max_steps

            # 1. learning rate
            lr = lr_at(step, tc)
            for g in opt.param_groups:
                g["lr"] = lr

            # 2. checkpoint, sample grid, evaluation (off the clock; the checkpoint first, so that a failure
            #    in sampling or evaluation never costs it)
            if step > start_step and (last_step or due(tc.ckpt_every_steps, step)):
                save_checkpoint(step)
            if step > start_step and tc.num_samples and (last_step or due(tc.sample_every_steps, step)):
                save_samples(step)
            if evaluator and step > start_step and (last_step or due(tc.eval_every_steps, step)):
                row = {"step": step, **evaluator(autocast_model(ema, device, precision), ema)}
                log(row)
                say(" | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                               for k, v in row.items()))
            if last_step:
                break

            # 3. forward / backward / step (skipped if anything is non-finite)
            if step >= timing_warmup:
                timer.start()
            x0, y = loader.next()
            loss, grad_norm, ok = train_step(forward, diffusion, opt, x0, y, precision, tc.grad_clip,
                                             (rank, world), channels_last, tc.grad_accum_steps, scaler)

            # 4. EMA
            ema_update(ema, model, ema_decay_at(step, tc) if tc.ema_decay > 0 else 0.0, ok)
            if step >= timing_warmup:
                timer.stop()
            tally.add(loss, diffusion.last_losses, diffusion.last_t * 4 // mc.timesteps, ok)
            step += 1
            pbar.update(1)

            # 5. log: one metrics.jsonl row per log_every_steps, the interval's only GPU->CPU sync
            if due(tc.log_every_steps, step) or step == tc.max_steps:
                # under DDP the loss sums are all-reduced; every rank skips the same steps
                t = tally.read(world)
                step_ms = statistics.median(timer.read_ms() or [float("nan")])
                row = {"step": step, "loss": t["loss"], "lr": lr,
                       **{f"loss_q{q}": t["loss_q"][q] for q in range(4)},
                       "grad_norm": grad_norm.item(), "nonfinite_skipped": t["skipped"], "step_ms": step_ms,
                       "img_per_s": tc.batch_size / step_ms * 1e3, "tflops": flops_per_step / step_ms / 1e9,
                       "mfu": mfu(flops_per_step, step_ms / 1e3, peak * world),
                       "kimg": step * tc.batch_size / 1e3, "wall_s": time.time() - t_start}
                row = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                       for k, v in row.items()}
                log(row)
                skipped_total += t["skipped"]
                if t["longest_run"] >= tc.max_nonfinite_steps:
                    raise TrainingError(f"{t['longest_run']} consecutive steps had a non-finite loss or "
                                        f"gradient (up to step {step}), all skipped; stopping. "
                                        f"The checkpoints in {out_dir} hold finite weights "
                                        "from before them: lower --lr or check the data, then --resume")
                if row["loss"] is not None and row["img_per_s"] is not None:
                    pbar.set_postfix_str(f"loss {row['loss']:.4f} | {row['img_per_s']:.0f} img/s | "
                                         f"{row['tflops']:.3f} TFLOP/s | MFU {100 * row['mfu']:.1f}%")
                elif row["loss"] is not None:
                    pbar.set_postfix_str(f"loss {row['loss']:.4f}")

            # 6. a stop request (SIGTERM, SIGINT) ends the run after this step, with a checkpoint
            if preempt.requested():
                save_checkpoint(step)
                say(f"stopped by {preempt.signal} after step {step}: checkpoint saved in {out_dir}; "
                    "continue with --resume")
                return out_dir
    finally:
        preempt.close()
        pbar.close()
        unlock_run_folder(lock)
    say(f"done: {out_dir} (step {step}, {time.time() - t_start:.0f} s)")
    return out_dir


def main(argv=None):
    """Bad input exits 2, a run that cannot go on exits 1; each with one line, never a traceback."""
    rank = f"[rank {os.environ.get('RANK')}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    try:
        mc, tc, preset = parse_args(sys.argv[1:] if argv is None else argv)
        train(mc, tc, preset)
    except (ConfigError, DataError) as e:
        print(f"{rank}error: {e}", file=sys.stderr)
        sys.exit(2)
    except TrainingError as e:
        print(f"{rank}error: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

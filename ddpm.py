"""Train a pixel-space diffusion model (Ho et al. 2020, "Denoising Diffusion Probabilistic Models").

    python ddpm.py                                  # the paper's CIFAR-10 run (preset 'ho')
    python ddpm.py --preset demo                    # a small model on built-in data, minutes on a CPU
    python ddpm.py --preset seed --batch_size=1024  # any field of either config, flat
    python ddpm.py --out_dir=runs/x --resume        # continue a run from its ckpt.pt
    python ddpm.py --help                           # every field with its default and meaning

This file holds the method, in four numbered sections read top to bottom: 1. the two configs with their
ranges, presets and CLI; 2. the diffusion maths (Diffusion: the forward process and the loss), sample() and
the samplers, one function each in the SAMPLERS table; 3. build() and the one training iteration that
benchmark.py measures too; 4. the training loop. Beside it stand unet.py, the network, which knows nothing
of the noise schedule, data.py and evaluate.py; below them the machinery/ package (README.md's file table):
runs (the run folder, devices, preemption), checkpoints, group (torchrun), cli, mfu (FLOPs, peaks, timing),
beton, fid, phema (post-hoc EMA), diffusers_io.

Measured (2026-12-03, torch 2.14.1): the demo preset learns recognisable 16x16 shapes in 1 min 45 s on
2 AVX512-BF16 CPU cores (bf16, 375 img/s). No GPU figures yet: BENCHMARKS.md.
"""
import contextlib
import copy
import functools
import math
import os
import statistics
import sys
import time
import typing
from dataclasses import asdict, dataclass
from typing import Literal

import torch

import data
import evaluate
import unet
from data import make_loader
from machinery import checkpoints, cli, diffusers_io, fid, files, group, mfu, phema, runs
from machinery.cli import chosen, ranged
from machinery.errors import RUN_STOPPED, UserError, first_line, reported
from unet import UNet

# -----------------------------------------------------------------------------
# 1. Configuration: every hyperparameter is spelled once, here, with its range or choices beside it. Presets
# override fields; the CLI and --help are generated from these fields and their comments.


SAMPLERS = {}  # sampler name -> Sampler; section 2 fills it (@sampler), and TrainerConfig.sampler reads it


@dataclass
class ModelConfig:  # the network and the diffusion process
    image_size: int = ranged(32, 1, data.MAX_IMAGE_SIZE + 1)  # training resolution in pixels (square)
    channels: int = ranged(3, 1, 65)                    # image channels
    patch_size: int = ranged(1, 1, 65)                  # P: fold PxP patches into channels (Luhman & Luhman
                                                        # 2022); 1 = off
    pos_emb: bool = False                               # add a fixed 2D sinusoidal position embedding after
                                                        # the input conv
    base_channels: int = ranged(128, 4, 8193)           # width of the first UNet level
    channel_mult: tuple[float, ...] = (1, 2, 2, 2)      # width multiplier per level (width = int(base x
                                                        # mult)); one level per entry
    num_res_blocks: int = ranged(2, 1, 65)              # residual blocks per level on the way down
    attn_resolutions: tuple[int, ...] = (16,)           # resolutions of the patched grid that get
                                                        # self-attention
    attn_heads: int = ranged(1, 0, 1025)                # attention heads; 0 = as many as the block's width /
                                                        # attn_head_dim
    attn_head_dim: int = ranged(0, 0, 8193)             # channels per head; 0 = the block's width /
                                                        # attn_heads
    dropout: float = ranged(0.1, 0, 1)                  # dropout in the residual blocks
    norm_groups: int = ranged(0, 0, 1024)               # GroupNorm groups in every layer (diffusers'
                                                        # norm_num_groups); 0 = per width: 32, fewer below 64
    scale_shift_norm: bool = False                      # the time embedding scales and shifts the residual
                                                        # block's second norm (Dhariwal & Nichol 2021, ADM);
                                                        # off: it is added before that norm (Ho et al.)
    resample: Literal["conv", "resblock"] = "conv"     # between levels: Ho et al.'s stride-2 conv down and
                                                        # nearest + conv up, or BigGAN's residual block that
                                                        # pools / upsamples inside (Brock et al. 2019; ADM's
                                                        # resblock_updown)
    mp_layers: bool = False                             # EDM2's magnitude-preserving layers (Karras et al.
                                                        # 2024 §2, configs D, E, G; unet.py), Ho's GroupNorms
                                                        # kept: the LR is then relative (EDM2: 1e-2)

    num_classes: int = ranged(0, 0, 10**6)              # class-conditional with this many classes; 0 =
                                                        # unconditional
    p_uncond: float = ranged(0.1, 0, 1)                 # probability of dropping the label in training (for
                                                        # guidance)
    prediction: Literal["eps", "x", "v", "edm"] = "eps"  # network output: noise eps, clean image x, v =
                                                        # sqrt(ab)eps - sqrt(1-ab)x, or F of Karras et al.
                                                        # 2022's preconditioning (edm: Diffusion.net_input)
    sigma_data: float = ranged(0.5, 1e-3, 100)          # sigma_data of the edm prediction and weighting
                                                        # (Karras et al. 2022 Table 1: 0.5 for images in
                                                        # [-1, 1])
    t_sampling: Literal["uniform", "lognormal"] = "uniform"  # training timesteps: t ~ U{0..T-1} (Ho et al.),
                                                        # or ln sigma_t ~ N(p_mean, p_std^2) (Karras et al.
                                                        # 2022 Table 1), sigma_t = sqrt((1-ab)/ab)
    p_mean: float = ranged(-1.2, -20, 20)               # P_mean of the lognormal timesteps (Karras et al.
                                                        # 2022: -1.2)
    p_std: float = ranged(1.2, 0.01, 20)                # P_std of the lognormal timesteps (Karras et al.
                                                        # 2022: 1.2)
    schedule: Literal["linear", "cosine"] = "linear"    # beta_t schedule: Ho et al. linear, or Nichol &
                                                        # Dhariwal cosine
    timesteps: int = ranged(1000, 2, 10**5)             # T, number of diffusion steps
    beta_start: float = ranged(1e-4, 0, 1)              # beta_1 of the linear schedule
    beta_end: float = ranged(0.02, 0, 1)                # beta_T of the linear schedule
    loss_weighting: Literal["none", "sqrt_snr", "min_snr", "edm"] = "none"  # none = MSE on the target;
                                                        # sqrt_snr / min_snr / edm: Diffusion._loss_weight
    min_snr_gamma: float = ranged(5.0, 1e-12, 1e4)      # gamma of the min_snr weighting (Hang et al. 2023)
    reverse_variance: Literal["large", "small"] = "large"  # sigma_t^2 of ancestral sampling: large = beta_t,
                                                        # small = posterior beta~_t
    split_timestep: int = ranged(0, 0)                  # model splitting (Luhman & Luhman §3.3): experts for
                                                        # t < S and t >= S; 0 = one model
    split_snr: float = ranged(0.0, 0, 1e6)              # alternative to split_timestep: S = first t with
                                                        # SNR(t) < split_snr (paper: 0.25); 0 = unused
    split_part: Literal["low", "high"] = "low"          # which expert this model is: 'low' trains t < S,
                                                        # 'high' t >= S


@dataclass
class TrainerConfig:  # the run
    dataset: str = chosen("cifar10", data.DATASETS)     # training data (the data.DATASETS table); 'shapes' is
                                                        # built in and offline
    data_dir: str = "data"                              # download folder ('cifar10') or the image folder
                                                        # ('folder')
    shapes_count: int = ranged(data.SHAPES_COUNT, 1, data.MAX_SHAPES_COUNT + 1)  # images in the built-in
                                                        # 'shapes' dataset
    loader: Literal["ffcv", "torch", "resident"] = "ffcv"  # FFCV from a cached .beton; gathers from uint8
                                                        # tensors in host memory; or on the device
    beton_dir: str = data.BETON_DIR                     # where .beton files are written once and reused
    fid_stats_dir: str = fid.STATS_DIR                  # where FID reference statistics are cached
    fid_ref_images: int = ranged(0, 0, 10**8)           # FID reference: this many training images, a fixed
                                                        # draw (fid.reference_subset); 0 = all of them
    num_workers: int = ranged(2, 1, 257)                # FFCV loader threads
    batch_size: int = ranged(128, 1, 2**20)             # global batch size, images per optimizer step
    grad_accum_steps: int = ranged(1, 1, 4097)          # micro-batches per optimizer step and rank (the batch
                                                        # is split, not grown)
    max_steps: int = ranged(800_000, 0, 10**10)         # optimizer steps to train for
    time_budget_min: float = ranged(0.0, 0, 10**6)      # also stop once this many minutes have passed since
                                                        # the process started (imports, data, compiling and
                                                        # training count; grids and evaluations do not),
                                                        # with the EMA saved at each whole minute in
                                                        # <run>/minutes; 0 = no limit
    lr: float = ranged(2e-4, 0, 1)                      # peak AdamW learning rate
    warmup_steps: int = ranged(5000, 0, 10**9)          # linear LR warm-up, in steps; 0 = none
    lr_schedule: Literal["constant", "cosine", "rsqrt"] = "constant"  # after warm-up: hold the LR,
                                                        # cosine-decay it to 0 at max_steps, or rsqrt: lr /
                                                        # sqrt(max(step / lr_decay_steps, 1)) (Karras et al.
                                                        # 2024, EDM2's decay)
    lr_decay_steps: int = ranged(1000, 1, 10**10)       # t_ref of the rsqrt schedule: the step it starts
                                                        # decaying from
    weight_decay: float = ranged(0.0, 0, 100)           # AdamW decoupled weight decay
    adam_beta1: float = ranged(0.9, 0, 1)               # AdamW beta1
    adam_beta2: float = ranged(0.999, 0, 1)             # AdamW beta2
    grad_clip: float = ranged(1.0, 0, 1e6)              # max global gradient norm; 0 = no clipping
    max_nonfinite_steps: int = ranged(20, 1, 10**6)     # steps with a non-finite loss or gradient are
                                                        # skipped; stop after this many in a row
    ema_decay: float = ranged(0.9999, 0, 1)             # EMA of the weights, per step; 0 = the EMA is a copy
                                                        # of the model
    ema_warmup: bool = True                             # ramp the EMA decay as min(ema_decay,
                                                        # (1+step)/(10+step))
    ema_sigma_rels: tuple[float, ...] = (0.05, 0.10)    # post-hoc EMA (machinery/phema.py): the σ_rel
                                                        # (relative width) of each power-function EMA
                                                        # tracked, each in [1e-4, 0.2887)
    ema_snapshot_kimg: int = ranged(5000, 0, 10**7)     # thousand images between their snapshots in
                                                        # <run>/phema (and one at the end); 0 = off
    ema_eval_sigma_rels: tuple[float, ...] = (0.03, 0.05, 0.075, 0.1, 0.15)  # with both: each σ_rel's
                                                        # weights rebuilt at the end into <run>/ema-sigma_rel
                                                        # <σ_rel>.pt, its FID, the best; empty: none
    hflip: bool = True                                  # random horizontal flips
    precision: Literal["auto", "bf16", "fp16", "tf32", "fp32"] = "auto"  # bf16 / fp16 (+ loss scaling)
                                                        # autocast, fp32 with TF32, true fp32; auto = bf16
                                                        # where the hardware has it, fp16 on older GPUs
    compile: Literal["auto", "true", "false"] = "auto"  # torch.compile the network; auto = on a GPU, not on a
                                                        # CPU (minutes to compile, slower there)
    compile_mode: Literal["default", "max-autotune", "reduce-overhead"] = "default"  # torch.compile mode;
                                                        # reduce-overhead = CUDA graphs
    channels_last: Literal["auto", "true", "false"] = "auto"  # NHWC activations and weights; auto = true, but
                                                        # NCHW for bf16 on a CPU, eager bf16/fp16 on GPUs
    cpu_threads: int = ranged(0, 0, 1025)               # CPU: intra-op threads for the step; 0 = torch's
                                                        # default (one per core)
    attention: Literal["sdpa", "math"] = "sdpa"         # attention kernel: F.scaled_dot_product_attention, or
                                                        # explicit softmax
    norm_kernel: Literal["torch", "triton"] = "torch"   # GroupNorm+SiLU: torch's ops, or kernels.py's fused
                                                        # Triton kernel (CUDA only)
    activation_checkpointing: bool = False              # recompute each residual/attention block in the
                                                        # backward pass: less memory, ~1 more forward
    out_dir: str = ""                                   # run folder; '' = runs/<preset>-<date>-<time>
    resume: bool = False                                # continue from out_dir/ckpt.pt
    resume_new_data: bool = False                       # with --resume: accept data settings other than the
                                                        # checkpoint's, from a new epoch plan; else refused
    init_from: str = ""                                 # start model and EMA weights from this checkpoint
                                                        # (e.g. the other expert's); '' = fresh
    log_every_steps: int = ranged(100, 1, 10**9)        # steps between metrics.jsonl lines (each is a
                                                        # GPU->CPU sync)
    log_to: Literal["none", "tensorboard", "wandb", "tensorboard,wandb"] = "none"  # trackers that also get
                                                        # every metrics row, grid and the config
                                                        # (runs.Trackers)
    sample_every_steps: int = ranged(10_000, 0, 10**9)  # steps between EMA sample grids; 0 = only at the end
    ckpt_every_steps: int = ranged(5000, 0, 10**9)      # steps between checkpoints; 0 = only at the end
    num_samples: int = ranged(64, 0, 65537)             # images per sample grid
    sampler: str = chosen("ddpm", SAMPLERS)             # sampler for the grids (the SAMPLERS table)
    sample_steps: int = ranged(0, 0)                    # sampler steps for the grids; 0 = all T
    eta: float = ranged(0.0, 0, 1)                      # the noise of a sampler that takes it (DDIM's eta: 0
                                                        # = deterministic) for the grids and FID samples
    guidance: float = ranged(1.0, 0, 100)               # classifier-free guidance weight w for the grids and
                                                        # the FID samples; 1 = none
    threshold: Literal["static", "dynamic", "none"] = "static"  # x0 clipping when sampling: static [-1, 1],
                                                        # dynamic (Saharia et al. 2022, p99.5), none
    eval_every_steps: int = ranged(0, 0, 10**9)         # steps between evaluations (FID, bits/dim) logged to
                                                        # metrics.jsonl; 0 = never
    eval_fid_samples: int = ranged(5000, 0, 10**6)      # EMA samples for that FID (torch-fidelity); 0 = none
    eval_sampler: str = chosen("dpm++", SAMPLERS)       # sampler for those samples
    eval_sample_steps: int = ranged(20, 1)              # its steps
    eval_bpd_images: int = ranged(1000, 0, 10**6)       # held-out images for bits/dim (the test split;
                                                        # 'folder': its own images); 0 = none
    eval_bpd_strata: int = ranged(8, 1)                 # bits/dim estimated from 2 x strata + 1 network calls
                                                        # (evaluate.bpd_estimate)
    seed: int = ranged(0, 0, 2**63 - 1024)              # seeds the weights, the data order, the noise and the
                                                        # grids
    device: str = "auto"                                # 'auto' = cuda if present, else cpu; or 'cpu',
                                                        # 'cuda', 'cuda:1', ...


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
    # Ho et al.'s network and training on a GPU, for the targets in README.md: 100 Mimg, post-hoc EMA (on by
    # default) swept at the end, an FID curve every 5 Mimg of 10k samples at 35 network evaluations
    "cifar-gpu": dict(max_steps=781_250, eval_every_steps=39_063, eval_fid_samples=10_000,
                      eval_sampler="heun", eval_sample_steps=18, sampler="heun", sample_steps=18),
    # CIFAR-10 on 2 CPU cores, ~2 h with its FID curve: scripts/levers.py's base and its lever (README.md)
    "cifar-cpu": dict(base_channels=32, num_res_blocks=1, norm_groups=16, batch_size=64, lr=5e-4,
                      warmup_steps=200, ema_decay=0.999, ema_snapshot_kimg=40, ema_eval_sigma_rels=(),
                      max_steps=6250, eval_every_steps=1563, eval_fid_samples=5000, fid_ref_images=10_000,
                      eval_bpd_images=0, sample_every_steps=0, ckpt_every_steps=1000, sampler="dpm++",
                      sample_steps=20, compile="false", loader="torch"),
    # CIFAR-10 on one GPU against the clock: 5 minutes from process start, data and compiling included, the
    # EMA saved at each minute (README.md). Not yet run on a GPU: the cifar-cpu shape at twice its width with
    # two blocks a level (8.95M parameters, 9.6 GFLOP per image), sized so that ~15% MFU on an H100 trains
    # ~3.5 Mimg in the 4 minutes left after compiling; the rest from the CPU lever studies (BENCHMARKS.md)
    "speedrun": dict(base_channels=64, num_res_blocks=2, dropout=0.0, batch_size=512, lr=1e-3,
                     warmup_steps=200, ema_decay=0.999, ema_snapshot_kimg=500, ema_eval_sigma_rels=(),
                     max_steps=200_000, time_budget_min=5, loader="resident", compile="true",
                     compile_mode="reduce-overhead", sample_every_steps=0, ckpt_every_steps=0, sampler="heun",
                     sample_steps=18, eval_sampler="heun", eval_sample_steps=18),
    # small enough to learn the built-in shapes at 16x16 on 2 CPU cores in 1.5 (bf16) to 5 (fp32) minutes:
    # 2x2 patches, v-prediction on the cosine schedule, class labels with guidance, high LR, small batches
    "demo": dict(dataset="shapes", image_size=16, patch_size=2, base_channels=64, channel_mult=(1, 2),
                 num_res_blocks=1, attn_resolutions=(4,), dropout=0.0, num_classes=4, prediction="v",
                 schedule="cosine", batch_size=32, max_steps=900, lr=2e-3, warmup_steps=100, ema_decay=0.999,
                 compile="false", log_every_steps=50, sample_every_steps=450, ckpt_every_steps=450,
                 sampler="ddim", sample_steps=50, guidance=2.0, loader="torch"),  # in memory: no beton
}


def parse_args(argv):
    """-> (ModelConfig, TrainerConfig, preset name). Flat: every field is --name=value (cli.py)."""
    classes = (ModelConfig, TrainerConfig)
    fields, preset = cli.flat_args(argv, classes, __doc__.split("\n\n")[1], PRESETS, default_preset="ho")
    overrides = {**PRESETS[preset], **fields}
    mc, tc = (cls(**{k: v for k, v in overrides.items() if k in cls.__dataclass_fields__}) for cls in classes)
    validate(mc, tc)
    return mc, tc, preset


def validate(mc, tc=None):
    """Catch impossible values and combinations before anything is built: each field's choices and range
    (beside the field), then the relations between fields. tc None: the model alone (a loaded model folder,
    whose check must not trip over TrainerConfig defaults nobody set)."""
    def check(ok, msg):
        if not ok:
            raise UserError(msg)

    for cfg in (mc, tc) if tc is not None else (mc,):
        cli.check_fields(cfg)  # each field's choices and range, as declared beside it
    check(0 <= mc.split_timestep < mc.timesteps, f"split_timestep must lie in [0, timesteps={mc.timesteps})")
    check(not (mc.split_timestep and mc.split_snr), "give split_timestep or split_snr, not both")
    try:
        split_timestep(mc)
    except ValueError as e:
        raise UserError(str(e)) from None
    check(1 <= len(mc.channel_mult) <= 16 and all(math.isfinite(m) and 0 < m <= 64 for m in mc.channel_mult),
          "channel_mult needs 1 to 16 entries, each in (0, 64]")
    levels = len(mc.channel_mult)
    check(mc.image_size % (mc.patch_size * 2 ** (levels - 1)) == 0,
          f"image_size {mc.image_size} is not divisible by patch_size x 2^(levels-1) = "
          f"{mc.patch_size} x {2 ** (levels - 1)}")
    grid = [mc.image_size // mc.patch_size // 2**i for i in range(levels)]
    for r in mc.attn_resolutions:
        check(r in grid, f"attn_resolutions: {r} never occurs; the patched grid has resolutions {grid}")
    widths = [int(mc.base_channels * m) for m in mc.channel_mult]
    check(min(widths) >= 2, f"channel_mult gives widths {widths}: each must be >= 2 channels")
    check(all(w % max(mc.norm_groups, 1) == 0 for w in [mc.base_channels, *widths]),
          f"norm_groups {mc.norm_groups} does not divide the widths {[mc.base_channels, *widths]}")
    check(mc.attn_heads or mc.attn_head_dim, "attn_heads=0 needs attn_head_dim > 0")
    for name, other in (("attn_heads", "attn_head_dim"), ("attn_head_dim", "attn_heads")):  # one of them
        check(getattr(mc, other) or all(w % getattr(mc, name) == 0 for w in widths),    # sets the other
              f"{name} {getattr(mc, name)} does not divide the widths {widths}")
    check(0 < mc.beta_start < mc.beta_end < 1, "need 0 < beta_start < beta_end < 1")
    if tc is None:
        return
    check(not tc.resume or tc.out_dir, "--resume needs --out_dir, the run folder to continue")
    check(not (tc.time_budget_min and tc.resume),
          "a run against the clock (time_budget_min) cannot be resumed")
    check(not tc.time_budget_min or mfu.process_seconds() is not None,
          "time_budget_min needs the process's start time, which this system does not give (/proc)")
    for name, low, high in (("sample_steps", 0, "timesteps"), ("eval_sample_steps", 1, "timesteps"),
                            ("eval_bpd_strata", 1, "timesteps-1")):
        top = mc.timesteps - high.endswith("-1")
        check(low <= getattr(tc, name) <= top, f"{name} must lie in [{low}, {high}={top}]")
    check(tc.eval_fid_samples != 1, "eval_fid_samples must be 0 or >= 2 (a covariance needs two samples)")
    check(not tc.eta or any(SAMPLERS[s].eta is not None for s in (tc.sampler, tc.eval_sampler)),
          f"eta {tc.eta}: neither sampler ({tc.sampler}, eval_sampler {tc.eval_sampler}) takes an eta")
    for name, least in (("ema_sigma_rels", 1), ("ema_eval_sigma_rels", 0)):
        if tc.ema_snapshot_kimg:  # distinct, each in [phema.SIGMA_REL_MIN, SIGMA_REL_MAX): before any work
            phema.check_sigma_rels(getattr(tc, name), name, least, 8)
    check(tc.lr_schedule != "rsqrt" or tc.lr_decay_steps >= tc.warmup_steps,
          f"lr_decay_steps {tc.lr_decay_steps} must be >= warmup_steps {tc.warmup_steps} (rsqrt decays after "
          "the warm-up)")
    check(tc.norm_kernel == "torch" or group.resolve_device(tc.device).type == "cuda",
          "norm_kernel=triton runs on CUDA devices only")
    check(tc.batch_size % tc.grad_accum_steps == 0,
          f"batch_size {tc.batch_size} does not divide into grad_accum_steps={tc.grad_accum_steps} parts")


# -----------------------------------------------------------------------------
# 2. The diffusion process. Notation of Ho et al. 2020: t = 0..T-1 here is the paper's t = 1..T
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

    The model returns the configured target: ε (Ho et al.), x₀, v = √ᾱ·ε − √(1−ᾱ)·x₀ (Salimans & Ho
    2022), or EDM's F (Karras et al. 2022, its input scaled by net_input). All four are converted exactly to
    (x̂₀, ε̂) by `predict_x0_eps`.
    A Module only so that .to(device) moves the float64 schedule buffers.
    """

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        betas = beta_schedule(cfg)
        alpha_bar = torch.cumprod(1 - betas, dim=0)
        snr = alpha_bar / (1 - alpha_bar)  # SNR(t) = ᾱ_t / (1 - ᾱ_t)
        self.split = split_timestep(cfg, snr)
        # the timesteps this model is trained on: all of them, or its expert's share [lo, hi)
        lo, hi = (0, self.split) if cfg.split_part == "low" else (self.split, cfg.timesteps)
        self.t_range = (lo, hi) if self.split else (0, cfg.timesteps)
        # σ_t of x = z_t/√ᾱ_t = x₀ + σ_t ε, the variance-exploding view (Karras et al. 2022 §2): σ_t² = 1/SNR
        sigma, sd = snr.rsqrt(), cfg.sigma_data
        buffers = {
            "betas": betas,                                    # β_t
            "alpha_bar": alpha_bar,                            # ᾱ_t
            "alpha_bar_prev": torch.cat([torch.ones(1, dtype=torch.float64),
                                         alpha_bar[:-1]]),             # ᾱ_{t-1}, ᾱ_0 = 1
            "sqrt_alpha_bar": alpha_bar.sqrt(),                # √ᾱ_t
            "sqrt_one_minus_alpha_bar": (1 - alpha_bar).sqrt(),  # √(1 - ᾱ_t)
            "loss_weight": self._loss_weight(snr),             # w_t multiplying the per-sample MSE
            "t_cdf": self._t_cdf(sigma),                       # P(t' <= t) of the training timesteps
            "sigma": sigma,                                    # σ_t = √((1 - ᾱ_t) / ᾱ_t)
            # EDM's preconditioning (Karras et al. 2022 Table 1): D(x; σ) = c_skip x + c_out F(c_in x)
            "c_in": (sigma**2 + sd**2).rsqrt(),
            "c_skip": sd**2 / (sigma**2 + sd**2),
            "c_out": sigma * sd * (sigma**2 + sd**2).rsqrt(),
            "posterior_variance": ((1 - torch.cat([torch.ones(1, dtype=torch.float64), alpha_bar[:-1]]))
                                   / (1 - alpha_bar) * betas),  # β̃_t = (1 - ᾱ_{t-1}) / (1 - ᾱ_t) β_t (eq. 7)
        }
        for name, value in buffers.items():
            self.register_buffer(name, value, persistent=False)

    def _loss_weight(self, snr):
        """Per-timestep weight on the MSE of the configured target.

        The weightings are defined on the x₀-MSE, λ(t), and converted exactly to the target:
        ‖ε̂−ε‖² = SNR·‖x̂₀−x₀‖² and ‖v̂−v‖² = (SNR+1)·‖x̂₀−x₀‖², so w_t = λ(t)/c(t) with
        c = 1, SNR, SNR+1 for x, ε, v. Then
          'none':     w_t = 1 (Ho et al.'s L_simple on whichever target);
          'sqrt_snr': λ = γ_t = √SNR (Luhman & Luhman 2022 §3.2, their x-prediction loss);
          'min_snr':  λ = min(SNR, γ), γ = min_snr_gamma (Hang et al. 2023 eq. 9);
          'edm':      λ(σ) = (σ² + σ_d²) / (σ σ_d)² with σ² = 1/SNR (Karras et al. 2022 Table 1).
        The edm prediction's F has ‖F̂−F‖² = ‖x̂₀−x₀‖² / c_out², so c = 1/c_out² there, and with the edm
        weighting its w_t is 1: λ c_out² = 1, EDM's own loss (eq. 8).
        """
        cfg, sd2 = self.cfg, self.cfg.sigma_data ** 2
        if cfg.loss_weighting == "none":
            return torch.ones_like(snr)
        lam = {"sqrt_snr": lambda: snr.sqrt(), "min_snr": lambda: snr.clamp(max=cfg.min_snr_gamma),
               "edm": lambda: (1 / snr + sd2) * snr / sd2}[cfg.loss_weighting]()
        c = {"x": lambda: torch.ones_like(snr), "eps": lambda: snr, "v": lambda: snr + 1,
             "edm": lambda: (1 + sd2 * snr) / sd2}[cfg.prediction]()  # 1/c_out² = (σ² + σ_d²) / (σ σ_d)²
        return lam / c

    def _t_cdf(self, sigma):
        """P(t' <= t) of the training timesteps on t_range: uniform, or 'lognormal': ln σ ~ N(P_mean, P_std²)
        (Karras et al. 2022 Table 1) put on the discrete t, each t taking the mass of ln σ between the
        midpoints to its neighbours' ln σ_t (ln σ_t increases with t)."""
        lo, hi = self.t_range
        if self.cfg.t_sampling == "uniform":
            p = torch.ones_like(sigma)
        else:
            log_sigma = sigma.log()
            edges = (log_sigma[1:] + log_sigma[:-1]) / 2
            cdf = torch.special.ndtr((edges - self.cfg.p_mean) / self.cfg.p_std)
            p = torch.diff(cdf, prepend=cdf.new_zeros(1), append=cdf.new_ones(1))
        p[:lo], p[hi:] = 0, 0
        if p.sum() <= 0:
            raise ValueError(f"the lognormal timesteps put no mass on the expert's range [{lo}, {hi})")
        return torch.cumsum(p / p.sum(), 0)

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
        if self.cfg.prediction == "edm":  # F = (x₀ − c_skip x) / c_out, x = x₀ + σ ε (Karras et al. eq. 8)
            x = x0 + extract(self.sigma, t, x0) * noise
            return (x0 - extract(self.c_skip, t, x0) * x) / extract(self.c_out, t, x0)
        return (extract(self.sqrt_alpha_bar, t, x0) * noise
                - extract(self.sqrt_one_minus_alpha_bar, t, x0) * x0)  # v

    def net_input(self, z, t):
        """What the network is given at z_t: z_t itself, or for the edm prediction c_in x with x = z_t/√ᾱ_t
        (Karras et al. 2022 eq. 7; the network still embeds t, not c_noise = ¼ ln σ)."""
        if self.cfg.prediction != "edm":
            return z
        return (extract(self.c_in, t, z) / extract(self.sqrt_alpha_bar, t, z)) * z

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
        elif self.cfg.prediction == "v":  # v = √ᾱ ε − √(1−ᾱ) x₀ => x₀ = √ᾱ z − √(1−ᾱ) v, ε = √(1−ᾱ) z + √ᾱ v
            x0, eps = a * z - s * out, s * z + a * out
        else:  # edm: x₀ = D(x; σ) = c_skip x + c_out F with x = z/√ᾱ (Karras et al. eq. 7)
            x0 = extract(self.c_skip, t, z) * z / a + extract(self.c_out, t, z) * out
            eps = (z - a * x0) / s
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
        if self.cfg.t_sampling == "uniform":  # a split expert sees only its own range
            t = torch.randint(*self.t_range, (B,), device=x0.device)[rank::world]
        else:  # inverse CDF: the first t whose P(t' <= t) exceeds u
            u = torch.rand(B, device=x0.device, dtype=torch.float64)[rank::world]
            t = torch.searchsorted(self.t_cdf, u, right=True).clamp(max=self.t_range[1] - 1)
        noise = torch.randn((B, *x0.shape[1:]), device=x0.device, dtype=x0.dtype)[rank::world]
        u = torch.rand(B, device=x0.device)[rank::world] if labels and self.cfg.p_uncond > 0 else None
        return t, noise, u

    def loss(self, model, x0, y=None, shard=(0, 1), draws=None):
        """-> (w_t ‖target − model(z_t, t, y)‖² / D for each sample, t): t ~ U{0..T-1}, ε ~ N(0, I) (Ho et
        al. Algorithm 1); the caller takes the mean.

        Labels are replaced by the null class with probability p_uncond, so one network learns
        both p(x|y) and p(x) for classifier-free guidance (Ho & Salimans 2022).
        Under DDP, shard = (rank, world): every rank draws t, ε and the label dropout for the whole
        global batch from the same seeded stream and keeps rows rank::world, the rows of its own images
        (data.shard), so a run does not depend on how many processes share it.
        draws: (t, ε, dropout uniforms) from self.draw for exactly these rows (micro-batches of one batch);
        None draws them here. The timesteps come back for per-quartile logging.
        """
        t, noise, u = draws if draws is not None else self.draw(x0, y is not None, shard)
        z = self.q_sample(x0, t, noise)
        if u is not None:
            y = torch.where(u < self.cfg.p_uncond, torch.full_like(y, self.cfg.num_classes), y)
        out = model(self.net_input(z, t), t, y).float()
        mse = (out - self.target(x0, noise, t)).pow(2).flatten(1).mean(1)  # (B,)
        return self.loss_weight[t].float() * mse, t

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
        """Descending timesteps to sample with: all T, or `steps` of them from T-1 to 0, spaced evenly in t
        ('time'), in λ = log(α/σ) = ½ log SNR ('logsnr', Lu et al. 2022's choice for pixel-space
        DPM-Solver), or as Karras et al. 2022 eq. 5 spaces σ = √((1-ᾱ)/ᾱ) ('karras', ρ = 7, each σ taken to
        the nearest timestep in log σ); timesteps that coincide after rounding are taken once."""
        T = self.cfg.timesteps
        if not steps or steps == T:
            return list(range(T - 1, -1, -1))
        if not 1 <= steps <= T:
            raise ValueError(f"steps must lie in [1, {T}], got {steps}")
        if spacing == "time":
            return sorted({round(i * (T - 1) / max(steps - 1, 1)) for i in range(steps)}, reverse=True)
        log_snr = torch.log(self.alpha_bar / (1 - self.alpha_bar)).cpu()  # decreasing in t
        if spacing == "logsnr":
            targets = torch.linspace(log_snr[-1].item(), log_snr[0].item(), steps, dtype=torch.float64)
        elif spacing == "karras":
            rho, (hi, lo) = 7.0, (torch.exp(-0.5 * log_snr[[-1, 0]])).tolist()  # σ_max, σ_min
            ramp = torch.linspace(0, 1, steps, dtype=torch.float64)
            sigmas = (hi ** (1 / rho) + ramp * (lo ** (1 / rho) - hi ** (1 / rho))) ** rho
            targets = -2 * torch.log(sigmas)  # log SNR = -2 log σ
        else:
            raise ValueError(f"unknown spacing '{spacing}'")
        return sorted({int((log_snr - v).abs().argmin()) for v in targets}, reverse=True)

    def guided(self, model, z, t, y, guidance):
        """The model output with classifier-free guidance: out_u + w (out_c - out_u)
        (Ho & Salimans 2022 eq. 6).

        Every target (ε, x, v) is affine in the output at fixed z_t, so guiding the output
        guides x̂₀ and ε̂ identically. w = 1 is plain conditional sampling: one call, no null pass.
        """
        z = self.net_input(z, t)
        if y is None or guidance == 1.0:
            return model(z, t, y).float()
        null = torch.full_like(y, self.cfg.num_classes)
        out_c, out_u = model(torch.cat([z, z]), torch.cat([t, t]), torch.cat([y, null])).float().chunk(2)
        return out_u + guidance * (out_c - out_u)


def dynamic_threshold(x0, percentile=0.995):
    """Saharia et al. 2022 §2.3: s = max(1, quantile_p |x̂₀|) per sample; x̂₀ <- clip(x̂₀, -s, s) / s."""
    s = torch.quantile(x0.abs().flatten(1).float(), percentile, dim=1).clamp(min=1.0).to(x0.dtype)
    s = s.view(-1, *([1] * (x0.dim() - 1)))
    return torch.maximum(torch.minimum(x0, s), -s) / s


@torch.no_grad()
def sample(d, model, shape, *, sampler="ddpm", steps=None, y=None, guidance=1.0, generator=None,
           eta=0.0, threshold="static", percentile=0.995, noise=None, capture=None):
    """Draw images in [-1, 1] of `shape` = (B, C, H, W) from the Diffusion d's reverse process, starting from
    z_T ~ N(0, I), with a sampler of the SAMPLERS table (below) on `steps` timesteps spaced as that sampler
    wants (all T when None).

    The sampler sees the network only through denoise(z_t, t) -> (x̂₀, ε̂), with classifier-free
    guidance and `threshold` applied (guided, predict_x0_eps), and ends on x̂₀ at t = 0. `generator` (any
    device) or noise(shape) (sample.py: each image from its own generator) draws the noise. capture(step)
    may wrap that step (t a (B,) tensor): sample.py compiles it whole, as CUDA graphs on a GPU.
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler '{sampler}'; choose one of {', '.join(SAMPLERS)}")
    device = d.alpha_bar.device
    gen_device = generator.device if generator is not None else device

    def draw():
        z = noise(shape) if noise else torch.randn(shape, generator=generator, device=gen_device)
        return z.to(device)

    def step(z, tt):
        return d.predict_x0_eps(d.guided(model, z, tt, y, guidance), z, tt, threshold, percentile)
    step = capture(step) if capture else step

    def denoise(z, t):
        return step(z, torch.full((shape[0],), t, device=device, dtype=torch.long))

    spec = SAMPLERS[sampler]
    ts = d.timestep_sequence(steps, spacing=spec.spacing)
    return spec.run(d, denoise, draw(), ts, draw, eta).clamp(-1, 1)


# -----------------------------------------------------------------------------
# The samplers. Each is one function of the same signature, registered in SAMPLERS by @sampler; the table
# gives TrainerConfig.sampler and sample.py --sampler their choices and README.md its sampler table:
#   run(d, denoise, z, ts, noise, eta) -> x̂₀
# d: the Diffusion (its ᾱ_t, q_posterior, cfg); denoise(z_t, t) -> (x̂₀, ε̂) at an int timestep t; z: z_T;
# ts: descending timesteps from the sampler's spacing; noise(): fresh N(0, I) draws of z's shape; eta: the
# noise of a sampler that takes one (DDIM; the others ignore it). Adding a sampler is one function with
# @sampler, which gives its default steps and eta.


@dataclass(frozen=True)
class Sampler:
    run: typing.Callable   # run(d, denoise, z, ts, noise, eta) -> x̂₀
    spacing: str           # its timesteps, as Diffusion.timestep_sequence spaces them: time, logsnr, karras
    summary: str           # one line, for --help and README.md's table (the function's docstring's first)
    steps: int             # its default steps (0 = all T): sample.py's when it is not the run's sampler
    eta: float | None      # its default eta, None if it takes none


def sampler(name, spacing="time", steps=0, eta=None):
    """Register the decorated function in SAMPLERS under `name`, with its default steps and eta."""
    def register(run):
        SAMPLERS[name] = Sampler(run, spacing, (run.__doc__ or name).strip().splitlines()[0], steps, eta)
        return run
    return register


def transitions(ts):
    """(t, s) for each step of the descending timesteps ts; s = -1 on the last: the clean image, ᾱ = 1."""
    return zip(ts, [*ts[1:], -1])


@sampler("ddpm")
def ddpm_ancestral(d, denoise, z, ts, noise, eta):
    """Ancestral sampling (Ho et al. Algorithm 2), respaced on fewer than T steps (Nichol & Dhariwal §4).

    z_s = μ̃(x̂₀, z_t) + σ ε through the posterior of eq. 7 with x̂₀ plugged in (q_posterior, which also
    serves s < t-1), and σ² = β_{t|s} ('large') or β̃ ('small': ModelConfig.reverse_variance).
    """
    ab = d.alpha_bar.tolist()  # python floats: the coefficients are computed in float64
    for t, s in transitions(ts):
        x0, eps = denoise(z, t)
        if s < 0:
            return x0
        mean, var_small = d.q_posterior(x0, z, ab[t], ab[s])
        var = var_small if d.cfg.reverse_variance == "small" else 1 - ab[t] / ab[s]
        z = mean + var**0.5 * noise()


@sampler("ddim", steps=50, eta=0.0)  # Song et al.'s 50 steps, deterministic
def ddim(d, denoise, z, ts, noise, eta):
    """DDIM (Song et al. 2021 eq. 12) on evenly spaced steps; deterministic at eta = 0.

    z_s = √ᾱ_s x̂₀ + √(1 - ᾱ_s - σ²) ε̂ + σ ε with σ = η √((1-ᾱ_s)/(1-ᾱ_t)) √(1 - ᾱ_t/ᾱ_s).
    """
    ab = d.alpha_bar.tolist()
    for t, s in transitions(ts):
        x0, eps = denoise(z, t)
        if s < 0:
            return x0
        sigma = eta * ((1 - ab[s]) / (1 - ab[t]) * (1 - ab[t] / ab[s])) ** 0.5
        z = ab[s] ** 0.5 * x0 + (1 - ab[s] - sigma**2) ** 0.5 * eps
        if sigma > 0:
            z = z + sigma * noise()


@sampler("dpm++", spacing="logsnr", steps=20)  # Lu et al.: good images at 20 steps
def dpm_solver_pp_2m(d, denoise, z, ts, noise, eta):
    """DPM-Solver++(2M) (Lu et al. 2022, Algorithm 2) on steps evenly spaced in log-SNR.

    With α = √ᾱ, σ = √(1-ᾱ), λ = log(α/σ) and h = λ_s - λ_t: z_s = (σ_s/σ_t) z_t - α_s (e^{-h} - 1) D, where
    D = x̂₀ on the first step and (1 + 1/2r) x̂₀ - (1/2r) x̂₀_prev after, r = h_prev/h.
    """
    ab = d.alpha_bar.tolist()
    lam = lambda a: 0.5 * math.log(a / (1 - a))  # noqa: E731  λ = log(α/σ)
    x0_prev, h_prev = None, None
    for t, s in transitions(ts):
        x0, eps = denoise(z, t)
        if s < 0:
            return x0
        h = lam(ab[s]) - lam(ab[t])
        D = x0 if x0_prev is None else (1 + h / (2 * h_prev)) * x0 - h / (2 * h_prev) * x0_prev
        z = ((1 - ab[s]) / (1 - ab[t])) ** 0.5 * z - ab[s] ** 0.5 * math.expm1(-h) * D
        x0_prev, h_prev = x0, h


@sampler("heun", spacing="karras", steps=18)  # Karras et al.'s CIFAR-10: 35 evaluations
def heun(d, denoise, z, ts, noise, eta):
    """Heun's 2nd-order ODE solver (Karras et al. 2022 Algorithm 1, no churn): 2 network calls a step.

    In x = z/√ᾱ the DDPM process is x = x₀ + σ ε with σ(t) = √((1-ᾱ)/ᾱ), and the probability-flow ODE is
    dx/dσ = (x - D(x; σ))/σ = ε̂. An Euler step to σ_s, then the trapezoid of ε̂ at both ends; the last
    step, to σ = 0, is Euler's alone and lands on x̂₀.
    """
    ab = d.alpha_bar.tolist()
    sigma = lambda t: ((1 - ab[t]) / ab[t]) ** 0.5  # noqa: E731
    x = z / ab[ts[0]] ** 0.5
    for t, s in transitions(ts):
        x0, eps = denoise(ab[t] ** 0.5 * x, t)
        if s < 0:
            return x0
        x_euler = x + (sigma(s) - sigma(t)) * eps                # Algorithm 1, lines 5-6
        _, eps_s = denoise(ab[s] ** 0.5 * x_euler, s)            # lines 7-8: ε̂ at the Euler point
        x = x + (sigma(s) - sigma(t)) * (eps + eps_s) / 2


# -----------------------------------------------------------------------------
# 3. Building a run's objects, and one optimisation step: shared by train(), benchmark.py and the
# comparison scripts, so that every speed figure measures what `python ddpm.py` trains.


def autocast(device, precision):
    return torch.autocast(device.type, dtype=mfu.AUTOCAST_DTYPES.get(precision, torch.float32),
                          enabled=precision in mfu.AUTOCAST_DTYPES)


def autocast_model(model, device, precision):
    """model(z, t, y) under autocast: the callable the samplers are given, in training and in sample.py."""
    def net(z, t, y=None):
        with autocast(device, precision):
            return model(z, t, y)
    return net


@dataclass
class Built:
    model: UNet                  # the weights being trained
    ema: UNet                    # their exponential moving average (eval mode, no gradients)
    diffusion: "Diffusion"       # the schedule and the maths, on the device
    opt: torch.optim.Optimizer   # AdamW, fused where torch has the kernel
    scaler: typing.Any           # fp16's dynamic loss scaler (torch.amp.GradScaler); None otherwise
    forward: typing.Callable     # what the step calls: the model, DDP-wrapped under torchrun, compiled
    precision: str               # tc.precision resolved for the device: bf16, fp16, tf32 or fp32
    channels_last: bool          # tc.channels_last resolved: NHWC weights and batches
    phema: typing.Any = None     # the post-hoc EMA's tracked averages (phema.Tracked); None when off


def build(mc, tc, device, world=1):
    """The model, its EMA, the optimizer, the loss scaler and the forward the step calls, from the configs.

    'auto' settings resolve for the device (runs.resolve_*). compile: torch.compile in tc.compile_mode
    ('max-autotune' searches kernel configurations, minutes more; 'reduce-overhead' replays the step as CUDA
    graphs; the UNet has no graph breaks). Under torchrun (world > 1) the forward is DistributedDataParallel,
    which all-reduces the gradients. Seed the global RNG first: the weights are drawn from it.
    """
    precision = runs.resolve_precision(tc.precision, device)
    runs.set_matmul_precision(precision)
    compiled = runs.resolve_compile(tc.compile, device)
    channels_last = runs.resolve_channels_last(tc.channels_last, device, precision, compiled)
    model = UNet(mc, attention=tc.attention, activation_checkpointing=tc.activation_checkpointing,
                 norm_kernel=tc.norm_kernel)
    model = model.to(device, memory_format=runs.memory_format(channels_last))
    ema = copy.deepcopy(model).requires_grad_(False).eval()
    # fused AdamW kernels exist for CUDA and the CPU since torch 2.4
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=(tc.adam_beta1, tc.adam_beta2),
                            weight_decay=tc.weight_decay, fused=device.type in ("cuda", "cpu"))
    # fp16 needs loss scaling (its range ends at 65504; small gradients underflow); part of the checkpoint
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    forward = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        forward = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if compiled:
        forward = torch.compile(forward, mode=None if tc.compile_mode == "default" else tc.compile_mode)
    tracked = phema.Tracked(model, tc.ema_sigma_rels) if tc.ema_snapshot_kimg else None
    return Built(model, ema, Diffusion(mc).to(device), opt, scaler, forward, precision, channels_last,
                 tracked)


class Step(typing.NamedTuple):  # what a training step leaves, on the device: read it without a sync
    loss: torch.Tensor       # the batch's mean loss
    grad_norm: torch.Tensor  # the gradients' norm before clipping
    ok: torch.Tensor         # 1 where the update was applied, 0 where it was skipped
    losses: torch.Tensor     # the per-sample losses, and their timesteps t (per-quartile logging)
    t: torch.Tensor


def train_step(model, diffusion, opt, x0, y, precision, grad_clip, shard=(0, 1), channels_last=False,
               accum_steps=1, scaler=None):
    """Forward, backward, clip, AdamW step, all without a host sync: -> Step. A non-finite loss or gradient
    (on any rank) skips the update: `ok` is then 0, and the fused AdamW kernel leaves weights, moments and
    its step count untouched (its found_inf input).

    accum_steps k: the rank's batch runs as k micro-batches, each loss scaled by 1/k, gradients summed, and
    under DDP all-reduced once, after the last (no_sync before it). The noise, timesteps and label dropout
    are drawn once for the whole batch, so k micro-batches train as one big batch does, to float rounding.
    scaler (fp16): the loss is scaled before backward and the gradients unscaled before clipping; an
    overflow shows as a non-finite gradient norm, so it is skipped by the same `ok` (one skip mechanism),
    and the scaler then lowers its scale."""
    torch.compiler.cudagraph_mark_step_begin()  # a new iteration for CUDA graphs (reduce-overhead)
    # a no-op where the loader's layout is the model's
    x0 = x0.contiguous(memory_format=runs.memory_format(channels_last))
    backward = (lambda loss: scaler.scale(loss).backward()) if scaler else (lambda loss: loss.backward())
    if accum_steps == 1:
        with autocast(x0.device, precision):
            losses, t = diffusion.loss(model, x0, y, shard)
            loss = losses.mean()
        backward(loss)
    else:
        draws, m = diffusion.draw(x0, y is not None, shard), len(x0) // accum_steps
        parts = []
        for i in range(accum_steps):
            rows = slice(i * m, (i + 1) * m)
            last = i == accum_steps - 1
            with contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync():
                with autocast(x0.device, precision):
                    part, part_t = diffusion.loss(model, x0[rows], y[rows] if y is not None else None, shard,
                                                  [d[rows] if d is not None else None for d in draws])
                backward(part.mean() / accum_steps)
            parts.append((part.detach().mean(), part.detach(), part_t))
        means, per_sample, ts = zip(*parts)
        loss, losses, t = torch.stack(means).mean(), torch.cat(per_sample), torch.cat(ts)
    if scaler:
        scaler.unscale_(opt)
    params = [p for g in opt.param_groups for p in g["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    ok = (torch.isfinite(loss) & torch.isfinite(grad_norm)).float()
    # DDP already agrees on the gradients; this also covers a loss that is inf on one rank only
    if shard[1] > 1:
        group.all_agree(ok)
    if opt.defaults.get("fused"):
        opt.found_inf = 1 - ok
        opt.step()
    elif ok.item():  # unfused optimizers cannot skip on the device
        opt.step()
    if diffusion.cfg.mp_layers:  # every weight row back to norm √fan_in (EDM2's config E)
        unet.force_weight_norm_(model)
    if scaler:
        scaler.update()  # from the overflow check unscale_ recorded: lower the scale, or grow it in time
    opt.zero_grad(set_to_none=True)
    return Step(loss.detach(), grad_norm, ok, losses.detach(), t)


@torch.no_grad()
def ema_update(ema, model, decay, ok=None):
    """θ_ema <- decay θ_ema + (1 - decay) θ, as one foreach lerp over all parameters; no change where ok = 0.

    ok stays on the device: _foreach_lerp_ would read a single tensor weight with .item() (a host sync every
    step), so it gets a list of 0-dim weights, which on a CPU is as fast as the scalar form."""
    ema_params, params = list(ema.parameters()), list(model.parameters())
    weight = 1 - decay if ok is None else [(1 - decay) * ok] * len(params)
    torch._foreach_lerp_(ema_params, params, weight)


def lr_at(step, tc):
    """Linear warm-up over warmup_steps, then constant, cosine decay to 0 at max_steps, or EDM2's inverse
    square root, lr / √max(step / t_ref, 1) with t_ref = lr_decay_steps (>= warmup_steps: no jump)."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    if tc.lr_schedule == "cosine":
        progress = (step - tc.warmup_steps) / max(1, tc.max_steps - tc.warmup_steps)
        return tc.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    if tc.lr_schedule == "rsqrt":
        return tc.lr / math.sqrt(max(step / tc.lr_decay_steps, 1))
    return tc.lr


def ema_decay_at(step, tc):
    return min(tc.ema_decay, (1 + step) / (10 + step)) if tc.ema_warmup else tc.ema_decay


def iteration(b, x0, y, tc, step, shard=(0, 1)):
    """One training iteration as train() runs it and every speed figure measures it: the learning rate of
    `step`, train_step, then the EMA at the step's warm-up decay (unchanged where the step was skipped)."""
    for g in b.opt.param_groups:
        g["lr"] = lr_at(step, tc)
    out = train_step(b.forward, b.diffusion, b.opt, x0, y, b.precision, tc.grad_clip, shard, b.channels_last,
                     tc.grad_accum_steps, b.scaler)
    ema_update(b.ema, b.model, ema_decay_at(step, tc) if tc.ema_decay > 0 else 0.0, out.ok)
    if b.phema:  # the power-function EMAs: step t = step + 1 (the first copies the weights)
        b.phema.update(b.model, step + 1, out.ok)
    return out


def load_ema(path, device):
    """-> (UNet with the EMA weights, ModelConfig, the run's TrainerConfig fields or {}), from a run's ckpt.pt
    or ema.pt, or from a diffusers model or pipeline folder (diffusers_io); bad input raises UserError."""
    if diffusers_io.is_folder(path):
        try:
            fields, state, notes = diffusers_io.read(path, unet)
            mc = ModelConfig(**fields)
            validate(mc)
            model = UNet(mc)
            diffusers_io.check(model, path, unet)
            unet.load_diffusers_state_dict(model, state)
        except ValueError as e:
            raise UserError(f"{path}: {e}") from None
        for note in notes:
            print(f"note: {note}")
        return model.to(device).eval().requires_grad_(False), mc, {}
    ckpt = checkpoints.load_checkpoint(path, device)
    try:
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in ckpt["model_config"].items()}
        state = ckpt["ema"]
    except (KeyError, TypeError, AttributeError) as e:  # a torch file, but not one of ours
        raise UserError(f"{path} is not a ddpm checkpoint (no {e})") from None
    try:
        mc = ModelConfig(**fields)
        validate(mc)  # before anything is allocated: the file may come from anyone
        model = UNet(mc).to(device)
        model.load_state_dict(state)
    except (TypeError, RuntimeError) as e:
        raise UserError(f"{path}: its weights do not match its model config ({first_line(e)})") from None
    return model.eval().requires_grad_(False), mc, ckpt.get("trainer_config", {})


# -----------------------------------------------------------------------------
# 4. Training


@dataclass
class Run:  # what train() sets up before its loop
    rank: int                    # this process under torchrun (0 alone writes the run folder and prints)
    world: int                   # processes under torchrun; 1 without
    device: torch.device
    out_dir: str                 # the run folder
    loader: typing.Any           # data.Loader: next() -> (x0, y) of this rank's batch
    built: Built                 # model, EMA, optimizer, forward (build)
    step: int                    # the step to start from: 0, or the checkpoint's on --resume
    skipped: int                 # non-finite steps skipped over the whole run before this start
    evaluator: typing.Any        # evaluate.TrainingEval, or None when eval_every_steps = 0
    flops_per_step: int          # counted training FLOPs of one global batch
    peak: float                  # peak FLOP/s of one device at the run's precision
    peak_source: str             # where that peak came from (datasheet, or measured)
    trackers: typing.Any = None  # runs.Trackers (TensorBoard, wandb) on rank 0 once the run is recorded
    budget: typing.Any = None    # Budget: the clock of time_budget_min


class Budget:
    """time_budget_min's clock: seconds since the process started (mfu.process_seconds: imports, data and
    compiling count), less the time spent on sample grids and evaluations (paused()); limit 0 = none."""
    clock = staticmethod(time.monotonic)

    def __init__(self, minutes):
        self.limit, self.paused_s, self.minutes_saved = minutes * 60, 0.0, 0
        self.start = self.clock() - ((mfu.process_seconds() or 0.0) if minutes else 0.0)

    def elapsed(self):
        return self.clock() - self.start - self.paused_s

    def spent(self, step, world, every):
        """Whether the budget is spent: checked every step in one process; under torchrun at the log steps
        (every), where the ranks agree (any rank's clock ends the run for all)."""
        if not self.limit or world > 1 and not due(every, step):
            return False
        over = float(self.elapsed() >= self.limit)
        return (group.all_reduce_sum(torch.tensor([over], dtype=torch.float64))[0].item() if world > 1
                else over) > 0

    @contextlib.contextmanager
    def paused(self):
        t = self.clock()
        try:
            yield
        finally:
            self.paused_s += self.clock() - t

    def minute_due(self):
        """The whole minute just passed, if its EMA snapshot is not saved yet and it is inside the budget."""
        m = int(self.elapsed() // 60)
        return m if self.limit and m > self.minutes_saved and m * 60 < self.limit else 0


def save_minute(run, mc, tc, step, minute):
    """The EMA at a whole minute of the budget, as <run>/minutes/ema_minNNN.pt in ema.pt's format (sample.py
    reads it), and its metrics row: the speedrun's FID curve is scored from these after training."""
    b, elapsed = run.built, run.budget.elapsed()
    run.budget.minutes_saved = minute
    if run.rank == 0:
        folder = files.own_folder(os.path.join(run.out_dir, "minutes"))
        checkpoints.atomic_save({"ema": b.ema.state_dict(), "model_config": asdict(mc),
                                 "trainer_config": asdict(tc), "step": step, "minute": minute,
                                 "clock_s": elapsed}, os.path.join(folder, f"ema_min{minute:03d}.pt"))
        runs.log_row(run.out_dir, {"step": step, "kimg": step * tc.batch_size / 1e3, "minute": minute,
                                   "clock_s": elapsed}, run.trackers)


def data_settings(mc, tc):
    """What defines the run's training data: recorded in ckpt.pt, compared by --resume."""
    folder = data.DATASETS[tc.dataset].reads != "built-in"
    return {"dataset": tc.dataset, "data_dir": os.path.abspath(tc.data_dir) if folder else None,
            "shapes_count": None if folder else tc.shapes_count, "image_size": mc.image_size}


def set_up(mc, tc, preset):
    """Everything before the loop: the device and torchrun, the run folder, the data, the model and its
    state (fresh, warm-started with init_from, or resumed), the evaluator and the FLOP counts."""
    validate(mc, tc)  # as parse_args does, for configs built in Python
    rank, world, device = runs.distributed_setup(tc)
    say = print if rank == 0 else (lambda *args, **kwargs: None)
    built_in = data.DATASETS[tc.dataset].reads == "built-in"  # its images are counted before any is made
    runs.check_fits(UNet, mc, tc, device, world, tc.shapes_count if built_in else 0)
    runs.check_trackers(tc.log_to)  # a tracker missing, or wandb without a login: before the run folder
    if data.DATASETS[tc.dataset].reads == "folder":
        data.with_images(tc.data_dir)  # an empty image folder: before the run folder
    out_dir = runs.prepare_run_folder(tc.out_dir, preset, tc.resume, world)
    loader, data_classes = make_loader(tc.loader, tc.dataset, tc.data_dir, mc.image_size,
                                       tc.batch_size // world, tc.seed, device, hflip=tc.hflip,
                                       with_labels=mc.num_classes > 0, shapes_count=tc.shapes_count,
                                       beton_dir=tc.beton_dir, num_workers=tc.num_workers)
    if mc.num_classes > 0 and mc.num_classes != data_classes:
        raise UserError(f"num_classes={mc.num_classes}, but dataset '{tc.dataset}' has "
                        f"{data_classes} classes")
    torch.manual_seed(tc.seed)  # after the data set-up, whose libraries may draw from the global RNG
    runs.set_up_cpu(device, tc.cpu_threads, say)
    b = build(mc, tc, device, world)
    runs.device_notes(device, b.precision, runs.resolve_compile(tc.compile, device), say)
    step, skipped = 0, 0
    if tc.init_from and not tc.resume:  # warm start, e.g. one expert from the other's checkpoint
        src, src_mc, _ = load_ema(tc.init_from, device)  # the averaged weights are the better starting point
        try:
            b.model.load_state_dict(src.state_dict())
            b.ema.load_state_dict(src.state_dict())
        except RuntimeError as e:
            raise UserError(f"--init_from {tc.init_from}: weights do not fit this model "
                            f"({first_line(e)})") from None
        differ = [f"{k}={v!r}" for k, v in asdict(src_mc).items() if getattr(mc, k) != v]
        say(f"initialised from {tc.init_from}" + (f" (a model with {', '.join(differ)})" if differ else ""))
    if tc.resume:
        ckpt, path = checkpoints.load_resume_checkpoint(out_dir, device)
        step = checkpoints.restore(ckpt, path, mc, b.model, b.ema, b.opt, loader, world, b.scaler,
                                   data_settings(mc, tc), tc.resume_new_data)
        skipped = ckpt.get("nonfinite_skipped", 0)
        if b.phema:
            b.phema.load_state_dict(ckpt.get("phema"), path)
        say(f"resumed {out_dir} from {os.path.basename(path)} at step {step}")
    # built now: missing Inception weights or data fail before training, not hours in
    evaluator = (evaluate.TrainingEval(mc, tc, b.diffusion, functools.partial(sample, b.diffusion), device)
                 if tc.eval_every_steps else None)
    peak, peak_source = mfu.peak_flops(device, b.precision)
    return Run(rank, world, device, out_dir, loader, b, step, skipped, evaluator,
               mfu.train_flops_per_image(UNet, mc, tc.attention) * tc.batch_size, peak, peak_source)


def record(run, mc, tc, preset):
    """config.json: both configs, what 'auto' resolved to, the environment; and the run's one-line summary."""
    b, n_params = run.built, sum(p.numel() for p in run.built.model.parameters())
    resolved = {"out_dir": run.out_dir, "device": str(run.device), "world_size": run.world,
                "precision": b.precision, "channels_last": b.channels_last,
                "compile": runs.resolve_compile(tc.compile, run.device), "parameters": n_params,
                "train_flops_per_image": run.flops_per_step // tc.batch_size,
                "peak_flops_per_device": run.peak, "peak_source": run.peak_source,
                "dataset_images": run.loader.n, "loader": type(run.loader).__name__}
    info = {"preset": preset, "model": asdict(mc), "trainer": asdict(tc), "resolved": resolved,
            "environment": runs.environment(run.device)}
    name = f"config-resume-{run.step}.json" if tc.resume else "config.json"
    runs.write_json(os.path.join(run.out_dir, name), info)
    run.trackers = runs.Trackers(tc.log_to, run.out_dir, info, run.step)
    print(f"{run.out_dir}: {n_params / 1e6:.2f}M parameters, {run.loader.n} images "
          f"({type(run.loader).__name__}), {run.world} x {run.device} {b.precision} "
          f"{'NHWC' if b.channels_last else 'NCHW'}, "
          f"{run.flops_per_step / tc.batch_size / 1e9:.3g} GFLOP/image fwd+bwd counted, "
          f"MFU against {run.peak / 1e12:.3g} TFLOP/s per device ({run.peak_source})")
    if b.phema:
        count = tc.max_steps * tc.batch_size // (tc.ema_snapshot_kimg * 1000) + 1
        most = "at most " if tc.time_budget_min else ""  # the clock may end the run sooner
        print(f"post-hoc EMA: σ_rel {', '.join(map(str, tc.ema_sigma_rels))} snapshotted every "
              f"{tc.ema_snapshot_kimg} kimg and at the end: {most}{count} snapshots, about "
              f"{count * b.phema.size_bytes() / 2**30:.2f} GiB in {os.path.join(run.out_dir, phema.FOLDER)}")


def log_interval(run, tc, step, tally, grad_norm, step_times_ms, t_start):
    """The metrics.jsonl row of the log interval ending at `step`, written by rank 0 (a host sync: the
    interval's only one); under DDP the loss sums are all-reduced, and every rank skipped the same steps.
    Stops the run once max_nonfinite_steps steps in a row were skipped."""
    t = tally.read(run.world)
    step_ms = statistics.median(step_times_ms or [float("nan")])
    quartiles = {f"loss_q{q}": t["loss_q"][q] for q in range(4)}
    row = {"step": step, "loss": t["loss"], "lr": lr_at(step - 1, tc), **quartiles,
           "grad_norm": grad_norm.item(), "nonfinite_skipped": t["skipped"], "step_ms": step_ms,
           "img_per_s": tc.batch_size / step_ms * 1e3, "tflops": run.flops_per_step / step_ms / 1e9,
           "mfu": mfu.mfu(run.flops_per_step, step_ms / 1e3, run.peak * run.world),
           "kimg": step * tc.batch_size / 1e3, "wall_s": time.time() - t_start}
    row = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
    if run.rank == 0:
        runs.log_row(run.out_dir, row, run.trackers)
    run.skipped += t["skipped"]
    if t["longest_run"] >= tc.max_nonfinite_steps:
        raise UserError(f"{t['longest_run']} consecutive steps had a non-finite loss or gradient (up to "
                        f"step {step}), all skipped; stopping. The checkpoints in {run.out_dir} hold finite "
                        "weights from before them: lower --lr or check the data, then --resume", RUN_STOPPED)
    return row


def save_samples(run, mc, tc, step):
    """An EMA sample grid: each rank draws its share, rank 0 saves it (and redraws loss.png)."""
    b, rank, world = run.built, run.rank, run.world
    mine = torch.arange(rank, tc.num_samples, world)
    y = (mine % mc.num_classes).to(run.device) if mc.num_classes > 0 else None
    g = torch.Generator().manual_seed(tc.seed + rank)  # the same noise every time: comparable grids
    x = sample(b.diffusion, autocast_model(b.ema, run.device, b.precision),
               (len(mine), mc.channels, mc.image_size, mc.image_size), sampler=tc.sampler,
               steps=tc.sample_steps or None, y=y, guidance=tc.guidance, threshold=tc.threshold,
               eta=tc.eta, generator=g)
    x = group.gather_rows(x)
    if rank == 0:
        path = os.path.join(run.out_dir, f"samples_{step:07d}.png")
        grid = runs.save_grid(x, path, kept=runs.kept(run.out_dir))
        if run.trackers:
            run.trackers.image(grid, step)
        runs.plot_curves(run.out_dir)


def off_the_clock(run, mc, tc, step, last_step, start_step, t_start, save_checkpoint, say):
    """Before a step's iteration: the checkpoint first (no later failure costs it), the post-hoc EMA snapshots
    (again on resuming at a snapshot's step, which a crash may have cost), the sample grid, the evaluation."""
    b, new = run.built, step > start_step
    if new and (last_step or due(tc.ckpt_every_steps, step)):
        save_checkpoint(step)
    if last_step and new and tc.time_budget_min and run.rank == 0:  # the final weights are written
        runs.log_row(run.out_dir, {"step": step, "kimg": step * tc.batch_size / 1e3,
                                   "clock_s": run.budget.elapsed(), "budget_s": tc.time_budget_min * 60},
                     run.trackers)
    kimg_due = b.phema and b.phema.snapshot_due(step, tc.batch_size, tc.ema_snapshot_kimg)
    if run.rank == 0 and b.phema and step > 0 and (kimg_due or last_step and new):
        b.phema.snapshot(run.out_dir, b.model, step, step * tc.batch_size, runs.kept(run.out_dir))
    if new and tc.num_samples and (last_step or due(tc.sample_every_steps, step)):
        with run.budget.paused():
            save_samples(run, mc, tc, step)
    if run.evaluator and new and (last_step or due(tc.eval_every_steps, step)):
        with run.budget.paused():
            result = run.evaluator(autocast_model(b.ema, run.device, b.precision), b.ema)
        row = {"step": step, "kimg": step * tc.batch_size / 1e3, "wall_s": time.time() - t_start, **result}
        if run.rank == 0:
            runs.log_row(run.out_dir, row, run.trackers)
            runs.plot_curves(run.out_dir)
        say(" | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
        if last_step and b.phema and tc.eval_fid_samples and tc.ema_eval_sigma_rels:
            ema_sweep(run, tc, step, say)  # the run's last act: nothing of the budget is left to pause


def ema_sweep(run, tc, step, say):
    """At the end of a run with post-hoc EMA and FID: the weights of each of ema_eval_sigma_rels rebuilt from
    the snapshots (phema.rebuilt_weights), written as `python -m machinery.phema` writes them, to
    <run>/ema-sigma_rel<σ_rel>.pt, and scored on the evaluations' fixed noise; one metrics row with every FID
    and the best."""
    b, fids, net = run.built, {}, copy.deepcopy(run.built.ema)
    group.barrier()  # rank 0 has written the last snapshots
    for sigma_rel in tc.ema_eval_sigma_rels:
        weights = phema.rebuilt_weights(run.out_dir, sigma_rel)
        if run.rank == 0:
            phema.write_weights(run.out_dir, sigma_rel, weights)
        net.load_state_dict(weights["ema"])
        scored = run.evaluator(autocast_model(net, run.device, b.precision), net, bpd=False)
        fids[phema.sigma_rel_name(sigma_rel)] = scored["fid"]
    best = min(fids, key=lambda w: fids[w] if fids[w] is not None else math.inf)  # NaN: logged as None
    if run.rank == 0:
        runs.log_row(run.out_dir, {"step": step, **{f"fid_sigma_rel_{w}": f for w, f in fids.items()},
                                   "best_sigma_rel": float(best)}, run.trackers)
    say(f"post-hoc EMA at the end: FID by σ_rel {fids}; best {best}, its weights "
        f"{phema.weights_path(run.out_dir, float(best))}")


def due(every, step):
    """An interval setting's test: every > 0 steps, and this step is one of them (0 = never)."""
    return every > 0 and step % every == 0


def train(mc, tc, preset="custom"):
    """Train from scratch or resume; returns the run folder. Fixed sections each step: checkpoint/samples/eval
    -> iteration (LR, forward/backward/step, EMA) -> log -> stop requests.
    Under torchrun every rank runs this; rank 0 alone writes the run folder."""
    from tqdm import tqdm

    budget = Budget(tc.time_budget_min)  # reads the process's start: set-up (data, compiling) counts
    run = set_up(mc, tc, preset)
    run.budget = budget
    b, step, lead = run.built, run.step, run.rank == 0
    say = print if lead else (lambda *args, **kwargs: None)
    timer = mfu.StepTimer(run.device)
    timing_warmup = step + 5  # the first steps after (re)start (compiling, allocator warm-up): off the clock
    tally = runs.Tally(run.device)  # the log interval's loss sums and skipped steps, on the device
    ticker, logged = runs.OffTerminal(), None  # off a terminal, a progress line a minute, not tqdm's bar
    start_step, t_start = step, time.time()

    def save_checkpoint(step):  # rank 0 alone: the other ranks hold the same state
        if lead:
            checkpoints.save_checkpoints(run.out_dir, step, b.model, b.ema, mc, tc,
                                         data=data_settings(mc, tc), optimizer=b.opt.state_dict(),
                                         loader=run.loader.state_dict(), world_size=run.world,
                                         scaler=b.scaler.state_dict() if b.scaler else None,
                                         phema=b.phema.state_dict() if b.phema else None,
                                         nonfinite_skipped=run.skipped + int(tally.skipped.item()))

    lock = runs.lock_run_folder(run.out_dir) if lead else None  # one run per folder: a second is refused
    preempt = runs.Preemption(run.world)
    pbar = None
    try:
        if lead:
            runs.mend_metrics(run.out_dir)  # a line cut by a crash is ended before this run appends
            record(run, mc, tc, preset)
        pbar = tqdm(total=tc.max_steps, initial=step, dynamic_ncols=True, desc="train",
                    disable=None if lead else True)  # on a terminal only (tqdm's None), and on rank 0
        if step >= tc.max_steps:
            say(f"note: {run.out_dir} is at step {step}, which is --max_steps={tc.max_steps} or past it: "
                "nothing to train")
        spent = budget.spent(step, run.world, tc.log_every_steps)  # time_budget_min's clock
        if spent and step < tc.max_steps:
            raise UserError(f"the time budget ({tc.time_budget_min:g} min) was spent before the first step: "
                            f"{budget.elapsed():.0f} s since the process started", RUN_STOPPED)
        while True:
            last_step = step >= tc.max_steps or spent

            # 1. checkpoint, post-hoc EMA snapshots, sample grid, evaluation (off the clock)
            off_the_clock(run, mc, tc, step, last_step, start_step, t_start, save_checkpoint, say)
            if last_step:
                break

            # 2. the learning rate, forward / backward / AdamW (skipped if anything is non-finite), the EMA
            if step >= timing_warmup:
                timer.start()
            out = iteration(b, *run.loader.next(), tc, step, (run.rank, run.world))  # the batch: x0, y
            if step >= timing_warmup:
                timer.stop()
            tally.add(out.loss, out.losses, out.t * 4 // mc.timesteps, out.ok)
            step += 1
            pbar.update(1)
            spent = budget.spent(step, run.world, tc.log_every_steps)

            # 3. log: one metrics.jsonl row per log_every_steps, the interval's only GPU->CPU sync
            if due(tc.log_every_steps, step) or step == tc.max_steps or spent:
                logged = log_interval(run, tc, step, tally, out.grad_norm, timer.read_ms(), t_start)
                pbar.set_postfix_str(runs.progress_text(logged))
            if lead and ticker.due():
                say(f"step {step}/{tc.max_steps}" + (f" ({runs.progress_text(logged)})" if logged else ""))
            minute = budget.minute_due()  # against the clock: the EMA at each whole minute
            if minute:
                save_minute(run, mc, tc, step, minute)

            # 4. a stop request (SIGTERM, SIGINT) ends the run after this step, with a checkpoint
            if preempt.requested():
                save_checkpoint(step)
                say(f"stopped by {preempt.signal} after step {step}: checkpoint saved in {run.out_dir}; "
                    "continue with --resume")
                return run.out_dir
    finally:
        preempt.close()
        if pbar:
            pbar.close()
        if run.trackers:
            run.trackers.close()
        runs.unlock_run_folder(lock)
    say(f"done: {run.out_dir} (step {step}, {time.time() - t_start:.0f} s)")
    return run.out_dir


def main(argv=None):
    """Bad input exits 2, a run that cannot go on exits 1; each with one line, never a traceback."""
    try:
        with reported():
            mc, tc, preset = parse_args(sys.argv[1:] if argv is None else argv)
            train(mc, tc, preset)
    finally:
        group.leave()


if __name__ == "__main__":
    main()


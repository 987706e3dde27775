"""The DDPM UNet of Ho et al. 2020 (Appendix B), with patching, class conditioning and SDPA.

    model = UNet(cfg)              # cfg: ddpm.ModelConfig
    out = model(x, t, y)           # x: (B, C, H, W), t: (B,) timesteps, y: (B,) labels or None

The network maps (x, t, y) to a tensor shaped like x. It knows nothing of the noise
schedule: t is just a number it embeds, and what `out` means (ε, x₀ or v) is decided
by ddpm.Diffusion. With the default config it has 35.7M parameters, as in the paper.

Patching (Luhman & Luhman 2022): with patch_size P the input is folded into
(B, C·P², H/P, W/P) by pixel_unshuffle before the first convolution, and the output is
unfolded by pixel_shuffle after the last, so every layer runs on a P× smaller grid.
Attention resolutions refer to that patched grid.

It is Ho et al.'s network function for function (their timestep frequencies, TF 'SAME' padding on the
stride-2 convs, GroupNorm eps 1e-6, their initialisation): with the same weights its output equals
diffusers' UNet2DModel to ~1e-15 in float64. The last section converts weights and config.json to and
from UNet2DModel's names (diffusers_state_dict, load_diffusers_state_dict); activation_checkpointing=True
recomputes each block in the backward pass; norm_kernel='triton' runs each GroupNorm-SiLU pair as one fused
Triton kernel (kernels.py, CUDA).

Two of issue 50's levers change the network itself, both off by default: resample='resblock' puts BigGAN's
residual resampling blocks between the levels (ResBlock), and mp_layers puts EDM2's magnitude-preserving
layers in place of Ho's convs, dense layers, sums and concatenations (the section after ho_init).
"""
import math
import re

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from machinery import kernels


NORM_EPS = 1e-6  # GroupNorm's epsilon in Ho et al.'s code (TF's group_norm), not PyTorch's default 1e-5
POS_EMB_OMEGA = 64  # omega x grid size of Luhman & Luhman's position embedding (position_embedding_2d)
NORM_KERNELS = ("torch", "triton")  # how a GroupNorm followed by SiLU runs (norm_silu)


def group_norm(channels, groups=0):
    """GroupNorm of `groups` groups (ModelConfig.norm_groups: one count for the whole network, as diffusers'
    norm_num_groups); 0: per width, 32 as in the paper but at least 2 channels per group: a group of one
    channel removes any per-channel shift, and so the time and class embedding a ResBlock adds just before
    its second norm (widths of 32 and below; the paper's are all >= 128, where this is 32 groups)."""
    groups = groups or max(g for g in range(1, 33) if channels % g == 0 and channels // g >= 2)
    return nn.GroupNorm(groups, channels, eps=NORM_EPS)


def norm_silu(norm, x, kernel="torch"):
    """F.silu(norm(x)), norm a GroupNorm. kernel 'torch': those two calls, which torch.compile fuses on
    its own; 'triton': kernels.group_norm_silu, one hand-written pass each way (CUDA; elsewhere it raises)."""
    return kernels.group_norm_silu(x, norm) if kernel == "triton" else F.silu(norm(x))


def ho_init(layer, scale=1.0, parts=1):
    """Ho et al.'s initialisation of a conv or dense layer (diffusion_tf's default_init): TF's
    variance_scaling(scale, 'fan_avg', 'uniform'), i.e. uniform on ±√(3·scale / fan_avg), which is
    Glorot-uniform with gain √scale; bias 0. scale 0 means 1e-10, as there: the last layer of every
    residual branch and the output start at ~0, so each block starts as the identity.
    parts: the layer is that many equal layers stacked along its output (q, k and v in one matmul),
    each initialised with its own fans."""
    for w in layer.weight.chunk(parts):
        nn.init.xavier_uniform_(w, gain=math.sqrt(scale or 1e-10))
    nn.init.zeros_(layer.bias)
    return layer


def conv(in_ch, out_ch, kernel, mp=False, scale=1.0, gain=1.0, **kw):
    """A conv layer: Ho et al.'s (ho_init at `scale`), or with mp a magnitude-preserving one (MPConv) whose
    output is multiplied by `gain` (1/MP_SILU after a SiLU)."""
    if mp:
        return MPConv(in_ch, out_ch, kernel, gain, **kw)
    return ho_init(nn.Conv2d(in_ch, out_ch, kernel, **kw), scale)


def dense(in_f, out_f, mp=False, scale=1.0, gain=1.0, parts=1):
    """A dense layer, as conv()."""
    return MPDense(in_f, out_f, gain) if mp else ho_init(nn.Linear(in_f, out_f), scale, parts)


# -----------------------------------------------------------------------------
# EDM2's magnitude-preserving layers (Karras et al. 2024 §2: config D's learned layers, E's forced weight
# normalisation, G's fixed-function layers), ModelConfig.mp_layers, here in Ho et al.'s network with its
# GroupNorms kept. The magnitude M[x] = (mean of E[x²])^½ stays 1 along the network: each conv and dense layer
# has no bias and divides each of its weight rows by the row's norm in the forward, so white inputs of
# magnitude 1 give outputs of magnitude 1; SiLU is divided by its magnitude on N(0, 1) (folded into the next
# layer's gain); residual sums and skip concatenations are weighted to keep their inputs' magnitude; the
# output has a learned gain that starts at 0 (Ho's zero-initialised last layers cannot be normalised).
# force_weight_norm_, which train_step calls after every optimizer step, projects each stored row back to
# norm √fan_in, so that Adam's steps change every layer by the same relative amount: the LR is relative to
# weights of magnitude 1 (EDM2 trains at 1e-2).

MP_SILU = 0.596     # M[silu(x)] for x ~ N(0, 1): E[silu(x)²]^½ (tests/test_unet.py integrates it)
MP_RESIDUAL = 0.3   # t of mp_sum between a block's input and its residual branch (EDM2's value)
MP_SKIP = 0.5       # t of mp_cat between the up path and a skip connection: both count the same
MP_EPS = 1e-4       # added to a weight row's norm before dividing by it


def unit_norm(w, dims):
    """w divided by its norm over `dims` (one row's), computed in float32."""
    norm = torch.linalg.vector_norm(w.float(), dim=dims, keepdim=True)
    return (w.float() / (norm + MP_EPS)).to(w.dtype)


def mp_sum(a, b, t):
    """The magnitude-preserving sum: the lerp (1-t)·a + t·b over √((1-t)² + t²), so that uncorrelated a and
    b of magnitude 1 give magnitude 1."""
    return ((1 - t) * a + t * b) / math.sqrt((1 - t) ** 2 + t * t)


def mp_cat(a, b, t):
    """The magnitude-preserving concatenation along channels: a weighted (1-t)/√N_a, b weighted t/√N_b, both
    scaled by √((N_a + N_b) / ((1-t)² + t²)), so that a and b of magnitude 1 give magnitude 1."""
    na, nb = a.shape[1], b.shape[1]
    c = math.sqrt((na + nb) / ((1 - t) ** 2 + t * t))
    return torch.cat([a * (c * (1 - t) / math.sqrt(na)), b * (c * t / math.sqrt(nb))], dim=1)


class MPConv(nn.Conv2d):
    """A conv without bias whose weight rows (one per output channel) have norm 1 in the forward."""

    def __init__(self, in_ch, out_ch, kernel, gain=1.0, **kw):
        super().__init__(in_ch, out_ch, kernel, bias=False, **kw)
        nn.init.normal_(self.weight)  # rows of norm ≈ √fan_in, where force_weight_norm_ keeps them
        self.gain, self.row = gain, (1, 2, 3)

    def forward(self, x):
        return self._conv_forward(x, unit_norm(self.weight, self.row) * self.gain, None)


class MPDense(nn.Linear):
    """A dense layer without bias whose weight rows have norm 1 in the forward."""

    def __init__(self, in_f, out_f, gain=1.0):
        super().__init__(in_f, out_f, bias=False)
        nn.init.normal_(self.weight)
        self.gain, self.row = gain, (1,)

    def forward(self, x):
        return F.linear(x, unit_norm(self.weight, self.row) * self.gain)


class MPEmbedding(nn.Embedding):
    """The class embedding as EDM2 has it: an MPDense on the one-hot label scaled to magnitude 1 (× √N for
    N classes), i.e. a lookup in a table whose columns (one per output channel) have norm √N."""

    def __init__(self, n, dim):
        super().__init__(n, dim)  # N(0, 1)
        self.row = (0,)

    def forward(self, y):
        return F.embedding(y, unit_norm(self.weight, self.row) * math.sqrt(self.num_embeddings))


@torch.no_grad()
def force_weight_norm_(model):
    """EDM2's forced weight normalisation: every magnitude-preserving layer's stored weight rows back to norm
    √(row size), the magnitude-1 elements the forward's unit rows start from. A no-op without them."""
    for m in model.modules():
        if isinstance(m, (MPConv, MPDense, MPEmbedding)):
            size = math.prod(m.weight.shape[d] for d in m.row)
            m.weight.copy_(unit_norm(m.weight, m.row) * math.sqrt(size))


def timestep_embedding(t, dim, max_period=10000.0):
    """Sinusoidal embedding of t: (B,) -> (B, dim), float32 (Vaswani et al. 2017, §3.5), with Ho et al.'s
    frequencies max_period^(-i / (dim/2 - 1)), i = 0..dim/2-1 (diffusion_tf's get_timestep_embedding)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32)
                      / max(half - 1, 1))
    args = t.float()[:, None] * freqs[None]  # (B, half)
    emb = torch.cat([torch.sin(args), torch.cos(args)], dim=1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


def position_embedding_2d(channels, size):
    """Luhman & Luhman 2022's fixed 2D position embedding, as their code adds it: (1, channels, size, size)
    for a size x size patched grid. Channel i < C/2 is sin(omega * x * f_i) of the column x, channel C/2 + i
    the same of the row y, with timestep_embedding's frequencies f_i = 10000^(-i/(C/2-1)) and
    omega = POS_EMB_OMEGA / size (larger grids get longer wavelengths); sine only (an odd C gets a zero
    channel)."""
    half = channels // 2
    omega = POS_EMB_OMEGA / size
    waves = timestep_embedding(torch.arange(size) * omega, 2 * half)[:, :half]  # (size, C/2): the sines
    emb = torch.cat([waves[None, :, :].expand(size, size, half),   # [y, x] -> wave of x
                     waves[:, None, :].expand(size, size, half)],  # [y, x] -> wave of y
                    dim=-1)
    return F.pad(emb.permute(2, 0, 1), (0, 0, 0, 0, 0, channels % 2))[None]


class ResBlock(nn.Module):
    """GroupNorm-SiLU-conv, add the time embedding, GroupNorm-SiLU-dropout-conv, plus a skip.

    scale_shift: the embedding gives a scale s and a shift b applied after the second GroupNorm,
    norm(h)·(1 + s) + b (Dhariwal & Nichol 2021's AdaGN; diffusers' resnet_time_scale_shift='scale_shift'),
    instead of being added before it.
    norm_kernel: how each GroupNorm-SiLU pair runs (norm_silu); with scale_shift the second norm's scale and
    shift sit between the two, so that one always runs on torch.
    resample: 'down' or 'up' makes it BigGAN's resampling block (Brock et al. 2019 Fig. 15; ADM's
    resblock_updown; diffusers' ResnetBlock2D(down=True / up=True)): after the first norm-SiLU, both the
    residual and the skip are halved by 2x2 average pooling or doubled by nearest upsampling."""

    def __init__(self, in_ch, out_ch, temb_ch, dropout, groups=0, scale_shift=False, norm_kernel="torch",
                 resample=None, mp=False):
        super().__init__()
        self.scale_shift, self.norm_kernel, self.mp = scale_shift, norm_kernel, mp
        self.resample = {None: None, "down": halve, "up": double}[resample]
        after_silu = 1 / MP_SILU
        self.norm1 = group_norm(in_ch, groups)
        self.conv1 = conv(in_ch, out_ch, 3, mp, gain=after_silu, padding=1)
        self.temb_proj = dense(temb_ch, 2 * out_ch if scale_shift else out_ch, mp, gain=after_silu)
        self.norm2 = group_norm(out_ch, groups)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = conv(out_ch, out_ch, 3, mp, scale=0, gain=after_silu, padding=1)
        self.skip = conv(in_ch, out_ch, 1, mp) if in_ch != out_ch else nn.Identity()  # Ho's "nin"

    def forward(self, x, temb):
        h = norm_silu(self.norm1, x, self.norm_kernel)
        if self.resample is not None:
            h, x = self.resample(h), self.resample(x)
        h = self.conv1(h)
        emb = self.temb_proj(F.silu(temb))[:, :, None, None]
        if self.scale_shift:
            scale, shift = emb.chunk(2, dim=1)
            h = F.silu(self.norm2(h) * (1 + scale) + shift)
        else:
            h = norm_silu(self.norm2, h + emb, self.norm_kernel)
        h = self.conv2(dropout(h, self.dropout.p, self.training))
        return mp_sum(self.skip(x), h, MP_RESIDUAL) if self.mp else self.skip(x) + h


def dropout(x, p, training):
    """F.dropout, with the keep mask cut from 32 random bits per element on a CPU in eager mode: ATen's CPU
    bernoulli_ draws one element at a time, ~155 ms of a 2.4 s 'ho' step at batch 16 on 2 cores; this made
    the step 5-6% faster (BENCHMARKS.md). The keep probability is 1 - p to 2^-32; the stream is torch's
    global generator, as F.dropout's (seeded runs stay deterministic). Elsewhere, and under torch.compile,
    F.dropout itself."""
    if not training or p == 0 or x.device.type != "cpu" or torch.compiler.is_compiling():
        return F.dropout(x, p, training)
    n = x.numel()
    bits = torch.randint(-2**63, 2**63 - 1, ((n + 1) // 2,), dtype=torch.int64).view(torch.int32)[:n]
    keep = bits.view(x.shape) < int(-2**31 + round((1 - p) * 2**32))  # P(keep) = 1 - p
    return x * keep.to(x.dtype).mul_(1 / (1 - p))


class Attention(nn.Module):
    """Self-attention over the H·W positions, with a residual connection.

    `heads` heads of `head_dim` channels each; head_dim = 0 splits the block's own width
    evenly between the heads (Ho et al. use one head of full width); heads = 0 takes as many
    heads of head_dim channels as the width holds (ADM's num_head_channels).
    backend 'sdpa' calls F.scaled_dot_product_attention (flash / memory-efficient kernels);
    'math' writes the softmax out, as the reference baseline did.
    """

    def __init__(self, channels, heads, head_dim, backend, groups=0, mp=False):
        super().__init__()
        self.mp = mp
        self.heads = heads or channels // head_dim  # heads = 0: as many heads of head_dim as the width holds
        self.head_dim = head_dim or channels // heads
        inner = self.heads * self.head_dim
        self.backend = backend
        self.norm = group_norm(channels, groups)
        self.qkv = dense(channels, 3 * inner, mp, parts=3)  # Ho et al.'s q, k, v: three C x C layers
        self.proj = dense(inner, channels, mp, scale=0)

    def forward(self, x):
        B, C, H, W = x.shape
        h = self.norm(x).flatten(2).transpose(1, 2)  # (B, HW, C)
        qkv = self.qkv(h).view(B, H * W, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, nh, HW, hd)
        if self.backend == "sdpa":
            h = F.scaled_dot_product_attention(q, k, v)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (B, nh, HW, HW)
            h = att.softmax(dim=-1) @ v
        h = h.transpose(1, 2).reshape(B, H * W, self.heads * self.head_dim)  # (B, HW, nh·hd)
        h = self.proj(h).transpose(1, 2).reshape(B, C, H, W)
        return mp_sum(x, h, MP_RESIDUAL) if self.mp else x + h


def halve(x):
    return F.avg_pool2d(x, 2)


def double(x):
    return F.interpolate(x, scale_factor=2.0, mode="nearest")


class Downsample(nn.Module):
    """Stride-2 3x3 conv with TF's padding='SAME', as Ho et al. ran it: on an even size, 0 rows and columns
    of zeros before and 1 after (a symmetric padding=1 would shift the sampling grid by one pixel)."""

    def __init__(self, channels, mp=False):
        super().__init__()
        self.conv = conv(channels, channels, 3, mp, stride=2)

    def forward(self, x, temb=None):  # temb: unused; called as the resampling ResBlock is
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    def __init__(self, channels, mp=False):
        super().__init__()
        self.conv = conv(channels, channels, 3, mp, padding=1)

    def forward(self, x, temb=None):  # temb: unused; called as the resampling ResBlock is
        return self.conv(double(x))


class Level(nn.Module):
    """The res blocks (each optionally followed by attention) at one resolution."""

    def __init__(self, in_chs, out_ch, temb_ch, attn, cfg, backend, norm_kernel="torch"):
        super().__init__()
        groups = cfg.norm_groups
        self.res = nn.ModuleList(ResBlock(c, out_ch, temb_ch, cfg.dropout, groups, cfg.scale_shift_norm,
                                          norm_kernel, mp=cfg.mp_layers) for c in in_chs)
        self.attn = nn.ModuleList(
            Attention(out_ch, cfg.attn_heads, cfg.attn_head_dim, backend, groups, cfg.mp_layers) if attn
            else nn.Identity()
            for _ in in_chs
        )


class UNet(nn.Module):
    """activation_checkpointing: each residual and attention block keeps only its input for the backward pass
    and recomputes the rest there (torch.utils.checkpoint, non-reentrant, the same dropout masks): the
    activations' memory falls to the blocks' inputs, for about one more forward pass of compute.
    norm_kernel (NORM_KERNELS): where a GroupNorm is followed directly by SiLU (each ResBlock's first norm,
    its second without scale_shift_norm, the output norm), 'torch' runs the two as F.silu(norm(x)), 'triton'
    as the fused kernel of kernels.py (a CUDA device; the weights and outputs are the same function)."""

    def __init__(self, cfg, attention="sdpa", activation_checkpointing=False, norm_kernel="torch"):
        super().__init__()
        if norm_kernel not in NORM_KERNELS:
            raise ValueError(f"norm_kernel={norm_kernel!r}: one of {NORM_KERNELS}")
        self.cfg, self.activation_checkpointing = cfg, activation_checkpointing
        self.norm_kernel = norm_kernel
        P, ch = cfg.patch_size, cfg.base_channels
        temb_ch = 4 * ch
        mp = cfg.mp_layers
        self.time_mlp = nn.Sequential(dense(ch, temb_ch, mp), nn.SiLU(),
                                      dense(temb_ch, temb_ch, mp, gain=1 / MP_SILU))
        # one extra class index, num_classes, is the "no label" class used by classifier-free guidance
        embedding = MPEmbedding if mp else nn.Embedding
        self.class_emb = embedding(cfg.num_classes + 1, temb_ch) if cfg.num_classes > 0 else None
        self.conv_in = conv(cfg.channels * P * P, ch, 3, mp, padding=1)
        if cfg.pos_emb:
            self.register_buffer("pos_emb", position_embedding_2d(ch, cfg.image_size // P), persistent=False)

        widths = [int(ch * m) for m in cfg.channel_mult]

        def resampler(way, width):  # between levels: Ho's conv, or BigGAN's residual block
            if cfg.resample == "conv":
                return Downsample(width, mp) if way == "down" else Upsample(width, mp)
            return ResBlock(width, width, temb_ch, cfg.dropout, cfg.norm_groups, cfg.scale_shift_norm,
                            norm_kernel, resample=way, mp=mp)

        res = cfg.image_size // P  # resolution of the patched grid
        skip_chs = [ch]  # channels of every activation the up path will concatenate
        self.down, self.downsample = nn.ModuleList(), nn.ModuleList()
        cur = ch
        for i, w in enumerate(widths):
            in_chs = [cur] + [w] * (cfg.num_res_blocks - 1)
            self.down.append(Level(in_chs, w, temb_ch, res in cfg.attn_resolutions, cfg, attention,
                                   norm_kernel))
            skip_chs += [w] * cfg.num_res_blocks
            cur = w
            last = i == len(widths) - 1
            self.downsample.append(nn.Identity() if last else resampler("down", cur))
            if not last:
                skip_chs.append(cur)
                res //= 2

        mid = (cur, cur, temb_ch, cfg.dropout, cfg.norm_groups, cfg.scale_shift_norm, norm_kernel, None, mp)
        self.mid_res1 = ResBlock(*mid)
        self.mid_attn = Attention(cur, cfg.attn_heads, cfg.attn_head_dim, attention, cfg.norm_groups, mp)
        self.mid_res2 = ResBlock(*mid)

        self.up, self.upsample = nn.ModuleList(), nn.ModuleList()
        for i, w in reversed(list(enumerate(widths))):
            in_chs = []
            for _ in range(cfg.num_res_blocks + 1):
                in_chs.append(cur + skip_chs.pop())
                cur = w
            self.up.append(Level(in_chs, w, temb_ch, res in cfg.attn_resolutions, cfg, attention,
                                 norm_kernel))
            self.upsample.append(resampler("up", cur) if i > 0 else nn.Identity())
            if i > 0:
                res *= 2

        self.norm_out = group_norm(cur, cfg.norm_groups)
        self.conv_out = conv(cur, cfg.channels * P * P, 3, mp, scale=0, gain=1 / MP_SILU, padding=1)
        if mp:  # the output's learned gain, from 0: the network starts at 0, as Ho's does
            self.out_gain = nn.Parameter(torch.zeros([]))

    def forward(self, x, t, y=None):
        """x: (B, C, H, W); t: (B,) timesteps; y: (B,) labels in [0, num_classes], num_classes = no label."""
        P = self.cfg.patch_size
        emb = timestep_embedding(t, self.cfg.base_channels)  # float32, as in Ho et al. and diffusers
        mp = self.cfg.mp_layers
        if mp:  # sines and cosines of amplitude 1 have magnitude 1/√2
            emb = emb * math.sqrt(2)
        # (B, 4ch), in the network's dtype (float64 too)
        temb = self.time_mlp(emb.to(self.conv_in.weight.dtype))
        if self.class_emb is not None:
            if y is None:  # unconditional call: everything gets the null class
                y = torch.full((x.shape[0],), self.cfg.num_classes, device=x.device, dtype=torch.long)
            temb = mp_sum(temb, self.class_emb(y), 0.5) if mp else temb + self.class_emb(y)

        h = self.conv_in(F.pixel_unshuffle(x, P) if P > 1 else x)  # (B, ch, H/P, W/P)
        if self.cfg.pos_emb:
            pos = self.pos_emb.to(h.dtype)
            h = mp_sum(h, math.sqrt(2) * pos, 0.5) if mp else h + pos
        hs = [h]
        for level, down in zip(self.down, self.downsample):
            for res, attn in zip(level.res, level.attn):
                h = self.block(attn, self.block(res, h, temb))
                hs.append(h)
            if not isinstance(down, nn.Identity):
                h = self.block(down, h, temb)
                hs.append(h)

        h = self.block(self.mid_res1, h, temb)
        h = self.block(self.mid_res2, self.block(self.mid_attn, h), temb)

        for level, up in zip(self.up, self.upsample):
            for res, attn in zip(level.res, level.attn):
                joined = mp_cat(h, hs.pop(), MP_SKIP) if mp else torch.cat([h, hs.pop()], dim=1)
                h = self.block(attn, self.block(res, joined, temb))
            if not isinstance(up, nn.Identity):
                h = self.block(up, h, temb)

        h = self.conv_out(norm_silu(self.norm_out, h, self.norm_kernel))
        if mp:
            h = h * self.out_gain.to(h.dtype)
        return F.pixel_shuffle(h, P) if P > 1 else h

    def block(self, module, *args):
        """module(*args), recomputed in the backward pass under activation checkpointing."""
        if self.activation_checkpointing and torch.is_grad_enabled() and not isinstance(module, nn.Identity):
            return torch.utils.checkpoint.checkpoint(module, *args, use_reentrant=False)
        return module(*args)


# -----------------------------------------------------------------------------
# diffusers' UNet2DModel is this network under other names (google/ddpm-cifar10-32, diffusers' conversion of
# Ho et al.'s CIFAR-10 checkpoint, is the 'ho' preset). Unconditional models with P = 1, no position
# embedding, one GroupNorm group count throughout and one attention layout can be written in its format and
# read back.

RENAMES = [  # (our tensor name pattern, diffusers' replacement), applied in this order
    (r"^time_mlp\.0\.", "time_embedding.linear_1."), (r"^time_mlp\.2\.", "time_embedding.linear_2."),
    (r"^(down|up)\.(\d+)\.res\.", r"\1_blocks.\2.resnets."),
    (r"^(down|up)\.(\d+)\.attn\.", r"\1_blocks.\2.attentions."),
    (r"^downsample\.(\d+)\.", r"down_blocks.\1.downsamplers.0."),
    (r"^upsample\.(\d+)\.", r"up_blocks.\1.upsamplers.0."),
    (r"^mid_res1\.", "mid_block.resnets.0."), (r"^mid_attn\.", "mid_block.attentions.0."),
    (r"^mid_res2\.", "mid_block.resnets.1."), (r"^norm_out\.", "conv_norm_out."),
    (r"\.temb_proj\.", ".time_emb_proj."), (r"\.skip\.", ".conv_shortcut."), (r"\.norm\.", ".group_norm."),
    (r"\.proj\.", ".to_out.0."),
]
QKV = ("to_q", "to_k", "to_v")  # our fused qkv is diffusers' three layers, stacked along the output
# names in older exports
DEPRECATED = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}


def diffusers_names(name):
    """Our tensor name -> its diffusers name(s): one, or three for a fused qkv."""
    for pattern, repl in RENAMES:
        name = re.sub(pattern, repl, name)
    return [name.replace(".qkv.", f".{n}.") for n in QKV] if ".qkv." in name else [name]


# our resample field -> diffusers' resampling in its attention blocks, and its block types without attention
RESAMPLE_TYPES = {"conv": "conv", "resblock": "resnet"}
DOWN_BLOCKS = {"conv": "DownBlock2D", "resblock": "ResnetDownsampleBlock2D"}
UP_BLOCKS = {"conv": "UpBlock2D", "resblock": "ResnetUpsampleBlock2D"}


def diffusers_config(model):
    """The UNet2DModel config (config.json's fields) of `model`; ValueError naming what it cannot express."""
    cfg = model.cfg

    def need(ok, field, why):
        if not ok:
            raise ValueError(f"diffusers' UNet2DModel cannot express {field}={getattr(cfg, field)!r} ({why})")

    need(cfg.patch_size == 1, "patch_size", "it has no patching")
    need(not cfg.pos_emb, "pos_emb", "it has no position embedding")
    need(cfg.num_classes == 0, "num_classes", "it has no null class for guidance")
    need(not cfg.mp_layers, "mp_layers", "it has no magnitude-preserving layers")
    widths = [int(cfg.base_channels * m) for m in cfg.channel_mult]
    need(widths[0] == cfg.base_channels, "channel_mult", "its first level is as wide as the input conv")
    groups = {m.num_groups for m in model.modules() if isinstance(m, nn.GroupNorm)}
    fits = [g for g in range(1, 33) if all(w % g == 0 and w // g >= 2 for w in [cfg.base_channels, *widths])]
    need(len(groups) == 1, "norm_groups", f"one GroupNorm group count for all widths, and these widths give "
         f"{sorted(groups)}: train with --norm_groups set to one of {fits}")
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    if all(a.heads == 1 for a in attns):
        head_dim = None  # one head as wide as its block, Ho et al.'s attention
    else:
        dims = {a.head_dim for a in attns}
        need(len(dims) == 1 and all(a.heads * a.head_dim == a.qkv.in_features for a in attns), "attn_heads",
             "heads of one fixed width that together span the block")
        head_dim = dims.pop()
    attn = [cfg.image_size // 2**i in cfg.attn_resolutions for i in range(len(widths))]
    return {
        "_class_name": "UNet2DModel", "sample_size": cfg.image_size, "in_channels": cfg.channels,
        "out_channels": cfg.channels, "center_input_sample": False, "time_embedding_type": "positional",
        # Ho's frequencies, sin before cos
        "time_embedding_dim": None, "freq_shift": 1, "flip_sin_to_cos": False,
        "down_block_types": ["AttnDownBlock2D" if a else DOWN_BLOCKS[cfg.resample] for a in attn],
        "mid_block_type": "UNetMidBlock2D",
        "up_block_types": ["AttnUpBlock2D" if a else UP_BLOCKS[cfg.resample] for a in reversed(attn)],
        "block_out_channels": widths, "layers_per_block": cfg.num_res_blocks, "mid_block_scale_factor": 1,
        "downsample_padding": 0,  # TF's 'SAME' on the stride-2 conv, as our Downsample
        "downsample_type": RESAMPLE_TYPES[cfg.resample], "upsample_type": RESAMPLE_TYPES[cfg.resample],
        "dropout": cfg.dropout, "act_fn": "silu",
        # with scale_shift, diffusers' mid-block attention has a norm only if attn_norm_num_groups says so
        "attention_head_dim": head_dim, "norm_num_groups": (g := groups.pop()),
        "attn_norm_num_groups": g if cfg.scale_shift_norm else None,
        "norm_eps": NORM_EPS, "resnet_time_scale_shift": "scale_shift" if cfg.scale_shift_norm else "default",
        "add_attention": True,
        "class_embed_type": None, "num_class_embeds": None, "num_train_timesteps": None,
    }


def model_fields_from_diffusers(config):
    """A UNet2DModel config.json -> our ModelConfig's network fields; ValueError naming a field it cannot
    express. Fields left out take diffusers' defaults (DIFFUSERS_DEFAULTS). The config's types and sizes are
    the caller's to check first (diffusers_io.LIMITS: a folder comes from strangers). The caller builds the
    model and compares diffusers_config(model) with the config, which catches the rest (a GroupNorm group
    count or an epsilon that differs from ours)."""
    config = {**DIFFUSERS_DEFAULTS, **config}

    def need(ok, field, why):
        if not ok:
            value = repr(config.get(field))
            value = value if len(value) <= 60 else value[:57] + "..."
            raise ValueError(f"config.json: {field}={value} cannot be expressed by this UNet ({why})")

    need(config.get("_class_name", "UNet2DModel") == "UNet2DModel", "_class_name", "only UNet2DModel is")
    size = config["sample_size"]
    size = size[0] if isinstance(size, (list, tuple)) and size and all(s == size[0] for s in size) else size
    need(isinstance(size, int) and not isinstance(size, bool), "sample_size",
         "square images of a given size only")
    need(config["out_channels"] == config["in_channels"], "out_channels",
         "the output has the input's channels: no learned variance")
    widths = config["block_out_channels"]
    widths = list(widths) if isinstance(widths, (list, tuple)) else []
    need(widths and all(isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in widths),
         "block_out_channels", "positive widths")
    mult = tuple(int(w // widths[0]) if w % widths[0] == 0 else w / widths[0] for w in widths)
    need(all(int(widths[0] * m) == w for m, w in zip(mult, widths)), "block_out_channels",
         "widths as multiples")
    down, up = config["down_block_types"], config["up_block_types"]
    down, up = (list(b) if isinstance(b, (list, tuple)) else [] for b in (down, up))
    resample = {v: k for k, v in RESAMPLE_TYPES.items()}.get(config["downsample_type"])
    need(resample is not None, "downsample_type", "a stride-2 conv or a residual block")
    need(config["upsample_type"] == config["downsample_type"], "upsample_type", "the same as downsample_type")
    need(len(down) == len(widths) and all(b in (DOWN_BLOCKS[resample], "AttnDownBlock2D") for b in down),
         "down_block_types", f"{DOWN_BLOCKS[resample]} and AttnDownBlock2D, one per width, with "
         f"downsample_type={config['downsample_type']!r}")
    attn = [b == "AttnDownBlock2D" for b in down]
    need(up == ["AttnUpBlock2D" if a else UP_BLOCKS[resample] for a in reversed(attn)], "up_block_types",
         "the down blocks mirrored")
    need(config["mid_block_type"] == "UNetMidBlock2D", "mid_block_type", "a mid block with attention")
    groups = config["norm_num_groups"]
    need(all(w % groups == 0 for w in widths), "norm_num_groups", "a divisor of every width")
    need(config["resnet_time_scale_shift"] in ("default", "scale_shift"), "resnet_time_scale_shift",
         "the embedding added before the norm, or ADM's scale and shift after it")
    if all(group_norm(w).num_groups == groups for w in widths):
        groups = 0  # what our per-width rule gives (Ho's 32 at widths >= 64): the config our runs record
    head_dim = config["attention_head_dim"]
    need(head_dim is None or (isinstance(head_dim, int) and head_dim > 0
                              and all(w % head_dim == 0 for w in widths)),
         "attention_head_dim", "heads of one width that divides every block's")
    return dict(image_size=size, channels=config["in_channels"], base_channels=widths[0], channel_mult=mult,
                num_res_blocks=config["layers_per_block"],
                attn_resolutions=tuple(size // 2**i for i, a in enumerate(attn) if a),
                attn_heads=1 if head_dim is None else 0, attn_head_dim=head_dim or 0,
                dropout=config["dropout"], num_classes=0, patch_size=1, pos_emb=False,
                norm_groups=groups, scale_shift_norm=config["resnet_time_scale_shift"] == "scale_shift",
                resample=resample, mp_layers=False)


def diffusers_state_dict(model):
    """Our weights under UNet2DModel's tensor names (contiguous copies, as safetensors wants them)."""
    diffusers_config(model)  # refuses a model it cannot express
    out = {}
    for name, tensor in model.state_dict().items():
        names = diffusers_names(name)
        for their, part in zip(names, tensor.chunk(len(names))):
            out[their] = part.detach().contiguous().clone()
    return out


def diffusers_parts(model, state_dict):
    """-> {our tensor name: its UNet2DModel tensors (one, or q, k and v)}, every tensor of `state_dict` used
    exactly once and shaped as `model` needs it: a missing, unexpected or misshapen one is a ValueError.
    Older exports' attention names (query, key, value, proj_attn) are read too. Only the model's tensor shapes
    are read, so a model on the meta device checks weights against a config before anything is allocated."""
    old = re.compile(r"\.attentions\.(\d+)\.(query|key|value|proj_attn)\.")
    theirs = {old.sub(lambda m: f".attentions.{m[1]}.{DEPRECATED[m[2]]}.", k): v
              for k, v in state_dict.items()}
    if len(theirs) < len(state_dict):
        raise ValueError("the diffusers weights hold an attention tensor under its name and its older one")
    ours, used = {}, set()
    for name, param in model.state_dict().items():
        names = diffusers_names(name)
        missing = [n for n in names if n not in theirs]
        if missing:
            raise ValueError(f"the diffusers weights have no tensor {missing[0]}")
        part = (param.shape[0] // len(names), *param.shape[1:])  # q, k and v: a third of our qkv each
        for n in names:  # each on its own: torch.cat would refuse parts of other ranks in a traceback
            if tuple(theirs[n].shape) != part:
                raise ValueError(f"{n} has shape {tuple(theirs[n].shape)}; this model's is {part}")
        ours[name] = [theirs[n] for n in names]
        used.update(names)
    unexpected = sorted(set(theirs) - used)
    if unexpected:
        raise ValueError(f"the diffusers weights hold {len(unexpected)} tensor(s) "
                         f"this model has no place for: {unexpected[0][:80]}, ...")
    return ours


def load_diffusers_state_dict(model, state_dict):
    """Load UNet2DModel tensors into `model` (diffusers_parts: every tensor used exactly once, or a
    ValueError)."""
    parts = diffusers_parts(model, state_dict)
    model.load_state_dict({name: torch.cat(p) if len(p) > 1 else p[0] for name, p in parts.items()})
    return model


DIFFUSERS_DEFAULTS = dict(  # UNet2DModel's own defaults (diffusers 0.42), for fields a config.json leaves out
    sample_size=None, in_channels=3, out_channels=3, center_input_sample=False,
    time_embedding_type="positional", time_embedding_dim=None, freq_shift=0, flip_sin_to_cos=True,
    down_block_types=["DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D"],
    mid_block_type="UNetMidBlock2D",
    up_block_types=["AttnUpBlock2D", "AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D"],
    block_out_channels=[224, 448, 672, 896], layers_per_block=2, mid_block_scale_factor=1,
    downsample_padding=1, downsample_type="conv", upsample_type="conv", dropout=0.0, act_fn="silu",
    attention_head_dim=8, norm_num_groups=32, attn_norm_num_groups=None, norm_eps=1e-5,
    resnet_time_scale_shift="default", add_attention=True, class_embed_type=None, num_class_embeds=None,
    num_train_timesteps=None,
)


def check_diffusers_config(model, config):
    """ValueError naming the first config.json field in which `model` (built from model_fields_from_diffusers)
    would compute another function than UNet2DModel with this config."""
    config = {**DIFFUSERS_DEFAULTS, **config}
    unknown = sorted(k for k in config if k not in DIFFUSERS_DEFAULTS and not k.startswith("_"))
    if unknown:
        raise ValueError(f"config.json: unknown UNet2DModel field {unknown[0][:80]}")
    same_norm = config["attn_norm_num_groups"] == config["norm_num_groups"]
    if same_norm and config["resnet_time_scale_shift"] == "default":  # None means the same norm there
        config["attn_norm_num_groups"] = None
    listed = lambda v: list(v) if isinstance(v, (list, tuple)) else v  # noqa: E731
    for field, ours in diffusers_config(model).items():
        if (field not in ("_class_name", "attention_head_dim", "sample_size")
                and listed(config[field]) != listed(ours)):
            raise ValueError(f"config.json: {field}={config[field]!r} cannot be expressed by this UNet "
                             f"(it has {ours!r})")

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
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def group_norm(channels):
    # 32 groups as in the paper, but at least 2 channels per group: a group of one channel removes
    # any per-channel shift, and so the time and class embedding a ResBlock adds just before its
    # second norm (widths of 32 and below; the paper's are all >= 128, where this is 32 groups)
    return nn.GroupNorm(max(g for g in range(1, 33) if channels % g == 0 and channels // g >= 2), channels)


def zero_init(module):
    # Ho et al. initialise the last layer of each residual branch (and the output) to ~0,
    # so every block starts as the identity
    nn.init.zeros_(module.weight)
    nn.init.zeros_(module.bias)
    return module


def timestep_embedding(t, dim, max_period=10000.0):
    """Transformer sinusoidal embedding (Vaswani et al. 2017, §3.5) of t: (B,) -> (B, dim)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]  # (B, half)
    emb = torch.cat([torch.sin(args), torch.cos(args)], dim=1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


def position_embedding_2d(channels, size):
    """Fixed 2D sinusoidal embedding, (1, channels, size, size): half the channels encode the row,
    half the column, each as timestep_embedding does; patched models use it to know where a patch lies."""
    pos = torch.arange(size)
    rows = timestep_embedding(pos, channels // 2)  # (size, C/2)
    cols = timestep_embedding(pos, channels - channels // 2)
    emb = torch.cat([rows[:, None, :].expand(size, size, -1), cols[None, :, :].expand(size, size, -1)], dim=-1)
    return emb.permute(2, 0, 1)[None]


class ResBlock(nn.Module):
    """GroupNorm-SiLU-conv, add the time embedding, GroupNorm-SiLU-dropout-conv, plus a skip."""

    def __init__(self, in_ch, out_ch, temb_ch, dropout):
        super().__init__()
        self.norm1 = group_norm(in_ch)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.temb_proj = nn.Linear(temb_ch, out_ch)
        self.norm2 = group_norm(out_ch)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = zero_init(nn.Conv2d(out_ch, out_ch, 3, padding=1))
        self.skip = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else nn.Identity()

    def forward(self, x, temb):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb_proj(F.silu(temb))[:, :, None, None]
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        return self.skip(x) + h


class Attention(nn.Module):
    """Self-attention over the H·W positions, with a residual connection.

    `heads` heads of `head_dim` channels each; head_dim = 0 splits the block's own width
    evenly between the heads (Ho et al. use one head of full width); heads = 0 takes as many
    heads of head_dim channels as the width holds (ADM's num_head_channels).
    backend 'sdpa' calls F.scaled_dot_product_attention (flash / memory-efficient kernels);
    'math' writes the softmax out, as the reference baseline did.
    """

    def __init__(self, channels, heads, head_dim, backend):
        super().__init__()
        self.heads = heads or channels // head_dim  # heads = 0: as many heads of head_dim as the width holds
        self.head_dim = head_dim or channels // heads
        inner = self.heads * self.head_dim
        self.backend = backend
        self.norm = group_norm(channels)
        self.qkv = nn.Linear(channels, 3 * inner)
        self.proj = zero_init(nn.Linear(inner, channels))

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
        return x + self.proj(h).transpose(1, 2).reshape(B, C, H, W)


class Downsample(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=1)

    def forward(self, x):
        return self.conv(x)


class Upsample(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Level(nn.Module):
    """The res blocks (each optionally followed by attention) at one resolution."""

    def __init__(self, in_chs, out_ch, temb_ch, attn, cfg, backend):
        super().__init__()
        self.res = nn.ModuleList(ResBlock(c, out_ch, temb_ch, cfg.dropout) for c in in_chs)
        self.attn = nn.ModuleList(
            Attention(out_ch, cfg.attn_heads, cfg.attn_head_dim, backend) if attn else nn.Identity() for _ in in_chs
        )


class UNet(nn.Module):
    def __init__(self, cfg, attention="sdpa"):
        super().__init__()
        self.cfg = cfg
        P, ch = cfg.patch_size, cfg.base_channels
        temb_ch = 4 * ch
        self.time_mlp = nn.Sequential(nn.Linear(ch, temb_ch), nn.SiLU(), nn.Linear(temb_ch, temb_ch))
        # one extra class index, num_classes, is the "no label" class used by classifier-free guidance
        self.class_emb = nn.Embedding(cfg.num_classes + 1, temb_ch) if cfg.num_classes > 0 else None
        self.conv_in = nn.Conv2d(cfg.channels * P * P, ch, 3, padding=1)
        if cfg.pos_emb:
            self.register_buffer("pos_emb", position_embedding_2d(ch, cfg.image_size // P), persistent=False)

        widths = [int(ch * m) for m in cfg.channel_mult]
        res = cfg.image_size // P  # resolution of the patched grid
        skip_chs = [ch]  # channels of every activation the up path will concatenate
        self.down, self.downsample = nn.ModuleList(), nn.ModuleList()
        cur = ch
        for i, w in enumerate(widths):
            in_chs = [cur] + [w] * (cfg.num_res_blocks - 1)
            self.down.append(Level(in_chs, w, temb_ch, res in cfg.attn_resolutions, cfg, attention))
            skip_chs += [w] * cfg.num_res_blocks
            cur = w
            last = i == len(widths) - 1
            self.downsample.append(nn.Identity() if last else Downsample(cur))
            if not last:
                skip_chs.append(cur)
                res //= 2

        self.mid_res1 = ResBlock(cur, cur, temb_ch, cfg.dropout)
        self.mid_attn = Attention(cur, cfg.attn_heads, cfg.attn_head_dim, attention)
        self.mid_res2 = ResBlock(cur, cur, temb_ch, cfg.dropout)

        self.up, self.upsample = nn.ModuleList(), nn.ModuleList()
        for i, w in reversed(list(enumerate(widths))):
            in_chs = []
            for _ in range(cfg.num_res_blocks + 1):
                in_chs.append(cur + skip_chs.pop())
                cur = w
            self.up.append(Level(in_chs, w, temb_ch, res in cfg.attn_resolutions, cfg, attention))
            self.upsample.append(Upsample(cur) if i > 0 else nn.Identity())
            if i > 0:
                res *= 2

        self.norm_out = group_norm(cur)
        self.conv_out = zero_init(nn.Conv2d(cur, cfg.channels * P * P, 3, padding=1))

    def forward(self, x, t, y=None):
        """x: (B, C, H, W); t: (B,) timesteps; y: (B,) labels in [0, num_classes], num_classes = no label."""
        P = self.cfg.patch_size
        temb = self.time_mlp(timestep_embedding(t, self.cfg.base_channels))  # (B, 4ch)
        if self.class_emb is not None:
            if y is None:  # unconditional call: everything gets the null class
                y = torch.full((x.shape[0],), self.cfg.num_classes, device=x.device, dtype=torch.long)
            temb = temb + self.class_emb(y)

        h = self.conv_in(F.pixel_unshuffle(x, P) if P > 1 else x)  # (B, ch, H/P, W/P)
        if self.cfg.pos_emb:
            h = h + self.pos_emb.to(h.dtype)
        hs = [h]
        for level, down in zip(self.down, self.downsample):
            for res, attn in zip(level.res, level.attn):
                h = attn(res(h, temb))
                hs.append(h)
            if not isinstance(down, nn.Identity):
                h = down(h)
                hs.append(h)

        h = self.mid_res2(self.mid_attn(self.mid_res1(h, temb)), temb)

        for level, up in zip(self.up, self.upsample):
            for res, attn in zip(level.res, level.attn):
                h = attn(res(torch.cat([h, hs.pop()], dim=1), temb))
            h = up(h)

        h = self.conv_out(F.silu(self.norm_out(h)))
        return F.pixel_shuffle(h, P) if P > 1 else h

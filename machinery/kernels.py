"""Fused GPU kernels for the UNet's hot spots: GroupNorm followed by SiLU in one Triton pass, forward and
backward.

    y = group_norm_silu(x, norm)   # = F.silu(norm(x)), norm an nn.GroupNorm; x: (B, C, H, W) on a GPU

Why: in the compiled bf16 training step, inductor's fused GroupNorm/SiLU kernels took 45% of the step on an
H200 and ran ~4x below the memory-bandwidth floor (issue 51). Here one program owns whole groups of one image:
it reads x once to get each group's mean and variance, and once more (from cache) to write y; the backward
reads x and dy the same way and writes dx, recomputing the normalised x from the saved mean and 1/std
rather than keeping it. Both layouts the step uses are read in full sectors: NCHW-contiguous, where a group
is one contiguous run, and channels_last (NHWC), where a program takes as many adjacent groups as fill a
32-byte DRAM sector of each pixel's channels. Statistics and arithmetic are float32 whatever x's dtype
(float32, bfloat16 or float16); y and dx take x's dtype and layout, the weight's and bias's gradients theirs.
The variance is the shifted-data sum (each channel shifted by its first pixel), combined per group exactly.
Not yet timed on a GPU: the tile sizes below are first guesses, to be tuned against inductor's kernels.

The kernels are torch.library.triton_op custom operators (ddpm::group_norm_silu_fwd and _bwd) under a
torch.autograd.Function, so torch.compile traces them into its graph without a break and inductor launches
them itself. They run where Triton does: CUDA tensors, or CPU tensors when TRITON_INTERPRET=1 was set
before triton was imported (the tests). Meta tensors give shapes and launch nothing (how the tests trace
them under torch.compile without a GPU). Anywhere else, and without triton, they raise: nothing falls back.
"""
import torch

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError:  # a CPU-only torch build: the module imports, group_norm_silu refuses to run
    triton = tl = None

INTERPRETED = bool(triton and triton.knobs.runtime.interpret)  # TRITON_INTERPRET=1: CPU tensors, numpy
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TILE = 4096      # elements of x a program holds at once (BLOCK_S pixels x BLOCK_C channels), forward
TILE_BWD = 2048  # the backward holds x and dy
ROW_BYTES = 32   # channels_last: the contiguous bytes of channels a program reads per pixel (a DRAM sector)


def jit(fn):
    """triton.jit; without triton, the plain function (never called: check_runnable raises first)."""
    return triton.jit(fn) if triton else fn


constexpr = tl.constexpr if tl else None


# -----------------------------------------------------------------------------
# The kernels (their names put them in mfu.PROFILE_CATEGORIES' "normalisation"). One program: image n, groups
# g0 .. g0 + GPB - 1 (channels c0 .. c0 + GPB*CG - 1, BLOCK_C of them rounded up to a power of two), every
# pixel in tiles of BLOCK_S. Address of x[n, c, s] (s = h*W + w):
# n*sb + c*sc + s*ss, which covers NCHW (sc = HW, ss = 1) and NHWC (sc = 1, ss = C).


@jit
def _at(ptr, n, c, s, sb, sc, ss):
    """Pointers to t[n, c, s], (BLOCK_S, BLOCK_C): the image's offset in 64 bits, offsets within it in 32."""
    return ptr + n.to(tl.int64) * sb + (c[None, :] * sc + s[:, None] * ss)


@jit
def _tile(ptr, n, c, s, sb, sc, ss, mask):
    """t[n, c, s] as float32, (BLOCK_S, BLOCK_C); 0 where masked."""
    return tl.load(_at(ptr, n, c, s, sb, sc, ss), mask=mask, other=0.0).to(tl.float32)


@jit
def _to_groups(v, onehot):
    """Per channel (BLOCK_C,) -> summed per group (BLOCK_G,)."""
    return tl.sum(tl.where(onehot, v[None, :], 0.0), axis=1)


@jit
def _to_channels(v, onehot):
    """Per group (BLOCK_G,) -> each channel's group's value (BLOCK_C,)."""
    return tl.sum(tl.where(onehot, v[:, None], 0.0), axis=0)


@jit
def _program(C, G, CG, GPB: constexpr, BLOCK_C: constexpr, BLOCK_G: constexpr):
    """-> (n, channels, channel mask, groups, group mask, onehot[group, channel]) of this program."""
    blocks = tl.cdiv(G, GPB)
    pid = tl.program_id(0)
    n, g0 = pid // blocks, (pid % blocks) * GPB
    lc, lg = tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_G)
    c, g = g0 * CG + lc, g0 + lg
    cmask, gmask = (lc < GPB * CG) & (c < C), (lg < GPB) & (g < G)
    onehot = (lc[None, :] // CG == lg[:, None]) & cmask[None, :]
    return n, c, cmask, g, gmask, onehot


@jit
def _silu_grad(x, dy, mean, rstd, w, b):
    """(dL/dz, xhat) at one tile: xhat = (x - mean)·rstd, z = xhat·w + b, y = z·σ(z)."""
    xhat = (x - mean[None, :]) * rstd[None, :]
    z = xhat * w[None, :] + b[None, :]
    sig = tl.sigmoid(z)
    return dy * sig * (1.0 + z * (1.0 - sig)), xhat


@jit
def _group_norm_silu_fwd_kernel(x, w, b, y, mean_out, rstd_out, C, HW, G, CG, eps,
                                sxb, sxc, sxs, syb, syc, sys,
                                GPB: constexpr, BLOCK_C: constexpr, BLOCK_G: constexpr, BLOCK_S: constexpr):
    n, c, cmask, g, gmask, onehot = _program(C, G, CG, GPB, BLOCK_C, BLOCK_G)
    # each channel's sums shifted by its first pixel (no cancellation when |mean| >> std)
    k = tl.load(x + n.to(tl.int64) * sxb + c * sxc, mask=cmask, other=0.0).to(tl.float32)
    acc1 = tl.zeros((BLOCK_S, BLOCK_C), tl.float32)
    acc2 = tl.zeros((BLOCK_S, BLOCK_C), tl.float32)
    for s0 in range(0, HW, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        m = (s < HW)[:, None] & cmask[None, :]
        d = tl.where(m, _tile(x, n, c, s, sxb, sxc, sxs, m) - k[None, :], 0.0)
        acc1 += d
        acc2 += d * d
    s1, s2 = tl.sum(acc1, axis=0), tl.sum(acc2, axis=0)  # (BLOCK_C,): Σ (x - k), Σ (x - k)²
    count = CG * HW * 1.0
    mean_g = _to_groups(s1 + HW * k, onehot) / count
    e = k - _to_channels(mean_g, onehot)  # Σ (x - mean)² = Σ (x - k)² + 2e Σ (x - k) + HW·e², per channel
    var_g = tl.maximum(_to_groups(s2 + 2.0 * e * s1 + HW * e * e, onehot) / count, 0.0)
    rstd_g = 1.0 / tl.sqrt(var_g + eps)
    tl.store(mean_out + n * G + g, mean_g, mask=gmask)
    tl.store(rstd_out + n * G + g, rstd_g, mask=gmask)

    scale = _to_channels(rstd_g, onehot) * tl.load(w + c, mask=cmask, other=0.0).to(tl.float32)
    shift = tl.load(b + c, mask=cmask, other=0.0).to(tl.float32) - _to_channels(mean_g, onehot) * scale
    for s0 in range(0, HW, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        m = (s < HW)[:, None] & cmask[None, :]
        z = _tile(x, n, c, s, sxb, sxc, sxs, m) * scale[None, :] + shift[None, :]
        tl.store(_at(y, n, c, s, syb, syc, sys), (z * tl.sigmoid(z)).to(y.dtype.element_ty), mask=m)


@jit
def _group_norm_silu_bwd_kernel(x, dy, w, b, mean_in, rstd_in, dx, dw_part, db_part, C, HW, G, CG,
                                sxb, sxc, sxs, sdb, sdc, sds, sgb, sgc, sgs,
                                GPB: constexpr, BLOCK_C: constexpr, BLOCK_G: constexpr, BLOCK_S: constexpr):
    n, c, cmask, g, gmask, onehot = _program(C, G, CG, GPB, BLOCK_C, BLOCK_G)
    mean = _to_channels(tl.load(mean_in + n * G + g, mask=gmask, other=0.0), onehot)
    rstd = _to_channels(tl.load(rstd_in + n * G + g, mask=gmask, other=0.0), onehot)
    wc = tl.load(w + c, mask=cmask, other=0.0).to(tl.float32)
    bc = tl.load(b + c, mask=cmask, other=0.0).to(tl.float32)
    acc_db = tl.zeros((BLOCK_S, BLOCK_C), tl.float32)
    acc_dw = tl.zeros((BLOCK_S, BLOCK_C), tl.float32)
    for s0 in range(0, HW, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        m = (s < HW)[:, None] & cmask[None, :]
        dz, xhat = _silu_grad(_tile(x, n, c, s, sxb, sxc, sxs, m), _tile(dy, n, c, s, sdb, sdc, sds, m),
                              mean, rstd, wc, bc)
        dz = tl.where(m, dz, 0.0)
        acc_db += dz
        acc_dw += dz * xhat
    db, dw = tl.sum(acc_db, axis=0), tl.sum(acc_dw, axis=0)  # this image's share of dbias, dweight
    tl.store(db_part + n * C + c, db, mask=cmask)
    tl.store(dw_part + n * C + c, dw, mask=cmask)

    # dx = rstd·(dxhat - mean_group(dxhat) - xhat·mean_group(dxhat·xhat)), dxhat = dz·w
    count = CG * HW * 1.0
    mean_dxhat = _to_channels(_to_groups(wc * db, onehot), onehot) / count
    mean_dxhat_xhat = _to_channels(_to_groups(wc * dw, onehot), onehot) / count
    for s0 in range(0, HW, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        m = (s < HW)[:, None] & cmask[None, :]
        dz, xhat = _silu_grad(_tile(x, n, c, s, sxb, sxc, sxs, m), _tile(dy, n, c, s, sdb, sdc, sds, m),
                              mean, rstd, wc, bc)
        grad = rstd[None, :] * (dz * wc[None, :] - mean_dxhat[None, :] - xhat * mean_dxhat_xhat[None, :])
        tl.store(_at(dx, n, c, s, sgb, sgc, sgs), grad.to(dx.dtype.element_ty), mask=m)


# -----------------------------------------------------------------------------
# The launches: layouts, block sizes, the custom operators and their autograd


def check_runnable(x):
    """RuntimeError unless Triton can run on x's device: a CUDA tensor, or a CPU one under the interpreter."""
    if triton is None:
        raise RuntimeError("norm_kernel='triton' needs the triton package, which this torch build lacks; "
                           "use norm_kernel='torch'")
    if not (x.device.type in ("cuda", "meta") or (INTERPRETED and x.device.type == "cpu")):
        raise RuntimeError(f"the fused GroupNorm+SiLU Triton kernel runs on CUDA tensors (or on the CPU "
                           f"under TRITON_INTERPRET=1), and x is on {x.device.type}: use norm_kernel='torch' "
                           f"there")
    if x.dim() != 4 or x.dtype not in DTYPES:
        raise RuntimeError(f"the fused GroupNorm+SiLU kernel takes (B, C, H, W) tensors in {DTYPES}, "
                           f"not {tuple(x.shape)} {x.dtype}")


def layout(t):
    """-> (t, its (batch, channel, pixel) strides): NCHW-contiguous or channels_last as it is, anything else
    made NCHW-contiguous first (H and W must merge into one pixel index)."""
    B, C, H, W = t.shape
    if t.is_contiguous():
        return t, (C * H * W, H * W, 1)
    if t.is_contiguous(memory_format=torch.channels_last):
        return t, (H * W * C, 1, C)
    return t.contiguous(), (C * H * W, H * W, 1)


def blocks(x, groups, strides, tile):
    """-> (grid, the kernels' block constants) for x: one group per program in NCHW, where a group is one
    contiguous run; in channels_last as many adjacent groups as make ROW_BYTES of channels per pixel."""
    B, C, H, W = x.shape
    cg = C // groups
    gpb = 1
    if strides[1] == 1 and C > 1:  # channels_last: the widest divisor of the groups within ROW_BYTES
        fit = max(1, ROW_BYTES // (x.element_size() * cg))
        gpb = max(d for d in range(1, groups + 1) if groups % d == 0 and d <= fit)
    block_c = triton.next_power_of_2(gpb * cg)
    block_s = min(triton.next_power_of_2(H * W), max(1, tile // block_c))
    meta = dict(GPB=gpb, BLOCK_C=block_c, BLOCK_G=triton.next_power_of_2(gpb), BLOCK_S=block_s,
                num_warps=4 if block_c * block_s <= 2048 else 8)
    return (B * triton.cdiv(groups, gpb),), meta


if triton is not None:
    @triton_op("ddpm::group_norm_silu_fwd", mutates_args=())
    def group_norm_silu_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (silu(group_norm(x)·weight + bias) in x's dtype and layout, mean, rstd: (B, groups) float32)."""
        check_runnable(x)
        x, sx = layout(x)
        B, C, H, W = x.shape
        y = torch.empty_like(x)
        mean = torch.empty(B, groups, device=x.device, dtype=torch.float32)
        rstd = torch.empty(B, groups, device=x.device, dtype=torch.float32)
        grid, meta = blocks(x, groups, sx, TILE)
        wrap_triton(_group_norm_silu_fwd_kernel)[grid](x, weight, bias, y, mean, rstd, C, H * W, groups,
                                                       C // groups, eps, *sx, *layout(y)[1], **meta)
        return y, mean, rstd

    @triton_op("ddpm::group_norm_silu_bwd", mutates_args=())
    def group_norm_silu_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                            mean: torch.Tensor, rstd: torch.Tensor,
                            groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (dx in x's dtype and layout, dweight, dbias in theirs), from the forward's mean and rstd."""
        check_runnable(x)
        x, sx = layout(x)
        dy, sd = layout(dy)
        B, C, H, W = x.shape
        dx = torch.empty_like(x)
        dw_part = torch.empty(B, C, device=x.device, dtype=torch.float32)  # each image's share
        db_part = torch.empty(B, C, device=x.device, dtype=torch.float32)
        grid, meta = blocks(x, groups, sx, TILE_BWD)
        wrap_triton(_group_norm_silu_bwd_kernel)[grid](x, dy, weight, bias, mean, rstd, dx, dw_part, db_part,
                                                       C, H * W, groups, C // groups, *sx, *sd,
                                                       *layout(dx)[1], **meta)
        return dx, dw_part.sum(0).to(weight.dtype), db_part.sum(0).to(bias.dtype)


class GroupNormSiLU(torch.autograd.Function):
    """silu(group_norm(x, groups, weight, bias, eps)) with the fused kernels both ways; the backward keeps
    x and the (B, groups) mean and rstd, not the normalised activations."""

    @staticmethod
    def forward(ctx, x, weight, bias, groups, eps):
        y, mean, rstd = group_norm_silu_fwd(x, weight, bias, groups, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.groups = groups
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = group_norm_silu_bwd(dy, x, weight, bias, mean, rstd, ctx.groups)
        return dx, dw, db, None, None


def group_norm_silu(x, norm):
    """F.silu(norm(x)) for an affine nn.GroupNorm `norm`, in one fused pass each way (x: (B, C, H, W))."""
    check_runnable(x)
    if norm.weight is None or norm.bias is None:
        raise ValueError("the fused GroupNorm+SiLU kernel needs an affine GroupNorm (weight and bias)")
    return GroupNormSiLU.apply(x, norm.weight, norm.bias, norm.num_groups, norm.eps)

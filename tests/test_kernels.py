"""The fused GroupNorm+SiLU kernel (kernels.py) against F.silu(F.group_norm(...)): forward and the gradients
of x, weight and bias, in Triton's interpreter on the CPU; through the UNet; traced by torch.compile without
a graph break; and the UNet's default, torch's two calls, as before."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, tiny_model

import unet
from machinery import kernels
from unet import UNet

# TRITON_INTERPRET=1 must be set before triton is imported: each check runs in a process of its own
COMPARE = """
import torch, torch.nn.functional as F
from machinery import kernels

def compare(shape, groups, dtype, channels_last, tile=None):
    kernels.TILE = kernels.TILE_BWD = tile or kernels.TILE  # a small tile: several tiles per group
    torch.manual_seed(0)
    x = (3 + 2 * torch.randn(shape)).to(dtype)  # a mean far from 0: the variance must not cancel
    x = x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    norm = torch.nn.GroupNorm(groups, shape[1], eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(1, 0.5), norm.bias.normal_(0, 0.5)
    dy = torch.randn(shape).to(dtype)
    ours = x.clone().requires_grad_()
    y = kernels.group_norm_silu(ours, norm)
    y.backward(dy)
    got = [y, ours.grad, norm.weight.grad, norm.bias.grad]
    norm.zero_grad()
    ref = x.float().requires_grad_()  # the reference in float32 from the same (rounded) inputs
    want = F.silu(F.group_norm(ref, groups, norm.weight, norm.bias, 1e-6))
    want.backward(dy.float())
    want = [want, ref.grad, norm.weight.grad, norm.bias.grad]
    assert y.dtype == dtype and ours.grad.dtype == dtype and norm.weight.grad.dtype == torch.float32
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert y.is_contiguous(memory_format=fmt) and ours.grad.is_contiguous(memory_format=fmt)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for name, a, b in zip(["y", "dx", "dweight", "dbias"], got, want):
        torch.testing.assert_close(a.float(), b, **tol, msg=lambda m: f"{name} {shape} {groups}: {m}")
"""


def interpreted(code, timeout=1800):
    """Run `code` after COMPARE in a fresh Python under TRITON_INTERPRET=1 (the timeout a hang guard)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", COMPARE + textwrap.dedent(code)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_matches_group_norm_then_silu(dtype):
    """Both layouts; groups of 2 channels, of 6 on a 5x7 grid, a 6x6 grid, channels_last programs holding
    several groups (and channels past the last group masked), several tiles per group with a ragged last."""
    pytest.importorskip("triton")
    interpreted(f"""
        for channels_last in (False, True):
            for shape, groups, tile in [((2, 8, 6, 6), 4, None), ((2, 12, 5, 7), 2, None),
                                        ((2, 32, 4, 4), 16, None), ((2, 6, 3, 3), 3, None),
                                        ((2, 8, 6, 6), 4, 32)]:
                compare(shape, groups, torch.{dtype}, channels_last, tile)
        """)


def test_unet_with_the_fused_kernel_is_the_same_function():
    """A tiny UNet (scale-shift norm on, so both ResBlock paths run): the output and every gradient as with
    torch's GroupNorm and SiLU, NCHW and channels_last, in float32."""
    pytest.importorskip("triton")
    interpreted("""
        from ddpm import ModelConfig
        from unet import UNet
        for channels_last, scale_shift in ((False, False), (True, True)):
            cfg = ModelConfig(image_size=8, base_channels=8, channel_mult=(1, 2), num_res_blocks=1,
                              attn_resolutions=(4,), dropout=0.0, scale_shift_norm=scale_shift)
            fmt = torch.channels_last if channels_last else torch.contiguous_format
            x, t = torch.randn(2, 3, 8, 8).contiguous(memory_format=fmt), torch.tensor([3, 70])
            runs = []
            for kernel in ("torch", "triton"):
                torch.manual_seed(0)
                model = UNet(cfg, norm_kernel=kernel).to(memory_format=fmt)
                with torch.no_grad():
                    for p in model.parameters():
                        p.normal_(0, 0.3)
                out = model(x, t)
                out.square().mean().backward()
                runs.append([out] + [p.grad for p in model.parameters()])
            for a, b in zip(*runs):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        """)


def test_compile_traces_the_unet_without_a_graph_break():
    """torch.compile(fullgraph=True) of the UNet's forward and backward with norm_kernel='triton', on the meta
    device (shapes only, no GPU): every fused norm is one kernel in the forward graph and one in the
    backward, inside the graphs, with no break."""
    pytest.importorskip("triton")
    code = """
        import torch
        from ddpm import ModelConfig
        from torch._functorch.aot_autograd import aot_module_simplified
        from unet import UNet

        graphs = {}
        def backend(gm, inputs):
            def keep(name):
                def compiler(g, _):
                    graphs[name] = [str(n.target) for n in g.graph.nodes if n.op == "call_function"]
                    return g.forward
                return compiler
            return aot_module_simplified(gm, inputs, fw_compiler=keep("fw"), bw_compiler=keep("bw"))

        cfg = ModelConfig(image_size=8, base_channels=8, channel_mult=(1, 2), num_res_blocks=1,
                          attn_resolutions=(4,), dropout=0.0)
        model = UNet(cfg, norm_kernel="triton").to("meta")
        x, t = torch.empty(2, 3, 8, 8, device="meta"), torch.zeros(2, dtype=torch.long, device="meta")
        torch.compile(model, fullgraph=True, backend=backend)(x, t).sum().backward()
        print(sum(n == "triton_kernel_wrapper_functional" for n in graphs["fw"]),
              sum(n == "triton_kernel_wrapper_functional" for n in graphs["bw"]))
        """
    env = {**os.environ, "PYTHONPATH": ROOT, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    fused = 2 * 8 + 1  # two per ResBlock (2 down, 2 mid, 4 up), and the output norm
    assert out.stdout.split() == [str(fused), str(fused)], out.stdout


@pytest.mark.skipif(kernels.INTERPRETED, reason="this process runs Triton's interpreter")
def test_the_fused_kernel_refuses_a_cpu_tensor_rather_than_fall_back():
    pytest.importorskip("triton")
    norm = torch.nn.GroupNorm(4, 8, eps=1e-6)
    with pytest.raises(RuntimeError, match="CUDA tensors.*norm_kernel='torch'"):
        kernels.group_norm_silu(torch.randn(2, 8, 4, 4), norm)
    model = UNet(tiny_model(), norm_kernel="triton")
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        model(torch.randn(1, 3, 16, 16), torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="norm_kernel"):
        UNet(tiny_model(), norm_kernel="apex")


@pytest.mark.parametrize("scale_shift", [False, True])
def test_the_default_norm_kernel_is_torchs_silu_of_the_norm(monkeypatch, scale_shift):
    """norm_kernel='torch' (the default) is F.silu(norm(x)), bitwise, and either kernel builds the same
    weights from the same seed (one checkpoint serves both)."""
    mc = tiny_model(scale_shift_norm=scale_shift)
    models = []
    for kw in ({}, {"norm_kernel": "torch"}, {"norm_kernel": "triton"}):
        torch.manual_seed(0)
        models.append(UNet(mc, **kw))
    for other in models[1:]:
        assert all(torch.equal(a, b) for a, b in zip(models[0].state_dict().values(),
                                                     other.state_dict().values()))
    with torch.no_grad():
        for p in models[0].parameters():
            p.normal_(0, 0.05)
    x, t = torch.randn(2, 3, 16, 16), torch.tensor([1, 90])
    out = models[0](x, t)
    calls = []
    monkeypatch.setattr(unet, "norm_silu", lambda norm, h, kernel: calls.append(kernel) or F.silu(norm(h)))
    assert torch.equal(out, models[0](x, t)) and set(calls) == {"torch"}
    assert len(calls) == (9 if scale_shift else 17)  # ResBlocks' first norms (8), second (8), output (1)

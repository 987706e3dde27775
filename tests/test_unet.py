"""The UNet: shapes, dtypes, patching, conditioning, attention backends, the paper's size."""
import math

import pytest
import torch
from conftest import tiny_model

import unet
from ddpm import ModelConfig
from unet import UNet


def randomise(model):
    """Zero-initialised output layers hide most of the network at init; give every weight a value."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


@pytest.mark.parametrize("patch_size", [1, 2, 4])
@pytest.mark.parametrize("num_classes", [0, 10])
def test_output_shape_and_dtype(patch_size, num_classes):
    mc = tiny_model(image_size=32, patch_size=patch_size, num_classes=num_classes,
                    attn_resolutions=(32 // patch_size // 2,))
    model = randomise(UNet(mc))
    x, t = torch.randn(3, 3, 32, 32), torch.tensor([0, 50, 99])
    y = torch.tensor([0, 9, 10]) if num_classes else None  # 10 = the null class
    out = model(x, t, y)
    assert out.shape == x.shape and out.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, t, y)
    assert out.shape == x.shape and out.dtype == torch.bfloat16


def test_patching_runs_on_the_patched_grid():
    mc = tiny_model(image_size=32, patch_size=4, attn_resolutions=(8,))
    model = UNet(mc)
    assert model.conv_in.in_channels == 3 * 16 and model.conv_out.out_channels == 3 * 16
    seen = []
    model.conv_in.register_forward_hook(lambda m, i, o: seen.append(o.shape[-1]))
    model(torch.randn(1, 3, 32, 32), torch.zeros(1, dtype=torch.long))
    assert seen == [8]


def test_class_conditioning_changes_the_output():
    model = randomise(UNet(tiny_model(num_classes=4)))
    x, t = torch.randn(2, 3, 16, 16), torch.tensor([10, 10])
    a, b = model(x, t, torch.tensor([0, 0])), model(x, t, torch.tensor([1, 1]))
    assert not torch.allclose(a, b)
    torch.testing.assert_close(model(x, t), model(x, t, torch.tensor([4, 4])))  # y=None is the null class


def test_initialisation_is_ho_et_als():
    """diffusion_tf's default_init: every conv and dense layer Glorot-uniform (TF's variance_scaling, fan_avg,
    uniform; q, k and v as three layers), biases 0, and scale 1e-10 for the last conv of each residual block,
    the attention output and the output conv. Checked layer by layer on the 'ho' network."""
    import torch.nn as nn

    from unet import Attention, ResBlock

    model = UNet(ModelConfig())
    tiny = {model.conv_out} | {m.conv2 for m in model.modules() if isinstance(m, ResBlock)} \
        | {m.proj for m in model.modules() if isinstance(m, Attention)}
    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert len(tiny) == 1 + 22 + 6 and len(layers) == 101
    for layer in layers:
        assert layer.bias.abs().max() == 0
        qkv = {m.qkv for m in model.modules() if isinstance(m, Attention)}
        parts = layer.weight.detach().chunk(3 if layer in qkv else 1)
        for w in parts:
            receptive = w[0, 0].numel()
            fan_avg = (w.shape[0] + w.shape[1]) * receptive / 2
            limit = (3 * (1e-10 if layer in tiny else 1.0) / fan_avg) ** 0.5
            assert w.abs().max() <= limit
            assert abs(w.std().item() / (limit / 3**0.5) - 1) < 0.05, (layer, w.std().item(), limit / 3**0.5)
    for norm in (m for m in model.modules() if isinstance(m, nn.GroupNorm)):
        assert norm.eps == 1e-6 and (norm.weight == 1).all() and (norm.bias == 0).all()
    out = model(torch.randn(2, 3, 32, 32), torch.tensor([1, 900]))
    assert 0 < out.abs().max() < 1e-3  # every block starts as ~the identity, and the output at ~0


@pytest.mark.parametrize("heads,head_dim", [(1, 0), (4, 0), (4, 8)])
def test_sdpa_matches_math_attention(heads, head_dim):
    mc = tiny_model(attn_heads=heads, attn_head_dim=head_dim, attn_resolutions=(16, 8))
    sdpa = randomise(UNet(mc, attention="sdpa")).eval()
    math_ = UNet(mc, attention="math").eval()
    math_.load_state_dict(sdpa.state_dict())
    x, t = torch.randn(2, 3, 16, 16), torch.tensor([3, 70])
    torch.testing.assert_close(sdpa(x, t), math_(x, t), rtol=1e-4, atol=1e-4)


def test_default_is_the_papers_35_7M():
    n = sum(p.numel() for p in UNet(ModelConfig()).parameters())
    assert n == 35_746_307  # Ho et al. 2020, CIFAR-10: 35.7M


def test_patch_8_and_position_embedding():
    mc = tiny_model(image_size=64, patch_size=8, attn_resolutions=(4,), pos_emb=True)
    model = randomise(UNet(mc))
    x = torch.randn(2, 3, 64, 64)
    assert model(x, torch.tensor([1, 2])).shape == x.shape
    emb = model.pos_emb
    assert emb.shape == (1, 16, 8, 8)
    assert not torch.equal(emb[..., 0, 0], emb[..., 0, 1]) and not torch.equal(emb[..., 0, 0], emb[..., 1, 0])
    assert torch.equal(emb[0, :8, 0, 3], emb[0, :8, 5, 3])  # the first half depends on the column only
    assert torch.equal(emb[0, 8:, 3, 0], emb[0, 8:, 3, 5])  # the second on the row only
    # the authors' formula (Luhman & Luhman's timestep_embedding_2d), written out: omega = 64 / grid size
    i, pos = torch.arange(8.0)[:, None], torch.arange(8.0)[None, :]
    waves = torch.sin(pos * (64 / 8) * 10000 ** (-i / 7))  # (channel, position)
    torch.testing.assert_close(emb[0, :8], waves[:, None, :].expand(8, 8, 8), rtol=0, atol=1e-5)
    torch.testing.assert_close(emb[0, 8:], waves[:, :, None].expand(8, 8, 8), rtol=0, atol=1e-5)
    # the embedding changes the output: the network can tell patches apart by position alone
    plain = UNet(tiny_model(image_size=64, patch_size=8, attn_resolutions=(4,)))
    plain.load_state_dict(model.state_dict())
    assert not torch.allclose(plain(x, torch.tensor([1, 2])), model(x, torch.tensor([1, 2])))


@pytest.mark.parametrize("preset", ["lsun-p2", "lsun-p4", "lsun-p8", "imagenet-p4", "ffhq-p4"])
def test_paper_presets_build_and_train_a_step_at_reduced_width(preset):
    import dataclasses

    from ddpm import Diffusion, parse_args

    mc, tc, _ = parse_args(["--preset", preset])
    assert mc.prediction == "x" and mc.loss_weighting == "sqrt_snr" and mc.attn_head_dim == 64
    # the authors' loop and sampler (their image_train.py, train_util.py and image_sample.py)
    assert mc.pos_emb and (tc.warmup_steps, tc.grad_clip, tc.ema_warmup, tc.ema_decay) == (0, 0, False,
                                                                                           0.9999)
    assert (tc.sampler, tc.sample_steps) == ("ddpm", 250)
    assert tc.threshold == ("dynamic" if tc.guidance > 1 else "static")
    assert Diffusion(mc).betas[-1].item() == pytest.approx(0.025 if preset == "ffhq-p4" else 0.02)
    if preset == "imagenet-p4":
        assert (tc.batch_size, tc.max_steps, tc.guidance) == (256, 500_000, 1.5)
    small = dataclasses.replace(mc, base_channels=16, attn_head_dim=16, num_res_blocks=1)
    model = UNet(small)
    x = torch.randn(1, 3, mc.image_size, mc.image_size)
    y = torch.tensor([3]) if mc.num_classes else None
    loss = Diffusion(small).loss(model, x, y)[0].mean()
    loss.backward()
    assert torch.isfinite(loss) and model.conv_out.weight.grad.abs().sum() > 0
    assert model.conv_in.in_channels == 3 * mc.patch_size**2


def test_norm_groups_never_hide_the_conditioning():
    """A one-channel group would normalise away the embedding added just before it."""
    from unet import group_norm

    assert [group_norm(c).num_groups for c in (16, 32, 64, 96, 128, 256)] == [8, 16, 32, 32, 32, 32]
    model = randomise(UNet(tiny_model(num_classes=4)))  # widths 16 and 32
    x = torch.randn(2, 3, 16, 16)
    base = model(x, torch.tensor([10, 10]), torch.tensor([0, 0]))
    for t, y in (([60, 60], [0, 0]), ([10, 10], [1, 1])):  # the time, and the class, each move the output
        assert (model(x, torch.tensor(t), torch.tensor(y)) - base).abs().max() > 1e-3 * base.abs().max()


@pytest.mark.parametrize("kw", [dict(num_classes=4), dict(patch_size=2, pos_emb=True, attn_resolutions=(4,)),
                                dict(num_classes=4, pos_emb=True, mp_layers=True, resample="resblock")])
def test_no_graph_breaks_for_torch_compile(kw):
    """One graph for the whole network: torch.compile can fuse across every layer (GroupNorm + SiLU...)."""
    import torch._dynamo

    model = UNet(tiny_model(**kw)).to(memory_format=torch.channels_last)
    y = torch.tensor([0, 3]) if kw.get("num_classes") else None
    explained = torch._dynamo.explain(model)(torch.randn(2, 3, 16, 16), torch.tensor([1, 50]), y)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def saved_bytes(model, x, t):
    """Bytes of the tensors autograd keeps for the backward pass of one forward (the activations' memory)."""
    total = []

    def pack(tensor):
        total.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = model(x, t)
    return out, sum(total)


def test_activation_checkpointing_same_gradients_less_memory():
    import torch._dynamo

    # dropout: the recomputation must redraw the same masks
    mc = tiny_model(dropout=0.1, attn_resolutions=(16, 8))
    plain, ckpt = randomise(UNet(mc)), UNet(mc, activation_checkpointing=True)
    ckpt.load_state_dict(plain.state_dict())
    x, t = torch.randn(4, 3, 16, 16), torch.tensor([1, 30, 60, 99])
    grads = []
    for model in (plain, ckpt):
        torch.manual_seed(1)
        out, saved = saved_bytes(model, x, t)
        out.square().mean().backward()
        grads.append(([p.grad.clone() for p in model.parameters()], saved))
    for a, b in zip(grads[0][0], grads[1][0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert grads[1][1] < 0.5 * grads[0][1], (grads[1][1], grads[0][1])
    explained = torch._dynamo.explain(ckpt)(x, t)
    assert explained.graph_break_count == 0, explained.break_reasons


def test_cpu_dropout_keeps_1_minus_p_and_scales_like_f_dropout():
    from unet import dropout

    x = torch.ones(64, 32, 16, 16, requires_grad=True)
    torch.manual_seed(0)
    y = dropout(x, 0.1, True)
    kept = (y != 0).float()
    assert abs(kept.mean().item() - 0.9) < 0.002  # 524288 elements: the s.d. of the fraction is 0.0004
    assert torch.allclose(y[y != 0], torch.full_like(y[y != 0], 1 / 0.9))
    y.sum().backward()
    assert torch.equal(x.grad, kept / 0.9)  # the gradient flows where the output does, scaled alike
    torch.manual_seed(0)
    assert torch.equal(dropout(x, 0.1, True), y)  # the global generator: seeded runs repeat
    assert torch.equal(dropout(x, 0.1, False), x) and torch.equal(dropout(x, 0.0, True), x)
    for p in (0.3, 0.5):  # other rates, and a layout that is not NCHW
        z = dropout(torch.ones(8, 16, 8, 8).to(memory_format=torch.channels_last), p, True)
        assert abs((z == 0).float().mean().item() - p) < 0.03


# EDM2's magnitude-preserving layers (mp_layers), against their closed forms


def test_mp_silu_is_silus_magnitude_on_a_standard_normal():
    from scipy import integrate
    second_moment, _ = integrate.quad(lambda x: (x / (1 + math.exp(-x))) ** 2 * math.exp(-x * x / 2)
                                      / math.sqrt(2 * math.pi), -40, 40)
    assert unet.MP_SILU == pytest.approx(math.sqrt(second_moment), abs=5e-4)


def test_mp_sum_and_mp_cat_keep_magnitude_one():
    """Exactly, for inputs of magnitude 1: orthogonal ones for the sum, any for the concatenation (of unequal
    widths); and the concatenation's parts keep EDM2's balance, (1-t)² : t² of the energy."""
    torch.manual_seed(0)
    magnitude = lambda x: x.double().square().mean().sqrt().item()  # noqa: E731
    unit = lambda x: x / magnitude(x)  # noqa: E731
    a, b = torch.randn(2, 8, 4, 4, dtype=torch.float64), torch.randn(2, 8, 4, 4, dtype=torch.float64)
    b = b - (a * b).sum() / (a * a).sum() * a  # orthogonal to a
    assert magnitude(unet.mp_sum(unit(a), unit(b), 0.3)) == pytest.approx(1, abs=1e-12)
    c = unit(torch.randn(2, 24, 4, 4, dtype=torch.float64))
    out = unet.mp_cat(unit(a), c, 0.3)
    assert out.shape[1] == 32 and magnitude(out) == pytest.approx(1, abs=1e-12)
    energy = out[:, :8].square().sum() / out.square().sum()
    assert energy.item() == pytest.approx(0.7**2 / (0.7**2 + 0.3**2), abs=1e-12)


def test_mp_layers_use_unit_rows_and_forced_normalisation_restores_their_norm():
    """Each MPConv/MPDense computes with its weight rows divided by their norms (no bias), so white noise of
    magnitude 1 comes out with magnitude 1; force_weight_norm_ puts the stored rows back to norm √fan_in."""
    torch.manual_seed(0)
    layer = unet.MPConv(16, 32, 3, padding=1)
    assert layer.bias is None
    x = torch.randn(64, 16, 24, 24)
    w = layer.weight / layer.weight.flatten(1).norm(dim=1)[:, None, None, None]
    torch.testing.assert_close(layer(x), torch.nn.functional.conv2d(x, w, padding=1), rtol=1e-4, atol=1e-5)
    assert layer(x)[:, :, 1:-1, 1:-1].square().mean().sqrt().item() == pytest.approx(1, abs=0.02)
    dense = unet.MPDense(64, 48)
    with torch.no_grad():
        layer.weight.mul_(torch.rand(32, 1, 1, 1) * 3)  # rows of every norm, as training leaves them
        dense.weight.add_(1)
    unet.force_weight_norm_(torch.nn.Sequential(layer, dense))
    # √(16·3·3) and √64, to the 1e-4 the norm is padded with before dividing
    torch.testing.assert_close(layer.weight.flatten(1).norm(dim=1), torch.full((32,), 12.0),
                               rtol=1e-4, atol=0)
    torch.testing.assert_close(dense.weight.norm(dim=1), torch.full((48,), 8.0), rtol=1e-4, atol=0)


def test_the_mp_network_starts_at_zero_and_keeps_magnitudes_near_one():
    """At init the output is 0 (the learned output gain starts at 0); with that gain at 1, a unit-variance
    input keeps every block's output magnitude near 1. No layer has a bias but the GroupNorms, and it costs
    what Ho's network costs, to the biases."""
    from machinery import mfu

    torch.manual_seed(0)
    mc = tiny_model(mp_layers=True, num_classes=3, channel_mult=(1, 2, 2), attn_resolutions=(8, 4))
    model = UNet(mc)
    x, t, y = torch.randn(16, 3, 16, 16), torch.randint(0, 100, (16,)), torch.randint(0, 4, (16,))
    assert torch.equal(model(x, t, y), torch.zeros_like(x))
    assert all(not n.endswith("bias") or ".norm" in n or "norm_out" in n for n, _ in model.named_parameters())
    with torch.no_grad():
        model.out_gain.fill_(1)
    seen = []
    for m in model.modules():
        if isinstance(m, (unet.ResBlock, unet.Attention)):
            m.register_forward_hook(lambda m, i, out: seen.append(out.square().mean().sqrt().item()))
    with torch.no_grad():
        out = model(x, t, y)
    assert len(seen) == 18 and all(0.6 < s < 1.4 for s in seen), seen
    assert 0.5 < out.square().mean().sqrt().item() < 2
    flops = [mfu.train_flops_per_image(UNet, tiny_model(mp_layers=mp)) for mp in (False, True)]
    assert flops[1] == pytest.approx(flops[0], rel=0.01)

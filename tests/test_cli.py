"""The command line: flat overrides, presets, and one clear line for bad input."""
import pytest
from conftest import one_line_error

import ddpm
from ddpm import parse_args
from machinery.errors import UserError


def test_defaults_are_ho_et_al():
    mc, tc, preset = parse_args([])
    assert preset == "ho"
    assert ((mc.base_channels, mc.channel_mult, mc.num_res_blocks, mc.attn_resolutions, mc.dropout)
            == (128, (1, 2, 2, 2), 2, (16,), 0.1))
    assert ((mc.timesteps, mc.beta_start, mc.beta_end, mc.prediction, mc.schedule)
            == (1000, 1e-4, 0.02, "eps", "linear"))
    assert ((tc.lr, tc.warmup_steps, tc.grad_clip, tc.batch_size, tc.ema_decay, tc.hflip)
            == (2e-4, 5000, 1.0, 128, 0.9999, True))


def test_overrides_and_presets():
    mc, tc, preset = parse_args(["--preset", "demo", "--lr=3e-4", "--channel_mult=1,2", "--attn_resolutions=",
                                 "--compile", "--prediction", "v", "--hflip=false"])
    assert preset == "demo" and mc.image_size == 16 and tc.dataset == "shapes"
    assert tc.lr == 3e-4 and mc.channel_mult == (1, 2) and mc.attn_resolutions == () and tc.compile == "true"
    assert mc.prediction == "v" and tc.hflip is False
    mc, tc, _ = parse_args(["--preset=seed"])
    assert ((mc.base_channels, mc.channel_mult, mc.attn_heads, mc.attn_head_dim, tc.batch_size)
            == (32, (1, 2, 4, 8), 4, 32, 3072))


def test_the_gpu_recipe_is_ho_with_its_curve_at_35_evaluations():
    """cifar-gpu (issue 33): Ho's network and training unchanged, 100 Mimg, an FID curve every 5 Mimg whose
    samples and grids take 35 network evaluations each, and the post-hoc EMA sweep at the end."""
    import dataclasses
    import torch
    ho_mc, ho_tc, _ = parse_args([])
    mc, tc, _ = parse_args(["--preset=cifar-gpu"])
    assert mc == ho_mc
    changed = {k for k, v in dataclasses.asdict(tc).items() if getattr(ho_tc, k) != v}
    assert changed == {"max_steps", "eval_every_steps", "eval_fid_samples", "eval_sampler",
                       "eval_sample_steps", "sampler", "sample_steps"}
    assert tc.max_steps * tc.batch_size == pytest.approx(100e6, rel=1e-3)
    assert tc.eval_every_steps * tc.batch_size == pytest.approx(5e6, rel=1e-3)
    assert tc.ema_snapshot_kimg > 0 and tc.eval_fid_samples > 0  # both: ddpm.ema_sweep runs at the end
    calls = []

    def net(z, t, y=None):
        calls.append(1)
        return torch.zeros_like(z)
    d = ddpm.Diffusion(mc)
    for sampler, steps in ((tc.eval_sampler, tc.eval_sample_steps), (tc.sampler, tc.sample_steps)):
        calls.clear()
        ddpm.sample(d, net, (1, 3, 4, 4), sampler=sampler, steps=steps, generator=torch.Generator())
        assert len(calls) == 35


@pytest.mark.parametrize("args,needle", [
    (["--lr=abc"], "--lr=abc"),
    (["--prediction=foo"], "--prediction=foo"),
    (["--image_size=30"], "image_size 30"),
    (["--attn_resolutions=5"], "attn_resolutions"),
    (["--preset=nope"], "preset"),
    (["--resume"], "--resume"),
])
def test_bad_values_raise_config_errors(args, needle):
    with pytest.raises(UserError, match=needle.replace("+", r"\+")):
        parse_args(args)


@pytest.mark.parametrize("arg,needle", [("--no_such_field=1", "no_such_field"), ("--lr=abc", "lr"),
                                        ("--image_size=20", "image_size")])
def test_bad_input_is_one_line_and_nonzero(capsys, arg, needle):
    assert needle in one_line_error(capsys, ddpm.main, [arg])


def test_help_lists_every_field_with_default_and_comment(capsys):
    with pytest.raises(SystemExit) as e:
        ddpm.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "--base_channels=128" in out and "width of the first UNet level" in out
    assert "--batch_size=128" in out and "global batch size" in out
    assert "demo" in out


@pytest.mark.parametrize("args,value", [([], "auto"), (["--channels_last"], "true"),
                                        (["--channels_last=false"], "false"),
                                        (["--channels_last=off"], "false"), (["--channels_last=yes"], "true"),
                                        (["--channels_last=auto"], "auto")])
def test_channels_last_takes_auto_or_a_boolean(args, value):
    assert parse_args(args)[1].channels_last == value


def test_channels_last_rejects_other_words():
    with pytest.raises(UserError, match="--channels_last=maybe: choose one of auto, true, false"):
        parse_args(["--channels_last=maybe"])

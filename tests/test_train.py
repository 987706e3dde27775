"""Real training runs through the real loop, on the built-in data, on the CPU."""
import json
import math
import os

import pytest
import torch
from conftest import read_metrics, tiny_model, tiny_trainer

import ddpm
from ddpm import train
from machinery.errors import UserError
from unet import UNet


def test_short_run_learns_and_fills_the_run_folder(tmp_path):
    out = tmp_path / "run"
    train(tiny_model(), tiny_trainer(out, max_steps=40, sample_every_steps=20), preset="test")
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(5, 41, 5))
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"]  # it learns
    for key in ("step", "loss", "lr", "img_per_s", "tflops", "mfu", "loss_q0", "loss_q3", "step_ms"):
        assert key in rows[-1]
    assert rows[-1]["img_per_s"] > 0 and 0 < rows[-1]["mfu"] < 2
    files = set(os.listdir(out))
    assert {"config.json", "metrics.jsonl", "ckpt.pt", "ema.pt", "loss.png", "samples_0000020.png",
            "samples_0000040.png"} <= files
    cfg = json.load(open(out / "config.json"))
    assert cfg["model"]["base_channels"] == 16 and cfg["trainer"]["max_steps"] == 40
    assert cfg["environment"]["torch"] == torch.__version__ and "git_hash" in cfg["environment"]
    assert cfg["resolved"]["train_flops_per_image"] > 0 and cfg["resolved"]["precision"] == "fp32"
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["step"] == 40 and {"model", "ema", "optimizer", "rng", "loader"} <= set(ckpt)


def test_the_edm_levers_train_together(tmp_path):
    """EDM's preconditioning, weighting and lognormal timesteps, ADM's scale-shift norm and EDM2's rsqrt LR in
    one real run: it learns, and its EMA samples through the same samplers."""
    out = tmp_path / "run"
    mc = tiny_model(prediction="edm", loss_weighting="edm", t_sampling="lognormal", scale_shift_norm=True)
    train(mc, tiny_trainer(out, max_steps=40, lr_schedule="rsqrt", lr_decay_steps=10), preset="test")
    rows = read_metrics(out)
    assert rows[-1]["loss"] < 0.85 * rows[0]["loss"]  # F's loss starts near 1 and keeps a high floor
    assert rows[-1]["lr"] == pytest.approx(2e-3 / (39 / 10) ** 0.5, rel=1e-6)
    assert "samples_0000040.png" in os.listdir(out)


def test_the_network_levers_train_together(tmp_path):
    """EDM2's magnitude-preserving layers with BigGAN's resampling blocks and a class label, in one real run
    at EDM2's relative LR: it learns, and after every step each stored weight row is back at norm √fan_in."""
    out = tmp_path / "run"
    mc = tiny_model(mp_layers=True, resample="resblock", num_classes=4)
    train(mc, tiny_trainer(out, max_steps=40, lr=1e-2), preset="test")
    rows = read_metrics(out)
    assert rows[-1]["loss"] < 0.7 * rows[0]["loss"]
    state = torch.load(out / "ckpt.pt", map_location="cpu", weights_only=True)["model"]
    rows_checked = 0
    for name, w in state.items():
        if name.endswith("weight") and w.dim() > 1:  # every conv and dense layer, and the class table
            dims = (0,) if name.startswith("class_emb") else tuple(range(1, w.dim()))
            size = math.prod(w.shape[d] for d in dims)
            norms = torch.linalg.vector_norm(w.float(), dim=dims)
            torch.testing.assert_close(norms, torch.full_like(norms, math.sqrt(size)), rtol=1e-4, atol=0)
            rows_checked += 1
    assert rows_checked > 20


def test_resume_is_bitwise_identical_to_a_straight_run(tmp_path):
    mc = tiny_model(dropout=0.1, num_classes=4)  # dropout and label dropout use the RNG too
    train(mc, tiny_trainer(tmp_path / "straight", max_steps=20, shapes_count=128), preset="test")
    # 8 batches an epoch: resumes mid-epoch
    train(mc, tiny_trainer(tmp_path / "resumed", max_steps=10, shapes_count=128), preset="test")
    train(mc, tiny_trainer(tmp_path / "resumed", max_steps=20, shapes_count=128, resume=True), preset="test")
    a = torch.load(tmp_path / "straight" / "ckpt.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed" / "ckpt.pt", weights_only=True)
    assert b["step"] == 20
    for part in ("model", "ema"):
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), (part, k)


def test_never_overwrites_a_checkpoint_and_checks_resume_config(tmp_path):
    out = tmp_path / "run"
    train(tiny_model(), tiny_trainer(out, max_steps=2, log_every_steps=1), preset="test")
    before = (out / "ckpt.pt").read_bytes()
    with pytest.raises(UserError, match="already holds a checkpoint"):
        train(tiny_model(), tiny_trainer(out, max_steps=2), preset="test")
    with pytest.raises(UserError, match="base_channels"):
        train(tiny_model(base_channels=32), tiny_trainer(out, max_steps=4, resume=True), preset="test")
    assert (out / "ckpt.pt").read_bytes() == before
    with pytest.raises(UserError, match="no checkpoint"):
        train(tiny_model(), tiny_trainer(tmp_path / "empty", resume=True), preset="test")
    (out / "ckpt.pt").write_bytes(before[: len(before) // 2])  # truncated: one clear error, not a traceback
    with pytest.raises(UserError, match="cannot read checkpoint"):
        train(tiny_model(), tiny_trainer(out, max_steps=4, resume=True), preset="test")


def test_channels_last_auto_is_nhwc_except_where_atens_group_norm_makes_it_slower():
    from machinery.runs import resolve_channels_last

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_channels_last("auto", cpu, "fp32") and resolve_channels_last("auto", cuda, "bf16")
    # ATen's NHWC GroupNorm is slow there (BENCHMARKS.md)
    assert not resolve_channels_last("auto", cpu, "bf16")
    # eager on a GPU in bf16/fp16: NHWC activations copied to NCHW around every GroupNorm (H200,
    # BENCHMARKS.md)
    assert not resolve_channels_last("auto", cuda, "bf16", compiled=False)
    assert not resolve_channels_last("auto", cuda, "fp16", compiled=False)
    assert resolve_channels_last("auto", cuda, "fp32", compiled=False)
    assert resolve_channels_last("true", cuda, "bf16", False)
    assert resolve_channels_last("true", cpu, "bf16") and not resolve_channels_last("false", cuda, "fp32")


def test_bf16_training_on_the_cpu_learns(tmp_path):
    """bf16 autocast on the CPU (what --precision=auto picks on AVX512-BF16/AMX CPUs; emulated, slower,
    elsewhere)."""
    out = tmp_path / "run"
    train(tiny_model(), tiny_trainer(out, max_steps=30, precision="bf16"), preset="test")
    rows = read_metrics(out)
    assert all(r["nonfinite_skipped"] == 0 for r in rows)
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"]
    resolved = json.load(open(out / "config.json"))["resolved"]
    # auto: NCHW for bf16 on a CPU
    assert resolved["precision"] == "bf16" and resolved["channels_last"] is False
    model = torch.load(out / "ckpt.pt", weights_only=True)["model"]
    # autocast computes in bf16, the weights stay fp32
    assert all(v.dtype == torch.float32 for v in model.values())


@pytest.mark.parametrize("ok", [None, 1.0, 0.0])
def test_ema_update_is_the_lerp_and_skips_where_ok_is_zero(ok):
    """θ_ema <- decay θ_ema + (1 - decay) θ; with ok (a device tensor, never read on the host) 0, no
    change."""
    mc = tiny_model()
    model, ema = UNet(mc), UNet(mc).requires_grad_(False)
    before = [p.clone() for p in ema.parameters()]
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))  # two random inits
    ddpm.ema_update(ema, model, 0.9, None if ok is None else torch.tensor(ok))
    for e, b, p in zip(ema.parameters(), before, model.parameters()):
        want = b if ok == 0.0 else 0.9 * b + 0.1 * p
        torch.testing.assert_close(e, want)


@pytest.mark.parametrize("k", [2, 4])
def test_gradient_accumulation_equals_one_big_batch(k):
    """k micro-batches with the loss scaled by 1/k: the big batch's loss, per-sample losses and gradients
    (read off an SGD step of lr 1, which moves every weight by its gradient)."""
    mc = tiny_model(num_classes=4, dropout=0.0)
    diffusion = ddpm.Diffusion(mc)
    x0, y = torch.rand(8, 3, 16, 16) * 2 - 1, torch.arange(8) % 4
    out = []
    for steps in (1, k):
        torch.manual_seed(0)
        model = UNet(mc)
        before = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        torch.manual_seed(1)
        step = ddpm.train_step(model, diffusion, opt, x0, y, "fp32", 0.0, accum_steps=steps)
        grads = [b - p.detach() for b, p in zip(before, model.parameters())]
        out.append((step.loss, grads, step.t, step.losses))
    (l1, g1, t1, s1), (lk, gk, tk, sk) = out
    assert torch.equal(t1, tk)  # the same timesteps, noise and label dropout: drawn once per batch
    torch.testing.assert_close(sk, s1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lk, l1, rtol=1e-5, atol=1e-6)
    for a, b in zip(gk, g1):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_fp16_with_loss_scaling_trains_and_resumes_bitwise(tmp_path):
    """fp16 autocast with a dynamic GradScaler (on the CPU here, where fp16 is slow: a short run): finite
    losses, no skipped steps, the scaler's state in the checkpoint, and a resumed run bitwise the straight
    one."""
    out, straight = tmp_path / "run", tmp_path / "straight"
    fp16 = dict(precision="fp16", batch_size=8, log_every_steps=2)
    train(tiny_model(), tiny_trainer(out, max_steps=4, **fp16), preset="test")
    rows = read_metrics(out)
    assert all(r["loss"] is not None and r["nonfinite_skipped"] == 0 for r in rows)
    assert torch.load(out / "ckpt.pt", weights_only=True)["scaler"]["scale"] > 0
    train(tiny_model(), tiny_trainer(straight, max_steps=6, **fp16), preset="test")
    train(tiny_model(), tiny_trainer(out, max_steps=6, resume=True, **fp16), preset="test")
    a, b = (torch.load(p / "ckpt.pt", weights_only=True) for p in (out, straight))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and a["scaler"] == b["scaler"]


def test_fp16_overflow_is_one_skip_and_lowers_the_scale():
    mc = tiny_model(dropout=0.0)
    b = ddpm.build(mc, ddpm.TrainerConfig(precision="fp16", compile="false"), torch.device("cpu"))
    model, diffusion, opt, scaler = b.model, b.diffusion, b.opt, b.scaler
    assert b.precision == "fp16" and isinstance(scaler, torch.amp.GradScaler)
    scaler._init_scale = 2.0**100  # a scale that overflows fp16 gradients for certain
    before = [p.detach().clone() for p in model.parameters()]
    x0 = torch.rand(4, 3, 16, 16) * 2 - 1
    step = ddpm.train_step(model, diffusion, opt, x0, None, "fp16", 1.0, scaler=scaler)
    # the loss was fine; the scaled gradients were not
    assert step.ok.item() == 0 and torch.isfinite(step.loss)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # skipped: nothing moved
    assert scaler.get_scale() == 2.0**99  # and the scaler backed off, once


def test_a_run_against_the_clock_stops_at_its_budget_with_the_ema_of_each_minute(tmp_path, monkeypatch):
    """time_budget_min, on a clock that moves 7 s at each reading (the test does not depend on this machine's
    speed): the EMA of each whole minute lands in minutes/ in ema.pt's format, the run stops once the budget
    is spent, with its weights, and records when; a budget spent before the first step is one line; a run
    against the clock cannot be resumed."""
    import itertools

    from machinery import mfu

    ticks = itertools.count()
    monkeypatch.setattr(ddpm.Budget, "clock", staticmethod(lambda: 7.0 * next(ticks)))
    monkeypatch.setattr(mfu, "process_seconds", lambda: 0.0)  # this process is pytest's, started long ago
    out = tmp_path / "run"
    tc = tiny_trainer(out, max_steps=10**6, time_budget_min=2.5, num_samples=0, log_every_steps=1000)
    train(tiny_model(), tc, preset="test")
    rows = read_metrics(out, key=None)
    minutes = [r for r in rows if "minute" in r]
    final = [r for r in rows if "budget_s" in r]
    assert [r["minute"] for r in minutes] == [1, 2] and len(final) == 1 and final[0]["budget_s"] == 150
    assert 60 <= minutes[0]["clock_s"] < 120 <= minutes[1]["clock_s"] < 150 <= final[0]["clock_s"]
    assert minutes[0]["step"] < minutes[1]["step"] < final[0]["step"]
    assert final[0]["step"] == torch.load(out / "ckpt.pt", weights_only=True)["step"]
    assert read_metrics(out)[-1]["step"] == final[0]["step"]  # the stop logs its interval, img/s and MFU
    assert sorted(os.listdir(out / "minutes")) == ["ema_min001.pt", "ema_min002.pt"]
    model, mc, _ = ddpm.load_ema(str(out / "minutes" / "ema_min002.pt"), "cpu")
    assert mc.base_channels == 16
    monkeypatch.setattr(mfu, "process_seconds", lambda: 1e4)  # set-up took longer than the budget
    with pytest.raises(UserError, match="spent before the first step"):
        train(tiny_model(), tiny_trainer(tmp_path / "late", time_budget_min=2.5), preset="test")
    with pytest.raises(UserError, match="cannot be resumed"):
        ddpm.validate(tiny_model(), tiny_trainer(out, time_budget_min=2.5, resume=True))


def test_the_clock_starts_with_the_process():
    """mfu.process_seconds counts from the process's start, before anything is imported."""
    import subprocess
    import sys

    from conftest import ROOT

    code = "import time; time.sleep(1.5); from machinery import mfu; print(mfu.process_seconds())"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and float(done.stdout.split()[-1]) >= 1.5, done.stderr

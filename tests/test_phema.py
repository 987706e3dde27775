"""Post-hoc EMA against the paper's maths (Karras et al. 2024, appendix C.2), written out independently."""
import io
import os

import numpy as np
import pytest
import torch

from machinery import phema
from machinery.errors import UserError


def test_the_sigma_rels_of_the_paper():
    """EDM2 §3.1: σ_rel 0.05 and 0.10 are the exponents γ = 16.97 and 6.94; σ_rel's formula inverts."""
    assert phema.gamma_of(0.05) == pytest.approx(16.97, abs=0.01)
    assert phema.gamma_of(0.10) == pytest.approx(6.94, abs=0.01)
    for s in (0.01, 0.08, 0.2, 0.28):
        assert phema.sigma_rel_of(phema.gamma_of(s)) == pytest.approx(s, rel=1e-10)
    for bad in (0.0, -0.1, 0.3, 1.0):
        with pytest.raises(ValueError):
            phema.gamma_of(bad)


def test_the_update_averages_with_the_power_profile():
    """Unrolled, the EMA after t steps is Σ_τ w_τ θ(τ) with w_τ = (τ^(γ+1) - (τ-1)^(γ+1)) / t^(γ+1): the
    profile (γ+1)τ^γ/t^(γ+1) integrated over each step, summing to 1, the first step included."""
    g = torch.Generator().manual_seed(0)
    thetas = torch.randn(300, generator=g)
    model = torch.nn.Linear(1, 1, bias=False)
    tracked = phema.Tracked(model, (0.05, 0.2))
    for t, theta in enumerate(thetas, start=1):
        model.weight.data.fill_(theta)
        tracked.update(model, t)
        for (average,), gamma in zip(tracked.averages, tracked.gammas):
            tau = np.arange(1, t + 1, dtype=np.float64)
            w = (tau ** (gamma + 1) - (tau - 1) ** (gamma + 1)) / t ** (gamma + 1)
            assert w.sum() == pytest.approx(1, rel=1e-12)
            assert average.item() == pytest.approx(float(w @ thetas[:t].double().numpy()), abs=1e-5)


def test_a_skipped_step_leaves_the_averages_alone():
    model = torch.nn.Linear(2, 2)
    tracked = phema.Tracked(model, (0.1,))
    tracked.update(model, 1)
    before = [a.clone() for a in tracked.averages[0]]
    with torch.no_grad():
        model.weight.add_(1)
    tracked.update(model, 2, ok=torch.tensor(0.0))
    assert all(torch.equal(a, b) for a, b in zip(tracked.averages[0], before))


@pytest.mark.parametrize("ta,ga,tb,gb", [(1.0, 6.94, 1.0, 16.97), (0.4, 3.0, 1.0, 16.97),
                                         (1.0, 0.5, 0.7, 2.0)])
def test_the_inner_product_is_the_integral(ta, ga, tb, gb):
    def p(t, g, tau):
        return np.where(tau <= t, (g + 1) * tau ** g / t ** (g + 1), 0.0)
    tau = np.linspace(0, min(ta, tb), 2_000_001)  # the product is 0 beyond
    numeric = np.trapezoid(p(ta, ga, tau) * p(tb, gb, tau), tau)
    assert phema.inner(ta, ga, tb, gb) == pytest.approx(numeric, rel=1e-5)
    assert phema.inner(ta, ga, tb, gb) == pytest.approx(phema.inner(tb, gb, ta, ga), rel=1e-12)
    # in step units of a long run (t^γ overflows a float64 without the logarithms)
    scaled = phema.inner(ta * 1e6, ga, tb * 1e6, gb)
    assert scaled == pytest.approx(phema.inner(ta, ga, tb, gb) / 1e6, rel=1e-9)


def walk(steps, seed=0):
    """A parameter vector that drifts and jitters as training weights do."""
    g = torch.Generator().manual_seed(seed)
    drift = torch.cumsum(torch.randn(steps, 64, generator=g) * 0.05, 0)
    return drift + torch.randn(steps, 64, generator=g) * 0.3


def track(tmp_path, sigma_rels, steps=400, every=40):
    thetas = walk(steps)
    model = torch.nn.Linear(64, 1, bias=False)
    tracked = phema.Tracked(model, sigma_rels)
    for t in range(1, steps + 1):
        model.weight.data.copy_(thetas[t - 1][None])
        tracked.update(model, t)
        if t % every == 0:
            tracked.snapshot(str(tmp_path), model, t, t * 8)
    return model, tracked


def test_a_tracked_sigma_rel_rebuilds_as_itself(tmp_path):
    model, tracked = track(tmp_path, (0.05, 0.10))
    for sigma_rel, (average,) in zip((0.05, 0.10), tracked.averages):
        state, used = phema.rebuild(str(tmp_path), phema.shapes_of(model), sigma_rel)
        torch.testing.assert_close(state["weight"], average.half().float(), rtol=0, atol=2e-3)
        own = [u["coefficient"] for u in used if u["step"] == 400 and u["sigma_rel"] == sigma_rel]
        assert own == [pytest.approx(1, abs=1e-6)] and sum(u["coefficient"] for u in used) == pytest.approx(1)
        assert len(used) == 20 and {u["nimg"] for u in used} == {40 * 8 * k for k in range(1, 11)}


def test_a_sigma_rel_between_rebuilds_closer_than_either_input(tmp_path):
    model, tracked = track(tmp_path, (0.05, 0.10))
    _, direct = track(tmp_path / "direct", (0.075,))
    truth = direct.averages[0][0]
    state, _ = phema.rebuild(str(tmp_path), phema.shapes_of(model), 0.075)
    err = (state["weight"] - truth).norm()
    inputs = [(average - truth).norm() for (average,) in tracked.averages]
    assert err < 0.25 * min(inputs), (err, inputs)
    earlier, _ = phema.rebuild(str(tmp_path), phema.shapes_of(model), 0.075, step=200)  # the EMA half-way
    assert (earlier["weight"] - truth).norm() > 2 * err


def test_bad_snapshots_are_one_line(tmp_path):
    model, _ = track(tmp_path, (0.05,), steps=80)
    folder = tmp_path / "phema"
    first = folder / "phema-000000040-0.0500.pt"
    first.write_bytes(first.read_bytes()[:100])  # truncated
    with pytest.raises(UserError, match="cannot read post-hoc EMA snapshot .*phema-000000040"):
        phema.rebuild(str(tmp_path), phema.shapes_of(model), 0.05)
    os.remove(first)
    os.symlink(folder / "phema-000000080-0.0500.pt", first)  # a planted link is not read through
    with pytest.raises(UserError, match="cannot read post-hoc EMA snapshot"):
        phema.rebuild(str(tmp_path), phema.shapes_of(model), 0.05)
    os.remove(first)
    with pytest.raises(UserError, match="not a snapshot of this model"):
        phema.rebuild(str(tmp_path), phema.shapes_of(torch.nn.Linear(3, 1, bias=False)), 0.05)
    elsewhere = tmp_path / "elsewhere"
    os.rename(folder, elsewhere)
    os.symlink(elsewhere, folder)
    with pytest.raises(UserError, match="not a folder of snapshots"):
        phema.rebuild(str(tmp_path), phema.shapes_of(model), 0.05)
    with pytest.raises(UserError, match="has no post-hoc EMA snapshots"):
        phema.rebuild(str(tmp_path / "none"), phema.shapes_of(model), 0.05)


# ---- in training and in sample.py


def test_training_snapshots_resume_bitwise_and_a_rebuilt_sigma_rel_is_a_weights_file(
        tmp_path, capsys, monkeypatch):
    """A run tracks its σ_rel values, snapshots every kimg and at the end; stopped half-way and resumed, it
    ends with the same tracked EMAs and snapshots, bit for bit; `python -m machinery.phema` writes the EMA of
    any σ_rel as a weights file in ema.pt's format, the parameters those rebuild() gives and the buffers
    ema.pt's, which sample.py samples like ema.pt and records with every snapshot used."""
    from conftest import one_line_error, tiny_model, tiny_trainer

    import ddpm
    import sample

    mc = tiny_model()
    kw = dict(batch_size=16, ema_snapshot_kimg=1, ema_sigma_rels=(0.05, 0.10))  # a snapshot every 63 steps
    straight = ddpm.train(mc, tiny_trainer(tmp_path / "a", max_steps=70, **kw), preset="test")
    assert "post-hoc EMA: σ_rel 0.05, 0.1 snapshotted every 1 kimg and at the end" in capsys.readouterr().out
    real = ddpm.iteration

    def crash_at_40(b, x0, y, tc, step, shard=(0, 1)):
        if step == 40:
            raise RuntimeError("the machine went away")
        return real(b, x0, y, tc, step, shard)

    with monkeypatch.context() as m, pytest.raises(RuntimeError, match="went away"):
        m.setattr(ddpm, "iteration", crash_at_40)
        ddpm.train(mc, tiny_trainer(tmp_path / "b", max_steps=70, ckpt_every_steps=20, **kw), preset="test")
    ddpm.train(mc, tiny_trainer(tmp_path / "b", max_steps=70, resume=True, **kw), preset="test")
    names = sorted(os.listdir(os.path.join(straight, "phema")))
    assert names == ["phema-000000063-0.0500.pt", "phema-000000063-0.1000.pt", "phema-000000070-0.0500.pt",
                     "phema-000000070-0.1000.pt"]
    assert sorted(os.listdir(tmp_path / "b" / "phema")) == names
    for name in names:
        a, b = (torch.load(os.path.join(run, "phema", name), weights_only=True)
                for run in (straight, tmp_path / "b"))
        assert a["nimg"] == b["nimg"]
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    ckpts = [torch.load(os.path.join(run, "ckpt.pt"), weights_only=True)["phema"]
             for run in (straight, tmp_path / "b")]
    assert all(torch.equal(x, y) for u, v in zip(*(c["averages"] for c in ckpts)) for x, y in zip(u, v))

    argv = ["--ckpt", str(straight), "--n", "4", "--batch", "4", "--sampler", "ddim", "--steps", "2",
            "--device", "cpu", "--guidance", "1"]
    paths = phema.main(["--run", str(straight), "--sigma_rel", "0.08,0.05"])
    assert paths == [os.path.join(straight, f"ema-sigma_rel{v}.pt") for v in ("0.0800", "0.0500")]
    written, ema = (torch.load(p, weights_only=True) for p in (paths[0], os.path.join(straight, "ema.pt")))
    state, _ = phema.rebuild(str(straight), phema.shapes_of(ddpm.UNet(mc)), 0.08, step=70)
    assert {k for k in written} == {*ema, "post_hoc_ema"} and written["ema"].keys() == ema["ema"].keys()
    assert all(torch.equal(written["ema"][k], state[k].to(v.dtype) if k in state else v)
               for k, v in ema["ema"].items())
    assert any(not torch.equal(written["ema"][k], ema["ema"][k]) for k in state)
    result = sample.main([*argv[:1], paths[0], *argv[2:], "--out", str(tmp_path / "s" / "g.png")])
    record = result["checkpoint"]["post_hoc_ema"]
    assert result["checkpoint"]["weights"] == "post-hoc EMA (machinery/phema.py)"
    assert record["sigma_rel"] == 0.08
    assert record["step"] == 70 and len(record["snapshots"]) == 4
    assert sum(s["coefficient"] for s in record["snapshots"]) == pytest.approx(1)
    assert "--sigma_rel" in one_line_error(capsys, phema.main, ["--run", str(straight), "--sigma_rel", "0.5"])


def test_resuming_a_run_without_post_hoc_ema_state_is_one_line(tmp_path):
    from conftest import tiny_model, tiny_trainer

    import ddpm

    ddpm.train(tiny_model(), tiny_trainer(tmp_path, max_steps=2, ema_snapshot_kimg=0), preset="test")
    with pytest.raises(UserError, match="holds no post-hoc EMA .*--ema_snapshot_kimg=0"):
        ddpm.train(tiny_model(), tiny_trainer(tmp_path, max_steps=4, resume=True, ema_snapshot_kimg=1),
                   preset="test")


def test_a_snapshot_lost_between_checkpoint_and_snapshot_is_written_on_resuming(tmp_path):
    """The checkpoint comes first; a crash before the snapshot of the same step is made good by --resume."""
    from conftest import tiny_model, tiny_trainer

    import ddpm

    kw = dict(batch_size=16, ema_snapshot_kimg=1)
    ddpm.train(tiny_model(), tiny_trainer(tmp_path, max_steps=63, **kw), preset="test")
    kept = {name: (tmp_path / "phema" / name).read_bytes() for name in os.listdir(tmp_path / "phema")}
    for name in kept:
        os.remove(tmp_path / "phema" / name)  # as if the process died right after ckpt.pt
    ddpm.train(tiny_model(), tiny_trainer(tmp_path, max_steps=64, resume=True, **kw), preset="test")
    for name, content in kept.items():
        again = torch.load(tmp_path / "phema" / name, weights_only=True)
        before = torch.load(io.BytesIO(content), weights_only=True)
        assert all(torch.equal(again["params"][k], before["params"][k]) for k in before["params"])

"""sample.py: well-formed outputs from a real checkpoint, and one clear line for bad ones."""
import json

import numpy as np
import pytest
from conftest import one_line_error, tiny_model, tiny_trainer

import sampling
import ddpm
import sample
from ddpm import train


@pytest.mark.parametrize("ckpt", ["ckpt.pt", "ema.pt"])
def test_writes_grid_and_npz(run_dir, tmp_path, ckpt):
    out = tmp_path / "grid.png"
    sample.main(["--ckpt", str(run_dir / ckpt), "--n", "10", "--batch", "4", "--steps", "5", "--guidance",
                 "1.5", "--out", str(out)])
    assert out.exists() and out.stat().st_size > 0
    z = np.load(tmp_path / "grid.npz")
    assert z["arr_0"].shape == (10, 16, 16, 3) and z["arr_0"].dtype == np.uint8
    assert z["arr_1"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]


def test_batching_does_not_change_the_samples(run_dir, tmp_path):
    for batch in (3, 10):
        sample.main(["--ckpt", str(run_dir / "ema.pt"), "--n", "6", "--batch", str(batch), "--sampler",
                     "ddim", "--steps", "4", "--label", "2", "--out", str(tmp_path / f"b{batch}.png")])
    a, b = np.load(tmp_path / "b3.npz"), np.load(tmp_path / "b10.npz")
    assert (a["arr_1"] == 2).all()
    assert a["arr_0"].shape == b["arr_0"].shape == (6, 16, 16, 3)


@pytest.mark.parametrize("content,needle", [(None, "no checkpoint at"),
                                            (b"not a checkpoint", "cannot read checkpoint")])
def test_bad_checkpoints_are_one_line(tmp_path, capsys, content, needle):
    path = tmp_path / "bad.pt"
    if content is not None:
        path.write_bytes(content)
    assert needle in one_line_error(capsys, sample.main, ["--ckpt", str(path), "--out",
                                                          str(tmp_path / "x.png")])


def test_split_experts_warm_start_and_sample_together(tmp_path):
    mc_low, mc_high = tiny_model(split_timestep=40), tiny_model(split_timestep=40, split_part="high")
    train(mc_low, tiny_trainer(tmp_path / "low", max_steps=3), preset="test")
    train(mc_high, tiny_trainer(tmp_path / "high", max_steps=3, init_from=str(tmp_path / "low" / "ckpt.pt")),
          preset="test")
    out = tmp_path / "split.png"
    sample.main(["--ckpt", str(tmp_path / "low" / "ema.pt"), "--ckpt_high", str(tmp_path / "high" / "ema.pt"),
                 "--n", "4", "--steps", "6", "--out", str(out)])
    assert np.load(tmp_path / "split.npz")["arr_0"].shape == (4, 16, 16, 3)
    with pytest.raises(SystemExit):  # one expert alone is refused
        sample.main(["--ckpt", str(tmp_path / "low" / "ema.pt"), "--out", str(tmp_path / "x.png")])


def test_eval_bpd_on_held_out_images(run_dir, tmp_path):
    out = tmp_path / "bpd.png"
    exact = sample.main(["--ckpt", str(run_dir / "ckpt.pt"), "--eval", "bpd", "--n", "32", "--batch", "16",
                         "--out", str(out)])
    est = sample.main(["--ckpt", str(run_dir / "ema.pt"), "--eval", "bpd", "--n", "32", "--batch", "16",
                       "--strata", "10", "--out", str(out)])
    assert 0 < exact["bpd"] < 50 and exact["n"] == 32 and exact["dataset"] == "shapes"
    assert est["estimator_se"] > 0 and abs(est["bpd"] - exact["bpd"]) < 5 * est["estimator_se"] + 0.05
    assert json.load(open(tmp_path / "bpd.json"))["strata"] == 10


def test_sampling_speed_is_reported(run_dir, tmp_path, capsys):
    run = sample.main(["--ckpt", str(run_dir / "ema.pt"), "--n", "6", "--batch", "4", "--sampler", "ddim",
                       "--steps", "3", "--guidance", "2", "--out", str(tmp_path / "g.png")])
    assert run == json.loads((tmp_path / "g.json").read_text())
    assert run["nfe_per_image"] == 6  # 3 steps, each a guided pair of evaluations
    assert run["img_per_s"] > 0 and run["s_per_img"] == pytest.approx(1 / run["img_per_s"])
    assert run["nfe_per_s"] == pytest.approx(6 * run["img_per_s"]) and run["peak_memory_bytes"] > 2**20
    assert "network evaluations per image" in capsys.readouterr().out


def test_sampling_defaults_are_the_runs(run_dir, tmp_path):
    """Without --sampler/--steps/--guidance/--threshold, sample.py samples as the run's config says (a paper
    preset's 250 ancestral steps, dynamic thresholding when guided); flags still override."""
    import torch

    ckpt = torch.load(run_dir / "ema.pt", weights_only=True)
    assert (ckpt["trainer_config"]["sampler"], ckpt["trainer_config"]["sample_steps"]) == ("ddim", 5)
    ckpt["trainer_config"].update(guidance=3.0, threshold="dynamic")
    torch.save(ckpt, tmp_path / "ema.pt")
    common = ["--ckpt", str(tmp_path / "ema.pt"), "--n", "4", "--batch", "4"]
    run = sample.main([*common, "--out", str(tmp_path / "a.png")])
    assert {k: run[k] for k in ("sampler", "steps", "guidance", "threshold")} == dict(
        sampler="ddim", steps=5, guidance=3.0, threshold="dynamic")
    assert run["nfe_per_image"] == 10  # 5 guided steps
    explicit = sample.main([*common, "--sampler", "ddim", "--steps", "5", "--guidance", "3", "--threshold",
                            "dynamic", "--out", str(tmp_path / "b.png")])
    assert explicit["threshold"] == "dynamic"
    a, b = np.load(tmp_path / "a.npz")["arr_0"], np.load(tmp_path / "b.npz")["arr_0"]
    assert np.array_equal(a, b)
    static = sample.main([*common, "--threshold", "static", "--steps", "1", "--out", str(tmp_path / "c.png")])
    assert (static["threshold"], static["steps"], static["sampler"]) == ("static", 1, "ddim")


def test_another_sampler_than_the_runs_does_not_take_its_grid_steps(run_dir, tmp_path):
    """The run samples its grids with DDIM (5 steps); --sampler dpm++ alone takes the run's eval_sample_steps,
    --sampler ddpm alone all T."""
    common = ["--ckpt", str(run_dir / "ema.pt"), "--n", "2", "--batch", "2", "--guidance", "1"]
    dpm = sample.main([*common, "--sampler", "dpm++", "--out", str(tmp_path / "a.png")])
    assert dpm["steps"] == 20  # TrainerConfig.eval_sample_steps, as the run recorded it
    ddpm_ = sample.main([*common, "--sampler", "ddpm", "--out", str(tmp_path / "b.png")])
    assert ddpm_["steps"] == 100 and ddpm_["nfe_per_image"] == 100  # all T of the tiny model


def test_a_sampler_registered_after_import_is_a_choice(run_dir, tmp_path):
    """--sampler's choices are ddpm.SAMPLERS when the arguments are parsed: a sampler registered with
    @ddpm.sampler after sample.py was imported is taken, with the defaults of any sampler other than the run's
    (all T steps), and refused again once it has left the table."""
    calls = []
    try:
        @ddpm.sampler("dummy")
        def one_call(d, denoise, z, ts, noise, eta):
            """One network call: x̂₀ at the first timestep."""
            calls.append(len(ts))
            return denoise(z, ts[0])[0]

        out = tmp_path / "dummy.png"
        run = sample.main(["--ckpt", str(run_dir / "ema.pt"), "--n", "3", "--batch", "2", "--guidance", "1",
                           "--sampler", "dummy", "--out", str(out)])
    finally:
        ddpm.SAMPLERS.pop("dummy", None)
    # all T of the tiny model
    assert (run["sampler"], run["steps"], run["nfe_per_image"]) == ("dummy", 100, 1)
    assert calls == [100, 100]  # two batches, each given all T timesteps
    assert out.exists() and out.stat().st_size > 0
    assert np.load(tmp_path / "dummy.npz")["arr_0"].shape == (3, 16, 16, 3)
    with pytest.raises(SystemExit) as e:
        sample.main(["--ckpt", str(run_dir / "ema.pt"), "--sampler", "dummy", "--out",
                     str(tmp_path / "x.png")])
    assert e.value.code == 2


def test_heun_samples_through_sample_py(run_dir, tmp_path):
    """--sampler heun: Karras-spaced timesteps, two network calls a step but one on the last."""
    out = tmp_path / "heun.png"
    run = sample.main(["--ckpt", str(run_dir / "ema.pt"), "--n", "3", "--batch", "2", "--guidance", "1",
                       "--sampler", "heun", "--steps", "4", "--out", str(out)])
    _, mc, _ = ddpm.load_ema(str(run_dir / "ema.pt"), "cpu")
    ts = ddpm.Diffusion(mc).timestep_sequence(4, ddpm.SAMPLERS["heun"].spacing)
    assert (run["sampler"], run["steps"]) == ("heun", 4) and len(ts) > 1
    assert run["nfe_per_image"] == 2 * len(ts) - 1
    images = np.load(tmp_path / "heun.npz")["arr_0"]
    assert images.shape == (3, 16, 16, 3) and images.std() > 0 and out.stat().st_size > 0
    assert run == json.loads((tmp_path / "heun.json").read_text())


def test_the_batch_fills_the_device_and_a_cpu_samples_eagerly(run_dir, tmp_path):
    """--batch 0 (the default) is CPU_BATCH on a CPU, and --compile auto leaves the CPU's step eager."""
    run = sample.main(["--ckpt", str(run_dir / "ema.pt"), "--n", "3", "--steps", "2", "--guidance", "1",
                       "--out", str(tmp_path / "a.png")])
    assert (run["batch"], run["compile"]) == (sampling.CPU_BATCH, "false")


@pytest.mark.parametrize("mp", [False, True])
def test_bf16_weights_give_the_bits_autocast_gives(mp):
    """The sampling network stores the conv and dense weights in bf16 where autocast would cast them at every
    call (not the magnitude-preserving ones, which normalise float32 weights first): the outputs are the same
    bits as autocast over the fp32 weights."""
    import argparse

    import torch

    from conftest import tiny_model
    from unet import UNet

    torch.manual_seed(0)
    mc = tiny_model(num_classes=4, mp_layers=mp)
    model = UNet(mc).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # off Ho's zero-initialised last layers
        if mp:
            model.out_gain.fill_(1)  # and off mp's zero output gain
    z, t, y = torch.randn(3, 3, 16, 16), torch.tensor([5, 50, 99]), torch.tensor([0, 3, 4])
    with torch.no_grad():
        want = ddpm.autocast_model(model, torch.device("cpu"), "bf16")(z, t, y)
        args = argparse.Namespace(compile="false", guidance=1.0)
        net, capture = sampling.sampling_network(args, model, mc, torch.device("cpu"), "bf16")
        got = net(z, t, y)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    stored = torch.float32 if mp else torch.bfloat16
    assert {m.weight.dtype for m in convs} == {stored} == {model.time_mlp[0].weight.dtype}
    # not cast by autocast
    assert model.norm_out.weight.dtype == model.class_emb.weight.dtype == torch.float32
    assert not capture.compiled and want.abs().mean() > 0.01
    assert torch.equal(got, want)


def test_a_compiled_step_draws_the_eager_images_to_bf16_rounding(run_dir, tmp_path):
    """--compile captures each guided sampler step whole (one graph: a short last batch is padded to --batch,
    not compiled again); the images match the eager ones to bf16's rounding, and the padding is not
    counted."""
    import torch

    runs, graphs = {}, torch._dynamo.utils.counters["stats"]
    for mode in ("false", "default"):
        before = graphs["unique_graphs"]
        runs[mode] = sample.main(["--ckpt", str(run_dir / "ema.pt"), "--n", "6", "--batch", "4", "--sampler",
                                  "ddim", "--steps", "4", "--guidance", "2", "--compile", mode,
                                  "--out", str(tmp_path / f"{mode}.png")])
        runs[mode]["graphs"] = graphs["unique_graphs"] - before
    assert (runs["false"]["graphs"], runs["default"]["graphs"]) == (0, 1)
    assert runs["default"]["compile"] == "default" and runs["false"]["compile"] == "false"
    assert runs["default"]["nfe_per_image"] == runs["false"]["nfe_per_image"] == 8
    eager, compiled = (np.load(tmp_path / f"{mode}.npz")["arr_0"].astype(int) for mode in ("false",
                                                                                           "default"))
    diff = np.abs(eager - compiled)
    assert diff.max() <= 2 and (diff > 0).mean() < 0.02 and eager.std() > 10

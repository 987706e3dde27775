"""GPU-only checks; skipped cleanly without CUDA. scripts/gpu_bench.sh runs them on a GPU."""
import dataclasses
import json

import pytest
import torch
from conftest import tiny_model, tiny_trainer

import ddpm
from data import Loader, ResidentLoader, shapes
from ddpm import train
from machinery.mfu import StepTimer
from unet import UNet

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_bf16_compiled_training_on_the_gpu(tmp_path):
    out = tmp_path / "run"
    train(tiny_model(num_classes=4), tiny_trainer(out, device="cuda", precision="bf16", compile="true",
                                                  max_steps=20),
          preset="test")
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert rows[-1]["loss"] < rows[0]["loss"] and rows[-1]["img_per_s"] > 0
    cfg = json.load(open(out / "config.json"))
    assert cfg["resolved"]["precision"] == "bf16" and cfg["resolved"]["peak_flops_per_device"] > 0


def test_sdpa_matches_math_in_bf16_on_the_gpu():
    mc = tiny_model(attn_heads=2, attn_resolutions=(16, 8))
    a = UNet(mc, attention="sdpa").cuda().eval()
    for p in a.parameters():
        torch.nn.init.normal_(p, 0, 0.05)
    b = UNet(mc, attention="math").cuda().eval()
    b.load_state_dict(a.state_dict())
    x, t = torch.randn(4, 3, 16, 16, device="cuda"), torch.tensor([1, 10, 50, 99], device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        torch.testing.assert_close(a(x, t).float(), b(x, t).float(), rtol=5e-2, atol=5e-2)


def test_cuda_event_timer():
    timer = StepTimer("cuda")
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(3):
        timer.start()
        x @ x
        timer.stop()
    ms = timer.read_ms()
    assert len(ms) == 3 and all(m > 0 for m in ms)


def test_ffcv_loader_on_the_gpu(tmp_path):
    pytest.importorskip("ffcv")
    from data import FFCVLoader, shapes
    from machinery.beton import write_beton

    images, labels, _ = shapes(64, 16)
    write_beton(images, labels, str(tmp_path / "s.beton"))
    x, y = FFCVLoader(str(tmp_path / "s.beton"), 16, 0, "cuda", with_labels=True).next()
    assert x.device.type == "cuda" and x.shape == (16, 3, 16, 16) and y.device.type == "cuda"


@pytest.mark.parametrize("loader_cls", [Loader, ResidentLoader])
def test_the_training_step_never_syncs_with_the_host(loader_cls):
    """Data, forward, backward, clipping, the non-finite check, AdamW and the EMA: all queued, no host
    sync."""
    mc, tc = tiny_model(num_classes=4), ddpm.TrainerConfig(batch_size=8)
    b = ddpm.build(mc, dataclasses.replace(tc, compile="false", channels_last="true"), torch.device("cuda"))
    model, ema, diffusion, opt = b.model, b.ema, b.diffusion, b.opt
    images, labels, _ = shapes(64, 16)
    loader = loader_cls(images, labels, 8, 0, "cuda", with_labels=True)
    for step in range(4):
        if step == 1:  # the first step allocates the optimizer state
            torch.cuda.set_sync_debug_mode("error")
        try:
            x0, y = loader.next()
            out = ddpm.train_step(model, diffusion, opt, x0, y, "bf16", 1.0, channels_last=True)
            ddpm.ema_update(ema, model, 0.999, out.ok)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out.loss) and out.ok.item() == 1


@pytest.mark.parametrize("mode", ["reduce-overhead"])
def test_cuda_graph_training(tmp_path, mode):
    out = tmp_path / "run"
    train(tiny_model(), tiny_trainer(out, device="cuda", precision="bf16", compile="true", compile_mode=mode,
                                     loader="resident", max_steps=12), preset="test")
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_graphed_sampling_draws_the_eager_images_on_the_gpu(run_dir, tmp_path):
    """sample.py --compile reduce-overhead replays each sampler step as CUDA graphs: DPM-Solver++ keeps the
    last step's x̂₀ across a replay (the outputs are copied), guided, with a short last batch padded; the
    images match eager ones to bf16's rounding. --batch 0 fills the GPU: here all --n images in one batch."""
    import numpy as np

    import sample

    runs = {}
    for mode in ("false", "reduce-overhead"):
        runs[mode] = sample.main(["--ckpt", str(run_dir / "ema.pt"), "--device", "cuda", "--n", "6",
                                  "--batch", "4", "--sampler", "dpm++", "--steps", "5", "--guidance", "2",
                                  "--compile", mode, "--out", str(tmp_path / f"{mode}.png")])
    assert runs["reduce-overhead"]["compile"] == "reduce-overhead"
    assert runs["reduce-overhead"]["nfe_per_image"] == runs["false"]["nfe_per_image"] == 10
    eager, graphed = (np.load(tmp_path / f"{mode}.npz")["arr_0"].astype(int) for mode in runs)
    diff = np.abs(eager - graphed)
    assert diff.max() <= 2 and (diff > 0).mean() < 0.02 and eager.std() > 10
    auto = sample.main(["--ckpt", str(run_dir / "ema.pt"), "--device", "cuda", "--n", "6", "--steps", "2",
                        "--out", str(tmp_path / "auto.png")])
    assert auto["batch"] == 6 and auto["compile"] == "reduce-overhead"

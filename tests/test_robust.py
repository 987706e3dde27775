"""Round 2 of hostile input: every numeric field in range, one run per folder, runs that end and keep their
checkpoint, verified betons, every image mode, honest figures. Each fault injected, each promise checked."""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import ROOT, TINY_ARGS, nan_after, one_line_error, read_metrics, tiny_model, tiny_trainer

import benchmark
import data
import evaluate
import ddpm
import sample
from ddpm import ModelConfig, TrainerConfig, parse_args, train
from machinery import beton, checkpoints, files, group, runs
from machinery.errors import UserError
from unet import UNet


# ---- every numeric field is range-checked, NaN and inf included

def test_every_numeric_field_has_a_range():
    for cls in (ModelConfig, TrainerConfig):
        for f in dataclasses.fields(cls):
            if type(f.default) in (int, float):
                assert "range" in f.metadata, f"{cls.__name__}.{f.name} has no range: declare it ranged"


def test_a_range_beside_its_field_is_what_validate_checks():
    mc = ModelConfig(dropout=1.0)  # dropout = ranged(0.1, 0, 1): 1 is outside [0, 1)
    with pytest.raises(UserError, match=r"dropout=1.0: must be in \[0, 1\)"):
        ddpm.validate(mc, TrainerConfig())
    with pytest.raises(UserError, match="sampler='nope': choose one of ddpm, ddim"):
        ddpm.validate(ModelConfig(), TrainerConfig(sampler="nope"))


@pytest.mark.parametrize("arg", ["--lr=-1", "--lr=nan", "--lr=inf", "--adam_beta1=1.5", "--adam_beta2=nan",
                                 "--weight_decay=-1", "--min_snr_gamma=-1", "--guidance=nan",
                                 "--sample_every_steps=-1", "--num_workers=-1", "--max_steps=-1",
                                 "--shapes_count=0", "--num_samples=-1", "--channel_mult=1,0.001",
                                 "--seed=1180591620717411303424", "--grad_clip=inf", "--dropout=nan",
                                 "--beta_end=inf", "--channel_mult=1,nan", "--base_channels=2"])
def test_out_of_range_values_are_refused(arg):
    with pytest.raises(UserError, match=arg[2:].split("=")[0].replace("channel_mult", "channel_mult")):
        parse_args([arg])


def test_a_device_this_machine_lacks_is_one_line():
    for name in ("mps", "cuda:7") if not torch.cuda.is_available() else ("mps",):
        with pytest.raises(UserError, match=f"--device={name}"):
            group.resolve_device(name)


# ---- runs end, and always keep their checkpoint

def test_resuming_past_max_steps_stops_at_once(tmp_path, capsys):
    train(tiny_model(), tiny_trainer(tmp_path, max_steps=4), preset="test")
    before = (tmp_path / "ckpt.pt").read_bytes()
    train(tiny_model(), tiny_trainer(tmp_path, max_steps=2, resume=True), preset="test")
    assert "nothing to train" in capsys.readouterr().out
    assert (tmp_path / "ckpt.pt").read_bytes() == before


def test_no_grids_still_writes_the_final_checkpoint(tmp_path):
    train(tiny_model(), tiny_trainer(tmp_path, max_steps=3, num_samples=0), preset="test")
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 3 and (tmp_path / "ema.pt").exists()
    assert not [f for f in os.listdir(tmp_path) if f.startswith("samples_")]


def test_a_folder_named_like_a_checkpoint(tmp_path):
    out = tmp_path / "w" / "v1.pt_runs"
    train(tiny_model(), tiny_trainer(out, max_steps=2, ckpt_every_steps=1), preset="test")
    assert {f for f in os.listdir(out) if ".pt" in f} == {"ckpt.pt", "ckpt.prev.pt", "ema.pt"}
    prev = checkpoints.previous_path(os.path.join("runs", "v1.pt", "ckpt.pt"))
    assert prev == os.path.join("runs", "v1.pt", "ckpt.prev.pt")


def test_grids_before_the_first_log_line(tmp_path):
    train(tiny_model(), tiny_trainer(tmp_path, max_steps=2, sample_every_steps=1, log_every_steps=5),
          preset="test")
    assert (tmp_path / "samples_0000001.png").exists() and (tmp_path / "loss.png").exists()


# ---- one run per folder

def test_a_second_run_on_the_same_folder_is_refused(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    try:
        tmp_path.mkdir(exist_ok=True)
        lock = {"host": runs.platform.node(), "pid": owner.pid, "token": "x", "since": "now"}
        (tmp_path / "run.lock").write_text(json.dumps(lock))
        with pytest.raises(UserError, match=f"in use by another run \\(pid {owner.pid}"):
            train(tiny_model(), tiny_trainer(tmp_path, max_steps=1), preset="test")
        assert not (tmp_path / "config.json").exists() and not (tmp_path / "metrics.jsonl").exists()
        # cannot be checked: refused
        (tmp_path / "run.lock").write_text(json.dumps({**lock, "host": "another-host"}))
        with pytest.raises(UserError, match="on another-host"):
            train(tiny_model(), tiny_trainer(tmp_path, max_steps=1), preset="test")
    finally:
        owner.kill()
        owner.wait()
    (tmp_path / "run.lock").write_text(json.dumps(lock))  # its process has ended: stale, taken over
    train(tiny_model(), tiny_trainer(tmp_path, max_steps=1), preset="test")
    assert not (tmp_path / "run.lock").exists()  # released at the end


def test_a_run_started_beside_a_live_one_is_refused(tmp_path):
    first = subprocess.Popen([sys.executable, "ddpm.py", *TINY_ARGS, "--loader=torch", "--max_steps=100000",
                              "--log_every_steps=1", f"--out_dir={tmp_path}"], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 1800  # a hang guard
        while time.time() < deadline and not (tmp_path / "metrics.jsonl").exists():
            time.sleep(0.2)
        with pytest.raises(UserError, match=f"in use by another run \\(pid {first.pid} on "):
            train(tiny_model(), tiny_trainer(tmp_path, max_steps=1), preset="test")
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=1800) == 0, first.stderr.read()
    assert not (tmp_path / "run.lock").exists()


# ---- messages that are true

def test_weights_that_overflow_never_overwrite_a_checkpoint(tmp_path, monkeypatch):
    real, calls = ddpm.train_step, []

    def poisoned(model, *args, **kw):
        out = real(model, *args, **kw)
        calls.append(1)
        if len(calls) == 3:  # a finite step whose update overflows the weights (as a huge lr can)
            with torch.no_grad():
                next(model.parameters()).fill_(float("inf"))
        return out

    monkeypatch.setattr(ddpm, "train_step", poisoned)
    with pytest.raises(UserError, match="no longer finite at step 4.*left as it was"):
        train(tiny_model(), tiny_trainer(tmp_path, max_steps=6, ckpt_every_steps=2, max_nonfinite_steps=100),
              preset="test")
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ckpt["step"] == 2 and all(torch.isfinite(v).all() for v in ckpt["model"].values())
    assert not (tmp_path / "run.lock").exists()


def test_a_skipped_step_does_not_blank_its_intervals_loss(tmp_path, monkeypatch):
    nan_after(monkeypatch, 1, 1)
    train(tiny_model(), tiny_trainer(tmp_path, max_steps=5, log_every_steps=5), preset="test")
    row = read_metrics(tmp_path)[0]
    assert row["nonfinite_skipped"] == 1 and row["loss"] is not None and np.isfinite(row["loss"])
    assert all(row[f"loss_q{q}"] is None or np.isfinite(row[f"loss_q{q}"]) for q in range(4))


# ---- the other command lines

@pytest.fixture(scope="module")
def ema_pt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "ema.pt"
    mc = tiny_model()
    torch.save({"ema": UNet(mc).state_dict(), "model_config": dataclasses.asdict(mc)}, path)
    return str(path)


@pytest.mark.parametrize("extra,needle", [
    (["--guidance", "nan"], "guidance=nan: must be in [0, 100]"), (["--eta", "-1"], "eta=-1.0: must be"),
    (["--percentile", "2"], "percentile=2.0: must be in [1e-06, 1]"), (["--seed", "-1"], "seed=-1: must be"),
    (["--out", "{d}/grid"], "image extension"),
    (["--out", "{d}/file/grid.png"], "cannot make the folder"),
])
def test_sample_cli_refuses_before_sampling(tmp_path, capsys, ema_pt, extra, needle):
    (tmp_path / "file").write_text("a file, not a folder")
    err = one_line_error(capsys, sample.main, ["--ckpt", ema_pt, "--steps", "2",
                                               *[a.format(d=tmp_path) for a in extra]])
    assert needle in err


@pytest.mark.parametrize("argv,needle", [
    (["--dataset=shapes", "--image_size=0", "--out=x.beton"], "--image_size 0"),
    (["--dataset=shapes", "--shapes_count=0", "--out=x.beton"], "--shapes_count 0"),
    (["--dataset=shapes", "--shapes_count=8", "--out=/dev/full"], "not a regular file"),
])
def test_data_cli_refuses_in_one_line(capsys, argv, needle):
    assert needle in one_line_error(capsys, data.main, argv)


@pytest.mark.parametrize("argv,needle", [(["--iters=-1"], "--iters -1"), (["--batch=-2"], "--batch -2"),
                                         (["--json=/no/such/folder/x.json"], "cannot write there"),
                                         (["--loaders=/no/such/folder"], "does not exist"),
                                         (["--loaders=.", "--loader_batch=0"], "--loader_batch 0")])
def test_benchmark_cli_refuses_in_one_line(capsys, argv, needle):
    assert needle in one_line_error(capsys, benchmark.main, ["--device=cpu", *argv])


# ---- data that is what it says

needs_ffcv = pytest.mark.skipif(not beton.ffcv_available(), reason="ffcv is not installed")


@needs_ffcv
@pytest.mark.parametrize("damage,needle", [
    ("middle", "does not match the checksum"), ("tail", "does not match the checksum"),
    ("truncate", "bytes, not the"), ("resolution", "holds 16px images, not 32px"),
])
def test_a_damaged_or_replaced_beton_is_one_line(tmp_path, damage, needle):
    betons = str(tmp_path)
    path, _ = data.beton_for("shapes", "", 16, betons, shapes_count=64)
    size = os.path.getsize(path)
    if damage == "resolution":  # a 16 px beton placed under the 32 px name, with its metadata
        other = os.path.join(betons, data.beton_name("shapes", "", 32, 64, True))
        os.replace(path, other)
        os.replace(path + ".json", other + ".json")
        path, res = other, 32
    else:
        res = 16
        with open(path, "r+b") as f:
            if damage == "truncate":
                f.truncate(size - 100)
            else:
                f.seek(size // 2 if damage == "middle" else size - 10)
                byte = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(UserError, match=needle):
        data.beton_for("shapes", "", res, betons, shapes_count=64)


@needs_ffcv
def test_beton_writing_on_a_full_disk_fails_at_once_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    images, labels, _ = data.shapes(64, 16)
    monkeypatch.setattr(files.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
    with pytest.raises(UserError, match=r"needs about 1\.\d MiB in .* and 0\.0 MiB are free: nothing was"):
        beton.write_verified_beton(images, labels, 4, str(tmp_path / "x.beton"))
    monkeypatch.undo()
    import ffcv.writer

    def interrupted(self, dataset, *a, **kw):  # SIGTERM half-way through the write
        with open(self.fname, "wb") as f:
            f.write(b"partial")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)

    monkeypatch.setattr(ffcv.writer.DatasetWriter, "from_indexed_dataset", interrupted)
    with pytest.raises(KeyboardInterrupt):
        beton.write_verified_beton(images, labels, 4, str(tmp_path / "x.beton"))
    assert os.listdir(tmp_path) == []


def test_every_image_mode_converts_to_8_bit_rgb():
    from PIL import Image

    gray16 = Image.fromarray(np.full((4, 4), 32768, np.uint16))  # mid-grey in 16 bits
    assert gray16.mode.startswith("I;16")
    palette = Image.new("P", (4, 4), 1)
    palette.putpalette([0, 0, 0, 200, 200, 200])
    cases = {
        "I;16": (gray16, 128), "I": (gray16.convert("I"), 128),
        "F": (Image.fromarray(np.full((4, 4), 0.5, np.float32)), 128),
        "L": (Image.new("L", (4, 4), 200), 200), "LA": (Image.new("LA", (4, 4), (200, 10)), 200),
        "P": (palette, 200),
        "RGBA": (Image.new("RGBA", (4, 4), (200, 200, 200, 0)), 200), "1": (Image.new("1", (4, 4), 1), 255),
        "CMYK": (Image.new("RGB", (4, 4), (200, 200, 200)).convert("CMYK"), 200),
    }
    for mode, (im, value) in cases.items():
        out = data.to_rgb8(im)
        assert out.shape == (4, 4, 3) and out.dtype == np.uint8, mode
        assert abs(int(out[0, 0, 0]) - value) <= 1, (mode, out[0, 0])


def test_a_dataset_smaller_than_the_global_batch_is_refused(monkeypatch):
    images, labels, _ = data.shapes(24, 16)
    data.Loader(images, labels, 12, 0, "cpu")  # 24 images, one process: fine
    monkeypatch.setattr(group, "rank_world", lambda: (0, 4))  # 4 ranks of 12: a global batch of 48
    with pytest.raises(UserError, match="global batch of 48 images exceeds the dataset's 24"):
        data.Loader(images, labels, 12, 0, "cpu")


def test_an_out_dir_through_a_file_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="--out_dir=.*cannot make it"):
        train(tiny_model(), tiny_trainer(tmp_path / "file" / "run", max_steps=1), preset="test")


def test_a_damaged_fid_statistics_cache_is_computed_again(tmp_path, capsys):
    """A cache is a cache (issue 53): one written by hand (no checksum, no settings) or cut short is computed
    again, with a note, and replaced."""
    from test_fid import TinyFeatures

    ref = {"mu": np.zeros(16), "sigma": np.eye(16), "features": np.zeros((2, 16)), "n": np.array(2)}
    path = tmp_path / (data.beton_name("shapes", "", 16, 64, True).replace(".beton", "-tiny.npz"))
    np.savez(path, **ref)
    extractor = TinyFeatures()

    def stats():
        return evaluate.reference_stats(extractor, "shapes", "", 16, 64, "cpu", cache_dir=str(tmp_path))

    assert stats()["n"] == 64
    assert extractor.calls > 0 and "computed again" in capsys.readouterr().out
    path.write_bytes(path.read_bytes()[:100])
    assert stats()["n"] == 64
    assert "computed again" in capsys.readouterr().out
    calls = extractor.calls
    evaluate.reference_stats(extractor, "shapes", "", 16, 64, "cpu", cache_dir=str(tmp_path))
    assert extractor.calls == calls  # the rewritten cache is read

"""Scale-out and survival: 2 gloo processes equal 1, preemption, checkpoint fallback, non-finite steps,
a full disk and other bad input: each ends in one clear line and never loses a checkpoint."""
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, TINY_ARGS, nan_after, one_line_error, read_metrics, tiny_model, tiny_trainer

import data
import ddpm
from ddpm import train
from machinery import beton, checkpoints
from machinery.errors import UserError
from unet import UNet

TINY = TINY_ARGS
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # two processes on two cores


def cli(*args, launcher=(sys.executable,), env=ENV, **kw):
    return subprocess.run([*launcher, "ddpm.py", *TINY, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1800, **kw)


def weights(run):
    return torch.load(os.path.join(run, "ckpt.pt"), weights_only=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_processes_with_accumulation_equal_one_with_the_same_global_batch(tmp_path):
    # FFCV in its distributed mode where it is installed
    loader = "ffcv" if beton.ffcv_available() else "torch"
    common = ["--num_classes=4", "--batch_size=16", "--max_steps=4", "--log_every_steps=2",
              f"--loader={loader}",
              # grids and bits/dim, split across ranks
              f"--beton_dir={tmp_path / 'betons'}", "--sample_every_steps=2",
              "--eval_every_steps=2", "--eval_fid_samples=0", "--eval_bpd_images=12", "--eval_bpd_strata=2"]
    # in this process; the pair under torchrun below
    ddpm.main([*TINY, *common, f"--out_dir={tmp_path / 'one'}"])
    # and each rank's 8 images as 2 micro-batches of 4 (DDP's no_sync on the first): still the same training
    two = cli(*common, "--grad_accum_steps=2", f"--out_dir={tmp_path / 'two'}", launcher=(
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
        "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}"))
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert b["world_size"] == 2 and b["step"] == 4
    # The same training to float tolerance. Compared per element, parameters whose true gradient is ~0 differ:
    # Adam turns float-rounding noise in such a gradient into an lr-sized step of either sign. So the
    # check is on the whole update: the two runs' weights differ by < 1% of how far training moved them.
    mc, _, _ = ddpm.parse_args(TINY + ["--num_classes=4"])
    torch.manual_seed(0)
    init = torch.cat([v.flatten() for v in UNet(mc).state_dict().values()])
    for part in ("model", "ema"):
        wa, wb = (torch.cat([w[part][k].flatten() for k in w[part]]) for w in (a, b))
        assert (wa - wb).norm() < 0.01 * (wa - init).norm(), part
    rows_a, rows_b = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [r["step"] for r in rows_b] == [2, 4]  # one writer
    evals = read_metrics(tmp_path / "two", "bpd")
    assert [(r["step"], r["bpd_images"]) for r in evals] == [(2, 12),
                                                             (4, 12)] and all(r["bpd"] > 0 for r in evals)
    assert sorted(f for f in os.listdir(tmp_path / "two") if f.startswith("samples_")) == [
        "samples_0000002.png", "samples_0000004.png"]
    for ra, rb in zip(rows_a, rows_b):  # the logged loss is the global batch's, all-reduced
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-4)
    assert json.load(open(tmp_path / "two" / "config.json"))["resolved"]["world_size"] == 2


def wait_for_metrics(run, lines):
    metrics, deadline = run / "metrics.jsonl", time.time() + 1800  # hang guard
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < lines):
        time.sleep(0.2)


def endless_torchrun(run):
    """2 gloo workers training until they are stopped; returned once they have logged 2 steps."""
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
                          "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", "ddpm.py", *TINY,
                          "--batch_size=8", "--loader=torch", "--log_every_steps=1", "--max_steps=100000",
                          f"--out_dir={run}"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    wait_for_metrics(run, 2)
    return p


def test_sigterm_to_one_rank_stops_both_after_the_same_step(tmp_path):
    """Preemption reaches one worker: the ranks agree (gloo all-reduce), both stop, rank 0 saves, torchrun
    exits 0."""
    run = tmp_path / "run"
    p = endless_torchrun(run)
    workers = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2
    os.kill(int(workers[-1]), signal.SIGTERM)  # one of them only
    out, err = p.communicate(timeout=1800)
    assert p.returncode == 0, err[-3000:]
    assert "stopped by" in out and "Traceback" not in err
    ckpt = weights(run)
    assert ckpt["world_size"] == 2 and ckpt["step"] >= 2
    assert read_metrics(run)[-1]["step"] <= ckpt["step"]


def test_sigterm_to_the_torchrun_launcher_saves_and_resume_continues(tmp_path):
    """What a cluster scheduler sends: torchrun forwards SIGTERM to the workers, which stop after the same
    step with a checkpoint; torchrun itself then exits non-zero with its own SignalException traceback (its
    behaviour, not a failed save: README). The checkpoint is complete and --resume continues it."""
    run = tmp_path / "run"
    p = endless_torchrun(run)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=1800)
    assert "stopped by SIGTERM" in out and "checkpoint saved" in out, err[-3000:]
    stopped = weights(run)
    assert stopped["world_size"] == 2 and stopped["step"] >= 2 and not (run / "run.lock").exists()
    ddpm.main([*TINY, "--batch_size=8", "--loader=torch", f"--max_steps={stopped['step'] + 2}",
               f"--out_dir={run}", "--resume"])
    assert weights(run)["step"] == stopped["step"] + 2


def test_batch_size_must_divide_by_the_world_size(tmp_path, capsys, monkeypatch):
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    err = one_line_error(capsys, ddpm.main, [*TINY, "--batch_size=15", f"--out_dir={tmp_path / 'run'}"])
    assert "batch_size 15 does not divide by the 2 processes" in err


def test_sigterm_saves_then_resume_is_bitwise_a_straight_run(tmp_path):
    run, straight = tmp_path / "run", tmp_path / "straight"
    args = ["--batch_size=8", "--log_every_steps=1", "--warmup_steps=0", "--loader=torch"]
    p = subprocess.Popen([sys.executable, "ddpm.py", *TINY, *args, "--max_steps=100000", f"--out_dir={run}"],
                         cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_metrics(run, 3)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=1800)
    assert p.returncode == 0, err
    assert "stopped by SIGTERM" in out and "Traceback" not in err
    stopped = weights(run)["step"]
    assert 3 <= stopped < 100000

    # every run in a fresh process of its own, as a cluster would start them (two side by side, one core each)
    procs = [subprocess.Popen([sys.executable, "ddpm.py", *TINY, *args, f"--max_steps={stopped + 3}", *extra],
                              cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for extra in ([f"--out_dir={run}", "--resume"], [f"--out_dir={straight}"])]
    for q in procs:
        assert q.wait(timeout=1800) == 0, q.stderr.read()
    a, b = weights(straight), weights(run)
    assert a["step"] == b["step"] == stopped + 3
    for part in ("model", "ema"):
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), (part, k)
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"]) and a["loader"] == b["loader"]


def test_a_corrupt_checkpoint_falls_back_to_the_previous_good_one(tmp_path, capsys):
    out = tmp_path / "run"
    train(tiny_model(), tiny_trainer(out, max_steps=4, ckpt_every_steps=2), preset="test")
    assert torch.load(out / "ckpt.prev.pt", weights_only=True)["step"] == 2  # the last good one is kept
    good = (out / "ckpt.pt").read_bytes()
    (out / "ckpt.pt").write_bytes(good[: len(good) // 3])  # truncated
    train(tiny_model(), tiny_trainer(out, max_steps=6, resume=True), preset="test")
    said = capsys.readouterr().out
    assert "cannot read checkpoint" in said and "resuming from the previous checkpoint" in said
    assert "at step 2" in said and weights(out)["step"] == 6


def test_checkpoints_load_with_weights_only(tmp_path):
    out = tmp_path / "run"
    train(tiny_model(), tiny_trainer(out, max_steps=2), preset="test")
    for name in ("ckpt.pt", "ema.pt"):
        # raises if anything but tensors and plain containers is inside
        torch.load(out / name, weights_only=True)
    evil = tmp_path / "evil.pt"
    torch.save({"x": object()}, evil)  # a pickle that weights_only refuses
    with pytest.raises(UserError, match="cannot read checkpoint"):
        checkpoints.load_checkpoint(str(evil), "cpu")


def test_non_finite_steps_are_skipped_and_counted(tmp_path, monkeypatch):
    nan_after(monkeypatch, 2, 3)
    out = tmp_path / "run"
    train(tiny_model(), tiny_trainer(out, max_steps=6, log_every_steps=1), preset="test")
    rows = read_metrics(out)
    assert [r["nonfinite_skipped"] for r in rows] == [0, 0, 1, 1, 0, 0]
    assert rows[2]["loss"] is None and rows[4]["loss"] is not None
    ckpt = weights(out)
    assert ckpt["nonfinite_skipped"] == 2
    # AdamW took 4 of the 6 steps
    assert all(s["step"].item() == 4 for s in ckpt["optimizer"]["state"].values())
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())


def test_k_consecutive_non_finite_steps_stop_the_run_and_keep_the_checkpoint(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    train(tiny_model(), tiny_trainer(out, max_steps=2), preset="test")
    before = (out / "ckpt.pt").read_bytes()
    nan_after(monkeypatch, 0)
    with pytest.raises(SystemExit) as e:
        ddpm.main([*TINY, "--shapes_count=512", "--loader=torch", "--batch_size=16", "--warmup_steps=5",
                   "--ema_decay=0.99", "--log_every_steps=1", "--max_steps=50", "--max_nonfinite_steps=3",
                   f"--out_dir={out}", "--resume"])
    assert e.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: 3 consecutive steps had a non-finite loss or gradient")
    assert (out / "ckpt.pt").read_bytes() == before


def test_a_full_disk_never_loses_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    train(tiny_model(), tiny_trainer(out, max_steps=2), preset="test")
    before = (out / "ckpt.pt").read_bytes()
    real_save = torch.save

    def full_disk(obj, f, *args, **kw):
        real_save(obj, f, *args, **kw)
        f.truncate(100)  # part of the file made it to disk, then the disk filled up
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(UserError, match="No space left on device.*previous checkpoint is intact"):
        train(tiny_model(), tiny_trainer(out, max_steps=4, resume=True), preset="test")
    assert (out / "ckpt.pt").read_bytes() == before
    assert not [f for f in os.listdir(out) if ".tmp" in f]


def test_a_corrupt_beton_is_one_line(tmp_path, capsys):
    if not beton.ffcv_available():
        pytest.skip("ffcv is not installed")
    betons = tmp_path / "betons"
    path, _ = data.beton_for("shapes", "unused", 16, str(betons), shapes_count=256)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    err = one_line_error(capsys, ddpm.main, [*TINY, "--batch_size=8", "--max_steps=2", "--loader=ffcv",
                                             f"--beton_dir={betons}", f"--out_dir={tmp_path / 'run'}"])
    assert "corrupt or replaced" in err and "delete it" in err


@pytest.mark.parametrize("make,needle", [
    (lambda d: d.mkdir(), "holds no images"),
    (lambda d: (d.mkdir(), (d / "a.png").write_bytes(b"not a png")), "could be read"),
    (lambda d: None, "does not exist"),
])
def test_empty_or_unreadable_image_folders_are_one_line(tmp_path, capsys, make, needle):
    folder = tmp_path / "images"
    make(folder)
    err = one_line_error(capsys, ddpm.main, [*TINY, "--dataset=folder", f"--data_dir={folder}",
                                             "--loader=torch", f"--out_dir={tmp_path / 'run'}"])
    assert needle in err

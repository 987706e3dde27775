"""Survive round 3, the run folder's side: files the run does not own (links, FIFOs), cut metrics lines, stale
locks, and one true line for every OS error."""
import errno
import json
import os
import time

import pytest
import torch
from conftest import TINY_ARGS, one_line_error, read_metrics, tiny_model, tiny_trainer

import ddpm
import sample
from ddpm import train
from machinery import files, runs
from machinery.errors import UserError

OUTPUTS = ["ckpt.pt", "ema.pt", "ckpt.prev.pt", "config.json", "loss.png", "samples_0000002.png",
           "samples_0000004.png", "run.lock"]


def plant_links(out, names):
    victim = out.parent / "victim.txt"
    victim.write_text("precious")
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        os.symlink(victim, out / name)
    return victim


def test_links_planted_at_the_run_outputs_are_replaced_never_followed(tmp_path):
    out = tmp_path / "run"
    victim = plant_links(out, OUTPUTS)
    os.remove(out / "ckpt.pt")  # a folder with a checkpoint needs --resume; the first run writes it afresh
    train(tiny_model(), tiny_trainer(out, max_steps=4, sample_every_steps=2, ckpt_every_steps=2,
                                     log_every_steps=2),
          preset="test")
    assert victim.read_text() == "precious"
    for name in ["ckpt.pt", "ema.pt", "config.json", "loss.png", "samples_0000002.png",
                 "samples_0000004.png"]:
        assert files.is_regular(out / name), name
    assert files.is_regular(out / "ckpt.prev.pt")  # the step-2 checkpoint, not the link
    # and a resumed run into the same folder, links planted again at every file it writes
    for name in ["ckpt.prev.pt", "ema.pt", "loss.png"]:
        os.remove(out / name)
        os.symlink(victim, out / name)
    os.symlink(victim, out / "config-resume-4.json")
    train(tiny_model(), tiny_trainer(out, max_steps=6, resume=True, sample_every_steps=2, ckpt_every_steps=2,
                                     log_every_steps=2), preset="test")
    assert victim.read_text() == "precious"
    assert all(files.is_regular(out / n) for n in ["ckpt.prev.pt", "ema.pt", "loss.png",
                                                   "config-resume-4.json"])


@pytest.mark.parametrize("make", ["symlink", "fifo"])
def test_metrics_jsonl_that_is_not_a_regular_file_is_refused_in_one_line(tmp_path, capsys, make):
    out = tmp_path / "run"
    victim = plant_links(out, [])
    if make == "symlink":
        os.symlink(victim, out / "metrics.jsonl")
    else:
        os.mkfifo(out / "metrics.jsonl")
    err = one_line_error(capsys, ddpm.main, [*TINY_ARGS, "--loader=torch", "--max_steps=2",
                                             f"--out_dir={out}"])
    assert "metrics.jsonl is not a regular file" in err
    assert victim.read_text() == "precious" and not (out / "run.lock").exists()


def test_a_fifo_in_place_of_a_checkpoint_never_blocks(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    os.mkfifo(out / "ckpt.pt")
    err = one_line_error(capsys, ddpm.main, [*TINY_ARGS, "--loader=torch", "--max_steps=2",
                                             f"--out_dir={out}", "--resume"])
    assert "no checkpoint at" in err  # a FIFO is no checkpoint of this folder
    err = one_line_error(capsys, sample.main, ["--ckpt", str(out / "ckpt.pt"), "--out",
                                               str(tmp_path / "g.png")])
    assert "cannot read checkpoint" in err and "not a regular file" in err


def test_a_cut_last_metrics_line_is_ended_on_resume_and_skipped_by_readers(tmp_path, capsys):
    out = tmp_path / "run"
    train(tiny_model(), tiny_trainer(out, max_steps=4, log_every_steps=2), preset="test")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 0.')  # kill -9 in the middle of a write
    rows, bad = runs.read_metrics(out)
    assert [r["step"] for r in rows] == [2, 4] and bad == 1
    capsys.readouterr()
    train(tiny_model(), tiny_trainer(out, max_steps=8, log_every_steps=2, resume=True, sample_every_steps=4),
          preset="test")
    assert "was cut short" in capsys.readouterr().out
    rows, bad = runs.read_metrics(out)
    assert [r["step"] for r in rows] == [2, 4, 6, 8] and bad == 1
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert lines[2] == '{"step": 5, "loss": 0.' and json.loads(lines[3])["step"] == 6  # not glued on
    assert (out / "loss.png").exists()


def test_metrics_rows_are_single_whole_writes(tmp_path, monkeypatch):
    writes = []
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, b: writes.append(bytes(b)) or real(fd, b))
    files.append_line(str(tmp_path / "m.jsonl"), json.dumps({"step": 1, "loss": 0.5}))
    assert writes == [b'{"step": 1, "loss": 0.5}\n']


@pytest.mark.parametrize("content", [b"", b"\x00\xff\xfe binary", b'{"host": "h", "pid": 12',
                                     b'{"host": "h", "pid": -1}',
                                     b'{"host": "h", "pid": 0}', b"[1, 2]", b'{"host": "h", "pid": true}'])
@pytest.mark.parametrize("age_s", [0, 3600])
def test_a_lock_that_cannot_be_parsed_or_names_no_process_is_stale(tmp_path, capsys, content, age_s):
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.lock").write_bytes(content.replace(b'"h"', json.dumps(runs.platform.node()).encode()))
    os.utime(out / "run.lock", (time.time() - age_s,) * 2)
    capsys.readouterr()
    train(tiny_model(), tiny_trainer(out, max_steps=1), preset="test")
    assert "taking over the stale lock" in capsys.readouterr().out
    assert not (out / "run.lock").exists()


def test_a_lock_nobody_touches_is_stale_whatever_host_it_names(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    lock = {"host": "another-host", "pid": os.getpid(), "token": "x", "since": "long ago"}
    (out / "run.lock").write_text(json.dumps(lock))
    with pytest.raises(UserError, match="in use by another run"):  # fresh: its owner may be alive
        train(tiny_model(), tiny_trainer(out, max_steps=1), preset="test")
    old = time.time() - runs.LOCK_STALE_S - 60
    os.utime(out / "run.lock", (old, old))
    capsys.readouterr()
    train(tiny_model(), tiny_trainer(out, max_steps=1), preset="test")
    assert "nobody has touched it" in capsys.readouterr().out


def test_a_held_lock_is_touched_by_its_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setattr(runs, "LOCK_HEARTBEAT_S", 0.05)
    lock = runs.lock_run_folder(str(tmp_path))
    try:
        old = time.time() - 3600
        os.utime(tmp_path / "run.lock", (old, old))
        for _ in range(200):  # a hang guard of 10 s at most; the heartbeat comes every 0.05 s
            if os.path.getmtime(tmp_path / "run.lock") > old + 60:
                break
            time.sleep(0.05)
        assert os.path.getmtime(tmp_path / "run.lock") > old + 60
    finally:
        runs.unlock_run_folder(lock)
    assert not (tmp_path / "run.lock").exists()


def mid_run_error(capsys, argv, code=1):
    """ddpm.main(argv) stops mid-run with one `error:` line, last on stderr after the progress bar, no
    traceback; -> that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        ddpm.main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert e.value.code == code and "Traceback" not in err and len(lines) == 1, err
    assert err.rstrip("\n").splitlines()[-1] == lines[0]
    return lines[0]


def oserror(code):
    def fail(*args, **kw):
        raise OSError(code, os.strerror(code))
    return fail


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_every_os_error_in_the_run_folder_is_one_true_line(tmp_path, capsys, monkeypatch, code):
    args = [*TINY_ARGS, "--loader=torch", "--log_every_steps=1"]
    reason = os.strerror(code)
    # the first checkpoint: there is no earlier one, and the line says so
    with monkeypatch.context() as m:
        m.setattr(torch, "save", oserror(code))
        err = mid_run_error(capsys, [*args, "--max_steps=2", f"--out_dir={tmp_path / 'a'}"])
    assert reason in err and "there is no earlier checkpoint" in err and "intact" not in err
    # metrics.jsonl
    with monkeypatch.context() as m:
        m.setattr(files.os, "write", oserror(code))
        err = mid_run_error(capsys, [*args, "--max_steps=2", f"--out_dir={tmp_path / 'b'}"])
    assert "metrics.jsonl" in err and reason in err and "no checkpoint had been written" in err
    # a grid, after a checkpoint: the line says the checkpoints are kept
    run = tmp_path / "c"
    train(tiny_model(), tiny_trainer(run, max_steps=2, num_samples=0, shapes_count=256), preset="test")
    with monkeypatch.context() as m:
        import torchvision

        m.setattr(torchvision.utils, "save_image", oserror(code))
        err = mid_run_error(capsys, [*args, "--max_steps=4", f"--out_dir={run}", "--resume",
                                     "--sample_every_steps=4"])
    assert "samples_0000004.png" in err and reason in err and "checkpoints in" in err and "intact" in err
    # the lock, in a folder that cannot be written: nothing was written
    with monkeypatch.context() as m:
        m.setattr(files, "fresh_temp", oserror(code))
        err = one_line_error(capsys, ddpm.main, [*args, "--max_steps=4", f"--out_dir={run}", "--resume"],
                             code=1)
    assert "run.lock" in err and reason in err and "nothing was written" in err
    # the grid failed after step 4's checkpoint, which was written first
    assert torch.load(run / "ckpt.pt", weights_only=True)["step"] == 4 and read_metrics(run)[-1]["step"] == 4
    assert not [f for f in os.listdir(run) if ".tmp" in f]


def test_resume_on_other_data_is_refused_unless_asked_for(tmp_path, capsys):
    out = tmp_path / "run"
    train(tiny_model(), tiny_trainer(out, max_steps=2), preset="test")
    assert torch.load(out / "ckpt.pt", weights_only=True)["data"]["shapes_count"] == 512
    args = [*TINY_ARGS, "--loader=torch", "--max_steps=4", f"--out_dir={out}", "--resume"]
    err = one_line_error(capsys, ddpm.main, [*args, "--shapes_count=300"])
    assert "the data differ from the checkpoint's (shapes_count: 512 -> 300)" in err
    assert "--resume_new_data" in err
    import numpy as np
    from PIL import Image

    (tmp_path / "images").mkdir()
    for i in range(20):
        Image.fromarray(np.full((16, 16, 3), 10 * i, np.uint8)).save(tmp_path / "images" / f"{i}.png")
    err = one_line_error(capsys, ddpm.main, [*args, "--batch_size=16", "--dataset=folder",
                                             f"--data_dir={tmp_path / 'images'}"])
    assert "dataset: 'shapes' -> 'folder'" in err
    capsys.readouterr()
    ddpm.main([*args, "--shapes_count=300", "--resume_new_data"])
    assert "a new epoch plan starts here" in capsys.readouterr().out
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == 4

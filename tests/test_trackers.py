"""TensorBoard and wandb see what metrics.jsonl records, step for step, and a resumed run continues the same
curves; a missing tracker is one line; a tracker failing mid-run is a warning, and training goes on."""
import importlib.util
import os
import subprocess
import sys

import pytest
from conftest import ROOT, TINY_ARGS, one_line_error, read_metrics, tiny_model, tiny_trainer

import ddpm
from ddpm import train
from machinery import runs


def scalars(out):
    """Every TensorBoard scalar in the run folder: {tag: {step: value}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}, acc


def test_tensorboard_scalars_match_metrics_jsonl_step_for_step_across_a_resume(tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    kw = dict(log_to="tensorboard", log_every_steps=2, sample_every_steps=4, ckpt_every_steps=4)
    train(tiny_model(), tiny_trainer(out, max_steps=4, **kw), preset="test")
    last = read_metrics(out)[-1]
    runs.log_row(str(out), {**last, "step": 5, "loss": 123.0}, runs.Trackers("tensorboard", str(out),
                 {"model": {}, "trainer": {}}, 0))  # logged after the checkpoint, then a crash
    train(tiny_model(), tiny_trainer(out, max_steps=8, resume=True, **kw), preset="test")
    tags, acc = scalars(out)
    rows = [r for r in read_metrics(out) if r["loss"] != 123.0]
    for key in ("loss", "lr", "loss_q0", "loss_q3", "grad_norm", "kimg", "nonfinite_skipped"):
        want = {r["step"]: r[key] for r in rows if r[key] is not None}  # None (not timed yet): not logged
        assert want and tags.get(f"train/{key}") == pytest.approx(want, rel=1e-6), key
    assert sorted(tags["train/loss"]) == [2, 4, 6, 8]  # one point a step: no duplicates across the resume
    images = acc.Images("samples")
    assert [e.step for e in images] == [4, 8]
    assert os.path.basename(str(out)) == "run"
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(out))


def test_evaluation_rows_go_to_the_trackers_too(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    logged = []
    real = runs.Trackers.log
    monkeypatch.setattr(runs.Trackers, "log", lambda self, row: logged.append(row) or real(self, row))
    out = tmp_path / "run"
    train(tiny_model(), tiny_trainer(out, max_steps=2, log_to="tensorboard", eval_every_steps=2,
                                     eval_fid_samples=0,
                                     eval_bpd_images=8, eval_bpd_strata=1, log_every_steps=1), preset="test")
    assert [r["step"] for r in logged if "bpd" in r] == [2]
    tags, _ = scalars(out)
    assert "eval/bpd" in tags and list(tags["eval/bpd"]) == [2]


def test_a_missing_tracker_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    err = one_line_error(capsys, ddpm.main, [*TINY_ARGS, "--loader=torch", "--max_steps=1", "--log_to=wandb",
                                             f"--out_dir={tmp_path / 'a'}"])
    assert "the wandb package is not installed" in err
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    err = one_line_error(capsys, ddpm.main, [*TINY_ARGS, "--loader=torch", "--max_steps=1",
                                             "--log_to=tensorboard", f"--out_dir={tmp_path / 'b'}"])
    assert "the tensorboard package is not installed" in err


def test_a_tracker_failing_mid_run_is_a_warning_and_training_goes_on(tmp_path, capsys, monkeypatch):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    def full(self, *args, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(SummaryWriter, "add_scalar", full)
    out = tmp_path / "run"
    train(tiny_model(), tiny_trainer(out, max_steps=6, log_to="tensorboard", log_every_steps=2),
          preset="test")
    printed = capsys.readouterr().out
    assert printed.count("warning: TensorBoard failed") == 1 and "No space left on device" in printed
    assert [r["step"] for r in read_metrics(out)] == [2, 4, 6]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed (optional)")
def test_wandb_offline_writes_its_run_files_and_resumes_the_same_run(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    for extra in ([], ["--resume", "--max_steps=4"]):
        args = [sys.executable, "ddpm.py", *TINY_ARGS, "--loader=torch", "--max_steps=2",
                "--log_every_steps=1", "--log_to=wandb", f"--out_dir={out}", *extra]
        p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        assert p.returncode == 0 and "warning" not in p.stdout, p.stdout + p.stderr  # the grid went too
    run_id = (out / "wandb-id").read_text().strip()
    starts = [out / "wandb" / s / "wandb" for s in os.listdir(out / "wandb")]  # a folder of its own a start
    assert len(starts) == 2 and all(s.parent.name.startswith("start-") for s in starts)
    folders = [s / d for s in starts for d in os.listdir(s) if d.startswith("offline-run")]
    assert folders and all(d.name.endswith(run_id) for d in folders)
    assert any(f.endswith(".wandb") for d in folders for f in os.listdir(d))


def test_wandb_without_a_login_is_one_line(tmp_path, capsys, monkeypatch):
    fake = type(sys)("wandb")
    fake.api = type("Api", (), {"api_key": None})()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    err = one_line_error(capsys, ddpm.main, [*TINY_ARGS, "--loader=torch", "--max_steps=1", "--log_to=wandb",
                                             f"--out_dir={tmp_path}"])
    assert "not logged in to wandb" in err and "WANDB_MODE=offline" in err


def test_long_commands_show_progress_on_a_terminal_only(run_dir, tmp_path, capsys, monkeypatch):
    """The bars (sampling, Inception features, bits/dim, training) are tqdm's with disable=None: drawn on a
    terminal, and silent when the output is a file or a pipe, as here."""
    import sample

    capsys.readouterr()
    sample.main(["--ckpt", str(run_dir / "ema.pt"), "--n", "4", "--batch", "2", "--steps", "2",
                 "--out", str(tmp_path / "g.png")])
    assert capsys.readouterr().err == ""
    drawn = []
    import tqdm

    real = tqdm.tqdm.__init__

    def spy(self, *args, **kw):
        drawn.append((kw.get("desc"), kw.get("disable")))
        real(self, *args, **kw)

    monkeypatch.setattr(tqdm.tqdm, "__init__", spy)
    sample.main(["--ckpt", str(run_dir / "ema.pt"), "--n", "4", "--batch", "2", "--steps", "2", "--eval",
                 "bpd", "--strata", "1", "--out", str(tmp_path / "b.png")])
    assert ("bits/dim", None) in drawn


def test_off_a_terminal_progress_comes_as_lines(run_dir, tmp_path, capsys, monkeypatch):
    """Output to a file (capsys, here): training and sampling print a progress line every
    runs.OffTerminal.EVERY_S seconds (0 here: every step and every shard) where tqdm draws nothing."""
    import sample
    from conftest import tiny_model, tiny_trainer

    from ddpm import train

    monkeypatch.setattr(runs.OffTerminal, "EVERY_S", 0)
    capsys.readouterr()
    train(tiny_model(), tiny_trainer(tmp_path / "run", max_steps=6, log_every_steps=3), preset="test")
    out = capsys.readouterr().out
    assert "step 2/6\n" in out and "step 6/6 (loss " in out
    sample.main(["--ckpt", str(run_dir / "ema.pt"), "--n", "4", "--batch", "2", "--shard_size", "2",
                 "--steps", "2", "--out", str(tmp_path / "g.png")])
    assert "2/4 images drawn" in capsys.readouterr().out

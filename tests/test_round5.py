"""Survive round 5 (issue 53): what the project reads back must be what it wrote. Files a library writes for a
run have names nobody can plant at, caches prove what they hold (else they are computed again), records that
scripts read back are checked before use, and bounds are shared and checked before any work."""
import json
import os
import socket
import sys
import threading
import time

import numpy as np
import pytest
import torch
from conftest import ROOT, one_line_error

import data
import evaluate
from machinery import fid, files, runs
from machinery.errors import UserError
from test_fid import TinyFeatures

sys.path.insert(0, os.path.join(ROOT, "scripts"))

# ---- 1. a tracker's files: no planted name can redirect or block them


@pytest.mark.parametrize("plant", ["link", "fifo"])
def test_tensorboard_never_writes_through_nor_blocks_on_a_planted_name(tmp_path, plant):
    """Links (to a file outside the run) or FIFOs at every name the event file could have for the next
    minute: the run writes its own file, the victim is untouched, nothing blocks."""
    pytest.importorskip("tensorboard")
    from tensorboard.summary.writer import event_file_writer

    out, victim = tmp_path / "run", tmp_path / "victim"
    out.mkdir()
    victim.write_text("victim")
    uid, now = event_file_writer._global_uid._value, int(time.time())  # the next writer's number here
    planted = [out / f"events.out.tfevents.{t:010d}.{socket.gethostname()}.{os.getpid()}.{u}"
               for t in range(now - 2, now + 60) for u in (uid, uid + 1)]
    for name in planted:
        os.symlink(victim, name) if plant == "link" else os.mkfifo(name)
    done = []

    def log():
        trackers = runs.Trackers("tensorboard", str(out), {"model": {}, "trainer": {}}, 0)
        trackers.log({"step": 1, "loss": 0.5})
        trackers.close()
        done.append(True)

    worker = threading.Thread(target=log, daemon=True)
    worker.start()
    worker.join(120)
    assert done, "the tracker blocked on a planted FIFO"
    assert victim.read_text() == "victim"
    assert all(os.path.islink(p) if plant == "link" else not files.is_regular(p) for p in planted)
    ours = [f for f in os.listdir(out) if files.is_regular(out / f)]
    assert len(ours) == 1 and ours[0].startswith("events.out.tfevents.")
    assert b"train/loss" in (out / ours[0]).read_bytes()


def test_wandbs_id_is_never_read_through_a_link_and_its_files_go_to_a_fresh_folder(tmp_path, monkeypatch):
    calls = []
    fake = type(sys)("wandb")
    fake.init = lambda **kw: calls.append(kw) or "run"
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    (tmp_path / "elsewhere").write_text("0123456789abcdef\n")
    os.symlink(tmp_path / "elsewhere", tmp_path / "wandb-id")
    os.makedirs(tmp_path / "wandb")
    os.mkfifo(tmp_path / "wandb" / "debug.log")  # a name wandb would write to in the folder it is given
    runs.start_wandb(str(tmp_path), {"model": {}, "trainer": {}})
    run_id = (tmp_path / "wandb-id").read_text().strip()
    assert files.is_regular(tmp_path / "wandb-id") and run_id != "0123456789abcdef"
    assert (tmp_path / "elsewhere").read_text() == "0123456789abcdef\n"
    folder = calls[0]["dir"]
    assert calls[0]["id"] == run_id and os.path.dirname(folder) == str(tmp_path / "wandb")
    assert os.path.basename(folder).startswith("start-") and os.listdir(folder) == []
    runs.start_wandb(str(tmp_path), {"model": {}, "trainer": {}})  # a resume: the same id, a new folder
    assert calls[1]["id"] == run_id and calls[1]["dir"] != folder


# ---- 4. FID statistics caches: never read through a link, used only where they prove to be what they name


def cache_of(tmp_path, n=64):
    """The statistics of shapes' train split (n images, 16 px) with TinyFeatures, cached in tmp_path/S.
    -> (their path, the statistics, the settings recorded with them)."""
    ref = evaluate.reference_stats(TinyFeatures(), "shapes", "", 16, n, "cpu", str(tmp_path / "S"))
    path = evaluate.reference_path(TinyFeatures(), "shapes", "", 16, n, str(tmp_path / "S"))
    with np.load(path) as z:
        settings = json.loads(str(z["meta"][()]))["settings"]
    return path, ref, settings


def test_a_link_planted_at_a_splits_cache_name_is_replaced_never_read(tmp_path, capsys):
    """S's cache name linked to another reference's statistics: they are computed again (the same as a fresh
    computation) and written in the link's place; the other file is untouched."""
    other_path, other, _ = cache_of(tmp_path / "other", n=32)
    path, ref, _ = cache_of(tmp_path)
    os.remove(path)
    os.symlink(other_path, path)
    before = open(other_path, "rb").read()
    extractor = TinyFeatures()
    again = evaluate.reference_stats(extractor, "shapes", "", 16, 64, "cpu", str(tmp_path / "S"))
    assert extractor.calls > 0 and "computed again" in capsys.readouterr().out
    np.testing.assert_array_equal(again["mu"], ref["mu"])
    assert not np.array_equal(again["mu"], other["mu"]) and int(again["n"]) == 64
    assert files.is_regular(path) and open(other_path, "rb").read() == before


@pytest.mark.parametrize("damage,why", [
    (lambda r: {**r, "mu": np.full_like(r["mu"], np.nan)}, "not finite"),
    (lambda r: {**r, "n": np.array(-7)}, "not statistics"),
    (lambda r: {**r, "mu": r["mu"][:8], "sigma": r["sigma"][:8, :8], "features": r["features"][:, :8]},
     "8 features, not the network's 16"),
    (None, "its checksum differs"),
    ("settings", "other data, settings or network"),
])
def test_cached_statistics_are_checked_and_computed_again_on_any_mismatch(tmp_path, capsys, damage, why):
    path, ref, settings = cache_of(tmp_path)
    if damage is None:  # a byte of the mean changed after it was written
        bad = dict(ref)
        fid.write_stats(path, bad, str(tmp_path / "S"), settings)
        with np.load(path) as z:
            content = {k: z[k] for k in z.files}
        content["mu"] = content["mu"] + 1e-9
        np.savez(path, **content)
    elif damage == "settings":  # another split's statistics, with their own record, copied in
        fid.write_stats(path, ref, str(tmp_path / "S"), {**settings, "ref_images": 5})
    else:
        fid.write_stats(path, damage(ref), str(tmp_path / "S"), settings)
    extractor = TinyFeatures()
    extractor.features_list = ["16"]  # as torch-fidelity's InceptionV3 says its width ("2048")
    again = evaluate.reference_stats(extractor, "shapes", "", 16, 64, "cpu", str(tmp_path / "S"))
    out = capsys.readouterr().out
    assert why in out and "computed again" in out and extractor.calls > 0
    np.testing.assert_array_equal(again["mu"], ref["mu"])
    assert fid.read_stats(path, fid.stats_settings(extractor, **{k: settings[k] for k in (
        "data", "content", "ref_images", "seed")}), 16)[0] is not None  # the cache is whole again


def test_samples_and_statistics_of_other_widths_are_one_line():
    ref = {"mu": np.zeros(16), "sigma": np.eye(16), "features": np.zeros((0, 16)), "n": np.array(4)}
    with pytest.raises(UserError, match="the samples have 8 features and the reference statistics 16"):
        fid.fid_metrics(torch.randn(4, 8), None, ref)


def test_a_folder_references_cache_is_keyed_by_the_bytes_of_its_images(tmp_path, monkeypatch, capsys):
    """An image replaced by another of the same size, its modification time restored: the statistics are
    computed again (sizes and times alone would have kept the stale ones)."""
    from PIL import Image

    folder = tmp_path / "ref"
    folder.mkdir()
    for i in range(4):
        Image.fromarray(np.full((8, 8, 3), 60 * i, np.uint8)).save(folder / f"{i}.bmp")  # fixed size
    np.savez(tmp_path / "a.npz", np.random.default_rng(0).integers(0, 256, (4, 8, 8, 3), dtype=np.uint8))
    monkeypatch.setattr(fid, "inception", lambda device, weights=None: TinyFeatures())
    argv = ["--fid", str(tmp_path / "a.npz"), str(folder), "--stats_dir", str(tmp_path / "S")]
    first = evaluate.main(argv)
    st = os.stat(folder / "3.bmp")
    Image.fromarray(np.full((8, 8, 3), 250, np.uint8)).save(folder / "3.bmp")
    os.utime(folder / "3.bmp", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(folder / "3.bmp").st_size == st.st_size
    second = evaluate.main(argv)
    assert second["reference_stats"]["sha256"] != first["reference_stats"]["sha256"]
    assert second["fid"] != first["fid"]
    assert evaluate.main(argv)["reference_stats"]["sha256"] == second["reference_stats"]["sha256"]


def test_fid_of_one_image_is_refused_before_any_work(run_dir, tmp_path, capsys, monkeypatch):
    import sample

    np.savez(tmp_path / "one.npz", np.zeros((1, 8, 8, 3), np.uint8))
    np.savez(tmp_path / "two.npz", np.zeros((2, 8, 8, 3), np.uint8))
    monkeypatch.setattr(fid, "inception", lambda *a, **k: pytest.fail("Inception built for one image"))
    for argv in (["--fid", str(tmp_path / "one.npz"), "shapes:train"],
                 ["--fid", str(tmp_path / "two.npz"), str(tmp_path / "one.npz")]):
        assert "FID needs at least 2" in one_line_error(capsys, evaluate.main, argv)
    err = one_line_error(capsys, sample.main, ["--ckpt", str(run_dir / "ema.pt"), "--n", "1", "--eval", "fid",
                                               "--out", str(tmp_path / "g.png")])
    assert "--n 1" in err and "FID needs at least 2" in err
    assert not (tmp_path / "g.shards").exists() and not (tmp_path / "g.npz").exists()
    with pytest.raises(UserError, match="FID needs at least 2 images"):
        fid.mean_cov(torch.zeros(1, 16))


# ---- 7. every command shares the configs' bounds


def test_data_py_shares_the_image_size_and_shapes_count_bounds(capsys, monkeypatch, tmp_path):
    import dataclasses

    import ddpm

    fields = {f.name: f for cls in (ddpm.ModelConfig, ddpm.TrainerConfig) for f in dataclasses.fields(cls)}
    assert fields["image_size"].metadata["range"][1] == data.MAX_IMAGE_SIZE + 1  # ranged's top is exclusive
    assert fields["shapes_count"].metadata["range"][1] - 1 <= data.MAX_SHAPES_COUNT
    monkeypatch.setattr(data, "load_dataset", lambda *a, **k: pytest.fail("images made past the bound"))
    monkeypatch.setattr(data.beton, "ffcv_available", lambda: True)
    for argv, needle in ((["--image_size=100000"], "--image_size 100000: must lie in [1, 8192]"),
                         (["--shapes_count=100000000"], "--shapes_count 100000000: must lie in"),
                         (["--image_size=8192"], "need at least 9,375.0 GiB")):
        out = str(tmp_path / "x.beton")
        assert needle in one_line_error(capsys, data.main, ["--dataset=shapes", *argv, f"--out={out}"])
    assert "--image_size 9000: must lie in [1, 8192]" in one_line_error(
        capsys, evaluate.main, ["--fid", "shapes:test", "shapes:train", "--image_size", "9000"])


# ---- 5, 6. records the scripts read back: one line or a note, never a traceback


def lever_study(tmp_path, rows_s1):
    """A lever study of the base alone, two seeds of 4 steps: seed 0 finished well, seed 1's metrics.jsonl
    holding `rows_s1` (text lines). -> the --report command line."""
    from test_levers import base

    good = {"step": 4, "bpd": 3.5, "wall_s": 60.0, "eval_s": 6.0}
    for seed, lines in ((0, [json.dumps(good)]), (1, rows_s1)):
        (tmp_path / "study" / f"base-s{seed}").mkdir(parents=True)
        (tmp_path / "study" / f"base-s{seed}" / "metrics.jsonl").write_text("\n".join(lines))
    return ["--base", base(tmp_path), "--arm", "base=", "--kimg", "0.064", "--seeds", "2", "--metric", "bpd",
            "--out", str(tmp_path / "study"), "--report"]


@pytest.mark.parametrize("lines,left_out", [
    (['{"step": 4, "bpd": 3.7, "wall_s": 60.0, "eval_s": 6.0}', '{"step": 5, "bp'], None),  # a cut line
    (['[1, 2]', '{"step": 4, "bpd": 3.7, "wall_s": 60.0, "eval_s": 6.0}'], None),  # a JSON list line
    (['{"step": 4, "bpd": null, "wall_s": 60.0, "eval_s": 6.0}'], "its bpd is null"),  # a NaN, logged
    (['{"step": 4, "bpd": 3.7, "wall_s": 60.0}'], "its eval_s is missing"),
    (['{"step": 4, "bpd": 3.7, "wall_s": "60", "eval_s": 6.0}'], 'its wall_s is "60"'),
    (['{"step": 4, "bp'], "not finished"),
])
def test_levers_report_reads_damaged_records_without_a_traceback(tmp_path, capsys, lines, left_out):
    import levers

    results = levers.main(lever_study(tmp_path, lines))
    out = capsys.readouterr().out
    if left_out is None:
        assert results["base"]["values"] == [3.5, 3.7]
    elif left_out == "not finished":
        assert results["base"]["values"] == [3.5] and "Not finished yet (1 of 2 runs): base-s1" in out
    else:
        assert results["base"]["values"] == [3.5] and f"finished, but {left_out}: left out" in out
        assert f"Left out (1 runs): base-s1 ({left_out})" in (tmp_path / "study" / "levers.md").read_text()


def test_levers_unclosed_quotes_are_one_line(tmp_path, capsys):
    import levers
    from test_levers import base

    for argv in (["--arm", "x='unclosed"], ["--base", base(tmp_path) + " --lr='2"]):
        err = one_line_error(capsys, levers.main, ["--base", base(tmp_path), "--kimg", "1", "--out",
                                                   str(tmp_path / "s"), *argv])
        assert "No closing quotation" in err
    assert not (tmp_path / "s").exists()


def vs_args(tmp_path, *extra):
    """vs_diffusers_train's command line on a folder of 4 images, both peer files this Python."""
    from PIL import Image

    (tmp_path / "images").mkdir(exist_ok=True)
    for i in range(4):
        Image.fromarray(np.full((8, 8, 3), 50 * i, np.uint8)).save(tmp_path / "images" / f"{i}.png")
    return ["--data_dir", str(tmp_path / "images"), "--peer_python", sys.executable, "--peer_script",
            sys.executable, "--epochs", "1", "--seeds", "1", "--out", str(tmp_path / "vs"), *extra]


@pytest.mark.parametrize("extra,needle", [(["--fid_samples", "1"], "--fid_samples in [2, 1e6]"),
                                          (["--sample_steps", "-1"], "--sample_steps -1 must lie in [1, "),
                                          (["--sample_steps", "0"], "--sample_steps 0 must lie in [1, ")])
def test_vs_diffusers_settings_fid_cannot_score_are_refused_before_training(
        tmp_path, capsys, monkeypatch, extra, needle):
    import subprocess

    import vs_diffusers_train as vs

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("something ran"))
    assert needle in one_line_error(capsys, vs.main, vs_args(tmp_path, *extra))
    assert not (tmp_path / "vs").exists()


@pytest.mark.parametrize("name,change,needle", [
    ("ours-s0-fid", {"fid": None}, "fid null: no FID"),
    ("theirs-s0", {"wall_s": 0}, "wall_s 0, not a time"),
    ("theirs-s0", {"wall_s": "60"}, 'wall_s "60", not a time'),
    ("ours-s0", {"wall_s": 1e308}, "wall_s 1e+308, not a time"),
    ("ours-s0", {"model": None}, "model null, not a model in"),
    ("ours-s0", {"model": "/etc"}, 'model "/etc", not a model in'),
    ("ours-wall-s0", {"continued": "{out}/../elsewhere/ema.pt"}, "continued"),
    ("ours-s0", "not a table", "not a table"),
])
def test_vs_diffusers_record_entries_are_checked_when_read_back(tmp_path, capsys, monkeypatch, name, change,
                                                                needle):
    import subprocess

    import vs_diffusers_train as vs

    argv = vs_args(tmp_path)
    args, _, _, tc, steps = vs.parse(argv)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "inception_weights", "seeds",
                                                                 "equal_wall")}
    out = str(tmp_path / "vs")
    done = {"ours-s0": {"steps": 2, "wall_s": 9.0, "model": f"{out}/ours-s0/ema.pt"},
            "ours-s0-fid": {"fid": 80.5, "n": 1000},
            "theirs-s0": {"wall_s": 20.0, "model": f"{out}/theirs-s0"},
            "ours-wall-s0": {"steps": 4, "wall_s": 19.0, "model": f"{out}/ours-wall-s0/ema.pt",
                             "continued": f"{out}/ours-s0/ema.pt"}}
    done[name] = change if isinstance(change, str) else {**done[name], **{
        k: v.format(out=out) if isinstance(v, str) else v for k, v in change.items()}}
    os.makedirs(out)
    with open(os.path.join(out, vs.RECORD), "w") as f:
        json.dump({"settings": json.loads(json.dumps({**settings, "steps": steps})), "done": done}, f)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("something ran"))
    monkeypatch.setattr(fid, "inception", lambda *a, **k: None)
    err = one_line_error(capsys, vs.main, argv)
    assert f"its entry '{name}' is not what this script writes" in err and needle in err
    assert "remove that entry" in err


# ---- 8. small ones


def test_a_run_folder_as_ckpt_is_its_ema_pt(run_dir, tmp_path):
    import sample

    sample.main(["--ckpt", str(run_dir), "--n", "2", "--steps", "2", "--device", "cpu", "--out",
                 str(tmp_path / "g.png")])  # not read as a diffusers folder
    sample.main(["--ckpt", str(run_dir / "ema.pt"), "--n", "2", "--steps", "2", "--device", "cpu", "--out",
                 str(tmp_path / "e.png")])
    assert np.array_equal(np.load(tmp_path / "g.npz")["arr_0"], np.load(tmp_path / "e.npz")["arr_0"])


def test_what_a_run_needs_is_checked_before_its_folder_is_made(tmp_path, monkeypatch):
    """runs.check_trackers and data.with_images: cheap checks ddpm.py can make before the run folder."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(UserError, match="the wandb package is not installed"):
        runs.check_trackers("wandb")
    assert runs.check_trackers("none") == []
    (tmp_path / "empty").mkdir()
    os.mkfifo(tmp_path / "empty" / "a.png")
    with pytest.raises(UserError, match="holds no images .*; skipped 1 FIFO/device/socket"):
        data.with_images(str(tmp_path / "empty"))


def test_the_world_size_note_on_resume_is_printed_by_rank_0_alone(run_dir, capsys, monkeypatch):
    import ddpm
    from conftest import tiny_model, tiny_trainer
    from machinery import checkpoints

    mc, tc = tiny_model(num_classes=4), tiny_trainer(run_dir, max_steps=3)
    loader = type("Loader", (), {"batch_size": 4, "load_state_dict": lambda self, state: None})()
    for rank, printed in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        b = ddpm.build(mc, tc, torch.device("cpu"))
        ckpt, path = checkpoints.load_resume_checkpoint(str(run_dir), "cpu")
        capsys.readouterr()
        checkpoints.restore(ckpt, path, mc, b.model, b.ema, b.opt, loader, world=2)
        assert ("note: resuming 1-process training with 2" in capsys.readouterr().out) == printed


# ---- 2, 3, 5. post-hoc EMA: snapshots carry their run, step, σ_rel and checksum; names are unique


def tracked_run(folder, sigma_rels=(0.05, 0.10), steps=80, every=40, ckpt_step=None):
    """A parameter walk tracked for `steps`, snapshotted every `every` steps into folder/phema, with an
    ema.pt naming the step `ckpt_step` (default: the last) and the run. -> (model, tracked)."""
    from machinery import phema

    model = torch.nn.Linear(8, 1, bias=False)
    tracked = phema.Tracked(model, sigma_rels)
    g = torch.Generator().manual_seed(0)
    for t in range(1, steps + 1):
        model.weight.data.add_(torch.randn(1, 8, generator=g) * 0.1)
        tracked.update(model, t)
        if t % every == 0:
            tracked.snapshot(str(folder), model, t, t * 8)
    torch.save({"step": ckpt_step or steps, "phema_run": tracked.run}, folder / "ema.pt")
    return model, tracked


def test_a_rebuild_is_at_the_checkpoints_step_and_leaves_later_snapshots_out(tmp_path, capsys):
    """kill -9 after a snapshot the checkpoint has not reached, resumed to an earlier end: the rebuilt EMA is
    of ema.pt's step, from the snapshots up to it; no snapshot at that step (a run resumed without
    snapshots) is one line."""
    from machinery import phema

    model, _ = tracked_run(tmp_path, steps=120, ckpt_step=80)
    record = phema.load_rebuilt(model, str(tmp_path), 0.07)
    assert record["step"] == 80 and {s["step"] for s in record["snapshots"]} == {40, 80}
    assert "2 post-hoc EMA snapshots in" in capsys.readouterr().out  # step 120's, of both σ_rel values
    torch.save({"step": 100, "phema_run": None}, tmp_path / "ema.pt")  # went on with snapshots off
    with pytest.raises(UserError, match="no post-hoc EMA snapshot at step 100, the checkpoint's"):
        phema.load_rebuilt(model, str(tmp_path), 0.07)


def test_another_runs_snapshot_is_refused(tmp_path):
    import shutil

    from machinery import phema

    model, _ = tracked_run(tmp_path / "mine")
    tracked_run(tmp_path / "other")  # the same steps and σ_rel values, another run
    shutil.copy(tmp_path / "other" / "phema" / "phema-000000040-0.0500.pt", tmp_path / "mine" / "phema")
    with pytest.raises(UserError, match="phema-000000040-0.0500.pt is a snapshot of another run"):
        phema.load_rebuilt(model, str(tmp_path / "mine"), 0.07)


def test_a_missing_sigma_rel_is_an_error_not_a_substitution(tmp_path):
    from machinery import phema

    model, _ = tracked_run(tmp_path)
    os.remove(tmp_path / "phema" / "phema-000000040-0.0500.pt")
    with pytest.raises(UserError, match=r"step 40 are of σ_rel \[0.1\], the run tracked \[0.05, 0.1\]"):
        phema.load_rebuilt(model, str(tmp_path), 0.05)


@pytest.mark.parametrize("damage,needle", [
    ("weight", "their checksum differs"), ("nan", "not all finite"), ("no step", "not a snapshot of this"),
    ("pickle", "objects other than tensors"), ("cut", "cannot read post-hoc EMA snapshot")])
def test_a_damaged_snapshot_is_one_line(tmp_path, capsys, damage, needle):
    import argparse

    from machinery import phema

    model, _ = tracked_run(tmp_path)
    path = tmp_path / "phema" / "phema-000000040-0.1000.pt"
    record = torch.load(path, weights_only=True)
    if damage == "weight":  # one weight changed after it was written
        record["params"]["weight"][0, 0] += 1
    elif damage == "nan":  # written so, with its checksum
        record["params"]["weight"][0, 0] = float("nan")
        record["sha256"] = phema.params_sha256(record["params"])
    elif damage == "no step":
        del record["step"]
    elif damage == "pickle":
        record["extra"] = argparse.Namespace()
    torch.save(record, path)
    if damage == "cut":
        path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(UserError, match=needle) as e:
        phema.load_rebuilt(model, str(tmp_path), 0.07)
    assert "\n" not in str(e.value) and "weights_only=False" not in str(e.value)


def test_sigma_rels_are_bounded_distinct_and_named_apart(tmp_path, run_dir, capsys):
    from machinery import phema

    assert phema.sigma_rel_name(0.05) == "0.0500" and phema.sigma_rel_name(0.05004) == "0.05004"
    assert phema.sigma_rel_name(4e-4) == "0.0004" and phema.sigma_rel_name(1.5e-4) == "0.00015"
    _, tracked = tracked_run(tmp_path, sigma_rels=(0.05, 0.05004), steps=40)
    names = sorted(os.listdir(tmp_path / "phema"))
    assert names == ["phema-000000040-0.0500.pt", "phema-000000040-0.05004.pt"]
    for bad in ((0.00004, 0.1), (1e-300,), (0.05, 0.05), (float("nan"),)):
        with pytest.raises(UserError, match="ema_sigma_rels .*distinct σ_rel values, each in \\[0.0001"):
            phema.Tracked(torch.nn.Linear(2, 1), bad)
    with pytest.raises(UserError, match="ema_eval_sigma_rels 1e-300"):
        phema.check_sigma_rels([1e-300], "ema_eval_sigma_rels", 0, 8)  # ddpm.py's validate, before training
    for bad in ("1e-300", "1e-160", "0.05,0.05", "x"):
        err = one_line_error(capsys, phema.main, ["--run", str(run_dir), "--sigma_rel", bad])
        assert "--sigma_rel" in err
    paths = phema.main(["--run", str(run_dir), "--sigma_rel", "0.05,0.05004"])
    assert [os.path.basename(p) for p in paths] == ["ema-sigma_rel0.0500.pt", "ema-sigma_rel0.05004.pt"]
    records = [torch.load(p, weights_only=True)["post_hoc_ema"] for p in paths]
    assert [r["sigma_rel"] for r in records] == [0.05, 0.05004]


def test_a_sigma_rel_far_outside_the_tracked_ones_is_said_to_be_extrapolated(tmp_path, capsys):
    from machinery import phema

    model, _ = tracked_run(tmp_path)
    phema.load_rebuilt(model, str(tmp_path), 0.075)
    assert "extrapolated" not in capsys.readouterr().out
    phema.load_rebuilt(model, str(tmp_path), 0.001)
    assert "σ_rel 0.001 lies outside the tracked [0.05, 0.1]: extrapolated" in capsys.readouterr().out


def test_a_snapshot_name_at_step_0_is_one_line(tmp_path):
    from machinery import phema

    model, _ = tracked_run(tmp_path)
    (tmp_path / "phema" / "phema-000000000-0.0500.pt").write_bytes(b"")
    with pytest.raises(UserError, match="phema-000000000-0.0500.pt: not a snapshot name"):
        phema.load_rebuilt(model, str(tmp_path), 0.05)


def test_split_experts_are_each_rebuilt_from_their_own_snapshots(tmp_path):
    import sample
    from conftest import tiny_model, tiny_trainer
    from machinery import phema

    from ddpm import train

    mc_low, mc_high = tiny_model(split_timestep=40), tiny_model(split_timestep=40, split_part="high")
    train(mc_low, tiny_trainer(tmp_path / "low", max_steps=2), preset="test")
    train(mc_high, tiny_trainer(tmp_path / "high", max_steps=2), preset="test")
    argv = ["--ckpt", str(tmp_path / "low" / "ema.pt"), "--ckpt_high", str(tmp_path / "high" / "ema.pt"),
            "--n", "2", "--steps", "2", "--out", str(tmp_path / "s.png")]
    plain = sample.main(argv)
    low, high = (phema.main(["--run", str(tmp_path / part), "--sigma_rel", "0.07"])[0]
                 for part in ("low", "high"))
    rebuilt = sample.main(["--ckpt", low, "--ckpt_high", high, *argv[4:]])
    record, record_high = (rebuilt[k]["post_hoc_ema"] for k in ("checkpoint", "checkpoint_high"))
    assert record["step"] == record_high["step"] == 2 and record["run"] != record_high["run"]
    assert rebuilt["checkpoint_high"]["sha256"] != plain["checkpoint_high"]["sha256"]

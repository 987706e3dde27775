"""Survive round 4 (issue 34): folders the project derives are never links, every size is bounded before it is
allocated, shards prove their content, and what is accepted is what is recorded."""
import dataclasses
import io
import json
import math
import os
import shutil
import zipfile

import numpy as np
import pytest
from conftest import ROOT, one_line_error

import data
import ddpm
import evaluate
import sample
from machinery import beton, fid, files, runs, shards
from machinery.errors import UserError

needs_ffcv = pytest.mark.skipif(not beton.ffcv_available(), reason="ffcv is not installed")


def common(run_dir, out, *extra):
    return ["--ckpt", str(run_dir / "ema.pt"), "--guidance", "1", "--sampler", "ddim", "--steps", "2",
            "--device", "cpu", "--out", str(out), *extra]


# ---- 1. a folder the project derives is never a planted link


def test_a_shard_folder_planted_as_a_link_is_refused_and_its_target_untouched(run_dir, tmp_path, capsys):
    """mkdir T; cp a_shard T/; ln -s T O/g.shards; sample.py --out O/g.png: refused, T as it was."""
    target, out = tmp_path / "T", tmp_path / "O"
    target.mkdir(), out.mkdir()
    (target / "shard-000000.npz").write_bytes(b"not ours")
    os.symlink(target, out / "g.shards")
    err = one_line_error(capsys, sample.main, common(run_dir, out / "g.png", "--n", "4"))
    assert "g.shards is a symbolic link" in err
    assert os.listdir(target) == ["shard-000000.npz"]
    assert (target / "shard-000000.npz").read_bytes() == b"not ours"
    assert not (out / "g.npz").exists()


def plant(tmp_path, monkeypatch, name):
    """In a fresh working folder: `name` a link to a victim folder holding one file. -> the victim."""
    monkeypatch.chdir(tmp_path)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "kept").write_text("victim")
    os.makedirs(os.path.dirname(name) or ".", exist_ok=True)
    os.symlink(victim, name)
    return victim


@pytest.mark.parametrize("where", ["betons", "fid statistics", "run folder", "wandb", "a folder of our own"])
def test_every_derived_folder_refuses_a_planted_link(tmp_path, monkeypatch, where):
    """The default beton cache, the default FID statistics cache, runs/<preset>-<time>, <run>/wandb and any
    folder named by the program: a link there is one UserError line and nothing is written through it."""
    monkeypatch.setattr(runs.time, "strftime", lambda fmt: "now")
    name, make = {
        "betons": (data.BETON_DIR, lambda: data.beton_for("shapes", "", 8, data.BETON_DIR, shapes_count=16)),
        "fid statistics": (fid.STATS_DIR, lambda: files.own_or_named(fid.STATS_DIR, fid.STATS_DIR)),
        "run folder": ("runs/test-now", lambda: runs.prepare_run_folder("", "test", False, 1)),
        "wandb": ("run/wandb", lambda: files.own_folder("run/wandb")),
        "a folder of our own": ("out.shards", lambda: files.own_folder("out.shards")),
    }[where]
    victim = plant(tmp_path, monkeypatch, name)
    with pytest.raises(UserError, match="is a symbolic link; this program uses only folders it made"):
        make()
    assert os.listdir(victim) == ["kept"]


def test_a_folder_the_user_names_may_be_a_link(tmp_path, monkeypatch):
    """--beton_dir, --stats_dir and --out_dir are the user's: a link to another disk is taken."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / "mine")
    assert files.own_or_named(str(tmp_path / "mine"), fid.STATS_DIR) == str(tmp_path / "mine")
    assert runs.prepare_run_folder(str(tmp_path / "mine"), "test", False, 1) == str(tmp_path / "mine")


# ---- 2. every size is bounded before anything is allocated, written or rendered


RELATIONAL = {"split_timestep", "sample_steps", "eval_sample_steps", "eval_bpd_strata"}  # <= timesteps


def test_every_numeric_field_has_an_upper_bound():
    for cls in (ddpm.ModelConfig, ddpm.TrainerConfig):
        for f in dataclasses.fields(cls):
            lo_hi = f.metadata.get("range")
            if lo_hi is not None and f.name not in RELATIONAL:
                assert lo_hi[1] is not None and math.isfinite(lo_hi[1]), f"{cls.__name__}.{f.name}: {lo_hi}"


@pytest.mark.parametrize("arg", ["--image_size=1e9", "--image_size=1000000000", "--channels=1000000000",
                                 "--base_channels=1000000000", "--channel_mult=1,1e30",
                                 "--num_res_blocks=1000000000", "--attn_head_dim=1000000000",
                                 "--timesteps=1000000000", "--cpu_threads=1000000000",
                                 "--shapes_count=1000000000", "--guidance=1e30", "--lr=1e30",
                                 "--min_snr_gamma=1e30", "--warmup_steps=1000000000000"])
def test_sizes_beyond_any_run_are_one_line(capsys, tmp_path, arg):
    err = one_line_error(capsys, ddpm.main, ["--preset=demo", arg, f"--out_dir={tmp_path / 'run'}"])
    assert arg.split("=")[0].lstrip("-") in err
    assert not (tmp_path / "run").exists()


def test_a_network_too_big_for_memory_is_refused_with_the_estimate(capsys, tmp_path):
    err = one_line_error(capsys, ddpm.main, ["--preset=demo", "--image_size=2048", "--base_channels=4096",
                                             "--attn_resolutions=", "--device=cpu",
                                             f"--out_dir={tmp_path / 'run'}"])
    assert "GiB" in err


@pytest.mark.parametrize("extra,needle", [
    (["--n", "1000000000"], "n=1000000000: must be in [1, 100000000]"),
    (["--n", "4611686018427387904", "--shard_size", "1"], "must be in [1, 100000000]"),
    (["--n", "200000", "--shard_size", "1"], "more than 100000: choose --shard_size 2 or more"),
    (["--n", "10", "--label", "-5"], "label=-5: must be in [-1, 2147483648)"),
    (["--n", "10", "--label", "4"], "--label 4 is out of range: [-1, 3]"),
])
def test_sample_sizes_are_bounded_before_drawing(run_dir, tmp_path, capsys, extra, needle):
    err = one_line_error(capsys, sample.main, common(run_dir, tmp_path / "g.png", *extra))
    assert needle in err
    assert not os.path.exists(tmp_path / "g.npz")


def test_sampling_more_than_the_free_disk_holds_is_refused_with_the_estimate(run_dir, tmp_path, capsys,
                                                                             monkeypatch):
    monkeypatch.setattr(files.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 10**6))
    err = one_line_error(capsys, sample.main, common(run_dir, tmp_path / "g.png", "--n", "2000"))
    assert "needs about 2.9 MiB" in err and "1.0 MiB are free" in err  # 2 x 2000 images of 16 x 16 x 3
    assert not (tmp_path / "g.shards").exists()


def npz_with_header(path, shape, payload=96):
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "|u1", "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("arr_0.npy", head.getvalue() + bytes(payload))


@pytest.mark.parametrize("shape,needle", [((100000, 100000, 100000, 3), "at most 8192 pixels a side"),
                                          ((100000, 4000, 4000, 3), "announces (100000, 4000, 4000, 3)"),
                                          ((0, 4, 4, 3), "no images")])
def test_an_npz_header_is_checked_against_its_bytes(tmp_path, capsys, monkeypatch, shape, needle):
    """Before any image is read or any network built: a header claiming 960 GB, or no images, is one line."""
    npz_with_header(tmp_path / "a.npz", shape, payload=0 if shape[0] == 0 else 96)
    monkeypatch.setattr(fid, "inception", lambda *a, **k: pytest.fail("Inception built for a bad input"))
    err = one_line_error(capsys, evaluate.main, ["--fid", str(tmp_path / "a.npz"), "shapes:train"])
    assert needle in err


def test_fid_checks_both_inputs_before_any_inception_work(tmp_path, capsys, monkeypatch):
    np.savez(tmp_path / "b.npz", np.zeros((4, 8, 8, 3), np.uint8))
    npz_with_header(tmp_path / "a.npz", (0, 8, 8, 3), payload=0)
    monkeypatch.setattr(fid, "inception", lambda *a, **k: pytest.fail("B's features before A was checked"))
    for argv in (["--fid", str(tmp_path / "b.npz"), str(tmp_path / "a.npz")],
                 ["--fid", str(tmp_path / "a.npz"), str(tmp_path / "b.npz")]):
        assert "no images" in one_line_error(capsys, evaluate.main, argv)
    (tmp_path / "empty").mkdir()
    err = one_line_error(capsys, evaluate.main, ["--fid", str(tmp_path / "b.npz"), str(tmp_path / "empty")])
    assert "holds no images" in err


# ---- 3. a shard proves its content


@pytest.mark.parametrize("damage", ["flipped byte", "zeroed images", "no checksum"])
def test_a_shard_whose_content_changed_is_drawn_again(run_dir, tmp_path, capsys, damage):
    argv = common(run_dir, tmp_path / "g.png", "--n", "6", "--batch", "2", "--shard_size", "2",
                  "--keep_shards")
    straight = common(run_dir, tmp_path / "s.png", "--n", "6", "--batch", "2", "--shard_size", "2")
    sample.main(straight)
    sample.main(argv)
    shard = tmp_path / "g.shards" / "shard-000001.npz"
    if damage == "zeroed images":  # rewritten with the same settings: only the checksum tells
        content = dict(np.load(shard))
        content["images"] = np.zeros_like(content["images"])
        np.savez(shard, **content)
    elif damage == "no checksum":
        manifest = json.loads((tmp_path / "g.shards" / "manifest.json").read_text())
        del manifest["checksums"]["1"]
        (tmp_path / "g.shards" / "manifest.json").write_text(json.dumps(manifest))
    else:
        raw = bytearray(shard.read_bytes())
        raw[200] ^= 0x01  # inside the images' array
        shard.write_bytes(raw)
    os.remove(tmp_path / "g.npz")
    capsys.readouterr()
    result = sample.main(argv)
    out = capsys.readouterr().out
    assert "shard-000001.npz" in out and "drawn again" in out
    assert result["resumed"] == 4 and result["drawn"] == 2
    assert np.array_equal(np.load(tmp_path / "g.npz")["arr_0"], np.load(tmp_path / "s.npz")["arr_0"])


def test_a_stop_between_the_checksum_and_the_rename_leaves_no_shard_without_one(
        run_dir, tmp_path, capsys, monkeypatch):
    """A SIGTERM just after a shard's checksum is in the manifest: the shard is dropped whole, and the same
    command draws it again without a warning (a shard on disk never lacks its checksum)."""
    argv = common(run_dir, tmp_path / "g.png", "--n", "6", "--batch", "2", "--shard_size", "2")
    real = shards.write_manifest

    def stopped(folder, manifest):
        real(folder, manifest)
        if len(manifest["checksums"]) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(shards, "write_manifest", stopped)
    assert "stopped by a signal" in one_line_error(capsys, sample.main, argv, code=1)
    monkeypatch.setattr(shards, "write_manifest", real)
    listed = sorted(os.listdir(tmp_path / "g.shards"))
    assert listed == [".manifest.lock", "manifest.json", "shard-000000.npz"]
    result = sample.main(argv)
    assert "warning" not in capsys.readouterr().out
    assert result["resumed"] == 2 and result["drawn"] == 4
    straight = common(run_dir, tmp_path / "s.png", "--n", "6", "--batch", "2", "--shard_size", "2")
    sample.main(straight)
    assert np.array_equal(np.load(tmp_path / "g.npz")["arr_0"], np.load(tmp_path / "s.npz")["arr_0"])


# ---- 4. and 5. no traceback, and what is accepted is what is recorded


def write_manifest(folder, manifest):
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps(manifest) if not isinstance(manifest, str) else manifest)


@pytest.mark.parametrize("manifest,needle", [
    ("[" * 100_000 + "]" * 100_000, "RecursionError"),
    ({"settings": {"shard_size": True}, "checksums": {}}, "shard_size True is not a number of images"),
    ({"settings": {}, "checksums": []}, "its checksums are not a table"),
])
def test_a_bad_manifest_is_one_line(run_dir, tmp_path, capsys, manifest, needle):
    write_manifest(tmp_path / "g.shards", manifest)
    err = one_line_error(capsys, sample.main, common(run_dir, tmp_path / "g.png", "--n", "4"))
    assert needle in err


def test_device_meta_and_a_fifo_for_weights_are_one_line(run_dir, tmp_path, capsys):
    err = one_line_error(capsys, sample.main, ["--ckpt", str(run_dir / "ema.pt"), "--n", "4",
                                               "--device", "meta", "--out", str(tmp_path / "g.png")])
    assert "meta" in err
    os.mkfifo(tmp_path / "weights.pth")
    np.savez(tmp_path / "b.npz", np.zeros((4, 8, 8, 3), np.uint8))
    err = one_line_error(capsys, evaluate.main, ["--fid", str(tmp_path / "b.npz"), str(tmp_path / "b.npz"),
                                                 "--inception_weights", str(tmp_path / "weights.pth")])
    assert "a FIFO, not a weights file" in err


def test_png_dir_in_outs_own_folder_is_refused(run_dir, tmp_path, capsys):
    err = one_line_error(capsys, sample.main, common(run_dir, tmp_path / "g.png", "--n", "4", "--png_dir",
                                                     str(tmp_path)))
    assert "is --out's own folder" in err and not (tmp_path / "g.npz").exists()


# ---- 7. round 3's two open cases


def test_a_pipeline_without_its_scheduler_is_refused(tmp_path, capsys):
    import unet
    from conftest import tiny_model
    from machinery import diffusers_io
    from unet import UNet

    mc = tiny_model(base_channels=64)  # 32 groups in every GroupNorm, as diffusers' norm_num_groups needs
    diffusers_io.export(str(tmp_path / "unet"), UNet(mc), mc, unet)
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    shutil.move(str(tmp_path / "unet"), pipe / "unet")
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "DDPMPipeline",
                                                       "scheduler": ["diffusers", "DDPMScheduler"],
                                                       "unet": ["diffusers", "UNet2DModel"]}))
    os.remove(pipe / "unet" / diffusers_io.SCHEDULER)
    for ckpt in (pipe, pipe / "unet"):
        err = one_line_error(capsys, sample.main, ["--ckpt", str(ckpt), "--n", "2", "--out",
                                                   str(tmp_path / "g.png")])
        assert "scheduler/scheduler_config.json is missing" in err


@needs_ffcv
def test_a_beton_whose_json_claims_other_classes_is_refused(tmp_path):
    path, k = data.beton_for("shapes", "", 8, str(tmp_path), shapes_count=32)
    meta = json.load(open(path + ".json"))
    assert k == meta["num_classes"] == 4
    for claim in (7, True):
        json.dump({**meta, "num_classes": claim}, open(path + ".json", "w"))
        with pytest.raises(UserError, match="claims were changed|cannot read"):
            data.beton_for("shapes", "", 8, str(tmp_path), shapes_count=32)
    assert os.path.exists(path)  # refused, not rewritten: the user decides


def test_the_readme_says_user_named_folders_may_be_links():
    readme = " ".join(open(os.path.join(ROOT, "README.md")).read().split())
    assert ("A folder you name on the command line (`--out_dir`, `--beton_dir`, `--stats_dir`, `--out`'s "
            "folder, `--png_dir`) may be a link") in readme


def test_an_image_too_large_is_skipped_from_its_header_before_decoding(tmp_path, monkeypatch, capsys):
    from PIL import Image

    Image.new("RGB", (4, 4)).save(tmp_path / "big.png")
    Image.new("RGB", (3, 3)).save(tmp_path / "small.png")
    monkeypatch.setattr(data, "MAX_DECODE_PIXELS", 15)  # 4x4 is "too large" here
    decoded = []
    real = data.to_rgb8
    monkeypatch.setattr(data, "to_rgb8", lambda im: decoded.append(im.size) or real(im))
    images, _, _ = data.image_folder(str(tmp_path), 8)
    assert len(images) == 1 and decoded == [(3, 3)]
    assert "1 unreadable images skipped" in capsys.readouterr().out

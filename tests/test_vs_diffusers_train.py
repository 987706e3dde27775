"""scripts/vs_diffusers_train.py end to end, with a stand-in for diffusers' example (its command line; it
writes a real UNet2DModel pipeline folder from the config it is given, untrained) and tiny Inception
features: both sides at equal steps and ours at their wall-clock, scored alike, then read back."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, one_line_error
from PIL import Image
from test_fid import TinyFeatures

import sample
from machinery import fid

pytest.importorskip("diffusers")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import vs_diffusers_train as vs  # noqa: E402

INCEPTION = fid.inception

PEER = """import argparse, json, os
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel
p = argparse.ArgumentParser()
for flag in ("train_data_dir", "resolution", "output_dir", "model_config_name_or_path", "train_batch_size",
             "num_epochs", "learning_rate", "lr_warmup_steps", "ddpm_num_steps", "ddpm_beta_schedule",
             "prediction_type", "eval_batch_size", "ddpm_num_inference_steps", "save_images_epochs",
             "save_model_epochs", "checkpointing_steps"):
    p.add_argument("--" + flag, required=True)
p.add_argument("--use_ema", action="store_true")
p.add_argument("--random_flip", action="store_true")
a = p.parse_args()
unet = UNet2DModel.from_config(UNet2DModel.load_config(a.model_config_name_or_path))
scheduler = DDPMScheduler(num_train_timesteps=int(a.ddpm_num_steps), beta_schedule=a.ddpm_beta_schedule,
                          prediction_type=a.prediction_type)
DDPMPipeline(unet=unet, scheduler=scheduler).save_pretrained(a.output_dir)
with open(os.path.join(a.output_dir, "argv.json"), "w") as f:
    json.dump(vars(a), f)
"""
NETWORK = ("--image_size=16 --base_channels=16 --channel_mult=1,2 --num_res_blocks=1 --attn_resolutions=8 "
           "--norm_groups=8 --timesteps=100 --dropout=0")


def in_process_score(args, tc, model, out, name):
    """vs.score's sample.py command, run in this process so that the tiny Inception features reach it."""
    sample.main(vs.score_argv(args, tc, model, out))
    return {"fid": vs.read_fid(out), "n": args.fid_samples}


def setting(tmp_path, monkeypatch):
    for c in range(2):  # 16 images in two class folders
        (tmp_path / "images" / f"c{c}").mkdir(parents=True)
        for i in range(8):
            pixels = np.random.default_rng(8 * c + i).integers(0, 256, (16, 16, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / "images" / f"c{c}" / f"{i}.png")
    (tmp_path / "peer.py").write_text(PEER)
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "datasets.py").write_text("def load_dataset(*args, **kw):\n    return None\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "mods"))  # their cache step imports `datasets`
    monkeypatch.setattr(fid, "inception", lambda device, weights=None: TinyFeatures())
    monkeypatch.setattr(vs, "score", in_process_score)
    ours = ("--dataset=folder --loader=torch --batch_size=8 --lr=2e-3 --warmup_steps=2 --compile=false "
            "--precision=fp32 --ckpt_every_steps=0 --num_samples=0 --eval_fid_samples=0 --eval_bpd_images=0 "
            f"--ema_snapshot_kimg=0 --fid_ref_images=0 --beton_dir={tmp_path / 'betons'} "
            f"--fid_stats_dir={tmp_path / 'stats'}")
    return ["--data_dir", str(tmp_path / "images"), "--peer_python", sys.executable, "--peer_script",
            str(tmp_path / "peer.py"), "--network=" + NETWORK, "--ours=" + ours, "--epochs", "1",
            "--seeds", "2", "--fid_samples", "8", "--sample_steps", "2", "--out", str(tmp_path / "vs")]


def test_both_sides_train_the_same_network_and_a_finished_comparison_is_read_back(tmp_path, monkeypatch,
                                                                                  capsys):
    argv = setting(tmp_path, monkeypatch)
    done = vs.main(argv)
    out = tmp_path / "vs"
    theirs = json.loads((out / "theirs-s0" / "argv.json").read_text())
    assert {k: theirs[k] for k in ("train_batch_size", "num_epochs", "learning_rate", "lr_warmup_steps",
                                   "ddpm_num_steps", "ddpm_beta_schedule", "prediction_type")} == {
        "train_batch_size": "8", "num_epochs": "1", "learning_rate": "0.002", "lr_warmup_steps": "2",
        "ddpm_num_steps": "100", "ddpm_beta_schedule": "linear", "prediction_type": "epsilon"}
    assert theirs["use_ema"] and theirs["random_flip"] and theirs["model_config_name_or_path"] == str(
        out / "network")
    network = json.loads((out / "network" / "config.json").read_text())
    assert network["block_out_channels"] == [16, 32] and network["norm_num_groups"] == 8
    for s in range(2):
        assert done[f"ours-s{s}"]["steps"] == 2  # one epoch of 16 images in batches of 8
        config = json.loads((out / f"ours-s{s}" / "config.json").read_text())
        assert config["trainer"]["seed"] == s and config["model"]["base_channels"] == 16
        wall = max(1, round(2 * done[f"theirs-s{s}"]["wall_s"] / done[f"ours-s{s}"]["wall_s"]))
        assert done[f"ours-wall-s{s}"]["steps"] == wall
        for side in ("ours", "theirs", "ours-wall"):
            assert math.isfinite(done[f"{side}-s{s}-fid"]["fid"]) and done[f"{side}-s{s}-fid"]["n"] == 8
        same = done[f"ours-wall-s{s}"]["model"] == done[f"ours-s{s}"]["model"]
        assert (done[f"ours-wall-s{s}-fid"] == done[f"ours-s{s}-fid"]) == same
        assert (out / "fid" / f"ours-wall-s{s}.json").exists() != same  # the same model is scored once
    table = (out / "vs_diffusers.md").read_text()
    assert "| equal steps | ours | 2 |" in table and "| equal wall-clock | ours |" in table
    assert "| both | theirs | 2 |" in table
    # again: every step is read back from the record, nothing trained or scored again
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a finished step ran again"))
    monkeypatch.setattr(vs, "score", lambda *a, **k: pytest.fail("a finished score ran again"))
    capsys.readouterr()
    assert vs.main(argv) == done and capsys.readouterr().out.count("finished before") == len(done)


def test_without_equal_wall_clock_each_seed_trains_and_scores_two_models(tmp_path, monkeypatch):
    argv = setting(tmp_path, monkeypatch) + ["--no-equal_wall"]
    argv[argv.index("--seeds") + 1] = "1"
    done = vs.main(argv)
    assert sorted(done) == ["caches", "network", "ours-s0", "ours-s0-fid", "theirs-s0", "theirs-s0-fid"]
    table = (tmp_path / "vs" / "vs_diffusers.md").read_text()
    assert "| equal steps | ours | 2 |" in table and "equal wall-clock" not in table
    # a second seed: the same command with --seeds 2 trains and scores seed 1 only
    argv[argv.index("--seeds") + 1] = "2"
    again = vs.main(argv)
    assert {k: again[k] for k in done} == done and sorted(set(again) - set(done)) == [
        "ours-s1", "ours-s1-fid", "theirs-s1", "theirs-s1-fid"]
    assert "| 2 |" in (tmp_path / "vs" / "vs_diffusers.md").read_text()


def test_equal_wall_clock_added_later_continues_the_equal_steps_run_as_a_straight_run(tmp_path, monkeypatch):
    argv = setting(tmp_path, monkeypatch)
    argv[argv.index("--seeds") + 1] = "1"
    vs.main(argv + ["--no-equal_wall"])
    record = tmp_path / "vs" / vs.RECORD
    saved = json.loads(record.read_text())  # their run took 3x ours' time: ours makes 6 steps in it
    saved["done"]["theirs-s0"]["wall_s"] = 3 * saved["done"]["ours-s0"]["wall_s"]
    record.write_text(json.dumps(saved))
    done = vs.main(argv)  # the same study, now with equal wall-clock
    wall, ours = done["ours-wall-s0"], done["ours-s0"]
    assert wall["steps"] == 6 and wall["continued"] == ours["model"] and wall["wall_s"] > ours["wall_s"]
    ours_argv = vs.parse(argv)[1]
    straight = vs.train_ours(ours_argv, 6, str(tmp_path / "straight"), 0, "a straight run of 6 steps")
    a, b = (torch.load(os.path.join(os.path.dirname(r["model"]), "ckpt.pt"), weights_only=True)
            for r in (straight, wall))
    assert a["step"] == b["step"] == 6
    for part in ("model", "ema"):
        assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    assert "| equal wall-clock | ours | 6 |" in (tmp_path / "vs" / "vs_diffusers.md").read_text()


@pytest.mark.parametrize("change,needle", [
    (("--network", NETWORK + " --prediction=v"), "not prediction=v"),
    (("--peer_script", "/no/such/train_unconditional.py"), "no such file"),
    (("--ours", "--dataset=shapes"), "as an image folder"),
    (("--epochs", "0"), "--epochs in [1, 1e4]"),
])
def test_bad_settings_are_one_line_before_anything_runs(tmp_path, monkeypatch, capsys, change, needle):
    argv = setting(tmp_path, monkeypatch)
    at = next(i for i, a in enumerate(argv) if a == change[0] or a.startswith(change[0] + "="))
    argv[at:at + 1 + (argv[at] == change[0])] = [f"{change[0]}={change[1]}"]
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("something ran"))
    assert needle in one_line_error(capsys, vs.main, argv)


def test_a_record_of_other_settings_is_refused(tmp_path, monkeypatch, capsys):
    argv = setting(tmp_path, monkeypatch)
    (tmp_path / "vs").mkdir()
    (tmp_path / "vs" / vs.RECORD).write_text(json.dumps({"settings": {"epochs": 9}, "done": {}}))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("something ran"))
    assert "other settings" in one_line_error(capsys, vs.main, argv)


def test_missing_inception_weights_are_one_line_before_anything_trains(tmp_path, monkeypatch, capsys):
    argv = setting(tmp_path, monkeypatch)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("something ran"))
    monkeypatch.setattr(fid, "inception", INCEPTION)  # the real one: the weights are looked for
    argv += ["--inception_weights", str(tmp_path / "none.pth")]
    assert "--inception_weights" in one_line_error(capsys, vs.main, argv)
    assert not (tmp_path / "vs").exists()
    args, _, _, tc, _ = vs.parse(argv)  # and a file that is there reaches every sample.py that scores
    assert vs.score_argv(args, tc, "m", "o.png")[-2:] == ["--inception_weights", str(tmp_path / "none.pth")]

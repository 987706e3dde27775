"""scripts/levers.py: the lever table's runs at an equal image budget, read back when finished, refused in one
line when an arm is bad (tiny networks on the built-in shapes, bits/dim as the metric: no Inception)."""
import json
import math
import os
import subprocess
import sys

import pytest
from conftest import ROOT, TINY_ARGS, one_line_error

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import levers  # noqa: E402


def base(tmp_path):
    return " ".join([*TINY_ARGS, "--batch_size=16", "--loader=torch", "--ema_snapshot_kimg=0",
                     "--eval_bpd_images=8", "--eval_bpd_strata=2", f"--beton_dir={tmp_path / 'betons'}",
                     f"--fid_stats_dir={tmp_path / 'stats'}"])


def test_arms_run_at_equal_images_and_a_finished_study_is_read_back(tmp_path, capsys, monkeypatch):
    argv = ["--base", base(tmp_path), "--arm", "base=", "--arm", "batch8=--batch_size=8", "--kimg", "0.064",
            "--seeds", "2", "--metric", "bpd", "--out", str(tmp_path / "study")]
    results = levers.main(argv)
    assert results["base"]["steps"] == 4 and results["batch8"]["steps"] == 8  # 64 images each
    for r in results.values():
        assert len(r["values"]) == 2 and all(0 < v < 100 for v in r["values"])
        assert r["values"][0] != r["values"][1]  # two seeds, two runs
    for name, seed in (("base", 0), ("base", 1), ("batch8", 0), ("batch8", 1)):
        config = json.loads((tmp_path / "study" / f"{name}-s{seed}" / "config.json").read_text())
        assert config["trainer"]["seed"] == seed
    table = (tmp_path / "study" / "levers.md").read_text()
    assert "| batch8 | `--batch_size=8` |" in table and "0.064 kimg per run" in table
    saved = json.loads((tmp_path / "study" / "levers.json").read_text())
    assert saved["arms"] == json.loads(json.dumps(results))
    # run again: every run is read from its folder, none trained again
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a finished run was run again"))
    capsys.readouterr()
    again = levers.main(argv)
    assert again == results and capsys.readouterr().out.count("finished before") == 4


def test_the_table_reads_differences_against_two_sds():
    results = {"base": {"flags": "", "values": [10.0, 10.2, 9.8], "minutes": [1.0]},
               "a": {"flags": "--lr=1", "values": [8.0, 8.1, 7.9], "minutes": [1.0]},
               "b": {"flags": "--lr=2", "values": [10.1, 10.3, 9.9], "minutes": [1.0]},
               "c": {"flags": "--lr=3", "values": [12.0], "minutes": [2.0]}}
    rows = {line.split("|")[1].strip(): line for line in levers.table(results, "fid", 100).splitlines()
            if line.startswith("| ") and "arm" not in line}
    assert "-2.00: better" in rows["a"] and "within 2 s.d." in rows["b"]
    assert "10.00 ± 0.20" in rows["base"] and "+2.00: worse (the base's s.d.)" in rows["c"]
    assert "| 12.00 | 1 |" in rows["c"] and "nan" not in rows["c"]  # one seed: its value, no s.d.
    assert math.isnan(levers.summary([12.0])[1])
    one = {"base": {"flags": "", "values": [10.0], "minutes": [1.0]}, **{k: results[k] for k in "ac"}}
    assert levers.table(one, "fid", 100).count("(one seed of the base: no s.d.)") == 2


def test_runs_go_seed_by_seed_and_report_reads_what_finished(tmp_path, capsys, monkeypatch):
    order = []

    def fake_run(argv, out_dir, steps, metric, name):
        order.append(os.path.basename(out_dir))
        return {"step": steps, "bpd": 3.0 + len(order) / 10, "wall_s": 60.0, "eval_s": 30.0}

    argv = ["--base", base(tmp_path), "--arm", "a=--lr=1e-3", "--arm", "b=--dropout=0", "--kimg", "0.064",
            "--metric", "bpd", "--out", str(tmp_path / "study")]
    monkeypatch.setattr(levers, "run", fake_run)
    levers.main(argv + ["--seeds", "2"])
    assert order == ["base-s0", "a-s0", "b-s0", "base-s1", "a-s1", "b-s1"]  # every arm before a second seed
    study = json.loads((tmp_path / "study" / "levers.json").read_text())
    assert study["arms"]["a"]["minutes"] == [1.5, 1.5]  # the run's minutes include its evaluation
    # --report runs nothing and reads the folders: here one real run of the base, the rest missing
    monkeypatch.undo()
    levers.main(["--base", base(tmp_path), "--kimg", "0.064", "--seeds", "1", "--metric", "bpd",
                 "--arm", "base=", "--out", str(tmp_path / "real")])
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("--report ran a run"))
    capsys.readouterr()
    results = levers.main(["--base", base(tmp_path), "--kimg", "0.064", "--seeds", "2", "--metric", "bpd",
                           "--arm", "a=--lr=1e-3", "--out", str(tmp_path / "real"), "--report"])
    assert list(results) == ["base"] and len(results["base"]["values"]) == 1
    text = (tmp_path / "real" / "levers.md").read_text()
    assert "Not finished yet (3 of 4 runs): a-s0, base-s1, a-s1" in text and text == capsys.readouterr().out
    saved = json.loads((tmp_path / "real" / "levers.json").read_text())
    assert saved["not_finished"] == ["a-s0", "base-s1", "a-s1"]
    # with no finished run of the base there is nothing to read against: one line
    err = one_line_error(capsys, levers.main, ["--base", base(tmp_path), "--kimg", "0.064", "--metric", "bpd",
                                               "--arm", "a=--lr=1e-3", "--out", str(tmp_path / "x"),
                                               "--report"])
    assert "no run of the base has finished" in err and not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize("arm,needle", [
    ("x=--no_such_field=1", "no_such_field"),
    ("../x=--lr=1e-3", "a name is letters"),
])
def test_a_bad_arm_is_one_line_before_any_run(tmp_path, capsys, monkeypatch, arm, needle):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a run started"))
    err = one_line_error(capsys, levers.main, ["--base", base(tmp_path), "--arm", arm, "--kimg", "1",
                                               "--metric", "bpd", "--out", str(tmp_path / "s")])
    assert needle in err


def test_the_cpu_recipe_is_the_study_base_with_its_winning_lever():
    """cifar-cpu (issue 33) trains what the lever table measured: the study's base with the one arm that beat
    it, the unpatched narrow network; only the run's length, its FID curve at n = 5000 and the grids' sampler
    differ."""
    import dataclasses
    import shlex
    import ddpm
    mc, tc, _ = ddpm.parse_args(["--preset=cifar-cpu"])
    study_mc, study_tc, _ = ddpm.parse_args(shlex.split(levers.BASE + " " + levers.ARMS["patch1-narrow"]))
    assert mc == study_mc
    changed = {k for k, v in dataclasses.asdict(tc).items() if getattr(study_tc, k) != v}
    assert changed == {"dataset", "max_steps", "eval_every_steps", "eval_fid_samples", "ema_snapshot_kimg",
                       "ema_eval_sigma_rels", "ckpt_every_steps", "sampler", "sample_steps"}
    assert tc.dataset == "cifar10" and tc.eval_fid_samples == 5000 and tc.fid_ref_images == 10_000
    assert tc.max_steps * tc.batch_size == 400_000
    assert 3 * tc.eval_every_steps < tc.max_steps < 4 * tc.eval_every_steps  # 4 points, the last at the end


def test_cost_times_the_arms_in_turn_and_reads_each_against_the_base_by_round(tmp_path, capsys, monkeypatch):
    """--cost: real iterations of each arm (ddpm.iteration), alternating, never a run to the end; the ratio is
    the median of the per-round ratios, so a round slowed for every arm alike (the machine busy) cancels."""
    import ddpm
    calls, timers = [], []
    real_iteration = ddpm.iteration

    def iteration(b, x0, y, tc, step, shard=(0, 1)):
        calls.append((b.model.cfg.base_channels, step))
        assert x0.shape[1:] == (3, 16, 16) and x0.min() >= -1 and x0.max() <= 1
        return real_iteration(b, x0, y, tc, step, shard)

    # arm k's round r takes (k + 1) * 10 ms, 4 times that in rounds 3 and 4 (the machine busy for all) and
    # in round 2 for arm 1 alone: its median time is 8 times the base's, but it takes twice the base's time
    # in 4 rounds of 5
    class FakeTimer:
        def __init__(self, device):
            self.k, self.ms = len(timers), []
            timers.append(self)

        def start(self):
            pass

        def stop(self):
            r = len(self.ms)
            self.ms.append((self.k + 1) * 10.0 * (4 if r in (3, 4) or (r, self.k) == (2, 1) else 1))

        def read_ms(self):
            return self.ms

    monkeypatch.setattr(ddpm, "iteration", iteration)
    monkeypatch.setattr(levers.mfu, "StepTimer", FakeTimer)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("--cost started a run"))
    results = levers.main(["--base", base(tmp_path), "--arm", "wide=--base_channels=24", "--arm",
                           "mp=--mp_layers=true --batch_size=8", "--kimg", "1", "--cost", "5",
                           "--out", str(tmp_path / "c")])
    assert list(results) == ["base", "wide", "mp"]
    # two warm-up iterations of each arm as it is built, then one of each in turn, the steps counted on
    assert calls[:6] == [(16, 0), (16, 1), (24, 0), (24, 1), (16, 0), (16, 1)]
    assert calls[6:] == [(w, s) for s in range(2, 7) for w in (16, 24, 16)]
    # per image: mp's 30 ms for 8 images against the base's 10 ms for 16
    assert [results[a]["ratio"] for a in results] == [1.0, 2.0, 6.0] and results["mp"]["img_s"] == 8e3 / 30
    assert results["wide"]["ms"] == 80.0 and results["wide"]["img_s"] == 16 * 1e3 / 80.0
    text = (tmp_path / "c" / "cost.md").read_text()
    assert "| wide | `--base_channels=24` | 80.0 | 200.0 | 2.000 |" in text
    assert text == capsys.readouterr().out
    assert json.loads((tmp_path / "c" / "cost.json").read_text())["arms"] == json.loads(json.dumps(results))
    err = one_line_error(capsys, levers.main, ["--base", base(tmp_path), "--kimg", "1", "--cost", "5",
                                               "--report", "--out", str(tmp_path / "d")])
    assert "not with --report" in err and not os.path.exists(tmp_path / "d")

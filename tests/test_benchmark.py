"""FLOP counting against an analytic count, and the CPU ladder's rows."""
import json
import os

import pytest
import torch
from conftest import tiny_model

import benchmark
import ddpm
import ladder
from machinery.mfu import train_flops_per_image
from unet import Attention, UNet


def analytic_train_flops(mc):
    """Forward FLOPs from the layer shapes (2 per multiply-add), then x3 for forward + backward,
    less the input gradients nobody asks for (the image into conv_in, the sinusoids into time_mlp)."""
    model = UNet(mc)
    fwd, no_input_grad = {}, {model.conv_in, model.time_mlp[0]}

    def hook(m, inputs, out):
        x = inputs[0]
        if isinstance(m, torch.nn.Conv2d):
            f = (2 * m.out_channels * (m.in_channels // m.groups) * m.kernel_size[0] * m.kernel_size[1]
                 * out.shape[-2] * out.shape[-1])
        elif isinstance(m, torch.nn.Linear):
            f = 2 * m.in_features * m.out_features * (x.numel() // m.in_features)
        else:  # attention: Q Kᵀ and (softmax) V, each 2 · heads · L² · head_dim
            L = x.shape[-2] * x.shape[-1]
            f = 2 * 2 * m.heads * L * L * m.head_dim
        fwd[m] = fwd.get(m, 0) + f

    for m in model.modules():
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear, Attention)):
            m.register_forward_hook(hook)
    y = torch.zeros(1, dtype=torch.long) if mc.num_classes else None
    model(torch.zeros(1, mc.channels, mc.image_size, mc.image_size), torch.zeros(1, dtype=torch.long), y)
    return sum(3 * f - (f if m in no_input_grad else 0) for m, f in fwd.items())


@pytest.mark.parametrize("kw", [dict(), dict(attn_heads=2, attn_resolutions=(16, 8)),
                                dict(patch_size=2, attn_head_dim=8, attn_heads=4, num_classes=3)])
@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_flop_counter_matches_analytic_count(kw, attention):
    mc = tiny_model(**kw)
    if mc.patch_size == 2:
        mc.attn_resolutions = (4,)
    assert train_flops_per_image(UNet, mc, attention) == analytic_train_flops(mc)


def test_cpu_ladder_rows_are_well_formed(tmp_path):
    out = tmp_path / "ladder.json"
    benchmark.main(["--preset", "demo", "--device", "cpu", "--iters", "2", "--warmup", "1", "--base_batch",
                    "4", "--json", str(out)])
    result = json.load(open(out))
    names = [r["version"] for r in result["rows"]]
    assert names == [name.replace("patch_size P", "patch_size 2") for name, _ in ladder.LADDER]
    ran = [r for r in result["rows"] if "skipped" not in r]
    assert ran[0]["version"] == "baseline" and ran[0]["speedup"] == 1.0 and ran[0]["batch"] == 4
    assert (ran[0]["precision"], ran[0]["attention"], ran[0]["loader"]) == ("fp32", "math", "dataloader")
    for r in ran:
        assert r["step_ms"] > 0 and r["img_per_s"] > 0 and r["tflops"] > 0 and 0 < r["mfu_measured"] < 2
        assert r["img_per_s"] == pytest.approx(r["batch"] / r["step_ms"] * 1e3)
    skipped = {r["version"]: r["skipped"] for r in result["rows"] if "skipped" in r}
    assert "torch.compile" in skipped  # off on the CPU unless --cpu_compile
    assert {"fp16 autocast", "checkpointing at the largest batch",
            "patch_size 2 at the largest batch"} <= set(skipped)
    assert skipped["fused GroupNorm+SiLU (Triton)"] == "the fused Triton kernel runs on CUDA devices only"
    by = {r["version"]: r for r in ran}
    # the rows that vary their row alone, and that nothing after them inherits their change
    assert (by["grad accumulation x4"]["accum_steps"],
            by["activation checkpointing"]["activation_checkpointing"]) \
        == (4, True)
    last = by["patch_size 2"]
    assert (last["accum_steps"], last["activation_checkpointing"], last["patch_size"]) == (1, False, 2)
    assert last["batch"] == by["scale up batch"]["batch"] == by["activation checkpointing"]["batch"]


def test_fp16_rows_step_through_the_loss_scaler(monkeypatch):
    """The fp16 row's step is train()'s: GradScaler scales the loss and updates its scale (on the CPU
    here)."""
    import data

    built = []
    real = ddpm.build
    monkeypatch.setattr(ddpm, "build", lambda *a, **kw: built.append(real(*a, **kw)) or built[-1])
    mc = tiny_model()
    row = dict(ladder.LADDER[0][1], precision="fp16", attention="sdpa", loader="resident")
    images, labels, _ = data.shapes(64, mc.image_size)
    ms, mem, prof = ladder.time_steps(mc, row, 4, torch.device("cpu"), images, labels, None, warmup=1,
                                      iters=2)
    assert ms > 0 and mem is None and prof is None
    scalers = [b.scaler for b in built]
    assert len(scalers) == 1 and scalers[0].get_scale() == 2.0**16  # no overflow in 3 steps: scale unchanged
    assert scalers[0]._get_growth_tracker() == 3


def test_sampling_table_across_patch_sizes(tmp_path, capsys):
    out = tmp_path / "sample.json"
    rows = benchmark.main(["--sample", "--preset", "demo", "--device", "cpu", "--patch_sizes", "1,2,16",
                           "--sample_steps", "2", "--sample_batch", "2", "--base_channels=32",
                           "--json", str(out)])
    assert rows == json.load(open(out))["rows"]
    p1, p2, p16 = rows
    assert "skipped" in p16  # a 16 px image has no 16x16 patches with levels below them
    for r in (p1, p2):
        assert r["nfe_per_image"] == 4 and r["steps"] == 2 and r["guidance"] == 2.0  # the demo's guidance
        assert r["img_per_s"] > 0 and r["s_per_img"] == pytest.approx(1 / r["img_per_s"])
    assert p1["gflop_per_image"] / p2["gflop_per_image"] == pytest.approx(p2["flops_ratio"])
    assert p2["flops_ratio"] > 3.5
    assert "| 2 | 2 | 2 |" in capsys.readouterr().out


@pytest.mark.parametrize("args,needle", [(["--patch_sizes", "1,x"], "--patch_sizes"),
                                         (["--sample_steps", "5000"], "sample_steps"),
                                         (["--base_channels=0"], "base_channels"), (["stray"], "stray"),
                                         (["--precision=fp16"], "only ModelConfig fields")])
def test_bad_sampling_arguments_are_one_line(capsys, args, needle):
    from conftest import one_line_error

    assert needle in one_line_error(capsys, benchmark.main, ["--sample", "--preset", "demo", "--device",
                                                             "cpu", *args])


def test_batch_search_doubles_until_the_first_out_of_memory(monkeypatch):
    tried = []

    def fake_time_steps(mc, row, batch, *args, **kw):
        tried.append((batch, row["compile"], row["loader"]))
        if batch > 512:
            raise torch.cuda.OutOfMemoryError("out of memory")
        return 1.0, None, None

    monkeypatch.setattr(ladder, "time_steps", fake_time_steps)
    row = {"compile": True, "loader": "ffcv", "precision": "bf16", "attention": "sdpa"}
    images, labels = torch.zeros(256, 3, 16, 16, dtype=torch.uint8), torch.zeros(256, dtype=torch.long)
    assert ladder.largest_batch(tiny_model(), row, torch.device("cpu"), images, labels, 128, 16384) == 512
    assert [b for b, _, _ in tried] == [128, 256, 512, 1024]
    # eager, batches from host memory (more images are drawn when a batch outgrows them)
    assert all(not compiled and loader == "host" for _, compiled, loader in tried)


def test_a_ladder_cut_short_keeps_and_prints_its_rows(tmp_path, monkeypatch, capsys):
    """Ctrl-C (or gpu_bench.sh's `timeout -s INT`) in the third measured row: the first two are saved, with
    speedups, and printed as the table; the exit status says the ladder is incomplete."""
    calls = []

    def fake_time_steps(mc, row, batch, *args, **kw):
        calls.append(batch)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return 100.0 / len(calls), None, None

    monkeypatch.setattr(ladder, "time_steps", fake_time_steps)
    out = tmp_path / "cut.json"
    with pytest.raises(SystemExit) as e:
        benchmark.main(["--preset", "demo", "--device", "cpu", "--json", str(out)])
    assert e.value.code == 130
    rows = [r for r in json.load(open(out))["rows"] if "skipped" not in r]
    assert [r["version"] for r in rows] == ["baseline", "scale up batch"]
    assert rows[0]["speedup"] == 1.0
    assert rows[1]["speedup"] == pytest.approx(2 * rows[1]["batch"] / rows[0]["batch"])
    table = capsys.readouterr().out.split("interrupted in the row 'PyTorch SDPA'")[1]
    assert "| baseline |" in table and "| scale up batch |" in table and "| PyTorch SDPA |" not in table


def test_batch_search_says_when_not_even_the_first_batch_fits(monkeypatch):
    def oom(*args, **kw):
        raise torch.cuda.OutOfMemoryError("out of memory")

    monkeypatch.setattr(ladder, "time_steps", oom)
    # the ladder's row records it as skipped
    with pytest.raises(RuntimeError, match="even batch 128 does not fit"):
        ladder.largest_batch(tiny_model(), {}, torch.device("cpu"),
                             torch.zeros(512, 3, 16, 16, dtype=torch.uint8),
                             torch.zeros(512, dtype=torch.long), 128, 16384)


@pytest.mark.parametrize("preset,q,attn", [("ffhq-p4", 1, (64, 32)), ("ffhq-p4", 8, (8, 4)),
                                           ("lsun-p2", 4, (8, 4)),
                                           ("seed", 2, (16, 8, 4, 2))])
def test_any_patch_size_attends_over_the_same_regions(preset, q, attn):
    mc, tc, _ = ddpm.parse_args(["--preset", preset])
    row = benchmark.repatched(mc, q)
    assert (row.patch_size, row.attn_resolutions) == (q, attn)
    ddpm.validate(row, tc)  # a model that exists: the paper's P = 4 against P = 1 comparison can run


def test_gpu_bench_dry_run_runs_every_command_on_the_cpu(tmp_path):
    """scripts/gpu_bench.sh --dry-run: the GPU script's every command, with tiny settings on the CPU, so its
    plumbing is tested although no GPU has run it. About two minutes on 2 cores."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    out = tmp_path / "gpu"
    proc = subprocess.run(["bash", "scripts/gpu_bench.sh", "--dry-run", str(out)], cwd=ROOT,
                          capture_output=True,
                          text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    status = dict(line.split() for line in (out / "status.txt").read_text().splitlines())
    assert status == {k: "0" for k in ("gpu_tests", "seed", "ho", "patch", "sample", "vs_diffusers",
                                       "vs_sampling")}
    seed = json.loads((out / "seed.json").read_text())["rows"]
    assert {r["version"] for r in seed if "skipped" not in r} >= {"baseline", "grad accumulation x4",
                                                                  "activation checkpointing", "patch_size 2"}
    patch = json.loads((out / "patch.json").read_text())["rows"]
    # from --start
    assert [r["version"] for r in patch if "skipped" not in r] == ["PyTorch SDPA", "patch_size 1"]
    assert patch[0]["skipped"] == "above --start (its settings taken as given)"
    assert all(r["profile"]["shares"] for r in seed + patch if "skipped" not in r)  # --profile
    assert [r["patch_size"] for r in json.loads((out / "sample.json").read_text())["rows"]] == [1, 2]
    vs = {r["config"]: r for r in json.loads((out / "vs_diffusers.json").read_text())["rows"]}
    assert set(vs) == {"theirs bf16", "ours eager"} and vs["ours eager"]["vs_theirs_bf16"] > 0
    assert "| ours eager | 2 |" in (out / "vs_diffusers.md").read_text()
    sampling = {r["config"]: r for r in json.loads((out / "vs_sampling.json").read_text())["rows"]}
    assert set(sampling) == {"theirs bf16", "ours eager", "ours graphed"}
    assert sampling["ours graphed"]["share_differing"] < 0.05 and sampling["ours eager"]["vs_theirs_bf16"] > 0


@pytest.mark.parametrize("flag", ["--rows", "--skip"])
def test_an_unknown_row_name_is_one_line(capsys, flag):
    from conftest import one_line_error

    err = one_line_error(capsys, benchmark.main, ["--preset", "demo", "--device", "cpu", flag,
                                                  "baseline,torch.compil"])
    assert "torch.compil;" in err and "torch.compile" in err


def test_rows_without_the_baseline_start_from_it(monkeypatch, tmp_path):
    monkeypatch.setattr(ladder, "time_steps", lambda *a, **kw: (10.0, None, None))
    out = tmp_path / "rows.json"
    benchmark.main(["--preset", "demo", "--device", "cpu", "--rows", "PyTorch SDPA", "--json", str(out)])
    ran = [r for r in json.load(open(out))["rows"] if "skipped" not in r]
    assert len(ran) == 1 and ran[0]["version"] == "PyTorch SDPA"
    assert (ran[0]["attention"], ran[0]["precision"], ran[0]["loader"], ran[0]["accum_steps"]) == (
        "sdpa", "fp32", "dataloader", 1)


def test_a_ladder_row_times_the_iteration_train_runs(monkeypatch):
    """Each timed step is ddpm.iteration at the next step number: the LR schedule and the EMA's warm-up decay
    as train() has them (the row's TrainerConfig), not a step of its own."""
    import data

    seen = []
    real = ddpm.iteration
    monkeypatch.setattr(ddpm, "iteration",
                        lambda b, x0, y, tc, step, *a: seen.append(step) or real(b, x0, y, tc, step, *a))
    mc = tiny_model()
    images, labels, _ = data.shapes(64, mc.image_size)
    row = dict(ladder.LADDER[0][1], attention="sdpa", loader="resident")
    ladder.time_steps(mc, row, 4, torch.device("cpu"), images, labels, None, warmup=1, iters=2)
    assert seen == [0, 1, 2]


def test_the_cpu_peak_is_the_best_this_machine_has_shown(tmp_path, monkeypatch, capsys):
    """A start-up under load measures a low peak, which would inflate MFU: the best rate seen for the
    machine is remembered and used; a damaged table is said in one warning line and written anew, and a
    link planted at its folder is never written through."""
    from machinery import mfu

    monkeypatch.setattr(mfu, "PEAK_CACHE", str(tmp_path / "ddpm" / "peaks.json"))
    assert mfu.remembered_best("cpu A", 2e11) == 2e11
    assert mfu.remembered_best("cpu A", 1e11) == 2e11  # measured under load: the remembered best stands
    assert mfu.remembered_best("cpu B", 5e10) == 5e10
    assert json.load(open(tmp_path / "ddpm" / "peaks.json")) == {"cpu A": 2e11, "cpu B": 5e10}
    (tmp_path / "ddpm" / "peaks.json").write_text('{"cpu A": true}')
    capsys.readouterr()
    assert mfu.remembered_best("cpu A", 1e11) == 1e11
    assert "is not a table of peaks" in capsys.readouterr().out
    assert json.load(open(tmp_path / "ddpm" / "peaks.json")) == {"cpu A": 1e11}
    victim = tmp_path / "victim"
    victim.mkdir()
    monkeypatch.setattr(mfu, "PEAK_CACHE", str(tmp_path / "linked" / "peaks.json"))
    os.symlink(victim, tmp_path / "linked")
    assert mfu.remembered_best("cpu A", 1e11) == 1e11
    assert "cannot remember the CPU peak" in capsys.readouterr().out and os.listdir(victim) == []
    _, source = mfu.peak_flops(torch.device("cpu"), "fp32")
    assert source == "the best torch.float32 matmul measured on this cpu"

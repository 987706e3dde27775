"""FID you can trust, at scale: per-image seeds (the images do not depend on --batch, processes or
interruptions), resumable shards that refuse other settings, outputs others can score (ADM's arr_0, PNGs),
the protocol in the result, and evaluate.py --fid scoring an .npz, a folder or a dataset split."""
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
import zipfile

import numpy as np
import pytest
import torch
from conftest import ROOT, one_line_error
from PIL import Image
from test_fid import TinyFeatures
from test_survive import free_port

import ddpm
import evaluate
import sample
import sampling
from machinery import fid, files, shards

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # two processes on two cores; the one-process runs alike
# sample.py in a subprocess, with the small feature extractor of test_fid in place of InceptionV3
LAUNCHER = f"""import sys
sys.path[:0] = [{ROOT!r}, {os.path.join(ROOT, 'tests')!r}]
import sample
from machinery import fid
from test_fid import TinyFeatures
fid.inception = lambda device, weights=None: TinyFeatures()
sample.main(sys.argv[1:])
"""


def common(run_dir, out, *extra):
    return ["--ckpt", str(run_dir / "ema.pt"), "--guidance", "1.5", "--out", str(out), *extra]


def launch(tmp_path, argv, world=1, **kw):
    script = tmp_path / "launch.py"
    script.write_text(LAUNCHER)
    runner = [sys.executable] if world == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={world}",
        "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}"]
    return subprocess.run([*runner, str(script), *argv], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=1800, **kw)


# ---- seeds


def test_each_image_has_its_own_noise_and_one_image_is_diffusion_sample(run_dir):
    """Row j of ImageNoise is image indices[j]'s own stream, whatever else is in the batch; and one image
    drawn with noise=ImageNoise is Diffusion.sample's with that image's generator, bit for bit."""
    noise3, noise1 = sampling.ImageNoise(7, [4, 5, 6]), sampling.ImageNoise(7, [5])
    for _ in range(3):  # z_T, then two steps' draws: each image's in its own order
        assert torch.equal(noise3((3, 3, 4, 4))[1], noise1((1, 3, 4, 4))[0])
    assert sampling.image_seed(0, 1) != sampling.image_seed(1, 0) and 0 <= sampling.image_seed(2**63 - 1,
                                                                                               10**9) < 2**63
    model, mc, _ = ddpm.load_ema(str(run_dir / "ema.pt"), "cpu")
    diffusion = ddpm.Diffusion(mc)
    for sampler, eta in (("ddpm", 0.0), ("ddim", 0.5), ("heun", 0.0)):
        kw = dict(sampler=sampler, steps=4, y=torch.tensor([2]), guidance=1.5, eta=eta, threshold="dynamic",
                  percentile=0.9)
        ours = ddpm.sample(diffusion, model, (1, 3, 16, 16), noise=sampling.ImageNoise(3, [9]), **kw)
        theirs = ddpm.sample(diffusion, model, (1, 3, 16, 16), generator=torch.Generator().manual_seed(
            sampling.image_seed(3, 9)), **kw)
        assert torch.equal(ours, theirs), sampler


@pytest.mark.parametrize("sampler,steps,eta", [("ddpm", 6, ()), ("ddim", 4, ("--eta", "0.5"))])
def test_images_are_the_same_for_any_batch(run_dir, tmp_path, sampler, steps, eta):
    """Image i comes from (seed, i) alone: --batch 1, 3 and 8 draw the same 8 images, labels cycling."""
    runs = {}
    for batch in (1, 3, 8):
        out = tmp_path / f"b{batch}.png"
        sample.main(common(run_dir, out, "--n", "8", "--batch", str(batch), "--sampler", sampler, "--steps",
                           str(steps), *eta, "--device", "cpu", "--seed", "5"))
        runs[batch] = np.load(tmp_path / f"b{batch}.npz")
    assert runs[1]["arr_0"].std() > 0 and runs[1]["arr_1"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    for batch in (3, 8):
        assert np.array_equal(runs[batch]["arr_0"], runs[1]["arr_0"]), batch
        assert np.array_equal(runs[batch]["arr_1"], runs[1]["arr_1"])
    other = tmp_path / "seed6.png"
    sample.main(common(run_dir, other, "--n", "8", "--sampler", sampler, "--steps", str(steps), *eta,
                       "--device", "cpu", "--seed", "6"))
    assert not np.array_equal(np.load(tmp_path / "seed6.npz")["arr_0"], runs[1]["arr_0"])


# ---- processes and interruptions


def test_two_processes_write_the_same_npz_and_fid_as_one(run_dir, tmp_path):
    """torchrun with 2 gloo processes: the same .npz, byte for byte, the same PNGs and the same FID as one
    process; one result, from rank 0."""
    argv = common(run_dir, "{out}", "--num_images", "10", "--batch", "2", "--shard_size", "2", "--sampler",
                  "ddpm",
                  "--steps", "5", "--eval", "fid", "--stats_dir", str(tmp_path / "stats"),
                  "--png_dir", "{png}")
    results = {}
    for world in (1, 2):
        out, png = tmp_path / f"w{world}" / "s.png", tmp_path / f"w{world}" / "png"
        done = launch(tmp_path, [a.format(out=out, png=png) for a in argv], world)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "warning: FID is biased upward at small n" in done.stdout
        results[world] = json.loads((tmp_path / f"w{world}" / "s.json").read_text())
        assert not (tmp_path / f"w{world}" / "s.shards").exists()  # removed once the outputs are written
    one, two = (tmp_path / "w1" / "s.npz").read_bytes(), (tmp_path / "w2" / "s.npz").read_bytes()
    assert one == two
    assert results[2]["world_size"] == 2 and results[2]["drawn"] == 10
    assert results[1]["fid"] == results[2]["fid"] and np.isfinite(results[1]["fid"])
    images = np.load(tmp_path / "w2" / "s.npz")["arr_0"]
    names = sorted(os.listdir(tmp_path / "w2" / "png"))
    assert names == [f"{i:06d}.png" for i in range(10)]
    for i, name in enumerate(names):
        assert np.array_equal(np.asarray(Image.open(tmp_path / "w2" / "png" / name)), images[i])


def test_an_interrupted_run_continues_to_the_same_npz(run_dir, tmp_path, capsys, monkeypatch):
    """Ctrl-C after 2 of 5 shards: one line, the 2 shards kept; the same command then draws the other 3
    and writes the .npz a straight run writes, byte for byte."""
    argv = common(run_dir, tmp_path / "cut.png", "--n", "10", "--batch", "3", "--shard_size", "2",
                  "--sampler", "ddpm", "--steps", "5")
    real, saved = shards.save, []

    def interrupted(plan, k, *args):
        if len(saved) == 2:
            raise KeyboardInterrupt
        saved.append(k)
        real(plan, k, *args)

    monkeypatch.setattr(shards, "save", interrupted)
    err = one_line_error(capsys, sample.main, argv, code=1)
    assert "stopped by a signal" in err and "cut.shards" in err
    monkeypatch.setattr(shards, "save", real)
    assert sorted(os.listdir(tmp_path / "cut.shards")) == [".manifest.lock", "manifest.json",
                                                           "shard-000000.npz", "shard-000001.npz"]
    assert not (tmp_path / "cut.npz").exists()
    resumed = sample.main(argv)
    assert (resumed["resumed"], resumed["drawn"], resumed["nfe_per_image"]) == (4, 6, 10)
    assert "resuming: 4/10 images already drawn" in capsys.readouterr().out
    straight = sample.main(common(run_dir, tmp_path / "straight.png", "--n", "10", "--batch", "3",
                                  "--shard_size", "2", "--sampler", "ddpm", "--steps", "5"))
    assert straight["resumed"] == 0
    assert (tmp_path / "cut.npz").read_bytes() == (tmp_path / "straight.npz").read_bytes()


def test_sigterm_stops_and_the_same_command_continues(run_dir, tmp_path):
    """What a scheduler sends: SIGTERM mid-run stops after whole shards with one line and status 1; the same
    command finishes with the images of an uninterrupted run."""
    argv = common(run_dir, tmp_path / "cut" / "s.png", "--n", "48", "--batch", "2", "--shard_size", "2",
                  "--sampler", "ddpm", "--steps", "20")
    script = tmp_path / "launch.py"
    script.write_text(LAUNCHER)
    p = subprocess.Popen([sys.executable, str(script), *argv], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    first, deadline = tmp_path / "cut" / "s.shards" / "shard-000000.npz", time.time() + 1800  # hang guard
    while not first.exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=1800)
    assert p.returncode == 1 and err.count("\n") == 1 and "stopped by a signal" in err, err
    shards = [f for f in os.listdir(tmp_path / "cut" / "s.shards") if f.startswith("shard-")]
    assert 1 <= len(shards) < 24
    again = launch(tmp_path, argv)
    assert again.returncode == 0 and "resuming:" in again.stdout, again.stderr
    straight = launch(tmp_path, [a.replace(str(tmp_path / "cut"), str(tmp_path / "straight")) for a in argv])
    assert straight.returncode == 0, straight.stderr
    assert (tmp_path / "cut" / "s.npz").read_bytes() == (tmp_path / "straight" / "s.npz").read_bytes()


def test_shards_of_other_settings_are_refused_in_one_line(run_dir, tmp_path, capsys):
    """A shard folder of other settings (a seed, a sampler, other weights) is never mixed in; the same EMA
    weights from ckpt.pt or ema.pt are the same checkpoint."""
    def argv(out, *extra):
        return ["--ckpt", str(run_dir / "ckpt.pt"), "--n", "4", "--batch", "2", "--shard_size", "2",
                "--steps", "2", "--keep_shards", "--out", str(out), *extra]

    sample.main(argv(tmp_path / "a.png"))
    manifest = json.loads((tmp_path / "a.shards" / "manifest.json").read_text())["settings"]
    assert manifest["seed"] == 0 and manifest["shard_size"] == 2 and len(manifest["checkpoint"]) == 64
    err = one_line_error(capsys, sample.main, argv(tmp_path / "a.png", "--seed", "1"))
    assert "a.shards holds images of other settings (seed 0 there, 1 here)" in err
    err = one_line_error(capsys, sample.main, argv(tmp_path / "a.png", "--sampler", "ddpm"))
    assert "sampler 'ddim' there, 'ddpm' here" in err
    ckpt = torch.load(run_dir / "ema.pt", weights_only=True)
    ckpt["ema"] = {k: v + 1e-3 if v.is_floating_point() else v for k, v in ckpt["ema"].items()}
    torch.save(ckpt, tmp_path / "other.pt")
    err = one_line_error(capsys, sample.main, [*argv(tmp_path / "a.png")[2:], "--ckpt",
                                               str(tmp_path / "other.pt")])
    assert "holds images of other settings (checkpoint" in err
    same = sample.main([*argv(tmp_path / "a.png")[2:], "--ckpt", str(run_dir / "ema.pt")])
    assert same["drawn"] == 0 and same["resumed"] == 4 and same["img_per_s"] is None
    # one shard of another seed slipped into a folder whose manifest matches: refused too
    sample.main(argv(tmp_path / "b.png", "--seed", "1"))
    os.replace(tmp_path / "a.shards" / "shard-000001.npz", tmp_path / "b.shards" / "shard-000001.npz")
    err = one_line_error(capsys, sample.main, argv(tmp_path / "b.png", "--seed", "1"))
    assert "shard-000001.npz holds images of other settings (seed 0 there, 1 here)" in err
    (tmp_path / "b.shards" / "manifest.json").write_text("not json")
    err = one_line_error(capsys, sample.main, argv(tmp_path / "b.png", "--seed", "1"))
    assert "is not a manifest sample.py wrote" in err


# ---- outputs


def test_the_npz_is_the_adm_evaluators_layout_and_pngs_match_it(run_dir, tmp_path, capsys):
    """arr_0: uint8 (N, H, W, 3) in C order and arr_1: int64 labels, stored (uncompressed) .npy entries as
    np.savez writes them, which guided-diffusion's evaluator reads; --png_dir holds the same images."""
    sample.main(common(run_dir, tmp_path / "s.png", "--n", "5", "--batch", "2", "--shard_size", "2",
                       "--steps", "2", "--png_dir", str(tmp_path / "png")))
    with zipfile.ZipFile(tmp_path / "s.npz") as zf:
        assert [i.filename for i in zf.infolist()] == ["arr_0.npy", "arr_1.npy"]
        assert all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())
        with zf.open("arr_0.npy") as f:  # as the ADM evaluator's NpzArrayReader reads it
            version = np.lib.format.read_magic(f)
            assert np.lib.format.read_array_header_1_0(f) == ((5, 16, 16, 3), False, np.dtype(np.uint8))
            assert version == (1, 0)
    z = np.load(tmp_path / "s.npz")
    images = z["arr_0"]
    assert images.dtype == np.uint8 and images.shape == (5, 16, 16, 3) and images.flags.c_contiguous
    assert z["arr_1"].dtype == np.int64 and z["arr_1"].tolist() == [0, 1, 2, 3, 0]
    assert images.std() > 0
    assert torch.equal(torch.cat(list(evaluate.NpzImages(str(tmp_path / "s.npz")).batches(2))),
                       torch.from_numpy(images).permute(0, 3, 1, 2))
    for i in range(5):
        assert np.array_equal(np.asarray(Image.open(tmp_path / "png" / f"{i:06d}.png")), images[i])
    (tmp_path / "png" / "stray.jpg").write_bytes(b"x")
    err = one_line_error(capsys, sample.main, common(run_dir, tmp_path / "t.png", "--png_dir",
                                                     str(tmp_path / "png")))
    assert "holds 1 other files (stray.jpg" in err


def test_the_npz_is_written_shard_by_shard(tmp_path):
    """write_npz streams: of 10 chunks of 3 MB (30 MB in all) at most the one written and the next being made
    are in memory at once, and the file reads back whole; the same images give the same bytes (no
    timestamps)."""
    def chunks():
        for k in range(10):
            yield np.full((16, 256, 256, 3), k, np.uint8), np.full(16, k, np.int64)

    tracemalloc.start()
    try:
        files.write_npz(str(tmp_path / "a.npz"), (160, 256, 256, 3), chunks())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * 16 * 256 * 256 * 3
    z = np.load(tmp_path / "a.npz")
    assert z["arr_0"].shape == (160, 256, 256, 3) and (z["arr_0"][::16, 0, 0, 0] == np.arange(10)).all()
    assert z["arr_1"].tolist() == [k for k in range(10) for _ in range(16)]
    files.write_npz(str(tmp_path / "b.npz"), (160, 256, 256, 3), chunks())
    assert (tmp_path / "a.npz").read_bytes() == (tmp_path / "b.npz").read_bytes()


# ---- the protocol


def test_the_result_records_the_protocol(run_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fid, "inception", lambda device, weights=None: TinyFeatures())
    result = sample.main(common(run_dir, tmp_path / "s.png", "--eval", "fid", "--n", "12", "--batch", "4",
                                "--steps", "3", "--stats_dir", str(tmp_path / "stats")))
    out = capsys.readouterr().out
    assert out.count("warning: FID is biased upward at small n (12 < 50,000 samples)") == 1
    assert result == json.loads((tmp_path / "s.json").read_text())
    assert {k: result[k] for k in ("n", "sampler", "steps", "guidance", "threshold", "seed",
                                   "weights")} == dict(
        n=12, sampler="ddim", steps=3, guidance=1.5, threshold="static", seed=0, weights="EMA")
    assert result["checkpoint"]["step"] == 3 and result["checkpoint"]["path"] == str(run_dir / "ema.pt")
    model, _, _ = ddpm.load_ema(str(run_dir / "ema.pt"), "cpu")
    assert result["checkpoint"]["sha256"] == sampling.weights_sha256(model)
    ref = result["reference_stats"]
    assert (ref["dataset"], ref["split"], ref["images"], ref["image_size"]) == ("shapes", "train", 512, 16)
    with np.load(ref["cache"]) as z:
        assert ref["sha256"] == fid.stats_sha256(z)
    assert result["inception"]["network"] == "tiny" and result["inception"]["torch_fidelity"]
    assert "per image" in result["noise"] and "biased upward" in result["fid_note"]


def random_inception_weights(path, monkeypatch):
    """torch-fidelity's InceptionV3 with random weights, saved as its weights file (no download)."""
    fe = pytest.importorskip("torch_fidelity.feature_extractor_inceptionv3")
    with monkeypatch.context() as m:
        m.setattr(fe, "load_state_dict_from_url", lambda *a, **k: {})
        m.setattr(torch.nn.Module, "load_state_dict", lambda self, *a, **k: None)
        net = fe.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"])
    torch.save(net.state_dict(), path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_local_inception_weights_are_hashed_and_a_wrong_file_is_one_line(tmp_path, monkeypatch, capsys):
    sha = random_inception_weights(tmp_path / "inception.pth", monkeypatch)
    images = np.random.default_rng(0).integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
    np.savez(tmp_path / "x.npz", images)
    result = evaluate.main(["--fid", str(tmp_path / "x.npz"), str(tmp_path / "x.npz"), "--inception_weights",
                            str(tmp_path / "inception.pth"), "--out", str(tmp_path / "r.json")])
    assert result["inception"]["weights_sha256"] == sha and result["fid"] == pytest.approx(0, abs=1e-3)
    assert json.loads((tmp_path / "r.json").read_text())["inception"]["weights_sha256"] == sha
    assert fid.json_safe({"inception_score": float("nan"), "fid": 1.5, "n": 4}) == dict(
        inception_score=None, fid=1.5, n=4)  # the offline weights' IS: null, never NaN in the .json
    monkeypatch.setenv(fid.WEIGHTS_ENV, str(tmp_path / "inception.pth"))
    assert fid.inception("cpu").weights_sha256 == sha
    torch.save({"fc.weight": torch.zeros(3, 3)}, tmp_path / "other.pth")
    for bad, needle in ((tmp_path / "other.pth", "is not the Inception weights file"),
                        (tmp_path / "x.npz", "is not the Inception weights file"),
                        (tmp_path / "missing.pth", "no such file")):
        err = one_line_error(capsys, evaluate.main, ["--fid", str(tmp_path / "x.npz"),
                                                     str(tmp_path / "x.npz"),
                                                     "--inception_weights", str(bad)])
        assert needle in err and "--inception_weights" in err
    monkeypatch.setenv(fid.WEIGHTS_ENV, str(tmp_path / "other.pth"))
    err = one_line_error(capsys, evaluate.main, ["--fid", str(tmp_path / "x.npz"), str(tmp_path / "x.npz")])
    assert f"${fid.WEIGHTS_ENV}" in err and "is not the Inception weights file" in err


# ---- evaluate.py --fid A B


def test_evaluate_scores_npz_folders_and_dataset_splits(run_dir, tmp_path, monkeypatch, capsys):
    """The test split against the training split is close, noise is far, a folder of PNGs scores as the
    .npz of the same images, and the reference's statistics are cached (a split's, an .npz's by content)."""
    ext = TinyFeatures()
    monkeypatch.setattr(fid, "inception", lambda device, weights=None: ext)
    common_args = ["--image_size", "16", "--shapes_count", "256", "--stats_dir", str(tmp_path / "stats"),
                   "--batch", "64"]
    sanity = evaluate.main(["--fid", "shapes:test", "shapes:train", *common_args])
    assert os.listdir(tmp_path / "stats") == ["shapes-train-16px-n256-tiny.npz"]
    calls = ext.calls
    noise = np.random.default_rng(0).integers(0, 256, (256, 16, 16, 3), dtype=np.uint8)
    np.savez(tmp_path / "noise.npz", noise)
    far = evaluate.main(["--fid", str(tmp_path / "noise.npz"), "shapes:train", *common_args[2:]])
    assert ext.calls == calls + 4  # the reference from the cache: only the 256 noise images went through
    assert far["fid"] > 20 * sanity["fid"] and far["reference_stats"]["image_size"] == 16  # the .npz's size
    assert sanity["reference"] == "shapes:train, 256 images" and sanity["reference_stats"]["split"] == "train"
    assert sanity["n"] == 256 and sanity["samples"] == "shapes:test"
    sample.main(common(run_dir, tmp_path / "s.png", "--n", "20", "--steps", "2", "--png_dir",
                       str(tmp_path / "png")))
    argv = ["--fid", f"folder:{tmp_path / 'png'}", str(tmp_path / "s.npz"),
            "--stats_dir", str(tmp_path / "st")]
    calls = ext.calls
    same = evaluate.main(argv)
    assert same["fid"] == pytest.approx(0, abs=1e-3) and same["reference_stats"]["kind"] == "npz"
    assert ext.calls == calls + 2 and len(os.listdir(tmp_path / "st")) == 1  # B cached by its content
    again = evaluate.main(argv)
    assert ext.calls == calls + 3 and again["fid"] == same["fid"]  # B's statistics from the cache
    out = capsys.readouterr().out
    assert "FID " in out and "warning: FID is biased upward at small n" in out


@pytest.mark.parametrize("make,spec,needle", [
    (None, "{d}/nothing", "neither an .npz file, an image folder"),
    (None, "cifar10:val", "neither an .npz file"),
    (None, "{d}/missing.npz", "is not a readable .npz"),
    (lambda d: (d / "t.npz").write_bytes(b"PK\x03\x04 cut"), "{d}/t.npz", "is not a readable .npz"),
    (lambda d: np.savez(d / "k.npz", other=np.zeros(3)), "{d}/k.npz", "holds no images"),
    (lambda d: np.savez(d / "f.npz", np.zeros((2, 8, 8, 3))), "{d}/f.npz", "are uint8 (N, H, W, 3)"),
    (lambda d: (d / "empty").mkdir(), "{d}/empty", "holds no images"),
])
def test_evaluate_bad_operands_are_one_line(tmp_path, capsys, monkeypatch, make, spec, needle):
    monkeypatch.setattr(fid, "inception", lambda device, weights=None: TinyFeatures())
    np.savez(tmp_path / "ok.npz", np.zeros((2, 8, 8, 3), np.uint8))
    if make is not None:
        make(tmp_path)
    err = one_line_error(capsys, evaluate.main, ["--fid", spec.format(d=tmp_path), str(tmp_path / "ok.npz")])
    assert needle in err, err

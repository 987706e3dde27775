"""FID, Inception Score and precision/recall: the maths against scipy, and the whole path offline with a
small injected feature extractor in place of InceptionV3 (whose weights need a download)."""
import json
import os
import urllib.error

import numpy as np
import pytest
import scipy.linalg
import torch
from conftest import one_line_error, read_metrics, tiny_model, tiny_trainer

import evaluate
import sample
from ddpm import train
from machinery import fid, phema
from machinery.errors import UserError


class TinyFeatures(torch.nn.Module):
    """uint8 (B, 3, H, W) -> (16 features, 10 logits), like InceptionV3's (2048, 1008); counts its calls."""

    name = "tiny"

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.conv = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.fc = torch.nn.Linear(16, 10)
        self.calls = 0

    def forward(self, x):
        assert x.dtype == torch.uint8
        self.calls += 1
        f = torch.relu(self.conv(x.float() / 127.5 - 1)).mean((2, 3))
        return f, self.fc(f)


def reference_fid(x, y):
    """The textbook formula with scipy's matrix square root."""
    mu1, mu2 = x.mean(0), y.mean(0)
    s1, s2 = np.cov(x, rowvar=False), np.cov(y, rowvar=False)
    covmean = scipy.linalg.sqrtm(s1 @ s2).real
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1 + s2 - 2 * covmean))


def test_frechet_distance_matches_scipy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(500, 12))
    y = rng.normal(size=(400, 12)) @ rng.normal(size=(12, 12)) * 0.5 + 0.3
    mu1, s1 = fid.mean_cov(torch.from_numpy(x))
    mu2, s2 = fid.mean_cov(torch.from_numpy(y))
    np.testing.assert_allclose(s1, np.cov(x, rowvar=False), rtol=1e-10)
    assert fid.frechet_distance(mu1, s1, mu2, s2) == pytest.approx(reference_fid(x, y), rel=1e-6)
    assert fid.frechet_distance(mu1, s1, mu1, s1) == pytest.approx(0, abs=1e-6)


def test_reference_stats_are_cached_and_fid_of_the_data_itself_is_zero(tmp_path):
    ext = TinyFeatures()
    ref = evaluate.reference_stats(ext, "shapes", "unused", 16, 96, "cpu", cache_dir=str(tmp_path), batch=32)
    assert ext.calls == 3 and ref["features"].shape == (96, 16) and int(ref["n"]) == 96
    files = os.listdir(tmp_path)
    assert len(files) == 1 and files[0].startswith("shapes-train-16px-n96-tiny")
    again = evaluate.reference_stats(ext, "shapes", "unused", 16, 96, "cpu", cache_dir=str(tmp_path))
    assert ext.calls == 3  # read from the cache
    np.testing.assert_array_equal(again["sigma"], ref["sigma"])

    import data

    images, _, _ = data.load_dataset("shapes", "unused", 16, 96)
    same = fid.fid_metrics(*fid.features(ext, images.split(40), "cpu"), ref)
    assert same["fid"] == pytest.approx(0, abs=1e-4)
    assert same["precision"] == same["recall"] == 1.0  # every point lies in its own k-NN ball
    assert 1 <= same["inception_score"] <= 10
    noise = torch.randint(0, 256, (96, 3, 16, 16), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(0))
    other = fid.fid_metrics(*fid.features(ext, noise.split(40), "cpu"), ref)
    assert other["fid"] > 100 * max(same["fid"], 1e-3) and other["precision"] < 0.5


def test_a_reference_of_fewer_images_is_a_fixed_draw_cached_apart(tmp_path, capsys, monkeypatch):
    """fid_ref_images: the same n images of the split on every call (seed 0, the split's order kept), cached
    under a name of their own; more images than the split has is one line."""
    import data

    images = torch.arange(100)
    pick = fid.reference_subset(images, 30, "x")
    assert torch.equal(pick, fid.reference_subset(images, 30, "x")) and len(set(pick.tolist())) == 30
    assert torch.equal(pick, pick.sort().values) and not torch.equal(pick, torch.arange(30))
    assert torch.equal(fid.reference_subset(images, 0, "x"), images)
    with pytest.raises(UserError, match="31 images asked of x, which has 30"):
        fid.reference_subset(images[:30], 31, "x")
    ext = TinyFeatures()
    ref = evaluate.reference_stats(ext, "shapes", "unused", 16, 96, "cpu", str(tmp_path), ref_images=40)
    full = evaluate.reference_stats(ext, "shapes", "unused", 16, 96, "cpu", str(tmp_path))
    assert int(ref["n"]) == 40 and int(full["n"]) == 96
    assert sorted(os.listdir(tmp_path)) == ["shapes-train-16px-n96-ref40-tiny.npz",
                                            "shapes-train-16px-n96-tiny.npz"]
    split, _, _ = data.load_dataset("shapes", "unused", 16, 96)
    feats, _ = fid.features(ext, [fid.reference_subset(split, 40, "shapes train")], "cpu")
    np.testing.assert_allclose(ref["mu"], feats.double().mean(0).numpy(), rtol=1e-6)
    monkeypatch.setattr(fid, "inception", lambda device, weights=None: ext)
    argv = ["--fid", "shapes:test", "shapes:train", "--shapes_count", "96", "--image_size", "16",
            "--stats_dir", str(tmp_path), "--fid_ref_images"]
    assert "200 images asked of shapes train, which has 96" in one_line_error(capsys, evaluate.main,
                                                                              [*argv, "200"])
    assert evaluate.main([*argv, "40"])["reference_stats"]["sha256"] == fid.stats_sha256(ref)
    assert "must be >= 1 (or 0: all)" in one_line_error(capsys, evaluate.main, [*argv, "-1"])
    np.savez(tmp_path / "b.npz", arr_0=np.zeros((4, 16, 16, 3), np.uint8))
    assert "b.npz is not one" in one_line_error(capsys, evaluate.main, [*argv[:2], str(tmp_path / "b.npz"),
                                                                        *argv[3:], "40"])


def test_offline_inception_is_one_clear_line(tmp_path, monkeypatch):
    pytest.importorskip("torch_fidelity")
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))

    def offline(url, dst, **kw):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    with pytest.raises(UserError,
                       match=r"offline, place https://\S+weights-inception\S+\.pth at \S+checkpoints"):
        fid.inception("cpu")
    (tmp_path / "checkpoints" / "weights-inception-2015-12-05-6726825d.pth").write_bytes(b"truncated")
    with pytest.raises(UserError, match="is not the Inception weights file"):
        fid.inception("cpu")


def test_sample_eval_fid_writes_all_metrics(run_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(fid, "inception", lambda device, weights=None: TinyFeatures())
    out = tmp_path / "fid" / "s.png"
    result = sample.main(["--ckpt", str(run_dir / "ema.pt"), "--eval", "fid", "--n", "24", "--batch", "12",
                          "--steps", "3", "--stats_dir", str(tmp_path / "stats"), "--out", str(out)])
    saved = json.loads((tmp_path / "fid" / "s.json").read_text())
    assert saved == result
    assert result["fid"] > 0 and np.isfinite(result["fid"]) and result["n"] == 24
    assert 0 <= result["precision"] <= 1 and 0 <= result["recall"] <= 1 and result["inception_score"] >= 1
    assert result["reference"] == "shapes train, 512 images"
    assert np.load(tmp_path / "fid" / "s.npz")["arr_0"].shape == (24, 16, 16, 3)
    # a reference of 100 of the 512, drawn by fid.reference_subset, recorded as such
    drawn = sample.main(["--ckpt", str(run_dir / "ema.pt"), "--eval", "fid", "--n", "24", "--batch", "12",
                         "--steps", "3", "--stats_dir", str(tmp_path / "stats"), "--fid_ref_images", "100",
                         "--out", str(tmp_path / "fid" / "d.png")])
    assert drawn["reference"] == "shapes train, 100 images" and drawn["reference_stats"]["drawn"] == "seed 0"
    assert drawn["fid"] != result["fid"]


def test_sample_eval_fid_offline_is_one_line(run_dir, tmp_path, capsys, monkeypatch):
    pytest.importorskip("torch_fidelity")
    for name, value in (("TORCH_HOME", str(tmp_path)), ("HTTPS_PROXY", "http://127.0.0.1:9"),
                        ("https_proxy", "http://127.0.0.1:9")):
        monkeypatch.setenv(name, value)  # no weights cached, and no way out: the download fails at once
    err = one_line_error(capsys, sample.main, ["--ckpt", str(run_dir / "ema.pt"), "--eval", "fid",
                                               "--out", str(tmp_path / "x.png")])
    assert "place https://" in err and str(tmp_path) in err


def test_training_logs_fid_and_bpd(tmp_path, monkeypatch):
    monkeypatch.setattr(fid, "inception", lambda device, weights=None: TinyFeatures())
    tc = tiny_trainer(tmp_path / "run", max_steps=4, eval_every_steps=2, eval_fid_samples=12,
                      eval_sample_steps=2, fid_ref_images=300,
                      eval_bpd_images=6, eval_bpd_strata=2, fid_stats_dir=str(tmp_path / "stats"))
    train(tiny_model(), tc, preset="test")
    evals = read_metrics(tmp_path / "run", "fid")
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert r["fid"] > 0 and 0 < r["bpd"] < 100 and r["bpd_images"] == 6 and r["fid_samples"] == 12
        assert r["kimg"] == r["step"] * 16 / 1e3 and r["wall_s"] > 0
    assert (tmp_path / "run" / "fid.png").exists()  # FID against kimg and hours
    # post-hoc EMA is on by default: at the end, each of ema_eval_sigma_rels rebuilt into a weights file,
    # its FID, and the best
    (sweep,) = read_metrics(tmp_path / "run", "best_sigma_rel")
    keys = [f"fid_sigma_rel_{phema.sigma_rel_name(s)}" for s in tc.ema_eval_sigma_rels]
    assert sweep["step"] == 4 and all(sweep[k] > 0 for k in keys)
    best = sweep["fid_sigma_rel_" + phema.sigma_rel_name(sweep["best_sigma_rel"])]
    assert best == min(sweep[k] for k in keys)
    assert all(os.path.exists(phema.weights_path(tmp_path / "run", s)) for s in tc.ema_eval_sigma_rels)
    # the cached reference statistics
    assert os.listdir(tmp_path / "stats") == ["shapes-train-16px-n512-ref300-tiny.npz"]  # 300 of the 512


def test_no_ema_eval_sigma_rels_means_no_sweep_at_the_end(tmp_path, monkeypatch):
    """Snapshots kept for `python -m machinery.phema` later (the lever study's runs), no sweep at the end."""
    monkeypatch.setattr(fid, "inception", lambda device, weights=None: TinyFeatures())
    tc = tiny_trainer(tmp_path / "run", max_steps=2, eval_every_steps=2, eval_fid_samples=12,
                      eval_sample_steps=2, fid_ref_images=300, eval_bpd_images=0, ema_eval_sigma_rels=(),
                      fid_stats_dir=str(tmp_path / "stats"))
    assert tc.ema_snapshot_kimg
    train(tiny_model(), tc, preset="test")
    assert [r["step"] for r in read_metrics(tmp_path / "run", "fid")] == [2]
    assert not read_metrics(tmp_path / "run", "best_sigma_rel") and os.listdir(tmp_path / "run" / "phema")


def test_training_eval_fails_before_training_when_offline(tmp_path, monkeypatch):
    def offline(device, weights=None):
        raise UserError("cannot download the Inception weights")

    monkeypatch.setattr(fid, "inception", offline)
    with pytest.raises(UserError, match="Inception"):
        train(tiny_model(), tiny_trainer(tmp_path / "run", eval_every_steps=2), preset="test")
    assert not os.path.exists(tmp_path / "run" / "ckpt.pt")


def test_the_real_inception_network_runs_offline_with_local_weights(tmp_path, monkeypatch):
    """torch-fidelity's InceptionV3 through fid.inception, from a weights file placed where the offline
    message says (random weights here: no download), on CIFAR-sized uint8 images."""
    fe = pytest.importorskip("torch_fidelity.feature_extractor_inceptionv3")
    # build the network once without weights, to write a file of the right shape
    with monkeypatch.context() as m:
        m.setattr(fe, "load_state_dict_from_url", lambda *a, **k: {})
        m.setattr(torch.nn.Module, "load_state_dict", lambda self, *a, **k: None)
        net = fe.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"])
    path = tmp_path / "checkpoints" / os.path.basename(fe.URL_INCEPTION_V3)
    path.parent.mkdir()
    torch.save(net.state_dict(), path)
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    extractor = fid.inception("cpu")
    assert extractor.name == "inception-v3-compat"
    images = torch.randint(0, 256, (3, 3, 32, 32), dtype=torch.uint8)
    feats, logits = fid.features(extractor, [images[:2], images[2:]], "cpu")
    assert feats.shape == (3, 2048) and logits.shape == (3, 1008) and torch.isfinite(feats).all()
    # run channels-last on the CPU (faster): the features of the network as torch-fidelity lays it out
    assert extractor.Conv2d_1a_3x3.conv.weight.is_contiguous(memory_format=torch.channels_last)
    plain, _ = fid.features(extractor.to(memory_format=torch.contiguous_format), [images], "cpu")
    assert torch.allclose(feats, plain, rtol=1e-4, atol=1e-5)

"""The FFCV path: beton round trips, caching, and batch-for-batch agreement with the torch loader."""
import json
import os

import numpy as np
import pytest
import torch
from conftest import one_line_error
from PIL import Image

import data
from data import FFCVLoader, Loader, beton_for, make_loader, shapes
from data import main as data_main
from machinery import beton
from machinery.beton import write_beton

pytest.importorskip("ffcv", reason="ffcv is not installed (make setup installs it)")


def test_beton_round_trip_is_bit_exact(tmp_path):
    images, labels, _ = shapes(300, 16)
    path = str(tmp_path / "s.beton")
    write_beton(images, labels, path)
    loader = FFCVLoader(path, batch_size=100, seed=0, device="cpu", hflip=False, with_labels=True)
    got_x, got_y = [], []
    for _ in range(3):
        idx = loader.order[loader.index : loader.index + 100]
        x, y = loader.next()
        assert torch.equal(y, labels[idx])
        got_x.append(x), got_y.append(y)
        torch.testing.assert_close(x, images[idx].float() / 127.5 - 1, rtol=0, atol=0)
    assert sorted(torch.cat(got_y).tolist()) == sorted(labels.tolist())


def test_ffcv_and_torch_loaders_agree_batch_for_batch_and_resume(tmp_path):
    images, labels, _ = shapes(96, 8)
    path = str(tmp_path / "s.beton")
    write_beton(images, labels, path)
    ffcv = FFCVLoader(path, batch_size=32, seed=3, device="cpu", hflip=True, with_labels=True)
    plain = Loader(images, labels, batch_size=32, seed=3, device="cpu", hflip=True, with_labels=True)
    for _ in range(7):  # across epoch boundaries
        (xa, ya), (xb, yb) = ffcv.next(), plain.next()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    state = ffcv.state_dict()
    assert state == {"epoch": 2, "index": 32}
    expected = [ffcv.next() for _ in range(4)]
    resumed = FFCVLoader(path, batch_size=32, seed=3, device="cpu", hflip=True, with_labels=True)
    resumed.load_state_dict(state)
    for (xa, ya), (xb, yb) in zip(expected, (resumed.next() for _ in range(4))):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_betons_are_cached_by_content(tmp_path, monkeypatch):
    beton_dir = str(tmp_path / "betons")
    path, k = beton_for("shapes", "unused", 8, beton_dir, shapes_count=64)
    assert k == 4 and os.path.exists(path) and "shapes-train-8px-n64" in path
    mtime = os.path.getmtime(path)
    assert beton_for("shapes", "unused", 8, beton_dir, shapes_count=64)[0] == path
    assert os.path.getmtime(path) == mtime  # reused, not rewritten
    assert beton_for("shapes", "unused", 16, beton_dir, shapes_count=64)[0] != path
    # a half-written file (no metadata beside it, or a .tmp name) is never taken for a finished one
    os.remove(path + ".json")
    beton_for("shapes", "unused", 8, beton_dir, shapes_count=64)
    assert os.path.getmtime(path) >= mtime and os.path.exists(path + ".json")


def test_folder_beton_changes_with_the_files(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(folder / "a.png")
    name1 = data.beton_name("folder", str(folder), 8, 0, True)
    Image.fromarray(np.ones((8, 8, 3), np.uint8)).save(folder / "b.png")
    assert data.beton_name("folder", str(folder), 8, 0, True) != name1


def test_fallback_to_torch_loader_when_ffcv_is_missing(monkeypatch, capsys):
    monkeypatch.setattr(beton, "ffcv_available", lambda: False)
    loader, k = make_loader("ffcv", "shapes", "unused", 8, 16, 0, "cpu", shapes_count=64)
    assert isinstance(loader, Loader) and not isinstance(loader, FFCVLoader) and k == 4
    assert "ffcv cannot be imported" in capsys.readouterr().out


def test_training_through_ffcv_equals_training_through_torch(tmp_path):
    """Same seed, same batches, same layout: the two loaders train to bitwise the same weights."""
    import json

    from conftest import tiny_model, tiny_trainer

    from ddpm import train

    mc = tiny_model(num_classes=4)
    for kind in ("ffcv", "torch"):
        out = tmp_path / kind
        train(mc, tiny_trainer(out, loader=kind, max_steps=6, shapes_count=64, beton_dir=str(tmp_path / "b")),
              preset="test")
        loader = json.load(open(out / "config.json"))["resolved"]["loader"]
        assert loader == ("FFCVLoader" if kind == "ffcv" else "Loader")
    a = torch.load(tmp_path / "ffcv" / "ckpt.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "torch" / "ckpt.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(os.listdir(tmp_path / "b")) == ["shapes-train-16px-n64.beton",
                                                  "shapes-train-16px-n64.beton.json"]


def test_data_cli_writes_a_beton_and_rejects_bad_input(tmp_path, capsys):
    out = tmp_path / "s.beton"
    data_main(["--dataset", "shapes", "--shapes_count", "40", "--image_size", "8", "--out", str(out)])
    assert out.exists() and json.loads((tmp_path / "s.beton.json").read_text())["images"] == 40
    loader = FFCVLoader(str(out), batch_size=8, seed=0, device="cpu")
    assert loader.n == 40 and loader.next()[0].shape == (8, 3, 8, 8)
    err = one_line_error(capsys, data_main, ["--dataset", "folder", "--data_dir", str(tmp_path / "none"),
                                             "--out", str(tmp_path / "x.beton")])
    assert err == f"error: image folder '{tmp_path / 'none'}' does not exist"

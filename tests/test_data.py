"""The three data sources and the loader."""

import os

import numpy as np
import pytest
import torch
from PIL import Image

from data import Loader, ResidentLoader, image_folder, load_dataset, shapes
from machinery.errors import UserError


def test_shapes_is_deterministic_any_size_and_labelled():
    a, la, k = shapes(64, 24)
    b, lb, _ = shapes(64, 24)
    assert a.shape == (64, 3, 24, 24) and a.dtype == torch.uint8 and k == 4
    assert torch.equal(a, b) and torch.equal(la, lb)
    assert set(la.tolist()) == {0, 1, 2, 3}
    assert a.float().std() > 20  # not blank


def test_image_folder_classes_modes_and_junk(tmp_path, capsys):
    (tmp_path / "cats").mkdir()
    (tmp_path / "dogs").mkdir()
    Image.fromarray(np.full((40, 20), 128, np.uint8), "L").save(tmp_path / "cats" / "gray.png")
    Image.fromarray(np.zeros((20, 20, 4), np.uint8), "RGBA").save(tmp_path / "cats" / "rgba.png")
    Image.fromarray(np.full((30, 50, 3), 255, np.uint8)).save(tmp_path / "dogs" / "white.jpg")
    (tmp_path / "dogs" / "notes.txt").write_text("not an image")
    (tmp_path / "dogs" / "broken.png").write_bytes(b"\x89PNG garbage")
    images, labels, k = image_folder(str(tmp_path), 16)
    assert images.shape == (3, 3, 16, 16) and k == 2
    assert sorted(labels.tolist()) == [0, 0, 1]
    assert images[labels == 1].min() >= 250  # the white dog, resized and cropped
    out = capsys.readouterr().out
    assert "1 non-image files skipped" in out and "1 unreadable images skipped" in out


def test_flat_folder_and_errors(tmp_path):
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "a.png")
    _, labels, k = image_folder(str(tmp_path), 8)
    assert labels.tolist() == [0] and k == 0
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no images"):
        image_folder(str(tmp_path / "empty"), 8)
    with pytest.raises(UserError, match="does not exist"):
        image_folder(str(tmp_path / "missing"), 8)


def test_cifar10_offline_says_where_to_put_the_files(tmp_path, monkeypatch):
    import torchvision

    def offline(*a, **k):
        raise OSError("Name or service not known")

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", offline)
    with pytest.raises(UserError, match="cifar-10-python.tar.gz") as e:
        load_dataset("cifar10", str(tmp_path), 32)
    assert str(tmp_path) in str(e.value) and "--dataset=shapes" in str(e.value)


def make_loader(n=40, batch=8, seed=0, hflip=True):
    images = torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1).expand(n, 3, 2, 2).clone()
    images[:, :, :, 0] = 255  # left column white, so a flip is visible
    return Loader(images, torch.arange(n), batch, seed, "cpu", hflip=hflip, with_labels=True)


def test_loader_normalises_flips_and_is_seeded():
    x, y = make_loader().next()
    assert x.shape == (8, 3, 2, 2) and x.min() >= -1 and x.max() == 1
    # label i holds pixel value i
    torch.testing.assert_close(x[:, 0, 0].min(-1).values, y.float() / 127.5 - 1)
    flipped = [make_loader(seed=s).next()[0][:, 0, 0, 1] == 1 for s in range(50)]
    frac = torch.cat(flipped).float().mean().item()
    assert 0.4 < frac < 0.6  # about half the images are mirrored
    a, b, c = make_loader(seed=1), make_loader(seed=1), make_loader(seed=2)
    assert torch.equal(a.next()[1], b.next()[1]) and not torch.equal(make_loader(seed=1).next()[1],
                                                                     c.next()[1])
    assert make_loader(hflip=False).next()[0][:, 0, 0, 0].eq(1).all()


def test_loader_covers_each_epoch_once_and_resumes_exactly():
    loader = make_loader(n=40, batch=8)
    epoch = torch.cat([loader.next()[1] for _ in range(5)])
    assert sorted(epoch.tolist()) == list(range(40))
    for _ in range(2):
        loader.next()
    state = loader.state_dict()
    expected = [loader.next() for _ in range(6)]  # crosses into epoch 2
    resumed = make_loader(n=40, batch=8)
    resumed.load_state_dict(state)
    for (xa, ya), (xb, yb) in zip(expected, (resumed.next() for _ in range(6))):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_drop_last():
    loader = make_loader(n=20, batch=8)
    seen = [loader.next()[1] for _ in range(2)]
    assert loader.next()[1].numel() == 8 and loader.state_dict()["epoch"] == 1
    assert len(set(torch.cat(seen).tolist())) == 16


def test_resident_loader_gives_the_loaders_batches():
    images, labels, _ = load_dataset("shapes", "unused", 8, shapes_count=40)
    a = Loader(images, labels, 8, seed=3, device="cpu", with_labels=True)
    b = ResidentLoader(images, labels, 8, seed=3, device="cpu", with_labels=True)
    for _ in range(7):  # across an epoch boundary
        (xa, ya), (xb, yb) = a.next(), b.next()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_the_torch_loader_decodes_a_folder_once(tmp_path, capsys, monkeypatch):
    """An image folder is decoded at the first start and cached beside the betons (verified like a beton:
    the data asked for, every byte, the .json's claims); the next start reads the cache, and a changed
    folder is decoded again under a new name."""
    import json

    import data

    for c in ("a", "b"):
        (tmp_path / "imgs" / c).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(np.full((8, 8, 3), 20 * i, np.uint8)).save(tmp_path / "imgs" / c / f"{i}.png")
    args = ("torch", "folder", str(tmp_path / "imgs"), 8, 4, 0, "cpu")
    kw = dict(with_labels=True, beton_dir=str(tmp_path / "cache"))
    first, k = data.make_loader(*args, **kw)
    assert "writing" in capsys.readouterr().out and k == 2
    decoded = []
    monkeypatch.setattr(data, "to_rgb8", lambda im: decoded.append(1) or np.zeros((8, 8, 3), np.uint8))
    again, k = data.make_loader(*args, **kw)
    assert decoded == [] and k == 2 and torch.equal(again.images, first.images)
    assert torch.equal(again.labels, first.labels)
    (cached,) = [p for p in os.listdir(tmp_path / "cache") if p.endswith(".decoded.npz")]
    meta_path = tmp_path / "cache" / (cached + ".json")
    meta = json.load(open(meta_path))
    json.dump({**meta, "num_classes": 3}, open(meta_path, "w"))
    with pytest.raises(UserError, match="claims were changed"):
        data.make_loader(*args, **kw)
    json.dump(meta, open(meta_path, "w"))
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "imgs" / "a" / "new.png")
    monkeypatch.undo()
    changed, _ = data.make_loader(*args, **kw)
    assert changed.n == 13 and len([p for p in os.listdir(tmp_path / "cache") if p.endswith(".npz")]) == 2

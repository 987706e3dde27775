"""Issue 24 items 1, 2, 5 and 7 for data.py: an image folder with FIFOs, devices and bad links in it is read
without blocking, through one walk; a beton records the data it was written from and is refused for other
data; betons and their .json are created fresh (links replaced, never followed); a failed write is one line.

Anything that could block on a FIFO if it regressed runs in a fresh interpreter, with a timeout that only
guards against a hang (the fixed code finishes in seconds)."""
import errno
import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, TINY_ARGS, one_line_error
from PIL import Image

import data
import ddpm
from machinery import beton
from machinery.errors import UserError

HANG_GUARD = 600  # seconds; never reached unless something blocks
needs_ffcv = pytest.mark.skipif(not beton.ffcv_available(), reason="ffcv is not installed")


def png(path, value=0, size=8):
    Image.fromarray(np.full((size, size, 3), value, np.uint8)).save(path)


def run_python(code):
    """`code` in a fresh interpreter at the repository root -> (returncode, stdout, stderr)."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=HANG_GUARD)
    return out.returncode, out.stdout, out.stderr


@pytest.fixture
def hostile(tmp_path):
    """imgs/{cats,dogs}: 4 readable images (one a link to a file outside, one in a linked folder), a FIFO, a
    link to a device, a looping link, a dangling link, a link to a folder above (a cycle), a text file."""
    root, outside, extra = tmp_path / "imgs", tmp_path / "outside", tmp_path / "extra"
    for d in (root / "cats", root / "dogs", outside, extra):
        d.mkdir(parents=True)
    png(root / "cats" / "a.png", 10)
    png(root / "dogs" / "b.png", 20)
    png(outside / "o.png", 30)
    png(extra / "c.png", 40)
    (root / "cats" / "notes.txt").write_text("not an image")
    os.mkfifo(root / "cats" / "pipe.png")
    os.symlink("/dev/zero", root / "cats" / "zero.png")
    os.symlink("loop.png", root / "cats" / "loop.png")
    os.symlink("missing.png", root / "cats" / "gone.png")
    os.symlink(outside / "o.png", root / "cats" / "outside.png")
    os.symlink("..", root / "dogs" / "up")
    os.symlink(extra, root / "dogs" / "more")
    return root


NOTE = ("note: skipped 5 entries of {} that are not regular image files (2 FIFOs/devices/sockets, "
        "3 broken or looping links)")


def test_the_walk_lists_regular_files_only_and_opens_nothing(hostile):
    listing = data.image_files(str(hostile))
    assert [f[0] for f in listing.files] == ["cats/a.png", "cats/outside.png", "dogs/b.png",
                                             "dogs/more/c.png"]
    assert (listing.other, listing.special, listing.bad_links, listing.unreadable) == (1, 2, 3, 0)
    assert listing.note() == NOTE.format(hostile)
    # one walk behind every name: beton names and provenance do not trip over loops (they used to raise ELOOP)
    assert data.beton_name("folder", str(hostile), 8, 0, True).startswith("folder-train-8px-")
    assert "4 images" in data.provenance("folder", str(hostile), 8)["source"]


def test_a_socket_is_skipped_like_a_fifo(tmp_path):
    png(tmp_path / "a.png")
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(tmp_path / "s.png"))
    except OSError:
        pytest.skip("no unix socket at this path length")
    try:
        listing = data.image_files(str(tmp_path))
    finally:
        s.close()
    assert [f[0] for f in listing.files] == ["a.png"] and listing.special == 1


def test_the_torch_loader_reads_a_folder_with_a_fifo_without_blocking(hostile):
    rc, out, err = run_python(
        "import data\n"
        f"loader, k = data.make_loader('torch', 'folder', {str(hostile)!r}, 8, 2, 0, 'cpu', "
        f"with_labels=True, beton_dir={str(hostile) + '-betons'!r})\n"
        "x, y = loader.next()\n"
        "print('loaded', loader.n, k, sorted(loader.labels.tolist()))\n")
    assert rc == 0, err
    assert "loaded 4 2 [0, 0, 1, 1]" in out
    assert NOTE.format(hostile) in out.splitlines()
    assert "1 non-image files skipped, 0 unreadable images skipped" in out


@needs_ffcv
def test_the_ffcv_loader_and_the_data_cli_read_a_folder_with_a_fifo_and_loops(hostile, tmp_path):
    betons = tmp_path / "betons"
    rc, out, err = run_python(
        "import data\n"
        f"loader, k = data.make_loader('ffcv', 'folder', {str(hostile)!r}, 8, 2, 0, 'cpu', "
        f"beton_dir={str(betons)!r})\n"
        "x, _ = loader.next()\n"
        "print('loaded', loader.n, k, tuple(x.shape))\n")
    assert rc == 0, err
    assert "loaded 4 2 (2, 3, 8, 8)" in out and NOTE.format(hostile) in out.splitlines()
    (meta,) = [json.loads(p.read_text()) for p in betons.glob("*.json")]
    assert meta["source"] == data.provenance("folder", str(hostile), 8)["source"]
    # the data CLI walks the same way
    rc, out, err = run_python("import data; data.main(['--dataset', 'folder', '--data_dir', "
                              f"{str(hostile)!r}, '--image_size', '8', '--out', "
                              f"{str(tmp_path / 'x.beton')!r}])")
    assert rc == 0, err
    assert json.loads((tmp_path / "x.beton.json").read_text())["images"] == 4


def test_a_folder_of_nothing_usable_is_one_line(tmp_path):
    os.mkfifo(tmp_path / "pipe.jpg")
    os.symlink("loop.jpg", tmp_path / "loop.jpg")
    rc, out, err = run_python("import data; data.main(['--dataset', 'folder', '--data_dir', "
                              f"{str(tmp_path)!r}, '--out', {str(tmp_path / 'x.beton')!r}])")
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: image folder '{tmp_path}' holds no images (")
    assert err.rstrip().endswith("; skipped 1 FIFO/device/socket, 1 broken or looping link")


def test_a_fifo_swapped_in_after_the_walk_is_never_waited_on(tmp_path):
    png(tmp_path / "a.png")
    png(tmp_path / "b.png")
    rc, out, err = run_python(
        "import os, data\n"
        f"root = {str(tmp_path)!r}\n"
        "listing = data.image_files(root)\n"
        "os.remove(os.path.join(root, 'b.png')); os.mkfifo(os.path.join(root, 'b.png'))\n"
        "images, labels, k = data.image_folder(root, 8, listing)\n"
        "print('loaded', len(images))\n")
    assert rc == 0, err
    assert "loaded 1" in out and "1 unreadable images skipped" in out


# ---- provenance


def test_provenance_names_the_data(tmp_path):
    train, test = data.provenance("shapes", "x", 16, 64), data.provenance("shapes", "x", 16, 64, train=False)
    assert train == {"dataset": "shapes", "split": "train", "image_size": 16,
                     "source": "shapes: 64 images, seed 0"}
    assert test["split"] == "test" and test["source"] == "shapes: 64 images, seed 1"
    assert data.provenance("cifar10", str(tmp_path), 32)["source"] == f"cifar10 in {tmp_path}"
    with pytest.raises(UserError, match="unknown dataset 'mnist'"):
        data.provenance("mnist", "x", 32)
    folder = tmp_path / "imgs"
    folder.mkdir()
    png(folder / "a.png")
    first = data.provenance("folder", str(folder), 8)
    assert first["source"].startswith(f"folder {folder}: 1 images, files ")
    (folder / "README").write_text("not an image")  # only image files define the data
    assert data.provenance("folder", str(folder), 8) == first
    os.utime(folder / "a.png", ns=(0, 0))  # a changed modification time: other data
    assert data.provenance("folder", str(folder), 8) != first
    json.dumps(first)  # recordable as it is


@needs_ffcv
def test_the_test_splits_beton_copied_over_the_trains_is_refused(tmp_path, capsys):
    betons = tmp_path / "betons"
    test_path, _ = data.beton_for("shapes", "", 16, str(betons), shapes_count=64, train=False)
    train_path = str(betons / data.beton_name("shapes", "", 16, 64, True))
    shutil.copy(test_path, train_path)
    shutil.copy(test_path + ".json", train_path + ".json")
    with pytest.raises(UserError, match=r"records split 'test' in its .json, not 'train' as asked"):
        data.beton_for("shapes", "", 16, str(betons), shapes_count=64)
    err = one_line_error(capsys, ddpm.main, [*TINY_ARGS, "--shapes_count=64", "--batch_size=8",
                                             "--max_steps=1", "--loader=ffcv", f"--beton_dir={betons}",
                                             f"--out_dir={tmp_path / 'run'}"])
    assert "records split 'test'" in err and "delete it and its .json" in err


@needs_ffcv
def test_another_folders_beton_under_this_folders_name_is_refused(tmp_path):
    a, b, betons = tmp_path / "a", tmp_path / "b", str(tmp_path / "betons")
    for d, v in ((a, 0), (b, 255)):
        d.mkdir()
        png(d / "x.png", v)
    path_a, _ = data.beton_for("folder", str(a), 8, betons)
    path_b = os.path.join(betons, data.beton_name("folder", str(b), 8, 0, True))
    os.replace(path_a, path_b)
    os.replace(path_a + ".json", path_b + ".json")
    with pytest.raises(UserError,
                       match=r"records source 'folder .*/a: 1 images, files \w+' in its .json, not "):
        data.beton_for("folder", str(b), 8, betons)


@needs_ffcv
def test_a_beton_without_recorded_provenance_is_rewritten_with_a_note(tmp_path, capsys):
    betons = str(tmp_path)
    path, _ = data.beton_for("shapes", "", 8, betons, shapes_count=40)
    meta = json.load(open(path + ".json"))
    for k in ("dataset", "split", "source"):
        del meta[k]
    json.dump(meta, open(path + ".json", "w"))
    capsys.readouterr()
    data.beton_for("shapes", "", 8, betons, shapes_count=40)
    out = capsys.readouterr().out
    assert f"note: {path} does not record the data it was written from (an older cache); rewriting it" in out
    assert json.load(open(path + ".json"))["source"] == "shapes: 40 images, seed 0"


# ---- written fresh: links replaced, never followed; one line when a write fails


@needs_ffcv
def test_links_planted_at_the_beton_and_its_json_are_replaced_not_followed(tmp_path):
    betons, victims = tmp_path / "betons", tmp_path / "victims"
    betons.mkdir(), victims.mkdir()
    (victims / "beton").write_bytes(b"victim beton")
    (victims / "json").write_text("victim json")
    path = betons / data.beton_name("shapes", "", 8, 40, True)
    os.symlink(victims / "json", str(path) + ".json")  # no beton: it is written, the .json link replaced
    data.beton_for("shapes", "", 8, str(betons), shapes_count=40)
    os.remove(str(path) + ".json")
    os.remove(path)
    os.symlink(victims / "beton", path)  # a link at the beton, no .json: rewritten, the link replaced
    data.beton_for("shapes", "", 8, str(betons), shapes_count=40)
    out = tmp_path / "out.beton"  # the data CLI: both names links
    os.symlink(victims / "beton", out)
    os.symlink(victims / "json", str(out) + ".json")
    data.main(["--dataset", "shapes", "--shapes_count", "40", "--image_size", "8", "--out", str(out)])
    for p in (path, str(path) + ".json", out, str(out) + ".json"):
        assert not os.path.islink(p) and os.path.isfile(p), p
    assert json.load(open(str(out) + ".json"))["split"] == "train"
    assert (victims / "beton").read_bytes() == b"victim beton"
    assert (victims / "json").read_text() == "victim json"
    assert sorted(os.listdir(betons)) == sorted([path.name, path.name + ".json"])  # no temporary file


@needs_ffcv
def test_a_fifo_at_the_json_or_the_beton_is_one_line_not_a_hang(tmp_path):
    rc, out, err = run_python(
        "import os, data\n"
        "from machinery.errors import UserError\n"
        f"betons = {str(tmp_path)!r}\n"
        "path, _ = data.beton_for('shapes', '', 8, betons, shapes_count=40)\n"
        "for victim in (path + '.json', path):\n"
        "    os.rename(victim, victim + '.kept'); os.mkfifo(victim)\n"
        "    try:\n"
        "        data.beton_for('shapes', '', 8, betons, shapes_count=40)\n"
        "    except UserError as e:\n"
        "        print('error:', e)\n"
        "    os.remove(victim); os.rename(victim + '.kept', victim)\n"
        "os.remove(path); os.mkfifo(path)\n"
        "try:\n"
        "    data.FFCVLoader(path, 8, 0, 'cpu')\n"
        "except UserError as e:\n"
        "    print('error:', e)\n")
    assert rc == 0, err
    lines = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(lines) == 3, out
    assert "cannot read" in lines[0] and ".json" in lines[0]
    assert "is 0 bytes, not the" in lines[1]
    assert "is not a regular file" in lines[2]


def no_temporary_files(folder):
    return not [f for f in os.listdir(folder) if ".tmp" in f]


@needs_ffcv
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
@pytest.mark.parametrize("stage", ["beton", "json"])
def test_a_failed_beton_write_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, code, stage):
    import ffcv.writer

    images, labels, _ = data.shapes(40, 8)
    path = str(tmp_path / "x.beton")

    def fail(*a, **kw):
        raise OSError(code, os.strerror(code))

    if stage == "beton":  # part-way through FFCV's writing of the temporary file
        monkeypatch.setattr(ffcv.writer.DatasetWriter, "from_indexed_dataset", fail)
    else:
        monkeypatch.setattr(json, "dump", fail)
    with pytest.raises(UserError) as e:
        beton.write_verified_beton(images, labels, 4, path, data.provenance("shapes", "", 8, 40))
    target = path if stage == "beton" else path + ".json"
    assert str(e.value).startswith(f"could not write {target} ({os.strerror(code)}); ")
    assert "nothing was written" in str(e.value) and "\n" not in str(e.value)
    assert os.listdir(tmp_path) == []


@needs_ffcv
def test_a_read_only_beton_dir_is_one_line(tmp_path, monkeypatch, capsys):
    betons = tmp_path / "betons"
    betons.mkdir()
    if os.geteuid() == 0:  # root writes through permissions: the refusal the kernel would give, simulated
        def refuse(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

        monkeypatch.setattr(beton.files, "fresh_temp", refuse)
    else:
        betons.chmod(0o500)
    try:
        err = one_line_error(capsys, data.main, ["--dataset", "shapes", "--shapes_count", "40",
                                                 "--image_size", "8",
                                                 "--out", str(betons / "x.beton")], code=1)
        with pytest.raises(UserError, match="Permission denied.*nothing was written"):
            data.beton_for("shapes", "", 8, str(betons), shapes_count=40)
    finally:
        betons.chmod(0o700)
    assert err == f"error: could not write {betons / 'x.beton'} (Permission denied); nothing was written"
    assert os.listdir(betons) == []


@needs_ffcv
def test_a_failed_rewrite_keeps_nothing_half_made(tmp_path, monkeypatch):
    """Rewriting an older beton on a full disk: one line, no temporary file, and no .json left that could
    pass the old beton (or a half-written one) off as the new data."""
    import ffcv.writer

    betons = str(tmp_path)
    path, _ = data.beton_for("shapes", "", 8, betons, shapes_count=40)
    meta = json.load(open(path + ".json"))
    del meta["source"]
    json.dump(meta, open(path + ".json", "w"))

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ffcv.writer.DatasetWriter, "from_indexed_dataset", full)
    with pytest.raises(UserError,
                       match=f"could not write {path} .No space left on device.; nothing was written"):
        data.beton_for("shapes", "", 8, betons, shapes_count=40)
    assert no_temporary_files(betons) and not os.path.exists(path + ".json")
    monkeypatch.undo()
    assert data.beton_for("shapes", "", 8, betons, shapes_count=40)[0] == path  # written again on next use

"""sample.py's resumable store: the images drawn so far as shards of consecutive indices in <out>.shards/,
each checked against the settings that made it and the checksum recorded when it was written; at the end,
the .npz, the grid and the PNGs written from them.

    p = plan(out, n, settings_for, size, default_size, rank, world)   # p.missing: the shards to draw
    save(p, k, images, labels, made); images, labels = load(p, k)    # checked: settings, range, checksum

<out>.shards/ is made by this program (files.own_folder: never a link); manifest.json holds the settings and
each finished shard's SHA-256 (of its images and labels). A shard of other settings is refused in one line;
one that is unreadable, or does not match its checksum, is drawn again (said in one line).
"""
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re

import numpy as np
import torch

from machinery import files, group, runs
from machinery.errors import UserError, first_line

MANIFEST_LIMIT = 64 * 2**20  # bytes: a manifest is its settings plus ~80 bytes a shard
MAX_IMAGES = 10**8  # --n: 100 million images (CIFAR-10's FID uses 50,000)
MAX_SHARDS = 100_000  # a manifest of ~8 MB
STALE = re.compile(r"\.(shard|features)-\d+\.npz\.tmp-.*|\.manifest\.json\.tmp-.*|\.\d+\.png\.tmp-.*")


@dataclasses.dataclass
class Plan:
    folder: str     # <out>.shards
    settings: dict  # what made the images: in the manifest and in every shard
    ranges: list    # (start, end) of each shard, in index order
    missing: list   # the shards not on disk (or not trusted) when this run started
    rank: int
    world: int

    def path(self, k, kind="shard"):
        return os.path.join(self.folder, f"{kind}-{k:06d}.npz")

    def mine(self, shards):
        """This rank's share of a list of shards."""
        return list(shards)[self.rank :: self.world]


def folder_of(out):
    return os.path.splitext(out)[0] + ".shards"


def npz_path(out):
    return os.path.splitext(out)[0] + ".npz"


def content_sha256(images, labels):
    """SHA-256 of a shard's content: its images' and labels' dtypes, shapes and bytes."""
    h = hashlib.sha256()
    for a in (images, labels):
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}:{a.shape};".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def compare_settings(where, saved, settings):
    """One line naming what differs between the settings on disk and these."""
    diff = [f"{k} {saved.get(k)!r} there, {v!r} here" for k, v in settings.items() if saved.get(k) != v]
    diff += [f"{k} {saved[k]!r} there" for k in saved if k not in settings]
    if diff:
        raise UserError(f"{where} holds images of other settings ({'; '.join(diff[:4])}): never mixed in; "
                        "delete it to start afresh, or choose another --out")


def read_manifest(folder):
    """The manifest's contents, or None when there is none yet."""
    path = os.path.join(folder, "manifest.json")
    if not os.path.lexists(path):
        return None
    try:
        with files.open_regular(path, "rb") as f:
            text = f.read(MANIFEST_LIMIT + 1)
        if len(text) > MANIFEST_LIMIT:
            raise ValueError(f"over {MANIFEST_LIMIT >> 20} MiB")
        manifest = json.loads(text)
        if not isinstance(manifest, dict) or not isinstance(manifest.get("settings"), dict):
            raise ValueError("no settings in it")
        if not isinstance(manifest.setdefault("checksums", {}), dict):
            raise ValueError("its checksums are not a table")
        return manifest
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: lists nested thousands deep
        raise UserError(f"{path} is not a manifest sample.py wrote ({type(e).__name__}: {first_line(e)}): "
                        f"delete {folder}, or choose another --out") from None


def plan(out, n, settings_for, size, default_size, rank, world, png_dir=""):
    """The shard folder, checked against settings_for(shard size) (refused in one line if they differ),
    made with its manifest where new, and the shards still to draw. The shard size: `size`, else the
    folder's own, else `default_size`. Every rank looks before any rank draws."""
    folder = folder_of(out)
    if rank == 0:
        files.own_folder(folder)
    group.barrier()
    manifest = read_manifest(folder)
    size = size or (manifest or {}).get("settings", {}).get("shard_size") or default_size
    if type(size) is not int or size < 1:  # a bool is not a number of images
        raise UserError(f"{folder}/manifest.json: shard_size {size!r} is not a number of images: delete "
                        f"{folder}, or choose another --out")
    if -(-n // size) > MAX_SHARDS:
        raise UserError(f"--shard_size {size} cuts {n} images into {-(-n // size)} shards, more than "
                        f"{MAX_SHARDS}: choose --shard_size {-(-n // MAX_SHARDS)} or more")
    settings = settings_for(size)
    if manifest is not None:
        compare_settings(folder, manifest["settings"], settings)
    if rank == 0:
        prepare_folder(folder, settings, manifest is None, png_dir)
    group.barrier()
    ranges = [(s, min(s + size, n)) for s in range(0, n, size)]
    p = Plan(folder, settings, ranges, [], rank, world)
    checksums = (read_manifest(folder) or {}).get("checksums", {})
    p.missing = [k for k in range(len(ranges)) if not on_disk(p, k, checksums)]
    group.barrier()  # no rank writes a shard before every rank has listed the missing ones
    done = sum(e - s for k, (s, e) in enumerate(ranges) if k not in p.missing)
    if done and rank == 0:
        print(f"resuming: {done}/{n} images already drawn in {folder}", flush=True)
    return p


def prepare_folder(folder, settings, new, png_dir):
    """Rank 0: the manifest of a new folder; temporary files a killed run left behind are removed."""
    try:
        for where in [folder] + ([png_dir] if png_dir else []):
            for name in os.listdir(where):
                if STALE.fullmatch(name):
                    os.remove(os.path.join(where, name))
    except OSError as e:
        raise files.os_error(e, folder) from None
    if new:
        write_manifest(folder, {"settings": settings, "written_by": "sample.py", "checksums": {},
                                "shards": "shard-NNNNNN.npz: images k*shard_size .. (k+1)*shard_size-1; "
                                          "checksums: SHA-256 of each one's images and labels"})


def write_manifest(folder, manifest):
    with files.created(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)


@contextlib.contextmanager
def manifest_locked(folder):
    """The ranks' turns at rewriting the manifest: an flock of <folder>/.manifest.lock, this user's alone."""
    fd = os.open(os.path.join(folder, ".manifest.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held by a rank for one rewrite of a small file
        yield
    finally:
        os.close(fd)


def on_disk(plan, k, checksums):
    """Whether shard k is on disk, whole, from these settings, matching the checksum the manifest recorded
    when it was written; a shard of other settings is refused in one line, any other one drawn again."""
    path = plan.path(k)
    if not os.path.lexists(path):
        return False
    try:
        images, labels, saved, span = read(path)
        why = (None if checksums.get(str(k)) == content_sha256(images, labels)
               else "the manifest records no checksum for it" if str(k) not in checksums
               else "its content does not match the checksum the manifest recorded when it was written")
    except Exception as e:
        why = f"it is unreadable ({type(e).__name__})"
        saved = None
    if saved is not None:
        compare_settings(path, saved, plan.settings)
        why = why or (None if span == list(plan.ranges[k]) else "it holds other images")
    if why and plan.rank == 0:
        print(f"warning: {path}: {why}: it is drawn again", flush=True)
    return why is None


def read(path):
    """-> (images, labels, settings, range) of a shard file."""
    with files.open_regular(path) as f, np.load(f) as z:
        return z["images"], z["labels"], json.loads(str(z["settings"])), z["range"].tolist()


def save(plan, k, images, labels, made):
    """Shard k, written whole to a fresh name and renamed into place, its checksum put in the manifest
    before the rename: a stop between the two drops the shard, so every shard on disk has one."""
    with files.created(plan.path(k), kept="the shards written before it are kept") as f:
        np.savez(f, images=images, labels=labels, settings=np.array(json.dumps(plan.settings)),
                 range=np.array(plan.ranges[k]), made=np.array(json.dumps(made)))
        with manifest_locked(plan.folder):
            manifest = read_manifest(plan.folder)
            manifest["checksums"][str(k)] = content_sha256(images, labels)
            write_manifest(plan.folder, manifest)


def load(plan, k):
    """-> (uint8 images (B, H, W, C), labels) of shard k, checked against the plan and its checksum."""
    path, (start, end) = plan.path(k), plan.ranges[k]
    try:
        images, labels, saved, span = read(path)
        checksum = (read_manifest(plan.folder) or {}).get("checksums", {}).get(str(k))
    except Exception as e:
        raise UserError(f"cannot read the shard {path} ({type(e).__name__}: {first_line(e)}); if the "
                        "ranks do not share one file system, give --out on one they share; else run the "
                        "same command again: it is drawn again") from None
    shape = (end - start, *plan.settings["image_shape"])
    if (saved != plan.settings or span != [start, end] or images.shape != shape or images.dtype != np.uint8
            or len(labels) != (end - start if plan.settings["num_classes"] else 0)
            or checksum != content_sha256(images, labels)):
        raise UserError(f"{path} is not shard {k} of these settings, as written: run the same command again: "
                        "it is drawn again")
    return images, labels


def save_features(plan, k, feats, logits):
    with files.created(plan.path(k, "features")) as f:
        np.savez(f, features=feats, logits=logits)


def load_features(plan, k):
    path = plan.path(k, "features")
    try:
        with files.open_regular(path) as f, np.load(f) as z:
            return z["features"], z["logits"]
    except Exception as e:
        raise UserError(f"cannot read {path} ({type(e).__name__}: {first_line(e)}): do the ranks share one "
                        "file system? run the same command again") from None


def all_features(plan, local):
    """All shards' Inception features and logits in index order: this process's (`local`) or other ranks'."""
    parts = [local[k] if k in local else map(torch.from_numpy, load_features(plan, k))
             for k in range(len(plan.ranges))]
    return (torch.cat(p) for p in zip(*parts))


def remove(plan):
    """The shard folder, once the outputs are written: only the files this program names are removed, only
    from a real folder (never through a link), and the folder only if nothing else is left in it."""
    names = ["manifest.json", ".manifest.lock"] + [os.path.basename(plan.path(k, kind)) for kind in
                                                   ("shard", "features") for k in range(len(plan.ranges))]
    with contextlib.suppress(OSError):
        if not os.path.isdir(plan.folder) or os.path.islink(plan.folder):
            return
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(plan.folder, name))
        os.rmdir(plan.folder)


def check_png_dir(folder, n, out):
    """--png_dir: made if missing, never --out's folder; it may hold only this run's own PNGs (NNNNNN.png,
    below n: a run continued), so that a tool scoring the folder sees these n images and no others."""
    if os.path.realpath(folder) == os.path.realpath(os.path.dirname(os.path.abspath(out))):
        raise UserError(f"--png_dir {folder} is --out's own folder, where the grid, .npz and .json go: a "
                        "tool scoring it would see them too; give a folder of its own")
    try:
        os.makedirs(folder, exist_ok=True)
        names = os.listdir(folder)
    except OSError as e:
        raise UserError(f"--png_dir {folder}: cannot use it ({e.strerror or e})") from None
    ours = re.compile(r"\d{6,}\.png|\.\d{6,}\.png\.tmp-.*")
    others = [f for f in names if not (ours.fullmatch(f) and int(f.strip(".").split(".")[0]) < n)]
    if others:
        raise UserError(f"--png_dir {folder} holds {len(others)} other files ({sorted(others)[0]}, ...): "
                        f"give an empty or new folder, so that whoever scores it sees these {n} images only")


def write_pngs(folder, images, start, n):
    """Images start.. as NNNNNN.png files (as wide as n needs, at least 6 digits), each created fresh."""
    from PIL import Image

    width = max(6, len(str(n - 1)))
    for i, img in enumerate(images, start):
        with files.created(os.path.join(folder, f"{i:0{width}d}.png")) as f:
            Image.fromarray(img).save(f, format="PNG")


def write_outputs(plan, out, n, grid):
    """<out>.npz of all n images, streamed from the shards, and at `out` the grid of the first `grid`.
    -> the .npz's path."""
    first = []

    def chunks():
        for k in range(len(plan.ranges)):
            images, labels = load(plan, k)
            first.append(images[: max(0, grid - sum(map(len, first)))])
            yield images, labels

    path = npz_path(out)
    files.write_npz(path, (n, *plan.settings["image_shape"]), chunks())
    runs.save_grid(torch.from_numpy(np.concatenate(first)).permute(0, 3, 1, 2).float() / 127.5 - 1, out)
    return path

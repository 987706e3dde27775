"""FFCV .beton files: written once per (dataset, split, resolution) beside a .json of what they hold and
were written from, with the file's size and checksum, which every use verifies.

    meta = write_verified_beton(images, labels, num_classes, path, origin)   # the beton and PATH.json
    meta = read_meta(path); verify_beton(path, meta, image_size, origin)     # before every use
"""
import contextlib
import hashlib
import json
import os
import signal
import threading

import numpy as np
import torch

from machinery import files
from machinery.errors import UserError

META_LIMIT = 2**20  # bytes: a beton's .json is a few hundred; a larger one is not ours
PROVENANCE = ("dataset", "split", "image_size", "source")  # data.provenance()'s fields, in the order checked


def ffcv_available():
    try:
        with torch_threads_kept():
            import ffcv  # noqa: F401

        return True
    except ImportError:  # not installed, or its native libraries (libturbojpeg, OpenCV) are missing
        return False


@contextlib.contextmanager
def torch_threads_kept():
    """FFCV sets torch's process-wide thread count to its own worker count (1 on import, num_workers on
    each loader and epoch): a CPU training step would silently run on that many cores. Keep ours."""
    n = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(n)


def write_beton(images, labels, path, num_workers=2):
    """(N, 3, H, W) uint8 images and (N,) labels -> an FFCV .beton (RGBImageField + IntField).

    Up to 64 px the pixels are stored raw, so they load back bit-exact; larger images are stored
    as JPEG at quality 90. The file appears under its name only once complete (temp file, rename).
    """
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    class Rows:  # the indexed dataset DatasetWriter reads: (HWC uint8 array, int label)
        def __init__(self):
            self.x, self.y = images.permute(0, 2, 3, 1).numpy(), labels.numpy()

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return self.x[i], int(self.y[i])

    raw = images.shape[-1] <= 64
    field = RGBImageField(write_mode="raw") if raw else RGBImageField(write_mode="jpg", jpeg_quality=90)
    folder = os.path.dirname(os.path.abspath(path))
    refuse_special(path)
    kept = "nothing was written" + (f", {path} is as it was" if os.path.lexists(path) else "")
    need = images.numel() // (1 if raw else 4) + 2**20  # FFCV's writer hangs on a full disk: fail before it
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise files.os_error(e, path, kept) from None
    files.check_space([(path, need)], kept)
    tmp = None
    previous = (signal.signal(signal.SIGTERM, interrupt)
                if threading.current_thread() is threading.main_thread() else None)
    try:  # FFCV's writer takes a file name: a fresh one (O_EXCL) beside path, renamed over it when complete
        tmp = files.fresh_temp(path)
        DatasetWriter(tmp, {"image": field, "label": IntField()},
                      num_workers=num_workers).from_indexed_dataset(Rows())
        digest = checksum(tmp)
        files.commit(tmp, path)  # a link at path is replaced, never followed
        tmp = None
    except OSError as e:
        raise files.os_error(e, path, kept) from None
    finally:  # an error, Ctrl-C or SIGTERM leaves no temporary file behind
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return digest


def refuse_special(path):
    """Refuse a target that is there and neither a regular file nor a link (a folder, /dev/full, a FIFO):
    a file or a link there is replaced whole by the rename, a link never followed."""
    if os.path.lexists(path) and not os.path.islink(path) and not files.is_regular(path):
        raise UserError(f"{path} exists and is not a regular file")


def interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def checksum(path):
    """BLAKE2b of the whole file (about 1 s per GB): any changed byte, or another file under the name,
    shows. Only a regular file is read (files.open_regular): a FIFO there raises OSError, never blocks."""
    h = hashlib.blake2b(digest_size=16)
    with files.open_regular(path) as f:
        for block in iter(lambda: f.read(2**22), b""):
            h.update(block)
    return h.hexdigest()


def write_decoded(images, labels, path):
    """The decoded images (N, 3, H, W) uint8 and labels as one uncompressed .npz, the torch loader's cache of
    an image folder (decoding 50,000 JPEGs takes minutes; reading this, a second). -> its checksum."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    except OSError as e:
        raise files.os_error(e, path, "nothing was written") from None
    files.check_space([(path, images.numel() + labels.numel() * 8 + 2**20)],
                      "free space, or use --loader=ffcv")
    with files.created(path, kept="nothing was written") as f:
        np.savez(f, images=images.numpy(), labels=labels.numpy())
    return checksum(path)


def read_decoded(path, meta):
    """-> (images, labels) of a verified decoded cache (verify_beton first): its arrays must be what its
    .json claims, else one UserError line."""
    try:
        with files.open_regular(path) as f, np.load(f) as z:
            images, labels = z["images"], z["labels"]
    except Exception as e:
        raise UserError(f"cannot read {path} ({type(e).__name__}): delete it and its .json") from None
    size = meta["image_size"]
    if images.dtype != np.uint8 or images.shape[1:] != (3, size, size) or labels.shape != (len(images),) or \
            len(images) != meta["images"]:
        raise UserError(f"{path} does not hold what its .json claims: delete it and its .json")
    return torch.from_numpy(images), torch.from_numpy(labels).long()


def write_verified_beton(images, labels, num_classes, path, origin=None, writer=write_beton):
    """A beton and its metadata, PATH.json: what it holds, what it was written from (`origin`, the split's
    provenance()), and the file's size and checksum, which every use verifies. Any .json there is removed
    first and the new one renamed into place last: a beton without it is rewritten. Both are created fresh
    (a link at either name is replaced, never followed); a failed write is one UserError line and leaves
    neither, nor any temporary file."""
    meta_path = path + ".json"
    refuse_special(path)
    refuse_special(meta_path)
    try:
        os.remove(meta_path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise files.os_error(e, meta_path, "nothing was written") from None
    meta = {"num_classes": num_classes, "images": len(images), "image_size": images.shape[-1]}
    meta.update(origin or {})
    meta["blake2b"] = writer(images, labels, path)
    try:
        meta["bytes"] = os.path.getsize(path)
        meta["claims_blake2b"] = claims_digest(meta)
        with files.created(meta_path, "w", kept=f"{path} was removed: nothing was written") as f:
            json.dump(meta, f)
    except OSError as e:
        remove_quietly(path)
        raise files.os_error(e, path, "nothing was written") from None
    except UserError:
        remove_quietly(path)
        raise
    return meta


def claims_digest(meta):
    """BLAKE2b of everything the .json claims (the class count, the images, the provenance, the beton's own
    checksum): a claim edited after writing no longer matches it."""
    claims = {k: v for k, v in meta.items() if k != "claims_blake2b"}
    return hashlib.blake2b(json.dumps(claims, sort_keys=True).encode(), digest_size=16).hexdigest()


def remove_quietly(path):
    with contextlib.suppress(OSError):
        os.remove(path)


def read_meta(path):
    """A cached beton's metadata, or None where the beton must be (re)written: either file missing, or
    metadata from before checksums or provenance were recorded (said in a note line). The .json is read
    only from a regular file of at most META_LIMIT bytes."""
    if not (os.path.exists(path) and os.path.exists(path + ".json")):
        return None
    try:
        with files.open_regular(path + ".json") as f:
            text = f.read(META_LIMIT + 1)
        if len(text) > META_LIMIT:
            raise ValueError(f"over {META_LIMIT} bytes")
        meta = json.loads(text)
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
        counts = (meta.get("num_classes"), meta.get("bytes"))
        if "blake2b" in meta and not all(type(c) is int for c in counts):  # a bool is not a number
            raise ValueError("no num_classes or bytes")
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested thousands deep
        raise UserError(f"cannot read {path}.json ({type(e).__name__}); "
                        f"delete it and {path} to rewrite them") from None
    if "blake2b" not in meta:
        print(f"note: {path} has no checksum recorded (an older cache); rewriting it")
        return None
    if not all(k in meta for k in PROVENANCE) or "claims_blake2b" not in meta:
        print(f"note: {path} does not record the data it was written from (an older cache); rewriting it")
        return None
    return meta


def verify_beton(path, meta, image_size, origin=None):
    """The beton is the one its metadata describes: the data asked for (`origin`, provenance(); without it,
    the resolution only), its size and every byte."""
    asked = origin or {"image_size": image_size}
    field = next((k for k in PROVENANCE if k in asked and meta.get(k) != asked[k]), None)
    try:
        problem = (f"holds {meta.get('image_size')}px images, not {image_size}px"
                   if field == "image_size"
                   else f"records {field} {meta.get(field)!r} in its .json, not {asked[field]!r} as asked"
                   if field
                   else "has a .json whose claims were changed after it was written (num_classes, ...)"
                   if claims_digest(meta) != meta["claims_blake2b"]
                   else f"is {os.path.getsize(path)} bytes, not the {meta['bytes']} written"
                   if os.path.getsize(path) != meta.get("bytes")
                   else "does not match the checksum recorded when it was written"
                   if checksum(path) != meta["blake2b"]
                   else None)
    except OSError as e:
        problem = f"cannot be read ({e.strerror or e})"
    if problem:
        raise UserError(f"{path} {problem} (corrupt or replaced): delete it and its .json to rewrite it")

"""Datasets as uint8 tensors, and the loader that feeds them to training.

    images, labels, num_classes = load_dataset("shapes", "data", image_size=16)
    loader = Loader(images, labels, batch_size=64, seed=0, device="cpu")
    x0, y = loader.next()        # x0: (B, C, H, W) float in [-1, 1] on the device; y: (B,) or None

Three sources, all ending as an (N, 3, H, W) uint8 tensor plus (N,) int64 labels:
- 'cifar10': torchvision's CIFAR-10, downloaded into data_dir on first use;
- 'folder':  any folder of images; class subfolders become labels, a flat folder is class 0;
- 'shapes':  a built-in procedural dataset (coloured shapes on striped gradient backgrounds),
             deterministic, any resolution, no download: the offline demo data.
Training reads them through FFCV from a cached, verified .beton (FFCVLoader), from host memory
(Loader), or from device memory with the whole data set on the device (ResidentLoader); all three
follow one epoch plan, so they give the same batches. `python data.py --out X.beton` writes a beton.

Measured (2026-12-02, 2 CPU cores, CIFAR-10 train): FFCVLoader 78k img/s, 16.9x a typical torch
DataLoader with per-sample transforms and 2 workers (`python benchmark.py --loaders`, BENCHMARKS.md).
"""
import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import threading

import numpy as np
import torch
import torch.nn.functional as F

from errors import UserError, reported

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
SHAPE_CLASSES = ("circle", "square", "triangle", "diamond")  # label order of the 'shapes' dataset


# images in the built-in 'shapes' dataset, unless told otherwise (TrainerConfig.shapes_count)
SHAPES_COUNT = 50_000
BETON_DIR = "data/betons"  # where betons are cached, unless told otherwise (TrainerConfig.beton_dir)


def resize_center_crop(images, size):
    """(N, C, h, w) uint8 -> (N, C, size, size) uint8: resize the short side to `size`, crop the centre."""
    h, w = images.shape[-2:]
    if (h, w) == (size, size):
        return images
    scale = size / min(h, w)
    nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
    x = F.interpolate(images.float(), size=(nh, nw), mode="bilinear", antialias=True, align_corners=False)
    top, left = (nh - size) // 2, (nw - size) // 2
    return x[..., top : top + size, left : left + size].round().clamp(0, 255).to(torch.uint8)


# -----------------------------------------------------------------------------
# the three sources


def cifar10(data_dir, image_size, train=True):
    import torchvision

    try:
        ds = torchvision.datasets.CIFAR10(data_dir, train=train, download=True)
    except Exception as e:  # no network, a partial file, ... : say where the files go
        raise UserError(
            f"could not get CIFAR-10 into '{data_dir}' ({type(e).__name__}: {e}). Put cifar-10-python.tar.gz "
            f"(https://www.cs.toronto.edu/~kriz/cifar.html) in '{data_dir}', or use --dataset=shapes, "
            "which works offline"
        ) from None
    images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()  # (N, 3, 32, 32) uint8
    return resize_center_crop(images, image_size), torch.tensor(ds.targets, dtype=torch.long), 10


def to_rgb8(im):
    """A PIL image of any mode -> (H, W, 3) uint8. 16-bit and 32-bit grayscale ('I;16', 'I', 'F') is scaled to
    8 bits, not clipped (PIL's convert('RGB') clips 65535-scaled values to white); palettes are expanded,
    alpha is dropped, and CMYK, YCbCr, LAB and 1-bit images are converted by PIL."""
    if im.mode.startswith("I") or im.mode == "F":
        a = np.asarray(im, dtype=np.float64)
        peak = 65535.0 if im.mode.startswith("I;16") or a.max(initial=0) > 255 else 255.0
        if im.mode == "F" and a.max(initial=0) <= 1.0:  # float images in [0, 1]
            peak = 1.0
        a = np.clip(np.round(a * (255.0 / peak)), 0, 255).astype(np.uint8)
        return np.repeat(a[..., None], 3, axis=2)
    return np.array(im.convert("RGB"))


def image_folder(root, image_size):
    """Every image below `root`; its first-level subfolders are the classes (sorted by name)."""
    from PIL import Image

    if not os.path.isdir(root):
        raise UserError(f"image folder '{root}' does not exist")
    files, skipped = [], 0
    for dirpath, _, names in sorted(os.walk(root)):
        for name in sorted(names):
            if name.lower().endswith(IMAGE_EXTENSIONS):
                files.append(os.path.join(dirpath, name))
            else:
                skipped += 1
    if not files:
        raise UserError(f"image folder '{root}' holds no images ({', '.join(IMAGE_EXTENSIONS)})")
    top = [os.path.relpath(f, root).split(os.sep)[0] for f in files]
    has_classes = all(os.path.isdir(os.path.join(root, d)) for d in top)
    classes = sorted(set(top)) if has_classes else []
    images, labels, corrupt = [], [], 0
    for f, d in zip(files, top):
        try:
            with Image.open(f) as im:
                arr = to_rgb8(im)
        except Exception:
            corrupt += 1
            continue
        images.append(resize_center_crop(torch.from_numpy(arr).permute(2, 0, 1)[None], image_size))
        labels.append(classes.index(d) if has_classes else 0)
    if not images:
        raise UserError(f"image folder '{root}': none of its {len(files)} images could be read")
    print(
        f"folder {root}: {len(images)} images, {max(len(classes), 1)} classes"
        f" ({skipped} non-image files skipped, {corrupt} unreadable images skipped)"
    )
    return torch.cat(images), torch.tensor(labels, dtype=torch.long), len(classes)


def shapes(n, image_size, seed=0, chunk=2048):
    """n images of one coloured shape (SHAPE_CLASSES) on a striped two-colour gradient; label = shape.

    Drawn with 1-pixel anti-aliased edges from signed distances, in chunks to bound memory.
    The same (n, image_size, seed) always gives the same tensors.
    """
    g = torch.Generator().manual_seed(seed)
    c = (torch.arange(image_size, dtype=torch.float32) + 0.5) / image_size  # pixel centres in [0, 1]
    py, px = torch.meshgrid(c, c, indexing="ij")  # (H, W), y points down
    out, labels = [], []
    for start in range(0, n, chunk):
        b = min(chunk, n - start)

        def u(*shape, lo=0.0, hi=1.0):
            return lo + (hi - lo) * torch.rand(*shape, generator=g)

        # background: muted two-colour gradient along a random direction, with faint stripes across it
        c1, c2 = u(b, 3, 1, 1, lo=0.1, hi=0.6), u(b, 3, 1, 1, lo=0.1, hi=0.6)
        angle = u(b, 1, 1, hi=2 * math.pi)
        along = (px - 0.5) * torch.cos(angle) + (py - 0.5) * torch.sin(angle) + 0.5  # (b, H, W)
        across = -(px - 0.5) * torch.sin(angle) + (py - 0.5) * torch.cos(angle)
        stripes = 0.04 * torch.sin(2 * math.pi * u(b, 1, 1, lo=1.0, hi=2.5) * across)
        bg = c1 + (c2 - c1) * along[:, None] + stripes[:, None]

        # foreground: one bright, saturated shape
        label = torch.randint(len(SHAPE_CLASSES), (b,), generator=g)
        cx, cy = u(b, 1, 1, lo=0.4, hi=0.6), u(b, 1, 1, lo=0.4, hi=0.6)
        r = u(b, 1, 1, lo=0.25, hi=0.38)
        dx, dy = px - cx, py - cy
        dist = torch.stack(
            [
                torch.sqrt(dx**2 + dy**2) - r,  # circle of radius r
                torch.maximum(dx.abs(), dy.abs()) - 0.8 * r,  # square
                # triangle, apex up
                torch.stack([dy, 0.866 * dx - 0.5 * dy, -0.866 * dx - 0.5 * dy]).amax(0) - 0.5 * r,
                (dx.abs() + dy.abs()) - 1.15 * r,  # diamond
            ]
        )[label, torch.arange(b)]  # (b, H, W) signed distance, < 0 inside
        alpha = (0.5 - dist * image_size).clamp(0, 1)[:, None]
        hue = u(b, 1, 1)
        # (b, 3, 1, 1)
        colour = torch.stack([0.5 + 0.5 * torch.cos(2 * math.pi * (hue + k / 3)) for k in range(3)], 1)
        img = bg * (1 - alpha) + (0.15 + 0.85 * colour) * alpha
        out.append((img.clamp(0, 1) * 255).round().to(torch.uint8))
        labels.append(label)
    return torch.cat(out), torch.cat(labels), len(SHAPE_CLASSES)


def load_dataset(name, data_dir, image_size, shapes_count=SHAPES_COUNT, train=True):
    """-> (images (N, 3, H, W) uint8, labels (N,) int64, num_classes)."""
    if name == "cifar10":
        return cifar10(data_dir, image_size, train)
    if name == "folder":
        return image_folder(data_dir, image_size)
    if name == "shapes":
        return shapes(shapes_count, image_size, seed=0 if train else 1)
    raise UserError(f"unknown dataset '{name}'")


# -----------------------------------------------------------------------------
# FFCV .beton files: written once per (dataset, split, resolution), then reused


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
    if os.path.exists(path) and not os.path.isfile(path):  # /dev/full, a folder: never replaced by a file
        raise UserError(f"{path} exists and is not a regular file")
    need = images.numel() // (1 if raw else 4) + 2**20  # FFCV's writer hangs on a full disk: fail before it
    try:
        os.makedirs(folder, exist_ok=True)
        free = shutil.disk_usage(folder).free
    except OSError as e:
        raise UserError(f"cannot write {path} ({e.strerror or e})") from None
    if free < need:
        raise UserError(f"{folder} has {free / 2**20:.0f} MiB free; "
                        f"the beton needs about {need / 2**20:.0f} MiB")
    tmp = f"{path}.tmp-{os.getpid()}"
    previous = (signal.signal(signal.SIGTERM, interrupt)
                if threading.current_thread() is threading.main_thread() else None)
    try:
        DatasetWriter(tmp, {"image": field, "label": IntField()},
                      num_workers=num_workers).from_indexed_dataset(Rows())
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(f"cannot write {path} ({e.strerror or e})") from None
    finally:  # an error, Ctrl-C or SIGTERM leaves no temporary file behind
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return checksum(path)


def interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def checksum(path):
    """BLAKE2b of the whole file (about 1 s per GB): any changed byte, or another file under the name,
    shows."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**22), b""):
            h.update(block)
    return h.hexdigest()


def beton_name(dataset, data_dir, image_size, shapes_count, train):
    """A name that changes whenever the contents would: dataset, split, resolution (and source files)."""
    name = f"{dataset}-{'train' if train else 'test'}-{image_size}px"
    if dataset == "shapes":
        name += f"-n{shapes_count}"
    if dataset == "folder":  # the folder's files, sizes and modification times
        h = hashlib.sha1(os.path.abspath(data_dir).encode())
        for dirpath, _, names in sorted(os.walk(data_dir)):
            for n in sorted(names):
                st = os.stat(os.path.join(dirpath, n))
                h.update((f"{os.path.relpath(os.path.join(dirpath, n), data_dir)}:"
                          f"{st.st_size}:{st.st_mtime_ns}").encode())
        name += f"-{h.hexdigest()[:12]}"
    return name + ".beton"


def beton_for(dataset, data_dir, image_size, beton_dir, shapes_count=SHAPES_COUNT, train=True):
    """-> (path of a finished .beton, num_classes), writing it first if it is not cached yet."""
    path = os.path.join(beton_dir, beton_name(dataset, data_dir, image_size, shapes_count, train))
    meta = read_meta(path)
    if meta is None:
        images, labels, num_classes = load_dataset(dataset, data_dir, image_size, shapes_count, train)
        print(f"writing {path} ({len(images)} images)")
        meta = write_verified_beton(images, labels, num_classes, path)
    verify_beton(path, meta, image_size)
    return path, meta["num_classes"]


def write_verified_beton(images, labels, num_classes, path):
    """A beton and its metadata, PATH.json: what it holds and the file's size and checksum, which every
    use verifies. The metadata is renamed into place last: a beton without it is rewritten."""
    meta = {"num_classes": num_classes, "images": len(images), "image_size": images.shape[-1]}
    meta.update(blake2b=write_beton(images, labels, path), bytes=os.path.getsize(path))
    try:
        with open(path + ".json.tmp", "w") as f:
            json.dump(meta, f)
        os.replace(path + ".json.tmp", path + ".json")
    except OSError as e:
        raise UserError(f"cannot write {path}.json ({e.strerror or e})") from None
    return meta


def read_meta(path):
    """A cached beton's metadata, or None where the beton must be (re)written: either file missing, or
    metadata from before checksums were recorded."""
    if not (os.path.exists(path) and os.path.exists(path + ".json")):
        return None
    try:
        with open(path + ".json") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path}.json ({type(e).__name__}); "
                        f"delete it and {path} to rewrite them") from None
    if "blake2b" not in meta:
        print(f"note: {path} has no checksum recorded (an older cache); rewriting it")
        return None
    return meta


def verify_beton(path, meta, image_size):
    """The beton is the one its metadata describes: its resolution, its size and every byte."""
    problem = (f"holds {meta.get('image_size')}px images, not {image_size}px"
               if meta.get("image_size") != image_size
               else f"is {os.path.getsize(path)} bytes, not the {meta['bytes']} written"
               if os.path.getsize(path) != meta.get("bytes")
               else "does not match the checksum recorded when it was written"
               if checksum(path) != meta["blake2b"]
               else None)
    if problem:
        raise UserError(f"{path} {problem} (corrupt or replaced): delete it and its .json to rewrite it")


# -----------------------------------------------------------------------------
# the loaders


def epoch_plan(seed, epoch, n):
    """Epoch `epoch`'s order (a permutation of range(n)) and flips (one bit per image).

    A function of (seed, epoch) alone, so every loader, and every resumed run, sees the same batches.
    torch seeds its CPU generator from 32 bits: hash (seed, epoch) into them rather than add them.
    """
    g = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0]))
    return torch.randperm(n, generator=g), torch.rand(n, generator=g) < 0.5


def shard(order, n):
    """This rank's share of an epoch's order under torch.distributed (all of it otherwise)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return order
    rank, world = dist.get_rank(), dist.get_world_size()
    return order[rank::world][: n // world]


def world_size():
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def to_device(x, device):
    """A host tensor to the device without a host sync: a copy from pageable memory would wait for
    the GPU's queue to drain first, so it goes through pinned memory."""
    if device.type == "cuda" and x.device.type == "cpu":
        x = x.pin_memory()
    return x.to(device, non_blocking=True)


class Loader:
    """Endless shuffled batches (drop_last) with random horizontal flips, normalised on the device.

    This is the plain torch path: the uint8 images live in memory and a batch is one gather.
    The position (epoch, index) is the loader's whole state: with `epoch_plan`, a run resumed
    mid-epoch sees exactly the batches it would have seen.
    """

    def __init__(self, images, labels, batch_size, seed, device, hflip=True, with_labels=False):
        self.images, self.labels = images, labels
        self._init_state(len(images), batch_size, seed, device, hflip, with_labels)

    def _init_state(self, n, batch_size, seed, device, hflip, with_labels):
        # under torchrun each rank draws from its 1/world share of the images
        if batch_size * world_size() > n:
            raise UserError(f"the global batch of {batch_size * world_size()} images "
                            f"exceeds the dataset's {n}")
        self.n, self.batch_size, self.seed, self.hflip, self.with_labels = (int(n), batch_size, seed, hflip,
                                                                            with_labels)
        self.device = torch.device(device)
        self.epoch, self.index = 0, 0
        self._start_epoch()

    def _start_epoch(self):
        order, self.flips = epoch_plan(self.seed, self.epoch, self.n)
        self.order = shard(order, self.n)

    def state_dict(self):
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state):
        self.epoch, self.index = state["epoch"], state["index"]
        self._start_epoch()

    def next(self):
        """-> (x0 (B, C, H, W) float32 in [-1, 1], y (B,) int64 or None), both on the device."""
        if self.index + self.batch_size > len(self.order):  # drop_last
            self.epoch, self.index = self.epoch + 1, 0
            self._start_epoch()
        idx = self.order[self.index : self.index + self.batch_size]
        self.index += self.batch_size
        x, y = self._fetch(idx)
        return self._finish(x, y, self.flips[idx])

    def _fetch(self, idx):
        """The uint8 images and labels of dataset indices idx, on the device."""
        return to_device(self.images[idx], self.device), to_device(self.labels[idx], self.device)

    def _finish(self, x, y, flips):
        """uint8 -> [-1, 1] and the flips, on the device, in the layout that arrived (FFCV's is
        channels_last): train_step puts it in the model's layout, a copy only where they differ. Both
        loaders hand training the same values. x₀ stays float32 even under bf16 autocast: q_sample's
        √ᾱ coefficients need it, and autocast casts at the first conv."""
        x = x.to(torch.float32).div_(127.5).sub_(1.0)
        if self.hflip:
            flips = to_device(flips, self.device)
            x = torch.where(flips[:, None, None, None], x.flip(3), x)
        return x, (y if self.with_labels else None)


class FFCVLoader(Loader):
    """The same batches as Loader, read from a .beton by FFCV's compiled, multi-threaded pipeline.

    FFCV is handed the order of `epoch_plan` (its own orders are seeded differently), so both
    loaders agree batch for batch; decoding, collation and the host-to-device copy run in FFCV's
    worker threads, ahead of the training step.
    """

    def __init__(self, path, batch_size, seed, device, hflip=True, with_labels=False, num_workers=2):
        from ffcv.traversal_order.base import TraversalOrder

        device = torch.device(device)
        if not os.path.exists(path):
            raise UserError(f"no beton at {path}")
        try:
            with torch_threads_kept():
                self.ffcv = self._open(path, batch_size, num_workers, device)
        except Exception as e:  # FFCV's own errors on a damaged file are assertions and index errors
            raise UserError(f"cannot read the beton {path} ({type(e).__name__}: {e}); "
                            f"it is corrupt or truncated: delete it (and {os.path.basename(path)}.json) "
                            "and it is written again") from None
        outer = self

        class PlanOrder(TraversalOrder):
            def sample_order(self, epoch):
                return outer.order.numpy().astype("uint64")

        # FFCV's constructor only accepts its built-in orders; swap ours in afterwards
        self.ffcv.traversal_order = PlanOrder(self.ffcv)
        self._init_state(self.ffcv.reader.num_samples, batch_size, seed, device, hflip, with_labels)

    @staticmethod
    def _open(path, batch_size, num_workers, device):
        from ffcv.fields.decoders import IntDecoder, SimpleRGBImageDecoder
        from ffcv.loader import Loader as _FFCV
        from ffcv.loader import OrderOption
        from ffcv.transforms import Squeeze, ToDevice, ToTensor, ToTorchImage

        on_gpu = device.type == "cuda"
        return _FFCV(
            path, batch_size=batch_size, num_workers=num_workers, order=OrderOption.SEQUENTIAL,
            drop_last=True, os_cache=True,
            # FFCV's distributed mode, under DDP; its per-rank order (a DistributedSampler's) is then replaced
            # by ours, data.shard, which gives every world size the same global batches
            distributed=torch.distributed.is_available() and torch.distributed.is_initialized(),
            pipelines={
                "image": [SimpleRGBImageDecoder(), ToTensor(), ToDevice(device, non_blocking=on_gpu),
                          ToTorchImage(channels_last=True)],
                "label": [IntDecoder(), ToTensor(), Squeeze(), ToDevice(device, non_blocking=on_gpu)],
            },
        )

    def _start_epoch(self):
        super()._start_epoch()
        self.ffcv.next_epoch = self.epoch
        with torch_threads_kept():
            self.batches = iter(self.ffcv)
        for _ in range(self.index // self.batch_size):  # resuming mid-epoch: skip what was already seen
            next(self.batches)

    def _fetch(self, idx):
        return next(self.batches)  # FFCV follows self.order, so this batch holds images idx


class ResidentLoader(Loader):
    """Loader with the whole uint8 dataset on the device (CIFAR-10 is 150 MB): a batch is one gather
    there, with no host work or copy at all. For datasets that fit in device memory."""

    def __init__(self, images, labels, batch_size, seed, device, hflip=True, with_labels=False):
        super().__init__(images.to(device), labels.to(device), batch_size, seed, device, hflip, with_labels)

    def _start_epoch(self):  # the epoch's order and flips go to the device once, not a batch at a time
        super()._start_epoch()
        self.order, self.flips = to_device(self.order, self.device), to_device(self.flips, self.device)

    def _fetch(self, idx):
        return self.images[idx], self.labels[idx]


def make_loader(kind, dataset, data_dir, image_size, batch_size, seed, device, *, hflip=True,
                with_labels=False, shapes_count=SHAPES_COUNT, beton_dir=BETON_DIR, num_workers=2):
    """-> (loader, num_classes). kind 'ffcv' reads a cached .beton; 'torch', or 'ffcv' when ffcv cannot
    be imported (said in one warning line), gathers from uint8 tensors in memory; 'resident' keeps
    them on the device."""
    if kind == "ffcv" and not ffcv_available():
        print("warning: ffcv cannot be imported (see README: make setup); using the torch loader instead")
        kind = "torch"
    if kind == "ffcv":
        path, num_classes = beton_for(dataset, data_dir, image_size, beton_dir, shapes_count)
        return FFCVLoader(path, batch_size, seed, device, hflip, with_labels, num_workers), num_classes
    images, labels, num_classes = load_dataset(dataset, data_dir, image_size, shapes_count)
    cls = ResidentLoader if kind == "resident" else Loader
    return cls(images, labels, batch_size, seed, device, hflip, with_labels), num_classes


# -----------------------------------------------------------------------------
# python data.py --dataset ... --out PATH.beton   |   python data.py --bench --data_dir FOLDER


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description="Write an FFCV .beton file (with its verified metadata).")
    p.add_argument("--dataset", choices=["cifar10", "folder", "shapes"], default="cifar10")
    p.add_argument("--data_dir", default="data", help="download folder (cifar10) or image folder (folder)")
    p.add_argument("--image_size", type=int, default=32,
                   help="pixels; images are resized and centre-cropped to it")
    p.add_argument("--split", choices=["train", "test"], default="train")
    p.add_argument("--shapes_count", type=int, default=SHAPES_COUNT,
                   help="images in the built-in shapes dataset")
    p.add_argument("--out", help="the .beton to write")
    args = p.parse_args(argv)
    with reported():
        for name in ("image_size", "shapes_count"):
            if getattr(args, name) < 1:
                raise UserError(f"--{name} {getattr(args, name)}: must be >= 1")
        if args.out:
            if not ffcv_available():
                raise UserError("ffcv cannot be imported: run make setup "
                                "(it needs libturbojpeg0-dev libopencv-dev pkg-config)")
            if os.path.exists(args.out) and not os.path.isfile(args.out):  # before loading any data
                raise UserError(f"{args.out} exists and is not a regular file")
            images, labels, num_classes = load_dataset(args.dataset, args.data_dir, args.image_size,
                                                       args.shapes_count, train=args.split == "train")
            write_verified_beton(images, labels, num_classes, args.out)
            print(f"wrote {args.out} and {args.out}.json: {len(images)} images, {args.image_size}px")
        else:
            raise UserError("give --out PATH.beton, the beton to write")


if __name__ == "__main__":
    main()

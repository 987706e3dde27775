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

An image folder is read through one walk (image_files) that lists regular files only and opens nothing:
links are resolved once; FIFOs, devices, sockets, dangling and looping links are skipped and counted; every
image is opened with files.open_regular, so nothing planted in the folder can block a read. A beton's .json
records what it was written from (provenance: dataset, split, source, resolution), and a beton recording
other data than asked is refused; betons and their .json are created fresh and renamed into place (files.py).

Measured (2026-12-02, 2 CPU cores, CIFAR-10 train): FFCVLoader 78k img/s, 16.9x a typical torch
DataLoader with per-sample transforms and 2 workers (`python benchmark.py --loaders`, BENCHMARKS.md).
"""
import hashlib
import json
import math
import os
import stat
import typing

import numpy as np
import torch
import torch.nn.functional as F

from machinery import beton, files, group
from machinery.errors import UserError, reported
from machinery.progress import Progress

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
SHAPE_CLASSES = ("circle", "square", "triangle", "diamond")  # label order of the 'shapes' dataset


# images in the built-in 'shapes' dataset, unless told otherwise (TrainerConfig.shapes_count)
SHAPES_COUNT = 50_000
MAX_SHAPES_COUNT = 10**7  # the most 'shapes' images any command makes (TrainerConfig.shapes_count's bound)
MAX_IMAGE_SIZE = 8192  # pixels a side: the largest resolution any command takes (ModelConfig.image_size's
#                        bound, evaluate.py's .npz images, data.py's --image_size)
MAX_DECODE_PIXELS = 8192**2  # an image file larger than this is skipped as unreadable, never decoded
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


class Listing(typing.NamedTuple):
    """One walk of an image folder (image_files): the images to read, and what was skipped and why."""

    root: str
    files: list  # (path relative to root, size, mtime_ns) of each image file, in reading order
    other: int  # regular files without an image extension
    special: int  # FIFOs, devices, sockets: never opened
    bad_links: int  # dangling or looping links, and links to a folder walked already
    unreadable: int  # folders that could not be listed, entries that vanished while listed

    def fingerprint(self):
        """A hash of the image files' relative paths, sizes and modification times."""
        text = json.dumps(self.files)  # ASCII: any file name, even undecodable bytes, as \u escapes
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    def content_digest(self):
        """A BLAKE2b digest of the image files' relative paths and bytes, read in one streaming pass (4 MiB at
        a time): it changes with any image's content, whatever its size and modification time say."""
        h = hashlib.blake2b(digest_size=16)
        for rel, _, _ in self.files:
            one = hashlib.blake2b(digest_size=16)
            try:
                with files.open_regular(os.path.join(self.root, rel)) as f:
                    for block in iter(lambda: f.read(2**22), b""):
                        one.update(block)
            except OSError:  # gone or no longer a regular file: the loaders skip it as unreadable
                one.update(b"unreadable")
            h.update(json.dumps([rel, one.hexdigest()]).encode())
        return h.hexdigest()

    def skipped(self):
        """'' or what was skipped that is not a regular file: '2 FIFOs/devices/sockets, 1 broken ...'"""
        kinds = ((self.special, "FIFO/device/socket", "FIFOs/devices/sockets"),
                 (self.bad_links, "broken or looping link", "broken or looping links"),
                 (self.unreadable, "unreadable folder or entry", "unreadable folders or entries"))
        return ", ".join(f"{k} {one if k == 1 else many}" for k, one, many in kinds if k)

    def note(self):
        """The one note line on what was skipped that is not a regular file, or None."""
        n = self.special + self.bad_links + self.unreadable
        return (f"note: skipped {n} {'entry' if n == 1 else 'entries'} of {self.root} that "
                f"{'is' if n == 1 else 'are'} not regular image files ({self.skipped()})") if n else None


def image_files(root):
    """The one walk of an image folder, used by all that reads or names one (image_folder, provenance,
    beton_name, the data CLI). It opens nothing, so nothing in the folder can block it. Regular files with an
    image extension are listed; a link is resolved once: to a file (inside the folder or not) it is followed,
    to a folder it is walked unless that folder was walked already (a cycle, or a second name for one);
    dangling and looping links, FIFOs, devices and sockets are skipped and counted."""
    try:
        top = os.stat(root)
    except OSError:
        top = None
    if top is None or not stat.S_ISDIR(top.st_mode):
        raise UserError(f"image folder '{root}' " + ("does not exist" if top is None else "is not a folder"))
    seen = {(top.st_dev, top.st_ino)}  # folders walked, by device and inode
    found, n = [], dict(other=0, special=0, bad_links=0, unreadable=0)
    real, links = [""], []  # folders to list; links to folders, walked after all real folders
    while real or links:
        if real:
            rel = real.pop()
        else:
            links.sort(reverse=True)
            rel, key = links.pop()
            if key in seen:
                n["bad_links"] += 1
                continue
            seen.add(key)
        try:
            with os.scandir(os.path.join(root, rel)) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            n["unreadable"] += 1
            continue
        for e in entries:
            r, is_link = os.path.join(rel, e.name), False
            try:
                is_link = e.is_symlink()
                st = os.stat(e.path) if is_link else e.stat(follow_symlinks=False)
            except OSError:  # dangling, looping (ELOOP), or gone since it was listed
                n["bad_links" if is_link else "unreadable"] += 1
                continue
            if stat.S_ISDIR(st.st_mode):
                key = (st.st_dev, st.st_ino)
                if is_link:
                    links.append((r, key))
                elif key in seen:  # a bind mount of a folder above: a loop without a link
                    n["bad_links"] += 1
                else:
                    seen.add(key)
                    real.append(r)
            elif not stat.S_ISREG(st.st_mode):
                n["special"] += 1
            elif e.name.lower().endswith(IMAGE_EXTENSIONS):
                found.append((r, st.st_size, st.st_mtime_ns))
            else:
                n["other"] += 1
    found.sort(key=lambda f: (os.path.dirname(f[0]), os.path.basename(f[0])))  # as sorted(os.walk(root))
    return Listing(root, found, **n)


def with_images(root, listing=None):
    """-> the walk of an image folder (image_files, or `listing`, one made already) if it lists images; else
    one UserError line naming what was skipped. It opens nothing: a command checks its folder with it before
    it makes anything (ddpm.py before its run folder)."""
    listing = image_files(root) if listing is None else listing
    if not listing.files:
        skipped = listing.skipped()
        raise UserError(f"image folder '{root}' holds no images ({', '.join(IMAGE_EXTENSIONS)})"
                        + (f"; skipped {skipped}" if skipped else ""))
    return listing


def image_folder(root, image_size, listing=None):
    """Every image below `root` (image_files: regular files only); its first-level subfolders are the classes
    (sorted by name). Each is opened with files.open_regular, so a FIFO swapped in after the walk is skipped
    as unreadable, never waited on. `listing`: the walk of `root` already made."""
    from PIL import Image

    listing = with_images(root, listing)
    parts = [rel.split(os.sep) for rel, _, _ in listing.files]
    has_classes = all(len(p) > 1 for p in parts)
    classes = sorted({p[0] for p in parts}) if has_classes else []
    images, labels, corrupt = [], [], 0
    with Progress(f"decoding folder {root}", len(listing.files)) as bar:  # minutes for a large folder
        for (rel, _, _), p in zip(listing.files, parts):
            try:
                with files.open_regular(os.path.join(root, rel)) as f, Image.open(f) as im:
                    if im.width * im.height > MAX_DECODE_PIXELS:  # from the header, before any decoding
                        raise ValueError(f"{im.width}x{im.height} pixels")
                    arr = to_rgb8(im)
                images.append(resize_center_crop(torch.from_numpy(arr).permute(2, 0, 1)[None], image_size))
            except Exception:  # not an image, truncated, unreadable, no longer a regular file, too large
                corrupt += 1
            else:
                labels.append(classes.index(p[0]) if has_classes else 0)
            bar.update()
    if listing.note():
        print(listing.note())
    if not images:
        raise UserError(f"image folder '{root}': none of its {len(listing.files)} images could be read")
    print(
        f"folder {root}: {len(images)} images, {max(len(classes), 1)} classes"
        f" ({listing.other} non-image files skipped, {corrupt} unreadable images skipped)"
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


def shapes_seed(train):
    """The 'shapes' split's seed: 0 for train, 1 for test."""
    return 0 if train else 1


class Dataset(typing.NamedTuple):
    """An entry of DATASETS: a coded dataset's loader and what its data_dir means (`reads`), which decides how
    the loader is called and what provenance() records of its source."""
    load: typing.Callable    # -> (images, labels, classes); download: load(data_dir, image_size, train);
    #                          folder: load(data_dir, image_size, listing);
    #                          built-in: load(shapes_count, image_size, seed)
    reads: str               # 'download' (data_dir: where it is downloaded to), 'folder' (data_dir: the
    #                          images), 'built-in' (no files: shapes_count images, seeded by the split)
    splits: tuple = ("train", "test")  # its DATASET:SPLIT operands of evaluate.py --fid; () for none
    image_size: int = 0      # its own resolution (evaluate.py's default size), 0 for none


# the coded datasets: TrainerConfig.dataset, data.py --dataset and evaluate.py's DATASET:SPLIT read this
# table. Adding one is one loader function and one entry.
DATASETS = {
    "cifar10": Dataset(cifar10, "download", image_size=32),
    "folder": Dataset(image_folder, "folder", splits=()),
    "shapes": Dataset(shapes, "built-in"),
}


def spec(name):
    """DATASETS[name]; an unknown name is one line naming the choices."""
    if name not in DATASETS:
        raise UserError(f"unknown dataset '{name}': choose one of {', '.join(DATASETS)}")
    return DATASETS[name]


def load_dataset(name, data_dir, image_size, shapes_count=SHAPES_COUNT, train=True, listing=None):
    """-> (images (N, 3, H, W) uint8, labels (N,) int64, num_classes). `listing`: for a folder, the walk of
    data_dir already made (image_files), so that what is read is what was named."""
    d = spec(name)
    if d.reads == "download":
        return d.load(data_dir, image_size, train)
    if d.reads == "folder":
        return d.load(data_dir, image_size, listing)
    return d.load(shapes_count, image_size, seed=shapes_seed(train))


def provenance(name, data_dir, image_size, shapes_count=SHAPES_COUNT, train=True, listing=None):
    """The settings that define a split's data, as JSON-able values: equal dicts, the same images.

    {"dataset": a DATASETS key, "split": 'train' | 'test', "image_size": int, "source": str}, the source
    being, for a folder, its absolute path, image count and a fingerprint of its image files (relative paths,
    sizes, modification times: image_files); for a download, the absolute download folder; for a built-in
    dataset, the count and seed. Recorded in each beton's .json and checked on use. A folder is walked
    (stat only) unless `listing`, its walk, is given."""
    reads = spec(name).reads
    if reads == "folder":
        listing = image_files(data_dir) if listing is None else listing
        source = (f"{name} {os.path.abspath(data_dir)}: {len(listing.files)} images, "
                  f"files {listing.fingerprint()}")
    elif reads == "download":
        source = f"{name} in {os.path.abspath(data_dir)}"
    else:
        source = f"{name}: {shapes_count} images, seed {shapes_seed(train)}"
    return {"dataset": name, "split": "train" if train else "test", "image_size": int(image_size),
            "source": source}


# -----------------------------------------------------------------------------
# The .beton cache of each (dataset, split, resolution): beton.py writes and verifies it


def beton_file(origin, shapes_count):
    """A beton's file name from its provenance: it changes whenever the contents would."""
    name = f"{origin['dataset']}-{origin['split']}-{origin['image_size']}px"
    reads = spec(origin["dataset"]).reads
    if reads == "built-in":
        name += f"-n{shapes_count}"
    if reads == "folder":  # the folder's path and its files' names, sizes and modification times
        source = origin["source"].encode(errors="surrogateescape")  # a path of undecodable bytes too
        name += "-" + hashlib.blake2b(source, digest_size=6).hexdigest()
    return name + ".beton"


def beton_name(dataset, data_dir, image_size, shapes_count, train, listing=None):
    """A name that changes whenever the contents would: dataset, split, resolution (and source files)."""
    return beton_file(provenance(dataset, data_dir, image_size, shapes_count, train, listing), shapes_count)


def beton_for(dataset, data_dir, image_size, beton_dir, shapes_count=SHAPES_COUNT, train=True, decoded=False):
    """-> (path of a finished .beton, num_classes), writing it first if it is not cached yet. The beton used
    is the one its .json describes (verify_beton), and that .json records the data asked for. decoded: the
    torch loaders' cache instead, the decoded images as <name>.decoded.npz (beton.write_decoded), made and
    verified the same way."""
    listing = image_files(data_dir) if spec(dataset).reads == "folder" else None  # the one walk
    files.own_or_named(beton_dir, BETON_DIR)
    origin = provenance(dataset, data_dir, image_size, shapes_count, train, listing)
    name = beton_file(origin, shapes_count)
    path = os.path.join(beton_dir, name.replace(".beton", ".decoded.npz") if decoded else name)
    meta = beton.read_meta(path)
    if meta is None:
        images, labels, num_classes = load_dataset(dataset, data_dir, image_size, shapes_count, train,
                                                   listing)
        print(f"writing {path} ({len(images)} images)")
        meta = beton.write_verified_beton(images, labels, num_classes, path, origin,
                                          beton.write_decoded if decoded else beton.write_beton)
    beton.verify_beton(path, meta, image_size, origin)
    return path, meta["num_classes"]


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
    """This rank's share of an epoch's order under torchrun (all of it otherwise)."""
    rank, world = group.rank_world()
    return order if world == 1 else order[rank::world][: n // world]


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
        if batch_size * group.rank_world()[1] > n:
            raise UserError(f"the global batch of {batch_size * group.rank_world()[1]} images "
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
        if not stat.S_ISREG(os.stat(path).st_mode):  # FFCV would wait on a FIFO for ever
            raise UserError(f"{path} is not a regular file, not a beton")
        try:
            with beton.torch_threads_kept():
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
            distributed=group.joined(),
            pipelines={
                "image": [SimpleRGBImageDecoder(), ToTensor(), ToDevice(device, non_blocking=on_gpu),
                          ToTorchImage(channels_last=True)],
                "label": [IntDecoder(), ToTensor(), Squeeze(), ToDevice(device, non_blocking=on_gpu)],
            },
        )

    def _start_epoch(self):
        super()._start_epoch()
        self.ffcv.next_epoch = self.epoch
        with beton.torch_threads_kept():
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
    if kind == "ffcv" and not beton.ffcv_available():
        print("warning: ffcv cannot be imported (see README: make setup); using the torch loader instead")
        kind = "torch"
    if kind == "ffcv":
        path, num_classes = beton_for(dataset, data_dir, image_size, beton_dir, shapes_count)
        return FFCVLoader(path, batch_size, seed, device, hflip, with_labels, num_workers), num_classes
    if spec(dataset).reads == "folder":  # decoded once, then read back from the cache in a second
        path, num_classes = beton_for(dataset, data_dir, image_size, beton_dir, shapes_count, decoded=True)
        images, labels = beton.read_decoded(path, beton.read_meta(path))
    else:
        images, labels, num_classes = load_dataset(dataset, data_dir, image_size, shapes_count)
    cls = ResidentLoader if kind == "resident" else Loader
    return cls(images, labels, batch_size, seed, device, hflip, with_labels), num_classes


# -----------------------------------------------------------------------------
# python data.py --dataset ... --out PATH.beton


def check_host_memory(count, image_size):
    """Refuse in one line, before any image is made, `count` images of image_size that host memory cannot
    hold (a lower bound: the uint8 images alone)."""
    need = count * 3 * image_size**2
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if need > have:
        raise UserError(f"{count:,} images of {image_size}px need at least {need / 2**30:,.1f} GiB; this "
                        f"machine has {have / 2**30:,.1f} GiB: make them fewer or smaller")


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description="Write an FFCV .beton file (with its verified metadata).")
    p.add_argument("--dataset", choices=list(DATASETS), default="cifar10")
    p.add_argument("--data_dir", default="data", help="download folder (cifar10) or image folder (folder)")
    p.add_argument("--image_size", type=int, default=32,
                   help="pixels; images are resized and centre-cropped to it")
    p.add_argument("--split", choices=["train", "test"], default="train")
    p.add_argument("--shapes_count", type=int, default=SHAPES_COUNT,
                   help="images in the built-in shapes dataset")
    p.add_argument("--out", help="the .beton to write")
    args = p.parse_args(argv)
    with reported():
        for name, top in (("image_size", MAX_IMAGE_SIZE), ("shapes_count", MAX_SHAPES_COUNT)):
            if not 1 <= getattr(args, name) <= top:
                raise UserError(f"--{name} {getattr(args, name)}: must lie in [1, {top}]")
        if args.out:
            if not beton.ffcv_available():
                raise UserError("ffcv cannot be imported: run make setup "
                                "(it needs libturbojpeg0-dev libopencv-dev pkg-config)")
            beton.refuse_special(args.out)  # before loading any data
            train = args.split == "train"
            listing = image_files(args.data_dir) if DATASETS[args.dataset].reads == "folder" else None
            origin = provenance(args.dataset, args.data_dir, args.image_size, args.shapes_count, train,
                                listing)
            built_in = DATASETS[args.dataset].reads == "built-in"  # a download's count is known once loaded
            count = len(listing.files) if listing else args.shapes_count * built_in
            check_host_memory(count, args.image_size)
            images, labels, num_classes = load_dataset(args.dataset, args.data_dir, args.image_size,
                                                       args.shapes_count, train, listing)
            beton.write_verified_beton(images, labels, num_classes, args.out, origin)
            print(f"wrote {args.out} and {args.out}.json: {len(images)} images, {args.image_size}px")
        else:
            raise UserError("give --out PATH.beton, the beton to write")


if __name__ == "__main__":
    main()

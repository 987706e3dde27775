"""Datasets as uint8 tensors, and the loader that feeds them to training.

    images, labels, num_classes = load_dataset("shapes", "data", image_size=16)
    loader = Loader(images, labels, batch_size=64, seed=0, device="cpu")
    x0, y = loader.next()        # x0: (B, C, H, W) float in [-1, 1] on the device; y: (B,) or None

Three sources, all ending as an (N, 3, H, W) uint8 tensor plus (N,) int64 labels:
- 'cifar10': torchvision's CIFAR-10, downloaded into data_dir on first use;
- 'folder':  any folder of images; class subfolders become labels, a flat folder is class 0;
- 'shapes':  a built-in procedural dataset (coloured shapes on striped gradient backgrounds),
             deterministic, any resolution, no download: the offline demo data.
"""
import math
import os

import numpy as np
import torch
import torch.nn.functional as F

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
SHAPE_CLASSES = ("circle", "square", "triangle", "diamond")  # label order of the 'shapes' dataset


class DataError(Exception):
    """Bad or missing data: reported to the user as one line."""


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
        raise DataError(
            f"could not get CIFAR-10 into '{data_dir}' ({type(e).__name__}: {e}). Put cifar-10-python.tar.gz "
            f"(https://www.cs.toronto.edu/~kriz/cifar.html) in '{data_dir}', or use --dataset=shapes, which works offline"
        ) from None
    images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()  # (N, 3, 32, 32) uint8
    return resize_center_crop(images, image_size), torch.tensor(ds.targets, dtype=torch.long), 10


def image_folder(root, image_size):
    """Every image below `root`; its first-level subfolders are the classes (sorted by name)."""
    from PIL import Image

    if not os.path.isdir(root):
        raise DataError(f"image folder '{root}' does not exist")
    files, skipped = [], 0
    for dirpath, _, names in sorted(os.walk(root)):
        for name in sorted(names):
            if name.lower().endswith(IMAGE_EXTENSIONS):
                files.append(os.path.join(dirpath, name))
            else:
                skipped += 1
    if not files:
        raise DataError(f"image folder '{root}' holds no images ({', '.join(IMAGE_EXTENSIONS)})")
    top = [os.path.relpath(f, root).split(os.sep)[0] for f in files]
    has_classes = all(os.path.isdir(os.path.join(root, d)) for d in top)
    classes = sorted(set(top)) if has_classes else []
    images, labels, corrupt = [], [], 0
    for f, d in zip(files, top):
        try:
            with Image.open(f) as im:
                arr = np.array(im.convert("RGB"))  # grayscale, palette and RGBA all become RGB
        except Exception:
            corrupt += 1
            continue
        images.append(resize_center_crop(torch.from_numpy(arr).permute(2, 0, 1)[None], image_size))
        labels.append(classes.index(d) if has_classes else 0)
    if not images:
        raise DataError(f"image folder '{root}': none of its {len(files)} images could be read")
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
                torch.stack([dy, 0.866 * dx - 0.5 * dy, -0.866 * dx - 0.5 * dy]).amax(0) - 0.5 * r,  # triangle, apex up
                (dx.abs() + dy.abs()) - 1.15 * r,  # diamond
            ]
        )[label, torch.arange(b)]  # (b, H, W) signed distance, < 0 inside
        alpha = (0.5 - dist * image_size).clamp(0, 1)[:, None]
        hue = u(b, 1, 1)
        colour = torch.stack([0.5 + 0.5 * torch.cos(2 * math.pi * (hue + k / 3)) for k in range(3)], 1)  # (b, 3, 1, 1)
        img = bg * (1 - alpha) + (0.15 + 0.85 * colour) * alpha
        out.append((img.clamp(0, 1) * 255).round().to(torch.uint8))
        labels.append(label)
    return torch.cat(out), torch.cat(labels), len(SHAPE_CLASSES)


def load_dataset(name, data_dir, image_size, shapes_count=50_000, train=True):
    """-> (images (N, 3, H, W) uint8, labels (N,) int64, num_classes)."""
    if name == "cifar10":
        return cifar10(data_dir, image_size, train)
    if name == "folder":
        return image_folder(data_dir, image_size)
    if name == "shapes":
        return shapes(shapes_count, image_size, seed=0 if train else 1)
    raise DataError(f"unknown dataset '{name}'")


# -----------------------------------------------------------------------------
# the loader


class Loader:
    """Endless shuffled batches (drop_last) with random horizontal flips, normalised on the device.

    Epoch e's order and flips come from a generator seeded with (seed, e), so (epoch, index) is the
    loader's whole state: a run resumed mid-epoch sees exactly the batches it would have seen.
    """

    def __init__(self, images, labels, batch_size, seed, device, hflip=True, with_labels=False):
        if batch_size > len(images):
            raise DataError(f"batch_size {batch_size} exceeds the dataset's {len(images)} images")
        self.images, self.labels = images, labels
        self.batch_size, self.seed, self.hflip, self.with_labels = batch_size, seed, hflip, with_labels
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self.epoch, self.index = 0, 0
        self._new_epoch()

    def _new_epoch(self):
        # torch seeds its CPU generator from 32 bits: hash (seed, epoch) into them rather than add
        g = torch.Generator().manual_seed(int(np.random.SeedSequence([self.seed, self.epoch]).generate_state(1)[0]))
        self.order = torch.randperm(len(self.images), generator=g)
        self.flips = torch.rand(len(self.images), generator=g) < 0.5

    def state_dict(self):
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state):
        self.epoch, self.index = state["epoch"], state["index"]
        self._new_epoch()

    def next(self):
        """-> (x0 (B, C, H, W) float32 in [-1, 1], y (B,) int64 or None), both on the device."""
        if self.index + self.batch_size > len(self.images):  # drop_last
            self.epoch, self.index = self.epoch + 1, 0
            self._new_epoch()
        idx = self.order[self.index : self.index + self.batch_size]
        flips = self.flips[self.index : self.index + self.batch_size]
        self.index += self.batch_size
        x = self.images[idx]
        if self.pin:
            x = x.pin_memory()
        x = x.to(self.device, non_blocking=True).float().div_(127.5).sub_(1.0)
        if self.hflip:
            flips = flips.to(self.device, non_blocking=True)
            x = torch.where(flips[:, None, None, None], x.flip(3), x)
        y = self.labels[idx].to(self.device, non_blocking=True) if self.with_labels else None
        return x, y

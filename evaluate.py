"""Evaluation: FID, Inception Score and precision/recall of samples, and bits/dim of held-out images.

    ref = reference_stats(inception(device), "cifar10", "data", 32, 50_000, device, cache_dir)  # cached
    fid_metrics(*features(extractor, batches, device), ref)     # {'fid', 'inception_score', 'precision', ...}
    held_out_bits(diffusion, model, images, labels, ...)        # bpd / bpd_estimate (below), batched
    TrainingEval(mc, tc, diffusion, sample, device)(net, ema)   # what train() logs every eval_every_steps

A library for sample.py and ddpm.py; it imports neither: it is handed the model callable, the Diffusion and
the config values it needs. Under torch.distributed every rank does 1/world of the work and sums are
all-reduced.

It is also a command that scores anything against anything (main, below):

    python evaluate.py --fid samples.npz cifar10:train          # an .npz (arr_0: uint8 N x H x W x 3)
    python evaluate.py --fid generated/ cifar10:train           # an image folder (PNG, JPEG, ...)
    python evaluate.py --fid cifar10:test cifar10:train         # the data against itself: a sanity check
    python evaluate.py --fid folder:/data/cifar/test /data/cifar/train --image_size 32 --out check.json

A is scored against B, each an .npz, an image folder (or folder:PATH) or DATASET:SPLIT (cifar10 or shapes,
train or test; --data_dir). B's statistics are cached in --stats_dir: a split's by its provenance, an .npz's
or a folder's by its content (keep the file to keep them).
"""
import hashlib
import json
import math
import os
import time
import zipfile

import numpy as np
import torch

import data
from machinery import fid, files, group
from machinery.errors import UserError, first_line, reported
from machinery.progress import Progress

# -----------------------------------------------------------------------------
# Bits/dim: the variational bound of a Diffusion's model on held-out images


@torch.no_grad()
def bpd(diffusion, model, x0, y=None, threshold="static", generator=None):
    """Bits per dimension of the full variational bound (Ho et al. eq. 5), one value per image: (B,).

    L = L_T + sum_{t>1} L_{t-1} + L_0, in nats, divided by D ln 2 (D = C·H·W), for 8-bit data in [-1, 1]:
      L_T     = KL(q(x_T|x_0) || N(0, I)), in closed form;
      L_{t-1} = KL(q(x_{t-1}|x_t, x_0) || p(x_{t-1}|x_t)) at one x_t ~ q(x_t|x_0) per t, where p
                has the posterior mean with x̂₀ plugged in and variance β̃_t ('small') or β_t ('large');
      L_0     = -log p(x_0|x_1), a Gaussian at x̂₀ discretised into 256 bins of width 2/255, the
                edge bins open-ended (eq. 13).
    The decoder's variance is β̃ of the paper's t = 2 for both choices, as β̃_1 = 0 (Ho et al.'s code
    does the same). T network calls per batch; `generator` fixes the x_t draws.
    """
    x0 = x0.double()
    nats = prior_nats(diffusion, x0) + sum(vb_term(diffusion, model, x0, t, y, threshold, generator)
                                           for t in range(diffusion.cfg.timesteps - 1, -1, -1))
    return nats / (x0[0].numel() * math.log(2))


@torch.no_grad()
def bpd_estimate(diffusion, model, x0, y=None, strata=50, threshold="static", generator=None):
    """The bound of `bpd` from 2·strata + 1 network calls instead of T: -> (bits/dim, standard error),
    each (B,).

    The KL terms t = 1..T-1 are cut into `strata` contiguous strata of n_k timesteps; two timesteps
    drawn uniformly in each give the stratified estimate Σ_k n_k (L_a + L_b)/2 of their sum, with
    variance Σ_k n_k² (L_a - L_b)²/4. The prior and decoder terms are computed exactly. Every image
    draws its own timesteps, so the images' errors are independent and their standard errors combine
    as such (one draw shared by the batch would correlate them).
    """
    x0, T = x0.double(), diffusion.cfg.timesteps
    if not 1 <= strata <= T - 1:
        raise ValueError(f"strata must lie in [1, {T - 1}]")
    nats = prior_nats(diffusion, x0) + vb_term(diffusion, model, x0, 0, y, threshold, generator)
    var = torch.zeros_like(nats)
    edges = torch.linspace(1, T, strata + 1).round().long().tolist()
    for lo, hi in zip(edges[:-1], edges[1:]):
        draws = torch.randint(lo, hi, (2, x0.shape[0]), generator=generator,
                              device=generator.device if generator else "cpu")
        a, b = (vb_term(diffusion, model, x0, t.to(x0.device), y, threshold, generator) for t in draws)
        nats += (hi - lo) * (a + b) / 2
        var += (hi - lo) ** 2 * (a - b) ** 2 / 4
    scale = x0[0].numel() * math.log(2)
    return nats / scale, var.sqrt() / scale


def prior_nats(diffusion, x0):
    """L_T = KL(q(x_T|x_0) || N(0, I)) per image, in nats."""
    ab_T = diffusion.alpha_bar[-1].item()
    return normal_kl(ab_T**0.5 * x0, 1 - ab_T, 0.0, 1.0).flatten(1).sum(1)


def vb_term(diffusion, model, x0, t, y, threshold, generator):
    """L_{t-1} of eq. 5 per image, in nats, at one x_t ~ q(x_t|x_0); t: one timestep for the batch, or
    (B,) timesteps >= 1, one per image; t = 0 is the decoder L_0."""
    tt = torch.full((x0.shape[0],), t, device=x0.device, dtype=torch.long) if isinstance(t, int) else t
    noise = torch.randn(x0.shape, generator=generator,
                        device=generator.device if generator else x0.device)
    z = diffusion.q_sample(x0, tt, noise.to(x0.device, torch.float64))
    out = model(diffusion.net_input(z, tt).float(), tt, y).double()
    x0_hat, _ = diffusion.predict_x0_eps(out, z, tt, threshold)
    mean_p, _ = diffusion.q_posterior_mean_variance(x0_hat, z, tt)
    if isinstance(t, int) and t == 0:  # the discretised decoder
        return -discretized_gaussian_log_likelihood(x0, mean_p,
                                                    diffusion.posterior_variance[1].item()).flatten(1).sum(1)
    mean_q, var_q = diffusion.q_posterior_mean_variance(x0, z, tt)
    table = diffusion.posterior_variance if diffusion.cfg.reverse_variance == "small" else diffusion.betas
    var_p = table[tt].to(x0.dtype).view(-1, *([1] * (x0.dim() - 1)))  # ddpm.extract
    return normal_kl(mean_q, var_q, mean_p, var_p).flatten(1).sum(1)


def normal_kl(mean1, var1, mean2, var2):
    """KL(N(mean1, var1) || N(mean2, var2)) per element, in nats."""
    var1, var2 = torch.as_tensor(var1, dtype=torch.float64), torch.as_tensor(var2, dtype=torch.float64)
    return 0.5 * (torch.log(var2 / var1) + (var1 + (mean1 - mean2) ** 2) / var2 - 1)


def discretized_gaussian_log_likelihood(x, mean, var):
    """log P(x) for x in {-1, ..., 1} (256 levels) under N(mean, var) integrated over each pixel's bin
    [x - 1/255, x + 1/255]; the bins of -1 and 1 extend to -inf and +inf (Ho et al. eq. 13)."""
    std = var**0.5
    cdf = lambda v: 0.5 * (1 + torch.erf((v - mean) / (std * math.sqrt(2))))  # noqa: E731
    upper = torch.where(x > 0.999, torch.ones_like(x), cdf(x + 1 / 255))
    lower = torch.where(x < -0.999, torch.zeros_like(x), cdf(x - 1 / 255))
    return torch.log((upper - lower).clamp(min=1e-12))


def held_out_bits(diffusion, model, images, labels, num_classes, device, batch, strata=0, threshold="static",
                  generator=None, progress=False):
    """Bits/dim of uint8 images, batch by batch, in fp32/fp64: the exact bound (strata = 0) or its
    stratified estimate. -> (bits per image (N,) on the CPU, the estimator's summed variance). progress: how
    far it is, with the time left (Progress: a bar on a terminal, lines in a log)."""
    bits, est_var = [], 0.0
    with Progress("bits/dim" if progress else None, len(images)) as bar:
        for start in range(0, len(images), batch):
            x0 = images[start : start + batch].to(device).double() / 127.5 - 1
            y = labels[start : start + batch].to(device) if num_classes > 0 else None
            if strata:
                b, se = bpd_estimate(diffusion, model, x0, y, strata=strata, threshold=threshold,
                                     generator=generator)
                est_var += (se**2).sum().item()
            else:
                b = bpd(diffusion, model, x0, y, threshold=threshold, generator=generator)
            bits.append(b.cpu())
            bar.update(len(x0))
    return torch.cat(bits) if bits else torch.zeros(0, dtype=torch.float64), est_var


def to_uint8(x):
    return ((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).cpu()


def generate(sample, net, n, mc, device, *, batch, generator, labels=None, **sampler_args):
    """Yields n samples as uint8 CPU batches of sample(net, shape, y=, generator=, ...) (ddpm.sample with its
    Diffusion); `labels` (n,) for a class-conditional model."""
    for start in range(0, n, batch):
        b = min(batch, n - start)
        y = labels[start : start + b].to(device) if labels is not None else None
        yield to_uint8(sample(net, (b, mc.channels, mc.image_size, mc.image_size), y=y, generator=generator,
                              **sampler_args))


class TrainingEval:
    """What train() runs every eval_every_steps: FID of eval_fid_samples EMA samples (DPM-Solver++ with
    eval_sample_steps) against the training set's cached statistics, and bits/dim of the first eval_bpd_images
    held-out images (the stratified estimate of the bound, eval_bpd_strata strata). Every rank takes 1/world
    of both and the sums are all-reduced, so no rank waits on another. The noise is fixed: the numbers
    are comparable across steps. Built before training starts, so missing weights or data fail at once."""

    def __init__(self, mc, tc, diffusion, sample, device, extractor=None, batch=250):
        self.mc, self.tc, self.diffusion, self.device, self.batch = mc, tc, diffusion, device, batch
        self.sample = sample  # sample(net, shape, ...): ddpm.sample with this Diffusion
        self.rank, self.world = group.rank_world()
        self.extractor = self.ref = self.held_out = None
        if tc.eval_fid_samples:
            self.extractor = extractor or fid.inception(device)
            self.ref = reference_stats(self.extractor, tc.dataset, tc.data_dir, mc.image_size,
                                       tc.shapes_count, device, tc.fid_stats_dir,
                                       ref_images=tc.fid_ref_images)
        if tc.eval_bpd_images:
            try:
                images, labels, _ = data.load_dataset(tc.dataset, tc.data_dir, mc.image_size, tc.shapes_count,
                                                      train=False)
            except UserError as e:
                raise UserError(f"held-out images for bits/dim: {e}") from None
            n = min(tc.eval_bpd_images, len(images))
            self.held_out = images[:n][self.rank :: self.world], labels[:n][self.rank :: self.world]

    @torch.no_grad()
    def __call__(self, net, ema, bpd=True):
        """-> {'fid': ..., 'bpd': ..., ...}: samples from `net` (the EMA model as training runs it, under
        autocast), the bound from `ema` itself, in fp32 (not with bpd=False)."""
        t0, out, tc, mc = time.time(), {}, self.tc, self.mc
        if self.extractor is not None:
            mine = torch.arange(self.rank, tc.eval_fid_samples, self.world)
            labels = mine % mc.num_classes if mc.num_classes > 0 else None
            g = torch.Generator().manual_seed(tc.seed + 1 + self.rank)
            batches = generate(self.sample, net, len(mine), mc, self.device, batch=self.batch, generator=g,
                               labels=labels, sampler=tc.eval_sampler, steps=tc.eval_sample_steps,
                               eta=tc.eta, guidance=tc.guidance, threshold=tc.threshold)
            feats, _ = fid.features(self.extractor, batches, self.device, desc="sampling for FID",
                                    total=len(mine))
            out["fid"] = fid.fid_metrics(feats, None, self.ref, prc=False)["fid"]
            out["fid_samples"] = tc.eval_fid_samples
        if self.held_out is not None and bpd:
            g = torch.Generator().manual_seed(tc.seed + 1 + self.rank)
            bits, _ = held_out_bits(self.diffusion, ema, *self.held_out, mc.num_classes, self.device,
                                    self.batch, tc.eval_bpd_strata, generator=g, progress=True)
            (total,) = group.all_reduce_sum(torch.tensor([bits.sum().item(), len(bits)], dtype=torch.float64))
            out["bpd"], out["bpd_images"] = (total[0] / total[1]).item(), int(total[1])
        out["eval_s"] = time.time() - t0
        return out


# -----------------------------------------------------------------------------
# sample.py's scores: FID of the images it drew, bits/dim of held-out images


def reference_path(extractor, dataset, data_dir, image_size, shapes_count, cache_dir, train=True,
                   ref_images=0):
    """Where a split's statistics are cached: the name changes with the data (as a beton's does), with the
    number of its images drawn (fid.reference_subset) and with the network (its name, and its weights' hash
    where it has one)."""
    name = data.beton_name(dataset, data_dir, image_size, shapes_count, train=train)
    drawn = f"-ref{ref_images}" if ref_images else ""
    return os.path.join(cache_dir, name.replace(".beton", drawn + fid.extractor_suffix(extractor)))


def reference_stats(extractor, dataset, data_dir, image_size, shapes_count, device, cache_dir, batch=250,
                    train=True, ref_images=0):
    """A split's (the training set's by default; ref_images of them, drawn by fid.reference_subset, if > 0)
    feature mean and covariance, plus up to fid.REFERENCE_KEEP of its features (precision/recall). Computed
    once, then read from cache_dir (reference_path) as long as they prove to be this split's
    (fid.cached_stats): its provenance (a folder's by the bytes of its images), the draw and the network."""
    path = reference_path(extractor, dataset, data_dir, image_size, shapes_count, cache_dir, train,
                          ref_images)
    listing = data.image_files(data_dir) if data.spec(dataset).reads == "folder" else None
    origin = data.provenance(dataset, data_dir, image_size, shapes_count, train, listing)
    content = listing.content_digest() if listing is not None else None
    settings = fid.stats_settings(extractor, data=origin, content=content, ref_images=ref_images,
                                  seed=fid.REFERENCE_SEED)
    split = "train" if train else "test"

    def compute():
        rank, world = group.rank_world()
        try:
            images, _, _ = data.load_dataset(dataset, data_dir, image_size, shapes_count, train, listing)
        except UserError as e:
            raise UserError(f"FID reference statistics: {e}") from None
        images = fid.reference_subset(images, ref_images, f"{dataset} {split}")
        print(f"computing FID reference statistics of {dataset} {split} ({len(images)} images) into {path}",
              flush=True)
        mine = images[rank::world]
        f, _ = fid.features(extractor, (mine[i : i + batch] for i in range(0, len(mine), batch)), device,
                            desc="FID reference statistics", total=len(mine))
        mu, sigma = fid.mean_cov(f)
        kept = f[: fid.REFERENCE_KEEP // world].float().numpy()  # this rank's share; rank 0's is cached
        return {"mu": mu, "sigma": sigma, "features": kept, "n": np.array(len(images))}

    return fid.cached_stats(path, settings, fid.feature_width(extractor), compute, cache_dir)


def sample_reference(dataset, data_dir, shapes_count, image_size, device, weights, stats_dir, ref_images=0):
    """Before any sampling: -> (the Inception network, the training split's statistics (of ref_images drawn
    from it, if > 0), what a result records of them)."""
    extractor = fid.inception(device, weights)
    ref = reference_stats(extractor, dataset, data_dir, image_size, shapes_count, device, stats_dir,
                          ref_images=ref_images)
    cache = reference_path(extractor, dataset, data_dir, image_size, shapes_count, stats_dir, True,
                           ref_images)
    record = {"dataset": dataset, "data_dir": data_dir, "split": "train", "images": int(ref["n"]),
              "drawn": f"seed {fid.REFERENCE_SEED}" if ref_images else None,
              "image_size": image_size, "sha256": fid.stats_sha256(ref), "cache": os.path.abspath(cache)}
    return extractor, ref, record


def score_samples(feats, logits, reference, record):
    """FID, Inception Score and precision/recall of the samples' features, with the protocol: the reference,
    the network's weights, torch-fidelity's version, and `record` (the samples' settings)."""
    extractor, ref, ref_record = reference
    warning = small_n_warning(len(feats))
    return {**fid.json_safe(fid.fid_metrics(feats, logits, ref)),
            "reference": f"{ref_record['dataset']} train, {ref_record['images']} images",
            "reference_stats": ref_record, **record,
            "feature_extractor": "torch-fidelity inception-v3-compat",
            "inception": fid.extractor_record(extractor),
            "fid_note": warning.removeprefix("warning: ") or None}


def other_scores(result):
    """', inception_score 9.1234, precision 0.5000, recall 0.4000': the other scores a result holds."""
    return "".join(f", {k} {result[k]:.4f}" for k in ("inception_score", "precision", "recall")
                   if result.get(k) is not None)


def held_out_result(diffusion, model, mc, dataset, data_dir, shapes_count, n, seed, batch, strata, threshold,
                    device):
    """Bits/dim of the first n images of the held-out split, in fp32 (the bound sums T terms), with its
    standard error over images (and the estimator's, with strata)."""
    images, labels, _ = data.load_dataset(dataset, data_dir, mc.image_size, shapes_count, train=False)
    n = min(n, len(images))
    g = torch.Generator().manual_seed(seed)
    bits, est_var = held_out_bits(diffusion, model, images[:n], labels[:n], mc.num_classes, device, batch,
                                  strata, threshold, g, progress=True)
    return {"bpd": bits.mean().item(), "sem": (bits.std() / n**0.5).item() if n > 1 else None, "n": n,
            "dataset": dataset, "split": "test", "strata": strata or None,
            "estimator_se": est_var**0.5 / n if strata else None, "reverse_variance": mc.reverse_variance}


# -----------------------------------------------------------------------------
# Images from anywhere: .npz files (streamed), image folders and dataset splits, and the command that scores
# one against another.

SMALL_N = 50_000  # FID is biased upward below this many samples (and published figures use it)


def dataset_splits():
    """The DATASET:SPLIT operands, from data.DATASETS: {name: its splits}; a folder is folder:PATH or PATH."""
    return {name: d.splits for name, d in data.DATASETS.items() if d.splits}


def small_n_warning(n):
    """The one-line warning for a FID of fewer than SMALL_N samples; '' at SMALL_N or more."""
    if n >= SMALL_N:
        return ""
    return (f"warning: FID is biased upward at small n ({n} < {SMALL_N:,} samples): compare FIDs only at "
            "equal n, and quote published figures only at 50,000")


class NpzImages:
    """The uint8 images (N, H, W, 3) of an .npz (arr_0, the ADM evaluator's key, or `images`), read batch by
    batch from the zip entry: memory holds one batch, whatever N. Bad files are one UserError line."""

    def __init__(self, path):
        self.path = path
        try:
            with files.open_regular(path) as f, zipfile.ZipFile(f) as zf:
                names = zf.namelist()
                self.key = next((k for k in ("arr_0.npy", "images.npy") if k in names), None)
                if self.key is None:
                    raise UserError(f"{path} holds no images: no arr_0 (nor images) array in {names[:5]}")
                with zf.open(self.key) as a:
                    self.shape, self.offset = self.header(a, zf.getinfo(self.key).file_size)
        except (OSError, zipfile.BadZipFile, ValueError, EOFError) as e:
            raise UserError(f"{path} is not a readable .npz ({type(e).__name__}: {first_line(e)})") from None

    def header(self, a, size):
        """The array's shape and where its bytes start, checked against the bytes the zip entry holds."""
        version = np.lib.format.read_magic(a)
        fmt = np.lib.format
        read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, fortran, dtype = read(a)
        if dtype != np.uint8 or fortran or len(shape) != 4 or shape[3] != 3 or shape[1] < 1 or shape[2] < 1:
            raise UserError(f"{self.path}: {self.key[:-4]} is {dtype} {shape}{' Fortran-ordered' * fortran}; "
                            "images are uint8 (N, H, W, 3) in C order")
        top = data.MAX_IMAGE_SIZE  # pixels a side, as for every command
        if shape[0] == 0 or max(shape[1:3]) > top:
            raise UserError(f"{self.path}: {self.key[:-4]} is {shape}: " + (
                "no images" if shape[0] == 0 else f"images of at most {top} pixels a side are scored"))
        if size - a.tell() != int(np.prod(shape)):  # a header claiming more (or fewer) images than there are
            raise UserError(f"{self.path}: {self.key[:-4]} announces {shape}, {int(np.prod(shape))} bytes, "
                            f"and holds {size - a.tell()}")
        return tuple(shape), a.tell()

    def __len__(self):
        return self.shape[0]

    def batches(self, batch):
        """-> uint8 (B, 3, H, W) tensors in order."""
        per = int(np.prod(self.shape[1:]))
        batch = max(1, min(batch, 2**30 // per))  # at most 1 GiB of images in memory, whatever --batch
        try:
            with files.open_regular(self.path) as f, zipfile.ZipFile(f) as zf, zf.open(self.key) as a:
                a.read(self.offset)
                for start in range(0, len(self), batch):
                    b = min(batch, len(self) - start)
                    buf = a.read(b * per)
                    if len(buf) != b * per:
                        raise EOFError(f"{len(self)} images announced, {start + len(buf) // per} present")
                    x = np.frombuffer(buf, np.uint8).reshape(b, *self.shape[1:])
                    yield torch.from_numpy(x.copy()).permute(0, 3, 1, 2)
        except (OSError, zipfile.BadZipFile, ValueError, EOFError) as e:
            raise UserError(f"{self.path} is not a readable .npz ({type(e).__name__}: "
                            f"{first_line(e)})") from None


def operand(spec):
    """--fid's A or B -> ('npz', path) | ('folder', path) | ('dataset', name, split)."""
    if spec.startswith("folder:"):
        return ("folder", spec[len("folder:"):])
    name, _, split = spec.partition(":")
    if split in dataset_splits().get(name, ()) and not os.path.exists(spec):
        return ("dataset", name, split)
    if spec.lower().endswith(".npz") and not os.path.isdir(spec):
        return ("npz", spec)
    if os.path.isdir(spec):
        return ("folder", spec)
    raise UserError(f"--fid {spec}: neither an .npz file, an image folder (or folder:PATH), nor "
                    "DATASET:SPLIT, one of "
                    + ", ".join(f"{n}:{s}" for n, ss in dataset_splits().items() for s in ss))


def check_operand(op):
    """Before any Inception work, what can be checked cheaply: an .npz's header, a folder's listing, and at
    least 2 images on each side."""
    if op[0] == "npz" and len(NpzImages(op[1])) < 2:
        raise UserError(f"--fid {op[1]}: one image; FID needs at least 2 (a covariance)")
    count = len(data.image_files(op[1]).files) if op[0] == "folder" else 2
    if count < 2:
        raise UserError(f"--fid {op[1]}: the folder holds {'one image' if count else 'no images'} "
                        f"({', '.join(data.IMAGE_EXTENSIONS)}); FID needs at least 2 (a covariance)")


def describe(op):
    return f"{op[1]}:{op[2]}" if op[0] == "dataset" else op[1]


def operand_batches(op, args, image_size):
    """-> (the number of images, an iterator of uint8 (B, 3, S, S) batches) of one operand at image_size."""
    if op[0] == "npz":
        images = NpzImages(op[1])
        batches = images.batches(args.batch)
        if images.shape[1:3] != (image_size, image_size):
            batches = (data.resize_center_crop(x, image_size) for x in batches)
        return len(images), batches
    if op[0] == "folder":  # data.image_folder reads the whole folder (regular files only)
        x, _, _ = data.load_dataset("folder", op[1], image_size)
    else:
        x, _, _ = data.load_dataset(op[1], args.data_dir, image_size, args.shapes_count,
                                    train=op[2] == "train")
    return len(x), iter(x.split(args.batch))


def default_image_size(a, b, args):
    """The resolution both sides are scored at: --image_size, else an .npz's own, else a dataset's own
    (data.DATASETS: CIFAR-10's 32)."""
    if args.image_size:
        return args.image_size
    for op in (a, b):
        if op[0] == "npz":
            return NpzImages(op[1]).shape[1]
    for op in (a, b):
        if op[0] == "dataset" and data.DATASETS[op[1]].image_size:
            return data.DATASETS[op[1]].image_size
    raise UserError("give --image_size: neither side is an .npz or a dataset of one resolution")


def parse_args(argv):
    import argparse

    p = argparse.ArgumentParser(description="FID (with Inception Score and precision/recall) of A against B.")
    p.add_argument("--fid", nargs=2, metavar=("A", "B"), required=True,
                   help="each an .npz (arr_0: uint8 N x H x W x 3, as sample.py and the ADM evaluator "
                        "write), an image folder (or folder:PATH) or DATASET:SPLIT (cifar10:train, "
                        "cifar10:test, shapes:train, shapes:test); B is the reference")
    p.add_argument("--image_size", type=int, default=0,
                   help="resize (short side) and centre-crop both sides to this; default: an .npz's own "
                        "resolution, else 32 for CIFAR-10")
    p.add_argument("--data_dir", default="data", help="where cifar10 is (or is downloaded to)")
    p.add_argument("--shapes_count", type=int, default=50_000, help="images in the shapes dataset")
    p.add_argument("--stats_dir", default=fid.STATS_DIR,
                   help="where B's statistics are cached (a split by its provenance, an .npz or folder "
                        "by its content)")
    p.add_argument("--inception_weights", default="",
                   help=f"a local copy of torch-fidelity's Inception weights (also ${fid.WEIGHTS_ENV}); "
                        "default: torch.hub's cache, downloaded once")
    p.add_argument("--batch", type=int, default=250, help="images per Inception call")
    p.add_argument("--fid_ref_images", type=int, default=0,
                   help="B = DATASET:SPLIT: this many of its images, a fixed draw (seed 0); 0 = all")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="", help="also write the result as JSON here")
    args = p.parse_args(argv)
    for name, top in (("batch", 2**16), ("shapes_count", data.MAX_SHAPES_COUNT)):
        if not 1 <= getattr(args, name) <= top:
            raise UserError(f"--{name} {getattr(args, name)}: must lie in [1, {top}]")
    if not 0 <= args.image_size <= data.MAX_IMAGE_SIZE:
        raise UserError(f"--image_size {args.image_size}: must lie in [1, {data.MAX_IMAGE_SIZE}] (or 0: the "
                        "default)")
    if args.fid_ref_images < 0:
        raise UserError(f"--fid_ref_images {args.fid_ref_images}: must be >= 1 (or 0: all)")
    return args


def content_key(op):
    """A digest of what an .npz or folder operand holds: the .npz file's bytes (SHA-256), or its image files'
    names and bytes (data.Listing.content_digest), each read in one streaming pass."""
    if op[0] == "folder":
        return data.image_files(op[1]).content_digest()
    h = hashlib.sha256()
    with files.open_regular(op[1]) as f:
        for block in iter(lambda: f.read(2**22), b""):
            h.update(block)
    return h.hexdigest()


def side_stats(op, args, extractor, image_size, device):
    """The reference side B: a dataset split's cached statistics, or those of an .npz's or folder's images,
    cached by their content (fid.cached_stats: used only where they prove to be these). -> (statistics,
    their record)."""
    if op[0] == "dataset":
        path = reference_path(extractor, op[1], args.data_dir, image_size, args.shapes_count,
                              args.stats_dir, op[2] == "train", args.fid_ref_images)
        ref = reference_stats(extractor, op[1], args.data_dir, image_size, args.shapes_count, device,
                              args.stats_dir, args.batch, op[2] == "train", args.fid_ref_images)
    else:  # cached by content: the .npz's bytes, or the folder's image names and bytes
        key = content_key(op)
        path = os.path.join(args.stats_dir, f"{op[0]}-{key[:16]}-{image_size}px"
                            + fid.extractor_suffix(extractor))

        def compute():
            _, batches = operand_batches(op, args, image_size)
            f, _ = fid.features(extractor, batches, device, desc=f"Inception features of {describe(op)}")
            mu, sigma = fid.mean_cov(f)
            kept = f[:fid.REFERENCE_KEEP].numpy()
            return {"mu": mu, "sigma": sigma, "features": kept, "n": np.array(len(f))}

        settings = fid.stats_settings(extractor, kind=op[0], content=key, image_size=image_size)
        ref = fid.cached_stats(path, settings, fid.feature_width(extractor), compute, args.stats_dir)
    record = {"source": describe(op), "kind": op[0], "split": op[2] if op[0] == "dataset" else None,
              "drawn": f"seed {fid.REFERENCE_SEED}" if args.fid_ref_images else None, "images": int(ref["n"]),
              "image_size": image_size, "sha256": fid.stats_sha256(ref), "cache": path}
    return ref, record


def main(argv=None):
    """python evaluate.py --fid A B: FID of A against B (the reference), with A's Inception Score and
    precision/recall, printed and, with --out, written as JSON."""
    with reported():
        args = parse_args(argv)
        a, b = operand(args.fid[0]), operand(args.fid[1])
        for op in (a, b):  # both sides, before either one's features
            check_operand(op)
        if args.fid_ref_images and b[0] != "dataset":
            raise UserError(f"--fid_ref_images draws from a DATASET:SPLIT reference: {args.fid[1]} is not "
                            "one")
        image_size = default_image_size(a, b, args)
        device = group.resolve_device(args.device)
        extractor = fid.inception(device, args.inception_weights)
        ref, reference = side_stats(b, args, extractor, image_size, device)
        n, batches = operand_batches(a, args, image_size)
        warning = small_n_warning(n)
        if warning:
            print(warning)
        feats, logits = fid.features(extractor, batches, device, desc=f"Inception features of {describe(a)}",
                                     total=n)
        result = {**fid.json_safe(fid.fid_metrics(feats, logits, ref)), "n": len(feats),
                  "samples": describe(a),
                  "reference": f"{describe(b)}, {reference['images']} images", "reference_stats": reference,
                  "inception": fid.extractor_record(extractor),
                  "fid_note": warning.removeprefix("warning: ") or None}
        if args.out:
            with files.created(args.out, "w") as f:
                json.dump(result, f, indent=2)
        extra = other_scores(result)
        wrote = f"; wrote {args.out}" if args.out else ""
        score = f"{result['fid']:.4f}" if result["fid"] is not None else "not a number"
        print(f"FID {score}: {describe(a)} ({len(feats)} images) against {describe(b)} "
              f"({reference['images']} images) at {image_size}px{extra}{wrote}")
        return result


if __name__ == "__main__":
    main()

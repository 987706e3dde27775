"""Evaluation: FID, Inception Score and precision/recall of samples, and bits/dim of held-out images.

    ref = reference_stats(inception(device), "cifar10", "data", 32, 50_000, device, cache_dir)  # cached
    fid_metrics(*features(extractor, batches, device), ref)     # {'fid', 'inception_score', 'precision', ...}
    held_out_bits(diffusion, model, images, labels, ...)        # bpd / bpd_estimate (below), batched
    TrainingEval(mc, tc, diffusion, device)(net, ema)           # what train() logs every eval_every_steps

A library for sample.py and ddpm.py; it imports neither: it is handed the model callable, the Diffusion and
the config values it needs. Under torch.distributed every rank does 1/world of the work and sums are
all-reduced.

It is also a command that scores anything against anything (main, below):

    python evaluate.py --fid samples.npz cifar10:train          # an .npz (arr_0: uint8 N x H x W x 3)
    python evaluate.py --fid generated/ cifar10:train           # an image folder (PNG, JPEG, ...)
    python evaluate.py --fid cifar10:test cifar10:train         # the data against itself: a sanity check
    python evaluate.py --fid folder:/data/cifar/test /data/cifar/train --image_size 32 --out check.json

A is scored against B, each an .npz, an image folder (or folder:PATH) or DATASET:SPLIT (cifar10 or shapes,
train or test; --data_dir). B's statistics are cached in --stats_dir when B is a dataset split.
"""
import hashlib
import json
import math
import os
import time
import zipfile

import numpy as np
import torch

import files
from errors import UserError, first_line, reported

# FID, Inception Score and precision/recall, with torch-fidelity's InceptionV3 (the TF-FID network, ported
# bit-exactly). Reference statistics of a training set are computed once and cached as an .npz.
# Under torch.distributed every rank does 1/world of the images and the sums are all-reduced.

REFERENCE_KEEP = 10_000  # reference features kept for precision/recall (k-NN balls are O(n^2) in memory)


WEIGHTS_ENV = "DDPM_INCEPTION_WEIGHTS"  # a local Inception weights file, for machines without internet


def inception(device, weights=None):
    """uint8 images (B, 3, H, W) -> (2048-d pool features, 1008 logits), as torch-fidelity computes them.
    The weights: `weights` (a path), else $DDPM_INCEPTION_WEIGHTS, else torch.hub's cache, downloaded once
    (offline, the error says where to put them). A file that is not the network's weights is one UserError
    line. The extractor carries `weights_sha256` and `weights_path`: what a result records."""
    try:
        from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3, FeatureExtractorInceptionV3
    except ImportError:
        raise UserError("FID needs torch-fidelity: pip install torch-fidelity") from None
    what = "--inception_weights" if weights else f"${WEIGHTS_ENV}"
    weights = weights or os.environ.get(WEIGHTS_ENV) or ""
    if weights:
        path = weights
        if not files.is_regular(os.path.realpath(path)):
            raise UserError(f"{what} {path}: no such file")
        wrong = f"{what} {path} is not the Inception weights file ({URL_INCEPTION_V3})"
    else:
        path = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(URL_INCEPTION_V3))
        download_weights(URL_INCEPTION_V3, path)
        wrong = f"{path} is not the Inception weights file: delete it, and place {URL_INCEPTION_V3} there"
    try:
        with files.open_regular(path) as f:
            sha = hashlib.sha256(f.read()).hexdigest()
            f.seek(0)
            state = torch.load(f, map_location="cpu", weights_only=True)  # tensors only, before the library
        if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
            raise TypeError("not a state dict")
        extractor = FeatureExtractorInceptionV3("inception-v3-compat", ["2048", "logits_unbiased"],
                                                feature_extractor_weights_path=path)
    except Exception as e:  # unreadable, not a torch file, or a network of other names or shapes
        raise UserError(f"{wrong} ({type(e).__name__}: {first_line(e)[:200]})") from None
    extractor.weights_sha256, extractor.weights_path = sha, os.path.abspath(path)
    return extractor.to(device)


def download_weights(url, path):
    """torch-fidelity's Inception weights into torch.hub's cache, once; offline, one line saying where to
    place them."""
    if os.path.exists(path):
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.hub.download_url_to_file(url, path, progress=False)  # via a temporary file
    except Exception as e:
        raise UserError(f"cannot download the Inception weights ({type(e).__name__}); offline, "
                        f"place {url} at {path}, or give its path with --inception_weights or "
                        f"${WEIGHTS_ENV}") from None


def extractor_record(extractor):
    """What a FID result says of the network that measured it: its name, its weights' SHA-256 (torch.hub
    names files by the first 8 hex digits of theirs: the official one's begins 6726825d) and torch-fidelity's
    version."""
    try:
        from importlib.metadata import version

        fidelity = version("torch-fidelity")
    except Exception:
        fidelity = None
    return {"network": getattr(extractor, "name", type(extractor).__name__),
            "weights_sha256": getattr(extractor, "weights_sha256", None),
            "weights_path": getattr(extractor, "weights_path", None), "torch_fidelity": fidelity}


def json_safe(result):
    """A result with each non-finite number (the Inception Score of weights without the classifier, say) as
    None: strict JSON has no NaN."""
    return {k: None if isinstance(v, float) and not np.isfinite(v) else v for k, v in result.items()}


def stats_sha256(ref):
    """SHA-256 of reference statistics (the mean's and covariance's float64 bytes): two results with the
    same hash were measured against the same reference."""
    h = hashlib.sha256()
    for k in ("mu", "sigma"):
        h.update(np.ascontiguousarray(ref[k], dtype=np.float64).tobytes())
    return h.hexdigest()


def distributed():
    import torch.distributed as dist

    return ((dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized()
            else (0, 1))


def all_reduce_sum(*tensors):
    """Sum CPU float64 tensors over ranks (gloo and NCCL both take them on the process group's device)."""
    import torch.distributed as dist

    if distributed()[1] == 1:
        return tensors
    device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
              else torch.device("cpu"))
    out = []
    for t in tensors:
        t = t.to(device)
        dist.all_reduce(t)
        out.append(t.cpu())
    return out


@torch.no_grad()
def features(extractor, batches, device, desc=None, total=None):
    """-> (features (N, D), logits (N, K)), float32 on the CPU, of uint8 image batches. desc: a progress bar
    of `total` images with the time left, on a terminal only (tqdm's disable=None)."""
    from tqdm import tqdm

    feats, logits = [], []
    bar = tqdm(total=total, desc=desc, unit="img", disable=None if desc else True, leave=False)
    for x in batches:
        bar.update(len(x))
        f, lg = extractor(x.to(device))
        feats.append(f.float().cpu())
        logits.append(lg.float().cpu())
    bar.close()
    return torch.cat(feats), torch.cat(logits)


def mean_cov(feats, chunk=4096):
    """Mean and covariance (float64) of (N, D) features, summed over ranks under torch.distributed."""
    s = torch.zeros(feats.shape[1], dtype=torch.float64)
    outer = torch.zeros(feats.shape[1], feats.shape[1], dtype=torch.float64)
    for i in range(0, len(feats), chunk):
        f = feats[i : i + chunk].double()
        s += f.sum(0)
        outer += f.T @ f
    n, s, outer = all_reduce_sum(torch.tensor(float(len(feats)), dtype=torch.float64), s, outer)
    mu = s / n
    return mu.numpy(), ((outer - n * torch.outer(mu, mu)) / (n - 1)).numpy()


def frechet_distance(mu1, sigma1, mu2, sigma2):
    """||mu1 - mu2||^2 + Tr(S1 + S2 - 2 (S1 S2)^(1/2)) (Heusel et al. 2017), as torch-fidelity computes it."""
    from torch_fidelity.metric_fid import fid_statistics_to_metric

    return fid_statistics_to_metric({"mu": np.asarray(mu1), "sigma": np.asarray(sigma1)},
                                    {"mu": np.asarray(mu2), "sigma": np.asarray(sigma2)}, verbose=False)[
        "frechet_inception_distance"]


def reference_path(extractor, dataset, data_dir, image_size, shapes_count, cache_dir, train=True):
    """Where a split's statistics are cached: the name changes with the data (as a beton's does) and with
    the network (its name, and its weights' hash where it has one)."""
    import data

    name = data.beton_name(dataset, data_dir, image_size, shapes_count, train=train)
    net = getattr(extractor, "name", type(extractor).__name__)
    sha = getattr(extractor, "weights_sha256", None)
    suffix = f"-{net}" + (f"-{sha[:12]}" if sha else "") + ".npz"
    return os.path.join(cache_dir, name.replace(".beton", suffix))


def reference_stats(extractor, dataset, data_dir, image_size, shapes_count, device, cache_dir, batch=250,
                    train=True):
    """A split's (the training set's by default) feature mean and covariance, plus up to REFERENCE_KEEP of
    its features (precision/recall). Computed once, then read from cache_dir (reference_path)."""
    import data

    path = reference_path(extractor, dataset, data_dir, image_size, shapes_count, cache_dir, train)
    rank, world = distributed()
    (cached,) = all_reduce_sum(torch.tensor(float(os.path.exists(path)), dtype=torch.float64))
    # decided together: a rank that skipped the computation would leave the others waiting
    if cached == world:
        try:  # a file on disk may be truncated or someone else's: checked before it is trusted
            with files.open_regular(path) as f, np.load(f) as z:
                ref = {k: z[k] for k in z.files}
            ok = {"mu", "sigma", "features", "n"} <= set(ref) and ref["sigma"].shape == (len(ref["mu"]),) * 2
        except Exception:
            ok = False
        if not ok:
            raise UserError(f"{path} is not readable FID reference statistics: delete it and they are "
                            "computed again")
        return ref
    try:
        images, _, _ = data.load_dataset(dataset, data_dir, image_size, shapes_count, train=train)
    except UserError as e:
        raise UserError(f"FID reference statistics: {e}") from None
    split = "train" if train else "test"
    print(f"computing FID reference statistics of {dataset} {split} ({len(images)} images) into {path}",
          flush=True)
    mine = images[rank::world]
    f, _ = features(extractor, (mine[i : i + batch] for i in range(0, len(mine), batch)), device,
                    desc="FID reference statistics", total=len(mine))
    mu, sigma = mean_cov(f)
    kept = f[: REFERENCE_KEEP // world].float().numpy()  # this rank's share; rank 0's is what the cache keeps
    ref = {"mu": mu, "sigma": sigma, "features": kept, "n": np.array(len(images))}
    if rank == 0:
        os.makedirs(cache_dir, exist_ok=True)
        with files.created(path, kept="nothing is cached; the statistics are computed again next time") as f:
            np.savez(f, **ref)
    return ref


def fid_metrics(gen_feats, gen_logits, ref, prc=True):
    """FID against `ref`; Inception Score (10 splits) and precision/recall (k = 3) where asked and
    available."""
    mu, sigma = mean_cov(gen_feats)
    out = {"fid": frechet_distance(mu, sigma, ref["mu"], ref["sigma"])}
    if gen_logits is not None:
        from torch_fidelity.metric_isc import isc_features_to_metric

        isc = isc_features_to_metric(gen_logits, splits=10)
        out.update(inception_score=isc["inception_score_mean"],
                   inception_score_std=isc["inception_score_std"])
    if prc and len(ref.get("features", ())) > 3:
        from torch_fidelity.metric_prc import prc_features_to_metric

        real = torch.from_numpy(ref["features"]).float()
        m = prc_features_to_metric(gen_feats[: len(real)].float(), real, prc_neighborhood=3,
                                   prc_batch_size=10_000, save_cpu_ram=False, verbose=False)
        out.update(precision=m["precision"], recall=m["recall"], prc_n=min(len(gen_feats), len(real)))
    return out


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
    x0_hat, _ = diffusion.predict_x0_eps(model(z.float(), tt, y).double(), z, tt, threshold)
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
    stratified estimate. -> (bits per image (N,) on the CPU, the estimator's summed variance). progress: a bar
    with the time left, on a terminal only."""
    from tqdm import tqdm

    bits, est_var = [], 0.0
    bar = tqdm(total=len(images), desc="bits/dim", unit="img", disable=None if progress else True,
               leave=False)
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
    bar.close()
    return torch.cat(bits) if bits else torch.zeros(0, dtype=torch.float64), est_var


def to_uint8(x):
    return ((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).cpu()


def generate(diffusion, net, n, mc, *, batch, generator, labels=None, **sampler_args):
    """Yields n samples as uint8 CPU batches; `labels` (n,) for a class-conditional model."""
    device = diffusion.alpha_bar.device
    for start in range(0, n, batch):
        b = min(batch, n - start)
        y = labels[start : start + b].to(device) if labels is not None else None
        yield to_uint8(diffusion.sample(net, (b, mc.channels, mc.image_size, mc.image_size), y=y,
                                        generator=generator, **sampler_args))


class TrainingEval:
    """What train() runs every eval_every_steps: FID of eval_fid_samples EMA samples (DPM-Solver++ with
    eval_sample_steps) against the training set's cached statistics, and bits/dim of the first eval_bpd_images
    held-out images (the stratified estimate of the bound, eval_bpd_strata strata). Every rank takes 1/world
    of both and the sums are all-reduced, so no rank waits on another. The noise is fixed: the numbers
    are comparable across steps. Built before training starts, so missing weights or data fail at once."""

    def __init__(self, mc, tc, diffusion, device, extractor=None, batch=250):
        import data

        self.mc, self.tc, self.diffusion, self.device, self.batch = mc, tc, diffusion, device, batch
        self.rank, self.world = distributed()
        self.extractor = self.ref = self.held_out = None
        if tc.eval_fid_samples:
            self.extractor = extractor or inception(device)
            self.ref = reference_stats(self.extractor, tc.dataset, tc.data_dir, mc.image_size,
                                       tc.shapes_count, device, cache_dir=tc.fid_stats_dir)
        if tc.eval_bpd_images:
            try:
                images, labels, _ = data.load_dataset(tc.dataset, tc.data_dir, mc.image_size, tc.shapes_count,
                                                      train=False)
            except UserError as e:
                raise UserError(f"held-out images for bits/dim: {e}") from None
            n = min(tc.eval_bpd_images, len(images))
            self.held_out = images[:n][self.rank :: self.world], labels[:n][self.rank :: self.world]

    @torch.no_grad()
    def __call__(self, net, ema):
        """-> {'fid': ..., 'bpd': ..., ...}: samples from `net` (the EMA model as training runs it, under
        autocast), the bound from `ema` itself, in fp32."""
        t0, out, tc, mc = time.time(), {}, self.tc, self.mc
        if self.extractor is not None:
            mine = torch.arange(self.rank, tc.eval_fid_samples, self.world)
            labels = mine % mc.num_classes if mc.num_classes > 0 else None
            g = torch.Generator().manual_seed(tc.seed + 1 + self.rank)
            batches = generate(self.diffusion, net, len(mine), mc, batch=self.batch, generator=g,
                               labels=labels, sampler="dpm++", steps=tc.eval_sample_steps,
                               guidance=tc.guidance, threshold=tc.threshold)
            feats, _ = features(self.extractor, batches, self.device)
            out["fid"] = fid_metrics(feats, None, self.ref, prc=False)["fid"]
            out["fid_samples"] = tc.eval_fid_samples
        if self.held_out is not None:
            g = torch.Generator().manual_seed(tc.seed + 1 + self.rank)
            bits, _ = held_out_bits(self.diffusion, ema, *self.held_out, mc.num_classes, self.device,
                                    self.batch, tc.eval_bpd_strata, generator=g)
            (total,) = all_reduce_sum(torch.tensor([bits.sum().item(), len(bits)], dtype=torch.float64))
            out["bpd"], out["bpd_images"] = (total[0] / total[1]).item(), int(total[1])
        out["eval_s"] = time.time() - t0
        return out


# -----------------------------------------------------------------------------
# Images from anywhere: .npz files (streamed), image folders and dataset splits, and the command that scores
# one against another.

SMALL_N = 50_000  # FID is biased upward below this many samples (and published figures use it)
DATASET_SPLITS = ("cifar10", "shapes")  # DATASET:SPLIT operands; a folder is folder:PATH or just PATH


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
                    self.shape, self.offset = self.header(a)
        except (OSError, zipfile.BadZipFile, ValueError, EOFError) as e:
            raise UserError(f"{path} is not a readable .npz ({type(e).__name__}: {first_line(e)})") from None

    def header(self, a):
        version = np.lib.format.read_magic(a)
        fmt = np.lib.format
        read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, fortran, dtype = read(a)
        if dtype != np.uint8 or fortran or len(shape) != 4 or shape[3] != 3 or shape[1] < 1 or shape[2] < 1:
            raise UserError(f"{self.path}: {self.key[:-4]} is {dtype} {shape}{' Fortran-ordered' * fortran}; "
                            "images are uint8 (N, H, W, 3) in C order")
        return tuple(shape), a.tell()

    def __len__(self):
        return self.shape[0]

    def batches(self, batch):
        """-> uint8 (B, 3, H, W) tensors in order."""
        per = int(np.prod(self.shape[1:]))
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
    if name in DATASET_SPLITS and split in ("train", "test") and not os.path.exists(spec):
        return ("dataset", name, split)
    if spec.lower().endswith(".npz") and not os.path.isdir(spec):
        return ("npz", spec)
    if os.path.isdir(spec):
        return ("folder", spec)
    raise UserError(f"--fid {spec}: neither an .npz file, an image folder (or folder:PATH), nor "
                    f"DATASET:SPLIT with DATASET one of {', '.join(DATASET_SPLITS)} and SPLIT train or test")


def describe(op):
    return f"{op[1]}:{op[2]}" if op[0] == "dataset" else op[1]


def operand_batches(op, args, image_size):
    """-> (the number of images, an iterator of uint8 (B, 3, S, S) batches) of one operand at image_size."""
    import data

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
    """The resolution both sides are scored at: --image_size, else an .npz's own, else CIFAR-10's 32."""
    if args.image_size:
        return args.image_size
    for op in (a, b):
        if op[0] == "npz":
            return NpzImages(op[1]).shape[1]
    if "cifar10" in (a[1], b[1]):
        return 32
    raise UserError("give --image_size: neither side is an .npz or CIFAR-10, whose resolution it would be")


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
    p.add_argument("--stats_dir", default="data/fid_stats",
                   help="where a dataset split's reference statistics are cached")
    p.add_argument("--inception_weights", default="",
                   help=f"a local copy of torch-fidelity's Inception weights (also ${WEIGHTS_ENV}); default: "
                        "torch.hub's cache, downloaded once")
    p.add_argument("--batch", type=int, default=250, help="images per Inception call")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="", help="also write the result as JSON here")
    args = p.parse_args(argv)
    for name in ("batch", "shapes_count"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} {getattr(args, name)}: must be >= 1")
    if args.image_size < 0:
        raise UserError(f"--image_size {args.image_size}: must be >= 1 (or 0: the default)")
    return args


def resolve_device(name):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError, ValueError) as e:
        raise UserError(f"--device {name}: not available here ({first_line(e)})") from None
    return device


def side_stats(op, args, extractor, image_size, device):
    """The reference side B: a dataset split's cached statistics, or those of an .npz's or folder's images.
    -> (statistics, their record)."""
    if op[0] == "dataset":
        path = reference_path(extractor, op[1], args.data_dir, image_size, args.shapes_count, args.stats_dir,
                              op[2] == "train")
        ref = reference_stats(extractor, op[1], args.data_dir, image_size, args.shapes_count, device,
                              args.stats_dir, args.batch, train=op[2] == "train")
    else:
        path = None
        _, batches = operand_batches(op, args, image_size)
        f, _ = features(extractor, batches, device, desc=f"Inception features of {describe(op)}")
        mu, sigma = mean_cov(f)
        ref = {"mu": mu, "sigma": sigma, "features": f[:REFERENCE_KEEP].numpy(), "n": np.array(len(f))}
    record = {"source": describe(op), "kind": op[0], "split": op[2] if op[0] == "dataset" else None,
              "images": int(ref["n"]), "image_size": image_size, "sha256": stats_sha256(ref), "cache": path}
    return ref, record


def main(argv=None):
    """python evaluate.py --fid A B: FID of A against B (the reference), with A's Inception Score and
    precision/recall, printed and, with --out, written as JSON."""
    with reported():
        args = parse_args(argv)
        a, b = operand(args.fid[0]), operand(args.fid[1])
        image_size = default_image_size(a, b, args)
        device = resolve_device(args.device)
        extractor = inception(device, args.inception_weights)
        ref, reference = side_stats(b, args, extractor, image_size, device)
        n, batches = operand_batches(a, args, image_size)
        warning = small_n_warning(n)
        if warning:
            print(warning)
        feats, logits = features(extractor, batches, device, desc=f"Inception features of {describe(a)}",
                                 total=n)
        result = {**json_safe(fid_metrics(feats, logits, ref)), "n": len(feats), "samples": describe(a),
                  "reference": f"{describe(b)}, {reference['images']} images", "reference_stats": reference,
                  "inception": extractor_record(extractor),
                  "fid_note": warning.removeprefix("warning: ") or None}
        if args.out:
            with files.created(args.out, "w") as f:
                json.dump(result, f, indent=2)
        extra = "".join(f", {k} {result[k]:.4f}" for k in ("inception_score", "precision", "recall")
                        if result.get(k) is not None)
        wrote = f"; wrote {args.out}" if args.out else ""
        fid = f"{result['fid']:.4f}" if result["fid"] is not None else "not a number"
        print(f"FID {fid}: {describe(a)} ({len(feats)} images) against {describe(b)} "
              f"({reference['images']} images) at {image_size}px{extra}{wrote}")
        return result


if __name__ == "__main__":
    main()

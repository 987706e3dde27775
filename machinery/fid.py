"""FID, Inception Score and precision/recall with torch-fidelity's InceptionV3 (the TF-FID network, ported
bit-exactly), and the reference statistics of a dataset split, computed once and cached as an .npz.

    ref = reference_stats(inception(device), "cifar10", "data", 32, 50_000, device, cache_dir)  # cached
    fid_metrics(*features(extractor, batches, device), ref)     # {'fid', 'inception_score', 'precision', ...}

A cache is used only where it proves to be what its name says (cached_stats: read through no link, its
arrays sound, its checksum and the settings it was computed from as recorded); else it is computed again.
Under torchrun every rank does 1/world of the images and the sums are all-reduced (group.py).
"""
import hashlib
import json
import os

import numpy as np
import torch

from machinery import files, group
from machinery.errors import UserError, first_line
from machinery.progress import Progress

STATS_DIR = "data/fid_stats"  # the default cache of reference statistics (a folder of its own)
REFERENCE_KEEP = 10_000  # reference features kept for precision/recall (k-NN balls are O(n^2) in memory)
REFERENCE_SEED = 0  # the permutation that draws a reference of fewer images than its split (reference_subset)


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
            raise UserError(f"{what} {path}: {files.kind(path)}, not a weights file")
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
    # channels-last: 1.6x the images a second on the AVX2 CPU (BENCHMARKS.md), features equal to rounding
    cpu = torch.device(device).type == "cpu"
    return extractor.to(device, memory_format=torch.channels_last if cpu else torch.preserve_format)


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


@torch.no_grad()
def features(extractor, batches, device, desc=None, total=None):
    """-> (features (N, D), logits (N, K)), float32 on the CPU, of uint8 image batches. desc: progress of
    `total` images (None: unknown) named so, with the time left (Progress: a bar on a terminal,
    lines in a log); none without it."""
    feats, logits = [], []
    with Progress(desc, total) as bar:
        for x in batches:
            f, lg = extractor(x.to(device))
            feats.append(f.float().cpu())
            logits.append(lg.float().cpu())
            bar.update(len(x))
    return torch.cat(feats), torch.cat(logits)


def mean_cov(feats, chunk=4096):
    """Mean and covariance (float64) of (N, D) features, summed over ranks under torch.distributed."""
    s = torch.zeros(feats.shape[1], dtype=torch.float64)
    outer = torch.zeros(feats.shape[1], feats.shape[1], dtype=torch.float64)
    for i in range(0, len(feats), chunk):
        f = feats[i : i + chunk].double()
        s += f.sum(0)
        outer += f.T @ f
    n, s, outer = group.all_reduce_sum(torch.tensor(float(len(feats)), dtype=torch.float64), s, outer)
    if n < 2:
        raise UserError(f"FID needs at least 2 images (a covariance), not {int(n)}")
    mu = s / n
    return mu.numpy(), ((outer - n * torch.outer(mu, mu)) / (n - 1)).numpy()


def frechet_distance(mu1, sigma1, mu2, sigma2):
    """||mu1 - mu2||^2 + Tr(S1 + S2 - 2 (S1 S2)^(1/2)) (Heusel et al. 2017), as torch-fidelity computes it."""
    from torch_fidelity.metric_fid import fid_statistics_to_metric

    return fid_statistics_to_metric({"mu": np.asarray(mu1), "sigma": np.asarray(sigma1)},
                                    {"mu": np.asarray(mu2), "sigma": np.asarray(sigma2)}, verbose=False)[
        "frechet_inception_distance"]


def reference_subset(images, n, what):
    """n of a split's images (all of them for n = 0), drawn without replacement by a fixed permutation
    (seed 0, REFERENCE_SEED), kept in the split's order: the same n images on every machine."""
    if n > len(images):
        raise UserError(f"FID reference: {n} images asked of {what}, which has {len(images)}")
    if not n:
        return images
    pick = torch.randperm(len(images), generator=torch.Generator().manual_seed(REFERENCE_SEED))[:n]
    return images[pick.sort().values]


def extractor_suffix(extractor):
    """-<network>[-<its weights' hash>].npz: a cached statistics file names the network that made it."""
    net = getattr(extractor, "name", type(extractor).__name__)
    sha = getattr(extractor, "weights_sha256", None)
    return f"-{net}" + (f"-{sha[:12]}" if sha else "") + ".npz"


def feature_width(extractor):
    """The width of the network's features (InceptionV3's pool: 2048) where it says, else None."""
    listed = getattr(extractor, "features_list", None)
    return int(listed[0]) if listed and str(listed[0]).isdigit() else None


def stats_settings(extractor, **what):
    """What cached statistics were computed from: `what` (the data, its resolution, the draw) and the network
    (its name and weights' hash), as JSON holds it: the record a cache must match to be used."""
    net = {"network": getattr(extractor, "name", type(extractor).__name__),
           "weights_sha256": getattr(extractor, "weights_sha256", None), "width": feature_width(extractor)}
    return json.loads(json.dumps({**what, **net}))


def content_sha256(ref):
    """SHA-256 of everything cached statistics hold (each array's dtype, shape and bytes)."""
    h = hashlib.sha256()
    for k in ("mu", "sigma", "features", "n"):
        a = np.ascontiguousarray(ref[k])
        h.update(f"{k} {a.dtype.str} {a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def read_stats(path, settings, width=None):
    """Cached statistics -> (ref, None) if they prove to be those of `settings`, else (None, why; why None
    when nothing is there). Read from a regular file only, never through a link; the arrays checked (mean
    and covariance finite, of `width` features where given, n >= 2), then their checksum and the settings
    they were computed from, as write_stats recorded them."""
    try:
        with files.open_regular(path, follow=False) as f, np.load(f) as z:
            ref = {k: z[k] for k in ("mu", "sigma", "features", "n")}
            meta = json.loads(str(z["meta"][()]))
    except FileNotFoundError:
        return None, None
    except Exception as e:  # a link, a FIFO, truncated, no meta (an older cache), not an .npz
        return None, f"not readable as statistics this program wrote ({type(e).__name__})"
    mu, sigma, feats, n = ref["mu"], ref["sigma"], ref["features"], ref["n"]
    d = mu.shape[0] if mu.ndim == 1 else -1
    if not (d >= 1 and sigma.shape == (d, d) and feats.ndim == 2 and feats.shape[1] == d and n.shape == ()
            and n.dtype.kind in "iu" and n >= 2 and mu.dtype.kind == sigma.dtype.kind == "f"):
        return None, f"not statistics (mean {mu.shape}, covariance {sigma.shape}, n {n})"
    if width is not None and d != width:
        return None, f"statistics of {d} features, not the network's {width}"
    if not (np.isfinite(mu).all() and np.isfinite(sigma).all()):
        return None, "a mean or covariance that is not finite"
    if not isinstance(meta, dict) or meta.get("sha256") != content_sha256(ref):
        return None, "content that is not what was written (its checksum differs)"
    if meta.get("settings") != settings:
        return None, "statistics of other data, settings or network than these"
    return ref, None


def write_stats(path, ref, cache_dir, settings):
    """The cache: the statistics with the settings they were computed from and their checksum (read_stats)."""
    files.own_or_named(cache_dir, STATS_DIR)
    meta = json.dumps({"settings": settings, "sha256": content_sha256(ref)})
    with files.created(path, kept="nothing is cached; the statistics are computed again next time") as f:
        np.savez(f, **ref, meta=np.array(meta))


def cached_stats(path, settings, width, compute, cache_dir):
    """The statistics cached at `path` if they prove to be those of `settings` (read_stats), else compute()'s,
    cached there (whatever was at `path` replaced, never written through). Under torchrun every rank reads
    them, and all compute if any rank could not (decided together: a rank that skipped the computation
    would leave the others waiting); rank 0 writes."""
    rank, world = group.rank_world()
    ref, why = read_stats(path, settings, width)
    (good,) = group.all_reduce_sum(torch.tensor(float(ref is not None), dtype=torch.float64))
    if good == world:
        return ref
    if why and rank == 0:
        print(f"note: the cache {path} holds {why}: the statistics are computed again", flush=True)
    ref = compute()
    if rank == 0:
        write_stats(path, ref, cache_dir, settings)
    return ref


def fid_metrics(gen_feats, gen_logits, ref, prc=True):
    """FID against `ref`; Inception Score (10 splits) and precision/recall (k = 3) where asked and
    available."""
    if gen_feats.shape[1] != len(ref["mu"]):
        raise UserError(f"the samples have {gen_feats.shape[1]} features and the reference statistics "
                        f"{len(ref['mu'])}: they were not made by the same network")
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

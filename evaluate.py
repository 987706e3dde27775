"""Evaluation: FID, Inception Score and precision/recall of samples, and bits/dim of held-out images.

    ref = reference_stats(inception(device), "cifar10", "data", 32, 50_000, device, cache_dir)  # cached
    fid_metrics(*features(extractor, batches, device), ref)     # {'fid', 'inception_score', 'precision', ...}
    held_out_bits(diffusion, model, images, labels, ...)        # Diffusion.bpd / bpd_estimate, batched
    TrainingEval(mc, tc, diffusion, device)(net, ema)           # what train() logs every eval_every_steps

A library for sample.py and ddpm.py; it imports neither: it is handed the model callable, the Diffusion and
the config values it needs. Under torch.distributed every rank does 1/world of the work and sums are
all-reduced.
"""
import os
import time

import numpy as np
import torch

import files
from errors import UserError

# FID, Inception Score and precision/recall, with torch-fidelity's InceptionV3 (the TF-FID network, ported
# bit-exactly). Reference statistics of a training set are computed once and cached as an .npz.
# Under torch.distributed every rank does 1/world of the images and the sums are all-reduced.

REFERENCE_KEEP = 10_000  # reference features kept for precision/recall (k-NN balls are O(n^2) in memory)


def inception(device):
    """uint8 images (B, 3, H, W) -> (2048-d pool features, 1008 logits), as torch-fidelity computes them.
    The weights are downloaded once into torch.hub's cache; offline, the error says where to put them."""
    try:
        from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3, FeatureExtractorInceptionV3
    except ImportError:
        raise UserError("FID needs torch-fidelity: pip install torch-fidelity") from None
    path = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(URL_INCEPTION_V3))
    if not os.path.exists(path):
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.hub.download_url_to_file(URL_INCEPTION_V3, path, progress=False)  # via a temporary file
        except Exception as e:
            raise UserError(f"cannot download the Inception weights ({type(e).__name__}); offline, "
                            f"place {URL_INCEPTION_V3} at {path}") from None
    try:
        # a tensors-only file, before the library loads it
        torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        raise UserError(f"{path} is not the Inception weights file: delete it, and place "
                        f"{URL_INCEPTION_V3} there") from None
    return FeatureExtractorInceptionV3("inception-v3-compat", ["2048", "logits_unbiased"],
                                       feature_extractor_weights_path=path).to(device)


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
def features(extractor, batches, device):
    """-> (features (N, D), logits (N, K)), float32 on the CPU, of uint8 image batches."""
    feats, logits = [], []
    for x in batches:
        f, lg = extractor(x.to(device))
        feats.append(f.float().cpu())
        logits.append(lg.float().cpu())
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


def reference_stats(extractor, dataset, data_dir, image_size, shapes_count, device, cache_dir, batch=250):
    """The training set's feature mean and covariance, plus up to REFERENCE_KEEP of its features
    (precision/recall). Computed once, then read from cache_dir; the file name changes with the data, as a
    beton's does."""
    import data

    name = data.beton_name(dataset, data_dir, image_size, shapes_count, train=True)
    path = os.path.join(
        cache_dir, name.replace(".beton", f"-{getattr(extractor, 'name', type(extractor).__name__)}.npz"))
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
        images, _, _ = data.load_dataset(dataset, data_dir, image_size, shapes_count, train=True)
    except UserError as e:
        raise UserError(f"FID reference statistics: {e}") from None
    print(f"computing FID reference statistics of {dataset} ({len(images)} images) into {path}", flush=True)
    mine = images[rank::world]
    f, _ = features(extractor, (mine[i : i + batch] for i in range(0, len(mine), batch)), device)
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


def held_out_bits(diffusion, model, images, labels, num_classes, device, batch, strata=0, threshold="static",
                  generator=None, progress=False):
    """Bits/dim of uint8 images, batch by batch, in fp32/fp64: the exact bound (strata = 0) or its
    stratified estimate. -> (bits per image (N,) on the CPU, the estimator's summed variance)."""
    bits, est_var = [], 0.0
    for start in range(0, len(images), batch):
        x0 = images[start : start + batch].to(device).double() / 127.5 - 1
        y = labels[start : start + batch].to(device) if num_classes > 0 else None
        if strata:
            b, se = diffusion.bpd_estimate(model, x0, y, strata=strata, threshold=threshold,
                                           generator=generator)
            est_var += (se**2).sum().item()
        else:
            b = diffusion.bpd(model, x0, y, threshold=threshold, generator=generator)
        bits.append(b.cpu())
        if progress:
            print(f"{start + len(x0)}/{len(images)} images", flush=True)
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

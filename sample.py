"""Generate images from a trained run: a PNG grid and an .npz of uint8 samples, from the EMA weights.

    python sample.py --ckpt runs/demo-.../ema.pt --n 64 --sampler dpm++ --steps 20 --guidance 2 --out grid.png
    python sample.py --ckpt runs/x/ckpt.pt --n 10000 --batch 500 --out samples.png   # writes samples.npz too
    python sample.py --ckpt runs/x/ema.pt --eval fid --n 50000 --out fid/samples.png  # + FID, IS, precision/recall
    python sample.py --ckpt runs/x/ema.pt --eval bpd --n 10000 --out bpd/test.png     # bits/dim of the test split
    python sample.py --ckpt ddpm-cifar10-32 --eval fid --n 50000 --out fid/ho.png     # diffusers' copy of Ho's weights
    python sample.py --ckpt runs/x/ema.pt --export_diffusers hub/x                     # a folder diffusers loads

--ckpt takes either checkpoint a run writes (ckpt.pt, the resumable state, or ema.pt, the export);
both hold the EMA weights and the model config, and load with weights_only=True. It also takes a
diffusers model folder (config.json + safetensors or .bin, and scheduler_config.json for the schedule),
or a pipeline folder holding them in unet/ and scheduler/ (diffusers_io.py). Class-conditional
models cycle through the classes unless --label fixes one. The network runs under bf16 autocast
where the hardware has it (GPUs, CPUs with AVX512-BF16/AMX), as --precision=auto does in training.

--eval fid scores the samples with torch-fidelity's InceptionV3 against the run's training set, whose
statistics are computed once and cached (--stats_dir). The results go to a .json beside --out.

Measured: see README.md (the demo grid) -- sampling cost is the network's forward FLOPs x steps.
"""
import argparse
import dataclasses
import json
import math
import os
import sys
import time

import numpy as np
import torch

import ddpm
import diffusers_io


# -----------------------------------------------------------------------------
# FID, Inception Score and precision/recall, with torch-fidelity's InceptionV3 (the TF-FID network, ported
# bit-exactly). Reference statistics of a training set are computed once and cached as an .npz.
# Under torch.distributed every rank does 1/world of the images and the sums are all-reduced.

REFERENCE_KEEP = 10_000  # reference features kept for precision/recall (k-NN balls are O(n^2) in memory)


class EvalError(Exception):
    """A missing library, missing weights or unusable data: one clear line for the user."""


def inception(device):
    """uint8 images (B, 3, H, W) -> (2048-d pool features, 1008 logits), as torch-fidelity computes them.
    The weights are downloaded once into torch.hub's cache; offline, the error says where to put them."""
    try:
        from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3, FeatureExtractorInceptionV3
    except ImportError:
        raise EvalError("FID needs torch-fidelity: pip install torch-fidelity") from None
    path = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(URL_INCEPTION_V3))
    if not os.path.exists(path):
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.hub.download_url_to_file(URL_INCEPTION_V3, path, progress=False)  # via a temporary file
        except Exception as e:
            raise EvalError(f"cannot download the Inception weights ({type(e).__name__}); offline, "
                            f"place {URL_INCEPTION_V3} at {path}") from None
    try:
        torch.load(path, map_location="cpu", weights_only=True)  # a tensors-only file, before the library loads it
    except Exception:
        raise EvalError(f"{path} is not the Inception weights file: delete it, and place "
                        f"{URL_INCEPTION_V3} there") from None
    return FeatureExtractorInceptionV3("inception-v3-compat", ["2048", "logits_unbiased"],
                                       feature_extractor_weights_path=path).to(device)


def distributed():
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


def all_reduce_sum(*tensors):
    """Sum CPU float64 tensors over ranks (gloo and NCCL both take them on the process group's device)."""
    import torch.distributed as dist

    if distributed()[1] == 1:
        return tensors
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
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


def reference_stats(extractor, dataset, data_dir, image_size, shapes_count, device,
                    cache_dir=ddpm.TrainerConfig.fid_stats_dir, batch=250):
    """The training set's feature mean and covariance, plus up to REFERENCE_KEEP of its features (precision/recall).
    Computed once, then read from cache_dir; the file name changes with the data, as a beton's does."""
    import data

    name = data.beton_name(dataset, data_dir, image_size, shapes_count, train=True)
    path = os.path.join(cache_dir, name.replace(".beton", f"-{getattr(extractor, 'name', type(extractor).__name__)}.npz"))
    rank, world = distributed()
    (cached,) = all_reduce_sum(torch.tensor(float(os.path.exists(path)), dtype=torch.float64))
    if cached == world:  # decided together: a rank that skipped the computation would leave the others waiting
        try:  # a file on disk may be truncated or someone else's: checked before it is trusted
            with np.load(path) as z:
                ref = {k: z[k] for k in z.files}
            ok = {"mu", "sigma", "features", "n"} <= set(ref) and ref["sigma"].shape == (len(ref["mu"]),) * 2
        except Exception:
            ok = False
        if not ok:
            raise EvalError(f"{path} is not readable FID reference statistics: delete it and they are computed again")
        return ref
    try:
        images, _, _ = data.load_dataset(dataset, data_dir, image_size, shapes_count, train=True)
    except data.DataError as e:
        raise EvalError(f"FID reference statistics: {e}") from None
    print(f"computing FID reference statistics of {dataset} ({len(images)} images) into {path}", flush=True)
    mine = images[rank::world]
    f, _ = features(extractor, (mine[i : i + batch] for i in range(0, len(mine), batch)), device)
    mu, sigma = mean_cov(f)
    kept = f[: REFERENCE_KEEP // world].float().numpy()  # this rank's share; rank 0's is what the cache keeps
    ref = {"mu": mu, "sigma": sigma, "features": kept, "n": np.array(len(images))}
    if rank == 0:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = path + ".tmp.npz"
        np.savez(tmp, **ref)
        os.replace(tmp, path)
    return ref


def fid_metrics(gen_feats, gen_logits, ref, prc=True):
    """FID against `ref`; Inception Score (10 splits) and precision/recall (k = 3) where asked and available."""
    mu, sigma = mean_cov(gen_feats)
    out = {"fid": frechet_distance(mu, sigma, ref["mu"], ref["sigma"])}
    if gen_logits is not None:
        from torch_fidelity.metric_isc import isc_features_to_metric

        isc = isc_features_to_metric(gen_logits, splits=10)
        out.update(inception_score=isc["inception_score_mean"], inception_score_std=isc["inception_score_std"])
    if prc and len(ref.get("features", ())) > 3:
        from torch_fidelity.metric_prc import prc_features_to_metric

        real = torch.from_numpy(ref["features"]).float()
        m = prc_features_to_metric(gen_feats[: len(real)].float(), real, prc_neighborhood=3, prc_batch_size=10_000,
                                   save_cpu_ram=False, verbose=False)
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
            b, se = diffusion.bpd_estimate(model, x0, y, strata=strata, threshold=threshold, generator=generator)
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
        yield to_uint8(diffusion.sample(net, (b, mc.channels, mc.image_size, mc.image_size), y=y, generator=generator,
                                        **sampler_args))


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
            self.ref = reference_stats(self.extractor, tc.dataset, tc.data_dir, mc.image_size, tc.shapes_count, device,
                                       cache_dir=tc.fid_stats_dir)
        if tc.eval_bpd_images:
            try:
                images, labels, _ = data.load_dataset(tc.dataset, tc.data_dir, mc.image_size, tc.shapes_count, train=False)
            except data.DataError as e:
                raise EvalError(f"held-out images for bits/dim: {e}") from None
            n = min(tc.eval_bpd_images, len(images))
            self.held_out = images[:n][self.rank :: self.world], labels[:n][self.rank :: self.world]

    @torch.no_grad()
    def __call__(self, ema, precision):
        """-> {'fid': ..., 'bpd': ..., ...} of the EMA model; sampling runs under `precision`, the bound in fp32."""
        t0, out, tc, mc = time.time(), {}, self.tc, self.mc

        def net(z, t, y):
            with ddpm.autocast(self.device, precision):
                return ema(z, t, y)

        if self.extractor is not None:
            mine = torch.arange(self.rank, tc.eval_fid_samples, self.world)
            labels = mine % mc.num_classes if mc.num_classes > 0 else None
            g = torch.Generator().manual_seed(tc.seed + 1 + self.rank)
            batches = generate(self.diffusion, net, len(mine), mc, batch=self.batch, generator=g, labels=labels,
                               sampler="dpm++", steps=tc.eval_sample_steps, guidance=tc.guidance)
            feats, _ = features(self.extractor, batches, self.device)
            out["fid"] = fid_metrics(feats, None, self.ref, prc=False)["fid"]
            out["fid_samples"] = tc.eval_fid_samples
        if self.held_out is not None:
            g = torch.Generator().manual_seed(tc.seed + 1 + self.rank)
            bits, _ = held_out_bits(self.diffusion, ema, *self.held_out, mc.num_classes, self.device, self.batch,
                                    tc.eval_bpd_strata, generator=g)
            (total,) = all_reduce_sum(torch.tensor([bits.sum().item(), len(bits)], dtype=torch.float64))
            out["bpd"], out["bpd_images"] = (total[0] / total[1]).item(), int(total[1])
        out["eval_s"] = time.time() - t0
        return out


def main(argv=None):
    p = argparse.ArgumentParser(description="Sample images from a trained ddpm run.")
    p.add_argument("--ckpt", required=True, help="a run's ckpt.pt or ema.pt, or a diffusers model or pipeline folder")
    p.add_argument("--ckpt_high", default="", help="with model splitting: the t >= S expert (--ckpt is then the t < S one)")
    p.add_argument("--n", type=int, default=64, help="number of images")
    p.add_argument("--sampler", choices=["ddpm", "ddim", "dpm++"], default="dpm++")
    p.add_argument("--steps", type=int, default=20, help="sampler steps; 0 = all T")
    p.add_argument("--eta", type=float, default=0.0, help="DDIM noise; 0 = deterministic")
    p.add_argument("--guidance", type=float, default=1.0, help="classifier-free guidance weight w; 1 = none")
    p.add_argument("--threshold", choices=["static", "dynamic", "none"], default="static",
                   help="x0 clipping: static [-1, 1], dynamic (Saharia et al. 2022), or none")
    p.add_argument("--percentile", type=float, default=0.995, help="dynamic thresholding percentile")
    p.add_argument("--label", type=int, default=-1, help="class to sample; -1 = cycle through all classes")
    p.add_argument("--batch", type=int, default=256, help="images per network call (memory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="samples.png", help="grid PNG; the .npz (and, with --eval, a .json of the results) is written beside it")
    p.add_argument("--eval", choices=["samples", "fid", "bpd"], default="samples",
                   help="samples: draw --n images; fid: also FID/IS/precision/recall of them against the training set; "
                        "bpd: bits/dim of --n held-out images (Diffusion.bpd)")
    p.add_argument("--strata", type=int, default=0, help="bpd: estimate from 2*strata+1 network calls; 0 = all T (exact)")
    p.add_argument("--dataset", help="fid: the reference (train split), bpd: held-out data (test split); default: the run's own dataset")
    p.add_argument("--data_dir", help="fid, bpd: default: the run's own data_dir")
    p.add_argument("--stats_dir", default=ddpm.TrainerConfig.fid_stats_dir, help="fid: where the reference statistics are cached")
    p.add_argument("--export_diffusers", metavar="DIR", default="",
                   help="write the EMA model as a diffusers folder (UNet2DModel + DDPMScheduler config) and exit")
    args = p.parse_args(argv)
    try:
        device = ddpm.resolve_device(args.device)
        model, mc, run = ddpm.load_ema(args.ckpt, device)
        if args.ckpt_high:  # model splitting: two experts, each used for its own timesteps
            high, mc_high, _ = ddpm.load_ema(args.ckpt_high, device)
            same = {k: v for k, v in dataclasses.asdict(mc).items() if k != "split_part"}
            if same != {k: v for k, v in dataclasses.asdict(mc_high).items() if k != "split_part"}:
                raise ddpm.ConfigError("--ckpt and --ckpt_high differ in more than split_part")
            if (mc.split_part, mc_high.split_part) != ("low", "high") or not ddpm.split_timestep(mc):
                raise ddpm.ConfigError("--ckpt must be a split model's 'low' expert and --ckpt_high its 'high' one")
            model = ddpm.SplitModel(model, high, ddpm.split_timestep(mc))
        elif ddpm.split_timestep(mc):
            raise ddpm.ConfigError(f"{args.ckpt} is one expert of a split model: give the other with --ckpt_high")
        if not (0 <= args.steps <= mc.timesteps) or args.n < 1 or args.batch < 1:
            raise ddpm.ConfigError(f"need n >= 1, batch >= 1 and 0 <= steps <= {mc.timesteps}")
        for name, ok in (("guidance", 0 <= args.guidance < math.inf), ("eta", 0 <= args.eta <= 1),
                         ("percentile", 0 < args.percentile <= 1), ("seed", 0 <= args.seed < 2**63),
                         ("strata", 0 <= args.strata < mc.timesteps)):
            if not ok:  # NaN fails every comparison
                raise ddpm.ConfigError(f"--{name} {getattr(args, name)} is out of range")
        if not args.export_diffusers:  # the outputs are checked before any sampling
            check_output(args.out)
        if args.label >= mc.num_classes or (args.label >= 0 and mc.num_classes == 0):
            raise ddpm.ConfigError(f"--label {args.label}: the model has {mc.num_classes} classes")
        if args.export_diffusers:
            if args.ckpt_high:
                raise ddpm.ConfigError("--export_diffusers: diffusers has no two-expert (split) model")
            try:
                diffusers_io.write(args.export_diffusers, model, mc)
            except ValueError as e:
                raise ddpm.ConfigError(f"--export_diffusers: {e}") from None
            print(f"wrote {args.export_diffusers}: UNet2DModel.from_pretrained and DDPMScheduler.from_pretrained load it")
            return args.export_diffusers
    except ddpm.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

    diffusion = ddpm.Diffusion(mc).to(device)
    if args.eval == "bpd":
        return evaluate_bpd(args, model, mc, run, diffusion, device)
    if args.eval == "fid":  # the Inception weights and the reference statistics first: fail before sampling
        try:
            dataset, data_dir = run_data(args, run)
            extractor = inception(device)
            ref = reference_stats(extractor, dataset, data_dir, mc.image_size, run.get("shapes_count", 50_000), device,
                                  cache_dir=args.stats_dir)
        except EvalError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
    precision = ddpm.resolve_precision("auto", device)  # bf16 where the hardware has it, as in training

    def net(z, t, y):
        with ddpm.autocast(device, precision):
            return model(z, t, y)

    if mc.num_classes > 0:
        labels = torch.full((args.n,), args.label) if args.label >= 0 else torch.arange(args.n) % mc.num_classes
    else:
        labels = None
    g = torch.Generator().manual_seed(args.seed)  # one CPU stream for all batches: reproducible on any device
    images = []
    for x in generate(diffusion, net, args.n, mc, batch=args.batch, generator=g, labels=labels, sampler=args.sampler,
                      steps=args.steps or None, guidance=args.guidance, eta=args.eta, threshold=args.threshold,
                      percentile=args.percentile):
        images.append(x)
        print(f"{sum(map(len, images))}/{args.n} images", flush=True)
    images = torch.cat(images)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    ddpm.save_grid(images[:256].float() / 127.5 - 1, args.out)
    npz = os.path.splitext(args.out)[0] + ".npz"
    np.savez(npz, images=images.permute(0, 2, 3, 1).numpy(),
             labels=labels.numpy() if labels is not None else np.zeros(0, np.int64))
    what = f"{args.n} images, {args.sampler} {args.steps or mc.timesteps} steps, guidance {args.guidance}"
    print(f"wrote {args.out} and {npz}: {what}")
    if args.eval == "fid":
        feats, logits = features(extractor, images.split(args.batch), device)
        result = {**fid_metrics(feats, logits, ref), "n": args.n, "reference": f"{dataset} train, {int(ref['n'])} images",
                  "sampler": args.sampler, "steps": args.steps or mc.timesteps, "guidance": args.guidance,
                  "feature_extractor": "torch-fidelity inception-v3-compat"}
        path = write_json(result, args.out)
        extra = "".join(f", {k} {result[k]:.4f}" for k in ("inception_score", "precision", "recall") if k in result)
        print(f"FID {result['fid']:.3f} ({args.n} samples vs {result['reference']}){extra}; wrote {path}")
        return result


def check_output(out):
    """The grid's format from its extension, and a folder it can be written into (made now if missing)."""
    from PIL import Image

    ext = os.path.splitext(out)[1].lower()
    if ext not in Image.registered_extensions():
        raise ddpm.ConfigError(f"--out {out}: give the grid an image extension such as .png")
    folder = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise ddpm.ConfigError(f"--out {out}: cannot make the folder {folder} ({e.strerror or e})") from None
    if not os.access(folder, os.W_OK) or os.path.isdir(out):
        raise ddpm.ConfigError(f"--out {out}: cannot write there")


def run_data(args, run):
    """The held-out/reference data: --dataset/--data_dir, else what the checkpoint's run trained on."""
    dataset, data_dir = args.dataset or run.get("dataset"), args.data_dir or run.get("data_dir")
    if not dataset:
        raise EvalError(f"--eval {args.eval} needs --dataset (and --data_dir): this checkpoint does not record its run's data")
    return dataset, data_dir


def write_json(result, out):
    path = os.path.splitext(out)[0] + ".json"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    return path


def evaluate_bpd(args, model, mc, run, diffusion, device):
    """Bits/dim of the first --n images of the held-out split, in fp32 (the bound sums T terms)."""
    import data

    try:
        dataset, data_dir = run_data(args, run)
        images, labels, _ = data.load_dataset(dataset, data_dir, mc.image_size, run.get("shapes_count", 50_000), train=False)
    except (EvalError, data.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    n = min(args.n, len(images))
    g = torch.Generator().manual_seed(args.seed)
    bits, est_var = held_out_bits(diffusion, model, images[:n], labels[:n], mc.num_classes, device, args.batch,
                                  args.strata, args.threshold, g, progress=True)
    result = {"bpd": bits.mean().item(), "sem": (bits.std() / n**0.5).item() if n > 1 else None, "n": n,
              "dataset": dataset, "split": "test", "strata": args.strata or None,
              "estimator_se": est_var**0.5 / n if args.strata else None, "reverse_variance": mc.reverse_variance}
    path = write_json(result, args.out)
    extra = f", estimator s.e. {result['estimator_se']:.4f}" if args.strata else ""
    print(f"bits/dim {result['bpd']:.4f} ± {result['sem'] or 0:.4f} (s.e.m. over {n} {dataset} test images{extra}); wrote {path}")
    return result


if __name__ == "__main__":
    main()

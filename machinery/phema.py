"""Post-hoc EMA (Karras et al. 2024, "Analyzing and Improving the Training Dynamics of Diffusion Models",
§3.1 and appendix C.2): power-function EMAs tracked while training, snapshotted in the run folder, and the
EMA of any other relative width σ_rel rebuilt afterwards from the snapshots by least squares.

    tracked = Tracked(model, (0.05, 0.10))          # in training: tracked.update(model, step) after each step
    tracked.snapshot(out_dir, step, nimg)            # every ema_snapshot_kimg
    write_weights(out_dir, 0.08)                     # afterwards: <run>/ema-sigma_rel0.0800.pt

Time is counted in optimizer steps t = 1, 2, ... (one batch each: the images seen, in batches). A
power-function EMA of exponent γ averages the weights θ(τ) of the steps so far with the profile p(τ) ∝ τ^γ
on [0, t] (eq. 3 of the paper); its relative width σ_rel (the profile's standard deviation over its
length) names it.
"""
import argparse
import hashlib
import math
import os
import re

import numpy as np
import torch

from machinery import checkpoints, files
from machinery.errors import UserError, first_line, reported
from machinery.progress import Progress

FOLDER = "phema"  # in the run folder
NAME = re.compile(r"^phema-(\d{9})-(\d[0-9.e+-]*)\.pt$")  # phema-<step>-<sigma_rel_name(sigma_rel)>.pt
MAX_SNAPSHOTS = 10_000  # a folder listing more is not one this program wrote
SIGMA_REL_MIN = 1e-4  # the narrowest σ_rel taken: γ ≈ 10^4, an average over the last 1/10^4 of a run (the
#                       maths holds far below; the values of use lie in 0.01..0.25, EDM2 §3)
EXTRAPOLATED = 1.5  # a rebuild outside the tracked σ_rel values with a coefficient beyond ±this is said


def sigma_rel_of(gamma):
    """σ_rel, the relative width of the profile p(τ) ∝ τ^γ on [0, t]: √((γ+1) / ((γ+2)² (γ+3))) (app. C.2)."""
    return math.sqrt((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3)))


SIGMA_REL_MAX = sigma_rel_of(0)  # 1/√12: the flat average of all steps so far; wider needs γ < 0


def gamma_of(sigma_rel):
    """The exponent γ > 0 whose profile has relative width sigma_rel: the root of
    σ²γ³ + 7σ²γ² + (16σ² - 1)γ + 12σ² - 1 = 0 (σ_rel's equation, multiplied out) above 0."""
    if not SIGMA_REL_MIN <= sigma_rel < SIGMA_REL_MAX:
        raise ValueError(f"σ_rel must lie in [{SIGMA_REL_MIN}, {SIGMA_REL_MAX:.4f}), "
                         f"not {sigma_rel}")
    s2 = sigma_rel ** 2
    roots = np.roots([s2, 7 * s2, 16 * s2 - 1, 12 * s2 - 1])
    return float(max(r.real for r in roots if abs(r.imag) < 1e-9 and r.real > 0))


def sigma_rel_name(sigma_rel):
    """σ_rel as file names hold it: 4 decimals where they are σ_rel exactly ('0.0500'), else the
    shortest text that reads back as it ('0.05004', '4e-05'): distinct values, distinct names."""
    text = f"{sigma_rel:.4f}"
    return text if float(text) == sigma_rel else repr(float(sigma_rel))


def check_sigma_rels(values, what, least=1, most=64):
    """σ_rel values as given (--sigma_rel, ema_sigma_rels, ema_eval_sigma_rels): least..most of them,
    distinct, each in [SIGMA_REL_MIN, SIGMA_REL_MAX); else one UserError line naming `what`. -> them, as
    floats."""
    out = [float(v) for v in values]
    if not (least <= len(out) <= most and len(set(out)) == len(out)
            and all(SIGMA_REL_MIN <= w < SIGMA_REL_MAX for w in out)):  # NaN fails too
        raise UserError(f"{what} {','.join(map(str, values)) or '(none)'}: give {least} to {most} distinct "
                        f"σ_rel values, each in [{SIGMA_REL_MIN}, {SIGMA_REL_MAX:.4f})")
    return out


def beta(t, gamma):
    """The decay of step t (t = 1, 2, ...): β_γ(t) = (1 - 1/t)^(γ+1) (eq. 4); β(1) = 0: the first step copies.
    Unrolled, step τ's weights enter the EMA at step t with weight (τ^(γ+1) - (τ-1)^(γ+1)) / t^(γ+1): the
    profile (γ+1) τ^γ / t^(γ+1) integrated over (τ-1, τ]."""
    return (1 - 1 / t) ** (gamma + 1)


def inner(t_a, g_a, t_b, g_b):
    """<p_a, p_b> = ∫ p_a(τ) p_b(τ) dτ for the normalised profiles p(τ) = (γ+1) τ^γ / t^(γ+1) on [0, t]:
    (γ_a+1)(γ_b+1) min(t_a, t_b)^(γ_a+γ_b+1) / ((γ_a+γ_b+1) t_a^(γ_a+1) t_b^(γ_b+1)), in logarithms (t^γ
    overflows). Broadcasts over numpy arrays."""
    t_a, g_a, t_b, g_b = (np.asarray(v, dtype=np.float64) for v in (t_a, g_a, t_b, g_b))
    log = (np.log(g_a + 1) + np.log(g_b + 1) + (g_a + g_b + 1) * np.log(np.minimum(t_a, t_b))
           - np.log(g_a + g_b + 1) - (g_a + 1) * np.log(t_a) - (g_b + 1) * np.log(t_b))
    return np.exp(log)


def coefficients(ts, gammas, t, gamma):
    """x minimising ‖Σ_i x_i p_i - p_target‖² over the snapshots' profiles p_i (steps ts, exponents gammas):
    the normal equations A x = b with A_ij = <p_i, p_j>, b_i = <p_i, p_target> (appendix C.2), solved by
    least squares, then scaled to sum to 1 so that the rebuilt weights stay an average."""
    ts, gammas = np.asarray(ts, dtype=np.float64), np.asarray(gammas, dtype=np.float64)
    scale = max(ts.max(), t)  # the inner products in units of the run's length: same x, tamer numbers
    ts, t = ts / scale, t / scale
    A = inner(ts[:, None], gammas[:, None], ts[None, :], gammas[None, :])
    b = inner(ts, gammas, t, gamma)
    x = np.linalg.lstsq(A, b, rcond=None)[0]
    return x / x.sum()


class Tracked:
    """The power-function EMAs of a model's parameters, one per σ_rel, kept in float32."""

    def __init__(self, model, sigma_rels):
        self.sigma_rels = tuple(check_sigma_rels(sigma_rels, "ema_sigma_rels", 1, 8))
        self.gammas = [gamma_of(s) for s in self.sigma_rels]
        self.averages = [[p.detach().float().clone() for p in model.parameters()] for _ in self.sigma_rels]
        self.run = os.urandom(8).hex()  # the run's identity, kept across resumes, in every snapshot

    @torch.no_grad()
    def update(self, model, t, ok=None):
        """After optimizer step t: θ̂ <- β_γ(t) θ̂ + (1 - β_γ(t)) θ for each tracked γ; no change where ok = 0
        (a skipped, non-finite step), as the classic EMA does."""
        params = [p.detach().float() for p in model.parameters()]
        for average, gamma in zip(self.averages, self.gammas):
            weight = 1 - beta(t, gamma)  # ok stays on the device: a list of 0-dim weights (ddpm.ema_update)
            torch._foreach_lerp_(average, params, weight if ok is None else [weight * ok] * len(params))

    def state_dict(self):
        return {"sigma_rels": list(self.sigma_rels), "averages": self.averages, "run": self.run}

    def load_state_dict(self, state, path):
        """From a resumed checkpoint (`path`, for the error line), which must track the same σ_rel values."""
        if not isinstance(state, dict) or "averages" not in state:
            raise UserError(f"--resume: {path} holds no post-hoc EMA (its run began without it): resume with "
                            "--ema_snapshot_kimg=0")
        if list(state["sigma_rels"]) != list(self.sigma_rels):
            raise UserError(f"--resume: {path} tracks the σ_rel values {list(state['sigma_rels'])}, this run "
                            f"{list(self.sigma_rels)}: give --ema_sigma_rels as the run had it")
        for mine, saved in zip(self.averages, state["averages"]):
            torch._foreach_copy_(mine, saved)
        self.run = state.get("run")  # None: a run begun before snapshots named their run

    def snapshot_due(self, step, batch, kimg):
        """Step `step` (of `batch` images) crossed a multiple of kimg thousand images."""
        return step * batch // (kimg * 1000) != (step - 1) * batch // (kimg * 1000)

    def size_bytes(self):
        """One snapshot of every tracked σ_rel, in half precision."""
        return sum(2 * a.numel() for average in self.averages for a in average)

    def snapshot(self, out_dir, model, step, nimg, kept="the earlier snapshots are intact"):
        """Each tracked EMA, in half precision, to <out_dir>/phema/phema-<step>-<sigma_rel_name>.pt (written
        as every file of the run folder is: a fresh temporary name, then a rename; the folder made here), with
        what it is: its run, step and σ_rel, the σ_rel values tracked beside it, and its weights' checksum."""
        folder = files.own_folder(os.path.join(out_dir, FOLDER))
        names = [name for name, _ in model.named_parameters()]
        for sigma_rel, gamma, average in zip(self.sigma_rels, self.gammas, self.averages):
            state = {name: a.half().cpu() for name, a in zip(names, average)}
            record = {"step": step, "nimg": nimg, "sigma_rel": sigma_rel, "gamma": gamma, "params": state,
                      "run": self.run, "sigma_rels": list(self.sigma_rels), "sha256": params_sha256(state)}
            path = os.path.join(folder, f"phema-{step:09d}-{sigma_rel_name(sigma_rel)}.pt")
            with files.created(path, kept=kept) as f:
                torch.save(record, f)


def params_sha256(params):
    """SHA-256 of a snapshot's weights: each tensor's name, dtype, shape and bytes, in order."""
    h = hashlib.sha256()
    for name, v in params.items():
        h.update(f"{name} {v.dtype} {tuple(v.shape)}".encode())
        h.update(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def snapshots(out_dir):
    """The run folder's snapshots as [(step, sigma_rel, path)], sorted; the folder must be a real one (never
    a link) and each name as snapshot() writes it (step >= 1, its σ_rel as sigma_rel_name writes it)."""
    folder = os.path.join(out_dir, FOLDER)
    if not os.path.lexists(folder):
        raise UserError(f"{out_dir} has no post-hoc EMA snapshots (train with --ema_snapshot_kimg > 0)")
    if os.path.islink(folder) or not os.path.isdir(folder):
        raise UserError(f"{folder} is not a folder of snapshots (a link or a file): this program reads only "
                        "the folder it made")
    found = []
    with os.scandir(folder) as entries:
        for entry in entries:
            m = NAME.match(entry.name)
            if m and not entry.is_file(follow_symlinks=False):  # a link planted there is never read through
                raise UserError(f"cannot read post-hoc EMA snapshot {entry.path} (not a regular file: "
                                "a link?)")
            if m:
                try:
                    step, sigma_rel = int(m[1]), float(m[2])
                except ValueError:
                    step = sigma_rel = None
                if not step or sigma_rel is None or sigma_rel_name(sigma_rel) != m[2]:
                    raise UserError(f"{entry.path}: not a snapshot name this program writes (step >= 1, "
                                    "σ_rel as written): move it away")
                found.append((step, sigma_rel, entry.path))
                if len(found) > MAX_SNAPSHOTS:
                    raise UserError(f"{folder} holds over {MAX_SNAPSHOTS} snapshots: not a folder this "
                                    "program wrote")
    if not found:
        raise UserError(f"{folder} holds no snapshots (phema-<step>-<sigma_rel>.pt)")
    return sorted(found)


def read_snapshot(path, step, sigma_rel, shapes, parameters_only=False):
    """One snapshot, read with weights_only=True from a regular file only; what it records must be what its
    name says (its step and σ_rel) and its weights the model's shapes, finite, with the checksum it was
    written with (snapshots from before they carried one: their weights as they are). Anything else is one
    UserError line."""
    try:
        with files.open_regular(path, follow=False) as f:
            record = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, corrupt, a FIFO or a link there, not a torch file
        why = "objects other than tensors" if "weights only" in first_line(e).lower() else first_line(e)[:80]
        raise UserError(f"cannot read post-hoc EMA snapshot {path} ({type(e).__name__}: {why})") from None
    params = record.get("params") if isinstance(record, dict) else None
    ok = (isinstance(params, dict) and type(record.get("step")) is int and record["step"] == step
          and record.get("sigma_rel") == sigma_rel and type(record.get("nimg")) is int and record["nimg"] >= 0
          and list(params) == [k for k in shapes if k in params or not parameters_only] and params and all(
              isinstance(v, torch.Tensor) and v.is_floating_point() and tuple(v.shape) == shapes[k]
              for k, v in params.items()))
    if not ok:
        raise UserError(f"{path} is not a snapshot of this model at step {step}, σ_rel {sigma_rel}")
    if "sha256" in record and record["sha256"] != params_sha256(params):
        raise UserError(f"{path}: its weights are not those written (their checksum differs): the snapshot "
                        "is damaged")
    if not all(torch.isfinite(v).all() for v in params.values()):
        raise UserError(f"{path}: its weights are not all finite: not an average of a run's weights")
    return record


def shapes_of(model):
    """{parameter name: shape}: what a model's snapshots hold."""
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def rebuild(out_dir, shapes, sigma_rel, step=None, run=None, parameters_only=False):
    """The parameters of the EMA of σ_rel = sigma_rel at `step` (the last snapshot's when None), as the
    least-squares combination of the snapshots up to then. Every snapshot used must be of one run (`run`, a
    checkpoint's, where given) and hold every σ_rel tracked beside it, and one must be at `step` itself:
    snapshots past it (a run that went on past its checkpoint, then crashed) are left out, with a note.
    `shapes` are the model's parameters' (shapes_of); with parameters_only, a state dict's (an ema.pt's, its
    buffers too), of which the snapshots hold the parameters. -> (state, used): a state dict of the model's
    parameters (float32) and [{step, nimg, sigma_rel, coefficient}] for every snapshot used."""
    gamma = gamma_of(check_sigma_rels([sigma_rel], "a rebuilt EMA's σ_rel")[0])
    every = snapshots(out_dir)
    step = every[-1][0] if step is None else step
    found = [s for s in every if s[0] <= step]
    if len(found) < len(every):
        print(f"note: {len(every) - len(found)} post-hoc EMA snapshots in {out_dir} are past the "
              f"checkpoint's step {step} (a run that went on past it, then stopped): they are not used")
    if not found or found[-1][0] != step:
        raise UserError(f"{out_dir}: no post-hoc EMA snapshot at step {step}, the checkpoint's (they end at "
                        f"{found[-1][0] if found else 'none'}): the run went on without snapshots, or they "
                        "were lost; --resume it to a step that snapshots")
    records = []
    with Progress(f"reading the post-hoc EMA snapshots of {out_dir}", len(found), "snapshots") as bar:
        for s, sigma, path in found:  # minutes for many snapshots of a large model
            records.append(read_snapshot(path, s, sigma, shapes, parameters_only))
            bar.update()
    shapes = {name: shapes[name] for name in records[-1]["params"]}
    if any(list(r["params"]) != list(shapes) for r in records):
        raise UserError(f"{out_dir}: its snapshots do not all hold the same parameters: not one run's")
    check_one_run(out_dir, found, records, run if run is not None else records[-1].get("run"))
    x = coefficients([s[0] for s in found], [gamma_of(s[1]) for s in found], step, gamma)
    tracked = sorted({s[1] for s in found})
    if not tracked[0] <= sigma_rel <= tracked[-1] and abs(x).max() > EXTRAPOLATED:
        print(f"note: σ_rel {sigma_rel} lies outside the tracked {tracked}: extrapolated, with "
              f"coefficients up to ±{abs(x).max():.1f} (less trustworthy the further out)")
    state = {name: torch.zeros(shape) for name, shape in shapes.items()}
    used = []
    for (s, sigma, path), record, coefficient in zip(found, records, x):
        for name, v in record["params"].items():
            state[name].add_(v.float(), alpha=float(coefficient))
        used.append({"step": s, "nimg": record["nimg"], "sigma_rel": sigma,
                     "coefficient": float(coefficient)})
    return state, used


def check_one_run(out_dir, found, records, run):
    """The snapshots are all of `run` (None: a run begun before snapshots named their run), and each step
    holds every σ_rel tracked beside it: a missing one is an error, never made up from the others."""
    by_step = {}
    for (s, sigma, path), record in zip(found, records):
        if record.get("run") != run:
            raise UserError(f"{path} is a snapshot of another run ({record.get('run')}; this one is {run}): "
                            "move it away")
        by_step.setdefault(s, set()).add(sigma)
    tracked = set(records[-1].get("sigma_rels") or set().union(*by_step.values()))
    for s, held in by_step.items():
        if held != tracked:
            raise UserError(f"{out_dir}: the snapshots of step {s} are of σ_rel {sorted(held)}, "
                            f"the run tracked {sorted(tracked)}: some are missing (or not this run's)")
    if run is None:
        print("note: these snapshots are from before snapshots named their run: that they are this "
              "checkpoint's run is not verified")


# -----------------------------------------------------------------------------
# The command: the EMA of any σ_rel as a weights file in ema.pt's format, which sample.py samples like ema.pt


def sigma_rels(text):
    """--sigma_rel's "0.05,0.08" -> [0.05, 0.08]; anything else is one UserError line (check_sigma_rels)."""
    try:
        out = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"--sigma_rel {text}: give σ_rel values as numbers, comma-separated") from None
    return check_sigma_rels(out, "--sigma_rel")


def read_checkpoint(path):
    """A run's ema.pt (or ckpt.pt), read as every checkpoint is (checkpoints.load_checkpoint): -> (the
    checkpoint, its step, its post-hoc EMA's run: None for a run begun before snapshots named their run)."""
    ckpt = checkpoints.load_checkpoint(path, "cpu")
    if not isinstance(ckpt, dict):
        raise UserError(f"{path} is not a checkpoint of a run (no dict of weights and settings)")
    step, tracked = ckpt.get("step"), ckpt.get("phema")  # ema.pt names the run; ckpt.pt's averages do
    run = ckpt.get("phema_run", tracked.get("run") if isinstance(tracked, dict) else None)
    if type(step) is not int or step < 1 or not (run is None or isinstance(run, str)):
        raise UserError(f"{path} does not say which step and run it is of: not a checkpoint of a run")
    return ckpt, step, run


def located(where):
    """-> (the run folder, its checkpoint): `where` is the run folder (its ema.pt) or a checkpoint in it."""
    return (where, os.path.join(where, "ema.pt")) if os.path.isdir(where) else (os.path.dirname(where), where)


def load_rebuilt(model, where, sigma_rel):
    """Load the EMA of σ_rel = sigma_rel into model, rebuilt from a run's snapshots at the step of its
    checkpoint and checked to be that checkpoint's run (`where`: located()). -> the record a result keeps:
    σ_rel, the step, the run and every snapshot used with its coefficient."""
    out_dir, ckpt = located(where)
    _, step, run = read_checkpoint(ckpt)
    state, used = rebuild(out_dir, shapes_of(model), sigma_rel, step, run)
    model.load_state_dict(state, strict=False)
    return {"sigma_rel": sigma_rel, "gamma": gamma_of(sigma_rel), "step": step, "run": run, "snapshots": used}


def weights_path(out_dir, sigma_rel):
    return os.path.join(out_dir, f"ema-sigma_rel{sigma_rel_name(sigma_rel)}.pt")


def rebuilt_weights(where, sigma_rel):
    """The EMA of σ_rel = sigma_rel at the step of the run's checkpoint (`where`: located()), rebuilt from the
    run's snapshots, in ema.pt's format: its configs and step, the rebuilt parameters in place of the EMA's
    (the buffers as they are), and the rebuild's record under "post_hoc_ema"."""
    out_dir, path = located(where)
    ckpt, step, run = read_checkpoint(path)
    ema = ckpt.get("ema")
    if not isinstance(ema, dict) or not all(isinstance(v, torch.Tensor) for v in ema.values()):
        raise UserError(f"{path} holds no EMA weights: not a run's ema.pt or ckpt.pt")
    shapes = {k: tuple(v.shape) for k, v in ema.items() if v.is_floating_point()}
    state, used = rebuild(out_dir, shapes, sigma_rel, step, run, parameters_only=True)
    record = {"sigma_rel": sigma_rel, "gamma": gamma_of(sigma_rel), "step": step, "run": run,
              "snapshots": used}
    weights = {**ema, **{k: v.to(ema[k].dtype) for k, v in state.items()}}
    keep = {k: ckpt[k] for k in ("model_config", "trainer_config", "step", "phema_run") if k in ckpt}
    return {"ema": weights, **keep, "post_hoc_ema": record}


def write_weights(where, sigma_rel, weights=None):
    """rebuilt_weights (or `weights`, made by it) as <run>/ema-sigma_rel<σ_rel>.pt. -> the file's path."""
    out = weights_path(located(where)[0], sigma_rel)
    weights = weights or rebuilt_weights(where, sigma_rel)
    with files.created(out, kept="no weights file is written") as f:
        torch.save(weights, f)
    return out


def main(argv=None):
    """python -m machinery.phema --run RUN --sigma_rel 0.05,0.10: one weights file per σ_rel."""
    p = argparse.ArgumentParser(prog="python -m machinery.phema", description=(
        "Rebuild the post-hoc EMA of each σ_rel from a run's snapshots (Karras et al. 2024), at the step of "
        "its ema.pt, into <run>/ema-sigma_rel<σ_rel>.pt, in ema.pt's format: sample.py --ckpt samples it."))
    p.add_argument("--run", required=True, help="the run folder (its ema.pt), or a checkpoint in it")
    p.add_argument("--sigma_rel", required=True, type=sigma_rels,
                   help=f"σ_rel values, comma-separated, each in [{SIGMA_REL_MIN}, {SIGMA_REL_MAX:.4f})")
    with reported():
        args = p.parse_args(argv)
        paths = []
        for sigma_rel in args.sigma_rel:
            paths.append(write_weights(args.run, sigma_rel))
            print(f"wrote {paths[-1]} (σ_rel {sigma_rel_name(sigma_rel)})", flush=True)
        return paths


if __name__ == "__main__":
    main()

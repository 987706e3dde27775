"""Post-hoc EMA (Karras et al. 2024, "Analyzing and Improving the Training Dynamics of Diffusion Models",
§3.1 and appendix C.2): power-function EMAs tracked while training, snapshotted in the run folder, and the
EMA of any other relative width rebuilt afterwards from the snapshots by least squares.

    tracked = Tracked(model, (0.05, 0.10))          # in training: tracked.update(model, step) after each step
    tracked.snapshot(out_dir, step, nimg)            # every ema_snapshot_kimg
    state, used = rebuild(out_dir, model, 0.08)      # afterwards: the EMA of relative width 0.08

Time is counted in optimizer steps t = 1, 2, ... (one batch each: the images seen, in batches). A
power-function EMA of exponent γ averages the weights θ(τ) of the steps so far with the profile p(τ) ∝ τ^γ
on [0, t] (eq. 3 of the paper); its relative width σ_rel (the profile's standard deviation over its
length) names it.
"""
import argparse
import hashlib
import json
import math
import os
import re

import numpy as np
import torch

import files
from errors import UserError, first_line

FOLDER = "phema"  # in the run folder
NAME = re.compile(r"^phema-(\d{9})-(\d[0-9.e+-]*)\.pt$")  # phema-<step>-<width_name(sigma_rel)>.pt
MAX_SNAPSHOTS = 10_000  # a folder listing more is not one this program wrote
SIGMA_REL_MIN = 1e-4  # the narrowest width taken: γ ≈ 10^4, an average over the last 1/10^4 of a run (the
#                       maths holds far below; the widths of use lie in 0.01..0.25, EDM2 §3)
EXTRAPOLATED = 1.5  # a rebuild outside the tracked widths with a coefficient beyond ±this is said


def sigma_rel_of(gamma):
    """The relative width of the profile p(τ) ∝ τ^γ on [0, t]: √((γ+1) / ((γ+2)² (γ+3))) (appendix C.2)."""
    return math.sqrt((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3)))


SIGMA_REL_MAX = sigma_rel_of(0)  # 1/√12: the flat average of all steps so far; wider needs γ < 0


def gamma_of(sigma_rel):
    """The exponent γ > 0 whose profile has relative width sigma_rel: the root of
    σ²γ³ + 7σ²γ² + (16σ² - 1)γ + 12σ² - 1 = 0 (the width's equation, multiplied out) above 0."""
    if not SIGMA_REL_MIN <= sigma_rel < SIGMA_REL_MAX:
        raise ValueError(f"a relative EMA width must lie in [{SIGMA_REL_MIN}, {SIGMA_REL_MAX:.4f}), "
                         f"not {sigma_rel}")
    s2 = sigma_rel ** 2
    roots = np.roots([s2, 7 * s2, 16 * s2 - 1, 12 * s2 - 1])
    return float(max(r.real for r in roots if abs(r.imag) < 1e-9 and r.real > 0))


def width_name(sigma_rel):
    """A width as file names hold it: 4 decimals where they are the width exactly ('0.0500'), else the
    shortest text that reads back as it ('0.05004', '4e-05'): distinct widths, distinct names."""
    text = f"{sigma_rel:.4f}"
    return text if float(text) == sigma_rel else repr(float(sigma_rel))


def check_widths(widths, what, least=1, most=64):
    """Widths as given (--ema_length, ema_sigma_rels, ema_eval_widths): least..most of them, distinct, each
    in [SIGMA_REL_MIN, SIGMA_REL_MAX); else one UserError line naming `what`. -> them, as floats."""
    out = [float(w) for w in widths]
    if not (least <= len(out) <= most and len(set(out)) == len(out)
            and all(SIGMA_REL_MIN <= w < SIGMA_REL_MAX for w in out)):  # NaN fails too
        raise UserError(f"{what} {','.join(map(str, widths)) or '(none)'}: give {least} to {most} distinct "
                        f"relative widths, each in [{SIGMA_REL_MIN}, {SIGMA_REL_MAX:.4f})")
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
    """The power-function EMAs of a model's parameters, one per relative width, kept in float32."""

    def __init__(self, model, sigma_rels):
        self.sigma_rels = tuple(check_widths(sigma_rels, "ema_sigma_rels", 1, 8))
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
        """From a resumed checkpoint (`path`, for the error line), which must track the same widths."""
        if not isinstance(state, dict) or "averages" not in state:
            raise UserError(f"--resume: {path} holds no post-hoc EMA (its run began without it): resume with "
                            "--ema_snapshot_kimg=0")
        if list(state["sigma_rels"]) != list(self.sigma_rels):
            raise UserError(f"--resume: {path} tracks the EMA widths {list(state['sigma_rels'])}, this run "
                            f"{list(self.sigma_rels)}: give --ema_sigma_rels as the run had it")
        for mine, saved in zip(self.averages, state["averages"]):
            torch._foreach_copy_(mine, saved)
        self.run = state.get("run")  # None: a run begun before snapshots named their run

    def snapshot_due(self, step, batch, kimg):
        """Step `step` (of `batch` images) crossed a multiple of kimg thousand images."""
        return step * batch // (kimg * 1000) != (step - 1) * batch // (kimg * 1000)

    def size_bytes(self):
        """One snapshot of every tracked width, in half precision."""
        return sum(2 * a.numel() for average in self.averages for a in average)

    def snapshot(self, out_dir, model, step, nimg, kept="the earlier snapshots are intact"):
        """Each tracked EMA, in half precision, to <out_dir>/phema/phema-<step>-<width_name>.pt (written as
        every file of the run folder is: a fresh temporary name, then a rename; the folder made here), with
        what it is: its run, step and width, the widths tracked beside it, and its weights' checksum."""
        folder = files.own_folder(os.path.join(out_dir, FOLDER))
        names = [name for name, _ in model.named_parameters()]
        for sigma_rel, gamma, average in zip(self.sigma_rels, self.gammas, self.averages):
            state = {name: a.half().cpu() for name, a in zip(names, average)}
            record = {"step": step, "nimg": nimg, "sigma_rel": sigma_rel, "gamma": gamma, "params": state,
                      "run": self.run, "sigma_rels": list(self.sigma_rels), "sha256": params_sha256(state)}
            path = os.path.join(folder, f"phema-{step:09d}-{width_name(sigma_rel)}.pt")
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
    a link) and each name as snapshot() writes it (step >= 1, its width as width_name writes it)."""
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
                    step, width = int(m[1]), float(m[2])
                except ValueError:
                    step = width = None
                if not step or width is None or width_name(width) != m[2]:
                    raise UserError(f"{entry.path}: not a snapshot name this program writes (step >= 1, "
                                    "width as written): move it away")
                found.append((step, width, entry.path))
                if len(found) > MAX_SNAPSHOTS:
                    raise UserError(f"{folder} holds over {MAX_SNAPSHOTS} snapshots: not a folder this "
                                    "program wrote")
    if not found:
        raise UserError(f"{folder} holds no snapshots (phema-<step>-<sigma_rel>.pt)")
    return sorted(found)


def read_snapshot(path, step, sigma_rel, shapes):
    """One snapshot, read with weights_only=True from a regular file only; what it records must be what its
    name says (its step and width) and its weights the model's shapes, finite, with the checksum it was
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
          and list(params) == list(shapes) and all(
              isinstance(v, torch.Tensor) and v.is_floating_point() and tuple(v.shape) == shapes[k]
              for k, v in params.items()))
    if not ok:
        raise UserError(f"{path} is not a snapshot of this model at step {step}, width {sigma_rel}")
    if "sha256" in record and record["sha256"] != params_sha256(params):
        raise UserError(f"{path}: its weights are not those written (their checksum differs): the snapshot "
                        "is damaged")
    if not all(torch.isfinite(v).all() for v in params.values()):
        raise UserError(f"{path}: its weights are not all finite: not an average of a run's weights")
    return record


def rebuild(out_dir, model, sigma_rel, step=None, run=None):
    """The parameters of the EMA of relative width sigma_rel at `step` (the last snapshot's when None), as the
    least-squares combination of the snapshots up to then. Every snapshot used must be of one run (`run`, a
    checkpoint's, where given) and hold every width tracked beside it, and one must be at `step` itself:
    snapshots past it (a run that went on past its checkpoint, then crashed) are left out, with a note.
    -> (state, used): a state dict of the model's parameters (float32) and [{step, nimg, sigma_rel,
    coefficient}] for every snapshot used."""
    gamma = gamma_of(check_widths([sigma_rel], "a rebuilt EMA's width")[0])
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
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    records = [read_snapshot(path, s, width, shapes) for s, width, path in found]
    check_one_run(out_dir, found, records, run if run is not None else records[-1].get("run"))
    x = coefficients([s[0] for s in found], [gamma_of(s[1]) for s in found], step, gamma)
    widths = sorted({s[1] for s in found})
    if not widths[0] <= sigma_rel <= widths[-1] and abs(x).max() > EXTRAPOLATED:
        print(f"note: width {sigma_rel} lies outside the tracked widths {widths}: extrapolated, with "
              f"coefficients up to ±{abs(x).max():.1f} (less trustworthy the further out)")
    state = {name: torch.zeros(shape) for name, shape in shapes.items()}
    used = []
    for (s, width, path), record, coefficient in zip(found, records, x):
        for name, v in record["params"].items():
            state[name].add_(v.float(), alpha=float(coefficient))
        used.append({"step": s, "nimg": record["nimg"], "sigma_rel": width,
                     "coefficient": float(coefficient)})
    return state, used


def check_one_run(out_dir, found, records, run):
    """The snapshots are all of `run` (None: a run begun before snapshots named their run), and each step
    holds every width tracked beside it: a missing width is an error, never made up from the others."""
    by_step = {}
    for (s, width, path), record in zip(found, records):
        if record.get("run") != run:
            raise UserError(f"{path} is a snapshot of another run ({record.get('run')}; this one is {run}): "
                            "move it away")
        by_step.setdefault(s, set()).add(width)
    tracked = set(records[-1].get("sigma_rels") or set().union(*by_step.values()))
    for s, widths in by_step.items():
        if widths != tracked:
            raise UserError(f"{out_dir}: the snapshots of step {s} are of widths {sorted(widths)}, "
                            f"the run tracked {sorted(tracked)}: some are missing (or not this run's)")
    if run is None:
        print("note: these snapshots are from before snapshots named their run: that they are this "
              "checkpoint's run is not verified")


# -----------------------------------------------------------------------------
# sample.py --ema_length: one width, or a sweep of several


def widths(text):
    """--ema_length's "0.05,0.08" -> [0.05, 0.08]; anything else is one UserError line (check_widths)."""
    try:
        out = [float(v) for v in text.split(",") if v.strip()] if text else []
    except ValueError:
        raise UserError(f"--ema_length {text}: give relative widths as numbers, comma-separated") from None
    return check_widths(out, "--ema_length") if out else []


def checkpoint_identity(path):
    """-> (step, run) of a run's ema.pt or ckpt.pt: the step its weights are of, and its post-hoc EMA's run
    (None for a run begun before snapshots named their run)."""
    try:
        with files.open_regular(path) as f:
            ckpt = torch.load(f, map_location="cpu", weights_only=True)
        step, tracked = ckpt["step"], ckpt.get("phema")  # ema.pt names the run; ckpt.pt's averages do
    except Exception as e:
        raise UserError(f"cannot read checkpoint {path} ({type(e).__name__}: {first_line(e)[:80]})") from None
    run = ckpt.get("phema_run", tracked.get("run") if isinstance(tracked, dict) else None)
    if type(step) is not int or step < 1 or not (run is None or isinstance(run, str)):
        raise UserError(f"{path} does not say which step and run it is of: not a checkpoint of a run")
    return step, run


def load_rebuilt(model, where, sigma_rel):
    """Load the EMA of relative width sigma_rel into model, rebuilt from a run's snapshots at the step of its
    checkpoint and checked to be that checkpoint's run: `where` is the run folder (its ema.pt the checkpoint)
    or a checkpoint in it (ema.pt, ckpt.pt). -> the record sample.py's result keeps: the width, the step, the
    run and every snapshot used with its coefficient."""
    out_dir, ckpt = ((where, os.path.join(where, "ema.pt")) if os.path.isdir(where)
                     else (os.path.dirname(where), where))
    step, run = checkpoint_identity(ckpt)
    state, used = rebuild(out_dir, model, sigma_rel, step, run)
    missing = model.load_state_dict(state, strict=False).missing_keys
    if any(name in dict(model.named_parameters()) for name in missing):
        raise UserError(f"{out_dir}: its snapshots do not hold every parameter of the model")
    return {"sigma_rel": sigma_rel, "gamma": gamma_of(sigma_rel), "step": step, "run": run, "snapshots": used}


def sweep_args(args):
    """sample.py's arguments for each width of an --ema_length sweep: each width its own outputs
    (<out>-ema<width>.png, its .npz and shard folder) and, with --png_dir, its own PNG folder."""
    return [argparse.Namespace(**{**vars(args), "ema_length": [s], "out": sweep_out(args.out, s),
                                  "png_dir": args.png_dir and sweep_out(args.png_dir, s)})
            for s in args.ema_length]


def sweep_out(out, sigma_rel):
    """<out>-ema<width>.png: each width of a sweep has its own outputs (and shard folder, and PNG folder)."""
    stem, ext = os.path.splitext(out)
    return f"{stem}-ema{width_name(sigma_rel)}{ext}"


def write_sweep(out, results):
    """The sweep's table, <out>.json (one row per width: its FID where scored, its outputs) and, with FID,
    <out>-ema.png, FID against the width; printed as a table. -> the table."""
    rows = [{"sigma_rel": r["checkpoint"]["post_hoc_ema"]["sigma_rel"], "fid": r.get("fid"), "n": r["n"],
             "npz": r["npz"]} for r in results]
    table = {"post_hoc_ema_sweep": rows, "settings": {k: v for k, v in results[0].items() if k in (
        "sampler", "steps", "guidance", "eta", "threshold", "seed", "n")}}
    with files.created(os.path.splitext(out)[0] + ".json", "w") as f:
        json.dump(table, f, indent=2)
    for row in rows:
        score = f"FID {row['fid']:.3f}" if row["fid"] is not None else "not scored"
        print(f"EMA width {width_name(row['sigma_rel'])}: {score}, {row['npz']}")
    scored = [row for row in rows if row["fid"] is not None]
    if scored:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([r["sigma_rel"] for r in scored], [r["fid"] for r in scored], "o-")
        ax.set(xlabel="EMA relative width σ_rel (post-hoc)", ylabel=f"FID (n = {scored[0]['n']})")
        fig.tight_layout()
        with files.created(os.path.splitext(out)[0] + "-ema.png") as f:
            fig.savefig(f, format="png", dpi=120)
        plt.close(fig)
    return table

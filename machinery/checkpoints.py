"""Checkpoints that are never lost: ckpt.pt (the resumable state, the one before it kept as ckpt.prev.pt)
and ema.pt (the export), written atomically, read with weights_only=True, and restored into a run.

    save_checkpoints(out_dir, step, model, ema, mc, tc, optimizer=..., loader=...)   # both files
    ckpt, path = load_resume_checkpoint(out_dir, device)   # the newest readable one
    step = restore(ckpt, path, mc, model, ema, opt, loader, world)
"""
import os
from dataclasses import asdict

import torch

from machinery import files
from machinery.errors import RUN_STOPPED, UserError, first_line


def previous_path(path):
    """ckpt.pt -> ckpt.prev.pt, in the same folder, whatever the folder is called."""
    root, ext = os.path.splitext(path)
    return root + ".prev" + ext


def atomic_save(obj, path, keep_previous=False):
    """torch.save to a fresh temporary file, fsync, rename (files.created): a crash mid-write never leaves a
    broken `path`, and a link planted at `path` is replaced, not followed. keep_previous: the file it replaces
    survives as *.prev.pt. A failed write (a full disk) leaves `path` as it was and raises one UserError
    line (status 1) that says whether an earlier checkpoint is there."""
    earlier = files.is_regular(path) or files.is_regular(previous_path(path))
    kept = "the previous checkpoint is intact" if earlier else "there is no earlier checkpoint"
    with files.created(path, kept=kept, previous=previous_path(path) if keep_previous else None) as f:
        torch.save(obj, f)


def save_checkpoints(out_dir, step, model, ema, mc, tc, **state):
    """ckpt.pt, the resumable state (weights, EMA, RNG, both configs and `state`: optimizer, scaler, loader
    position, ...; the one before survives as ckpt.prev.pt), and ema.pt, the export. Weights that are no
    longer finite are never written: the run stops with the checkpoints it had."""
    finite = torch.stack([torch.isfinite(p).all() for p in [*model.parameters(), *ema.parameters()]]).all()
    # a sync, once per checkpoint; a finite step can still overflow the weights (huge lr)
    if not finite.item():
        raise UserError(f"the weights are no longer finite at step {step}; "
                        f"{os.path.join(out_dir, 'ckpt.pt')} is left as it was (lower --lr, then --resume)",
                        RUN_STOPPED)
    on_gpu = next(model.parameters()).device.type == "cuda"
    rng = {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if on_gpu else []}
    configs = {"model_config": asdict(mc), "trainer_config": asdict(tc), "step": step}
    atomic_save({"model": model.state_dict(), "ema": ema.state_dict(), "rng": rng, **state, **configs},
                os.path.join(out_dir, "ckpt.pt"), keep_previous=True)
    tracked = state.get("phema")  # the post-hoc EMA's run, which its snapshots name (phema.py), if any
    run = {"phema_run": tracked.get("run")} if isinstance(tracked, dict) else {}
    atomic_save({"ema": ema.state_dict(), **configs, **run}, os.path.join(out_dir, "ema.pt"))


def load_checkpoint(path, device):
    """torch.load with weights_only=True (a checkpoint can never run code) of a regular file only (a FIFO
    there would block forever); a bad file is one UserError line."""
    if not os.path.exists(path):
        raise UserError(f"no checkpoint at {path}")
    try:
        with files.open_regular(path) as f:
            return torch.load(f, map_location=device, weights_only=True)
    except Exception as e:  # truncated, corrupt, or not a torch file
        raise UserError(f"cannot read checkpoint {path} ({type(e).__name__}: {first_line(e)})") from None


def load_resume_checkpoint(out_dir, device):
    """The newest readable of ckpt.pt and ckpt.prev.pt; a corrupt or missing newest one is said in one
    line."""
    path = os.path.join(out_dir, "ckpt.pt")
    try:
        if not files.is_regular(path):  # a link or FIFO planted there is not this folder's checkpoint
            raise UserError(f"cannot read checkpoint {path} (not a regular file)")
        return load_checkpoint(path, device), path
    except UserError as e:
        prev = previous_path(path)
        if not files.is_regular(prev):
            raise
        print(f"warning: {e}; resuming from the previous checkpoint {prev}")
        return load_checkpoint(prev, device), prev


def data_changes(ckpt, data_now):
    """The data settings that differ between a checkpoint and this run: ['dataset: shapes -> folder', ...]
    (a checkpoint from before they were recorded: its trainer config's dataset)."""
    saved = ckpt.get("data")
    if not isinstance(saved, dict):
        saved = {"dataset": (ckpt.get("trainer_config") or {}).get("dataset")}
    return [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in data_now.items() if k in saved and saved[k] != v]


def restore(ckpt, path, mc, model, ema, opt, loader, world, scaler=None, data_now=None, new_data=False):
    """Load a resumable checkpoint into the run's objects: weights, EMA, optimizer, data position, RNG
    states. -> its step. A checkpoint of a different model is one UserError line, and so is other data
    (data_now: this run's data settings) unless new_data: then the epoch plan starts afresh, said once."""
    try:
        saved = ckpt["model_config"]
        as_list = lambda v: list(v) if isinstance(v, (tuple, list)) else v  # noqa: E731
        defaults = asdict(type(mc)())  # a field newer than the checkpoint: its default is what it ran with
        changed = [k for k, v in asdict(mc).items() if as_list(saved.get(k, defaults[k])) != as_list(v)]
        states = (ckpt["model"], ckpt["ema"], ckpt["optimizer"], dict(ckpt["loader"]), ckpt["rng"],
                  ckpt["step"])
    except (KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{path} is not a resumable ddpm checkpoint (no {e})") from None
    if changed:
        raise UserError(f"--resume: the model config differs from the checkpoint's in {', '.join(changed)}")
    other_data = data_changes(ckpt, data_now or {})
    if other_data and not new_data:
        raise UserError(f"--resume: the data differ from the checkpoint's ({'; '.join(other_data)}); "
                        "pass --resume_new_data to train on them from a new epoch plan")
    model_state, ema_state, opt_state, position, rng, step = states
    say = print if int(os.environ.get("RANK", "0")) == 0 else (lambda *a, **k: None)  # once, not per rank
    model.load_state_dict(model_state)
    ema.load_state_dict(ema_state)
    opt.load_state_dict(opt_state)
    # fp16's loss scale goes on where it was: resume stays bitwise
    if scaler is not None and ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    saved_world = ckpt.get("world_size", 1)
    if saved_world != world:  # the position counts per-rank images: keep the same place in the epoch
        per_rank = position["index"] * saved_world // world
        position["index"] = per_rank - per_rank % loader.batch_size
        say(f"note: resuming {saved_world}-process training with {world}: the same epoch and place in it, "
            "but not bitwise the run it would have been")
    if other_data:
        say(f"note: training on other data than the checkpoint's ({'; '.join(other_data)}), as "
            "--resume_new_data asks: a new epoch plan starts here")
    else:
        loader.load_state_dict(position)
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available() and rng["cuda"]:
        torch.cuda.set_rng_state_all(rng["cuda"])
    return step

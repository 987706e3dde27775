"""Everything around a run that is not the method: the device and torchrun set-up, the run folder with its
lock, config and metrics, atomic checkpoints and resume, sample grids and the loss plot, and preemption.

A run folder explains itself: config.json (both configs, what 'auto' resolved to, the environment),
metrics.jsonl (one JSON row per log interval or evaluation), samples_*.png grids, loss.png, ckpt.pt (the
resumable state; the one before it survives as ckpt.prev.pt) and ema.pt (the EMA weights, for sampling and
export). run.lock keeps a second run out while one writes there.
"""
import contextlib
import json
import math
import os
import platform
import signal
import subprocess
import sys
import threading
import time

import torch
import torch.nn.functional as F

from machinery import checkpoints, files, group, mfu
from machinery.errors import UserError, first_line

# -----------------------------------------------------------------------------
# The device: which one, which precision and layout, and torchrun


def resolve_precision(precision, device):
    """'auto' -> 'bf16' on CUDA devices with bf16 and on CPUs with AVX512-BF16/AMX; 'fp16' (with loss
    scaling) on older GPUs (V100, T4, P100), whose fp16 tensor cores are their fast path; else 'fp32'."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    return "bf16" if device.type == "cpu" and mfu.cpu_has_bf16() else "fp32"


def set_matmul_precision(precision):
    """'fp32' is true fp32 everywhere; the others let fp32 matmuls and convs use TF32 tensor cores."""
    tf32 = precision != "fp32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def resolve_channels_last(channels_last, device, precision, compiled=True):
    """'auto' -> NHWC, the layout tensor-core and oneDNN fp32 convolutions want, except where ATen's GroupNorm
    runs the step: for bf16 on a CPU its NHWC kernel is far slower than its NCHW one (the convolutions run as
    fast in NCHW there), and on a GPU an eager (not `compiled`) step in bf16 or fp16 copies NHWC activations
    to NCHW around every GroupNorm (on an H200, 'ho' at batch 512 in bf16: 178 ms a step in NHWC against 140
    in NCHW, 28% of its GPU time in those copies). Compiled, inductor fuses the GroupNorms (BENCHMARKS.md)."""
    if channels_last != "auto":
        return channels_last == "true"
    if device.type == "cpu":
        return precision != "bf16"
    return compiled or precision not in ("bf16", "fp16")


def memory_format(channels_last):
    return torch.channels_last if channels_last else torch.contiguous_format


def resolve_compile(compile, device):
    """'auto' -> compile on a GPU only: on a CPU compiling takes minutes and the compiled step has measured
    no faster than eager (BENCHMARKS.md)."""
    if compile != "auto":
        return compile == "true"
    return device.type == "cuda"


def device_notes(device, precision, compile, say):
    """One line for each setting that will not run as fast as its user may think."""
    if device.type == "cpu" and precision == "bf16" and not mfu.cpu_has_bf16():
        say("warning: this CPU has no AVX512-BF16/AMX; bf16 will run far slower than --precision=fp32")
    if device.type == "cpu" and precision == "fp16":
        say("note: fp16 on a CPU runs for testing the loss-scaling path; it is not faster than fp32 there")
    if device.type == "cpu" and compile:
        say("note: torch.compile takes minutes on a CPU and measured no faster than eager there "
            "(BENCHMARKS.md); --compile=auto or false skips it")


def check_fits(network, mc, tc, device, world, data_images):
    """Before anything is allocated: refuse in one line a run whose memory cannot fit, by a lower bound
    (mfu.training_bytes: the weights with their optimizer state and EMA, one micro-batch's activations, plus
    the `data_images` uint8 images the data set-up holds in host memory), with the estimate in the line."""
    precision = resolve_precision(tc.precision, device)
    micro = max(1, tc.batch_size // world // tc.grad_accum_steps)
    params, step = mfu.training_bytes(network, mc, micro, precision, tc.activation_checkpointing)
    images = data_images * mc.channels * mc.image_size**2
    host, on_device = mfu.memory_bytes(torch.device("cpu")), mfu.memory_bytes(device)
    needs = [(step, on_device, f"the {device.type} step"), (images, host, "the images in host memory")]
    if device.type == "cpu":
        needs = [(step + images, host, "the step and the images in host memory")]
    for need, have, what in needs:
        if have is not None and need > have:
            raise UserError(f"{what} need at least {need / 2**30:,.1f} GiB ({params:,} parameters, "
                            f"micro-batch {micro}, {data_images:,} images of {mc.image_size}px); this "
                            f"machine has {have / 2**30:,.1f} GiB: make the model, the batch or the data "
                            "smaller")


def set_up_cpu(device, threads, say):
    """On a CPU: the step's intra-op threads (0 = torch's default) and glibc keeping freed memory."""
    if device.type != "cpu":
        return
    if threads > 16 * (os.cpu_count() or 1):
        raise UserError(f"cpu_threads={threads}: this machine has {os.cpu_count()} cores; give at most "
                        f"{16 * (os.cpu_count() or 1)} threads (0 = one per core)")
    if threads:
        torch.set_num_threads(threads)
    if not mfu.keep_freed_memory():
        say("note: not glibc: freed memory goes back to the OS, and each CPU step page-faults it in again")


def distributed_setup(tc):
    """-> (rank, world, device): the global batch checked against torchrun's processes, then the group
    joined (group.join)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and tc.batch_size % world:
        raise UserError(f"batch_size {tc.batch_size} does not divide by the {world} processes "
                        "(it is the global batch, split evenly across them)")
    if world > 1 and tc.batch_size // world % tc.grad_accum_steps:
        raise UserError(f"each process's batch of {tc.batch_size // world} does not divide into "
                        f"grad_accum_steps={tc.grad_accum_steps} micro-batches")
    return group.join(tc.device)


# -----------------------------------------------------------------------------
# The run folder: its lock, its record of the environment, grids and the loss plot


def prepare_run_folder(out_dir, preset, resume, world):
    """-> the run folder, made if need be: out_dir, or runs/<preset>-<date>-<time>. A folder that already
    holds a checkpoint is continued only with --resume, and --resume needs one."""
    if world > 1 and not out_dir:
        raise UserError("under torchrun, give --out_dir (every rank must name the same run folder)")
    named = bool(out_dir)  # the user's folder may be a link (runs on another disk); a derived one never
    out_dir = out_dir or os.path.join("runs", f"{preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    # a link planted at either name is no checkpoint of this folder: it is replaced when one is written
    have_ckpt = files.is_regular(ckpt_path) or files.is_regular(checkpoints.previous_path(ckpt_path))
    if resume and not have_ckpt:
        raise UserError(f"--resume: no checkpoint at {ckpt_path}")
    if not resume and have_ckpt:
        raise UserError(f"{out_dir} already holds a checkpoint: pass --resume to continue it, "
                        "or choose another --out_dir")
    try:
        os.makedirs(out_dir, exist_ok=True) if named else files.own_folder(out_dir)  # runs/<preset>-<time>
    except OSError as e:  # a path through a file, a read-only place
        raise UserError(f"--out_dir={out_dir}: cannot make it ({e.strerror or e})") from None
    metrics = os.path.join(out_dir, "metrics.jsonl")
    if os.path.lexists(metrics) and not files.is_regular(metrics):  # appended to, so never replaced
        raise UserError(f"{metrics} is not a regular file (a link, FIFO or device planted there?); only "
                        "files this program made are appended to: remove it")
    return out_dir


def kept(out_dir):
    """What a failed write in the run folder leaves: for the one error line."""
    if files.is_regular(os.path.join(out_dir, "ckpt.pt")):
        return f"the checkpoints in {out_dir} are intact"
    return f"no checkpoint had been written to {out_dir} yet"


def write_json(path, obj):
    """A JSON file of the run folder, created fresh (a link planted at `path` is replaced, not followed)."""
    with files.created(path, "w", kept=kept(os.path.dirname(path) or ".")) as f:
        json.dump(obj, f, indent=2)


def append_metrics(out_dir, row):
    """One row of metrics.jsonl, as one write of a whole line to a regular file."""
    files.append_line(os.path.join(out_dir, "metrics.jsonl"), json.dumps(row), kept=kept(out_dir))


def progress_text(row):
    """The progress bar's postfix for a metrics row."""
    if row["loss"] is None:
        return ""
    if row["img_per_s"] is None:
        return f"loss {row['loss']:.4f}"
    return (f"loss {row['loss']:.4f} | {row['img_per_s']:.0f} img/s | {row['tflops']:.3f} TFLOP/s | "
            f"MFU {100 * row['mfu']:.1f}%")


def log_row(out_dir, row, trackers=None):
    """A metrics row: to metrics.jsonl, then to the trackers (TensorBoard, wandb) if any."""
    append_metrics(out_dir, row)
    if trackers is not None:
        trackers.log(row)


def read_metrics(out_dir):
    """metrics.jsonl's rows -> (rows, lines skipped): a cut or invalid line (a kill -9 or a full disk in
    the middle of a write) is skipped and counted, never fatal."""
    rows, bad = [], 0
    try:
        with files.open_regular(os.path.join(out_dir, "metrics.jsonl"), "rb") as f:
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return rows, bad
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
        elif line.strip():
            bad += 1
    return rows, bad


def mend_metrics(out_dir):
    """Before a run appends: a last line cut short (no newline at its end) is ended, so the next row starts a
    line of its own; readers skip the cut one."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not files.is_regular(path) or os.path.getsize(path) == 0:
        return
    with files.open_regular(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        cut = f.read(1) != b"\n"
    if cut:
        print(f"note: the last line of {path} was cut short (a crash or a full disk mid-write); "
              "it is ended and skipped by readers")
        files.append_line(path, "", kept=kept(out_dir))


HELD_LOCKS = {}  # token -> the open lock file of each run-folder lock this process holds (its heartbeat)
LOCK_HEARTBEAT_S = 60  # a live run touches its run.lock this often
LOCK_STALE_S = 15 * 60  # a lock nobody has touched for this long has no live owner, whatever host it names


def read_lock(path):
    """The owner a run.lock names: {'host': str, 'pid': int > 0, ...}, or None for a lock that cannot be
    parsed (empty, binary, truncated, not a regular file, pid <= 0): such a lock is stale. A lock is written
    whole before it appears (lock_run_folder), so a half-written one is never seen."""
    try:
        with files.open_regular(path, "rb") as f:
            owner = json.loads(f.read(4096).decode())
    except (OSError, ValueError):
        return None
    if not (isinstance(owner, dict) and isinstance(owner.get("host"), str)
            and type(owner.get("pid")) is int and owner["pid"] > 0):
        return None
    return owner


def lock_is_stale(path, owner, me):
    """-> why the lock is stale, or None while its owner may be alive."""
    if owner is None:
        return "it cannot be read as a lock"
    try:
        idle = time.time() - os.lstat(path).st_mtime
    except OSError:
        return "it is gone"
    if idle > LOCK_STALE_S:
        return f"nobody has touched it for {idle / 60:.0f} minutes"
    if owner["host"] == me["host"] and not process_alive(owner["pid"], owner.get("token")):
        return f"pid {owner['pid']} has ended"
    return None


def lock_run_folder(out_dir):
    """One run per folder: out_dir/run.lock names its owner's host and pid, and a second run is refused in one
    line. The lock appears whole (written to a fresh file, then hard-linked into place) and its owner touches
    it every LOCK_HEARTBEAT_S seconds. A stale lock is taken over with a note: one that cannot be parsed or
    names pid <= 0, one untouched for LOCK_STALE_S, or one of this host whose pid is no longer alive (or is
    this process, from a run that already ended). -> (path, token) for unlock_run_folder."""
    path = os.path.join(out_dir, "run.lock")
    me = {"host": platform.node(), "pid": os.getpid(), "token": os.urandom(8).hex(),
          "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    tmp = None
    try:
        tmp = files.fresh_temp(path)
        with open(tmp, "w") as f:
            json.dump(me, f)
        for _ in range(3):
            try:
                os.link(tmp, path)  # atomic, and never through a link: fails if anything is at `path`
            except FileExistsError:
                owner = read_lock(path)
                why = lock_is_stale(path, owner, me)
                if why is None:
                    raise UserError(f"{out_dir} is in use by another run (pid {owner['pid']} on "
                                    f"{owner['host']}, since {owner.get('since', '?')}); "
                                    f"if that run has ended, delete {path}")
                print(f"note: taking over the stale lock {path}: {why}")
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
                continue
            HELD_LOCKS[me["token"]] = open(tmp, "rb")  # the same file as run.lock: its heartbeat handle
            threading.Thread(target=heartbeat, args=(me["token"],), daemon=True).start()
            return path, me["token"]
        raise UserError(f"could not take the lock {path}")
    except OSError as e:  # a read-only folder, no permission, a full disk: nothing was written
        raise files.os_error(e, path, "nothing was written; the folder is as it was") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)


def heartbeat(token):
    """Touch the held lock every LOCK_HEARTBEAT_S seconds until it is released (through its own open file:
    a link planted at run.lock meanwhile is never followed)."""
    while True:
        f = HELD_LOCKS.get(token)
        if f is None:
            return
        with contextlib.suppress(OSError, ValueError):
            os.utime(f.fileno())
        time.sleep(LOCK_HEARTBEAT_S)


def process_alive(pid, token):
    if pid == os.getpid():  # this process: alive, but the lock is stale unless a run in it still holds it
        return token in HELD_LOCKS
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, ValueError, TypeError, OverflowError):
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def unlock_run_folder(lock):
    if lock is None:
        return
    path, token = lock
    f = HELD_LOCKS.pop(token, None)
    if f is not None:
        f.close()
    owner = read_lock(path)
    if owner is not None and owner.get("token") == token:
        with contextlib.suppress(OSError):
            os.remove(path)


def environment(device):
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=os.path.dirname(os.path.abspath(__file__)),
                                  capture_output=True, text=True, timeout=10).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None

    import numpy
    import torchvision

    return {
        "git_hash": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "numpy": numpy.__version__,
        "device": mfu.device_name(device),
        "cpu_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
        "hostname": platform.node(),
        "argv": sys.argv,
    }


class OffTerminal:
    """Progress where tqdm draws nothing (output to a file: a batch job's log): due() is true once every
    EVERY_S seconds there, never on a terminal."""
    EVERY_S = 60

    def __init__(self):
        self.on, self.last = not sys.stdout.isatty(), time.time()

    def due(self):
        if not self.on or time.time() - self.last < self.EVERY_S:
            return False
        self.last = time.time()
        return True


def save_grid(images, path, kept=""):
    """images in [-1, 1], (B, C, H, W) -> a square PNG grid, created fresh; small images are enlarged to be
    visible. -> the grid, (C, H, W) in [0, 1]."""
    import torchvision

    x = (images.float() + 1) / 2
    if x.shape[-1] < 64:
        x = F.interpolate(x, scale_factor=64 // x.shape[-1], mode="nearest")
    from PIL import Image

    image_format = Image.registered_extensions().get(os.path.splitext(path)[1].lower(), "PNG")
    grid = torchvision.utils.make_grid(x, nrow=math.ceil(math.sqrt(len(x))), padding=2)
    with files.created(path, kept=kept) as f:
        torchvision.utils.save_image(grid, f, format=image_format)
    return grid.clamp(0, 1)


def plot_curves(out_dir):
    """loss.png from metrics.jsonl: the loss and its four timestep quartiles (none before the first row);
    and with evaluation rows, fid.png: FID against thousands of training images and against wall-clock
    hours (this session's, as wall_s)."""
    every = read_metrics(out_dir)[0]
    rows = [r for r in every if "loss" in r]  # not the evaluation rows
    evals = [r for r in every if isinstance(r.get("fid"), (int, float)) and "kimg" in r]
    if not rows:
        return
    try:
        import matplotlib
    except ImportError:  # a bare machine (e.g. a lent GPU box) may lack it: no plot, said once
        if not getattr(plot_curves, "warned", False):
            print("note: matplotlib is not installed; loss.png is not drawn (metrics.jsonl has the numbers)")
            plot_curves.warned = True
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def curve(key):  # a value a row lacks, or could not hold (NaN is logged as null), leaves a gap
        return [r[key] if isinstance(r.get(key), (int, float)) else float("nan") for r in rows]

    fig, ax = plt.subplots(figsize=(6, 4))
    steps = [r["step"] for r in rows]
    ax.plot(steps, curve("loss"), label="loss")
    for q in range(4):
        ax.plot(steps, curve(f"loss_q{q}"), lw=0.8, alpha=0.7, label=f"t quartile {q}")
    ax.set(xlabel="step", ylabel="loss", yscale="log", title="training loss")
    ax.legend(fontsize=7)
    figures = [(fig, "loss.png")]
    if evals:
        fig, axes = plt.subplots(1, 2, figsize=(8, 3.5), sharey=True)
        for ax, x, label in ((axes[0], "kimg", "thousand training images"), (axes[1], "wall_s", "hours")):
            scale = 3600 if x == "wall_s" else 1
            ax.plot([r[x] / scale for r in evals], [r["fid"] for r in evals], "o-")
            ax.set(xlabel=label, title=f"FID ({evals[-1].get('fid_samples')} samples, fixed noise)")
        axes[0].set(ylabel="FID")
        figures.append((fig, "fid.png"))
    try:
        for fig, name in figures:
            fig.tight_layout()
            with files.created(os.path.join(out_dir, name), kept=kept(out_dir)) as f:
                fig.savefig(f, format="png", dpi=100)
    finally:
        for fig, _ in figures:
            plt.close(fig)


# -----------------------------------------------------------------------------
# Trackers: TensorBoard and wandb see what metrics.jsonl records


class Trackers:
    """TensorBoard and/or wandb (TrainerConfig.log_to), on rank 0: every metrics row at its step (training
    rows under train/, evaluation rows under eval/), each sample grid as an image, and the config as
    hyperparameters. TensorBoard's event files live in the run folder, so `tensorboard --logdir runs/` shows
    one run per folder; the wandb run is named after the folder and keeps its id there (wandb-id; its files
    in <run>/wandb/start-*, a folder made at each start), so a resumed run continues the same curves:
    TensorBoard drops the events a crash left past the checkpoint (purge_step), wandb the steps it already
    has. A tracker that is not installed, or wandb with neither a
    login nor WANDB_MODE=offline, is one error line at start-up; one that fails mid-run is one warning and
    is dropped, and training goes on with metrics.jsonl complete."""

    def __init__(self, log_to, out_dir, config, step):
        self.tb = self.wandb = None
        kinds = check_trackers(log_to)
        if "tensorboard" in kinds:
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams

            # resumed at `step`: the events a crash left after that step's checkpoint are dropped. The event
            # file's name (time, host, pid) is guessable, and the writer opens it by name: a random suffix
            # makes one nobody can have planted a link or FIFO at
            self.tb = SummaryWriter(out_dir, purge_step=step + 1 if step else None,
                                    filename_suffix="." + os.urandom(8).hex())
            flat = flat_config(config)
            for summary in hparams(flat, {}):
                self.tb.file_writer.add_summary(summary)
            self.tb.add_text("config", "    " + json.dumps(config, indent=2).replace("\n", "\n    "), step)
        if "wandb" in kinds:
            self.wandb = start_wandb(out_dir, config)

    def log(self, row):
        step, prefix = row["step"], "train/" if "loss" in row else "eval/"
        scalars = {prefix + k: v for k, v in row.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        self._each("tb", lambda tb: [tb.add_scalar(k, v, step) for k, v in scalars.items()] and tb.flush())
        self._each("wandb", lambda wb: wb.log(scalars, step=step))

    def image(self, grid, step):
        """grid: (3, H, W) in [0, 1], as save_grid returns it."""
        self._each("tb", lambda tb: tb.add_image("samples", grid, step) or tb.flush())
        self._each("wandb", lambda wb: wb.log({"samples": wb_image(grid)}, step=step))

    def close(self):
        self._each("tb", lambda tb: tb.close())
        self._each("wandb", lambda wb: wb.finish())

    def _each(self, name, call):
        tracker = getattr(self, name)
        if tracker is None:
            return
        try:
            call(tracker)
        except Exception as e:  # a full disk, a network gone: the run goes on without this tracker
            print(f"warning: {'TensorBoard' if name == 'tb' else 'wandb'} failed ({type(e).__name__}: "
                  f"{first_line(e)}); training goes on, metrics.jsonl is complete, and it logs nothing more")
            setattr(self, name, None)


def flat_config(config):
    """{'model/image_size': 32, ...}: the configs' fields as hyperparameters (tuples as text)."""
    return {f"{part}/{k}": v if isinstance(v, (int, float, str, bool)) else str(v)
            for part in ("model", "trainer") for k, v in config[part].items()}


def check_trackers(log_to):
    """Before the run folder is made: a tracker that is not installed, or wandb with neither a login nor
    WANDB_MODE=offline, is one UserError line. -> the trackers asked for."""
    kinds = [] if log_to == "none" else log_to.split(",")
    if "tensorboard" in kinds:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError:
            raise UserError("--log_to=tensorboard: the tensorboard package is not installed "
                            "(pip install tensorboard; make setup installs it)") from None
    if "wandb" in kinds:
        try:
            import wandb
        except ImportError:
            raise UserError("--log_to=wandb: the wandb package is not installed "
                            "(pip install wandb)") from None
        offline = os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun")
        if not offline and not (os.environ.get("WANDB_API_KEY") or wandb_logged_in(wandb)):
            raise UserError("--log_to=wandb: not logged in to wandb: run `wandb login`, or set "
                            "WANDB_MODE=offline to write the run to the run folder and `wandb sync` it later")
    return kinds


def start_wandb(out_dir, config):
    """The wandb run of this folder: its id kept in <run>/wandb-id (read from a regular file only, never
    through a link, and only as an id this program makes; else a new one), its files in a folder made fresh
    for this start inside <run>/wandb (no name there can have been planted before)."""
    import wandb

    id_path, run_id = os.path.join(out_dir, "wandb-id"), None
    with contextlib.suppress(OSError, UnicodeDecodeError):
        with files.open_regular(id_path, follow=False) as f:
            run_id = f.read(64).decode().strip()
    if run_id is None or not (len(run_id) == 16 and set(run_id) <= set("0123456789abcdef")):  # not ours
        run_id = os.urandom(8).hex()
        with files.created(id_path, "w") as f:
            f.write(run_id + "\n")
    folder = files.fresh_folder(files.own_folder(os.path.join(out_dir, "wandb")), "start-")
    return wandb.init(project=os.environ.get("WANDB_PROJECT", "ddpm"), name=os.path.basename(
        os.path.abspath(out_dir)), id=run_id, resume="allow", dir=folder, config=flat_config(config))


def wandb_logged_in(wandb):
    try:
        return bool(wandb.api.api_key)
    except Exception:
        return False


def wb_image(grid):
    import wandb

    return wandb.Image((grid.permute(1, 2, 0) * 255).round().byte().numpy())


# -----------------------------------------------------------------------------
# The loop's companions: the log interval's tallies on the device, and preemption


class Tally:
    """One log interval's loss sums and skipped steps, accumulated on the device: no host sync per step."""

    def __init__(self, device):
        # [loss, steps, 4 x loss per t quartile, 4 x samples per quartile]
        self.sums = torch.zeros(10, device=device)
        self.loss, self.steps, self.q_loss, self.q_count = (self.sums[0], self.sums[1], self.sums[2:6],
                                                            self.sums[6:10])
        self.skipped = torch.zeros((), device=device)  # steps skipped in this interval
        self.run = torch.zeros((), device=device)  # the current run of skipped steps
        self.longest = torch.zeros((), device=device)  # the longest run in this interval

    def add(self, loss, losses, quartile, ok):
        good = ok > 0  # torch.where, not x * ok: a skipped step's NaN x 0 would still be NaN
        self.loss += torch.where(good, loss, 0.0)
        self.steps += ok
        self.q_loss.index_add_(0, quartile, torch.where(good, losses, 0.0))
        self.q_count.index_add_(0, quartile, torch.ones_like(losses) * ok)
        self.skipped += 1 - ok
        self.run.mul_(1 - ok).add_(1 - ok)  # +1 on a skip, back to 0 on an applied step
        torch.maximum(self.longest, self.run, out=self.longest)

    def read(self, world):
        """-> the interval's means and counts (a host sync), and starts the next interval. The longest run of
        skips carries over: a run that spans two intervals is counted whole."""
        if world > 1:
            torch.distributed.all_reduce(self.sums)
        s, skipped, longest = self.sums.tolist(), int(self.skipped.item()), int(self.longest.item())
        out = {"loss": s[0] / s[1] if s[1] else None, "skipped": skipped, "longest_run": longest,
               "loss_q": [s[2 + q] / s[6 + q] if s[6 + q] else None for q in range(4)]}
        self.sums.zero_()
        self.skipped.zero_()
        self.longest.copy_(self.run)
        return out


class Preemption:
    """SIGTERM or SIGINT asks the run to stop: the current step finishes, a checkpoint is written, and
    train() returns. Under DDP the ranks agree through an asynchronous all-reduce on a gloo group
    (host memory: no GPU sync), read one step later, so all of them stop after the same step."""

    def __init__(self, world):
        self.signal, self.work, self.previous = None, None, {}
        # Python delivers signals to the main thread only
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        self.group = torch.distributed.new_group(backend="gloo") if world > 1 else None

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.signal == "SIGINT":
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the checkpoint
        self.signal = signal.Signals(signum).name

    def requested(self):
        if self.group is None:
            return self.signal is not None
        agreed = False
        if self.work is not None:
            self.work.wait()
            agreed = bool(self.flag.item())
        self.flag = torch.tensor([float(self.signal is not None)])
        self.work = torch.distributed.all_reduce(self.flag, op=torch.distributed.ReduceOp.MAX,
                                                 group=self.group, async_op=True)
        if agreed and self.signal is None:
            self.signal = "a signal to another rank"
        return agreed

    def close(self):
        if self.work is not None:
            self.work.wait()
        for s, handler in self.previous.items():
            signal.signal(s, handler)

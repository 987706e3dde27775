"""The efficiency ladder: the training step that ddpm.py runs, timed row by row, one optimisation added per
row, with its counted FLOPs and MFU (benchmark.py prints it; its docstring lists the rows).

    lad = Ladder(args, mc, device, ...); run_rows(lad); print_ladder(lad)   # ladder(args, mc, device)
"""
import argparse
import dataclasses
import datetime
import gc
import itertools
import json
import statistics

import torch

import data
import ddpm
from machinery import beton, errors, files, mfu
from unet import UNet

# -----------------------------------------------------------------------------
# The baseline's loader: a typical torch DataLoader with per-sample transforms


def TYPICAL_TRANSFORM():
    """The per-sample augmentation a typical torchvision pipeline applies."""
    import torchvision.transforms as T

    return T.Compose([T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize((0.5,) * 3, (0.5,) * 3)])


class InMemoryPIL(torch.utils.data.Dataset):
    """uint8 arrays in memory, one PIL image and transform per sample: what torchvision.datasets.CIFAR10
    does."""

    def __init__(self, images, labels):
        self.x, self.y = images.permute(0, 2, 3, 1).numpy(), labels.tolist()
        self.transform = TYPICAL_TRANSFORM()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        from PIL import Image

        return self.transform(Image.fromarray(self.x[i])), self.y[i]


class DataLoaderAdapter:
    """A typical torch DataLoader (shuffle, per-sample transforms, workers, pinned memory) behind the
    loaders' next() interface: the baseline of benchmark.py."""

    def __init__(self, images, labels, batch_size, device, with_labels=False, num_workers=2):
        self.device, self.with_labels, self.n = torch.device(device), with_labels, len(images)
        self.dl = torch.utils.data.DataLoader(InMemoryPIL(images, labels), batch_size=batch_size,
                                              shuffle=True, num_workers=num_workers, drop_last=True,
                                              pin_memory=self.device.type == "cuda",
                                              persistent_workers=num_workers > 0)
        self.it = iter(self.dl)

    def next(self):
        try:
            x, y = next(self.it)
        except StopIteration:
            self.it = iter(self.dl)
            x, y = next(self.it)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        return x, (y if self.with_labels else None)


# -----------------------------------------------------------------------------
# The ladder


def repatched(mc, patch_size):
    """The preset at another patch size Q, attending over the same image regions: its attention resolutions
    refer to its own patched grid (patch size P), where a region r positions wide spans r * P / Q at Q."""
    attn = tuple(r * mc.patch_size // patch_size for r in mc.attn_resolutions)
    return dataclasses.replace(mc, patch_size=patch_size, attn_resolutions=attn)


# (name, the change it makes to the row above); batch "max" searches the largest batch that fits (GPU).
# A row marked alone=True changes the last cumulative row for itself only: the next row builds on what was
# there before it.
LADDER = [
    ("baseline", dict(precision="fp32", compile=False, compile_mode="default", attention="math",
                      channels_last=False, loader="dataloader", batch="base", accum_steps=1,
                      checkpointing=False, norm_kernel="torch")),
    ("scale up batch", dict(batch="max")),
    ("PyTorch SDPA", dict(attention="sdpa", batch="max")),
    ("bf16 autocast", dict(precision="bf16", batch="max")),
    ("channels_last", dict(channels_last=True)),
    # after the eager changes: every compiled row compiles anew, so the first one compiles the settings
    # the later rows build on, and the eager rows cost no compilation
    ("torch.compile", dict(compile=True)),
    ("FFCV loading", dict(loader="ffcv")),
    ("device-resident data", dict(loader="resident")),  # the whole dataset on the device, against FFCV above
    ("compile max-autotune", dict(compile_mode="max-autotune")),
    ("CUDA graphs", dict(compile_mode="reduce-overhead")),  # replaces max-autotune (or adds to default)
    # each GroupNorm-SiLU pair as one hand-written Triton kernel each way, in place of inductor's (issue 51)
    ("fused GroupNorm+SiLU (Triton)", dict(norm_kernel="triton")),
    # for GPUs without bf16 (V100, T4, P100): fp16 autocast with the dynamic loss scaler
    ("fp16 autocast", dict(precision="fp16", alone=True)),
    ("grad accumulation x4", dict(accum_steps=4, alone=True)),  # the same batch, as 4 micro-batches
    ("activation checkpointing", dict(checkpointing=True, alone=True)),  # the same batch, blocks recomputed
    ("checkpointing at the largest batch", dict(checkpointing=True, batch="max", alone=True)),
    ("patch_size P", dict(patch_size="P")),  # P = --patch_size; same width and batch as the row above
    # the paper's memory claim: against the largest batch at the preset's own P (the rows above it)
    ("patch_size P at the largest batch", dict(patch_size="P", batch="max", alone=True)),
]


def row_config(row, batch):
    """A row's settings as the TrainerConfig `python ddpm.py` would train with: explicit, never 'auto'."""
    flag = lambda on: "true" if on else "false"  # noqa: E731
    return ddpm.TrainerConfig(batch_size=batch, grad_accum_steps=row["accum_steps"],
                              precision=row["precision"], compile=flag(row["compile"]),
                              compile_mode=row["compile_mode"], channels_last=flag(row["channels_last"]),
                              attention=row["attention"], activation_checkpointing=row["checkpointing"],
                              norm_kernel=row["norm_kernel"])


def row_loader(mc, row, batch, device, images, labels, beton):
    """The row's loader: the baseline's typical DataLoader, host memory, the device, or FFCV (`beton`)."""
    with_labels = mc.num_classes > 0
    if row["loader"] == "dataloader":
        return DataLoaderAdapter(images, labels, batch, device, with_labels)
    if row["loader"] == "host":  # batches gathered from the uint8 images in host memory (the batch search)
        return data.Loader(images, labels, batch, 0, device, with_labels=with_labels)
    if row["loader"] == "resident":
        return data.ResidentLoader(images, labels, batch, 0, device, with_labels=with_labels)
    return data.FFCVLoader(beton, batch, 0, device, with_labels=with_labels)


def build(mc, row, batch, device, images, labels, beton):
    """-> (TrainerConfig, ddpm.Built, loader) for one row: the row's settings as a TrainerConfig, and the
    model, EMA, optimizer, loss scaler and forward from ddpm.build, exactly as ddpm.train sets them up (the
    same seeded weights in every row)."""
    tc = row_config(row, batch)
    torch.manual_seed(0)
    built = ddpm.build(mc, tc, device)
    return tc, built, row_loader(mc, row, batch, device, images, labels, beton)


def time_steps(mc, row, batch, device, images, labels, beton, warmup, iters, profile=False):
    """Median ms of one training iteration (data + train_step + EMA), the peak memory in GB, and with
    `profile` where the time of three more iterations goes (mfu.kernel_profile; else None)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tc, b, loader = build(mc, row, batch, device, images, labels, beton)
    timer = mfu.StepTimer(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    steps = itertools.count()

    def step():  # exactly what train() runs: the step's LR, train_step, the EMA at its warm-up decay
        x0, y = loader.next()
        ddpm.iteration(b, x0, y, tc, next(steps))

    # the SDPA rows may use the fused kernels only (flash, or memory-efficient), never SDPA's math fallback
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        for i in range(warmup + iters):
            if i >= warmup:
                timer.start()
            step()
            if i >= warmup:
                timer.stop()
        ms = statistics.median(timer.read_ms())  # note: a sync point
        mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        return ms, mem, mfu.kernel_profile(step, device) if profile else None


def free_memory(device):
    # a fresh dynamo cache for every row: no recompile limit reached across rows, no batch size marked
    # dynamic because an earlier row compiled another one, no CUDA-graph pools kept (compiled kernels stay
    # cached)
    torch.compiler.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def largest_batch(mc, row, device, images, labels, start, limit):
    """The largest power-of-two batch (from `start`, at most `limit`) whose eager step fits in memory."""
    best, batch = None, start
    # memory is the model's: batches gathered from host memory, which hold no device memory of their own
    eager = {**row, "compile": False, "loader": "host"}
    while batch <= limit:
        if len(images) < 2 * batch:  # a warm-up and a timed step, each a full batch
            images, labels, _ = data.shapes(2 * batch, mc.image_size)
        try:
            time_steps(mc, eager, batch, device, images, labels, None, warmup=1, iters=1)
            best, batch = batch, batch * 2
        except torch.cuda.OutOfMemoryError:
            break
        finally:
            free_memory(device)
    if best is None:
        raise RuntimeError(f"even batch {start} does not fit in memory")
    return best


@dataclasses.dataclass
class Ladder:
    """What the rows share: the command line's settings, the images they train on, what the measured rows
    carry on to the rows below them, and the rows so far."""
    args: argparse.Namespace
    mc: ddpm.ModelConfig           # the preset, with the command line's ModelConfig fields
    device: torch.device
    device_name: str               # what the rows are labelled with (mfu.device_name)
    base_batch: int                # the baseline's batch
    iters: int                     # timed iterations per row
    warmup: int                    # untimed iterations before them (compilation included)
    skip: set                      # the names of the rows not to run: --skip's, and those --rows leaves out
    only: set                      # --rows: the names to run; empty = all
    images: torch.Tensor           # uint8 shapes at the preset's resolution; more when a batch outgrows them
    labels: torch.Tensor
    # the cumulative settings: a skipped baseline still gives every later row its starting point
    cfg: dict = dataclasses.field(default_factory=lambda: dict(LADDER[0][1]))
    scaled_batch: int = None       # the batch the last searched (or --batch) row carried on
    scaled_by: str = None          # that row's name
    rows: list = dataclasses.field(default_factory=list)

    @property
    def gpu(self):
        return self.device.type == "cuda"


def row_names(args):
    """-> (the names of the rows not to run: --skip's and those --rows leaves out; --rows's names). The
    patched rows are named with --patch_size; an unknown name in --rows or --skip is refused."""
    names = [name.replace("patch_size P", f"patch_size {args.patch_size}") for name, _ in LADDER]
    skip, only = ({s.strip() for s in spec.split(",") if s.strip()} for spec in (args.skip, args.rows))
    unknown = (skip | only | ({args.start} if args.start else set())) - set(names)
    if unknown:
        raise errors.UserError(f"no ladder row is called {', '.join(sorted(unknown))}; "
                               f"the rows: {', '.join(names)}")
    return skip | (set(names) - only if only else set()), only


def skip_reason(lad, name, change, trial, given=False):
    """Why the row `name` (its `change`; `trial`, the settings it would run with) is not run here, or
    None. given: the row is above --start, its settings to be taken without running it (--rows and --skip
    do not apply)."""
    if name in lad.skip and not given:
        return "not in --rows" if lad.only and name not in lad.only else "skipped by --skip"
    if trial["loader"] == "ffcv" and not beton.ffcv_available():
        return "ffcv is not installed"
    if trial["precision"] == "bf16" and not (lad.gpu and torch.cuda.is_bf16_supported()) and not (
            lad.device.type == "cpu" and mfu.cpu_has_bf16()):
        return "no bf16 hardware on this device"
    if trial["compile"] and not lad.gpu and not lad.args.cpu_compile:
        return "compiling takes minutes on the CPU; --cpu_compile includes it"
    if name == "compile max-autotune" and not lad.args.autotune:
        return "its kernel search takes many minutes; --autotune includes it"
    if trial["compile_mode"] == "reduce-overhead" and not lad.gpu:
        return "CUDA graphs need a GPU"
    if trial["compile_mode"] != "default" and not trial["compile"]:
        return "needs the torch.compile row"
    if trial["norm_kernel"] == "triton" and not lad.gpu:
        return "the fused Triton kernel runs on CUDA devices only"
    if trial["precision"] == "fp16" and not lad.gpu:
        return "fp16 is for GPUs without bf16; a CPU emulates it (7x slower than bf16 here)"
    if change.get("alone") and change.get("batch") == "max" and not lad.gpu:
        return "the largest-batch search needs a GPU (it stops at the first out-of-memory error)"
    if trial["accum_steps"] > 1 and (lad.scaled_batch or lad.base_batch) % trial["accum_steps"]:
        return f"the batch does not split into {trial['accum_steps']} micro-batches"
    return None


def invalid(mc_row, mc):
    """Why the row's repatched model cannot exist (ddpm.validate's message), or None."""
    if mc_row.patch_size == mc.patch_size:
        return None
    try:
        ddpm.validate(mc_row, ddpm.TrainerConfig())
    except errors.UserError as e:
        return str(e)
    return None


def row_batch(lad, change, trial, mc_row):
    """The row's batch: the baseline's, a searched largest batch (or --batch), or the one carried on."""
    if trial["batch"] == "base":
        return lad.base_batch
    if change.get("batch") == "max":
        if change.get("alone") or (lad.gpu and not lad.args.batch):  # searched; a one-off row ignores --batch
            return largest_batch(mc_row, trial, lad.device, lad.images, lad.labels, lad.base_batch,
                                 lad.args.max_batch)
        return lad.args.batch or 2 * lad.base_batch
    return lad.scaled_batch or lad.base_batch  # (the scaling row may have been skipped)


def row_beton(lad, trial, batch):
    """Enough images for the row's iterations (drawn afresh when its batch outgrows them), and for the FFCV
    row the same images as a beton, written once per size and reused; None for the other loaders."""
    if len(lad.images) < batch * (lad.warmup + lad.iters):
        lad.images, lad.labels, _ = data.shapes(batch * (lad.warmup + lad.iters), lad.mc.image_size)
    if trial["loader"] != "ffcv":
        return None
    beton, _ = data.beton_for("shapes", "", lad.mc.image_size, data.BETON_DIR, shapes_count=len(lad.images))
    return beton


def measured_row(lad, name, trial, mc_row, batch, ms, mem):
    """A measured row's JSON: its settings, speed, counted TFLOP/s and MFU against both peaks."""
    flops = mfu.train_flops_per_image(UNet, mc_row) * batch
    info = torchinfo_flops_per_image(mc_row)
    dtype = mfu.AUTOCAST_DTYPES.get(trial["precision"], torch.float32)
    sheet = mfu.datasheet_peak(lad.device, trial["precision"])
    measured = mfu.measure_matmul_flops(lad.device, dtype)
    return {"version": name, "batch": batch, "precision": trial["precision"],
            "compile": trial["compile"], "compile_mode": trial["compile_mode"],
            "attention": trial["attention"], "channels_last": trial["channels_last"],
            "loader": trial["loader"], "accum_steps": trial["accum_steps"],
            "activation_checkpointing": trial["checkpointing"], "norm_kernel": trial["norm_kernel"],
            "patch_size": mc_row.patch_size,
            "step_ms": ms, "img_per_s": batch / ms * 1e3, "tflops": flops / ms / 1e9,
            "tflops_torchinfo_x3": info * batch / ms / 1e9 if info else None,
            "mfu_datasheet": mfu.mfu(flops, ms / 1e3, sheet) if sheet else None,
            "datasheet_peak_tflops": sheet / 1e12 if sheet else None,
            "mfu_measured": mfu.mfu(flops, ms / 1e3, measured),
            "measured_peak_tflops": measured / 1e12, "peak_mem_gb": mem}


def run_row(lad, name, change):
    """One row: skipped with its reason, or measured and saved. A failed row adds nothing, as a skipped one;
    a measured row that is not `alone` carries its settings, and a batch it searched, on to the rows below."""
    trial = {**lad.cfg, **{k: v for k, v in change.items() if k != "alone"}}
    mc_row = repatched(lad.mc, lad.args.patch_size) if "patch_size" in trial else lad.mc
    reason = skip_reason(lad, name, change, trial) or invalid(mc_row, lad.mc)
    if not reason:
        try:
            batch = row_batch(lad, change, trial, mc_row)
            beton = row_beton(lad, trial, batch)
            ms, mem, prof = time_steps(mc_row, trial, batch, lad.device, lad.images, lad.labels, beton,
                                       lad.warmup, lad.iters, lad.args.profile)
        # e.g. a compile mode this torch cannot do here
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            reason = f"failed: {type(e).__name__}: {errors.first_line(e)[:200]}"
        free_memory(lad.device)
    if reason:
        print(f"{name}: {reason}")
        lad.rows.append({"version": name, "skipped": reason})
        return
    if not change.get("alone"):
        lad.cfg = trial
        if change.get("batch") == "max":
            lad.scaled_batch, lad.scaled_by = batch, name
    row = measured_row(lad, name, trial, mc_row, batch, ms, mem)
    lad.rows.append(row)
    print(f"{name}: batch {batch}, {ms:.1f} ms/step, {row['img_per_s']:.1f} img/s, "
          f"{row['tflops']:.3f} TFLOP/s", flush=True)
    if prof:
        row["profile"] = prof
        print(f"  {mfu.profile_line(prof)}", flush=True)
    save_ladder(lad)  # after every row, so a run cut short by a time limit keeps what it measured


def take_as_given(lad, name, change):
    """A row above --start: not run, but its settings carried on as a measured row's would be (not those
    of a row that varies alone, nor one this device cannot run)."""
    trial = {**lad.cfg, **{k: v for k, v in change.items() if k != "alone"}}
    reason = "varies its row alone" if change.get("alone") else skip_reason(lad, name, change, trial, True)
    if not reason:
        lad.cfg = trial
        if change.get("batch") == "max" and lad.args.batch:
            lad.scaled_batch = lad.args.batch  # not searched: no scaled_by, no "largest batch" line
    given = reason or "its settings taken as given"
    lad.rows.append({"version": name, "skipped": f"above --start ({given})"})


def run_rows(lad):
    """Every row of LADDER in turn, into lad.rows. -> whether it was cut short (Ctrl-C, or `timeout -s INT`):
    the rows measured before it stay."""
    name, started = None, not lad.args.start
    try:
        for name, change in LADDER:
            name = name.replace("patch_size P", f"patch_size {lad.args.patch_size}")
            started = started or name == lad.args.start
            if started:
                run_row(lad, name, change)
            else:
                take_as_given(lad, name, change)
    except KeyboardInterrupt:
        print(f"\ninterrupted in the row {name!r}: the table has the rows before it")
        return True
    return False


def save_ladder(lad):
    """Each measured row's speedup over the first measured one; the rows to --json, if given."""
    measured = [r for r in lad.rows if "skipped" not in r]
    for r in measured:
        r["speedup"] = r["tflops"] / measured[0]["tflops"]
    if lad.args.json:
        with files.created(lad.args.json, "w") as f:
            json.dump({"preset": lad.args.preset, "device": lad.device_name, "torch": torch.__version__,
                       "date": str(datetime.date.today()), "iters": lad.iters, "warmup": lad.warmup,
                       "rows": lad.rows}, f, indent=2)


def print_ladder(lad):
    """The table of the rows, and the largest batches that fit."""
    print("\nMFU (datasheet): fp32 rows against the plain fp32 peak (TF32 off), bf16 rows against the dense "
          "bf16 peak; MFU (measured matmul): against the best square-matmul rate measured here in the row's "
          "dtype.")
    print("\n| version | batch | ms/step | img/s | TFLOP/s | TFLOP/s (torchinfo x3) | speedup | "
          "MFU (datasheet) | MFU (measured matmul) | peak mem |\n|---|---|---|---|---|---|---|---|---|---|")
    pct = lambda v: f"{100 * v:.2f}%" if v is not None else "n/a"  # noqa: E731
    for r in lad.rows:
        if "skipped" in r:
            print(f"| {r['version']} | skipped: {r['skipped']} | | | | | | | | |")
            continue
        info = f"{r['tflops_torchinfo_x3']:.3f}" if r["tflops_torchinfo_x3"] else "n/a"
        mem = f"{r['peak_mem_gb']:.1f} GB" if r["peak_mem_gb"] is not None else "n/a"
        print(f"| {r['version']} | {r['batch']} | {r['step_ms']:.1f} | {r['img_per_s']:.1f} | "
              f"{r['tflops']:.3f} | {info} | {r['speedup']:.2f}x | {pct(r['mfu_datasheet'])} | "
              f"{pct(r['mfu_measured'])} | {mem} |")
    fits = [r for r in lad.rows if "skipped" not in r and r["version"].endswith("largest batch")]
    if fits and lad.scaled_by:  # the memory checkpointing and patching save, as the batch they let fit
        print(f"\nLargest batch that fits (powers of two, eager step): {lad.scaled_batch} at P = "
              f"{lad.mc.patch_size} (row '{lad.scaled_by}')"
              + "".join(f"; {r['batch']} with '{r['version']}' ({r['batch'] / lad.scaled_batch:.3g}x)"
                        for r in fits))


def ladder(args, mc, device):
    """The ladder on the device: every row measured or skipped (saved to --json after each measured row),
    then the table. -> (rows, whether it was cut short)."""
    gpu = device.type == "cuda"
    base_batch = args.base_batch or (128 if gpu else 4)
    iters, warmup = args.iters or (50 if gpu else 3), args.warmup or (10 if gpu else 1)
    skip, only = row_names(args)
    # the data: the built-in shapes at the preset's resolution, in memory and as a beton
    images, labels, _ = data.shapes(max(4096, 4 * base_batch), mc.image_size)
    lad = Ladder(args, mc, device, mfu.device_name(device), base_batch, iters, warmup, skip, only, images,
                 labels)
    print(f"# {args.preset} on {lad.device_name}, torch {torch.__version__}, {datetime.date.today()}\n")
    interrupted = run_rows(lad)
    save_ladder(lad)
    print_ladder(lad)
    return lad.rows, interrupted


@torch.random.fork_rng(devices=[])  # building a model must not move the training RNG (exact resume)
def torchinfo_flops_per_image(mc):
    """The reference repo's estimate: torchinfo's forward mult-adds x 2 FLOPs x 3 (forward + backward).
    It sees only nn.Module layers, so it misses the attention matmuls: shown beside the count above.
    None when torchinfo is not installed."""
    try:
        import torchinfo
    except ImportError:
        return None

    model = UNet(mc)
    x = torch.zeros(1, mc.channels, mc.image_size, mc.image_size)
    stats = torchinfo.summary(model, input_data=[x, torch.zeros(1, dtype=torch.long)], verbose=0,
                              device="cpu")
    return stats.total_mult_adds * 2 * 3

"""Counted FLOPs and the hardware they are measured against: MFU's numerator and denominator, and the clock.

FLOPs are counted, not estimated: torch.utils.flop_counter sees every matmul, convolution and attention call
(a multiply-add counts as 2 FLOPs), on the meta device at batch 1. The peak is the datasheet's for known GPUs
and elsewhere the best square-matmul rate this machine has shown (remembered in PEAK_CACHE, so a start-up
under load cannot inflate MFU). StepTimer times without syncing (CUDA events on a GPU), and
keep_freed_memory is the allocator setting every CPU step runs under.
"""
import json
import math
import os
import platform
import time

import torch

from machinery import files
from machinery.errors import first_line

# the best matmul rate measured on each machine (CPU model, threads, torch, dtype): a folder of this program's
PEAK_CACHE = os.environ.get("DDPM_PEAK_CACHE") or os.path.join(
    os.path.expanduser(os.environ.get("XDG_CACHE_HOME") or "~/.cache"), "ddpm", "matmul_peaks.json")

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # the precisions that run under autocast


# Dense peak FLOP/s by precision, from the vendors' datasheets (no sparsity). 'fp32' is the
# non-tensor-core rate, 'tf32' the tensor-core rate with fp32 inputs. Matched by name, in order.
PEAK_FLOPS = [
    ("H200", {"bf16": 989e12, "fp16": 989e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12}),
    ("H100", {"bf16": 989e12, "fp16": 989e12, "tf32": 494.7e12, "fp32": 66.9e12}),  # SXM
    ("A100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    # SXM2; no bf16 and no TF32 ('tf32' is its plain fp32 rate), as on the T4 and P100
    ("V100", {"fp16": 125e12, "tf32": 15.7e12, "fp32": 15.7e12}),
    ("T4", {"fp16": 65e12, "tf32": 8.1e12, "fp32": 8.1e12}),
    ("P100", {"fp16": 21.2e12, "tf32": 10.6e12, "fp32": 10.6e12}),  # SXM2
]


def datasheet_peak(device, precision):
    """Datasheet peak FLOP/s of a CUDA device at `precision`, or None when the device is not in the table."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peaks.get(precision) for key, peaks in PEAK_FLOPS if key in name), None)


_matmul_cache = {}


def measure_matmul_flops(device, dtype):
    """The best FLOP/s of square matmuls in `dtype` on `device`: the practical peak MFU is measured against.

    The size grows until one matmul takes >= 50 ms (or n = 8192), so slow paths stay quick to measure.
    The best of two sweeps: on a shared machine one sweep can land in a slow spell, which would inflate
    every MFU figure of the run.
    """
    key = (str(device), dtype)
    if key not in _matmul_cache:
        measured = max(time_matmuls(device, dtype) for _ in range(2))
        _matmul_cache[key] = remembered_best(f"{device_name(device)}|{torch.get_num_threads()} threads|"
                                             f"torch {torch.__version__}|{dtype}", measured)
    return _matmul_cache[key]


def remembered_best(machine, measured):
    """max(measured, the best remembered for `machine` in PEAK_CACHE), remembered in turn. The file is read
    only when it is a regular file of at most 1 MiB holding {name: FLOP/s}; anything else is said in one
    warning line and replaced."""
    peaks = {}
    try:
        with files.open_regular(PEAK_CACHE) as f:
            peaks = json.loads(f.read(2**20 + 1))
        if not (isinstance(peaks, dict) and all(type(v) is float and math.isfinite(v) and v > 0
                                                for v in peaks.values())):
            raise ValueError("not {machine: FLOP/s}")
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as e:
        print(f"warning: {PEAK_CACHE} is not a table of peaks ({type(e).__name__}); it is written anew")
        peaks = {}
    best = max(measured, peaks.get(machine, 0.0))
    if best > peaks.get(machine, 0.0):
        try:
            files.own_folder(os.path.dirname(PEAK_CACHE))
            with files.created(PEAK_CACHE, "w") as f:
                json.dump({**peaks, machine: best}, f, indent=1)
        except Exception as e:  # remembering is a help, never a reason to stop: said, and MFU stands
            print(f"warning: cannot remember the CPU peak in {PEAK_CACHE} ({first_line(e)})")
    return best


def time_matmuls(device, dtype):
    """One sweep of growing square matmuls -> the best FLOP/s it saw."""
    g = torch.Generator(device).manual_seed(0)  # its own generator: measuring never moves the training RNG
    n, best = 256, 0.0
    while True:
        a, b = (torch.randn(n, n, device=device, generator=g).to(dtype) for _ in range(2))
        timer = StepTimer(device)
        for _ in range(5):
            timer.start()
            a @ b
            timer.stop()
        sec = min(timer.read_ms()[1:]) / 1e3  # the first call is warm-up
        best = max(best, 2 * n**3 / sec)
        if sec >= 0.05 or n >= 8192:
            return best
        n *= 2


def cpu_has_bf16():
    """True where bf16 matmuls run on hardware (AVX512-BF16 or AMX); elsewhere they are emulated, ~100x
    slower."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def peak_flops(device, precision):
    """-> (peak FLOP/s, where it came from). CUDA: the datasheet (measured when the device is unknown);
    CPU: the measured matmul rate in the compute dtype."""
    peak = datasheet_peak(device, precision)
    if peak is not None:
        return peak, f"datasheet {torch.cuda.get_device_name(device)} {precision}"
    dtype = AUTOCAST_DTYPES.get(precision, torch.float32)
    return measure_matmul_flops(device, dtype), f"the best {dtype} matmul measured on this {device.type}"


def train_flops_per_image(network, mc, attention="sdpa"):
    """FLOPs of one training image through network(mc) (the UNet class), forward + backward, counted by
    torch.utils.flop_counter.

    Counted on the meta device (no memory, no compute) at batch 1; every op in the UNet is
    linear in the batch, so a step costs batch_size times this.
    """
    return counted_flops(network, mc, attention, backward=True)


def forward_flops_per_image(network, mc, attention="sdpa"):
    """FLOPs of one network evaluation of one image (a sampler step), counted as train_flops_per_image."""
    return counted_flops(network, mc, attention, backward=False)


def counted_flops(network, mc, attention, backward):
    """FLOPs of one image through network(mc) on the meta device, with or without the backward."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = network(mc, attention=attention)
        x = torch.zeros(1, mc.channels, mc.image_size, mc.image_size)
        t = torch.zeros(1, dtype=torch.long)
        y = torch.zeros(1, dtype=torch.long) if mc.num_classes > 0 else None
    with FlopCounterMode(display=False) as counter:
        out = model(x, t, y)
        if backward:
            out.sum().backward()
    return counter.get_total_flops()


def training_bytes(network, mc, batch, precision="fp32", activation_checkpointing=False):
    """A lower bound on one training step's memory with network(mc) (the UNet class): -> (parameters,
    bytes). Five fp32 copies of the weights (the weights, their gradients, AdamW's two moments, the EMA: 20
    bytes a parameter) and, without activation checkpointing, every convolution's output for `batch` images
    kept once for the backward pass (2 bytes an element under bf16/fp16 autocast, else 4). Counted on the
    meta device: nothing is allocated."""
    outputs = []
    with torch.device("meta"):
        model = network(mc)
        x = torch.zeros(1, mc.channels, mc.image_size, mc.image_size)
        t = torch.zeros(1, dtype=torch.long)
        y = torch.zeros(1, dtype=torch.long) if mc.num_classes > 0 else None
        hooks = [m.register_forward_hook(lambda m, i, o: outputs.append(o.numel()))
                 for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
        with torch.no_grad():
            model(x, t, y)
    for h in hooks:
        h.remove()
    params = sum(p.numel() for p in model.parameters())
    element = 2 if precision in AUTOCAST_DTYPES else 4
    activations = 0 if activation_checkpointing else sum(outputs) * batch * element
    return params, 20 * params + activations


def memory_bytes(device):
    """The device's memory: a GPU's total, or the host's physical memory for the CPU (None where unknown)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def mfu(flops_per_step, step_seconds, peak):
    """Model FLOPs utilisation = (FLOPs per step / seconds per step) / peak FLOP/s.

    FLOPs per step = batch_size x train_flops_per_image (forward + backward, attention included).
    """
    return flops_per_step / step_seconds / peak


def process_seconds():
    """Wall-clock seconds since this process started, its interpreter start and imports included (Linux:
    /proc/self/stat's start time against /proc/uptime, both since boot); None where there is no /proc."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command's name
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


class StepTimer:
    """Times code between start() and stop() without syncing: CUDA events on a GPU,
    perf_counter elsewhere (CPU ops are synchronous). read_ms() is the sync point."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.pending = []

    def start(self):
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self):
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pending.append((self._start, end))
        else:
            self.pending.append((time.perf_counter() - self._start) * 1e3)

    def read_ms(self):
        """Milliseconds of every start/stop pair since the last read. Note: a CPU-GPU sync point."""
        if self.cuda:
            torch.cuda.synchronize()
            out = [s.elapsed_time(e) for s, e in self.pending]
        else:
            out = self.pending
        self.pending = []
        return out


# What a kernel (GPU) or an op (CPU) does, from its name: the first category with a matching fragment
PROFILE_CATEGORIES = [
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("optimizer and EMA", ("adam", "foreach", "multi_tensor", "lerp")),
    ("fused by inductor", ("triton",)),
    ("matmul and conv", ("gemm", "conv", "cutlass", "cudnn", "nvjet", "sm90_", "sm80_", "xmma", "wgrad",
                         "dgrad", "implicit", "winograd", "aten::mm", "aten::bmm", "aten::addmm")),
    ("normalisation", ("group_norm", "groupnorm", "layer_norm", "welford")),
    ("copies and layout", ("memcpy", "memset", "copy", "nchwtonhwc", "nhwctonchw", "transpose")),
]


def kernel_profile(step, device, steps=3, top=8):
    """Where `step()`'s time goes: `steps` calls under torch.profiler. On a GPU the kernels' device time, on
    a CPU the ops' own CPU time, grouped by PROFILE_CATEGORIES (the rest: 'elementwise and other').
    -> {"ms_per_step", "shares": {category: share}, "top": [[name, ms per step, share], ...]}, or
    {"error": why} where the profiler fails (the steps' timings stand without it)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    try:
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            for _ in range(steps):
                step()
            if cuda:
                torch.cuda.synchronize()
        if cuda:  # the kernels themselves: events that ran on the device
            times = [(e.key, e.self_device_time_total) for e in prof.key_averages()
                     if e.device_type == DeviceType.CUDA]
        else:
            times = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
    except (RuntimeError, AssertionError, AttributeError) as e:
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    times = sorted(((name, us) for name, us in times if us > 0), key=lambda kv: -kv[1])
    total = sum(us for _, us in times) or 1.0
    shares = {}
    for name, us in times:
        low = name.lower()
        cat = next((c for c, frags in PROFILE_CATEGORIES if any(f in low for f in frags)),
                   "elementwise and other")
        shares[cat] = shares.get(cat, 0.0) + us / total
    return {"ms_per_step": total / 1e3 / steps,
            "shares": dict(sorted(shares.items(), key=lambda kv: -kv[1])),
            "top": [[name[:120], us / 1e3 / steps, us / total] for name, us in times[:top]]}


def profile_line(prof):
    """One line of a kernel_profile: its time per step and each category's share."""
    if "error" in prof:
        return f"profile failed: {prof['error']}"
    return f"{prof['ms_per_step']:.1f} ms/step profiled: " + ", ".join(
        f"{cat} {100 * share:.0f}%" for cat, share in prof["shares"].items())


def keep_freed_memory():
    """On a CPU with glibc: keep freed memory in the process (mmap threshold 32 MiB, glibc's largest; trim
    threshold 2 GiB). By default glibc hands large blocks back to the OS as soon as they are freed, so every
    training step page-faults its activations and gradients in afresh (BENCHMARKS.md has what it costs).
    Process-wide: -> whether it took effect (False off glibc)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
        return libc.mallopt(-3, 32 << 20) == 1 and libc.mallopt(-1, 2**31 - 1) == 1
    except (OSError, AttributeError):
        return False


def device_name(device):
    """The GPU's name, or the CPU's model name from /proc/cpuinfo: the label of every benchmark's rows."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


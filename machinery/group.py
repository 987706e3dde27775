"""The device each process uses and torchrun's process group: the one place a process joins it, and the
collectives training, sampling, evaluation and the data shards use.

    rank, world, device = group.join("auto")   # under torchrun: NCCL between GPUs, gloo between CPUs
    ...
    group.leave()                              # only a group join() made

Outside torchrun (WORLD_SIZE unset or 1) nothing is joined: rank 0 of 1, and every collective below is the
identity, so the same code runs on one process and on many.
"""
import contextlib
import os
import signal

import torch
import torch.distributed as dist

from machinery.errors import UserError, first_line


def resolve_device(name):
    """--device: 'auto' (a GPU where there is one) or a torch device name that works here, else one line."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device={name}: not a device name") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device={name}: no CUDA device is available")
    if device.type not in ("cpu", "cuda", "mps", "xpu"):  # meta, ...: no data to compute on
        raise UserError(f"--device={name}: not a device that computes (cpu, cuda, mps or xpu)")
    try:  # any other missing device (mps on a machine without it, cuda:7 of 1 GPU) fails here, not mid-run
        torch.empty(1, device=device) + 1
    except (RuntimeError, AssertionError, ValueError, NotImplementedError) as e:
        raise UserError(f"--device={name}: not available here ({first_line(e)})") from None
    return device


def join(device_name):
    """-> (rank, world, device). Under torchrun (WORLD_SIZE > 1) this process joins the group: NCCL between
    GPUs (one per process: LOCAL_RANK, set before any CUDA work), gloo between CPU processes."""
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    if world > 1 and device_name in ("auto", "cuda") and torch.cuda.is_available():
        torch.cuda.set_device(local)  # each rank's CUDA context on its own GPU only
    device = resolve_device(device_name)
    if world == 1:
        return 0, 1, device
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(local)
    if not joined():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        join.owned = True
    return dist.get_rank(), dist.get_world_size(), device


def joined():
    return dist.is_available() and dist.is_initialized()


def leave():
    """Leave the group join() joined (never one a caller had made itself)."""
    if getattr(join, "owned", False) and joined():
        dist.destroy_process_group()
    join.owned = False


def rank_world():
    """(rank, world) of this process: (0, 1) outside a group."""
    return (dist.get_rank(), dist.get_world_size()) if joined() else (0, 1)


def barrier():
    if joined():
        dist.barrier()


def collective_device():
    """Where the group's collectives take tensors: the current GPU under NCCL, else the CPU."""
    return (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
            else torch.device("cpu"))


def all_reduce_sum(*tensors):
    """Sum CPU float64 tensors over the ranks (-> CPU tensors; the inputs themselves outside a group)."""
    if not joined():
        return tensors
    out = []
    for t in tensors:
        t = t.to(collective_device())
        dist.all_reduce(t)
        out.append(t.cpu())
    return out


def all_agree(ok):
    """A 0/1 float tensor on the device -> its minimum over the ranks, in place (1: every rank says yes)."""
    if joined():
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return ok


def gather_rows(x):
    """Rows rank::world of a tensor from every rank -> the whole tensor in the original order (CPU)."""
    rank, world = rank_world()
    if world == 1:
        return x.cpu()
    parts = [None] * world
    dist.all_gather_object(parts, x.cpu())
    out = torch.empty((sum(map(len, parts)), *x.shape[1:]), dtype=x.dtype)
    for r, p in enumerate(parts):
        out[r::world] = p
    return out


@contextlib.contextmanager
def sigterm_interrupts():
    """SIGTERM (a scheduler's preemption, torchrun passing one on) stops a command as Ctrl-C does, with a
    KeyboardInterrupt: a file being written is dropped whole (files.created), the finished ones stay."""
    def stop(signum, frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: leave signals alone
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)

"""The device a training run computes on, told plainly: the dtype it computes in, its name, the peak
memory a rank used on it, and a warning when the run falls back to the CPU although GPUs are there.

A local run's ranks use NCCL on one GPU each when the host has a GPU for every local rank, and
gloo on the CPU otherwise (:func:`tensorpar.world.default_backend`): a run of more ranks than GPUs
trains on the CPU, and :func:`cpu_fallback_warning` says so before the ranks start.
"""

from __future__ import annotations

import os
import resource
import sys
from types import MappingProxyType

import torch
import torch.distributed as dist

from tensorpar.mesh import Mesh

#: ``--dtype``'s names of the dtypes a run computes in (bf16 and fp16 through autocast)
DTYPES = MappingProxyType({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32})


def compute_dtype(name: str | None, device: torch.device) -> str:
    """The ``--dtype`` a run computes in: ``name``, or by default bf16 on a GPU and fp32 on the CPU."""
    return name or ("bf16" if device.type == "cuda" else "fp32")


def device_name(device: torch.device) -> str:
    """``"cuda:0 (NVIDIA H100 80GB HBM3)"``, or ``"cpu"``."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def reset_peak_memory(device: torch.device) -> None:
    """Start counting a GPU's peak allocated memory afresh (a process's peak RSS cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory on ``device``: on a GPU the most its tensors held at once since
    :func:`reset_peak_memory` (``torch.cuda.max_memory_allocated``; no device sync); on the CPU the
    process's peak resident set (``getrusage``), Python and torch themselves included."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def peak_memory_per_rank(mesh: Mesh) -> list[int]:
    """Every rank's :func:`peak_memory_bytes`, on every rank (a collective over the world)."""
    peaks = torch.zeros(mesh.world_size, dtype=torch.int64, device=mesh.device)
    peaks[mesh.rank] = peak_memory_bytes(mesh.device)
    dist.all_reduce(peaks)
    return peaks.tolist()


def cpu_fallback_warning(*, tp: int, dp: int, pp: int, local_ranks: int, cuda_devices: int,
                         torchrun: bool = False) -> str | None:
    """What to tell a user whose ``local_ranks`` ranks on this host would train on the CPU although
    it has ``cuda_devices`` GPUs (NCCL needs one per rank), and how to use the GPUs; ``None`` when
    the run uses the GPUs, or there are none. ``torchrun``: the ranks are torchrun's processes.

    Example::

        cpu_fallback_warning(tp=2, dp=1, pp=1, local_ranks=2, cuda_devices=1)
        # 'CUDA is available (1 device) but tp x dp x pp = 2 x 1 x 1 = 2 ranks need 2 GPUs ...'
    """
    if cuda_devices == 0 or local_ranks <= cuda_devices:
        return None
    devices = f"{cuda_devices} device{'s' if cuda_devices > 1 else ''}"
    if torchrun:
        ranks = f"torchrun's {local_ranks} processes on this host"
        fix = f"Start at most {cuda_devices} (--nproc-per-node {cuda_devices}) to train on the GPUs."
    else:
        ranks = f"tp x dp x pp = {tp} x {dp} x {pp} = {local_ranks} ranks"
        if cuda_devices == 1:
            fix = "Use " + " ".join(f"--{name} 1" for name, n in (("tp", tp), ("dp", dp), ("pp", pp)) if n > 1) \
                  + " to train on the GPU."
        else:
            fix = f"Use at most {cuda_devices} ranks (tp x dp x pp <= {cuda_devices}) to train on the GPUs."
    return (f"CUDA is available ({devices}) but {ranks} need {local_ranks} GPUs (NCCL: one GPU per rank); "
            f"this run uses the CPU. {fix}")


def local_ranks(world: int) -> int:
    """The ranks of a run of ``world`` on this host: torchrun's ``LOCAL_WORLD_SIZE`` under torchrun,
    else all of them (a local run starts them itself)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if "WORLD_SIZE" in os.environ else world


def warn_if_gpus_unused(*, tp: int, dp: int, pp: int) -> None:
    """Print :func:`cpu_fallback_warning` for this host on stderr, if it applies: before a local run
    starts its ``tp * dp * pp`` ranks, or on rank 0 of torchrun's (``LOCAL_WORLD_SIZE`` per host)."""
    torchrun = "WORLD_SIZE" in os.environ
    if torchrun and os.environ.get("RANK", "0") != "0":
        return
    local = local_ranks(tp * dp * pp)
    warning = cpu_fallback_warning(tp=tp, dp=dp, pp=pp, local_ranks=local, torchrun=torchrun,
                                   cuda_devices=torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)

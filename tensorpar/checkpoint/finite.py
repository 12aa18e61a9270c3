"""Which tensors of a save hold a NaN or an infinity: such a checkpoint is never published (a diverged
run's state would otherwise replace, through retention, the last good checkpoints).

A tensor's largest absolute value is NaN or infinite exactly when one of its elements is (``max``
propagates NaN), so one infinity-norm per tensor, taken by torch's foreach kernels (a launch per
device and dtype), answers for all of them, and the host reads one vector of flags per device.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .safetensors_file import NAMES


def nonfinite(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of the floating-point ``tensors`` holding a NaN or an infinity, in the mapping's order
    (of the dtypes a checkpoint stores: the others are refused by name when written)."""
    groups: dict[tuple[torch.device, torch.dtype], list[str]] = {}
    for name, value in tensors.items():
        if value.is_floating_point() and value.dtype in NAMES and value.numel():  # no infinity norm of nothing
            groups.setdefault((value.device, value.dtype), []).append(name)
    flags: dict[torch.device, list[tuple[list[str], torch.Tensor]]] = {}
    for (device, _), names in groups.items():
        peaks = torch._foreach_norm([tensors[n] for n in names], float("inf"))  # max |x| of each
        flags.setdefault(device, []).append((names, torch.isfinite(torch.stack(peaks))))
    bad: set[str] = set()
    for parts in flags.values():  # one read per device
        finite = torch.cat([f for _, f in parts]).tolist()
        names = [n for group, _ in parts for n in group]
        bad.update(n for n, ok in zip(names, finite, strict=True) if not ok)
    return [name for name in tensors if name in bad]

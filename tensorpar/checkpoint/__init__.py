"""Distributed checkpoints on ``torch.distributed.checkpoint`` (DCP), loadable at any (tp, dp, pp),
with or without FSDP2. A checkpoint is a ``FileSystemWriter`` directory ``step-NNNNNN`` plus
``meta.json`` (step, layout, config, optimizer groups, ``extra``, every file's SHA-256); the README's
"Checkpoints" says what it holds and what it guarantees.

Example::

    tensorpar.checkpoint.save("out", model, optimizer, step=step, extra={"tokens": tokens})
    meta = tensorpar.checkpoint.load("out", model, optimizer)          # at any (tp, dp, pp)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..mesh import Mesh, current_mesh
from .files import FORMAT, MANIFEST, NAME, CheckpointError, resolve
from .loading import export_safetensors, export_state_dict, load, read_meta
from .saving import PendingSave, prepare, write

__all__ = ["FORMAT", "MANIFEST", "NAME", "CheckpointError", "PendingSave", "async_save", "export_safetensors",
           "export_state_dict", "load", "read_meta", "resolve", "save"]


def save(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         step: int, extra: Mapping[str, Any] | None = None, keep: int = 2, mesh: Mesh | None = None) -> Path:
    """Write ``directory/step-NNNNNN`` (a collective) and return its path; keep the newest ``keep``.

    Each rank writes its chunks of the model, the optimizer's state (``ZeroRedundancyOptimizer``'s
    too) and its generator states; ``extra`` (JSON) goes to ``meta.json``. A NaN or an infinity on
    any rank, or ranks passing different ``step``, ``keep`` or ``extra``, raise the same
    :class:`CheckpointError` on every rank, and nothing on disk changes.
    """
    return write(prepare(directory, model, optimizer, step=step, extra=extra, keep=keep, mesh=mesh or current_mesh()))


def async_save(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
               step: int, extra: Mapping[str, Any] | None = None, keep: int = 2,
               mesh: Mesh | None = None) -> PendingSave:
    """:func:`save` through ``dcp.async_save``: the tensors are staged to CPU memory and written in a
    thread; ``PendingSave.wait()`` (a collective) publishes the checkpoint and moves ``latest``."""
    return PendingSave(prepare(directory, model, optimizer, step=step, extra=extra, keep=keep,
                               mesh=mesh or current_mesh()))

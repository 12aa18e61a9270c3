"""Distributed checkpoints on ``torch.distributed.checkpoint`` (DCP): every rank writes only its own
shards, and a checkpoint saved at one (tp, dp, pp), with or without FSDP2, loads at any other.

A checkpoint is a directory ``step-NNNNNN`` written by torch's ``FileSystemWriter`` (``.metadata``
and one ``__R_0.distcp`` per rank) plus ``meta.json``: step, layout, model config, optimizer groups,
the caller's ``extra``, and the size and SHA-256 of every file (:mod:`.files`). torch's own tools
read it as it is, e.g. ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save(step_dir,
"out.pt")`` gives ``{"model.<key>": full tensor, "optim.state.<param>.<field>": ..., "rng...."}``.

What tensorpar adds to DCP: the chunk of the full tensor each rank holds (:mod:`.layout`: balanced
tp shards, FSDP2 chunks of them, fused projections), the generator states (:mod:`.generators`), and
the run's management: atomic publish, ``latest``, keep-N, no non-finite state ever published, and
a damaged or edited checkpoint refused before anything is modified.

Trade against torch's format: DCP's ``.metadata`` is a pickle and its ranks exchange plans through
object collectives; ``meta.json``'s hashes are checked before ``.metadata`` is opened, so a damaged
or edited checkpoint is refused, but a forger who rewrites those hashes can hand the loader a pickle:
load checkpoints you trust, as with ``torch.load``.

Example::

    path = tensorpar.checkpoint.save("out", model, optimizer, step=step, extra={"tokens": tokens})
    meta = tensorpar.checkpoint.load("out", model, optimizer)          # at any (tp, dp, pp)
    pending = tensorpar.checkpoint.async_save("out", model, optimizer, step=step)
    pending.wait()                                                      # latest moves now
    tensorpar.checkpoint.export_safetensors("out", "model.safetensors")  # one unsharded file
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
    """Write ``directory/step-NNNNNN`` (a collective: every rank calls it) and return its path.

    Each rank writes its own chunks of the model (under FSDP2 too), of the optimizer's state
    (``torch.optim`` optimizers and ``ZeroRedundancyOptimizer``) and its generator states. ``extra``
    (JSON-serialisable) is stored in ``meta.json``. The newest ``keep`` checkpoints stay; saving a
    step that exists replaces it. A state holding a NaN or an infinity (on any rank) is refused on
    every rank with a :class:`CheckpointError` naming the tensors, and nothing on disk changes. Ranks
    passing different ``step``, ``keep`` or ``extra`` all raise the same error, and nothing is written.

    Example::

        tensorpar.checkpoint.save("out", model, optimizer, step=step, extra={"tokens": tokens})
    """
    mesh = mesh or current_mesh()
    return write(prepare(directory, model, optimizer, step=step, extra=extra, keep=keep, mesh=mesh))


def async_save(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
               step: int, extra: Mapping[str, Any] | None = None, keep: int = 2,
               mesh: Mesh | None = None) -> PendingSave:
    """Like :func:`save` through ``dcp.async_save``: the tensors are copied to CPU memory, written in a
    thread, and ``PendingSave.wait()`` (a collective) publishes the checkpoint; ``latest`` does not
    move before. The result is the checkpoint :func:`save` would have written when called.

    Example::

        pending = tensorpar.checkpoint.async_save("out", model, optimizer, step=step)
        train_more_steps()
        pending.wait()
    """
    mesh = mesh or current_mesh()
    return PendingSave(prepare(directory, model, optimizer, step=step, extra=extra, keep=keep, mesh=mesh))

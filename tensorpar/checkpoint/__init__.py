"""Distributed checkpoints through ``torch.distributed.checkpoint`` (DCP): every rank writes only
its own shards, in parallel, and a checkpoint saved at one (tp, dp), with or without FSDP2, loads
at any other.

A checkpoint is a directory ``step-NNNNNN`` holding

* ``shard-RRRRR-of-WWWWW.safetensors``, one per rank: the chunks that rank
  wrote (its tp shard of each split tensor, under FSDP2 its dp chunk of that,
  and its share of the replicated tensors, each written once over all ranks),
  its optimizer state likewise, and its own generator states;
* ``meta.json``: step, tp, dp, model config, optimizer hyper-parameters, the
  caller's ``extra``, the chunk index (where each box of each full tensor
  lies, and the SHA-256 of its bytes: :mod:`.index`), the size and SHA-256 of
  each file, and a SHA-256 of itself (:mod:`.manifest`).

No rank ever holds the full model or the full optimizer state: saving streams a
rank's chunks to its file tensor by tensor; loading reads into each rank just
its boxes, resharded by DCP's planner from whatever chunks were written
(:mod:`.planner`). The files are written into a temporary directory that is
renamed into place when complete; then the ``latest`` file is replaced
atomically, so a crash at any moment loses nothing (:mod:`.publish`).

Nothing is unpickled and nothing but torch is needed (no numpy, no
``safetensors`` package): the storage is safetensors files with a JSON index,
written and read by our own code (:mod:`.storage` says why not DCP's pickled
``.metadata`` or torch's ``HuggingFaceStorageWriter``), and the ranks exchange
JSON over tensor collectives (:mod:`.agree`).

torch's standard DCP tools read a tensorpar checkpoint through :func:`to_dcp`
(or ``python -m tensorpar.checkpoint to-dcp CHECKPOINT OUT``), which writes the
unsharded model as a standard DCP directory with torch's ``FileSystemWriter``,
one tensor at a time. The checkpoint itself cannot be that directory, nor hold
it beside its own files at no cost, because of how torch's ``FileSystemReader``
(the reader of ``dcp.load`` by default, and of ``dcp_to_torch_save``) reads:

* its ``.metadata`` is unpickled (writing one beside ours would
  do, since our loader need never open it);
* every tensor item is read with ``torch.load`` of its byte range, so each stored
  chunk must be a ``torch.save`` archive: a zip of a pickle (the tensor's class,
  dtype, shape, strides and storage key) and the raw storage, 64-byte aligned.
  A safetensors file's data is the tensors' bytes end to end with no gap (its
  readers refuse gaps), so no byte range of it is such an archive: DCP's files
  beside ours would store every tensor a second time. And were our chunks
  ``torch.save`` archives instead, our reader would have to unpickle each
  archive's record to learn how its bytes are laid out (the strides live only
  there), or rely on torch's private zip layout, the guarantee that our load
  path unpickles nothing resting then on an undocumented format.

So the checkpoint keeps one copy of each tensor, in a format our loader reads
without unpickling, and the DCP form is made on demand.

A load checks everything before it modifies anything, on every rank, and the
ranks agree: a refused checkpoint changes nothing anywhere, and every refusal is
a :class:`CheckpointError` naming the rank, the file and the field.

Example::

    path = tensorpar.checkpoint.save("out", model, optimizer, step=step, extra={"tokens": tokens})
    meta = tensorpar.checkpoint.load("out", model, optimizer)          # at any (tp, dp)
    pending = tensorpar.checkpoint.async_save("out", model, optimizer, step=step)
    pending.wait()                                                      # latest moves now
    tensorpar.checkpoint.export_safetensors("out", "model.safetensors")  # one unsharded file
    tensorpar.checkpoint.to_dcp("out", "out-dcp")                        # torch's DCP format
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..mesh import Mesh, current_mesh
from .export import export_safetensors, export_state_dict, to_dcp
from .loading import load, read_meta
from .manifest import CheckpointError
from .meta import FORMAT
from .saving import PendingSave, finish, prepare, write
from .storage import ShardReader, ShardWriter, resolve

__all__ = ["FORMAT", "CheckpointError", "PendingSave", "ShardReader", "ShardWriter", "async_save",
           "export_safetensors", "export_state_dict", "load", "read_meta", "resolve", "save", "to_dcp"]


def save(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         step: int, extra: Mapping[str, Any] | None = None, keep: int = 2, mesh: Mesh | None = None) -> Path:
    """Write ``directory/step-NNNNNN`` (a collective: every rank calls it) and return its path.

    Each rank writes its own chunks of the model (under FSDP2 too), of the
    optimizer's state (``torch.optim`` optimizers and ``ZeroRedundancyOptimizer``)
    and its generator states. ``extra`` is stored in ``meta.json``
    (JSON-serialisable: e.g. the data position and the run's arguments). The
    newest ``keep`` checkpoints stay. Saving a step that exists replaces it;
    until the new copy is in place, the old one stays reachable through
    ``latest``. The checkpoint is complete on disk when this returns on any rank.
    A state holding a NaN or an infinity (a floating-point tensor of the model
    or the optimizer, on any rank) is refused on every rank with a
    :class:`CheckpointError` naming the tensors, and nothing on disk changes:
    retention never removes the newest finite checkpoint.
    The ranks must pass the same ``step``, ``keep`` and ``extra``: when they
    differ, every rank raises the same :class:`CheckpointError` naming the ranks
    and their values, and nothing is written. A rank whose launcher is gone
    (see :mod:`tensorpar.lifeline`) publishes nothing: the save raises.

    Example::

        tensorpar.checkpoint.save("out", model, optimizer, step=step, extra={"tokens": tokens})
    """
    mesh = mesh or current_mesh()
    job = prepare(directory, model, optimizer, step=step, extra=extra, keep=keep, mesh=mesh, stage=False)
    written, error = None, None
    try:
        written = write(job)
    except Exception as e:  # noqa: BLE001 - the other ranks learn of it in finish(), then every rank raises
        error = e
    return finish(job, written, error)


def async_save(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
               step: int, extra: Mapping[str, Any] | None = None, keep: int = 2,
               mesh: Mesh | None = None) -> PendingSave:
    """Like :func:`save`, writing in a background thread: returns a :class:`PendingSave` at once.

    Each rank first copies its own chunks to CPU memory (its shard, not the
    model), so the model and optimizer may change right after this returns.
    ``PendingSave.wait()`` (a collective) publishes the checkpoint once every
    rank's file is complete; ``latest`` does not move before. The result is the
    checkpoint :func:`save` would have written when ``async_save`` was called.

    Example::

        pending = tensorpar.checkpoint.async_save("out", model, optimizer, step=step)
        train_more_steps()
        pending.wait()
    """
    mesh = mesh or current_mesh()
    return PendingSave(prepare(directory, model, optimizer, step=step, extra=extra, keep=keep, mesh=mesh, stage=True))

"""Loading: each rank reads its own boxes of every tensor through ``torch.distributed.checkpoint``,
from whatever (tp, dp) wrote them; everything is checked before anything is modified, and the
ranks agree before any of them does.

On each rank: the manifest is checked (its own hash, its fields, its file list,
its index covering each tensor); the model's keys, full shapes and dtypes, the
optimizer's groups and state fields, and the generator states' names and sizes
are checked against it; ``dcp.load`` plans this rank's reads from the index
(:class:`~.planner.BoxLoadPlanner`, DCP's resharding) and
:class:`~.storage.ShardReader` checks the SHA-256 of each chunk it needs before
reading its rows into fresh buffers; the generator states read are checked. Then
the ranks share whether they succeeded (:mod:`.agree`): if any failed, every
rank raises and nothing is modified anywhere; otherwise each copies its buffers
into the model, the optimizer and the generators.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from ..mesh import Mesh, current_mesh
from . import optim, rng, state
from .agree import described, settle, share
from .boxes import Box
from .manifest import MANIFEST, check_file
from .meta import check_config, layout_of, world_of
from .planner import BoxLoadPlanner
from .storage import ShardReader, dcp_call


def read_meta(path: str | Path) -> dict[str, Any]:
    """The checkpoint's metadata (with ``"path"``: its directory), after checking the manifest's own
    hash, the type of each field, the chunk index, and every file against its recorded size and
    SHA-256 (no process group needed)."""
    reader = ShardReader.open(path)
    for name in reader.files:
        check_file(reader.directory, name, reader.listed[name])
    return {**reader.meta, "path": str(reader.directory)}


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         restore_rng: bool = True, cast: bool = False, mesh: Mesh | None = None) -> dict[str, Any]:
    """Load a checkpoint saved at any (tp, dp, pp), with or without FSDP2, into ``model`` (and
    ``optimizer``); return its metadata. A collective: every rank calls it. A pipeline rank's model
    (its stages, under the whole model's names) reads just its own tensors.

    Every rank reads only its own boxes of each tensor. Generator states are
    restored when the checkpoint was saved at the same (tp, dp, pp) and
    ``restore_rng`` is set. A tensor stored in a dtype other than the model's
    (or than the optimizer keeps) is refused unless ``cast=True``, which
    converts it. Raises :class:`CheckpointError` on every rank, naming the rank,
    the file and the field, for a missing, corrupt, edited or mismatched
    checkpoint; nothing (model, optimizer, generators, files) is then modified
    on any rank.

    Example::

        meta = tensorpar.checkpoint.load("out", model, optimizer)   # the newest one
        start = meta["step"] + 1
        tensorpar.checkpoint.load("bf16-run", fp32_model, cast=True)  # converts bf16 to float32
    """
    mesh = mesh or current_mesh()
    error: Exception | None = None
    try:
        reader = ShardReader.open(path)
        directory, meta, entries = reader.directory, reader.meta, reader.entries
        where = directory / MANIFEST
        check_config(meta, model, where)
        rng.check_index(entries, world_of(meta), where)
        tensors, boxes = state.destinations(model, entries, where, cast=cast, stage=mesh.pp > 1)
        optimizer_state = None
        if optimizer is not None:
            more, more_boxes, optimizer_state = optim.destinations(meta, entries, where, model, optimizer, cast=cast)
            tensors, boxes = tensors | more, boxes | more_boxes
        states: dict[str, torch.Tensor] = {}
        if restore_rng and layout_of(meta) == (mesh.tp, mesh.dp, mesh.pp):
            states = rng.destinations(entries, mesh.rank)
            boxes |= {k: Box((0,) * v.dim(), tuple(v.shape), tuple(v.shape)) for k, v in states.items()}
        with dcp_call():
            dcp.load(tensors | states, storage_reader=reader, planner=BoxLoadPlanner(boxes), no_dist=True)
        if states:
            rng.check_states(states, directory / reader.files[mesh.rank])
    except Exception as e:  # noqa: BLE001 - every rank learns of it below, then every rank raises
        error = e
    settle(share({"error": described(error)}, mesh), error, mesh, "load the checkpoint")
    # everything is read and checked on every rank: only now is anything modified
    state.apply(model, tensors)
    if optimizer is not None and optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state())
    if states:
        rng.restore(states, mesh)
    return {**meta, "path": str(directory)}

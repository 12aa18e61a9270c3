"""Loading: the manifest and the files' hashes are checked before DCP opens anything, then every
tensor's size and dtype, then each rank reads its own boxes with ``dcp.load`` into new tensors; the
ranks agree before any of them modifies anything."""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _check_box_bounds, _check_box_overlap
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..mesh import Mesh, current_mesh
from . import files
from .contents import MODEL, like, model_pieces, optim_destinations, rng_chosen, rng_destinations, rng_restore
from .files import MANIFEST, CheckpointError
from .layout import BoxLoadPlanner, whole
from .saving import agree, config_dict

Stored = dict[str, tuple[tuple[int, ...], torch.dtype]]  # name -> (full size, dtype), from DCP's metadata


def _read(directory: Path, state: dict[str, torch.Tensor], planner: Any = None) -> None:
    with warnings.catch_warnings():  # each rank reads alone on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        try:
            dcp.load(state, storage_reader=dcp.FileSystemReader(directory), planner=planner, no_dist=True)
        except CheckpointException as e:  # a BaseException, holding each rank's (exception, traceback)
            failure = next(iter(e.failures.values()))[0]
            raise CheckpointError(f"{directory}: its files cannot be read ({type(failure).__name__}: "
                                  f"{failure})"[:2000]) from None


def _stored(directory: Path, meta: dict[str, Any]) -> Stored:
    """Each tensor's full size and dtype from DCP's ``.metadata`` (hashed: it may be unpickled), after
    checking that its chunks tile it exactly and that it fits in the bytes of the files (a size, even
    forged by a consistent rewrite of the hashes, never reaches the allocator unchecked)."""
    total = sum(f["bytes"] for f in meta["files"].values())
    try:
        metadata = dcp.FileSystemReader(directory).read_metadata()
    except Exception as e:  # noqa: BLE001 - what unpickling a damaged file raises
        raise CheckpointError(f"{directory / '.metadata'} cannot be read: {e}") from None
    stored = {}
    for name, value in metadata.state_dict_metadata.items():
        if not isinstance(value, TensorStorageMetadata):
            continue
        size, chunks = tuple(value.size), value.chunks
        if math.prod(size) * value.properties.dtype.itemsize > total:
            raise CheckpointError(f"{directory / '.metadata'}: {name} of size {list(size)} would hold more than "
                                  f"the {total} bytes of the checkpoint's files")
        if not (all(len(c.offsets) == len(c.sizes) == len(size) and _check_box_bounds(value.size, c) for c in chunks)
                and not any(_check_box_overlap(c, d) for i, c in enumerate(chunks) for d in chunks[:i])
                and sum(math.prod(c.sizes) for c in chunks) == math.prod(size)):
            raise CheckpointError(f"{directory / '.metadata'}: the chunks of {name} do not tile its size "
                                  f"{list(size)} ({[(tuple(c.offsets), tuple(c.sizes)) for c in chunks[:4]]})")
        stored[name] = (size, value.properties.dtype)
    return stored


def read_meta(path: str | Path) -> dict[str, Any]:
    """The checkpoint's metadata (with ``"path"``: its directory), after checking the manifest and every
    file against its recorded size and SHA-256 (no process group needed)."""
    directory = files.resolve(path)
    return {**files.read_manifest(directory), "path": str(directory)}


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         restore_rng: bool = True, cast: bool = False, mesh: Mesh | None = None) -> dict[str, Any]:
    """Load a checkpoint saved at any (tp, dp, pp), with or without FSDP2, into ``model`` (and
    ``optimizer``); return its metadata (a collective). Another dtype than the model's is refused
    unless ``cast=True``. A missing, corrupt, edited or mismatched checkpoint raises
    :class:`CheckpointError` on every rank, and nothing is modified on any rank. E.g.
    ``load("bf16-run", fp32_model, cast=True)`` converts bf16 to float32.
    """
    mesh, error, optimizer_state = mesh or current_mesh(), None, None
    try:
        directory = files.resolve(path)
        meta, where = files.read_manifest(directory, (mesh.rank, mesh.world_size)), directory / MANIFEST
        saved, ours, theirs = (meta["tp"], meta["dp"], meta["pp"]), config_dict(model), meta["config"]
        if ours is not None and theirs is not None and ours != theirs:
            raise CheckpointError(f"{where}: config does not match the model's (" + ", ".join(
                f"{k}: checkpoint {theirs.get(k)!r}, model {ours.get(k)!r}"
                for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)) + ")")
        stored, (local, boxes) = _stored(directory, meta), model_pieces(model)
        if (other := sorted(k for k in stored if k.startswith(MODEL) and k not in boxes)) and mesh.pp == 1:
            raise CheckpointError(f"{where}: the checkpoint holds {other[:4]}, which the model lacks")
        tensors = {k: torch.empty(box.sizes, dtype=local[k].dtype) for k, box in boxes.items()}
        if optimizer is not None:
            more, more_boxes, optimizer_state = optim_destinations(meta, stored, where, model, optimizer)
            tensors, boxes = tensors | more, boxes | more_boxes
        for key, value in tensors.items():
            (size, dtype), want = stored.get(key, ((), None)), (value.dtype, boxes[key].size)
            if key not in stored or size != want[1] or (dtype != want[0] and not cast):
                raise CheckpointError(f"{where}: the checkpoint lacks {key}" if key not in stored else
                                      f"{where}: {key} is stored as {dtype} of shape {size}, the model's is {want[0]} "
                                      f"of shape {want[1]}" + " (load(..., cast=True) converts it)" * (size == want[1]))
        states = rng_destinations(stored, math.prod(saved), where) if restore_rng else {}
        _read(directory, tensors | states, BoxLoadPlanner(boxes | {k: whole(v) for k, v in states.items()}))
        mine, lost = rng_chosen(states, saved == (mesh.tp, mesh.dp, mesh.pp), mesh.rank, where)
    except Exception as e:  # noqa: BLE001 - every rank learns of it below, then every rank raises
        error = e
    agree(error, mesh, "load the checkpoint")
    # everything is read and checked on every rank: only now is anything modified
    model.load_state_dict({k: like(tensors[MODEL + k], v) for k, v in model.state_dict().items()})
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state())  # type: ignore[union-attr]
    rng_restore(mine, lost, mesh, directory, saved)
    return {**meta, "path": str(directory)}


def export_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The checkpoint's unsharded model state dict, for the plain model (no process group needed)."""
    directory = files.resolve(path)
    full = {k: torch.empty(size, dtype=dtype) for k, (size, dtype) in
            _stored(directory, files.read_manifest(directory)).items() if k.startswith(MODEL)}
    _read(directory, full)
    return {k.removeprefix(MODEL): v for k, v in full.items()}


def export_safetensors(path: str | Path, out_file: str | Path) -> Path:
    """Write the checkpoint's unsharded model state dict to the safetensors file ``out_file`` (through the
    ``safetensors`` package: ``pip install tensorpar[hf]``), replaced atomically when complete."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ImportError("export_safetensors needs the safetensors package: pip install 'tensorpar[hf]'") from None
    out, state = Path(out_file), export_state_dict(path)
    tmp = files.scratch(out)
    try:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
        os.replace(tmp, out)
    finally:
        files.discard(tmp)
    return out

"""Loading: the manifest and the files' hashes are checked before DCP opens anything, then every
tensor's size and dtype, then each rank reads its own boxes with ``dcp.load``; the ranks agree
before any of them modifies anything."""

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
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..mesh import Mesh, current_mesh
from . import files, generators
from .contents import MODEL, Entries, apply_model, model_destinations, optim_destinations
from .files import MANIFEST, CheckpointError
from .layout import BoxLoadPlanner, whole
from .saving import config_dict, described, everyone, settle


def _checked(path: str | Path, share: tuple[int, int] = (0, 1)) -> tuple[Path, dict[str, Any]]:
    """The checkpoint directory ``path`` names and its manifest, after checking the manifest and the
    files ``share = (first, step)`` picks of its sorted list against their sizes and hashes."""
    directory = files.resolve(path)
    meta = files.read_manifest(directory)
    names = sorted(meta["files"])
    for name in names:  # sizes everywhere (a stat each); each rank hashes its share
        files.check_file(directory, name, meta["files"][name], hash=name in names[share[0]::share[1]])
    return directory, meta


def _read(directory: Path, state: dict[str, torch.Tensor], planner: Any = None) -> None:
    with warnings.catch_warnings():  # each rank reads alone on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        try:
            dcp.load(state, storage_reader=dcp.FileSystemReader(directory), planner=planner, no_dist=True)
        except CheckpointException as e:  # a BaseException
            raise CheckpointError(f"{directory}: its files cannot be read ({e})") from None


def _entries(directory: Path, meta: dict[str, Any]) -> Entries:
    """Each tensor's full size and dtype from DCP's ``.metadata`` (hashed: it may be unpickled), after
    checking that its chunks cover it exactly and that it fits in the bytes of the files."""
    stored = sum(f["bytes"] for f in meta["files"].values())
    try:
        metadata = dcp.FileSystemReader(directory).read_metadata()
    except Exception as e:  # noqa: BLE001 - what unpickling a damaged file raises
        raise CheckpointError(f"{directory / '.metadata'} cannot be read: {e}") from None
    entries = {}
    for name, value in metadata.state_dict_metadata.items():
        if not isinstance(value, TensorStorageMetadata):
            continue
        size, boxes = tuple(value.size), [(tuple(c.offsets), tuple(c.sizes)) for c in value.chunks]
        if math.prod(size) * value.properties.dtype.itemsize > stored:
            raise CheckpointError(f"{directory / '.metadata'}: {name} of size {list(size)} would hold more than "
                                  f"the {stored} bytes of the checkpoint's files")
        inside = all(len(o) == len(s) == len(size) and all(a >= 0 and a + b <= n
                                                            for a, b, n in zip(o, s, size, strict=True))
                     for o, s in boxes)
        apart = all(any(a + b <= c or c + d <= a for a, b, c, d in zip(o, s, p, q, strict=True))
                    for i, (o, s) in enumerate(boxes) for p, q in boxes[:i])
        if not (inside and apart and sum(math.prod(s) for _, s in boxes) == math.prod(size)):
            raise CheckpointError(f"{directory / '.metadata'}: the chunks of {name} do not cover its size "
                                  f"{list(size)} exactly ({boxes[:4]})")
        entries[name] = (size, value.properties.dtype)
    return entries


def read_meta(path: str | Path) -> dict[str, Any]:
    """The checkpoint's metadata (with ``"path"``: its directory), after checking the manifest and every
    file against its recorded size and SHA-256 (no process group needed)."""
    directory, meta = _checked(path)
    return {**meta, "path": str(directory)}


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         restore_rng: bool = True, cast: bool = False, mesh: Mesh | None = None) -> dict[str, Any]:
    """Load a checkpoint saved at any (tp, dp, pp), with or without FSDP2, into ``model`` (and
    ``optimizer``); return its metadata (a collective). Generator states that differ by rank are
    restored only at the saving layout (elsewhere a warning names them); another dtype than the
    model's is refused unless ``cast=True``. A missing, corrupt, edited or mismatched checkpoint
    raises :class:`CheckpointError` on every rank, and nothing is modified on any rank. Example::

        meta = tensorpar.checkpoint.load("out", model, optimizer)   # the newest one
        tensorpar.checkpoint.load("bf16-run", fp32_model, cast=True)  # converts bf16 to float32
    """
    mesh = mesh or current_mesh()
    error: Exception | None = None
    try:
        directory, meta = _checked(path, (mesh.rank, mesh.world_size))
    except Exception as e:  # noqa: BLE001 - every rank learns of it below, then every rank raises
        error = e
    settle(everyone(described(error)), error, mesh, "load the checkpoint")
    saved, optimizer_state = (meta["tp"], meta["dp"], meta["pp"]), None
    states, lost = dict[str, torch.Tensor](), list[str]()
    try:
        where = directory / MANIFEST
        ours, theirs = config_dict(model), meta.get("config")
        if ours is not None and theirs is not None and ours != theirs:
            diff = ", ".join(f"{k}: checkpoint {theirs.get(k)!r}, model {ours.get(k)!r}"
                             for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k))
            raise CheckpointError(f"{where}: config does not match the model's ({diff})")
        entries = _entries(directory, meta)
        tensors, boxes = model_destinations(model, entries, where, cast=cast, stage=mesh.pp > 1)
        if optimizer is not None:
            more, more_boxes, optimizer_state = optim_destinations(meta, entries, where, model, optimizer, cast=cast)
            tensors, boxes = tensors | more, boxes | more_boxes
        states, lost = generators.destinations(entries, saved[0] * saved[1] * saved[2],
                                               saved == (mesh.tp, mesh.dp, mesh.pp), mesh.rank, where)
        if not restore_rng:
            states, lost = {}, []
        _read(directory, tensors | states, BoxLoadPlanner(boxes | {k: whole(v) for k, v in states.items()}))
        generators.check(states, where)
    except Exception as e:  # noqa: BLE001
        error = e
    settle(everyone(described(error)), error, mesh, "load the checkpoint")
    # everything is read and checked on every rank: only now is anything modified
    apply_model(model, tensors)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state())  # type: ignore[union-attr]
    if states or lost:
        generators.restore(states, lost, mesh, saved, directory)
    return {**meta, "path": str(directory)}


def export_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The checkpoint's unsharded model state dict, for the plain model (no process group needed)."""
    directory, meta = _checked(path)
    full = {k: torch.empty(size, dtype=dtype) for k, (size, dtype) in _entries(directory, meta).items()
            if k.startswith(MODEL)}
    _read(directory, full)
    return {k.removeprefix(MODEL): v for k, v in full.items()}


def export_safetensors(path: str | Path, out_file: str | Path) -> Path:
    """Write the checkpoint's unsharded model state dict to the safetensors file ``out_file`` (through the
    ``safetensors`` package: ``pip install tensorpar[hf]``), replaced atomically when complete."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ImportError("export_safetensors needs the safetensors package: pip install 'tensorpar[hf]'") from None
    out = Path(out_file)
    tmp = files.scratch(out.parent, out.name)
    try:
        save_file({k: v.contiguous() for k, v in export_state_dict(path).items()}, str(tmp))
        os.replace(tmp, out)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    return out

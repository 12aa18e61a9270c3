"""Loading: the manifest and the hashes are checked before DCP opens anything, then each tensor's size and dtype;
each rank reads its boxes into new tensors, checks them, and the ranks agree before anything is modified."""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import _check_box_bounds, _check_box_overlap
from torch.distributed.tensor import DTensor

from ..full import is_dtensor
from ..mesh import Mesh, current_mesh
from ..random import tracker as tp_streams
from . import files
from .files import MANIFEST, CheckpointError
from .layout import Box, BoxLoadPlanner
from .saving import MODEL, OPTIM, agree, config_dict, grouped_names, local_state

Stored = dict[str, tuple[tuple[int, ...], torch.dtype]]  # name -> (full size, dtype), from DCP's metadata
_RNG = re.compile(r"rng\.rank(\d+)\.(cpu|cuda|tp\.base|tp\.(?:cpu|cuda(?::\d+)?))")


def _read(directory: Path, state: dict[str, torch.Tensor], planner: Any = None) -> None:
    with warnings.catch_warnings():  # each rank reads alone on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        try:
            dcp.load(state, storage_reader=dcp.FileSystemReader(directory), planner=planner, no_dist=True)
        except dcp.CheckpointException as e:  # a BaseException, holding each rank's (exception, traceback)
            failure = next(iter(e.failures.values()))[0]
            raise CheckpointError(f"{directory}: its files cannot be read ({type(failure).__name__}: "
                                  f"{failure})"[:2000]) from None


def _stored(directory: Path, meta: dict[str, Any]) -> Stored:
    """Each tensor's full size and dtype from DCP's ``.metadata`` (hashed before it is unpickled), after checking
    that its chunks tile it and that it fits in the files' bytes (no forged size reaches the allocator)."""
    total, where, stored = sum(f["bytes"] for f in meta["files"].values()), directory / ".metadata", {}
    try:
        metadata = dcp.FileSystemReader(directory).read_metadata()
    except Exception as e:  # noqa: BLE001 - what unpickling a damaged file raises
        raise CheckpointError(f"{where} cannot be read: {e}") from None
    for name, value in metadata.state_dict_metadata.items():
        if not isinstance(value, dcp.TensorStorageMetadata):
            continue
        size, chunks = tuple(value.size), value.chunks
        if math.prod(size) * value.properties.dtype.itemsize > total:
            raise CheckpointError(f"{where}: {name} of size {list(size)} would hold more than the {total} bytes of "
                                  "the checkpoint's files")
        if not (all(len(c.offsets) == len(c.sizes) == len(size) and _check_box_bounds(value.size, c) for c in chunks)
                and not any(_check_box_overlap(c, d) for i, c in enumerate(chunks) for d in chunks[:i])
                and sum(math.prod(c.sizes) for c in chunks) == math.prod(size)):
            raise CheckpointError(f"{where}: the chunks of {name} do not tile its size {list(size)} "
                                  f"({[(tuple(c.offsets), tuple(c.sizes)) for c in chunks[:4]]})")
        stored[name] = (size, value.properties.dtype)
    return stored


def like(value: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """``value`` (this rank's local part) on the device and of the kind (DTensor or not) of ``current``."""
    if is_dtensor(current):
        return DTensor.from_local(value.to(current.to_local().device), current.device_mesh, current.placements,
                                  run_check=False, shape=current.shape, stride=current.stride())
    return value.to(current.device)


def _fits(saved: Any, current: Any) -> bool:
    """Whether the JSON value ``saved`` can stand for the hyper-parameter ``current``."""
    if isinstance(current, (list, tuple)):
        return isinstance(saved, list) and len(saved) == len(current) and all(map(_fits, saved, current))
    return type(saved) is type(current) or (type(saved), type(current)) == (int, float) or \
        {type(saved), type(current)} == {bool, type(None)}


def _optimizer(meta: Mapping[str, Any], stored: Stored, where: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
               tensors: dict[str, torch.Tensor], boxes: dict[str, Box]) -> Callable[[], dict[str, Any]]:
    """What makes the optimizer's state dict once its tensors, added to ``tensors`` (to read into) and ``boxes``,
    are read, after checking the groups and that every parameter's state holds the same fields as the optimizer's."""
    saved, copies, own = meta["param_groups"], getattr(model, "tied_copies", {}), grouped_names(model, optimizer)
    known = {n for g in saved if isinstance(g, dict) for n in g.get("params", ())}
    source = {n: n if n in known else copies.get(n, n) for g in own for n in g}  # a tied copy's: the original's
    if len(saved) != len(own):
        raise CheckpointError(f"{where}: param_groups lists {len(saved)} group{'s' * (len(saved) != 1)}, "
                              f"the optimizer has {len(own)}")
    groups, index = [], {n: i for i, n in enumerate(source)}
    for i, (group, current, names) in enumerate(zip(saved, optimizer.param_groups, own, strict=True)):
        ours = {source[n] for n in names}
        held = set(group.get("params", ())) & set(source.values()) if isinstance(group, dict) else set()
        if held != ours:  # a pipeline stage holds some of the checkpoint's parameters
            raise CheckpointError(f"{where}: param_groups[{i}] lacks {sorted(ours - held)[:3]} and holds "
                                  f"{sorted(held - ours)[:3]} of the optimizer's group (its parameters, or their "
                                  "grouping, differ)")
        if set(group) != set(current):
            raise CheckpointError(f"{where}: param_groups[{i}] has the keys {sorted(group)}, the optimizer's group "
                                  f"{sorted(current)}")
        for k in (k for k in sorted(current) if k != "params" and not _fits(group[k], current[k])):
            raise CheckpointError(f"{where}: param_groups[{i}].{k} is {group[k]!r}, which cannot stand for the "
                                  f"optimizer's {current[k]!r}")
        groups.append({k: type(v)(group[k]) if isinstance(v, (tuple, float)) else group[k] for k, v in current.items()}
                      | {"params": [index[n] for n in names]})
    fields: dict[str, set[str]] = {}
    for key in (k for k in stored if k.startswith(OPTIM)):
        name, _, field = key.removeprefix(OPTIM).rpartition(".")
        if name not in known or not field:
            raise CheckpointError(f"{where}: {key} is not the state of a parameter of the optimizer")
        fields.setdefault(name, set()).add(field)
    local = getattr(optimizer, "optim", optimizer)  # a ZeroRedundancyOptimizer's: this rank's
    if len(kinds := sorted(map(sorted, {frozenset(f) for f in fields.values()} | {  # else the next step fails
            frozenset(k for k, v in state.items() if v is not None) for state in local.state.values() if state}))) > 1:
        raise CheckpointError(f"{where}: the states of the parameters hold the fields {kinds} (the checkpoint's and "
                              "the optimizer's must match)")
    params, into = dict(model.named_parameters()), {}
    wanted = {id(p) for g in local.param_groups for p in g["params"]}  # a ZeroRedundancyOptimizer's: its own
    for name, i in index.items():
        for field in sorted(fields.get(source[name], ()) if id(param := params[name]) in wanted else ()):
            (size, dtype), key = stored[f"{OPTIM}{source[name]}.{field}"], f"{OPTIM}{source[name]}.{field}"
            boxes[key] = boxes[MODEL + name] if size else Box((), (), ())  # its parameter's
            want = param.dtype if size and param.is_floating_point() and dtype.is_floating_point else dtype
            tensors[key], into[key] = torch.empty(boxes[key].sizes, dtype=want), (i, field, param if size else None)

    def state_dict() -> dict[str, Any]:  # a state shaped like its parameter lies like it
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, (i, field, home) in into.items():
            state.setdefault(i, {})[field] = tensors[key] if home is None else like(tensors[key], home)
        return {"state": state, "param_groups": groups}

    return state_dict


def _generators(states: dict[str, torch.Tensor], saved: tuple[int, ...], mesh: Mesh, where: Path) -> Callable[[], None]:
    """What restores this rank's generator states (each saving rank's checked first): its own at the saving layout;
    at another, the streams equal on every saving rank (the bitwise mode's tp streams), warning of the rest."""
    world, by_stream = math.prod(saved), dict[str, dict[int, torch.Tensor]](cpu={})
    for key, state in sorted(states.items()):
        if not (match := _RNG.fullmatch(key)) or int(match[1]) >= world:
            raise CheckpointError(f"{where}: {key} is not a generator state of ranks 0-{world - 1}")
        by_stream.setdefault(stream := match[2], {})[int(match[1])] = state
        try:
            if stream == "tp.base" and (state.dtype, state.numel()) != (torch.int64, 1):
                raise ValueError(f"a seed is one int64, not {state.dtype} of shape {tuple(state.shape)}")
            if stream != "tp.base" and (torch.cuda.is_available() or "cuda" not in stream):
                torch.Generator("cuda" if "cuda" in stream else "cpu").set_state(state)
        except (RuntimeError, ValueError, TypeError) as e:
            raise CheckpointError(f"{where}: {key} is no valid generator state ({e})") from None
    if missing := sorted(f"rng.rank{r}.{s}" for s, by in by_stream.items() for r in range(world) if r not in by):
        raise CheckpointError(f"{where}: {missing[0]} is missing")
    same = saved == (mesh.tp, mesh.dp, mesh.pp)
    mine = {s: by[mesh.rank] if same else by[0] for s, by in by_stream.items()
            if same or all(torch.equal(v, by[0]) for v in by.values())}

    def restore() -> None:
        if lost := sorted(set(by_stream) - set(mine)):
            warnings.warn(f"{where.parent} was saved at (tp, dp, pp) = {saved}, this run is "
                          f"{(mesh.tp, mesh.dp, mesh.pp)}: the generator streams {lost} differ by rank and are not "
                          "restored" + " (the tp streams restart from their base seed)" * any("tp." in s for s in lost),
                          stacklevel=3)
        for stream, set_state in (("cpu", torch.set_rng_state), ("cuda", torch.cuda.set_rng_state)):
            if stream in mine and (stream == "cpu" or torch.cuda.is_available()):
                set_state(mine[stream])
        tp, base = {k[3:]: v for k, v in mine.items() if k.startswith("tp.") and k != "tp.base"}, mine.get("tp.base")
        if base is not None or tp:
            tp_streams(mesh).load_state_dict({"rank": mesh.tp_rank, "states": tp,
                                              "base": None if base is None else int(base.item())})

    return restore


def read_meta(path: str | Path) -> dict[str, Any]:
    """The checkpoint's metadata (with ``"path"``: its directory), every file checked against the manifest."""
    return {**files.read_manifest(directory := files.resolve(path)), "path": str(directory)}


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         cast: bool = False, mesh: Mesh | None = None) -> dict[str, Any]:
    """Load a checkpoint saved at any (tp, dp, pp), with or without FSDP2, into ``model`` (and ``optimizer``) and
    return its metadata (a collective). A missing, corrupt, edited or mismatched checkpoint raises
    :class:`CheckpointError` on every rank, modifying nothing; another dtype is refused unless ``cast=True``."""
    mesh, error, optimizer_state = mesh or current_mesh(), None, None
    try:
        directory = files.resolve(path)
        meta, where = files.read_manifest(directory, (mesh.rank, mesh.world_size)), directory / MANIFEST
        saved, ours, theirs = (meta["tp"], meta["dp"], meta["pp"]), config_dict(model), meta["config"]
        if ours is not None and theirs is not None and ours != theirs:
            raise CheckpointError(f"{where}: config does not match the model's (" + ", ".join(f"{k}: checkpoint "
                                  f"{theirs.get(k)!r}, model {ours.get(k)!r}" for k in sorted(ours | theirs)
                                  if ours.get(k) != theirs.get(k)) + ")")
        stored, (local, boxes) = _stored(directory, meta), local_state(model, None, mesh)  # boxes: the model's
        if (other := sorted(k for k in stored if k.startswith(MODEL) and k not in boxes)) and mesh.pp == 1:
            raise CheckpointError(f"{where}: the checkpoint holds {other[:4]}, which the model lacks")
        tensors = {k: torch.empty(box.sizes, dtype=local[k].dtype) for k, box in boxes.items()}
        if optimizer is not None:
            optimizer_state = _optimizer(meta, stored, where, model, optimizer, tensors, boxes)
        for key, value in tensors.items():
            (size, dtype), want = stored.get(key, ((), None)), (value.dtype, boxes[key].size)
            if key not in stored or size != want[1] or (dtype != want[0] and not cast):
                raise CheckpointError(f"{where}: the checkpoint lacks {key}" if key not in stored else
                                      f"{where}: {key} is stored as {dtype} of shape {size}, the model's is {want[0]} "
                                      f"of shape {want[1]}" + " (load(..., cast=True) converts it)" * (size == want[1]))
        states = {k: torch.empty(size, dtype=dtype) for k, (size, dtype) in stored.items() if k.startswith("rng.")}
        _read(directory, tensors | states, BoxLoadPlanner(boxes))
        restore = _generators(states, saved, mesh, where)
    except Exception as e:  # noqa: BLE001 - every rank learns of it below, then every rank raises
        error = e
    agree(error, mesh, "load the checkpoint")
    # everything is read and checked on every rank: only now is anything modified
    model.load_state_dict({k: like(tensors[MODEL + k], v) for k, v in model.state_dict().items()})
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state())  # type: ignore[union-attr]
    restore()
    return {**meta, "path": str(directory)}


def export_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The checkpoint's unsharded model state dict, for the plain model (no process group needed)."""
    directory = files.resolve(path)
    full = {k: torch.empty(size, dtype=dtype) for k, (size, dtype) in
            _stored(directory, files.read_manifest(directory)).items() if k.startswith(MODEL)}
    _read(directory, full)
    return {k.removeprefix(MODEL): v for k, v in full.items()}


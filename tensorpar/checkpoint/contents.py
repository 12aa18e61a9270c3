"""A model's and its optimizer's state as DCP names it: ``model.<key>`` and
``optim.state.<parameter>.<field>`` (a state shaped like its parameter lies like it; a scalar is a
tensor of its own). A ``ZeroRedundancyOptimizer``'s rank writes and reads the parameters it owns.
The optimizer's groups go to ``meta.json`` and must match the optimizer's on load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..full import is_dtensor, placements
from .files import CheckpointError
from .layout import Box, locate

MODEL, OPTIM = "model.", "optim.state."
Entries = Mapping[str, tuple[tuple[int, ...], torch.dtype]]  # name -> (full size, dtype), from DCP's metadata


def model_pieces(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Box]]:
    """``(tensors, boxes)`` of the model's state on this rank, by name."""
    where, tensors, boxes = placements(model), {}, {}
    for key, value in model.state_dict().items():
        tensors[MODEL + key], boxes[MODEL + key] = locate(value.detach(), *where.get(key, (None, None)))
    return tensors, boxes


def _check(name: str, entries: Entries, box: Box, dtype: torch.dtype, where: Path, cast: bool) -> None:
    size, stored = entries[name]
    if size != box.size:
        raise CheckpointError(f"{where}: {name}: the checkpoint holds shape {size}, "
                              f"the model's full shape is {box.size}")
    if stored != dtype and not cast:
        raise CheckpointError(f"{where}: {name} is stored as {stored}, the model's is {dtype} "
                              "(load(..., cast=True) converts it)")


def model_destinations(model: nn.Module, entries: Entries, where: Path, *, cast: bool,
                       stage: bool) -> tuple[dict[str, torch.Tensor], dict[str, Box]]:
    """Empty tensors to read this rank's boxes of the model into, after checking that the checkpoint
    holds the model's keys (and no others, unless the model is one pipeline ``stage``), shapes, dtypes."""
    local, boxes = model_pieces(model)
    stored = {k for k in entries if k.startswith(MODEL)}
    if missing := sorted(k.removeprefix(MODEL) for k in set(boxes) - stored):
        raise CheckpointError(f"{where}: the checkpoint lacks {missing}")
    if (unexpected := sorted(k.removeprefix(MODEL) for k in stored - set(boxes))) and not stage:
        raise CheckpointError(f"{where}: the checkpoint holds {unexpected}, which the model lacks")
    for key, box in boxes.items():
        _check(key, entries, box, local[key].dtype, where, cast)
    return {k: torch.empty(box.sizes, dtype=entries[k][1]) for k, box in boxes.items()}, boxes


def like(value: torch.Tensor, current: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``value`` (this rank's local part) on the device and of the kind (DTensor or not) of ``current``."""
    dtype = dtype or current.dtype
    if is_dtensor(current):
        return DTensor.from_local(value.to(dtype=dtype, device=current.to_local().device), current.device_mesh,
                                  current.placements, run_check=False, shape=current.shape, stride=current.stride())
    return value.to(dtype=dtype, device=current.device)


def apply_model(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    model.load_state_dict({k: like(tensors[MODEL + k], v) for k, v in model.state_dict().items()})


# --- the optimizer ------------------------------------------------------------------------------

def _local(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state: a ``ZeroRedundancyOptimizer``'s local one, or itself."""
    inner = getattr(optimizer, "optim", None)
    return inner if hasattr(optimizer, "consolidate_state_dict") and isinstance(inner, torch.optim.Optimizer) \
        else optimizer


def grouped_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    names = {id(p): name for name, p in model.named_parameters()}
    if any(id(p) not in names for group in optimizer.param_groups for p in group["params"]):
        raise CheckpointError("the optimizer holds a tensor that is not a parameter of the model")
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def param_groups(optimizer: torch.optim.Optimizer, rows: list[list[list[str]]]) -> list[dict[str, Any]]:
    """The groups for ``meta.json``: hyper-parameters, and the names of the parameters of every rank
    (``rows``: each rank's :func:`grouped_names`; pipeline stages hold different parameters)."""
    for i, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            if key != "params" and not _storable(value):
                raise CheckpointError(f"param_groups[{i}].{key} = {value!r} cannot be stored in meta.json "
                                      "(numbers, strings, booleans, None and lists of them can)")
    if len({len(row) for row in rows}) > 1:
        raise CheckpointError(f"the ranks' optimizers have different numbers of parameter groups "
                              f"({sorted({len(row) for row in rows})})")
    names = [list(dict.fromkeys(n for row in rows for n in row[i])) for i in range(len(rows[0]))]
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in group.items() if k != "params"} | {"params": n}
            for group, n in zip(optimizer.param_groups, names, strict=True)]


def _storable(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str)) or \
        (isinstance(value, (list, tuple)) and all(map(_storable, value)))


def optim_pieces(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Box]]:
    """``(tensors, boxes)`` of this rank's optimizer state, by name."""
    names, where, tensors, boxes = {id(p): n for n, p in model.named_parameters()}, placements(model), {}, {}
    for param, fields in _local(optimizer).state.items():
        for field, value in fields.items():
            if value is None:  # SGD without momentum: nothing to store
                continue
            value, key = torch.as_tensor(value).detach(), f"{OPTIM}{names[id(param)]}.{field}"
            if value.dim() and tuple(value.shape) != tuple(param.shape):
                raise CheckpointError(f"{key} has shape {tuple(value.shape)}, its parameter {tuple(param.shape)}: "
                                      "only states shaped like their parameter, and scalars, are checkpointed")
            tensors[key], boxes[key] = locate(value, *(where.get(names[id(param)], (None, None)) if value.dim()
                                                       else (None, None)))
    return tensors, boxes


def _conform(saved: Any, current: Any, where: str) -> Any:
    """``saved`` in the structure and type of ``current``, or a CheckpointError naming ``where``."""
    flag = (bool, type(None))
    kinds = {bool: flag, type(None): flag, int: (int,), float: (int, float), str: (str,)}  # JSON types it may be
    if isinstance(current, (list, tuple)):
        if isinstance(saved, list) and len(saved) == len(current):
            return type(current)(_conform(s, c, f"{where}[{i}]")
                                 for i, (s, c) in enumerate(zip(saved, current, strict=True)))
    elif type(saved) in kinds.get(type(current), ()):
        return float(saved) if type(current) is float else saved
    kind = f"a list of {len(current)}" if isinstance(current, (list, tuple)) else type(current).__name__
    raise CheckpointError(f"{where} must be {kind} like the optimizer's {current!r} (it is {saved!r})")


def _groups(meta: Mapping[str, Any], where: Path, model: nn.Module,
            optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The checkpoint's groups as ``load_state_dict`` takes them."""
    saved, stored = meta["param_groups"], {n for g in meta["param_groups"] for n in g["params"]}
    copies = getattr(model, "tied_copies", {})  # a copy of a tied parameter may be stored as the original only
    ours = [[copies.get(n, n) if n not in stored else n for n in g] for g in grouped_names(model, optimizer)]
    mine = {n for g in ours for n in g}
    if len(saved) != len(ours):
        raise CheckpointError(f"{where}: param_groups lists {len(saved)} group{'s' * (len(saved) != 1)}, "
                              f"the optimizer has {len(ours)}")
    groups, start = [], 0
    for i, (group, current, names) in enumerate(zip(saved, optimizer.param_groups, ours, strict=True)):
        held = set(group["params"]) & mine  # a pipeline stage holds some of the checkpoint's parameters
        if held != set(names):
            lacks, others = sorted(set(names) - held), sorted(held - set(names))
            problems = [f"lacks {lacks[:3]}{'...' * (len(lacks) > 3)}"] * bool(lacks)
            problems += [f"holds {others[:3]}, which the optimizer puts in another group"] * bool(others)
            raise CheckpointError(f"{where}: param_groups[{i}] {' and '.join(problems)} (its parameters, or their "
                                  "grouping, differ from the optimizer's)")
        keys, expected = set(group) - {"params"}, set(current) - {"params"}
        if keys != expected:
            problems = [f"lacks {sorted(expected - keys)}"] * bool(expected - keys)
            problems += [f"has {sorted(keys - expected)}, which the optimizer lacks"] * bool(keys - expected)
            raise CheckpointError(f"{where}: param_groups[{i}] {' and '.join(problems)}")
        groups.append({k: _conform(group[k], current[k], f"{where}: param_groups[{i}].{k}") for k in sorted(keys)}
                      | {"params": list(range(start, start + len(names)))})
        start += len(names)
    return groups


def optim_destinations(meta: Mapping[str, Any], entries: Entries, where: Path, model: nn.Module,
                       optimizer: torch.optim.Optimizer, *, cast: bool
                       ) -> tuple[dict[str, torch.Tensor], dict[str, Box], Callable[[], dict[str, Any]]]:
    """``(tensors to read into, their boxes, the optimizer's state dict once they are read)``, after
    checking the groups and, for every parameter with state, its fields, full shapes and dtypes."""
    groups = _groups(meta, where, model, optimizer)
    order = {n: i for i, n in enumerate(n for g in grouped_names(model, optimizer) for n in g)}
    params, found, local = dict(model.named_parameters()), placements(model), _local(optimizer)
    names = {id(p): n for n, p in params.items()}
    current = {names[id(p)]: {k: v for k, v in f.items() if v is not None} for p, f in local.state.items() if f}
    known = {n for g in meta["param_groups"] for n in g["params"]} | set(order)
    stored: dict[str, set[str]] = {}
    for key in entries:
        if key.startswith(OPTIM):
            name, _, field = key.removeprefix(OPTIM).rpartition(".")
            if name not in known or not field:
                raise CheckpointError(f"{where}: {key} is not the state of a parameter of the optimizer")
            stored.setdefault(name, set()).add(field)
    sources = {n: n for n in stored if n in order}
    for copy, original in getattr(model, "tied_copies", {}).items():
        if copy in order and copy not in sources and original in stored:
            sources[copy] = original
    first = min(sources, key=order.__getitem__, default="")
    for name, source in sources.items():  # a missing field would fail only in the optimizer's next step
        now = current.get(name)
        if now is not None and stored[source] != set(now):
            raise CheckpointError(f"{where}: the state of {name} holds {sorted(stored[source])}, "
                                  f"the optimizer's holds {sorted(now)}")
        if stored[source] != stored[sources[first]]:
            raise CheckpointError(f"{where}: the state of {name} holds {sorted(stored[source])}, "
                                  f"that of {first} holds {sorted(stored[sources[first]])}")
    wanted = {names[id(p)] for g in local.param_groups for p in g["params"]}
    tensors, boxes, into = {}, {}, {}
    for name in sorted(set(sources) & wanted, key=order.__getitem__):
        param, source = params[name], sources[name]
        for field in sorted(stored[source]):
            key = f"{OPTIM}{source}.{field}"
            size, dtype = entries[key]
            box = locate(param, *found.get(name, (None, None)))[1] if size else Box((), (), ())
            now = current.get(name, {}).get(field)
            want = param.dtype if size and param.is_floating_point() and dtype.is_floating_point else \
                now.dtype if isinstance(now, torch.Tensor) else dtype
            _check(key, entries, box, want, where, cast)
            tensors[key], boxes[key] = torch.empty(box.sizes, dtype=dtype), box
            into[key] = (order[name], field, param if size else None, want)  # a state shaped like param lies like it

    def state_dict() -> dict[str, Any]:
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, (i, field, home, dtype) in into.items():
            value = tensors[key]
            state.setdefault(i, {})[field] = value.to(dtype) if home is None else like(value, home, dtype)
        return {"state": state, "param_groups": groups}

    return tensors, boxes, state_dict

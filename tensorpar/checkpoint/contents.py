"""A model's and its optimizer's state as DCP names it: ``model.<key>`` and
``optim.state.<parameter>.<field>`` (a state shaped like its parameter lies like it; a scalar is a
tensor of its own). A ``ZeroRedundancyOptimizer``'s rank writes and reads the parameters it owns.
The optimizer's groups go to ``meta.json`` and must match the optimizer's on load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..full import is_dtensor, placements
from .files import CheckpointError
from .layout import Box, locate

MODEL, OPTIM = "model.", "optim.state."


def model_pieces(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Box]]:
    """``(tensors, boxes)`` of the model's state on this rank, by name."""
    where, tensors, boxes = placements(model), {}, {}
    for key, value in model.state_dict().items():
        tensors[MODEL + key], boxes[MODEL + key] = locate(value.detach(), *where.get(key, (None, None)))
    return tensors, boxes


def like(value: torch.Tensor, current: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``value`` (this rank's local part) on the device and of the kind (DTensor or not) of ``current``."""
    dtype = dtype or current.dtype
    if is_dtensor(current):
        return DTensor.from_local(value.to(dtype=dtype, device=current.to_local().device), current.device_mesh,
                                  current.placements, run_check=False, shape=current.shape, stride=current.stride())
    return value.to(dtype=dtype, device=current.device)


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
    if len({len(row) for row in rows}) > 1:
        raise CheckpointError(f"the ranks' optimizers have different numbers of parameter groups "
                              f"({sorted({len(row) for row in rows})})")
    return [{k: v for k, v in group.items() if k != "params"}
            | {"params": list(dict.fromkeys(n for row in rows for n in row[i]))}
            for i, group in enumerate(optimizer.param_groups)]


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


def _fits(saved: Any, current: Any) -> bool:
    """Whether the JSON value ``saved`` can stand for the hyper-parameter ``current``."""
    if isinstance(current, (list, tuple)):
        return isinstance(saved, list) and len(saved) == len(current) and all(map(_fits, saved, current))
    return type(saved) is type(current) or (type(saved), type(current)) == (int, float) or \
        {type(saved), type(current)} == {bool, type(None)}


def _groups(saved: list[Any], where: object, names: list[list[str]],
            optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The checkpoint's groups as ``load_state_dict`` takes them (``names``: the optimizer's, as stored)."""
    if len(saved) != len(names):
        raise CheckpointError(f"{where}: param_groups lists {len(saved)} group{'s' * (len(saved) != 1)}, "
                              f"the optimizer has {len(names)}")
    mine, groups, start = {n for g in names for n in g}, [], 0
    for i, (group, current, ours) in enumerate(zip(saved, optimizer.param_groups, names, strict=True)):
        held = set(group.get("params", ())) & mine if isinstance(group, dict) else None  # a pp stage holds some
        if held != set(ours):
            raise CheckpointError(f"{where}: param_groups[{i}] lacks {sorted(set(ours) - (held or set()))[:3]} and "
                                  f"holds {sorted((held or set()) - set(ours))[:3]} of the optimizer's group (its "
                                  "parameters, or their grouping, differ)")
        if set(group) != set(current):
            raise CheckpointError(f"{where}: param_groups[{i}] has the keys {sorted(group)}, the optimizer's group "
                                  f"{sorted(current)}")
        for key in sorted(set(current) - {"params"}):
            if not _fits(group[key], current[key]):
                raise CheckpointError(f"{where}: param_groups[{i}].{key} is {group[key]!r}, which cannot stand "
                                      f"for the optimizer's {current[key]!r}")
        groups.append({k: type(current[k])(group[k]) if isinstance(current[k], (tuple, float)) else group[k]
                       for k in current} | {"params": list(range(start, start + len(ours)))})
        start += len(ours)
    return groups


def optim_destinations(meta: Mapping[str, Any], stored: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                       where: object, model: nn.Module, optimizer: torch.optim.Optimizer
                       ) -> tuple[dict[str, torch.Tensor], dict[str, Box], Callable[[], dict[str, Any]]]:
    """``(tensors to read into, their boxes, the optimizer's state dict once they are read)``, after
    checking the groups and that every parameter's state holds the same fields as the optimizer's."""
    known = {n for g in meta["param_groups"] if isinstance(g, dict) for n in g.get("params", ())}
    copies = getattr(model, "tied_copies", {})  # a copy of a tied parameter may be stored as the original only
    names = [[copies.get(n, n) if n not in known else n for n in g] for g in grouped_names(model, optimizer)]
    groups = _groups(meta["param_groups"], where, names, optimizer)
    order = {n for g in names for n in g}  # the optimizer's parameters, as stored
    fields: dict[str, set[str]] = {}
    for key in stored:
        name, _, field = key.removeprefix(OPTIM).rpartition(".")
        if key.startswith(OPTIM) and (name not in known or not field):
            raise CheckpointError(f"{where}: {key} is not the state of a parameter of the optimizer")
        if key.startswith(OPTIM) and name in order:
            fields.setdefault(name, set()).add(field)
    params, found, local = dict(model.named_parameters()), placements(model), _local(optimizer)
    current = [frozenset(k for k, v in local.state[p].items() if v is not None) for p in params.values()
               if local.state.get(p)]
    if len(held := {frozenset(f) for f in fields.values()} | set(current)) > 1:  # else the next step would fail
        raise CheckpointError(f"{where}: the states of the parameters hold the fields {sorted(map(sorted, held))} "
                              "(the checkpoint's and the optimizer's must all be alike)")
    tensors, boxes, into = {}, {}, {}
    wanted = {id(p) for g in local.param_groups for p in g["params"]}
    for i, (name, source) in enumerate(zip([n for g in grouped_names(model, optimizer) for n in g],
                                           [n for g in names for n in g], strict=True)):
        param = params[name]
        for field in sorted(fields.get(source, ()) if id(param) in wanted else ()):
            key = f"{OPTIM}{source}.{field}"
            size, dtype = stored[key]
            box = locate(param, *found.get(name, (None, None)))[1] if size else Box((), (), ())
            now = local.state.get(param, {}).get(field)
            want = param.dtype if size and param.is_floating_point() and dtype.is_floating_point else \
                now.dtype if isinstance(now, torch.Tensor) else dtype
            tensors[key], boxes[key] = torch.empty(box.sizes, dtype=want), box
            into[key] = (i, field, param if size else None)  # a state shaped like param lies like it

    def state_dict() -> dict[str, Any]:
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, (i, field, home) in into.items():
            value = tensors[key]
            state.setdefault(i, {})[field] = value if home is None else like(value, home, value.dtype)
        return {"state": state, "param_groups": groups}

    return tensors, boxes, state_dict

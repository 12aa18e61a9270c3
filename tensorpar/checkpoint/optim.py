"""Optimizer state in a checkpoint: each parameter's state tensors, as boxes of full tensors.

A state tensor is named ``optim.state.<parameter>.<field>``
(``optim.state.h.0.mlp.fc1.weight.exp_avg``). One shaped like its parameter
lies where the parameter does (its tp shard, and under FSDP2 its dp chunk: see
:mod:`.boxes`); a scalar (AdamW's ``step``) is one tensor of its own. Each is
written once, by one of the ranks holding it. ``ZeroRedundancyOptimizer``
keeps each parameter's state on one dp rank only, and that rank writes it and,
on load, reads the state of just the parameters it owns in the new layout: no
rank ever holds the whole optimizer state. The parameter groups go to
``meta.json`` (see :mod:`.groups`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..full import placements
from ..mesh import Mesh
from .boxes import Box, locate, written
from .groups import check_groups, positions
from .index import Entry
from .manifest import CheckpointError
from .meta import OPTIM
from .state import check_entry, like


def _spread(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """The local optimizer of a ``ZeroRedundancyOptimizer`` (which holds the state of the parameters
    this rank owns), or None for an optimizer that holds all its state."""
    inner = getattr(optimizer, "optim", None)
    return inner if hasattr(optimizer, "consolidate_state_dict") and isinstance(inner, torch.optim.Optimizer) else None


def _owned(optimizer: torch.optim.Optimizer) -> Mapping[Any, Mapping[str, Any]]:
    """``{parameter: state}`` held on this rank."""
    return (_spread(optimizer) or optimizer).state


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def pieces(model: nn.Module, optimizer: torch.optim.Optimizer,
           mesh: Mesh) -> tuple[dict[str, torch.Tensor], dict[str, Box]]:
    """``(tensors, boxes)``: the optimizer state chunks that this rank writes, by name."""
    names, where, spread = _names(model), placements(model), _spread(optimizer) is not None
    tensors, boxes = {}, {}
    for param, fields in _owned(optimizer).items():
        name = names[id(param)]
        for field, value in fields.items():
            if value is None:  # SGD without momentum keeps momentum_buffer = None: nothing to store
                continue
            value, key = torch.as_tensor(value), f"{OPTIM}{name}.{field}"
            if value.dim() and tuple(value.shape) != tuple(param.shape):
                raise CheckpointError(f"{key} has shape {tuple(value.shape)}, its parameter {tuple(param.shape)}: "
                                      "only states shaped like their parameter, and scalars, are checkpointed")
            placement, group = where.get(name, (None, None)) if value.dim() else (None, None)
            local, box, dp_split = locate(value, placement, group)
            mine = written(box, key, tp_split=placement is not None, dp_split=dp_split or spread, mesh=mesh)
            if mine is not None:
                tensors[key], boxes[key] = local.detach(), mine
    return tensors, boxes


def _home(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.Tensor:
    """A tensor on the device and of the dtype where ``optimizer`` keeps state shaped like ``param``:
    ``param`` itself, unless the optimizer names another through ``state_like(param)`` (the host
    float32 master copy of ``tensorpar.OffloadedOptimizer``)."""
    state_like = getattr(optimizer, "state_like", None)
    return param if state_like is None else state_like(param)


def _expected_dtype(param: torch.Tensor, now: Any, shape: tuple[int, ...], stored: torch.dtype) -> torch.dtype:
    """The dtype the optimizer keeps a state in: that of ``param`` (its :func:`_home`) for a float tensor
    shaped like it (as torch's ``load_state_dict`` would cast it), else that of the state it holds now,
    else as stored."""
    if shape and param.is_floating_point() and stored.is_floating_point:
        return param.dtype
    return now.dtype if isinstance(now, torch.Tensor) else stored


def _stored_fields(entries: Mapping[str, Entry], order: Mapping[str, int], known: set[str], copies: Mapping[str, str],
                   where: Path) -> dict[str, tuple[str, set[str]]]:
    """``{parameter: (the name its state is stored under, the state's fields)}`` for the optimizer's
    parameters, after checking that every state stored is that of a parameter of the checkpoint's
    groups (``known``: the optimizer's, and on a pipeline stage those of the other stages). A copy of
    a tied parameter (``copies``: {copy: original}) whose own state is not stored takes the original's."""
    stored: dict[str, set[str]] = {}
    for key in entries:
        if key.startswith(OPTIM):
            name, _, field = key.removeprefix(OPTIM).rpartition(".")
            if name not in known or not field:
                raise CheckpointError(f"{where}: {key} is not the state of a parameter of the optimizer")
            stored.setdefault(name, set()).add(field)
    found = {name: (name, fields) for name, fields in stored.items() if name in order}
    for copy, original in copies.items():
        if copy in order and copy not in found and original in stored:
            found[copy] = (original, stored[original])
    return found


def destinations(meta: Mapping[str, Any], entries: Mapping[str, Entry], where: Path, model: nn.Module,
                 optimizer: torch.optim.Optimizer, *, cast: bool
                 ) -> tuple[dict[str, torch.Tensor], dict[str, Box], Callable[[], dict[str, Any]]]:
    """``(tensors to read into, their boxes, a function giving the state dict once they are read)``, after
    checking the groups and, for every parameter with state, its fields, full shapes and dtypes."""
    groups, order = check_groups(meta, where, model, optimizer), positions(model, optimizer)
    params, names, found = dict(model.named_parameters()), _names(model), placements(model)
    current = {names[id(p)]: {k: v for k, v in fields.items() if v is not None}
               for p, fields in _owned(optimizer).items() if fields and id(p) in names}
    local = _spread(optimizer)
    wanted = {names[id(p)] for group in (local or optimizer).param_groups for p in group["params"]}
    known = {name for group in meta["param_groups"] for name in group["params"]} | set(order)
    stored = _stored_fields(entries, order, known, getattr(model, "tied_copies", {}), where)
    first = min(stored, key=order.__getitem__, default="")
    for name, (_, fields) in stored.items():  # a missing field would fail only in the optimizer's next step
        now = current.get(name)
        if now is not None and fields != set(now):
            raise CheckpointError(f"{where}: the state of {name} holds {sorted(fields)}, "
                                  f"the optimizer's holds {sorted(now)}")
        if fields != stored[first][1]:
            raise CheckpointError(f"{where}: the state of {name} holds {sorted(fields)}, "
                                  f"that of {first} holds {sorted(stored[first][1])}")
    tensors, boxes, like_what = {}, {}, {}
    for name in sorted(set(stored) & wanted, key=order.__getitem__):
        param, (source, fields) = params[name], stored[name]
        for field in sorted(fields):
            key = f"{OPTIM}{source}.{field}"
            entry = entries[key]
            shaped = bool(entry.size)
            box = locate(param, *found.get(name, (None, None)))[1] if shaped else Box((), (), ())
            home = _home(local or optimizer, param)
            dtype = _expected_dtype(home, current.get(name, {}).get(field), entry.size, entry.dtype)
            check_entry(key, entry, box, dtype, where, cast=cast)
            tensors[key], boxes[key] = torch.empty(box.sizes, dtype=entry.dtype), box
            like_what[key] = (name, field, home if shaped else None, dtype)

    def state_dict() -> dict[str, Any]:
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            name, field, param, dtype = like_what[key]
            state.setdefault(order[name], {})[field] = value.to(dtype) if param is None else like(value, param, dtype)
        return {"state": state, "param_groups": groups}

    return tensors, boxes, state_dict

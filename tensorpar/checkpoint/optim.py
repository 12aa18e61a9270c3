"""Optimizer state in a checkpoint: gathered unsharded on save, checked and sliced on load.

Each parameter's state is stored unsharded under ``"<param>/<field>"``
(``"h.0.mlp.fc1.weight/exp_avg"``): a tensor shaped like the parameter's shard
is gathered across tp like the parameter, and ``ZeroRedundancyOptimizer``'s
state, spread over dp ranks, is first gathered to the first dp rank as
safetensors bytes over tensor collectives (not through its pickling
``consolidate_state_dict``). The hyper-parameters of each group go to
``meta.json``; on load they must have the structure of the optimizer's own
(a float where it has a float, two numbers for ``betas``...), so no edit can
hand the optimizer a value of another kind.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..full import Placements, placements, unshard
from ..mesh import Mesh
from .manifest import CheckpointError
from .state import read_local
from .tensors import Reader, gather


def _spread(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """The local optimizer of a ``ZeroRedundancyOptimizer`` (which holds the state of the parameters
    this rank owns), or None for an optimizer that holds all its state."""
    inner = getattr(optimizer, "optim", None)
    return inner if hasattr(optimizer, "consolidate_state_dict") and isinstance(inner, torch.optim.Optimizer) else None


def _owned(optimizer: torch.optim.Optimizer) -> Mapping[Any, Mapping[str, Any]]:
    """``{parameter: state}`` held on this rank."""
    return (_spread(optimizer) or optimizer).state


def grouped_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The names of each optimizer group's parameters (each must be a parameter of ``model``)."""
    names = {id(p): name for name, p in model.named_parameters()}
    if any(id(p) not in names for group in optimizer.param_groups for p in group["params"]):
        raise CheckpointError("the optimizer holds a tensor that is not a parameter of the model")
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def _positions(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Each parameter's index in the optimizer's state dict (its place over all groups)."""
    return {name: i for i, name in enumerate(n for group in grouped_names(model, optimizer) for n in group)}


def _storable(value: Any) -> bool:
    scalar = value is None or isinstance(value, (bool, int, float, str))
    return scalar or (isinstance(value, (list, tuple)) and all(_storable(v) for v in value))


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each group's hyper-parameters (every key but ``params``), checked to be storable in JSON."""
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            if key != "params" and not _storable(value):
                raise CheckpointError(f"param_groups[{i}].{key} = {value!r} cannot be stored in meta.json "
                                      "(numbers, strings, booleans, None and lists of them can)")
        groups.append({k: list(v) if isinstance(v, tuple) else v for k, v in group.items() if k != "params"})
    return groups


def collect(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh,
            gathers: bool) -> dict[str, torch.Tensor]:
    """Every parameter's optimizer state, unsharded, on the ranks that ``gathers`` (a collective)."""
    names = {id(p): name for name, p in model.named_parameters()}
    local = {f"{names[id(p)]}/{field}": torch.as_tensor(value) for p, fields in _owned(optimizer).items()
             for field, value in fields.items()}
    if _spread(optimizer) is not None:  # to the first rank of its group (of dp ranks), which gathers
        parts = gather(local, getattr(optimizer, "process_group", None), mesh.device)
        local = {k: v for part in parts or [] for k, v in part.items()}
    if not gathers:
        return {}
    where, order = placements(model), _positions(model, optimizer)
    tensors = {}
    for key in sorted(local, key=lambda k: (order[k.rpartition("/")[0]], k)):  # the same order on every tp rank
        value, name = local[key], key.rpartition("/")[0]
        if name in where and value.dim() > 0:  # shaped like the shard: gather like it
            value = unshard(value.to(mesh.device), *where[name])
        tensors[key] = value.detach().cpu().contiguous()
    return tensors


def _conform(saved: Any, current: Any, where: str) -> Any:
    """``saved`` in the structure and type of ``current`` (a float where it has a float, a tuple of as
    many items where it has a tuple...), or a CheckpointError naming ``where``."""
    if isinstance(current, (list, tuple)):
        if isinstance(saved, list) and len(saved) == len(current):
            return type(current)(_conform(s, c, f"{where}[{i}]") for i, (s, c) in enumerate(zip(saved, current)))
    elif current is None or isinstance(current, bool):  # flags, where None means "choose"
        if saved is None or isinstance(saved, bool):
            return saved
    elif isinstance(current, int):
        if type(saved) is int:
            return saved
    elif isinstance(current, float):
        if type(saved) in (int, float):
            return float(saved)
    elif isinstance(current, str) and isinstance(saved, str):
        return saved
    kind = f"a list of {len(current)}" if isinstance(current, (list, tuple)) else type(current).__name__
    raise CheckpointError(f"{where} must be {kind} like the optimizer's {current!r} (it is {saved!r})")


def check_groups(meta: Mapping[str, Any], where: Path, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The checkpoint's param groups as ``optimizer.load_state_dict`` takes them, after checking that
    they name the optimizer's parameters and carry hyper-parameters of the optimizer's structure."""
    ours = grouped_names(model, optimizer)
    saved = meta["param_groups"]
    if [group["params"] for group in saved] != ours:
        raise CheckpointError("the optimizer's parameters (or their grouping) differ from the checkpoint's")
    groups, start = [], 0
    for i, (group, current) in enumerate(zip(saved, optimizer.param_groups)):
        keys, expected = set(group) - {"params"}, set(current) - {"params"}
        if keys != expected:
            problems = [f"lacks {sorted(expected - keys)}"] * bool(expected - keys)
            problems += [f"has {sorted(keys - expected)}, which the optimizer lacks"] * bool(keys - expected)
            raise CheckpointError(f"{where}: param_groups[{i}] {' and '.join(problems)}")
        hyper = {k: _conform(group[k], current[k], f"{where}: param_groups[{i}].{k}") for k in sorted(keys)}
        groups.append(hyper | {"params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    return groups


def _expected_dtype(param: torch.Tensor, now: Any, shape: tuple[int, ...], stored: torch.dtype) -> torch.dtype:
    """The dtype the optimizer keeps a state in: the parameter's for a float tensor shaped like it (as
    torch's ``load_state_dict`` would cast it), else that of the state it holds now, else as stored."""
    if shape and param.is_floating_point() and stored.is_floating_point:
        return param.dtype
    return now.dtype if isinstance(now, torch.Tensor) else stored


def read_state(f: Reader, meta: Mapping[str, Any], where: Path, model: nn.Module,
               optimizer: torch.optim.Optimizer, placed: Placements, *, cast: bool) -> dict[str, Any]:
    """The optimizer's state dict from ``f`` and ``meta`` (this rank's slices), checked before returning:
    known parameters, full shapes, dtypes, and the same fields for every parameter with state."""
    groups, order = check_groups(meta, where, model, optimizer), _positions(model, optimizer)
    params = dict(model.named_parameters())
    names = {id(p): name for name, p in params.items()}
    current = {names[id(p)]: fields for p, fields in _owned(optimizer).items() if fields and id(p) in names}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key in f.keys():
        name, _, field = key.rpartition("/")
        if name not in order or not field:
            raise CheckpointError(f"{f.path}: {key} is not the state of a parameter of the optimizer")
        shape, stored = f.info(key)
        like = _expected_dtype(params[name], current.get(name, {}).get(field), shape, stored)
        placement, group = placed.get(name, (None, None)) if shape else (None, None)
        state.setdefault(name, {})[field] = read_local(f, key, placement, group, params[name].shape if shape else (),
                                                       like, cast=cast)
    first = min(state, key=order.__getitem__, default="")
    for name, fields in state.items():  # a missing field would fail only in the optimizer's next step
        now = current.get(name)
        if now is not None and set(fields) != set(now):
            raise CheckpointError(f"{f.path}: the state of {name} holds {sorted(fields)}, "
                                  f"the optimizer's holds {sorted(now)}")
        if set(fields) != set(state[first]):
            raise CheckpointError(f"{f.path}: the state of {name} holds {sorted(fields)}, "
                                  f"that of {first} holds {sorted(state[first])}")
    return {"state": {order[name]: s for name, s in state.items()}, "param_groups": groups}

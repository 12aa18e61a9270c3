"""An optimizer's parameter groups in a checkpoint: the names of each group's parameters and its
hyper-parameters, stored in ``meta.json``.

On load the groups must name the optimizer's parameters, grouped alike, and each
hyper-parameter must have the structure of the optimizer's own (a float where it
has a float, two numbers for ``betas``...), so no edit can hand the optimizer a
value of another kind.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .manifest import CheckpointError


def grouped_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The names of each optimizer group's parameters (each must be a parameter of ``model``)."""
    names = {id(p): name for name, p in model.named_parameters()}
    if any(id(p) not in names for group in optimizer.param_groups for p in group["params"]):
        raise CheckpointError("the optimizer holds a tensor that is not a parameter of the model")
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def merged_names(rows: list[dict[str, Any]], n_groups: int) -> list[list[str]]:
    """Each group's parameter names over every rank's ``rows[r]["names"]`` (pipeline stages hold different
    parameters), each name once, in rank order."""
    if any(len(row["names"]) != n_groups for row in rows):
        raise CheckpointError(f"the ranks' optimizers have different numbers of parameter groups "
                              f"({sorted({len(row['names']) for row in rows})})")
    merged: list[dict[str, None]] = [{} for _ in range(n_groups)]
    for row in rows:
        for group, names in zip(merged, row["names"], strict=True):
            group.update(dict.fromkeys(names))
    return [list(group) for group in merged]


def positions(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
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


def conform(saved: Any, current: Any, where: str) -> Any:
    """``saved`` in the structure and type of ``current`` (a float where it has a float, a tuple of as
    many items where it has a tuple...), or a CheckpointError naming ``where``."""
    if isinstance(current, (list, tuple)):
        if isinstance(saved, list) and len(saved) == len(current):
            return type(current)(conform(s, c, f"{where}[{i}]")
                                 for i, (s, c) in enumerate(zip(saved, current, strict=True)))
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
    stored = {name for group in saved for name in group["params"]}
    copies = getattr(model, "tied_copies", {})  # a copy of a tied parameter may be stored as the original only
    ours = [[copies.get(n, n) if n not in stored else n for n in group] for group in ours]
    mine = {name for group in ours for name in group}
    # a pipeline stage holds some of the checkpoint's parameters: those it holds must be grouped alike
    if len(saved) != len(ours):
        raise CheckpointError(f"{where}: param_groups lists {len(saved)} group{'s' * (len(saved) != 1)}, the optimizer "
                              f"has {len(ours)}")
    for i, (group, names) in enumerate(zip(saved, ours, strict=True)):
        held = set(group["params"]) & mine
        if held != set(names):
            lacks, others = sorted(set(names) - held), sorted(held - set(names))
            problems = [f"lacks {lacks[:3]}{'...' * (len(lacks) > 3)}"] * bool(lacks)
            problems += [f"holds {others[:3]}{'...' * (len(others) > 3)}, which the optimizer puts in another "
                         "group"] * bool(others)
            raise CheckpointError(f"{where}: param_groups[{i}] {' and '.join(problems)} (its parameters, or their "
                                  "grouping, differ from the optimizer's)")
    groups, start = [], 0
    for i, (group, current, names) in enumerate(zip(saved, optimizer.param_groups, ours, strict=True)):
        keys, expected = set(group) - {"params"}, set(current) - {"params"}
        if keys != expected:
            problems = [f"lacks {sorted(expected - keys)}"] * bool(expected - keys)
            problems += [f"has {sorted(keys - expected)}, which the optimizer lacks"] * bool(keys - expected)
            raise CheckpointError(f"{where}: param_groups[{i}] {' and '.join(problems)}")
        hyper = {k: conform(group[k], current[k], f"{where}: param_groups[{i}].{k}") for k in sorted(keys)}
        groups.append(hyper | {"params": list(range(start, start + len(names)))})
        start += len(names)
    return groups

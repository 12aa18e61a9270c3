"""What a checkpoint holds, as DCP names it: ``model.<key>``; ``optim.state.<parameter>.<field>`` (a
state shaped like its parameter lies like it; a scalar is a tensor of its own; a ``ZeroRedundancyOptimizer``'s
rank writes and reads the parameters it owns; the groups go to ``meta.json``); ``rng.rank<r>.<stream>``,
torch's generator states (``cpu``, ``cuda``) and the mesh's tp streams (``tp.<device>``, ``tp.base``).
At the saving layout each rank restores its own; at another, a stream equal on every saving rank (in
the bitwise mode the tp streams are) is restored, and a warning names each one that differs by rank."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from ..full import is_dtensor, placements
from ..mesh import Mesh
from ..random import tracker as tp_streams
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
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def grouped_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The names of the parameters of each of the optimizer's groups."""
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


def optim_destinations(meta: Mapping[str, Any], stored: Mapping[str, Any], where: object, model: nn.Module,
                       optimizer: torch.optim.Optimizer
                       ) -> tuple[dict[str, torch.Tensor], dict[str, Box], Callable[[], dict[str, Any]]]:
    """``(tensors to read into, their boxes, the optimizer's state dict once they are read)``, after
    checking the groups and that every parameter's state holds the same fields as the optimizer's."""
    saved = meta["param_groups"]
    known = {n for g in saved if isinstance(g, dict) for n in g.get("params", ())}
    copies = getattr(model, "tied_copies", {})  # a copy of a tied parameter may be stored as the original only
    own = grouped_names(model, optimizer)
    names = [[copies.get(n, n) if n not in known else n for n in g] for g in own]  # as stored
    if len(saved) != len(names):
        raise CheckpointError(f"{where}: param_groups lists {len(saved)} group{'s' * (len(saved) != 1)}, "
                              f"the optimizer has {len(names)}")
    groups, start, mine = [], 0, {n for g in names for n in g}
    for i, (group, current, ours) in enumerate(zip(saved, optimizer.param_groups, names, strict=True)):
        held = set(group.get("params", ())) & mine if isinstance(group, dict) else set()
        if held != set(ours):  # a pipeline stage holds some of the checkpoint's parameters
            raise CheckpointError(f"{where}: param_groups[{i}] lacks {sorted(set(ours) - held)[:3]} and holds "
                                  f"{sorted(held - set(ours))[:3]} of the optimizer's group (its parameters, or "
                                  "their grouping, differ)")
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
    fields: dict[str, set[str]] = {}
    for key in (k for k in stored if k.startswith(OPTIM)):
        name, _, field = key.removeprefix(OPTIM).rpartition(".")
        if name not in known or not field:
            raise CheckpointError(f"{where}: {key} is not the state of a parameter of the optimizer")
        fields.setdefault(name, set()).add(field)
    params, found, local = dict(model.named_parameters()), placements(model), _local(optimizer)
    held_fields = {frozenset(f) for f in fields.values()} | {  # else the optimizer's next step would fail
        frozenset(k for k, v in local.state[p].items() if v is not None) for p in params.values() if local.state.get(p)}
    if len(held_fields) > 1:
        raise CheckpointError(f"{where}: the states of the parameters hold the fields "
                              f"{sorted(map(sorted, held_fields))} (the checkpoint's and the optimizer's must match)")
    tensors, boxes, into = {}, {}, {}
    wanted = {id(p) for g in local.param_groups for p in g["params"]}  # a ZeroRedundancyOptimizer's: its own
    for i, (name, source) in enumerate(zip([n for g in own for n in g], [n for g in names for n in g], strict=True)):
        param = params[name]
        for field in sorted(fields.get(source, ()) if id(param) in wanted else ()):
            key = f"{OPTIM}{source}.{field}"
            (size, dtype), now = stored[key], local.state.get(param, {}).get(field)
            want = param.dtype if size and param.is_floating_point() and dtype.is_floating_point else \
                now.dtype if isinstance(now, torch.Tensor) else dtype
            boxes[key] = locate(param, *found.get(name, (None, None)))[1] if size else Box((), (), ())
            tensors[key], into[key] = torch.empty(boxes[key].sizes, dtype=want), (i, field, param if size else None)

    def state_dict() -> dict[str, Any]:  # a state shaped like its parameter lies like it
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, (i, field, home) in into.items():
            value = tensors[key]
            state.setdefault(i, {})[field] = value if home is None else like(value, home, value.dtype)
        return {"state": state, "param_groups": groups}

    return tensors, boxes, state_dict


# --- generator states ----------------------------------------------------------------------------

_KEY = re.compile(r"rng\.rank(\d+)\.(cpu|cuda|tp\.base|tp\.(?:cpu|cuda(?::\d+)?))")


def rng_streams(mesh: Mesh) -> dict[str, torch.Tensor]:
    """This rank's generator states under their checkpoint names."""
    mine = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        mine["cuda"] = torch.cuda.get_rng_state()
    tracker = tp_streams(mesh).state_dict()
    mine |= {f"tp.{device}": state for device, state in tracker["states"].items()}
    if tracker["base"] is not None:
        mine["tp.base"] = torch.tensor([tracker["base"]], dtype=torch.int64)
    return {f"rng.rank{mesh.rank}.{k}": v for k, v in mine.items()}


def rng_destinations(stored: Mapping[str, tuple[tuple[int, ...], torch.dtype]], world: int,
                 where: object) -> dict[str, torch.Tensor]:
    """Empty tensors to read every saving rank's states into, after checking that each rank has each."""
    found: dict[str, set[int]] = {"cpu": set()}
    for key in (k for k in stored if k.startswith("rng.")):
        if not (match := _KEY.fullmatch(key)) or int(match[1]) >= world:
            raise CheckpointError(f"{where}: {key} is not a generator state of ranks 0-{world - 1}")
        found.setdefault(match[2], set()).add(int(match[1]))
    for stream, ranks in sorted(found.items()):
        if missing := sorted(set(range(world)) - ranks):
            raise CheckpointError(f"{where}: rng.rank{missing[0]}.{stream} is missing")
    return {k: torch.empty(size, dtype=dtype) for k, (size, dtype) in stored.items() if k.startswith("rng.")}


def rng_chosen(states: Mapping[str, torch.Tensor], same_layout: bool, rank: int,
           where: object) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``(the state of each stream this rank restores, the streams it cannot)``, after checking that a
    scratch generator accepts each state."""
    by_stream: dict[str, dict[int, torch.Tensor]] = {}
    for key, state in states.items():
        match = _KEY.fullmatch(key)
        assert match is not None, key  # checked by rng_destinations()
        by_stream.setdefault(match[2], {})[int(match[1])] = state
        try:
            if match[2] == "tp.base" and (state.dtype, state.numel()) != (torch.int64, 1):
                raise ValueError(f"a seed is one int64, not {state.dtype} of shape {tuple(state.shape)}")
            if match[2] != "tp.base" and (torch.cuda.is_available() or "cuda" not in match[2]):
                torch.Generator("cuda" if "cuda" in match[2] else "cpu").set_state(state)
        except (RuntimeError, ValueError, TypeError) as e:
            raise CheckpointError(f"{where}: {key} is no valid generator state ({e})") from None
    mine = {s: by[rank] if same_layout else by[0] for s, by in by_stream.items()
            if same_layout or all(torch.equal(v, by[0]) for v in by.values())}
    return mine, sorted(set(by_stream) - set(mine))


def rng_restore(mine: Mapping[str, torch.Tensor], lost: list[str], mesh: Mesh, where: object,
                saved: tuple[int, ...]) -> None:
    """Set this rank's generators (and the mesh's tp streams) to ``mine``; warn naming the ``lost`` ones."""
    if lost:
        warnings.warn(f"{where} was saved at (tp, dp, pp) = {saved}, this run is {(mesh.tp, mesh.dp, mesh.pp)}: the "
                      f"generator streams {lost} differ by rank and are not restored"
                      + " (the tp streams restart from their base seed)" * any(s.startswith("tp.") for s in lost),
                      stacklevel=3)
    if "cpu" in mine:
        torch.set_rng_state(mine["cpu"])
    if "cuda" in mine and torch.cuda.is_available():
        torch.cuda.set_rng_state(mine["cuda"])
    tp = {k.removeprefix("tp."): v for k, v in mine.items() if k.startswith("tp.") and k != "tp.base"}
    if "tp.base" in mine or tp:
        base = mine.get("tp.base")
        tp_streams(mesh).load_state_dict({"rank": mesh.tp_rank, "states": tp,
                                          "base": None if base is None else int(base.item())})

"""The tensorpar checkpoint format: its files, its directory names, its state-dict keys, and the
fields of its ``meta.json``, each checked for type before anything uses it.

``meta.json`` holds ``format``, ``step``, ``tp``, ``dp``, the model's ``config``
(a dataclass as a JSON object, or null), ``param_groups`` (each optimizer group's
hyper-parameters and its parameters' names), ``extra`` (the caller's JSON object),
``tensors`` (where every chunk of every tensor lies, see :mod:`.index`), and the
manifest's ``files`` and ``meta_sha256`` (see :mod:`.manifest`).

The tensors are named as ``torch.distributed.checkpoint`` names a flattened
``{"model": model.state_dict(), "optim": optimizer_state_dict}``:
``model.<key>``, ``optim.state.<parameter>.<field>``; each rank's generator
states are ``rng.rank<r>.<generator>``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from .manifest import CheckpointError

FORMAT = "tensorpar-checkpoint/3"
MODEL, OPTIM, RNG = "model.", "optim.state.", "rng."
#: a checkpoint directory's name: ``step-`` and the step, at least 6 digits
NAME = re.compile(r"step-\d{6,}")


def shard_file(rank: int, world: int) -> str:
    """The name of the file that global rank ``rank`` of ``world`` writes."""
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


def shard_files(world: int) -> list[str]:
    """The data files of a checkpoint saved by ``world`` ranks, in rank order."""
    return [shard_file(r, world) for r in range(world)]


def dirname(step: int) -> str:
    """The directory name of the checkpoint of ``step``."""
    return f"step-{step:06d}"


def step_of(name: str) -> int:
    """The step of a checkpoint directory name (see :data:`NAME`)."""
    return int(name.removeprefix("step-"))


def whole(value: object, minimum: int) -> bool:
    """Whether ``value`` is an ``int`` (not a ``bool``) of at least ``minimum``."""
    return type(value) is int and value >= minimum


def as_json(value: Any, what: str) -> Any:
    """``value`` as JSON gives it back (tuples become lists), or a CheckpointError naming ``what``."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what} is not JSON-serialisable: {e}") from None


def config_dict(model: nn.Module) -> dict[str, Any] | None:
    """The model's ``config`` dataclass as JSON gives it back, or None when it has none. Fields whose
    metadata says ``{"state": False}`` (how the model runs, not what it holds) are left out."""
    config = getattr(model, "config", None)
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        return None
    fields = {f.name for f in dataclasses.fields(config) if f.metadata.get("state", True)}
    return as_json({k: v for k, v in dataclasses.asdict(config).items() if k in fields}, "the model's config")


MAX_WORLD = 1 << 16  # a larger tp x dp x pp is no checkpoint this library wrote


def world_of(meta: Mapping[str, Any]) -> int:
    """The number of ranks that wrote the checkpoint: tp x dp x pp (pp is 1 when not recorded)."""
    return meta["tp"] * meta["dp"] * meta.get("pp", 1)


def layout_of(meta: Mapping[str, Any]) -> tuple[int, int, int]:
    """``(tp, dp, pp)`` of the ranks that wrote the checkpoint."""
    return meta["tp"], meta["dp"], meta.get("pp", 1)


def check_fields(meta: Mapping[str, Any], where: Path) -> None:
    """Raise a CheckpointError naming ``where`` and the field unless every field the loader uses
    has the type it expects (the values are checked against the model and optimizer later)."""
    for key, minimum in (("step", 0), ("tp", 1), ("dp", 1)):
        if not whole(meta.get(key), minimum):
            raise CheckpointError(f"{where}: {key} must be an integer >= {minimum} (it is {meta.get(key)!r})")
    if "pp" in meta and not whole(meta["pp"], 1):
        raise CheckpointError(f"{where}: pp must be an integer >= 1 (it is {meta['pp']!r})")
    if world_of(meta) > MAX_WORLD:
        raise CheckpointError(f"{where}: tp x dp x pp must be at most {MAX_WORLD} (it is {world_of(meta)})")
    config = meta.get("config")
    if config is not None and not isinstance(config, dict):
        raise CheckpointError(f"{where}: config must be an object or null (it is {config!r})")
    if not isinstance(meta.get("extra"), dict):
        raise CheckpointError(f"{where}: extra must be an object (it is {meta.get('extra')!r})")
    groups = meta.get("param_groups")
    if not isinstance(groups, list):
        raise CheckpointError(f"{where}: param_groups must be a list (it is {groups!r})")
    for i, group in enumerate(groups):
        names = group.get("params") if isinstance(group, dict) else None
        if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
            raise CheckpointError(f"{where}: param_groups[{i}] must be an object with a list of parameter "
                                  f"names under 'params' (it is {group!r})")


def check_config(meta: Mapping[str, Any], model: nn.Module, where: Path) -> None:
    """Raise unless the checkpoint's model config (in ``where``) equals the model's (when both have one)."""
    ours, theirs = config_dict(model), meta.get("config")
    if ours is not None and theirs is not None and ours != theirs:
        diff = ", ".join(f"{k}: checkpoint {theirs.get(k)!r}, model {ours.get(k)!r}"
                         for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k))
        raise CheckpointError(f"{where}: config does not match the model's ({diff})")

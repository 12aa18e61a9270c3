"""Generator states: torch's (``cpu``, ``cuda``) and the mesh's tp streams (``tp.<device>``,
``tp.base``). A state equal on every saving rank is stored once as ``rng.<stream>`` and restored at
any layout; one that differs by rank as ``rng.rank<r>.<stream>``, restored only at the saving layout.
"""

from __future__ import annotations

import hashlib
import re
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch

from ..mesh import Mesh
from ..random import tracker as tp_streams
from .files import CheckpointError

RNG = "rng."
_KEY = re.compile(r"rng\.(?:rank(\d+)\.)?(cpu|cuda|tp\.base|tp\.(?:cpu|cuda(?::\d+)?))")


def streams(mesh: Mesh) -> dict[str, torch.Tensor]:
    """This rank's generator states by stream name."""
    mine = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        mine["cuda"] = torch.cuda.get_rng_state()
    tracker = tp_streams(mesh).state_dict()
    mine |= {f"tp.{device}": state for device, state in tracker["states"].items()}
    if tracker["base"] is not None:
        mine["tp.base"] = torch.tensor([tracker["base"]], dtype=torch.int64)
    return mine


def digests(mine: Mapping[str, torch.Tensor]) -> dict[str, str]:
    return {k: hashlib.sha256(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in mine.items()}


def named(mine: Mapping[str, torch.Tensor], every: list[dict[str, str]], rank: int) -> dict[str, torch.Tensor]:
    """This rank's states under their checkpoint names, given every rank's :func:`digests`."""
    common = {k for k in mine if all(row.get(k) == every[0].get(k) for row in every)}
    return {(f"{RNG}{k}" if k in common else f"{RNG}rank{rank}.{k}"): v for k, v in mine.items()}


def destinations(entries: Mapping[str, tuple[tuple[int, ...], torch.dtype]], world: int, same_layout: bool,
                 rank: int, where: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Empty tensors to read the states this rank restores into, and the streams it cannot restore,
    after checking every state's name, dtype and size."""
    cpu, found, lost, tensors = torch.get_rng_state().numel(), set(), set(), {}
    for key, (size, dtype) in entries.items():
        if not key.startswith(RNG):
            continue
        match = _KEY.fullmatch(key)
        if not match or (match[1] is not None and int(match[1]) >= world):
            raise CheckpointError(f"{where}: {key} is not a generator state of ranks 0-{world - 1}")
        stream = match[2]
        expected = ((1,), torch.int64) if stream == "tp.base" else ((cpu,), torch.uint8) if stream.endswith("cpu") \
            else None  # CUDA's: at most as large as a CPU state (16 bytes: seed, offset)
        if (size, dtype) != expected if expected else dtype != torch.uint8 or len(size) != 1 or size[0] > cpu:
            raise CheckpointError(f"{where}: {key} must be {expected or f'a state of at most {cpu} bytes'} "
                                  f"(it is {dtype} of shape {size})")
        found.add(stream if match[1] is None else f"{stream}@{match[1]}")
        if match[1] is None or (same_layout and int(match[1]) == rank):
            tensors[key] = torch.empty(size, dtype=dtype)
        elif not same_layout:
            lost.add(stream)
    ranked = {s.partition("@")[0] for s in found if "@" in s}  # every rank must have each stream that differs
    for stream in sorted(ranked | ({"cpu"} - found)):
        for r in range(world):
            if f"{stream}@{r}" not in found:
                raise CheckpointError(f"{where}: {RNG}rank{r}.{stream} is missing")
    return tensors, sorted(lost)


def check(states: Mapping[str, torch.Tensor], where: Path) -> None:
    """Raise unless a scratch generator of each state's device accepts it."""
    for key, state in states.items():
        cuda = "cuda" in key.rpartition(".")[2]
        if key.endswith("tp.base") or (cuda and not torch.cuda.is_available()):
            continue
        try:
            torch.Generator("cuda" if cuda else "cpu").set_state(state)
        except (RuntimeError, ValueError, TypeError) as e:
            raise CheckpointError(f"{where}: {key} is no valid generator state ({e})") from None


def restore(states: Mapping[str, torch.Tensor], lost: list[str], mesh: Mesh, saved: tuple[int, ...],
            where: Path) -> None:
    """Set this rank's generators (and the mesh's tp streams) to ``states``; warn naming the ``lost`` ones."""
    mine = {_KEY.fullmatch(k)[2]: v for k, v in states.items()}  # type: ignore[index]
    if lost:
        warnings.warn(f"{where} was saved at (tp, dp, pp) = {saved}, this run is {(mesh.tp, mesh.dp, mesh.pp)}: the "
                      f"generator streams {lost} differ by rank and are not restored"
                      + (" (the tp streams restart from their base seed)" if any(s.startswith("tp.") for s in lost)
                         else ""), stacklevel=3)
    if "cpu" in mine:
        torch.set_rng_state(mine["cpu"])
    if "cuda" in mine and torch.cuda.is_available():
        torch.cuda.set_rng_state(mine["cuda"])
    tp = {k.removeprefix("tp."): v for k, v in mine.items() if k.startswith("tp.") and k != "tp.base"}
    if "tp.base" in mine or tp:
        base = mine.get("tp.base")
        tp_streams(mesh).load_state_dict({"rank": mesh.tp_rank, "states": tp,
                                  "base": None if base is None else int(base.item())})

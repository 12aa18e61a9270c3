"""Every rank's random-generator states in a checkpoint.

Rank ``r`` stores, in its own file, ``rng.rank<r>.cpu`` (torch's CPU generator),
``rng.rank<r>.cuda`` (the current CUDA generator, when CUDA is in use),
``rng.rank<r>.tp.<device>`` (its tensor-parallel streams, see
:mod:`tensorpar.random`) and ``rng.rank<r>.tp.base`` (their base seed, once
drawn). On load at the same (tp, dp) every rank checks the entries of every rank
in the index (names, dtypes, sizes), then reads its own states and checks that a
scratch generator accepts each, before any generator is touched.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch

from ..mesh import Mesh
from .index import Entry
from .manifest import CheckpointError
from .meta import RNG

_KEY = re.compile(r"rng\.rank(\d+)\.(cpu|cuda|tp\.base|tp\.(?:cpu|cuda(?::\d+)?))")


def pieces(mesh: Mesh) -> dict[str, torch.Tensor]:
    """This rank's generator states, keyed ``rng.rank<r>.<name>`` (each written by this rank alone)."""
    mine = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        mine["cuda"] = torch.cuda.get_rng_state()
    tracker = mesh.rng.state_dict()
    mine |= {f"tp.{device}": state for device, state in tracker["states"].items()}
    if tracker["base"] is not None:
        mine["tp.base"] = torch.tensor([tracker["base"]], dtype=torch.int64)
    return {f"{RNG}rank{mesh.rank}.{k}": v for k, v in mine.items()}


def check_index(entries: Mapping[str, Entry], world: int, where: Path) -> None:
    """Raise unless the generator states in the index are those of ranks ``0..world-1``, each of the
    right dtype and size (a CPU state's exactly, a CUDA one at most as large: checked before anything is
    allocated for them), and every rank has its CPU state."""
    cpu_size = torch.get_rng_state().numel()
    found: dict[int, set[str]] = {r: set() for r in range(world)}
    for key, entry in entries.items():
        if not key.startswith(RNG):
            continue
        match = _KEY.fullmatch(key)
        if not match or int(match[1]) >= world:
            raise CheckpointError(f"{where}: {key} is not a generator state of ranks 0-{world - 1}")
        shape, dtype = entry.size, entry.dtype
        if match[2] == "tp.base":
            if (shape, dtype) != ((1,), torch.int64):
                raise CheckpointError(f"{where}: {key} must be one int64 (it is {dtype} of shape {shape})")
        elif match[2].endswith("cpu"):
            if (shape, dtype) != ((cpu_size,), torch.uint8):
                raise CheckpointError(f"{where}: {key} must be {cpu_size} bytes (it is {dtype} of shape {shape})")
        elif dtype != torch.uint8 or len(shape) != 1 or shape[0] > cpu_size:  # CUDA's: 16 bytes (seed, offset)
            raise CheckpointError(f"{where}: {key} must be a generator state of at most {cpu_size} bytes "
                                  f"(it is {dtype} of shape {shape})")
        found[int(match[1])].add(match[2])
    for r, names in found.items():
        if "cpu" not in names:
            raise CheckpointError(f"{where}: {RNG}rank{r}.cpu is missing")


def destinations(entries: Mapping[str, Entry], rank: int) -> dict[str, torch.Tensor]:
    """Empty tensors to read this rank's states into, by key."""
    prefix = f"{RNG}rank{rank}."
    return {k: torch.empty(e.size, dtype=e.dtype) for k, e in entries.items() if k.startswith(prefix)}


def check_states(states: Mapping[str, torch.Tensor], where: Path) -> None:
    """Raise unless a scratch generator of each state's device accepts it."""
    for key, state in states.items():
        if key.endswith(".tp.base"):
            continue
        cuda = "cuda" in key.rpartition(".")[2]
        if cuda and not torch.cuda.is_available():
            continue  # kept for a later run on a GPU; nothing here can use it
        try:
            torch.Generator("cuda" if cuda else "cpu").set_state(state)
        except (RuntimeError, ValueError, TypeError) as e:
            raise CheckpointError(f"{where}: {key} is no valid generator state ({e})") from None


def restore(states: Mapping[str, torch.Tensor], mesh: Mesh) -> None:
    """Set this rank's generators (and the mesh's tp streams) to ``states`` (read by :func:`destinations`)."""
    mine = {k.removeprefix(f"{RNG}rank{mesh.rank}."): v for k, v in states.items()}
    torch.set_rng_state(mine["cpu"])
    if "cuda" in mine and torch.cuda.is_available():
        torch.cuda.set_rng_state(mine["cuda"])
    base = mine.get("tp.base")
    streams = {k.removeprefix("tp."): v for k, v in mine.items() if k.startswith("tp.") and k != "tp.base"}
    mesh.rng.load_state_dict({"rank": mesh.rng.rank, "base": None if base is None else int(base.item()),
                              "states": streams})

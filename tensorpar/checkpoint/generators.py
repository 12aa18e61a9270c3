"""Generator states: torch's (``cpu``, ``cuda``) and the mesh's tp streams (``tp.<device>``,
``tp.base``). A state equal on every saving rank is stored once as ``rng.<stream>`` and restored at
any layout (in the bitwise mode the tp streams are); one that differs by rank as
``rng.rank<r>.<stream>``, restored only at the saving layout (elsewhere a warning names it).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping

import torch

from ..mesh import Mesh
from .files import CheckpointError

_KEY = re.compile(r"rng\.(?:rank(\d+)\.)?(cpu|cuda|tp\.base|tp\.(?:cpu|cuda(?::\d+)?))")


def streams(mesh: Mesh) -> dict[str, torch.Tensor]:
    """This rank's generator states by stream name."""
    mine = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        mine["cuda"] = torch.cuda.get_rng_state()
    tracker = mesh.rng.state_dict()
    mine |= {f"tp.{device}": state for device, state in tracker["states"].items()}
    if tracker["base"] is not None:
        mine["tp.base"] = torch.tensor([tracker["base"]], dtype=torch.int64)
    return mine


def named(every: list[dict[str, torch.Tensor]], rank: int) -> dict[str, torch.Tensor]:
    """This rank's states under their checkpoint names, given every rank's :func:`streams`."""
    common = {k for k, v in every[rank].items() if all(k in row and torch.equal(row[k], v) for row in every)}
    return {(f"rng.{k}" if k in common else f"rng.rank{rank}.{k}"): v for k, v in every[rank].items()}


def destinations(stored: Mapping[str, tuple[tuple[int, ...], torch.dtype]], world: int, same_layout: bool,
                 rank: int, where: object) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Empty tensors to read the states this rank restores into, and the streams it cannot restore."""
    found, tensors = set[tuple[str, int | None]](), {}
    for key, (size, dtype) in stored.items():
        if not key.startswith("rng."):
            continue
        if not (match := _KEY.fullmatch(key)) or (match[1] is not None and int(match[1]) >= world):
            raise CheckpointError(f"{where}: {key} is not a generator state of ranks 0-{world - 1}")
        found.add((match[2], None if match[1] is None else int(match[1])))
        if match[1] is None or (same_layout and int(match[1]) == rank):
            tensors[key] = torch.empty(size, dtype=dtype)
    ranked = {stream for stream, r in found if r is not None}
    for stream, r in [("cpu", None)] * all(s != "cpu" for s, _ in found) + [(s, r) for s in sorted(ranked) for r in range(world)]:
        if (stream, r) not in found:
            raise CheckpointError(f"{where}: rng.{'' if r is None else f'rank{r}.'}{stream} is missing")
    return tensors, sorted(ranked) if not same_layout else []


def restore(states: Mapping[str, torch.Tensor], lost: list[str], mesh: Mesh, where: object, check: bool) -> None:
    """Set this rank's generators (and the mesh's tp streams) to ``states``, or, with ``check``, only
    raise unless a scratch generator accepts each; warn naming the ``lost`` streams."""
    mine = {_KEY.fullmatch(k)[2]: v for k, v in states.items()}  # type: ignore[index]
    for stream, state in mine.items() if check else ():
        try:
            if stream == "tp.base" and (state.dtype, state.numel()) != (torch.int64, 1):
                raise ValueError(f"a seed is one int64, not {state.dtype} of shape {tuple(state.shape)}")
            if stream != "tp.base" and (torch.cuda.is_available() or "cuda" not in stream):
                torch.Generator("cuda" if "cuda" in stream else "cpu").set_state(state)
        except (RuntimeError, ValueError, TypeError) as e:
            raise CheckpointError(f"{where}: rng.{stream} is no valid generator state ({e})") from None
    if check:
        return
    if lost:
        warnings.warn(f"{where}: saved at another (tp, dp, pp) than this run's {(mesh.tp, mesh.dp, mesh.pp)}, the "
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
        mesh.rng.load_state_dict({"rank": mesh.rng.rank, "states": tp,
                                  "base": None if base is None else int(base.item())})

"""Every rank's random-generator states in a checkpoint (``rng.safetensors``).

Rank ``r`` stores ``rank<r>/cpu`` (torch's CPU generator), ``rank<r>/cuda``
(the current CUDA generator, when CUDA is in use), ``rank<r>/tp/<device>`` (its
tensor-parallel streams, see :mod:`tensorpar.random`) and ``rank<r>/tp/base``
(their base seed, once drawn). The states are gathered to the writer as
safetensors bytes over tensor collectives. On load every rank checks the entries
of every rank (names, dtypes, sizes, and that each state is accepted by a
scratch generator), so all ranks accept or refuse the file alike, before any
generator is touched.
"""

from __future__ import annotations

import re

import torch

from ..mesh import Mesh
from .manifest import CheckpointError
from .tensors import Reader, gather

_KEY = re.compile(r"rank(\d+)/(cpu|cuda|tp/base|tp/(?:cpu|cuda(?::\d+)?))")


def collect(mesh: Mesh) -> dict[str, torch.Tensor] | None:
    """Every rank's generator states, keyed ``rank<r>/<name>``, on global rank 0 (a collective)."""
    mine = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        mine["cuda"] = torch.cuda.get_rng_state()
    tracker = mesh.rng.state_dict()
    mine |= {f"tp/{device}": state for device, state in tracker["states"].items()}  # type: ignore[union-attr]
    if tracker["base"] is not None:
        mine["tp/base"] = torch.tensor([tracker["base"]], dtype=torch.int64)
    everyone = gather(mine, None, mesh.device)
    return None if everyone is None else {f"rank{r}/{k}": v for r, states in enumerate(everyone)
                                          for k, v in states.items()}


def _check_state(f: Reader, key: str, state: torch.Tensor) -> None:
    """Raise unless a scratch generator of the state's device accepts ``state``."""
    cuda = "cuda" in key.rpartition("/")[2]
    if cuda and not torch.cuda.is_available():
        return  # kept for a later run on a GPU; nothing here can use it
    try:
        torch.Generator("cuda" if cuda else "cpu").set_state(state)
    except (RuntimeError, ValueError, TypeError) as e:
        raise CheckpointError(f"{f.path}: {key} is no valid generator state ({e})") from None


def read(f: Reader, world: int, rank: int) -> dict[str, torch.Tensor]:
    """This rank's states from ``f`` (written by ``world`` ranks), after checking every rank's."""
    cpu_size = torch.get_rng_state().numel()
    found: dict[int, set[str]] = {r: set() for r in range(world)}
    states = {}
    for key in f.keys():
        match = _KEY.fullmatch(key)
        if not match or int(match[1]) >= world:
            raise CheckpointError(f"{f.path}: {key} is not a generator state of ranks 0-{world - 1}")
        shape, dtype = f.info(key)
        if match[2] == "tp/base":
            if (shape, dtype) != ((1,), torch.int64):
                raise CheckpointError(f"{f.path}: {key} must be one int64 (it is {dtype} of shape {shape})")
        else:
            size = cpu_size if match[2].endswith("cpu") else None
            if dtype != torch.uint8 or len(shape) != 1 or (size is not None and shape[0] != size):
                raise CheckpointError(f"{f.path}: {key} must be {size or 'a vector of'} bytes "
                                      f"(it is {dtype} of shape {shape})")
            _check_state(f, key, states.setdefault(key, f.read(key)))
        found[int(match[1])].add(match[2])
    for r, names in found.items():
        if "cpu" not in names:
            raise CheckpointError(f"{f.path}: rank{r}/cpu is missing")
    prefix = f"rank{rank}/"
    return {k.removeprefix(prefix): states[k] if k in states else f.read(k) for k in f.keys() if k.startswith(prefix)}


def restore(states: dict[str, torch.Tensor], mesh: Mesh) -> None:
    """Set this rank's generators (and the mesh's tp streams) to ``states`` (from :func:`read`)."""
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    base = states.get("tp/base")
    streams = {k.removeprefix("tp/"): v for k, v in states.items() if k.startswith("tp/") and k != "tp/base"}
    mesh.rng.load_state_dict({"rank": mesh.rng.rank, "base": None if base is None else int(base.item()),
                              "states": streams})

"""Random streams for tensor-parallel regions (Megatron's RNG-states tracker).

* **replicated** regions (residual and embedding dropout) act on tensors every tp rank holds whole and
  must draw the *same* mask: torch's default generator, which ranks seeded alike keep in step;
* **sharded** regions (attention-probability dropout over each rank's own heads) must draw *different*
  masks: they run inside :meth:`RNGStatesTracker.fork`, on a stream of this rank's own, seeded from a base
  seed and the tp rank (without :func:`manual_seed`, the base is one draw of the default generator at the
  first fork, the same on every rank).

Each mesh has one tracker, found by :func:`tracker` (the default mesh's when none is named); modules look
theirs up once, when they are built, so nothing is looked up inside a compiled region.

``torch.utils.checkpoint`` restores only the default generators: :func:`recompute_contexts` is a
``context_fn`` that replays the trackers too, leaving the live streams untouched.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import TypedDict

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .mesh import Mesh, current_mesh

_MASK = (1 << 64) - 1


def mix_seed(base: int, *keys: int) -> int:
    """A non-negative 63-bit seed derived from ``base`` and ``keys`` (splitmix64 chained)."""
    seed = base & _MASK
    for key in keys:  # seed = splitmix64(seed ^ key)
        x = ((seed ^ (key & _MASK)) + 0x9E3779B97F4A7C15) & _MASK
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
        seed = x ^ (x >> 31)
    return seed >> 1


def _swap(device: torch.device, state: torch.Tensor) -> torch.Tensor:
    """Set ``device``'s default generator to ``state``; return the state it had."""
    if device.type == "cuda":
        old = torch.cuda.get_rng_state(device)
        torch.cuda.set_rng_state(state, device)
    else:
        old = torch.get_rng_state()
        torch.set_rng_state(state)
    return old


class TrackerState(TypedDict):
    """An :class:`RNGStatesTracker`'s state, as a checkpoint holds it."""

    rank: int
    base: int | None
    states: dict[str, torch.Tensor]


class RNGStatesTracker:
    """This rank's random stream for sharded regions, one state per device: inside
    ``with tracker().fork(x.device):`` ``F.dropout`` draws a different mask on each tp rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._base: int | None = None
        self._states: dict[str, torch.Tensor] = {}
        self._inside: set[str] = set()

    def seed(self, base: int) -> None:
        """Restart the stream from ``base`` (mixed with this rank)."""
        self._base, self._states = int(base), {}

    @contextlib.contextmanager
    def fork(self, device: torch.device | str | None = None) -> Iterator[None]:
        """Run the block on this rank's stream for ``device`` (default: CPU)."""
        device = torch.device("cpu" if device is None else device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"no random-stream support for device {device}")
        key = str(device)
        if key in self._inside:
            raise RuntimeError(f"RNGStatesTracker.fork({key}) is already active: nested forks would draw "
                               "the same numbers twice")
        if key not in self._states:
            if self._base is None:
                self._base = int(torch.randint(0, 2**62, ()).item())  # the same draw on every rank
            self._states[key] = torch.Generator(device).manual_seed(mix_seed(self._base, self.rank)).get_state()
        outside = _swap(device, self._states[key])
        self._inside.add(key)
        try:
            yield
        finally:
            self._inside.discard(key)
            self._states[key] = _swap(device, outside)

    def state_dict(self) -> TrackerState:
        """The stream's state, for a checkpoint."""
        return {"rank": self.rank, "base": self._base, "states": {k: v.clone() for k, v in self._states.items()}}

    def load_state_dict(self, state: TrackerState) -> None:
        if state["rank"] != self.rank:
            raise ValueError(f"RNG state of tp rank {state['rank']} cannot be loaded on tp rank {self.rank}")
        self._base = state["base"]
        self._states = {k: v.clone() for k, v in state["states"].items()}


# Each live mesh's tracker, per context as the default mesh is: rebuilt (never changed in place) when a
# mesh is first asked for, dropping the trackers of meshes no longer alive.
_trackers: contextvars.ContextVar[tuple[tuple[weakref.ref[Mesh], RNGStatesTracker], ...]] = \
    contextvars.ContextVar("tensorpar_rng_trackers", default=())


def tracker(mesh: Mesh | None = None) -> RNGStatesTracker:
    """The tp stream of ``mesh`` (default: the default mesh), made at the first call for that mesh in this
    context (a new thread, which starts without a default mesh, makes its own)."""
    mesh = current_mesh() if mesh is None else mesh
    live = tuple(pair for pair in _trackers.get() if pair[0]() is not None)
    found = next((t for ref, t in live if ref() is mesh), None)
    if found is None:
        found = RNGStatesTracker(mesh.tp_rank)
        _trackers.set((*live, (weakref.ref(mesh), found)))
    return found


def manual_seed(seed: int, mesh: Mesh | None = None) -> None:
    """Seed torch's default generators (the same on every rank: replicated regions)
    and the tp streams of ``mesh`` (default: the default mesh; different on each tp rank: sharded regions)."""
    torch.manual_seed(seed)
    tracker(mesh).seed(seed)


def recompute_contexts(*trackers: RNGStatesTracker) -> tuple[AbstractContextManager[None],
                                                             AbstractContextManager[None]]:
    """The two contexts ``torch.utils.checkpoint(..., context_fn=...)`` asks for, replaying ``trackers``.

    The trackers' states are noted when torch asks for the contexts, as the checkpointed forward begins
    (where torch notes its own generators'); the second context, around the recomputation, puts them
    back (every forked region draws its masks again) and afterwards restores the live states. While
    ``torch.compile`` traces, the compiled graph recomputes and replays its own draws: the contexts are
    then selective checkpointing's, recomputing every operation. E.g. ``checkpoint(block, x,
    use_reentrant=False, context_fn=functools.partial(recompute_contexts, tracker()))``.
    """
    if torch.compiler.is_compiling():  # traced: the compiled graph recomputes; no Python runs again
        return create_selective_checkpoint_contexts(lambda *_, **__: CheckpointPolicy.PREFER_RECOMPUTE)
    unique = list({id(t): t for t in trackers}.values())
    at_forward = [t.state_dict() for t in unique]  # as torch notes its own generators', before the forward

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        live = [t.state_dict() for t in unique]
        for tracker, state in zip(unique, at_forward, strict=True):
            tracker.load_state_dict(state)
        try:
            yield
        finally:
            for tracker, state in zip(unique, live, strict=True):
                tracker.load_state_dict(state)

    return contextlib.nullcontext(), recompute()

"""Random streams for tensor-parallel regions (Megatron's RNG-states tracker).

Dropout in a tensor-parallel model comes in two kinds:

* **replicated** regions (residual dropout, embedding dropout) act on tensors
  every tp rank holds whole, so every rank must draw the *same* mask: they use
  torch's default generator, which ranks seeded alike keep in step;
* **sharded** regions (attention-probability dropout, where each rank holds
  its own heads) must draw *different* masks on each rank, or the heads of
  different ranks would share one mask pattern. They run inside
  :meth:`RNGStatesTracker.fork`, which swaps in a stream of this rank's own
  and swaps the default state back afterwards, untouched.

The rank's stream is seeded from a base seed and the tp rank; without
:func:`manual_seed` the base is one draw of the default generator, taken at
the first fork (identically on every rank, so ranks stay in step).

Activation checkpointing that recomputes a forked region must restore the
tracker's state too (``torch.utils.checkpoint`` restores only the default
generators): :func:`recompute_contexts` is a ``context_fn`` for
``torch.utils.checkpoint`` that does so, and leaves the live stream untouched
by the recomputation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import TypedDict

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def mix_seed(base: int, *keys: int) -> int:
    """A non-negative 63-bit seed derived from ``base`` and ``keys`` (splitmix64 chained)."""
    seed = base & _MASK
    for key in keys:
        seed = _splitmix64(seed ^ (key & _MASK))
    return seed >> 1


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class TrackerState(TypedDict):
    """An :class:`RNGStatesTracker`'s state, as a checkpoint holds it."""

    rank: int
    base: int | None
    states: dict[str, torch.Tensor]


class RNGStatesTracker:
    """This rank's random stream for sharded regions, one state per device.

    Example::

        mesh = tensorpar.init(tp=2)
        tensorpar.manual_seed(1234)                 # default stream and the tp streams
        with mesh.rng.fork(x.device):
            y = F.dropout(scores, 0.1)              # a different mask on each tp rank
        z = F.dropout(h, 0.1)                       # the same mask on every tp rank
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._base: int | None = None
        self._states: dict[str, torch.Tensor] = {}
        self._inside: set[str] = set()

    def seed(self, base: int) -> None:
        """Restart the stream from ``base`` (mixed with this rank)."""
        self._base, self._states = int(base), {}

    def _device(self, device: torch.device | str | None) -> torch.device:
        device = torch.device("cpu" if device is None else device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"no random-stream support for device {device}")
        return device

    @contextlib.contextmanager
    def fork(self, device: torch.device | str | None = None) -> Iterator[None]:
        """Run the block on this rank's stream for ``device`` (default: CPU)."""
        device = self._device(device)
        key = str(device)
        if key in self._inside:
            raise RuntimeError(f"RNGStatesTracker.fork({key}) is already active: nested forks would draw "
                               "the same numbers twice")
        if key not in self._states:
            if self._base is None:
                self._base = int(torch.randint(0, 2**62, ()).item())  # the same draw on every rank
            self._states[key] = torch.Generator(device).manual_seed(mix_seed(self._base, self.rank)).get_state()
        outside = _get_state(device)
        _set_state(device, self._states[key])
        self._inside.add(key)
        try:
            yield
        finally:
            self._inside.discard(key)
            self._states[key] = _get_state(device)
            _set_state(device, outside)

    def state_dict(self) -> TrackerState:
        """The stream's state, for a checkpoint."""
        return {"rank": self.rank, "base": self._base, "states": {k: v.clone() for k, v in self._states.items()}}

    def load_state_dict(self, state: TrackerState) -> None:
        if state["rank"] != self.rank:
            raise ValueError(f"RNG state of tp rank {state['rank']} cannot be loaded on tp rank {self.rank}")
        self._base = state["base"]
        self._states = {k: v.clone() for k, v in state["states"].items()}


def _recompute_all(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    """A selective-checkpointing policy that recomputes every operation: plain checkpointing."""
    return CheckpointPolicy.PREFER_RECOMPUTE


def recompute_contexts(*trackers: RNGStatesTracker) -> tuple[AbstractContextManager[None],
                                                             AbstractContextManager[None]]:
    """The two contexts ``torch.utils.checkpoint(..., context_fn=...)`` asks for, replaying ``trackers``.

    The first wraps the checkpointed forward and notes each tracker's state as
    it begins; the second wraps the recomputation (during backward): it puts
    those states back, so every forked region draws the masks it drew the
    first time, and afterwards restores the states the trackers had when the
    recomputation began, so the live streams go on as if it never ran. The
    default generator is ``torch.utils.checkpoint``'s own to restore
    (``preserve_rng_state=True``, its default).

    While ``torch.compile`` traces the region, the recomputation becomes
    the compiled graph's, whose random draws torch's partitioner saves or
    replays itself, and no Python runs again: nothing is to replay, and torch
    asks for dispatch-mode contexts there, so the contexts returned then are
    selective checkpointing's, with every operation recomputed. (A region
    that does not compile whole runs eagerly, with the contexts above.)

    Example::

        trackers = (tensorpar.current_mesh().rng,)
        y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False,
                                              context_fn=functools.partial(recompute_contexts, *trackers))
    """
    if torch.compiler.is_compiling():  # traced: the compiled graph recomputes; no Python runs again
        return create_selective_checkpoint_contexts(_recompute_all)
    unique = list({id(t): t for t in trackers}.values())
    at_forward: list[TrackerState] = []

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        at_forward[:] = [t.state_dict() for t in unique]
        yield

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

    return forward(), recompute()

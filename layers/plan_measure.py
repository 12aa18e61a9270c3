"""What a rank really holds during a step, measured: the plan's (:mod:`layers.plan_activations`) check.

* :func:`saved_bytes`: the bytes autograd saves for backward while a forward runs, seen by a
  ``torch.autograd.graph.saved_tensors_hooks`` pack hook, each storage once, parameters (and tensors
  aliasing them) excluded; with activation checkpointing the checkpointed blocks' inputs are added
  (once: torch 2.13's non-reentrant checkpoint saves them through the same hook).
* :class:`LiveBytes`: a ``TorchDispatchMode`` that counts the bytes of every storage an op creates
  while it is alive (a weak reference finalizer takes it off), from given starting tensors, and keeps
  the peak: the step's tensors' high-water mark on any device, the CPU included (where no allocator
  statistics exist). Storages made outside the dispatcher (inside a collective's backend) are not seen.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def saved_bytes(model: nn.Module, forward: Callable[[], Any], *, blocks: Iterable[nn.Module] = ()) -> int:
    """Bytes of the distinct storages autograd saves while ``forward()`` runs, ``model``'s parameters
    excluded, plus the inputs of ``blocks`` (checkpointed blocks: what their recomputation starts from)
    where not already counted. The result of ``forward()`` is dropped after."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}  # data pointer -> bytes

    def note(t: torch.Tensor) -> None:
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.nbytes():
            storages[s.data_ptr()] = s.nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        note(t)
        return t

    hooks = [b.register_forward_pre_hook(lambda _, args: note(args[0])) for b in blocks]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = forward()
    finally:
        for hook in hooks:
            hook.remove()
    del result
    return sum(storages.values())


def peak_saved_bytes(model: nn.Module, step: Callable[[], Any]) -> int:
    """The most bytes autograd holds saved for backward at once while ``step()`` runs forwards and backwards
    (a pipeline's schedule, say): each storage the pack hook sees, ``model``'s parameters excluded, counted
    until it is freed."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    live: dict[int, int] = {}
    peak = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in params and ptr not in live and s.nbytes():
            live[ptr] = s.nbytes()
            weakref.finalize(s, live.pop, ptr, 0)
            peak[0] = max(peak[0], sum(live.values()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return peak[0]


class LiveBytes(TorchDispatchMode):
    """Bytes of the live storages the ops run under it create (and of those given to :meth:`track`), and
    their peak. Each storage is counted once, from its creation (or tracking) until it is freed.

    Example::

        with LiveBytes() as live:
            live.track(model.parameters())
            loss = model(idx, targets); loss.backward(); optimizer.step()
        live.peak
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: dict[int, int] = {}  # data pointer -> bytes

    def track(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Count the storages of ``tensors`` (made before the mode was entered) while they live."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t)

    def _add(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        ptr, n = storage.data_ptr(), storage.nbytes()
        if not n or ptr in self._seen:
            return
        self._seen[ptr] = n
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._drop, ptr)

    def _drop(self, ptr: int) -> None:
        self.live -= self._seen.pop(ptr, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out


def _storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages of ``tensors``."""
    found = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(found.values())


def measure_step(config: Any, micro_batch: int, seq_len: int, *, autocast: torch.dtype | None = None,
                 seed: int = 0) -> dict[str, int]:
    """On every rank of the default mesh's tp group: a :class:`~layers.GPT` of ``config`` trained one AdamW
    step on ``micro_batch`` random sequences of ``seq_len`` tokens (under ``autocast`` where given), then
    measured over a second step: the bytes saved for backward by its forward (:func:`saved_bytes`), the
    peak of the step's live tensors from the forward through ``optimizer.step()`` (:class:`LiveBytes`,
    tracking the parameters, the optimizer state and the batch from the start), and the bytes of the
    parameters, their gradients and the optimizer state."""
    import contextlib

    import tensorpar

    from .gpt import GPT

    tensorpar.manual_seed(seed)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    idx, targets = (torch.randint(0, config.vocab_size, (micro_batch, seq_len), generator=g) for _ in range(2))

    def casting() -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if autocast is None else torch.autocast("cpu", dtype=autocast)

    def forward() -> torch.Tensor:
        with casting():
            return model(idx, targets)

    blocks: Iterable[nn.Module] = model.transformer.h if config.activation_checkpointing else ()  # type: ignore[assignment]
    saved = saved_bytes(model, forward, blocks=blocks)  # the first step's forward: saved, then dropped
    forward().backward()
    optimizer.step()
    optimizer.zero_grad()
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    with LiveBytes() as live:
        live.track([*model.parameters(), *state, idx, targets])
        loss = forward()
        loss.backward()
        grads = _storage_bytes(p.grad for p in model.parameters())
        optimizer.step()
        del loss
    return dict(saved=saved, peak=live.peak, params=_storage_bytes(model.parameters()), grads=grads,
                optimizer=_storage_bytes(state))

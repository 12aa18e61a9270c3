"""What a rank really holds during a step, measured: the plan's (:mod:`layers.plan_activations`) check.

* :func:`saved_bytes`: the bytes autograd saves for backward while a forward runs, seen by a
  ``torch.autograd.graph.saved_tensors_hooks`` pack hook, each storage once, parameters (and tensors
  aliasing them) excluded; with activation checkpointing the checkpointed blocks' inputs are added
  (once: torch 2.13's non-reentrant checkpoint saves them through the same hook).
* :class:`LiveBytes`: a ``TorchDispatchMode`` that counts the bytes of every storage an op creates
  while it is alive (a weak reference finalizer takes it off), from given starting tensors, and keeps
  the peak: the step's tensors' high-water mark on any device, the CPU included (where no allocator
  statistics exist). Storages made outside the dispatcher (inside a collective's backend) are not seen,
  but for the CPU generator's states ``torch.get_rng_state()`` returns (the mode wraps it while entered).
* :func:`build_for_layout` and :func:`measure_state`: the model and optimizer ``examples/train_gpt.py``
  builds for a :class:`~layers.Layout`, and the bytes of its parameters, gradients and optimizer state
  (and DDP's buckets, and the host's under offload) after one optimizer step: the plan's
  (:mod:`layers.plan_state`) check, field by field of :class:`~layers.RankPlan`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

import tensorpar

from .config import GPTConfig
from .gpt import GPT
from .pipeline import PipelinedGPT
from .plan_layout import Layout

#: the :class:`~layers.RankPlan` fields :func:`measure_state` measures
STATE_FIELDS = ("params_bytes", "grads_bytes", "optimizer_bytes", "host_params_bytes", "host_grads_bytes",
                "host_optimizer_bytes", "ddp_bucket_bytes")


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

    A storage a collective (a ``c10d`` op) read or wrote counts as freed right after the last op that used
    it, whenever it is really freed: a gloo process group's worker thread drops its reference to a finished
    collective (and the tensors it holds) when it gets to it, after the caller's ``wait()`` returned, so the
    moment such a buffer goes races with the ops that follow (at tp 3-4 on two cores the peak of one step
    moved by up to 10% between runs). Counted this way (also while a worker still holds one) the peak is the
    same in every run.

    Example::

        with LiveBytes() as live:
            live.track(model.parameters())
            loss = model(idx, targets); loss.backward(); optimizer.step()
        live.peak
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self._seen: dict[int, int] = {}  # data pointer -> bytes
        self._history: list[int] = []  # the live bytes after each storage was added
        self._last_use: dict[int, int] = {}  # data pointer -> the last history entry an op that used it made
        self._collective: set[int] = set()  # data pointers a collective used
        self._lock = threading.RLock()  # a worker thread's frees against this thread's ops

    @property
    def peak(self) -> int:
        """The most bytes live at once so far (a storage a collective used: until its last use, freed or not)."""
        with self._lock:
            history = list(self._history)
            for ptr in self._collective & self._seen.keys():  # alive yet: perhaps only for a worker thread
                n = self._seen[ptr]
                for i in range(self._last_use.get(ptr, len(history) - 1) + 1, len(history)):
                    history[i] -= n
        return max(history, default=0)

    def __enter__(self) -> LiveBytes:
        # the CPU generator's states that torch.get_rng_state() returns are made outside the dispatcher:
        # counted by wrapping it while the mode is on (checkpoints, fork_rng and the tp streams call it)
        get_state = self._get_rng_state = torch.get_rng_state

        def noted() -> torch.Tensor:
            state = get_state()
            self._add(state)
            return state

        torch.get_rng_state = noted
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.get_rng_state = self._get_rng_state
        super().__exit__(*exc)

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
        with self._lock:
            if not n or ptr in self._seen:
                return
            self._seen[ptr] = n
            self.live += n
            self._history.append(self.live)
        weakref.finalize(storage, self._drop, ptr)

    def _drop(self, ptr: int) -> None:
        with self._lock:
            n = self._seen.pop(ptr, 0)
            self.live -= n
            if ptr in self._collective:  # gone since just after its last use, in this count
                self._collective.discard(ptr)
                last = self._last_use.get(ptr, len(self._history) - 1)
                for i in range(last + 1, len(self._history)):
                    self._history[i] -= n
            self._last_use.pop(ptr, None)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        collective = func.namespace == "c10d"
        if collective:  # the worker thread holds what it is given: storages, not the autograd graphs behind them
            args, kwargs = tree_map_only(torch.Tensor, torch.Tensor.detach, (args, kwargs or {}))
        out = func(*args, **(kwargs or {}))
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for t in outputs:
            self._add(t)
        used = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)] + outputs
        ptrs = {t.untyped_storage().data_ptr() for t in used if t.device.type != "meta"}
        with self._lock:
            for ptr in ptrs & self._seen.keys():
                self._last_use[ptr] = len(self._history) - 1
            if collective:
                self._collective |= ptrs & self._seen.keys()
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
    tracking the parameters, the optimizer state, the batch and the tp stream's state from the start), and
    the bytes of the parameters, their gradients and the optimizer state."""
    import contextlib

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
        if config.dropout and tensorpar.current_bitwise() is None:  # the tp stream's state, made before, counted
            with tensorpar.random.tracker().fork():
                pass
        loss = forward()
        loss.backward()
        grads = _storage_bytes(p.grad for p in model.parameters())
        optimizer.step()
        del loss
    return dict(saved=saved, peak=live.peak, params=_storage_bytes(model.parameters()), grads=grads,
                optimizer=_storage_bytes(state))


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind these tensors' local parts (FSDP2's padding included)."""
    found = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        found[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(found.values())


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of these tensors' local elements (no padding)."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def build_for_layout(config: GPTConfig, layout: Layout, mesh: tensorpar.Mesh | None = None
                     ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer as ``examples/train_gpt.py`` builds them for ``layout`` on ``mesh`` (default:
    the current one): a :class:`~layers.GPT`, or a :class:`~layers.PipelinedGPT` where ``pp > 1``, in the
    layout's dtype; FSDP2 over dp on its blocks (with ``CPUOffloadPolicy`` under ``offload_optimizer``)
    where ``dp_sharding`` is ``"fsdp"``; the layout's optimizer over two groups (matrices, vectors), under
    ``ZeroRedundancyOptimizer`` where ``dp_sharding`` is ``"zero"`` and dp > 1. DDP's wrapper is the
    caller's (:func:`measure_state` adds it)."""
    mesh = mesh or tensorpar.current_mesh()
    dtype = getattr(torch, layout.dtype)
    offload: dict[str, Any] = {}
    if layout.offload_optimizer:
        from torch.distributed.fsdp import CPUOffloadPolicy

        offload["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device.type == "cuda")
    model: nn.Module
    if layout.pp > 1:
        model = PipelinedGPT(config, mesh=mesh, dtype=dtype)
        if layout.dp_sharding == "fsdp":
            for stage in model.stages:
                tensorpar.fully_shard_dp(stage, mesh, modules=stage.blocks, **offload)
    else:
        model = GPT(config, dtype=dtype)
        if layout.dp_sharding == "fsdp":
            blocks = cast(nn.ModuleList, model.transformer.h)
            tensorpar.fully_shard_dp(model, mesh, modules=blocks, **offload)
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2]}, {"params": [p for p in params if p.dim() < 2]}]
    kind = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[layout.optimizer]
    optimizer: torch.optim.Optimizer
    if layout.dp_sharding == "zero" and mesh.dp > 1:
        optimizer = ZeroRedundancyOptimizer(groups, optimizer_class=kind, process_group=mesh.dp_group, lr=1e-3)
    else:
        optimizer = kind(groups, lr=1e-3)
    return model, optimizer


def measure_state(config: GPTConfig, layout: Layout, idx: torch.Tensor, targets: torch.Tensor, *, seed: int = 0,
                  mesh: tensorpar.Mesh | None = None) -> tuple[dict[str, int], nn.Module]:
    """On this rank of ``mesh`` (default: the current one; every rank calls it): the model and optimizer of
    :func:`build_for_layout`, seeded with ``seed``, stepped once on this rank's batch ``idx``, ``targets``
    (a 1F1B pipeline step of ``layout.microbatches`` where ``pp > 1``; DDP around the model where dp > 1
    and the layout is not FSDP2's). Returns the bytes it then holds, keyed by :data:`STATE_FIELDS` (the
    distinct storages of the parameters, the gradients and the optimizer state; DDP's flat gradient
    buckets; under offload each in host memory, the device's 0), and the model stepped (DDP's wrapper
    where there is one: what :func:`~layers.plan_rank` reads)."""
    mesh = mesh or tensorpar.current_mesh()
    tensorpar.manual_seed(seed, mesh)
    model, optimizer = build_for_layout(config, layout, mesh)
    stepped = model
    if isinstance(model, PipelinedGPT):
        model.pipeline("1f1b", microbatches=layout.microbatches).step(idx, targets)
        model.finish_gradients()
    else:
        if mesh.dp > 1 and layout.dp_sharding != "fsdp":
            stepped = DistributedDataParallel(model, process_group=mesh.dp_group)
        stepped(idx, targets).backward()
    optimizer.step()
    params = list(model.parameters())
    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    states = [v for s in local.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    grads = [p.grad for p in params]
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    if missing:
        raise RuntimeError(f"no gradient after the step for {missing}")
    held = [g for g in grads if g is not None]
    buckets = sum(int(n) for n in stepped._get_ddp_logging_data()["bucket_sizes"].split(",")) \
        if isinstance(stepped, DistributedDataParallel) else 0  # the reducer's flat gradient buckets
    if layout.offload_optimizer:
        # A GPU run copies each gradient chunk to the host (unpadded, its own tensor); on a CPU that copy is
        # a no-op and the chunks stay views of the reduce-scatter's padded output: count their elements.
        values = (0, 0, 0, storage_bytes(params), tensor_bytes(held), storage_bytes(states), 0)
    else:
        values = (storage_bytes(params), storage_bytes(held), storage_bytes(states), 0, 0, 0, buckets)
    return dict(zip(STATE_FIELDS, values, strict=True)), stepped

"""A sequence-gathered activation kept for backward as this rank's tokens, gathered again there.

Column maps sharing one gathered input (Q, K and V after one ``all_gather_sequence``) would each keep the
whole ``(..., T, C)`` for their weight gradients; inside :func:`save_sequence_shard` autograd keeps
``(..., T_r, C)`` and gathers again once per backward pass (Megatron's re-gather, Korthikanti et al., 2022).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed import ProcessGroup

from .collectives import start_all_gather_along
from .regions import tp_group_rank_size
from .sequence import SEQ_DIM, check_tokens, sequence_sizes


class _Regather:
    """The gathered tokens of one forward's all-gather, gathered again (once per backward pass) when
    backward first needs them, and let go with their last user of that pass."""

    def __init__(self, full: torch.Tensor, local: torch.Tensor, group: ProcessGroup) -> None:
        self.group = group
        self.sizes = sequence_sizes(full.shape[SEQ_DIM], group.size())
        self.offset, self.version = full.storage_offset(), local._version
        self.users, self._left = 0, 0
        self._task: int | None = None
        self._full: torch.Tensor | None = None

    def full(self, local: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The gathered tokens, gathered from ``local()`` where this backward pass has not yet."""
        task = torch._C._current_graph_task_id()
        if self._full is None or task != self._task:  # the forward's call again: the same layout
            mine = local()
            if mine._version != self.version:
                raise RuntimeError(f"this rank's tokens, saved for backward as version {self.version}, were "
                                   f"modified in place (now version {mine._version}): their gathered copy cannot "
                                   "be rebuilt")
            self._full = start_all_gather_along(mine, SEQ_DIM, self.sizes, self.group).wait()
            self._task, self._left = task, self.users
        full = self._full
        self._left -= 1
        if self._left <= 0:  # the pass's last user: let the gathered tokens go with it
            self._full = None
        return full


class _SavedShard:
    """What is saved in place of a view of the gathered tokens: this rank's tokens and the view."""

    def __init__(self, regather: _Regather, local: Any, view: torch.Tensor) -> None:
        self.regather, self.local = regather, local
        self.shape, self.stride, self.offset = view.shape, view.stride(), view.storage_offset()

    def unpack(self, local: Callable[[], torch.Tensor]) -> torch.Tensor:
        full = self.regather.full(local)
        return full.as_strided(self.shape, self.stride, full.storage_offset() + self.offset - self.regather.offset)


@contextlib.contextmanager
def save_sequence_shard(full: torch.Tensor, local: torch.Tensor,
                        group: ProcessGroup | None = None) -> Iterator[None]:
    """Inside the block, whatever autograd saves of ``full`` (the all-gather of the sequence shards ``local``,
    cast as autocast casts) is kept as ``local`` and gathered again, once for all its users, when backward
    first needs it. Saved-tensor policies already active (checkpointing, offloading) are handed ``local``
    instead. While ``torch.compile`` traces it does nothing. Modifying ``local`` in place before backward
    is an error there.

    Example::

        x = tensorpar.all_gather_sequence(shard, seq_len)   # (B, T, C) from (B, T_r, C)
        with tensorpar.save_sequence_shard(x, shard):
            up, gate = up_proj(x), gate_proj(x)              # each keeps (B, T_r, C) for backward
    """
    group, rank, n = tp_group_rank_size(group)
    for what, t in (("full", full), ("local", local)):
        check_tokens(f"save_sequence_shard: {what}", t)
    expected = sequence_sizes(full.shape[SEQ_DIM], n)[rank]
    if local.shape[SEQ_DIM] != expected or full.shape[:SEQ_DIM] != local.shape[:SEQ_DIM] or \
            full.shape[-1] != local.shape[-1]:
        raise ValueError(f"save_sequence_shard: rank {rank}'s tokens of shape {tuple(local.shape)} are not its "
                         f"{expected} of the gathered shape {tuple(full.shape)} over tp {n}")
    if (n == 1 or not torch.is_grad_enabled() or torch.compiler.is_compiling() or not full.is_contiguous()
            or full.numel() == 0):
        yield
        return
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = outer if outer is not None else (lambda t: t, lambda t: t)
    local = local.detach().to(full.dtype)  # a copy only where autocast cast the tokens before gathering them
    # autograd keeps the hooks as long as what they saved: they hold the gathered tokens' address, not them
    regather, dtype, device = _Regather(full, local, group), full.dtype, full.device
    address = full.untyped_storage().data_ptr()

    def pack(t: torch.Tensor) -> Any:
        if t.dtype == dtype and t.device == device and t.numel() and t.untyped_storage().data_ptr() == address:
            regather.users += 1
            return _SavedShard(regather, outer_pack(local), t)  # as many as the outer policy will be asked for
        return outer_pack(t)

    def unpack(saved: Any) -> torch.Tensor:
        if isinstance(saved, _SavedShard):
            return saved.unpack(lambda: outer_unpack(saved.local))
        return outer_unpack(saved)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield

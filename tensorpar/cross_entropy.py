"""Cross-entropy from vocab-sharded logits, without gathering them.

Rank ``r`` holds the logits of vocabulary rows ``[lo_r, hi_r)`` (a balanced split). For target ``t``::

    loss = log Σ_v exp(z_v) − z_t = log Σ_v exp(z_v − m) − (z_t − m),   m = max_v z_v

Each rank reduces its own rows, and one all-reduce of ``(*)`` elements combines each ingredient: ``m``
(MAX), ``z_t − m`` (SUM; only the rank owning ``t`` contributes) and the sum of exponentials (SUM). The
gradient is local: ``∂loss/∂z_v = softmax(z)_v − [v = t]`` on each rank's rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

from .bitwise.settings import Bitwise, current_bitwise
from .bitwise.vocabulary import SegmentedExpSum
from .checks import check_ids
from .comm.collectives import start_all_reduce_
from .mesh import group_rank_size, tp_group
from .sharding import partition_bounds

REDUCTIONS = ("mean", "sum", "none")


def _loss_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype


#: ``Σ_v exp(z_v)`` over the whole vocabulary ``(*)`` from this rank's rows ``z``, writing ``exp(z)`` into ``z``
ExpSum = Callable[[torch.Tensor, ProcessGroup], torch.Tensor]


def _all_reduced_exp(z: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The default :data:`ExpSum`: this rank's sum, one all-reduce."""
    return start_all_reduce_(z.exp_().sum(-1), group).wait()


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, lo: int, ignore_index: int,
                reduction: str, group: ProcessGroup, summed_exp: ExpSum) -> torch.Tensor:
        # low-precision logits are reduced in float32, as F.cross_entropy accumulates
        z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits.clone()  # (*, V / tp)
        m = start_all_reduce_(z.amax(-1), group, op="max").wait()  # (*) global max
        z.sub_(m.unsqueeze(-1))
        local_t = targets - lo
        owned = (local_t >= 0) & (local_t < z.shape[-1])  # (*) this rank holds the target's row
        local_t = local_t.masked_fill(~owned, 0)
        target_z = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)  # (*)
        pending = start_all_reduce_(target_z, group)
        sum_exp = summed_exp(z, group)  # (*); z now holds exp(z - m)
        target_z = pending.wait()
        valid = targets != ignore_index
        log = summed_exp.log if isinstance(summed_exp, SegmentedExpSum) else torch.log  # the mode's: shape-blind
        loss = (log(sum_exp) - target_z).masked_fill(~valid, 0.0)  # (*)
        z.div_(sum_exp.unsqueeze(-1))  # softmax, this rank's rows
        ctx.save_for_backward(z, local_t, owned, valid)
        ctx.reduction, ctx.dtype = reduction, logits.dtype
        loss = loss.to(_loss_dtype(logits))
        ctx.count = valid.sum()
        if reduction == "none":
            return loss
        return loss.sum() / ctx.count if reduction == "mean" else loss.sum()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None, None]:
        softmax, local_t, owned, valid = ctx.saved_tensors
        grad_z = softmax  # reused in place: backward runs once
        grad_z.scatter_add_(-1, local_t.unsqueeze(-1), -owned.unsqueeze(-1).to(grad_z.dtype))
        scale = grad.to(grad_z.dtype) * valid  # (*) or (): the per-position weight of the loss
        if ctx.reduction == "mean":  # no counted target: no gradient (F.cross_entropy's zeros)
            scale = scale / ctx.count.clamp_min(1)
        grad_z.mul_(scale.unsqueeze(-1) if scale.dim() else scale)
        return grad_z.to(ctx.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, *,
                                 ignore_index: int = -100, reduction: str = "mean",
                                 group: ProcessGroup | None = None,
                                 bitwise: bool | Bitwise | None = None) -> torch.Tensor:
    """``F.cross_entropy`` of vocab-sharded ``logits`` (*, vocab_size / tp) against full ``targets`` (*).

    ``targets`` holds token ids in ``[0, vocab_size)`` (any integer dtype), the same on every rank; positions
    equal to ``ignore_index`` add nothing. The loss is the same on every rank (three all-reduces of
    ``targets.numel()`` elements), float32 for 16-bit logits, else in their dtype; the gradient comes back
    in the logits' dtype. Backward reuses the saved softmax in place, so it runs once. ``bitwise`` (a
    :class:`~tensorpar.bitwise.Bitwise`, ``True`` for the current one or the defaults, ``False`` for none;
    default: :func:`tensorpar.current_bitwise`) sums the exponentials by canonical segments of the
    vocabulary, the same bits at every tp of the mode, 1 included.

    Example::

        logits = lm_head(h)                                     # (B, T, V / tp)
        loss = tensorpar.vocab_parallel_cross_entropy(logits, targets, V)
    """
    for name, tensor in (("logits", logits), ("targets", targets)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"vocab_parallel_cross_entropy expects {name} as a tensor, got {type(tensor).__name__}")
    if not logits.dtype.is_floating_point:
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"targets must be integer token ids, got {targets.dtype}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    group = tp_group(group)
    rank, n = group_rank_size(group)
    lo, rows = partition_bounds(vocab_size, n, rank, name="vocab_size")
    if logits.dim() == 0 or logits.shape[:-1] != targets.shape or logits.shape[-1] != rows:
        raise ValueError(f"logits of shape {tuple(logits.shape)} do not match targets of shape "
                         f"{tuple(targets.shape)} and this rank's {rows} of {vocab_size} vocabulary rows")
    targets = targets.long()  # any integer width; int64 is what indexing and F.cross_entropy take
    check_ids(targets, vocab_size, "target id", f"vocab_size {vocab_size} (and is not ignore_index {ignore_index})",
              allowed=ignore_index)
    mode = bitwise if isinstance(bitwise, Bitwise) else current_bitwise() if bitwise is None else \
        (current_bitwise() or Bitwise()) if bitwise else None
    summed_exp: ExpSum = _all_reduced_exp
    if mode is not None:
        summed_exp = SegmentedExpSum(vocab_size, n, rank, mode.tp_sizes)
    elif n == 1:  # the whole vocabulary is here; 16-bit logits are reduced in float32, as at tp > 1
        loss = F.cross_entropy(logits.reshape(-1, vocab_size).to(_loss_dtype(logits)), targets.reshape(-1),
                               ignore_index=ignore_index, reduction=reduction)
        return loss.reshape(targets.shape) if reduction == "none" else loss
    return _VocabParallelCrossEntropy.apply(logits, targets, lo, ignore_index, reduction, group, summed_exp)

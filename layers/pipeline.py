"""A GPT split into pipeline stages of whole blocks, each stage tensor-parallel inside.

With ``pp`` pipeline ranks and ``v`` stages per rank there are ``pp * v``
stages; the ``n_layer`` blocks are split over them in balanced runs, the longer
first (5 blocks over 2 stages: 3 and 2). The first stage also holds the
embeddings, the last the final LayerNorm and the LM head, whose logits stay
vocab-sharded for the vocab-parallel loss::

    stage 0:  idx (B, T) -> wte + wpe -> blocks 0-2 -> x (B, T, C)
    stage 1:  x (B, T, C) -> blocks 3-4 -> ln_f -> lm_head -> logits (B, T, V / tp)

(with sequence parallelism each rank passes its own tokens, ``(B, T_r, C)``).
The head is tied to the token embedding; on different stages each keeps a copy,
initialised alike, whose gradients are summed over the two stages after every
step (Megatron's embedding group), so the copies stay equal.

:class:`PipelinedGPT` holds this rank's stages under the GPT's own parameter
names (``transformer.h.3.attn.c_attn.weight``...), so checkpoints move between any
(pp, dp, tp) and a GPT built from the same seed has the same weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import tensorpar
from tensorpar.checks import check_int
from tensorpar.full import is_dtensor, local_part
from tensorpar.pipeline import Pipeline, rank_stages, stage_blocks

from .block import Block, run_blocks
from .config import GPTConfig
from .gpt import GPT, embed, initialise_

HEAD = "lm_head.weight"
EMBEDDING = "transformer.wte.weight"
EMBEDDING_PARTS = ("wte", "wpe", "reduce", "drop")  # the first stage's; no wpe with rotary positions


class GPTStage(nn.Module):
    """Stage ``index`` of ``n_stages``: ``blocks``, after the embeddings on the first stage, before the
    final LayerNorm and the LM head on the last. Input: token ids ``(B, T)`` on the first stage, else
    hidden states; output: hidden states, or vocab-sharded logits ``(B, T, V / tp)`` on the last."""

    def __init__(self, config: GPTConfig, index: int, n_stages: int, blocks: list[Block], *,
                 embedding: nn.ModuleDict | None, ln_f: nn.Module | None, lm_head: nn.Module | None,
                 group: dist.ProcessGroup) -> None:
        super().__init__()
        self.config, self.index, self.n_stages, self.tp_group = config, index, n_stages, group
        self.embedding = embedding
        self.blocks = nn.ModuleList(blocks)
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            GPT._check_ids(x)
            t = x.shape[1]
            x = embed(self.embedding, self.config, x)  # (B, T, C) or (B, T_r, C)
        else:
            t = tensorpar.sequence_length(x, None, self.tp_group) if self.config.sequence_parallel else x.shape[1]
        x = run_blocks(self.blocks, x, t, self.config)
        if self.lm_head is None:
            return x
        assert self.ln_f is not None
        x = self.ln_f(x, t) if self.config.sequence_parallel else self.ln_f(x)
        return self.lm_head(x, t)  # (B, T, V / tp)


class PipelinedGPT(nn.Module):
    """This rank's stages of a GPT pipelined over ``mesh.pp`` ranks, ``stages_per_rank`` each
    (more than one for the interleaved schedule), under the GPT's parameter names.

    :meth:`pipeline` returns the :class:`tensorpar.pipeline.Pipeline` that trains it. Every rank of the
    mesh builds it with the same seed (:func:`tensorpar.manual_seed`): the weights equal a :class:`GPT`'s.

    Example::

        mesh = tensorpar.init(tp=2, pp=2)
        tensorpar.manual_seed(0)
        model = PipelinedGPT(GPTConfig(n_layer=5))          # stage 0: blocks 0-2, stage 1: 3-4
        pipe = model.pipeline("1f1b", microbatches=4)
        loss = pipe.step(idx, targets)                        # (B, T) on every rank
        model.finish_gradients()                              # averaged over dp, the tied head's summed
        model.clip_grad_norm_(1.0)
        optimizer.step()
    """

    def __init__(self, config: GPTConfig, *, stages_per_rank: int = 1, mesh: tensorpar.Mesh | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.mesh = mesh = mesh or tensorpar.current_mesh()
        check_int(stages_per_rank, "stages_per_rank")
        if stages_per_rank > 1 and mesh.pp == 1:
            raise ValueError(f"stages_per_rank ({stages_per_rank}) > 1 needs pipeline ranks to loop over: pp is 1")
        self.config, self.tp_group = config, mesh.tp_group
        self.numerics = tensorpar.current_bitwise()  # its bitwise mode (None: off): its loss and norm follow
        n_stages = mesh.pp * stages_per_rank
        split = stage_blocks(config.n_layer, n_stages)
        self.stage_ids = rank_stages(mesh.pp_rank, mesh.pp, stages_per_rank)
        full = GPT(config, group=mesh.tp_group, device="meta", dtype=dtype)  # the structure: no draws on meta
        names = [name for name, _ in full.named_parameters()]  # the GPT's order (the tied head once)
        geometry = tensorpar.shard_geometry(full)
        ours = [i for s in self.stage_ids for i in split[s]]
        first, last = 0 in self.stage_ids, n_stages - 1 in self.stage_ids
        t = full.transformer
        parts: dict[str, nn.Module] = {k: t[k] for k in EMBEDDING_PARTS if k in t} if first else {}
        parts["h"] = nn.ModuleDict({str(i): t.h[i] for i in ours})
        if last:
            parts["ln_f"] = t.ln_f
        self.transformer = nn.ModuleDict(parts)
        self.copied_head = last and not first  # the head on another rank than the embedding: a copy
        #: checkpoints: the copy's optimizer state is the embedding's where only that one is stored
        self.tied_copies = {HEAD: EMBEDDING} if self.copied_head else {}
        if last:
            self.lm_head = full.lm_head
            if self.copied_head:
                self.lm_head.weight = nn.Parameter(torch.empty_like(t.wte.weight))
        self.to_empty(device=device or mesh.device)
        held = dict(self.named_parameters())

        def copies(name: str) -> list[torch.Tensor]:  # the head's copy takes the embedding's values
            found = [held[name]] if name in held else []
            return [*found, held[HEAD]] if name == EMBEDDING and self.copied_head else found

        initialise_(config, [(name, copies(name)) for name in names], geometry)
        self._embedding_group = _embedding_group(mesh) if mesh.pp > 2 else mesh.pp_group if mesh.pp > 1 else None
        self._tied_pending, self.average_over_dp = False, True
        self.stages = [GPTStage(config, s, n_stages, [self.transformer.h[str(i)] for i in split[s]],
                                embedding=nn.ModuleDict({k: parts[k] for k in EMBEDDING_PARTS if k in parts})
                                if s == 0 else None,
                                ln_f=parts.get("ln_f") if s == n_stages - 1 else None,
                                lm_head=self.lm_head if s == n_stages - 1 else None, group=mesh.tp_group)
                       for s in self.stage_ids]

    def _apply(self, fn: Any, recurse: bool = True) -> PipelinedGPT:
        super()._apply(fn, recurse)
        if "wte" in self.transformer and hasattr(self, "lm_head"):  # one rank holds both: tied
            self.lm_head.weight = self.transformer.wte.weight
        return self

    def pipeline(self, schedule: str = "1f1b", microbatches: int = 1, *,
                 wrap: Callable[[nn.Module], nn.Module] | None = None, timed: bool = False) -> Pipeline:
        """The pipeline that trains this model with ``schedule`` (``"gpipe"``, ``"1f1b"`` or
        ``"interleaved"``) over ``microbatches`` micro-batches: ``step(idx, targets)`` returns the mean
        loss on every rank. ``wrap`` wraps each stage module in something that averages the gradients
        over dp itself (else :meth:`finish_gradients` does). ``timed``: see :class:`~tensorpar.pipeline.Pipeline`."""
        self.average_over_dp = wrap is None
        modules = [wrap(stage) if wrap else stage for stage in self.stages]
        return Pipeline(modules, self.stage_ids, self.mesh, schedule=schedule, microbatches=microbatches,
                        loss_fn=self._loss, stage_shapes=self.stage_shapes, check_inputs=self._check,
                        after_backward=self._backward_done, timed=timed)

    def stage_shapes(self, stage: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage ``stage``'s input and output (meta tensors) for a micro-batch of token ids ``idx`` ``(B, T)``:
        ``idx`` itself into the first stage, hidden states ``(B, T, C)`` between stages (this rank's tokens
        ``(B, T_r, C)`` with sequence parallelism), vocab-sharded logits ``(B, T, V / tp)`` out of the last.
        The hidden states keep the parameters' dtype (the residual stream's: under autocast, its sum with a
        lower-precision branch promotes back to it); the logits come from the head in the autocast dtype."""
        b, t = idx.shape
        device = self.mesh.device.type
        autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        dtype = next(self.parameters()).dtype
        rows = tensorpar.sequence_sizes(t, self.mesh.tp)[self.mesh.tp_rank] if self.config.sequence_parallel else t
        hidden = torch.empty(b, rows, self.config.n_embd, device="meta",
                             dtype=dtype if autocast is None else torch.promote_types(dtype, autocast))
        first = idx if stage == 0 else hidden
        if stage < self.stages[0].n_stages - 1:
            return first, hidden
        logits = torch.empty(b, t, self.lm_head.local_features, dtype=autocast or dtype, device="meta")
        return first, logits

    def _backward_done(self) -> None:
        self._tied_pending = True

    def _check(self, idx: torch.Tensor, targets: torch.Tensor) -> None:
        GPT._check_ids(idx)
        GPT._check_ids(targets, "targets")
        if targets.shape != idx.shape:
            raise ValueError(f"targets of shape {tuple(targets.shape)} do not match idx of shape {tuple(idx.shape)}")
        if idx.shape[1] > self.config.block_size:
            raise ValueError(f"sequence length ({idx.shape[1]}) is longer than block_size ({self.config.block_size})")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's stages' part of the unsharded model's state dict (gathered over tp; a collective)."""
        return tensorpar.full_state_dict(self)

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load this rank's stages' part of an unsharded GPT state dict (from any layout)."""
        tensorpar.load_full_state_dict(self, {k: state_dict[k] for k in self.state_dict() if k in state_dict})

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return tensorpar.vocab_parallel_cross_entropy(logits, targets, self.config.vocab_size, ignore_index=-1,
                                                      group=self.tp_group, bitwise=self.numerics or False)

    def _tied(self) -> Iterator[nn.Parameter]:
        if "wte" in self.transformer:
            yield self.transformer.wte.weight
        if self.copied_head:
            yield self.lm_head.weight

    def finish_gradients(self) -> None:
        """Once per optimizer step, after the last backward of any gradient accumulation: average the
        gradients over dp (unless the stages were wrapped to do it, or are FSDP2 modules), then sum the
        gradients of the token embedding and of the head's copy over their two stages (Megatron's
        embedding group). A collective; nothing when no step ran since the last call. Call it before
        :meth:`grad_norm`, :meth:`clip_grad_norm_` and ``optimizer.step()``."""
        pending, self._tied_pending = self._tied_pending, False
        if not pending:
            return
        if self.average_over_dp and self.mesh.dp > 1:
            grads = [p.grad for p in self.parameters() if p.grad is not None and not is_dtensor(p.grad)]
            average_over_group_(grads, self.mesh.dp_group)
        if self._embedding_group is not None:
            (p,) = self._tied()
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = local_part(p.grad)
            summed = grad.to(self.mesh.device)  # itself, unless FSDP2 offloads it to the host (NCCL needs the device)
            dist.all_reduce(summed, group=self._embedding_group)
            if summed is not grad:
                grad.copy_(summed)

    def _check_finished(self, what: str) -> None:
        """Raise (alike on every rank) while a step's gradients wait for :meth:`finish_gradients`."""
        if self._tied_pending:
            raise RuntimeError(f"PipelinedGPT.{what}: the gradients of the last step are not finished yet "
                               "(not averaged over dp, the tied head's not summed): call finish_gradients() first")

    def grad_norm(self) -> torch.Tensor:
        """The 2-norm of the whole (unsharded, unpipelined) model's gradient, on every rank (a collective;
        after :meth:`finish_gradients`)."""
        self._check_finished("grad_norm")
        return tensorpar.grad_norm(self, pp_group=self.mesh.pp_group, exclude=(HEAD,) if self.copied_head else ())

    def clip_grad_norm_(self, max_norm: float, *, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip by :meth:`grad_norm`, as ``torch.nn.utils.clip_grad_norm_`` would on the whole model;
        return the norm before (see :func:`tensorpar.clip_grad_norm_` for ``error_if_nonfinite``). After
        :meth:`finish_gradients`."""
        self._check_finished("clip_grad_norm_")
        return tensorpar.clip_grad_norm_(self, max_norm, pp_group=self.mesh.pp_group,
                                         exclude=(HEAD,) if self.copied_head else (),
                                         error_if_nonfinite=error_if_nonfinite)


def average_over_group_(grads: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Average ``grads`` over ``group`` in place: one all-reduce of all of them flattened, per dtype (the
    flat copy holds every gradient of that dtype at once, where DDP's buckets hold 25 MB each)."""
    n = dist.get_world_size(group)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = _flatten_dense_tensors(same)  # (sum of numel,)
        dist.all_reduce(flat, group=group)
        flat /= n
        for g, mean in zip(same, _unflatten_dense_tensors(flat, same), strict=True):
            g.copy_(mean)


def _embedding_group(mesh: tensorpar.Mesh) -> dist.ProcessGroup | None:
    """The group of this rank's twins on the first and the last pipeline stage (every rank calls it;
    ranks of the middle stages get ``None``)."""
    grid = mesh.device_mesh.mesh.reshape(mesh.pp, -1)  # (pp, dp * tp)
    pairs = [[int(grid[0, i]), int(grid[-1, i])] for i in range(grid.shape[1])]
    mine = None
    for pair in pairs:
        group = dist.new_group(pair)
        if mesh.rank in pair:
            mine = group
    return mine

"""The activation side of a plan: the bytes one rank holds saved for backward over a step's micro-batches
in flight, the largest transient, the peak.

Each micro-batch saves what :mod:`layers.plan_saved` counts layer by layer. Pipelines hold their stage's
bytes for every micro-batch in flight (:func:`in_flight`); a stage after the first also keeps the receive
buffers of its input of the step's other micro-batches (torch allocates one per micro-batch, once).

:func:`peak_bytes` adds what the hooks do not see and a step holds besides: the logits while the forward
ends, the backward's gradients and working buffers step by step (:mod:`layers.plan_backward`), AdamW's
temporaries, the generators' states that the tp stream and each checkpointed block keep.
"""

from __future__ import annotations

from tensorpar.comm.sequence import sequence_sizes
from tensorpar.pipeline import rank_stages, stage_blocks

from . import plan_bitwise as bitwise
from .config import GPTConfig
from .plan_backward import adamw_temporaries, backward_peak
from .plan_layout import Layout
from .plan_saved import (
    Shapes,
    block_after_last_fork,
    block_saved,
    check_where,
    first_stage_saved,
    generator_states,
    head_saved,
    loss_itemsize,
    shapes_of,
    weight_copies,
)
from .plan_schedule import InFlight, in_flight, moments, stage_sizes


def _stage_saved(config: GPTConfig, layout: Layout, s: Shapes, index: int, device_type: str
                 ) -> tuple[int, int, int]:
    """Stage ``index``'s (of ``pp * stages_per_rank``) bytes: ``(per micro-batch in flight, held once, a
    micro-batch's receive buffer of its input)``: its blocks, and the embedding or the final LayerNorm, head
    and loss."""
    n_stages = layout.pp * layout.stages_per_rank
    blocks = len(stage_blocks(config.n_layer, n_stages)[index])
    first, last = index == 0, index == n_stages - 1
    per, views = 0, 0  # views: the storages of the whole batch's ids and targets, held once
    if first:
        per += first_stage_saved(config, s, device_type)
        if s.tp == 1 and layout.pp > 1:  # the ids as given: a pipeline's micro-batch of them is a view of the batch's
            per -= 8 * s.b * s.t
            views += 8 * s.b * s.t * layout.microbatches
    if layout.activation_checkpointing:
        per += blocks * s.b * s.t_r * s.c * s.p  # each block's input; its insides are recomputed
    elif s.mode is not None:
        per += blocks * bitwise.block_saved(config, s)
    else:
        per += blocks * block_saved(config, s, device_type)
    if last:
        per += head_saved(config, s) if s.mode is None else bitwise.head_saved(config, s)
        if s.tp == 1 and s.mode is None:  # the targets as given: a pipeline's micro-batch of them is a view
            views += 8 * s.b * s.t * (layout.microbatches if layout.pp > 1 else 1)
    copied = 0 if layout.activation_checkpointing else blocks
    once, each = weight_copies(config, s, copied, last) if s.mode is None else \
        (0, bitwise.weight_copies(config, s, copied, last))
    # torch.distributed.pipelining allocates a receive buffer of a stage's input (none on the first stage)
    # per micro-batch of the step when it builds the schedule and keeps them; a micro-batch's is its first
    # block's saved input while it is in flight, and stays after
    received = s.b * s.t_r * s.c * s.p if layout.pp > 1 and index > 0 else 0
    return per + each, once + views, received


def _saved_moments(config: GPTConfig, layout: Layout, s: Shapes, stage: int, device_type: str
                   ) -> list[tuple[int, InFlight]]:
    """The bytes pipeline rank ``stage``'s stages hold saved at each moment of a step (:func:`moments`)."""
    parts = {i: _stage_saved(config, layout, s, i, device_type)
             for i in rank_stages(stage, layout.pp, layout.stages_per_rank)}
    held = sum(once for _, once, _ in parts.values())
    # a received buffer counts once its micro-batch's forward has run
    return [(held + sum(n * parts[i][0] + (run - n) * parts[i][2] for i, n, run in moment), moment)
            for moment in moments(layout, stage)]


def activation_bytes(config: GPTConfig, layout: Layout, *, tp_rank: int = 0, stage: int = 0,
                     device_type: str = "cpu") -> int:
    """Bytes saved for backward on one rank at the step's fullest moment: its stages' blocks (and the
    embedding, or the final LayerNorm, head and loss) for every micro-batch in flight on each
    (:mod:`layers.plan_schedule`), on ``device_type`` (``"cpu"`` or ``"cuda"``: dropout masks and SDPA differ)."""
    check_where(config, layout, stage, device_type)
    return max(n for n, _ in _saved_moments(config, layout, shapes_of(config, layout, tp_rank), stage, device_type))


def _forward_transient(s: Shapes) -> int:
    """What the last stage holds only while its forward ends: the logits (and at tp = 1 under autocast
    their float32 copy), of which the loss keeps its own buffers."""
    logits = s.b * s.t * s.vocab * s.a
    plain = s.tp == 1 and s.mode is None  # F.cross_entropy
    return logits + (s.b * s.t * s.vocab * loss_itemsize(s) if plain and s.a != loss_itemsize(s) else 0)


def _head_backward_transient(s: Shapes) -> int:
    """What the loss's and the head's backward add while they run: the logits' gradient (at tp > 1 the
    softmax, overwritten in place, and its cast to the logits' dtype), the head's input gradient and its
    weight gradient in the matmul dtype before the cast to the parameters'."""
    btv, loss = s.b * s.t * s.vocab, loss_itemsize(s)
    head = s.b * s.t * s.c * s.a + (s.vocab * s.c * s.a if s.a != s.p else 0)
    if s.tp == 1 and s.mode is None:  # nll_loss's gradient, then log_softmax's; the cast back, the head's matmuls
        return btv * loss + max(btv * loss, (btv * s.a if s.a != loss else 0) + head)
    return (btv * s.a if s.a != loss else 0) + head


def _communication(s: Shapes) -> int:
    """The largest collective buffer: with sequence parallelism the gathered tokens (padded to the largest
    shard, then joined) or a reduce-scatter's padded input; a row map's all-reduce runs in place."""
    if not s.sp:
        return 0
    most = sequence_sizes(s.t, s.tp)[0]
    return s.b * s.c * s.a * (s.tp * most + s.t)


def transient_bytes(config: GPTConfig, layout: Layout, *, tp_rank: int = 0, stage: int = 0,
                    device_type: str = "cpu") -> int:
    """The largest short-lived buffer of the step on one rank: the logits and the loss's gradient buffers
    (last stage), SDPA's scores on its math path, or the sequence-parallel collectives' padded buffers."""
    check_where(config, layout, stage, device_type)
    s = shapes_of(config, layout, tp_rank)
    found = [_communication(s)]
    if s.mode is not None:  # attention with dropout drawing its mask (the noise of every head), a head's scores
        found.append(bitwise.dropped_transient(config, s))
    elif config.dropout and device_type == "cpu":  # the scores before the softmax
        found.append(s.b * s.h * s.t * s.t * max(4, s.a))
    if stage == layout.pp - 1:
        found += [_forward_transient(s), _head_backward_transient(s)]
    return max(found)


def _saved_after_last_fork(config: GPTConfig, layout: Layout, s: Shapes, stage: int, device_type: str) -> int:
    """What one micro-batch's forward saves after its last fork of the tp stream (with dropout): the last
    stage's head and loss, and the last block's MLP half unless a sequence-parallel dropout forks at the end
    of each block (inside checkpointed blocks nothing is saved)."""
    after = head_saved(config, s) if stage == layout.pp - 1 else 0
    if layout.activation_checkpointing:
        return after
    return after + block_after_last_fork(config, s, device_type)


def _pipeline_buffers(layout: Layout, s: Shapes, moment: InFlight) -> int:
    """What a pipeline rank holds besides its saved activations at ``moment``: the outputs of each stage's
    micro-batches in flight, which the schedule keeps for their backward (the last stage's: the logits), before
    the last stage the receive buffers of its output's gradient, one per micro-batch of the step (kept as those
    of the inputs are), and after the first those of its inputs still to run forward."""
    if layout.pp == 1:
        return 0
    n_stages, m = layout.pp * layout.stages_per_rank, layout.microbatches
    tokens = s.b * s.t_r * s.c * s.p
    received = sum((m - run) * tokens for i, _, run in moment if i)  # of inputs whose forward is still to run
    return received + sum(n * s.b * s.t * s.vocab * s.a if i == n_stages - 1 else (m + n) * tokens
                          for i, n, _ in moment)


def peak_bytes(config: GPTConfig, layout: Layout, *, params: int, grads: int, optimizer: int,
               tp_rank: int = 0, stage: int = 0, device_type: str = "cpu") -> int:
    """The most bytes one rank holds at once during a step, given its ``params``, ``grads`` and
    ``optimizer`` state: the largest of

    * the forward's end: parameters, optimizer state, the step's token ids and targets, the saved
      activations of every micro-batch in flight, the logits, a pipeline's buffers (the outputs in flight,
      the gradients' receive buffers), and the gradients where a micro-batch's backward made them before
      another's forward with as many in flight (1F1B's steady state, gradient accumulation; not GPipe);
    * the backward: the same, then layer by layer in backward order each layer's new gradients and
      working buffers (the loss's and the head's gradient buffers; with activation checkpointing the
      block's recomputed activations), its saved tensors let go after it;
    * the optimizer step: parameters, gradients, optimizer state and the step's temporaries (AdamW: the
      square root of the second moment and its quotient, a parameter at a time on the CPU, every
      parameter at once with CUDA's foreach kernels).

    On the CPU the generators' states count too (5 KB each): with dropout the tp stream's own, and with
    activation checkpointing the states each checkpointed block notes at its forward (the CPU generator's,
    and with dropout the tp stream's) and those its recomputation notes while it runs.
    """
    check_where(config, layout, stage, device_type)
    s = shapes_of(config, layout, tp_rank)
    last = stage == layout.pp - 1
    sizes = stage_sizes(config.n_layer, layout, stage)
    state, stream = generator_states(config, device_type, s.mode is not None)
    batch = 16 * s.b * s.t * layout.microbatches + stream  # int64 ids and targets of the step; the tp stream
    interleaved = layout.pp > 1 and layout.schedule == "interleaved"

    def most(acts: int, moment: InFlight) -> int:
        """The most held at a moment of the step: as its forward ends, or in the backward that follows."""
        blocks = sum(n * sizes[i] for i, n, _ in moment)  # blocks run forward and not yet backward
        if layout.activation_checkpointing:  # the generator states each checkpointed block notes at its forward
            acts += blocks * (state + stream)
        elif s.mode is not None:  # saved, but let go as the forward ends
            acts -= blocks * bitwise.attention_unheld(config, s)
        # the gradients (set to None before the step) made by a micro-batch's backward while others are still to
        # run forward with as many in flight (1F1B's steady state, accumulation); GPipe's backwards all come
        # after; interleaved 1F1B: those of the stages that ran a backward (more forwards run than held)
        if interleaved:
            earlier = grads * sum(sizes[i] for i, n, run in moment if run > n) // sum(sizes.values())
        else:
            earlier = grads if layout.microbatches > in_flight(layout, stage) else 0
        held = params + optimizer + batch + acts + _pipeline_buffers(layout, s, moment)
        logits = _forward_transient(s) + (bitwise.loss_transient(config, s) if s.mode else 0) if last else 0
        if layout.pp > 1:  # the logits are a pipeline's held output (see _pipeline_buffers)
            logits -= s.b * s.t * s.vocab * s.a if last else 0
        forward_end = held + earlier + logits
        if stream:  # the forward's last fork of the tp stream as it ends: the states outside it and after it
            forward_end = max(forward_end, held + earlier + 2 * stream
                              - _saved_after_last_fork(config, layout, s, stage, device_type))
        if s.mode is not None:  # a row map's tree sum exchanging its partial sums, the head and loss yet to run:
            # the last block's output projection's (its MLP half and output dropouts yet to run) or its MLP's
            if layout.activation_checkpointing:  # (what the checkpointed forward holds of the block apart)
                rows = max(bitwise.exchange(config, s, "query"), bitwise.exchange(config, s, "hidden"))
            else:
                mask = bitwise.residual_mask(config, s)
                rows = max(bitwise.projection_exchange(config, s) - bitwise.mlp_half(config, s) - mask,
                           bitwise.mlp_exchange(config, s) - mask)
            forward_end = max(forward_end, held + earlier + rows - (bitwise.head_saved(config, s) if last else 0))
            # or the last attention's noise, its MLP half yet to run
            noise = bitwise.dropped_transient(config, s) - (0 if layout.activation_checkpointing
                                                            else bitwise.mlp_half(config, s))
            forward_end = max(forward_end, held + earlier + noise - (bitwise.head_saved(config, s) if last else 0))
        return max(forward_end, held + earlier + backward_peak(config, layout, s, stage, device_type,
                                                                 accumulating=bool(earlier)))

    during = max(most(acts, moment) for acts, moment in _saved_moments(config, layout, s, stage, device_type))
    temporaries = adamw_temporaries(config, layout, s, stage, device_type, params) if layout.optimizer == "adamw" else 0
    step = params + grads + optimizer + batch + temporaries
    return max(during, step)

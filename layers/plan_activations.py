"""The activation side of a plan: the bytes saved for backward, the largest transient, the peak.

Counted op by op for this implementation (:mod:`layers.gpt` and the layers it is built of), per rank,
with the shards it holds (balanced: the lower tp ranks hold the extra head, feature or vocabulary row).
``B`` sequences of ``T`` tokens per micro-batch, ``T_r`` this rank's tokens with sequence parallelism
(else ``T``), ``C`` the width, ``h``/``h_kv`` its query/KV heads of ``d`` features, ``H`` its MLP hidden
features, ``V`` its vocabulary rows; ``p`` bytes per element of the parameters (the residual stream, the
LayerNorms), ``a`` of the matmuls (2 under bfloat16 autocast, else ``p``). Per micro-batch in flight:

* embedding (first stage): the token ids ``8·B·T`` and positions ``8·T`` (at tp > 1 the masked ids and
  the bool mask of foreign rows of each table instead: ``9·B·T + 9·T``); a dropout mask ``B·T_r·C``;
* each block: both LayerNorms' inputs ``p·B·T_r·C`` and mean and 1/std ``4·B·T_r`` each (with sequence
  parallelism at tp > 1 also the weight and bias joined for their summed gradient); the inputs of the
  column maps ``a·B·T_r·C`` (the MLP's twice for SwiGLU under autocast, each map casting its own); fused
  ``[Q|K|V]`` ``a·B·T·(h + 2 h_kv)·d``, SDPA's log-sum-exp ``4·B·h·T`` and output ``a·B·T·h·d`` (the CPU
  flash kernel; with dropout on the CPU, SDPA's math path in float32: Q, Kᵀ, V, the softmax, its dropout
  noise and the dropped probabilities, ``3·4·B·h·T·d + 3·4·B·h·T·T``, and a copy of the output); the MLP's
  hidden activations ``a·B·T·H`` twice (GELU: its input and output) or four times (SwiGLU: gate, SiLU,
  up, product); the dropout masks of the attention and MLP outputs;
* with activation checkpointing, each block's input ``p·B·T_r·C`` instead of all of the above;
* last stage: the final LayerNorm as above, the head's input ``a·B·T_r·C``, and the loss's buffers: the
  vocab-parallel cross-entropy's softmax ``4·B·T·V`` (float32 for 16-bit logits), the local targets
  ``8·B·T`` and two bool masks ``2·B·T`` (at tp = 1 ``F.cross_entropy``'s log-softmax and the targets).

Under autocast the bfloat16 copies of the matmul weights are saved for backward too and are counted:
once for maps that run ``F.linear`` (autocast caches its casts of parameters), once per micro-batch for
the fused tensor-parallel maps (their forward casts them each call). Dropout masks are the input's dtype
on the CPU (``x * noise``) and bool on CUDA. With sequence parallelism at tp > 1 a rank holding fewer
tokens than the first keeps the embedding's reduce-scatter output as a view of its padded buffer (the
first block's input), unless dropout copied it. Pipelines hold their stage's bytes for every micro-batch
in flight (:func:`in_flight`); a stage after the first also keeps the receive buffers of its input of
the step's other micro-batches (torch allocates one per micro-batch, once). These are what
``saved_tensors_hooks`` sees on the CPU, to the byte in every measured case. On CUDA
(``device_type="cuda"``, not measured here) SDPA's flash or efficient kernels keep ``[Q|K|V]``, the
log-sum-exp and the output with or without dropout, and masks are bool.
Only the default numerics are counted: the bitwise mode is refused.

:func:`peak_bytes` adds what the hooks do not see and a step holds besides: the logits while the forward
ends, the backward's gradients and working buffers step by step, AdamW's temporaries, the tp stream's
generators' states that the tp stream and each checkpointed block keep.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tensorpar.comm.sequence import sequence_sizes
from tensorpar.pipeline import stage_blocks
from tensorpar.sharding import partition_sizes

from .config import GPTConfig
from .heads import head_layout
from .plan_layout import Layout

DEVICE_TYPES = ("cpu", "cuda")
#: the CPU generator's state (its Mersenne twister) as ``torch.get_rng_state()`` returns it: checkpoints note one
#: per block, the tp streams keep theirs; on CUDA every state (the GPU's too) is a host tensor, no device memory
CPU_RNG_STATE_BYTES = 5056


def _generator_states(config: GPTConfig, device_type: str) -> tuple[int, int]:
    """Bytes of ``(a generator state, the tp stream's state)`` in ``device_type``'s memory: the stream has
    one once a dropout has drawn from it."""
    state = CPU_RNG_STATE_BYTES if device_type == "cpu" else 0
    return state, state if config.dropout else 0


def _itemsize(name: str | None, what: str) -> int:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{what} must name a floating-point torch dtype, got {name!r}")
    return dtype.itemsize


@dataclass(frozen=True)
class _Shapes:
    """One rank's sizes of one micro-batch (see the module's docstring for the letters)."""

    b: int
    t: int
    t_r: int
    c: int
    d: int
    h: int
    h_kv: int
    kv_by_index: bool  # the local query heads read their KV heads unevenly: K and V gathered by index
    kv_joined: bool  # K and V rows held whole by every rank: the weight is a concatenated copy
    h_read: int  # the KV heads SDPA reads (h when gathered by index)
    hidden: int
    vocab: int
    tp: int
    p: int  # parameters, residual stream
    a: int  # matmuls (autocast's dtype, else p)
    autocast: bool
    sp: bool


def _shapes(config: GPTConfig, layout: Layout, tp_rank: int) -> _Shapes:
    tp = layout.tp
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank {tp_rank} is out of range for tp {tp}")
    t = config.block_size if layout.seq_len is None else layout.seq_len
    if not 1 <= t <= config.block_size:
        raise ValueError(f"seq_len ({t}) must be in [1, block_size ({config.block_size})]")
    p = _itemsize(layout.dtype, "Layout.dtype")
    a = p if layout.autocast is None else _itemsize(layout.autocast, "Layout.autocast")
    heads = head_layout(config.n_head, config.kv_heads, tp, tp_rank)
    sp = layout.sequence_parallel and tp > 1
    return _Shapes(b=layout.micro_batch, t=t, t_r=sequence_sizes(t, tp)[tp_rank] if sp else t, c=config.n_embd,
                   d=config.n_embd // config.n_head, h=len(heads.query), h_kv=len(heads.kv_held),
                   kv_by_index=heads.group_size is None, kv_joined=heads.kv_replicated and tp > 1,
                   h_read=len(heads.query) if heads.group_size is None else len(heads.kv_reads),
                   hidden=partition_sizes(config.mlp_hidden, tp)[tp_rank],
                   vocab=partition_sizes(config.vocab_size, tp, name="vocab_size")[tp_rank], tp=tp, p=p, a=a,
                   autocast=layout.autocast is not None, sp=sp)


def _mask(s: _Shapes, elements: int, dtype_bytes: int, dropout: float, device_type: str) -> int:
    """A dropout mask of ``elements``: the noise in the input's dtype on the CPU, bool on CUDA."""
    if dropout == 0:
        return 0
    return elements * (dtype_bytes if device_type == "cpu" else 1)


def _norm_bias(config: GPTConfig) -> bool:
    return config.bias and config.norm == "layernorm"  # RMSNorm has no bias


def _layer_norm(s: _Shapes, config: GPTConfig) -> int:
    """A norm's saved bytes: LayerNorm's input, mean and 1/std; RMSNorm's input, its normalised input and
    1/rms (``F.rms_norm`` runs as its parts on the CPU); with sequence parallelism also its weight (and
    bias) joined."""
    bias = _norm_bias(config)
    joined = s.c * (1 + bias) * s.p if s.sp else 0
    rows = s.b * s.t_r
    if config.norm == "rmsnorm":
        return 2 * rows * s.c * s.p + rows * 4 + joined
    return rows * s.c * s.p + 2 * rows * 4 + joined


def _rotary(config: GPTConfig, s: _Shapes, device_type: str) -> int:
    """What rotary positions add to a block's saved bytes: the rotated query heads and held key heads that
    SDPA keeps (gathered copies instead where the KV heads are read by index; the math path of dropout on
    the CPU keeps its own), and the angles: the block's table itself, or under autocast its two casts."""
    if config.positions != "rope":
        return 0
    table = config.block_size * 2 * s.d * s.p if s.a == s.p else 2 * s.t * 2 * s.d * s.a
    if config.dropout and device_type == "cpu":
        return table
    return table + s.b * s.t * s.d * s.a * (s.h + (0 if s.kv_by_index else s.h_kv))


def _attention(s: _Shapes, dropout: float, device_type: str) -> int:
    """SDPA's saved tensors and the output projection's input (its weight: :func:`_weights`)."""
    b, t, h, d = s.b, s.t, s.h, s.d
    gathered = 2 * b * h * t * d * s.a + 2 * 8 * h if s.kv_by_index else 0  # K, V copies; the two index lists
    out = b * t * h * d * s.a
    qkv = b * t * (h + 2 * s.h_kv) * d * s.a
    if dropout and device_type == "cpu":  # the math path, in float32 (float64 stays)
        m = max(4, s.a)
        # V as (B·h, T, d): a view of [Q|K|V] where B or h is 1 and nothing was cast, repeated or gathered
        v_view = (b == 1 or h == 1) and m == s.a and s.h_read == h and not s.kv_by_index
        v = qkv if v_view else b * h * t * d * m
        return 2 * b * h * t * d * m + v + 3 * b * h * t * t * m + out + (2 * 8 * h if s.kv_by_index else 0)
    return qkv + b * h * t * max(4, s.a) + out + gathered


def _padded_tokens(config: GPTConfig, s: _Shapes) -> int:
    """The bytes beyond this rank's tokens of the embedding's reduce-scatter output, which the first block
    keeps: uneven shards travel padded to the largest, and this rank's tokens are a view of its padded
    buffer, unless a dropout copied them."""
    most = sequence_sizes(s.t, s.tp)[0]
    if not s.sp or s.t_r == most or (config.dropout and s.t_r):
        return 0
    return s.b * (most - s.t_r) * s.c * s.p


def _block(config: GPTConfig, s: _Shapes, device_type: str) -> int:
    """One block's saved bytes for one micro-batch, weight copies apart."""
    rows_in = s.b * s.t_r * s.c
    swiglu = config.mlp == "swiglu"
    mlp_inputs = 2 if swiglu and s.autocast and not s.sp else 1  # each map casts the input itself
    hidden = (4 if swiglu else 2) * s.b * s.t * s.hidden * s.a
    drops = 2 * _mask(s, rows_in, s.a, config.dropout, device_type)  # the attention's and the MLP's outputs
    return (2 * _layer_norm(s, config) + (1 + mlp_inputs) * rows_in * s.a
            + _attention(s, config.dropout, device_type) + _rotary(config, s, device_type) + hidden + drops)


def _weights(config: GPTConfig, s: _Shapes, blocks: int, last: bool) -> tuple[int, int]:
    """The autocast copies of the matmul weights saved for backward: ``(cached once, per micro-batch)``."""
    if not s.autocast and not s.kv_joined:
        return 0, 0
    rows_qkv = (s.h + 2 * s.h_kv) * s.d
    c_attn = rows_qkv * s.c * s.a
    once, each = 0, 0
    if s.kv_joined:  # a concatenated copy each call, cast (under autocast) each call
        each += blocks * c_attn
    elif s.autocast:
        once += blocks * c_attn
    if not s.autocast:
        return once, each
    fused = s.tp > 1  # the row-parallel maps and the head run fused Functions: a cast each call
    up = (2 if config.mlp == "swiglu" else 1) * s.hidden * s.c * s.a
    once += blocks * up
    proj = blocks * (s.c * s.h * s.d + s.c * s.hidden) * s.a
    head = s.vocab * s.c * s.a if last else 0
    if fused:
        each += proj + head
    else:
        once += proj + head
    return once, each


def in_flight(layout: Layout, stage: int) -> int:
    """Micro-batches whose forward has run and whose backward has not, at a pipeline rank's fullest
    moment: one without a pipeline (accumulated micro-batches run one after the other), every one with
    GPipe, at most ``pp - stage`` with 1F1B (interleaved: counted as 1F1B, an approximation)."""
    if layout.pp == 1:
        return 1
    if layout.schedule == "gpipe":
        return layout.microbatches
    return min(layout.microbatches, layout.pp - stage)


def _check(config: GPTConfig, layout: Layout, stage: int, device_type: str) -> None:
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device_type must be one of {DEVICE_TYPES}, got {device_type!r}")
    if not 0 <= stage < layout.pp:
        raise ValueError(f"stage {stage} is out of range for pp {layout.pp}")
    from tensorpar.bitwise.settings import current_bitwise

    if current_bitwise() is not None:
        raise ValueError("the plan counts the default numerics only; the bitwise mode saves other tensors")


def activation_bytes(config: GPTConfig, layout: Layout, *, tp_rank: int = 0, stage: int = 0,
                     device_type: str = "cpu") -> int:
    """Bytes saved for backward on one rank at the step's fullest moment: its stage's blocks (and the
    embedding, or the final LayerNorm, head and loss) for every micro-batch in flight (see the module's
    docstring), on ``device_type`` (``"cpu"`` or ``"cuda"``: dropout masks and SDPA differ)."""
    _check(config, layout, stage, device_type)
    s = _shapes(config, layout, tp_rank)
    blocks = len(stage_blocks(config.n_layer, layout.pp)[stage])
    first, last = stage == 0, stage == layout.pp - 1
    per, views = 0, 0  # views: the storages of the whole batch's ids and targets, held once
    if first:
        per += _first_stage(config, s, device_type)
        if s.tp == 1 and layout.pp > 1:  # the ids as given: a pipeline's micro-batch of them is a view of the batch's
            per -= 8 * s.b * s.t
            views += 8 * s.b * s.t * layout.microbatches
    if layout.activation_checkpointing:
        per += blocks * s.b * s.t_r * s.c * s.p  # each block's input; its insides are recomputed
    else:
        per += blocks * _block(config, s, device_type)
    if last:
        per += _head_saved(config, s)
        if s.tp == 1:  # the targets as given: a pipeline's micro-batch of them is a view of the whole batch's
            views += 8 * s.b * s.t * (layout.microbatches if layout.pp > 1 else 1)
    once, each = _weights(config, s, 0 if layout.activation_checkpointing else blocks, last)
    flying = in_flight(layout, stage)
    return flying * (per + each) + once + views + (layout.microbatches - flying) * _received(layout, s, stage)


def _head_saved(config: GPTConfig, s: _Shapes) -> int:
    """One micro-batch's saved bytes of the last stage's final LayerNorm, head and loss (at tp = 1
    ``F.cross_entropy``'s log-softmax and the mean's total weight; else the softmax, the local targets, the
    owned and valid masks), the targets as given apart."""
    loss = _loss_bytes(s)
    found = _layer_norm(s, config) + s.b * (s.t if s.tp == 1 else s.t_r) * s.c * s.a + s.b * s.t * s.vocab * loss
    return found + (loss if s.tp == 1 else 8 * s.b * s.t + 2 * s.b * s.t)


def _saved_after_last_fork(config: GPTConfig, layout: Layout, s: _Shapes, stage: int, device_type: str) -> int:
    """What one micro-batch's forward saves after its last fork of the tp stream (with dropout): the last
    stage's head and loss, and the last block's MLP half unless a sequence-parallel dropout forks at the end
    of each block (inside checkpointed blocks nothing is saved)."""
    after = _head_saved(config, s) if stage == layout.pp - 1 else 0
    if layout.activation_checkpointing:
        return after
    return after + _block_after_last_fork(config, s, device_type)


def _block_after_last_fork(config: GPTConfig, s: _Shapes, device_type: str) -> int:
    """A block's saved bytes after its last fork of the tp stream: none where a sequence-parallel dropout
    forks at its end; else its MLP half, after the attention's dropout."""
    if s.sp:
        return 0
    attention = _layer_norm(s, config) + s.b * s.t_r * s.c * s.a + _attention(s, config.dropout, device_type) \
        + _rotary(config, s, device_type)
    return _block(config, s, device_type) - attention


def _pipeline_buffers(layout: Layout, s: _Shapes, stage: int) -> int:
    """What a pipeline stage holds besides its saved activations: the outputs of the micro-batches in flight,
    which the schedule keeps for their backward (the last stage's: the logits), and before the last stage
    the receive buffers of its output's gradient, one per micro-batch of the step (kept as those of the
    inputs are)."""
    if layout.pp == 1:
        return 0
    if stage == layout.pp - 1:
        return in_flight(layout, stage) * s.b * s.t * s.vocab * s.a
    return (layout.microbatches + in_flight(layout, stage)) * s.b * s.t_r * s.c * s.p


def _received(layout: Layout, s: _Shapes, stage: int) -> int:
    """One micro-batch's receive buffer of a pipeline stage's input (none on the first stage):
    torch.distributed.pipelining allocates one per micro-batch of the step when it builds the schedule and
    keeps them; a micro-batch's is its first block's saved input while it is in flight, and stays after."""
    return s.b * s.t_r * s.c * s.p if layout.pp > 1 and stage > 0 else 0


def _loss_bytes(s: _Shapes) -> int:
    """Bytes per element of the loss's buffers: float32 for 16-bit logits, else the logits' own."""
    return 4 if s.a < 4 else s.a


def _forward_transient(s: _Shapes) -> int:
    """What the last stage holds only while its forward ends: the logits (and at tp = 1 under autocast
    their float32 copy), of which the loss keeps its own buffers."""
    logits = s.b * s.t * s.vocab * s.a
    return logits + (s.b * s.t * s.vocab * _loss_bytes(s) if s.tp == 1 and s.a != _loss_bytes(s) else 0)


def _head_backward_transient(s: _Shapes) -> int:
    """What the loss's and the head's backward add while they run: the logits' gradient (at tp > 1 the
    softmax, overwritten in place, and its cast to the logits' dtype), the head's input gradient and its
    weight gradient in the matmul dtype before the cast to the parameters'."""
    btv, loss = s.b * s.t * s.vocab, _loss_bytes(s)
    head = s.b * s.t * s.c * s.a + (s.vocab * s.c * s.a if s.a != s.p else 0)
    if s.tp == 1:  # nll_loss's gradient, then log_softmax's; then the cast back and the head's matmuls
        return btv * loss + max(btv * loss, (btv * s.a if s.a != loss else 0) + head)
    return (btv * s.a if s.a != loss else 0) + head


def _communication(s: _Shapes) -> int:
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
    _check(config, layout, stage, device_type)
    s = _shapes(config, layout, tp_rank)
    found = [_communication(s)]
    if config.dropout and device_type == "cpu":  # the scores before the softmax
        found.append(s.b * s.h * s.t * s.t * max(4, s.a))
    if stage == layout.pp - 1:
        found += [_forward_transient(s), _head_backward_transient(s)]
    return max(found)


def _parameter_sizes(config: GPTConfig, layout: Layout, s: _Shapes, stage: int) -> list[int]:
    """Elements of this rank's parameter tensors, in the model's order (an optimizer's)."""
    c, b, rows, k = s.c, int(config.bias), (s.h + 2 * s.h_kv) * s.d, 2 if config.mlp == "swiglu" else 1
    norm = [c] + [c] * int(_norm_bias(config))
    positions = partition_sizes(config.block_size, s.tp, name="block_size")[0] * c
    sizes = [s.vocab * c, *[positions] * (config.positions == "learned")] if stage == 0 else []
    block = [*norm, rows * c, *[rows] * b, c * s.h * s.d, *[c] * b, *norm,
             *[s.hidden * c, *[s.hidden] * b] * k, c * s.hidden, *[c] * b]
    sizes += block * len(stage_blocks(config.n_layer, layout.pp)[stage])
    if stage == layout.pp - 1:
        sizes += norm + ([s.vocab * c] if stage else [])  # the head's copy where the embedding is elsewhere
    return sizes


def _adamw_temporaries(config: GPTConfig, layout: Layout, s: _Shapes, stage: int, device_type: str,
                       params: int) -> int:
    """AdamW's step temporaries: CUDA's foreach kernels take the square roots of every second moment at
    once; the CPU's loop takes a parameter's square root and quotient while the last one's lives on."""
    if device_type == "cuda":
        return params
    sizes = _parameter_sizes(config, layout, s, stage)
    return max(before + 2 * n for before, n in zip([0, *sizes], sizes, strict=False)) * s.p


Node = tuple[int, int, int]  # a backward step: (saved bytes it lets go, new gradient bytes, working bytes)


def _linear_node(s: _Shapes, saved: int, rows: int, cols: int, bias: bool, grad_out: int, grad_in: int) -> Node:
    """A matmul's backward: its weight ``(rows, cols)`` gradient (computed in the matmul dtype first under
    autocast), the output gradient it reads and the input gradient it makes (elements); with sequence
    parallelism the padded buffer of the collective it runs (of a column map, also the tokens it gathers
    again: count them in ``grad_out``)."""
    cast = rows * cols * s.a if s.a != s.p else 0
    padded = s.b * s.c * s.a * s.tp * sequence_sizes(s.t, s.tp)[0] if s.sp else 0  # a collective's flat buffer
    return saved, (rows * cols + bias * rows) * s.p, (grad_out + grad_in) * s.a + cast + padded


def _block_nodes(config: GPTConfig, s: _Shapes, device_type: str) -> list[Node]:
    """One block's backward, step by step; the saved bytes add up to :func:`_block` and the block's
    weight copies."""
    b, c, bias = s.b, s.c, config.bias
    rows_in, tokens, rows = s.b * s.t_r * s.c, s.b * s.t, (s.h + 2 * s.h_kv) * s.d
    k = 2 if config.mlp == "swiglu" else 1
    copies = s.a if s.autocast else 0  # the weights' autocast copies (the joined KV weight: a copy anyway)
    mask = _mask(s, rows_in, s.a, config.dropout, device_type)
    norm = (_layer_norm(s, config), c * (1 + _norm_bias(config)) * s.p, 2 * rows_in * s.p)
    mlp_inputs = 2 if k == 2 and s.autocast and not s.sp else 1
    hidden = tokens * s.hidden
    attention = _attention(s, config.dropout, device_type) + _rotary(config, s, device_type)
    scores = 2 * b * s.h * s.t * s.t * max(4, s.a) if config.dropout and device_type == "cpu" else 0
    regathered = tokens * c if s.sp else 0  # a column map's input, gathered again from this rank's tokens
    return [
        (mask, 0, 2 * rows_in * s.a),
        _linear_node(s, hidden * s.a + c * s.hidden * copies, c, s.hidden, bias, tokens * c, hidden),
        ((2 * k - 1) * hidden * s.a, 0, (2 * k - 1) * hidden * s.a),  # GELU's input; SiLU's, its output, the up's
        _linear_node(s, mlp_inputs * rows_in * s.a + k * s.hidden * c * copies, k * s.hidden, c, bias,
                     k * hidden + regathered, tokens * c),
        norm,
        (mask, 0, 2 * rows_in * s.a),
        _linear_node(s, c * s.h * s.d * copies, c, s.h * s.d, bias, tokens * c, tokens * s.h * s.d),
        (attention, 0, 2 * tokens * rows * s.a + scores),
        _linear_node(s, rows_in * s.a + rows * c * (s.a if s.kv_joined else copies), rows, c, bias,
                     tokens * rows + regathered, tokens * c),
        norm,
    ]


def _head_nodes(config: GPTConfig, s: _Shapes) -> list[Node]:
    """The loss's, the head's and the final LayerNorm's backward (their saved bytes: the last stage's)."""
    btv, loss, rows_in = s.b * s.t * s.vocab, _loss_bytes(s), s.b * s.t_r * s.c
    cast = btv * s.a if s.a != loss else 0  # the logits' gradient cast back to their dtype
    if s.tp == 1:  # F.cross_entropy: nll_loss's gradient, then log_softmax's, which the head reads
        ce, incoming = (btv * loss + 8 * s.b * s.t + loss, 0, 2 * btv * loss), btv * loss + cast
        softmax = 0
    elif cast:  # the softmax becomes the logits' gradient in place, cast to their dtype for the head
        ce, incoming, softmax = (btv * loss + 8 * s.b * s.t + 2 * s.b * s.t, 0, cast), cast, 0
    else:  # the softmax becomes the logits' gradient in place, which the head reads
        ce, incoming, softmax = (8 * s.b * s.t + 2 * s.b * s.t, 0, 0), 0, btv * loss
    head_input = s.b * (s.t if s.tp == 1 else s.t_r) * s.c * s.a
    grads = s.vocab * s.c * s.p
    head = (softmax + head_input + (s.vocab * s.c * s.a if s.autocast else 0), grads,
            incoming + s.b * s.t * s.c * s.a + (s.vocab * s.c * s.a if s.a != s.p else 0))
    norm = (_layer_norm(s, config), s.c * (1 + _norm_bias(config)) * s.p, 2 * rows_in * s.p)
    return [ce, head, norm]


def _backward(config: GPTConfig, layout: Layout, s: _Shapes, stage: int, device_type: str,
              accumulating: bool) -> int:
    """The most the backward of one micro-batch adds to what the forward's end holds, step by step in
    backward order: each step's working buffers and new gradients while it runs (which stay unless
    ``accumulating`` into those of earlier micro-batches), its saved tensors let go after."""
    blocks = len(stage_blocks(config.n_layer, layout.pp)[stage])
    nodes: list[Node] = _head_nodes(config, s) if stage == layout.pp - 1 else []
    block = _block_nodes(config, s, device_type)
    if layout.activation_checkpointing:  # the block's forward again, the generators' states noted and replayed
        state, stream = _generator_states(config, device_type)
        recomputed = sum(n[0] for n in block)
        # the recomputation's own transients: a row map's partial sums, the residual stream's sum, the gathered
        # tokens of the column regions (held with the recomputed graph, dropped with it); and the states: fork_rng's
        # note of the live generator, the tp stream's live state noted, inside a dropout's fork the state outside it
        ahead = s.b * s.t * s.c * s.a + s.b * s.t_r * s.c * s.p + (2 * s.b * s.t * s.c * s.a if s.sp else 0)
        # all on top of the recomputed activations as the recomputation ends, the stream's state put back; or
        # as its last fork ends (the states outside it and after it too), before the rest of the block
        ended = recomputed + ahead + state + 2 * stream
        if stream:
            ended = max(ended, recomputed - _block_after_last_fork(config, s, device_type) + ahead + state + 3 * stream)
        # after the block's backward its input and the states its checkpoint noted at the forward go
        block = [(-recomputed, 0, ended), *block, (s.b * s.t_r * s.c * s.p + state + stream, 0, 0)]
    nodes += block * blocks
    if stage == 0:
        learned = config.positions == "learned"
        positions = partition_sizes(config.block_size, s.tp, name="block_size")[0] * s.c * s.p * learned
        tied = s.vocab * s.c * s.p  # the lookup's dense gradient, added to the head's
        nodes.append((0, positions + (0 if stage == layout.pp - 1 else tied), tied + s.b * s.t * s.c * s.p))
    live, most = 0, 0
    for freed, grads, working in nodes:
        most = max(most, live + grads + working)  # accumulating, a new gradient is made, then added
        live += (0 if accumulating else grads) - freed
    return most


def _first_stage(config: GPTConfig, s: _Shapes, device_type: str) -> int:
    """The embedding's saved bytes for one micro-batch: ids and positions (at tp > 1 the masked ids and
    the masks of foreign rows), the dropout mask, the padding of the first block's input."""
    table = config.positions == "learned"  # rotary positions: no lookup
    ids = s.b * s.t * 8 + s.t * 8 * table
    masks = ids if s.tp == 1 else ids + s.b * s.t + s.t * table
    return masks + _mask(s, s.b * s.t_r * s.c, s.p, config.dropout, device_type) + _padded_tokens(config, s)


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
    _check(config, layout, stage, device_type)
    s = _shapes(config, layout, tp_rank)
    last = stage == layout.pp - 1
    acts = activation_bytes(config, layout, tp_rank=tp_rank, stage=stage, device_type=device_type)
    blocks = len(stage_blocks(config.n_layer, layout.pp)[stage])
    state, stream = _generator_states(config, device_type)
    if layout.activation_checkpointing:  # the generator states each checkpointed block notes at its forward
        acts += in_flight(layout, stage) * blocks * (state + stream)
    batch = 16 * s.b * s.t * layout.microbatches + stream  # int64 ids and targets of the step; the tp stream
    # the gradients (set to None before the step) made by a micro-batch's backward while others are still to
    # run forward with as many in flight (1F1B's steady state, accumulation); GPipe's backwards all come after
    earlier = grads if layout.microbatches > in_flight(layout, stage) else 0
    held = params + optimizer + batch + acts + _pipeline_buffers(layout, s, stage)
    logits = _forward_transient(s) if last else 0
    if layout.pp > 1:  # the logits are a pipeline's held output (see _pipeline_buffers)
        logits -= s.b * s.t * s.vocab * s.a if last else 0
    forward_end = held + earlier + logits
    if stream:  # the forward's last fork of the tp stream as it ends: the states outside it and after it
        forward_end = max(forward_end, held + earlier + 2 * stream
                          - _saved_after_last_fork(config, layout, s, stage, device_type))
    backward = held + earlier + _backward(config, layout, s, stage, device_type, accumulating=bool(earlier))
    if layout.optimizer == "adamw":
        temporaries = _adamw_temporaries(config, layout, s, stage, device_type, params)
    else:
        temporaries = 0
    step = params + grads + optimizer + batch + temporaries
    return max(forward_end, backward, step)

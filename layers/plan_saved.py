"""What one micro-batch's forward saves for backward on one rank, layer by layer: the plan's counts
of the default numerics (:mod:`layers.plan_activations` adds them up over a stage and the micro-batches in
flight).

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
first block's input), unless dropout copied it. These are what
``saved_tensors_hooks`` sees on the CPU, to the byte in every measured case. On CUDA
(``device_type="cuda"``, not measured here) SDPA's flash or efficient kernels keep ``[Q|K|V]``, the
log-sum-exp and the output with or without dropout, and masks are bool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tensorpar.bitwise import Bitwise
from tensorpar.comm.sequence import sequence_sizes
from tensorpar.sharding import partition_sizes

from .config import GPTConfig
from .heads import head_layout
from .plan_layout import Layout

DEVICE_TYPES = ("cpu", "cuda")
#: the CPU generator's state (its Mersenne twister) as ``torch.get_rng_state()`` returns it: checkpoints note one
#: per block, the tp streams keep theirs; on CUDA every state (the GPU's too) is a host tensor, no device memory
CPU_RNG_STATE_BYTES = 5056


def generator_states(config: GPTConfig, device_type: str, bitwise: bool = False) -> tuple[int, int]:
    """Bytes of ``(a generator state, the tp stream's state)`` in ``device_type``'s memory: the stream has
    one once a dropout has drawn from it (never in the ``bitwise`` mode, whose dropouts draw one mask for
    every tp from the default generator)."""
    state = CPU_RNG_STATE_BYTES if device_type == "cpu" else 0
    return state, state if config.dropout and not bitwise else 0


def _itemsize(name: str | None, what: str) -> int:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{what} must name a floating-point torch dtype, got {name!r}")
    return dtype.itemsize


@dataclass(frozen=True)
class Shapes:
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
    rank: int = 0  # this rank's index in its tp group
    mode: Bitwise | None = None  # the bitwise mode the layers are built in (None: the default numerics)
    sp_built: bool = False  # the layers built for sequence parallelism (at tp 1 too, where ``sp`` is False)


def shapes_of(config: GPTConfig, layout: Layout, tp_rank: int) -> Shapes:
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
    return Shapes(b=layout.micro_batch, t=t, t_r=sequence_sizes(t, tp)[tp_rank] if sp else t, c=config.n_embd,
                   d=config.n_embd // config.n_head, h=len(heads.query), h_kv=len(heads.kv_held),
                   kv_by_index=heads.group_size is None, kv_joined=heads.kv_replicated and tp > 1,
                   h_read=len(heads.query) if heads.group_size is None else len(heads.kv_reads),
                   hidden=partition_sizes(config.mlp_hidden, tp)[tp_rank],
                   vocab=partition_sizes(config.vocab_size, tp, name="vocab_size")[tp_rank], tp=tp, p=p, a=a,
                   autocast=layout.autocast is not None, sp=sp, rank=tp_rank, mode=layout.numerics,
                   sp_built=layout.sequence_parallel)


def check_where(config: GPTConfig, layout: Layout, stage: int, device_type: str) -> None:
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device_type must be one of {DEVICE_TYPES}, got {device_type!r}")
    if not 0 <= stage < layout.pp:
        raise ValueError(f"stage {stage} is out of range for pp {layout.pp}")


def dropout_mask(s: Shapes, elements: int, dtype_bytes: int, dropout: float, device_type: str) -> int:
    """A dropout mask of ``elements``: the noise in the input's dtype on the CPU, bool on CUDA; bool in the
    bitwise mode with sequence parallelism (this rank's tokens of one draw for the whole sequence, compared)."""
    if dropout == 0:
        return 0
    return elements * (dtype_bytes if device_type == "cpu" and not (s.mode is not None and s.sp_built) else 1)


def norm_bias(config: GPTConfig) -> bool:
    return config.bias and config.norm == "layernorm"  # RMSNorm has no bias


def norm_saved(s: Shapes, config: GPTConfig) -> int:
    """A norm's saved bytes: LayerNorm's input, mean and 1/std; RMSNorm's input, its normalised input and
    1/rms (``F.rms_norm`` runs as its parts on the CPU); with sequence parallelism also its weight (and
    bias) joined."""
    bias = norm_bias(config)
    joined = s.c * (1 + bias) * s.p if s.sp else 0
    rows = s.b * s.t_r
    if config.norm == "rmsnorm":
        return 2 * rows * s.c * s.p + rows * 4 + joined
    return rows * s.c * s.p + 2 * rows * 4 + joined


def rotary_saved(config: GPTConfig, s: Shapes, device_type: str) -> int:
    """What rotary positions add to a block's saved bytes: the rotated query heads and held key heads that
    SDPA keeps (gathered copies instead where the KV heads are read by index; the math path of dropout on
    the CPU keeps its own), and the angles: the block's table itself, or under autocast its two casts."""
    if config.positions != "rope":
        return 0
    table = config.block_size * 2 * s.d * s.p if s.a == s.p else 2 * s.t * 2 * s.d * s.a
    if config.dropout and device_type == "cpu":
        return table
    return table + s.b * s.t * s.d * s.a * (s.h + (0 if s.kv_by_index else s.h_kv))


def attention_saved(s: Shapes, dropout: float, device_type: str) -> int:
    """SDPA's saved tensors and the output projection's input (its weight: :func:`weight_copies`)."""
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


def _padded_tokens(config: GPTConfig, s: Shapes) -> int:
    """The bytes beyond this rank's tokens of the embedding's reduce-scatter output, which the first block
    keeps: uneven shards travel padded to the largest, and this rank's tokens are a view of its padded
    buffer, unless a dropout copied them (the default's leaves no tokens as they are; the bitwise mode's
    multiplies even those)."""
    most = sequence_sizes(s.t, s.tp)[0]
    if not s.sp or s.t_r == most or (config.dropout and (s.t_r or s.mode is not None)):
        return 0
    return s.b * (most - s.t_r) * s.c * s.p


def block_saved(config: GPTConfig, s: Shapes, device_type: str) -> int:
    """One block's saved bytes for one micro-batch, weight copies apart."""
    rows_in = s.b * s.t_r * s.c
    swiglu = config.mlp == "swiglu"
    mlp_inputs = 2 if swiglu and s.autocast and not s.sp else 1  # each map casts the input itself
    hidden = (4 if swiglu else 2) * s.b * s.t * s.hidden * s.a
    drops = 2 * dropout_mask(s, rows_in, s.a, config.dropout, device_type)  # the attention's and the MLP's outputs
    return (2 * norm_saved(s, config) + (1 + mlp_inputs) * rows_in * s.a
            + attention_saved(s, config.dropout, device_type) + rotary_saved(config, s, device_type) + hidden + drops)


def block_after_last_fork(config: GPTConfig, s: Shapes, device_type: str) -> int:
    """A block's saved bytes after its last fork of the tp stream: none where a sequence-parallel dropout
    forks at its end; else its MLP half, after the attention's dropout."""
    if s.sp:
        return 0
    attention = norm_saved(s, config) + s.b * s.t_r * s.c * s.a + attention_saved(s, config.dropout, device_type) \
        + rotary_saved(config, s, device_type)
    return block_saved(config, s, device_type) - attention


def weight_copies(config: GPTConfig, s: Shapes, blocks: int, last: bool) -> tuple[int, int]:
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


def first_stage_saved(config: GPTConfig, s: Shapes, device_type: str) -> int:
    """The embedding's saved bytes for one micro-batch: ids and positions (at tp > 1 the masked ids and
    the masks of foreign rows), the dropout mask, the padding of the first block's input."""
    table = config.positions == "learned"  # rotary positions: no lookup
    ids = s.b * s.t * 8 + s.t * 8 * table
    masks = ids if s.tp == 1 else ids + s.b * s.t + s.t * table
    return masks + dropout_mask(s, s.b * s.t_r * s.c, s.p, config.dropout, device_type) + _padded_tokens(config, s)


def head_saved(config: GPTConfig, s: Shapes) -> int:
    """One micro-batch's saved bytes of the last stage's final LayerNorm, head and loss (at tp = 1
    ``F.cross_entropy``'s log-softmax and the mean's total weight; else the softmax, the local targets, the
    owned and valid masks), the targets as given apart."""
    loss = loss_itemsize(s)
    found = norm_saved(s, config) + s.b * (s.t if s.tp == 1 else s.t_r) * s.c * s.a + s.b * s.t * s.vocab * loss
    return found + (loss if s.tp == 1 else 8 * s.b * s.t + 2 * s.b * s.t)


def loss_itemsize(s: Shapes) -> int:
    """Bytes per element of the loss's buffers: float32 for 16-bit logits, else the logits' own."""
    return 4 if s.a < 4 else s.a

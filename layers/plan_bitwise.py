"""What one micro-batch's forward saves for backward on one rank in the bitwise mode (:mod:`tensorpar.bitwise`),
layer by layer, and its backward step by step: the counts of :mod:`layers.plan_saved` and
:mod:`layers.plan_backward` for the mode's layers, in the letters of :mod:`layers.plan_saved` (``N = B·T``
the micro-batch's tokens, ``N_r = B·T_r`` this rank's).

The mode computes by canonical segments, with fixed shapes, and saves other tensors than the default:

* its norms (``TokenwiseNorm``) keep the input ``p·N_r·C`` and LayerNorm's mean and 1/std ``4·N_r`` each
  (RMSNorm's 1/rms ``p·N_r``), their parameters themselves (nothing joined);
* a column map keeps its input: the tokens as the default keeps them (``p·N_r·C`` with sequence parallelism,
  gathered again in backward, else ``p·N·C``, shared by the maps of one region), but under autocast each map
  casts its gathered input itself, ``a·N·C`` each; a row map keeps its input as one copy per leaf of its
  segments, ``a·N·(its input features)`` in all (a leaf of one segment that is contiguous, the rank's whole
  width or one token row, and aligned is a view instead: the activation's output over ``⌈N·H⌉₆₄`` elements);
* the activations run on flat tensors padded to a multiple of 64 elements: GELU or SiLU keep that padded
  input ``a·⌈N·H⌉₆₄`` (SwiGLU's product also SiLU's padded output and the up projection ``a·N·H``);
* attention reads its keys in blocks of ``key_block`` slots (``S``: that rounded up to a multiple of 8), each
  in float32 (``w``: 4, or 8 for float64) for queries padded to ``R = max(T, 8)`` rows, heads to ``h' = h``
  (2 where ``B·h`` is 1) and head size to ``d' = ⌈d⌉₈``: per key block its keys and values ``2·w·B·h'·S·d'``,
  scores ``w·B·h'·R·S``, their exponentials as many, their maximum ``w·B·h'·R`` and the mask ``R·S``; once
  the queries and the output ``2·w·B·h'·R·d'``, the sum of the exponentials ``w·B·h'·R`` and the running
  maximum of each key block after the second; rotary positions keep only their table;
* with dropout, attention runs one head at a time in its dtype ``a``, its mask drawn from the default generator
  for every head of the model (``4·B·n_head·T·T`` of noise, held while it is compared), of which the rank keeps
  its heads' ``B·h·T·T`` (bool): each head keeps its query, key and value ``3·a·B·T·d`` (copies; views of a
  fresh tensor where ``B`` is 1 and the head's block is aligned), its causal mask ``T·T`` (bool), its
  probabilities and the dropped ones ``2·a·B·T·T`` and its part of the mask; the attention's and the MLP's
  output dropouts keep their masks ``a·N_r·C`` (bool with sequence parallelism: one draw for the whole
  sequence, this rank's tokens compared), the embedding's ``p·N_r·C`` (likewise); no tp stream is forked;
* under autocast every map casts its weight each call: one copy per micro-batch of every matmul weight;
* the loss is the vocab-parallel cross-entropy at every tp, 1 included.

Counted for the CPU with one thread per rank (``Bitwise.threads``, as ``enable`` sets it).
"""

from __future__ import annotations

import functools

from tensorpar.bitwise.linear import ALIGNMENT
from tensorpar.bitwise.segments import Piece, placed_split, placed_vocabulary
from tensorpar.comm.sequence import sequence_sizes
from tensorpar.sharding import partition_bounds

from .config import GPTConfig
from .plan_exchange import exchange, qkv_pieces
from .plan_saved import Shapes, dropout_mask, loss_itemsize, norm_bias

#: attention's widths are padded to a multiple of this, its queries to at least this many rows
#: (:data:`tensorpar.bitwise.linear.WIDTH_MULTIPLE`, :data:`~tensorpar.bitwise.linear.MIN_ROWS`)
WIDTH, ROWS = 8, 8
#: elementwise kernels run on flat tensors padded to a multiple of this (:data:`~tensorpar.bitwise.linear.LANES`)
LANES = 64

Node = tuple[int, int, int]  # a backward step: (saved bytes it lets go, new gradient bytes, working bytes)


def _up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@functools.lru_cache(maxsize=256)
def _leaf_pieces(size: int, tp: int, rank: int, tp_sizes: tuple[int, ...]) -> tuple[tuple[Piece, ...], ...]:
    """The ``(local offset, length)`` pieces of each of this rank's leaves of its balanced shard of ``size``
    features at the mode's tp sizes."""
    placed = placed_split(lambda t, r: [partition_bounds(size, t, r)], size, tp, rank, tp_sizes)
    return tuple(placed.pieces(leaf) for leaf in placed.mine)


@functools.lru_cache(maxsize=256)
def _query_leaf_pieces(n_head: int, n_kv: int, d: int, tp: int, rank: int, tp_sizes: tuple[int, ...],
                       queries_only: bool = True) -> tuple[tuple[Piece, ...], ...]:
    """The pieces of each of this rank's leaves of its query features (the output projection's input), or of
    the fused ``[Q|K|V]`` rows."""
    size = (n_head + (0 if queries_only else 2 * n_kv)) * d
    placed = placed_split(qkv_pieces(n_head, n_kv, d, queries_only), size, tp, rank, tp_sizes)
    return tuple(placed.pieces(leaf) for leaf in placed.mine)


def _leaf_copies(s: Shapes, size: int, rows: int, storage: int,
                 leaves: tuple[tuple[Piece, ...], ...] | None = None) -> int:
    """Bytes of the copies of its input that a row map of ``size`` full features keeps, one per leaf of ``rows``
    rows (``a`` bytes an element), read from a fresh tensor of ``storage`` bytes: a leaf of one piece that is
    contiguous (the whole width, or one row) and aligned is a view of that tensor instead, held whole."""
    assert s.mode is not None
    leaves = _leaf_pieces(size, s.tp, s.rank, s.mode.tp_sizes) if leaves is None else leaves
    width = sum(n for pieces in leaves for _, n in pieces)
    viewed = [len(pieces) == 1 and (rows == 1 or pieces[0][1] == width) and pieces[0][0] * s.a % ALIGNMENT["cpu"] == 0
              for pieces in leaves]
    copied = sum(n for pieces, view in zip(leaves, viewed, strict=True) if not view for _, n in pieces)
    return (storage if any(viewed) else 0) + rows * copied * s.a


def projection_exchange(config: GPTConfig, s: Shapes) -> int:
    """What a block holds beyond its saved bytes up to attention's output (its input apart) while the output
    projection's tree sum exchanges: what attention's forward still holds (the fused ``[Q|K|V]`` output, with
    rotary positions the turned queries and keys, with sequence parallelism the gathered tokens; its output
    and that side by side), the projection's weight columns padded leaf by leaf, and the exchange (:func:`exchange`)."""
    assert s.mode is not None
    tokens = s.b * s.t
    held = tokens * (s.h + 2 * s.h_kv) * s.d * s.a + (tokens * s.c * s.p if s.sp else 0)
    if config.positions == "rope" and not (config.dropout and s.b == 1):  # else views the heads keep
        held += tokens * (s.h + s.h_kv) * s.d * s.a
    out = tokens * s.h * s.d * s.a  # attention's output (B, h, T, d); (B, T, h·d) a copy unless a view of it
    held += out if s.h > 1 and s.t > 1 else 0
    leaves = _query_leaf_pieces(config.n_head, config.kv_heads, s.d, s.tp, s.rank, s.mode.tp_sizes)
    if config.dropout:  # the output is fresh, not saved (but as the tensor the projection's leaves view)
        held += out - _projection_input(config, s) + _leaf_copies(s, config.n_head * s.d, tokens, 0, leaves)
    return held + _row_columns(s, leaves) + exchange(config, s, "query")


def mlp_exchange(config: GPTConfig, s: Shapes) -> int:
    """What a block holds beyond its saved bytes (its input apart) while the MLP's row map's tree sum exchanges:
    what the MLP's forward still holds (with sequence parallelism the gathered tokens; the activation's output,
    where the row map keeps copies of its leaves), the row map's weight columns padded leaf by leaf, and the
    exchange (:func:`exchange`)."""
    assert s.mode is not None
    n = s.b * s.t * s.hidden
    output = n * s.a if config.mlp == "swiglu" else _up(n, LANES) * s.a  # fresh: flat and padded for GELU
    leaves = _leaf_pieces(config.mlp_hidden, s.tp, s.rank, s.mode.tp_sizes)
    viewed = _leaf_copies(s, config.mlp_hidden, s.b * s.t, output) - _leaf_copies(s, config.mlp_hidden, s.b * s.t, 0)
    return (s.b * s.t * s.c * s.p if s.sp else 0) + output - viewed + _row_columns(s, leaves) + exchange(
        config, s, "hidden")


def _row_columns(s: Shapes, leaves: tuple[tuple[Piece, ...], ...]) -> int:
    """The weight columns a row map reads for each of its ``leaves``, side by side and padded to a width of a
    multiple of :data:`WIDTH` (:func:`~tensorpar.bitwise.linear.row_operands`): a copy, but of a leaf that is
    the whole local width, one piece, already as wide as that."""
    width = sum(n for pieces in leaves for _, n in pieces)
    copied = [pieces for pieces in leaves if len(pieces) > 1 or pieces[0][1] != width or width % WIDTH or s.c < 2]
    return sum(max(s.c, 2) * _up(sum(n for _, n in pieces), WIDTH) * s.a for pieces in copied)


def norm_saved(s: Shapes, config: GPTConfig) -> int:
    """A ``TokenwiseNorm``'s saved bytes: its input and LayerNorm's mean and 1/std (RMSNorm's 1/rms)."""
    rows = s.b * s.t_r
    return rows * s.c * s.p + (rows * s.p if config.norm == "rmsnorm" else 2 * rows * 4)


def _column_inputs(s: Shapes, maps: int) -> int:
    """The input a region of ``maps`` column maps keeps: cast by each under autocast (whole tokens), else
    shared (this rank's tokens with sequence parallelism)."""
    if s.a != s.p:
        return maps * s.b * s.t * s.c * s.a
    return s.b * (s.t_r if s.sp else s.t) * s.c * s.p


def _attention_sizes(s: Shapes) -> tuple[int, int, int, int, int, int]:
    """``(w, R, h', d', S, key blocks)`` of the attention by key blocks (see the module's docstring)."""
    assert s.mode is not None
    return (max(4, s.a), max(s.t, ROWS), s.h if s.b * s.h >= 2 else 2, _up(s.d, WIDTH), _up(s.mode.key_block, WIDTH),
            -(-s.t // s.mode.key_block))


def _head_blocks(s: Shapes, per_head: int, itemsize: int, fresh: bool) -> int:
    """Bytes of the per-head blocks that attention with dropout hands each head (:func:`~tensorpar.bitwise.linear.
    blockwise`): a copy of each head's ``per_head`` elements, except where a block of a fresh ``(B, h, ...)`` tensor
    is contiguous (``B == 1``) and aligned: then a view of that tensor, held whole."""
    if not (fresh and s.b == 1):
        return s.h * per_head * itemsize
    copied = sum(1 for j in range(1, s.h) if j * per_head * itemsize % ALIGNMENT["cpu"])
    return (s.h + copied) * per_head * itemsize


def _dropped_saved(config: GPTConfig, s: Shapes) -> int:
    """Attention with dropout, one head at a time (``a``: its dtype): each head's query, key and value
    ``3·a·B·T·d`` (copies, or views of fresh tensors), its causal mask ``T·T`` (bool), its probabilities and
    the dropped probabilities ``2·a·B·T·T``, its part of the mask ``B·T·T`` (bool)."""
    t, d = s.t, s.d
    rope = config.positions == "rope"
    expanded = config.kv_heads != config.n_head  # each query head's own copy of its KV head (fresh)
    one = s.b * t == 1  # one token: the heads of [Q|K|V] itself are contiguous, views of it where aligned
    qkv, viewed = 0, False
    for fresh, start in ((rope, 0), (rope or expanded, s.h * d), (expanded, (s.h + s.h_kv) * d)):
        if fresh or not one:
            qkv += _head_blocks(s, s.b * t * d, s.a, fresh)
            continue
        aligned = [(start + j * d) * s.a % ALIGNMENT["cpu"] == 0 for j in range(s.h)]
        qkv += aligned.count(False) * d * s.a
        viewed = viewed or any(aligned)
    qkv += (s.h + 2 * s.h_kv) * d * s.a if viewed else 0
    return qkv + s.h * t * t + 2 * s.h * s.b * t * t * s.a + _head_blocks(s, s.b * t * t, 1, True)


def _projection_input(config: GPTConfig, s: Shapes) -> int:
    """The output projection's saved input, a copy per leaf of the query features (with dropout the heads'
    output is a fresh tensor, of which one token's leaves are views where aligned)."""
    n = s.b * s.t * s.h * s.d * s.a
    if not config.dropout:
        return n
    assert s.mode is not None
    leaves = _query_leaf_pieces(config.n_head, config.kv_heads, s.d, s.tp, s.rank, s.mode.tp_sizes)
    return _leaf_copies(s, config.n_head * s.d, s.b * s.t, n, leaves)


def dropped_transient(config: GPTConfig, s: Shapes) -> int:
    """What attention with dropout holds only while it draws its mask: the noise for every head of the model
    (float32), of which this rank keeps its heads', and one head's scores."""
    if not config.dropout:
        return 0
    return s.b * config.n_head * s.t * s.t * 4 + 2 * s.b * s.t * s.t * s.a


def attention_saved(config: GPTConfig, s: Shapes) -> int:
    """The attention's saved bytes: by key blocks (see the module's docstring), or with dropout head by head."""
    if config.dropout:
        return _dropped_saved(config, s)
    w, rows, heads, width, slots, blocks = _attention_sizes(s)
    b = s.b
    per_block = 2 * b * heads * slots * width * w + rows * slots + 2 * b * heads * rows * slots * w \
        + b * heads * rows * w
    once = 2 * b * heads * rows * width * w + b * heads * rows * w * (1 + max(0, blocks - 2))
    return blocks * per_block + once


def attention_unheld(config: GPTConfig, s: Shapes) -> int:
    """The saved bytes of attention that backward never reaches, let go as its forward ends: by key blocks the
    scores and maxima that the (detached) running maximum saved; none with dropout."""
    if config.dropout:
        return 0
    w, rows, heads, _, slots, blocks = _attention_sizes(s)
    return blocks * s.b * heads * rows * (slots + 1) * w + max(0, blocks - 2) * s.b * heads * rows * w


def attention_forward_extra(config: GPTConfig, s: Shapes) -> int:
    """What attention's forward holds beyond what its backward reads, as a key block's exponentials are made:
    :func:`attention_unheld` and that block's shifted scores (a recomputation holds them over the block's
    recomputed activations); with dropout, :func:`dropped_transient` instead."""
    if config.dropout:
        return 0
    w, rows, heads, _, slots, _ = _attention_sizes(s)
    return attention_unheld(config, s) + s.b * heads * rows * slots * w


def row_forward(config: GPTConfig, s: Shapes) -> int:
    """What the MLP's row map holds in its forward beyond its saved inputs: each leaf's weight columns padded to
    a multiple of :data:`WIDTH`, each leaf's product of at least :data:`ROWS` rows until the tree sum adds it,
    and one leaf's input padded as it is multiplied (16-bit operands: also both widened to float32, and the
    float32 product before it is rounded back)."""
    assert s.mode is not None
    widths = [sum(n for _, n in pieces) for pieces in _leaf_pieces(config.mlp_hidden, s.tp, s.rank,
                                                                       s.mode.tp_sizes)]
    rows, widest = max(s.b * s.t, ROWS), _up(max(widths, default=0), WIDTH)
    widened = (rows * widest + max(s.c, 2) * widest + rows * s.c) * 4 if s.a < 4 else 0
    return sum(max(s.c, 2) * _up(n, WIDTH) * s.a + rows * s.c * s.a for n in widths) + rows * widest * s.a + widened


def _attention_working(config: GPTConfig, s: Shapes) -> int:
    """What attention's backward holds at its fullest: by key blocks a key block's score gradient and its sum's,
    the values' gradient made as the values let go; with dropout a head's probability gradients and the
    heads' query, key and value gradients, then joined."""
    if config.dropout:
        return 3 * s.b * s.t * s.t * s.a + 2 * 3 * s.b * s.h * s.t * s.d * s.a
    w, rows, heads, _, slots, _ = _attention_sizes(s)
    return 2 * s.b * heads * rows * slots * w


def _rotary_table(config: GPTConfig, s: Shapes) -> int:
    if config.positions != "rope":
        return 0
    return config.block_size * 2 * s.d * s.p if s.a == s.p else 2 * s.t * 2 * s.d * s.a


def _mlp_saved(config: GPTConfig, s: Shapes) -> int:
    """The activation's and the row map's saved bytes of one MLP (its column maps' inputs apart)."""
    n = s.b * s.t * s.hidden
    padded = _up(n, LANES) * s.a
    if config.mlp == "swiglu":  # SiLU's padded input and output, the up projection, the product's leaves
        return 2 * padded + n * s.a + _leaf_copies(s, config.mlp_hidden, s.b * s.t, n * s.a)
    return padded + _leaf_copies(s, config.mlp_hidden, s.b * s.t, padded)  # GELU's padded input, its output's leaves


def block_saved(config: GPTConfig, s: Shapes) -> int:
    """One block's saved bytes for one micro-batch, weight copies apart."""
    k = 2 if config.mlp == "swiglu" else 1
    return (2 * norm_saved(s, config) + _column_inputs(s, 1) + _column_inputs(s, k) + attention_saved(config, s)
            + _rotary_table(config, s) + _projection_input(config, s) + _mlp_saved(config, s)
            + 2 * residual_mask(config, s))


def mlp_half(config: GPTConfig, s: Shapes) -> int:
    """The saved bytes of a block after its attention: the second norm's, the MLP's and their dropout's."""
    k = 2 if config.mlp == "swiglu" else 1
    return norm_saved(s, config) + _column_inputs(s, k) + _mlp_saved(config, s) + residual_mask(config, s)


def residual_mask(config: GPTConfig, s: Shapes) -> int:
    """The mask of the attention's or the MLP's output dropout: of this rank's tokens, ``a`` bytes an element
    (``x * noise``), or bool with sequence parallelism (this rank's tokens of one draw, compared)."""
    return dropout_mask(s, s.b * s.t_r * s.c, s.a, config.dropout, "cpu")


def weight_copies(config: GPTConfig, s: Shapes, blocks: int, last: bool) -> int:
    """The autocast copies of the matmul weights each map casts each call, per micro-batch."""
    if s.a == s.p:
        return 0
    k = 2 if config.mlp == "swiglu" else 1
    block = (s.h + 2 * s.h_kv) * s.d * s.c + s.c * s.h * s.d + (k + 1) * s.hidden * s.c
    return (blocks * block + (s.vocab * s.c if last else 0)) * s.a


def head_saved(config: GPTConfig, s: Shapes) -> int:
    """The final norm's, the head's and the vocab-parallel cross-entropy's saved bytes (the softmax, the local
    targets, the owned and valid masks)."""
    n = s.b * s.t
    head_input = n * s.c * (s.a if s.a != s.p else s.p)  # the whole tokens: the head gathers them itself
    return norm_saved(s, config) + head_input + n * s.vocab * loss_itemsize(s) + 8 * n + 2 * n


def loss_transient(config: GPTConfig, s: Shapes) -> int:
    """What the loss's forward holds besides the logits while it sums their exponentials: each vocabulary
    segment's exponentials, padded flat (:class:`tensorpar.bitwise.vocabulary.SegmentedExpSum`), and the
    last one's contiguous copy."""
    assert s.mode is not None
    n, w = s.b * s.t, loss_itemsize(s)
    lengths = placed_vocabulary_lengths(config.vocab_size, s.tp, s.rank, s.mode.tp_sizes)
    return sum(_up(n * k, LANES) * w for k in lengths) + n * max(lengths) * w


@functools.lru_cache(maxsize=256)
def placed_vocabulary_lengths(vocab_size: int, tp: int, rank: int, tp_sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The lengths of this rank's canonical segments of the vocabulary."""
    return tuple(placed_vocabulary(vocab_size, tp, rank, tp_sizes).lengths())


def _gradient_copies(s: Shapes, leaves: tuple[tuple[Piece, ...], ...]) -> int:
    """What a column map's backward copies of its ``(N, its output features)`` output gradient: each leaf's
    columns side by side (but a leaf that is the whole width: the gradient itself), held while it runs."""
    width = sum(n for pieces in leaves for _, n in pieces)
    return sum(s.b * s.t * n * s.a for pieces in leaves if len(pieces) > 1 or pieces[0][1] != width for _, n in pieces)


def _linear_node(s: Shapes, saved: int, rows: int, cols: int, bias: bool, grad_out: int, grad_in: int,
                 leaves: bool, exchanged: int = 0, copies: int = 0) -> Node:
    """A segmented map's backward: its weight gradient (made leaf by leaf, then joined), the output gradient it
    reads and the input gradient it makes (elements), in float32 where the products widen 16-bit operands; a
    column map's ``copies`` of its output gradient (bytes: :func:`_gradient_copies`)."""
    grads = (rows * cols + bias * rows) * s.p
    joined = rows * cols * s.a if leaves else 0  # the leaves' weight gradients before they are joined
    padded = s.b * s.c * s.a * s.tp * sequence_sizes(s.t, s.tp)[0] if s.sp else 0  # a collective's flat buffer
    return saved, grads, grad_out * s.a + joined + padded + copies + max(2 * grad_in * s.a, exchanged)


def block_nodes(config: GPTConfig, s: Shapes, device_type: str = "cpu") -> list[Node]:
    """One block's backward, step by step; the saved bytes add up to :func:`block_saved` and the block's
    weight copies."""
    c, bias = s.c, config.bias
    tokens, rows, k = s.b * s.t, (s.h + 2 * s.h_kv) * s.d, 2 if config.mlp == "swiglu" else 1
    copies = s.a if s.a != s.p else 0
    rows_in = s.b * s.t_r * s.c
    norm = (norm_saved(s, config), c * (1 + norm_bias(config)) * s.p, 2 * rows_in * s.p)
    hidden = tokens * s.hidden
    mlp = _mlp_saved(config, s)
    leaves = mlp - (_up(hidden, LANES) * s.a if config.mlp == "gelu" else 3 * hidden * s.a)
    assert s.mode is not None
    attention = attention_saved(config, s) - attention_unheld(config, s) + _rotary_table(config, s)
    regathered = tokens * c if s.sp else 0
    mask = (residual_mask(config, s), 0, 2 * s.b * s.t_r * c * s.a)
    return [
        mask,
        _linear_node(s, leaves + c * s.hidden * copies, c, s.hidden, bias, tokens * c, hidden, True),
        (mlp - leaves, 0, (2 * k - 1) * _up(hidden, LANES) * s.a),
        _linear_node(s, _column_inputs(s, k) + k * s.hidden * c * copies, k * s.hidden, c, bias,
                     k * hidden + regathered, tokens * c, False, exchange(config, s, "hidden"),
                     _gradient_copies(s, _leaf_pieces(config.mlp_hidden, s.tp, s.rank, s.mode.tp_sizes))),
        norm,
        mask,
        _linear_node(s, _projection_input(config, s) + c * s.h * s.d * copies, c, s.h * s.d, bias, tokens * c,
                     tokens * s.h * s.d, True),
        (attention, 0, _attention_working(config, s)),
        _linear_node(s, _column_inputs(s, 1) + rows * c * copies, rows, c, bias, tokens * rows + regathered,
                     tokens * c, False, exchange(config, s, "qkv"), _gradient_copies(s, _query_leaf_pieces(
                         config.n_head, config.kv_heads, s.d, s.tp, s.rank, s.mode.tp_sizes, False))),
        norm,
    ]


def head_nodes(config: GPTConfig, s: Shapes) -> list[Node]:
    """The loss's, the head's and the final norm's backward (their saved bytes: :func:`head_saved`)."""
    assert s.mode is not None
    n, loss = s.b * s.t, loss_itemsize(s)
    btv = n * s.vocab
    cast = btv * s.a if s.a != loss else 0  # the softmax becomes the logits' gradient in place, cast for the head
    ce = (btv * loss + 8 * n + 2 * n if cast else 8 * n + 2 * n, 0, cast)
    head_input = n * s.c * (s.a if s.a != s.p else s.p)
    grads, copy = s.vocab * s.c * s.p, s.vocab * s.c * s.a if s.a != s.p else 0  # copy: the weight's, its gradient
    working = cast + copy + _gradient_copies(s, _leaf_pieces(config.vocab_size, s.tp, s.rank, s.mode.tp_sizes)) \
        + max(2 * n * s.c * s.a, exchange(config, s, "vocab"))
    if copy:  # the weight's gradient is made from its copy's, after the input gradient's exchange
        working = max(working - grads, cast + copy)
    head = ((0 if cast else btv * loss) + head_input + copy, grads, working)
    rows_in = s.b * s.t_r * s.c
    norm = (norm_saved(s, config), s.c * (1 + norm_bias(config)) * s.p, 2 * rows_in * s.p)
    return [ce, head, norm]

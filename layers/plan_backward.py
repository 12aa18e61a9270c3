"""The backward of one micro-batch step by step, and AdamW's step temporaries: what a rank holds on top of
the forward's end while the gradients are made (:func:`backward_peak`) and while the optimizer steps
(:func:`adamw_temporaries`), for :func:`layers.plan_activations.peak_bytes`.

Each step of the backward (a :data:`Node`) makes its new gradients and working buffers, and lets its saved
tensors go after it runs; the saved bytes of a block's steps add up to :func:`~layers.plan_saved.block_saved`.
"""

from __future__ import annotations

from tensorpar.comm.sequence import sequence_sizes
from tensorpar.sharding import partition_sizes

from . import plan_bitwise as bitwise
from .config import GPTConfig
from .plan_layout import Layout
from .plan_saved import (
    Shapes,
    attention_saved,
    block_after_last_fork,
    dropout_mask,
    generator_states,
    loss_itemsize,
    norm_bias,
    norm_saved,
    rotary_saved,
)
from .plan_schedule import stage_sizes


def _parameter_sizes(config: GPTConfig, layout: Layout, s: Shapes, stage: int) -> list[int]:
    """Elements of this rank's parameter tensors, in the model's order (an optimizer's)."""
    c, b, rows, k = s.c, int(config.bias), (s.h + 2 * s.h_kv) * s.d, 2 if config.mlp == "swiglu" else 1
    norm = [c] + [c] * int(norm_bias(config))
    positions = partition_sizes(config.block_size, s.tp, name="block_size")[0] * c
    sizes = [s.vocab * c, *[positions] * (config.positions == "learned")] if stage == 0 else []
    block = [*norm, rows * c, *[rows] * b, c * s.h * s.d, *[c] * b, *norm,
             *[s.hidden * c, *[s.hidden] * b] * k, c * s.hidden, *[c] * b]
    sizes += block * sum(stage_sizes(config.n_layer, layout, stage).values())
    if stage == layout.pp - 1:
        sizes += norm + ([s.vocab * c] if stage else [])  # the head's copy where the embedding is elsewhere
    return sizes


def adamw_temporaries(config: GPTConfig, layout: Layout, s: Shapes, stage: int, device_type: str,
                       params: int) -> int:
    """AdamW's step temporaries: CUDA's foreach kernels take the square roots of every second moment at
    once; the CPU's loop takes a parameter's square root and quotient while the last one's lives on."""
    if device_type == "cuda":
        return params
    sizes = _parameter_sizes(config, layout, s, stage)
    return max(before + 2 * n for before, n in zip([0, *sizes], sizes, strict=False)) * s.p


Node = tuple[int, int, int]  # a backward step: (saved bytes it lets go, new gradient bytes, working bytes)


def _linear_node(s: Shapes, saved: int, rows: int, cols: int, bias: bool, grad_out: int, grad_in: int) -> Node:
    """A matmul's backward: its weight ``(rows, cols)`` gradient (computed in the matmul dtype first under
    autocast), the output gradient it reads and the input gradient it makes (elements); with sequence
    parallelism the padded buffer of the collective it runs (of a column map, also the tokens it gathers
    again: count them in ``grad_out``)."""
    cast = rows * cols * s.a if s.a != s.p else 0
    padded = s.b * s.c * s.a * s.tp * sequence_sizes(s.t, s.tp)[0] if s.sp else 0  # a collective's flat buffer
    return saved, (rows * cols + bias * rows) * s.p, (grad_out + grad_in) * s.a + cast + padded


def _block_nodes(config: GPTConfig, s: Shapes, device_type: str) -> list[Node]:
    """One block's backward, step by step; the saved bytes add up to :func:`block_saved` and the block's
    weight copies."""
    b, c, bias = s.b, s.c, config.bias
    rows_in, tokens, rows = s.b * s.t_r * s.c, s.b * s.t, (s.h + 2 * s.h_kv) * s.d
    k = 2 if config.mlp == "swiglu" else 1
    copies = s.a if s.autocast else 0  # the weights' autocast copies (the joined KV weight: a copy anyway)
    mask = dropout_mask(s, rows_in, s.a, config.dropout, device_type)
    norm = (norm_saved(s, config), c * (1 + norm_bias(config)) * s.p, 2 * rows_in * s.p)
    mlp_inputs = 2 if k == 2 and s.autocast and not s.sp else 1
    hidden = tokens * s.hidden
    attention = attention_saved(s, config.dropout, device_type) + rotary_saved(config, s, device_type)
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


def _head_nodes(config: GPTConfig, s: Shapes) -> list[Node]:
    """The loss's, the head's and the final LayerNorm's backward (their saved bytes: the last stage's)."""
    btv, loss, rows_in = s.b * s.t * s.vocab, loss_itemsize(s), s.b * s.t_r * s.c
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
    norm = (norm_saved(s, config), s.c * (1 + norm_bias(config)) * s.p, 2 * rows_in * s.p)
    return [ce, head, norm]


def backward_peak(config: GPTConfig, layout: Layout, s: Shapes, stage: int, device_type: str,
              accumulating: bool) -> int:
    """The most the backward of one micro-batch adds to what the forward's end holds, step by step in
    backward order: each step's working buffers and new gradients while it runs (which stay unless
    ``accumulating`` into those of earlier micro-batches), its saved tensors let go after."""
    blocks = max(stage_sizes(config.n_layer, layout, stage).values())  # a backward runs one of its stages
    head, block_steps = (_head_nodes, _block_nodes) if s.mode is None else (bitwise.head_nodes, bitwise.block_nodes)
    nodes: list[Node] = head(config, s) if stage == layout.pp - 1 else []
    block = block_steps(config, s, device_type)
    if layout.activation_checkpointing:  # the block's forward again, the generators' states noted and replayed
        state, stream = generator_states(config, device_type, s.mode is not None)
        recomputed = sum(n[0] for n in block)
        # the recomputation's own transients: a row map's partial sums, the residual stream's sum, the gathered
        # tokens of the column regions (held with the recomputed graph, dropped with it); and the states: fork_rng's
        # note of the live generator, the tp stream's live state noted, inside a dropout's fork the state outside it
        ahead = s.b * s.t * s.c * s.a + s.b * s.t_r * s.c * s.p + (2 * s.b * s.t * s.c * s.a if s.sp else 0)
        if s.mode is not None:  # or what attention's forward holds beyond its saved bytes (scores backward never
            # reads, shifted scores), or the MLP's row map's padded operands and products
            ahead = max(ahead, bitwise.attention_forward_extra(config, s), bitwise.row_forward(config, s))
        # all on top of the recomputed activations as the recomputation ends, the stream's state put back; or
        # as its last fork ends (the states outside it and after it too), before the rest of the block
        ended = recomputed + ahead + state + 2 * stream
        if s.mode is not None:  # the attention's noise, before the MLP half is recomputed; or the output
            # projection's exchange, the attention's output dropout not yet run either; or the MLP's row map's
            # exchange, before the MLP's output dropout
            first_half, mask = recomputed - bitwise.mlp_half(config, s), bitwise.residual_mask(config, s)
            ended = max(ended, first_half + bitwise.dropped_transient(config, s) + state + 2 * stream,
                        first_half - mask + bitwise.projection_exchange(config, s) + state + 2 * stream,
                        recomputed - mask + bitwise.mlp_exchange(config, s) + state + 2 * stream)
        if stream:
            ended = max(ended, recomputed - block_after_last_fork(config, s, device_type) + ahead + state + 3 * stream)
        if s.mode is not None:  # the block's first steps run before a saved tensor is asked for, and the
            # recomputation: under autocast the output gradient rounded to the MLP's dtype, and with sequence
            # parallelism and no output dropout that gathered from this rank's tokens
            ended += (s.b * s.t_r * s.c * s.a if s.a != s.p else 0) + (
                s.b * s.t * s.c * s.a if s.sp and not config.dropout else 0)
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

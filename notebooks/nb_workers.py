"""Functions the notebooks run on several processes with ``tensorpar.spawn``.

``spawn`` starts fresh processes that import the function by module and name,
so a function defined in a notebook cell cannot be sent; the ones here can.
Each function calls ``tensorpar.init()`` (every spawned rank is a tp rank) and
returns plain Python values and small tensors, which travel back to the notebook.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import layers
import tensorpar
from tensorpar.testing import count_collectives, rel_error

# --------------------------------------------------------------------------- 01: column and row parallel


def dense_mlp(d: int, hidden: int) -> nn.Sequential:
    """nn.Linear -> GELU -> nn.Linear, with submodules named "0", "1", "2"."""
    return nn.Sequential(OrderedDict([("0", nn.Linear(d, hidden)), ("1", nn.GELU()), ("2", nn.Linear(hidden, d))]))


def mlp_column_then_row(d: int, hidden: int, tokens: int, seed: int = 0) -> dict:
    """Shard a dense MLP over the tp group two ways and compare both with the dense one.

    1. By hand: slice the weights and join the pieces with ``f`` (``copy_to_tp``)
       and ``g`` (``reduce_from_tp``).
    2. With ``layers.parallelize``: fc1 -> ``ColumnParallelLinear``, fc2 -> ``RowParallelLinear``.

    Returns this rank's shard shapes, the relative errors of the output, the
    input gradient and the weight gradients, the collectives each version issued,
    the slice of the hidden features each layer reports holding, and (last, as it
    overwrites the weights) where each weight element went: :func:`held_indices`.
    """
    mesh = tensorpar.init()
    torch.manual_seed(seed)  # the same dense model and input on every rank
    dense = dense_mlp(d, hidden).double()
    x = torch.randn(tokens, d, dtype=torch.float64)

    # Reference: the dense MLP on one rank.
    x_ref = x.clone().requires_grad_()
    y_ref = dense(x_ref)
    y_ref.square().sum().backward()

    # 1. By hand. This rank's rows of W1 (and of b1) and the matching columns of W2.
    lo = sum(tensorpar.partition_sizes(hidden, mesh.tp)[:mesh.tp_rank])
    hi = lo + tensorpar.partition_sizes(hidden, mesh.tp)[mesh.tp_rank]
    w1 = dense[0].weight.detach()[lo:hi].clone().requires_grad_()      # (hidden_r, d)
    b1 = dense[0].bias.detach()[lo:hi].clone().requires_grad_()        # (hidden_r,)
    w2 = dense[2].weight.detach()[:, lo:hi].clone().requires_grad_()   # (d, hidden_r)
    x_hand = x.clone().requires_grad_()
    with count_collectives() as hand_counts:
        h = F.gelu(tensorpar.copy_to_tp(x_hand) @ w1.T + b1)            # f, then (tokens, hidden_r): no communication
        y_hand = tensorpar.reduce_from_tp(h @ w2.T) + dense[2].bias     # partial sums (tokens, d), then g
        y_hand.square().sum().backward()

    # 2. With the layers: parallelize swaps the nn.Linears in place, keeping the weights.
    sharded = layers.parallelize(copy.deepcopy(dense), {"0": "column", "2": "row"})
    x_tp = x.clone().requires_grad_()
    with count_collectives() as tp_counts:
        y_tp = sharded(x_tp)
        y_tp.square().sum().backward()

    return {
        "rank": mesh.rank,
        "fc1 weight": tuple(sharded[0].weight.shape), "fc1 bias": tuple(sharded[0].bias.shape),
        "fc2 weight": tuple(sharded[2].weight.shape), "fc2 bias": tuple(sharded[2].bias.shape),
        "rows of W1": (lo, hi),
        "repr": [repr(sharded[0]), repr(sharded[2])],
        "errors": {
            "by hand: output": rel_error(y_hand, y_ref),
            "by hand: input grad": rel_error(x_hand.grad, x_ref.grad),
            "by hand: W1 grad": rel_error(w1.grad, dense[0].weight.grad[lo:hi]),
            "by hand: W2 grad": rel_error(w2.grad, dense[2].weight.grad[:, lo:hi]),
            "layers: output": rel_error(y_tp, y_ref),
            "layers: input grad": rel_error(x_tp.grad, x_ref.grad),
            "layers: W1 grad": rel_error(sharded[0].weight.grad, dense[0].weight.grad[lo:hi]),
            "layers: W2 grad": rel_error(sharded[2].weight.grad, dense[2].weight.grad[:, lo:hi]),
        },
        "collectives": {
            name: {phase: c.count("all_reduce", phase) for phase in ("forward", "backward")} | {"total": c.count()}
            for name, c in (("by hand", hand_counts), ("layers", tp_counts))
        },
        "all-reduce elements": tp_counts.numel("all_reduce"),
        "reported": {name: (module.local_offset, module.local_features)
                     for name, module in (("fc1", sharded[0]), ("fc2", sharded[2]))},
        "held": held_indices(sharded),
    }


def held_indices(model: nn.Module) -> dict[str, torch.Tensor]:
    """Load into ``model`` the full state dict whose every tensor holds its own flat element indices
    0, 1, 2, ... and return what this rank then holds, as integers.

    Wherever an element lands, its value says where in the full tensor it came
    from: a picture drawn from these numbers shows what the sharding code did,
    not what a formula says it should do. (float64 holds such integers exactly.)
    """
    full = tensorpar.full_state_dict(model)  # for the keys and full shapes only
    numbered = {k: torch.arange(v.numel(), dtype=torch.float64).view(v.shape).to(v.dtype) for k, v in full.items()}
    tensorpar.load_full_state_dict(model, numbered)
    return {k: v.detach().to(torch.int64) for k, v in model.state_dict().items()}


def attention_heads(n_embd: int, n_head: int, n_kv_head: int) -> dict:
    """Build a :class:`layers.ParallelSelfAttention` on the current tp group and report where its
    heads went: the indices this rank holds of each projection (see :func:`held_indices`), the
    KV heads its query heads read, and its own account of both."""
    attn = layers.ParallelSelfAttention(n_embd, n_head, n_kv_head=n_kv_head, bias=False, dtype=torch.float64)
    return {
        "n_embd": n_embd, "n_head": n_head, "n_kv_head": n_kv_head, "head_dim": attn.head_dim,
        "query heads": (attn.q_lo, attn.local_heads),        # (first global query head, count)
        "kv replicated": attn.kv_replicated,
        # KV heads this rank reads (first global KV head, count): those of its query groups
        "kv heads read": (attn.q_lo // (attn.n_head // attn.n_kv_head), attn.local_kv_heads),
        "held": held_indices(attn),
    }


def column_row_and_heads(d: int, hidden: int, tokens: int, attention: list[tuple[int, int, int]]) -> dict:
    """Notebook 01's run: :func:`mlp_column_then_row`, then :func:`attention_heads` for each
    ``(n_embd, n_head, n_kv_head)`` of ``attention``, in one group."""
    return {"mlp": mlp_column_then_row(d, hidden, tokens),
            "attention": [attention_heads(*case) for case in attention]}


# --------------------------------------------------------------------------- 02: ring all-reduce


def ring_all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, int]:
    """Sum ``x`` over every rank of ``group`` with a ring of point-to-point messages.

    The tensor is cut into N chunks (``torch.tensor_split``: sizes differ by at
    most one element, so N need not divide ``x.numel()``). Reduce-scatter: in
    N - 1 steps each rank passes one chunk to its right-hand neighbour and adds
    the chunk arriving from its left, until rank r holds the full sum of chunk
    (r + 1) mod N. All-gather: in N - 1 more steps the finished chunks travel
    once around the ring. Returns the sum (a new tensor) and the bytes this rank sent.
    """
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    out = x.detach().clone().reshape(-1)
    if n == 1:
        return out.view_as(x), 0
    chunks = list(torch.tensor_split(out, n))              # views into ``out``: writing them writes ``out``
    right = dist.get_global_rank(group, (rank + 1) % n) if group is not None else (rank + 1) % n
    left = dist.get_global_rank(group, (rank - 1) % n) if group is not None else (rank - 1) % n
    sent = 0

    def step(send_idx: int, recv_idx: int) -> torch.Tensor:
        """Send chunk ``send_idx`` to the right while receiving chunk ``recv_idx`` from the left."""
        nonlocal sent
        incoming = torch.empty_like(chunks[recv_idx])
        request = dist.isend(chunks[send_idx].contiguous(), right, group=group)  # isend: every rank sends at once
        dist.recv(incoming, left, group=group)
        request.wait()
        sent += chunks[send_idx].numel() * chunks[send_idx].element_size()
        return incoming

    for s in range(n - 1):                                 # reduce-scatter
        send_idx, recv_idx = (rank - s) % n, (rank - s - 1) % n
        chunks[recv_idx] += step(send_idx, recv_idx)
    for s in range(n - 1):                                 # all-gather: rank holds the sum of chunk (rank + 1) % n
        send_idx, recv_idx = (rank + 1 - s) % n, (rank - s) % n
        chunks[recv_idx].copy_(step(send_idx, recv_idx))
    return out.view_as(x), sent


def ring_vs_all_reduce(numel: int, seed: int = 0, group: dist.ProcessGroup | None = None) -> dict:
    """Run :func:`ring_all_reduce` over ``group`` (default: the world) on a per-rank random tensor
    and check it against ``dist.all_reduce``."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(seed + rank)                         # every rank holds a different tensor
    x = torch.randn(numel)
    ring, sent = ring_all_reduce(x, group)
    reference = x.clone()
    dist.all_reduce(reference, group=group)
    torch.testing.assert_close(ring, reference)            # float32 sums in a different order: default tolerances
    return {
        "rank": rank, "world size": n, "numel": numel,
        "chunk sizes": [c.numel() for c in torch.tensor_split(x, n)],
        "bytes sent": sent, "tensor bytes": x.numel() * x.element_size(),
        "max abs diff": (ring - reference).abs().max().item(),
    }


def ring_on_first_ranks(numel: int, sizes: list[int]) -> dict[int, dict | None]:
    """:func:`ring_vs_all_reduce` on a group of the first ``n`` ranks, for each ``n`` of ``sizes``:
    ``{n: this rank's result, or None when it is not in that group}``. One set of processes
    serves every size (starting processes costs far more than the rings)."""
    tensorpar.init()
    results = {}
    for n in sizes:
        group = dist.new_group(list(range(n)))             # every rank takes part in creating every group
        results[n] = ring_vs_all_reduce(numel, group=group) if dist.get_rank() < n else None
    return results

"""The state side of a plan: which parameters a rank holds, and the bytes of its parameters, gradients and
optimizer state under DDP, ZeRO or FSDP2 on dp.

Shapes come from the rules the layers split by (:mod:`tensorpar.sharding`'s balanced shards,
:func:`~layers.heads.head_layout`, :func:`tensorpar.pipeline.stage_blocks`); how dp holds them follows torch:

* ``"ddp"``: every dp rank holds the whole of its (tp, pp) shard; the gradients are separate tensors
  (``DistributedDataParallel``'s reducer keeps flat buckets as large besides them,
  ``gradient_as_bucket_view=False``: :func:`layers.plan.plan` adds those);
* ``"zero"``: ``ZeroRedundancyOptimizer`` keeps the optimizer state of the parameters its greedy rule gives
  each dp rank (per param group, largest first, to the rank with the fewest elements so far; the groups as
  ``examples/train_gpt.py`` builds them: matrices, then vectors);
* ``"fsdp"``: FSDP2 splits dim 0 of each local tensor like ``torch.chunk`` and keeps every rank's chunk in a
  buffer padded to the first chunk's rows (``⌈d0 / dp⌉``); its gradients are views of the reduce-scatter's
  output, padded alike (one buffer per FSDP2 unit); the optimizer's state is ``zeros_like`` of the unpadded
  chunk. With ``offload_optimizer`` (``CPUOffloadPolicy``) the padded parameters live on the host, the
  gradients are copied there unpadded, and so is the state: nothing of them stays on the device.

AdamW's state is ``exp_avg`` and ``exp_avg_sq`` in the parameter's dtype and shape, and ``step``, a scalar
of ``torch.get_default_dtype()``'s width (float32 unless the default is float64; on the host unless the
optimizer is fused or capturable: counted here with the state). SGD (no momentum) keeps none.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

from tensorpar.pipeline import rank_stages, stage_blocks
from tensorpar.sharding import Shard, partition_sizes

from .config import GPTConfig

#: bytes of an element of each parameter dtype a layout names
DTYPE_BYTES = MappingProxyType({"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8})


@dataclass(frozen=True)
class HeldParameter:
    """One parameter a rank holds: its name in the GPT and its local (tp shard) shape."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class StateBytes:
    """A rank's bytes of parameters, gradients and optimizer state on its device and on the host."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    host_params: int = 0
    host_grads: int = 0
    host_optimizer: int = 0


def attention_shards(config: GPTConfig, tp: int) -> tuple[Shard, Shard]:
    """The placements of ``c_attn`` (rows ``[Q | K | V]``) and ``c_proj`` (columns), as the attention layer
    builds them (see :mod:`layers.attention`)."""
    c, d, kv = config.n_embd, config.n_embd // config.n_head, config.kv_heads
    g = config.n_head // kv
    if kv < tp:  # query heads split alone, every rank holds all of K and V
        return Shard(0, c + 2 * kv * d, d, 2 * kv * d), Shard(1, c, d)
    return Shard(0, c + 2 * kv * d, (g * d, d, d)), Shard(1, c, g * d)


def block_parameters(config: GPTConfig, tp: int, tp_rank: int, index: int) -> list[HeldParameter]:
    """Block ``index``'s parameters on tp rank ``tp_rank``, in the block's order."""
    c, b = config.n_embd, config.bias
    qkv, proj = attention_shards(config, tp)
    rows, cols = qkv.sizes(tp)[tp_rank], proj.sizes(tp)[tp_rank]
    hidden = partition_sizes(config.mlp_hidden, tp, name="mlp hidden features")[tp_rank]
    at = f"transformer.h.{index}."
    found: list[tuple[str, tuple[int, ...]]] = []

    def linear(name: str, shape: tuple[int, int], bias: int) -> None:
        found.append((f"{name}.weight", shape))
        if b:
            found.append((f"{name}.bias", (bias,)))

    def norm(name: str) -> None:
        found.append((f"{name}.weight", (c,)))
        if b and config.norm == "layernorm":  # RMSNorm has no bias
            found.append((f"{name}.bias", (c,)))

    norm("ln_1")
    linear("attn.c_attn", (rows, c), rows)
    linear("attn.c_proj", (c, cols), c)
    norm("ln_2")
    linear("mlp.c_fc", (hidden, c), hidden)
    if config.mlp == "swiglu":
        linear("mlp.c_gate", (hidden, c), hidden)
    linear("mlp.c_proj", (c, hidden), c)
    return [HeldParameter(at + name, shape) for name, shape in found]


def held_parameters(config: GPTConfig, *, tp: int = 1, tp_rank: int = 0, pp: int = 1, pp_rank: int = 0,
                    stages_per_rank: int = 1) -> list[HeldParameter]:
    """The parameters rank (``tp_rank``, ``pp_rank``) holds, in ``model.parameters()``'s order: a
    :class:`~layers.GPT` at ``pp=1`` (the tied head once), else a :class:`~layers.PipelinedGPT`'s stages
    (the embeddings on the first stage, the final LayerNorm and a copy of the head on the last)."""
    c = config.n_embd
    vocab = partition_sizes(config.vocab_size, tp, name="vocab_size")[tp_rank]
    positions = partition_sizes(config.block_size, tp, name="block_size")[tp_rank]
    n_stages = pp * stages_per_rank
    split = stage_blocks(config.n_layer, n_stages)
    stages = rank_stages(pp_rank, pp, stages_per_rank)
    first, last = 0 in stages, n_stages - 1 in stages
    held: list[HeldParameter] = []
    if first:
        held.append(HeldParameter("transformer.wte.weight", (vocab, c)))
        if config.positions == "learned":  # rotary positions: no table
            held.append(HeldParameter("transformer.wpe.weight", (positions, c)))
    for i in (i for s in stages for i in split[s]):
        held += block_parameters(config, tp, tp_rank, i)
    if last:
        held.append(HeldParameter("transformer.ln_f.weight", (c,)))
        if config.bias and config.norm == "layernorm":
            held.append(HeldParameter("transformer.ln_f.bias", (c,)))
        if not first:  # the head on another rank than the embedding: a copy of it
            held.append(HeldParameter("lm_head.weight", (vocab, c)))
    return held


def step_bytes() -> int:
    """Bytes of AdamW's ``step`` scalar (``torch.optim.optimizer._get_scalar_dtype``: float64 when that is
    the default dtype, else float32)."""
    return 8 if torch.get_default_dtype() == torch.float64 else 4


def zero_owners(groups: Sequence[Sequence[int]], dp: int) -> list[list[int]]:
    """For each param group (the parameters' element counts, in order), the dp rank whose
    ``ZeroRedundancyOptimizer`` steps each parameter: torch's ``_partition_parameters``, which takes each
    group's parameters largest first (a stable sort) and gives each to the rank with the fewest elements so
    far (the lowest such rank), counting across groups."""
    sizes = [0] * dp
    owners: list[list[int]] = []
    for group in groups:
        order = sorted(range(len(group)), key=lambda i: group[i], reverse=True)
        owner = [0] * len(group)
        for i in order:
            rank = min(range(dp), key=lambda r: sizes[r])  # the first of the smallest
            owner[i] = rank
            sizes[rank] += group[i]
        owners.append(owner)
    return owners


def fsdp_rows(d0: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """``(rows, padded_rows)`` of dim 0 FSDP2 keeps on ``dp_rank``: its ``torch.chunk`` of ``d0`` rows (empty
    past the chunks there are) and the first chunk's rows, to which it pads every rank's buffer."""
    padded = -(-d0 // dp)
    return max(0, min(padded, d0 - dp_rank * padded)), padded


def optimizer_slots(optimizer: str) -> int:
    """Tensors of the parameter's shape the optimizer keeps per parameter."""
    return {"adamw": 2, "sgd": 0}[optimizer]


def dp_state_bytes(held: Iterable[HeldParameter], itemsize: int, *, dp: int, dp_sharding: str, optimizer: str,
                   offload: bool = False) -> list[StateBytes]:
    """The bytes of ``held`` parameters (each ``itemsize`` bytes an element), their gradients and
    optimizer state on each dp rank of ``dp`` (see the module's docstring for the rules)."""
    held = list(held)
    slots, step = optimizer_slots(optimizer), (step_bytes() if optimizer_slots(optimizer) else 0)
    if dp_sharding == "fsdp":
        found = []
        for dp_rank in range(dp):
            params = opt = unpadded = 0
            for p in held:
                rows, padded = fsdp_rows(p.shape[0], dp, dp_rank)
                row = p.numel // p.shape[0] * itemsize
                params += padded * row
                unpadded += rows * row
                opt += slots * rows * row + step
            found.append(StateBytes(host_params=params, host_grads=unpadded, host_optimizer=opt) if offload
                         else StateBytes(params=params, grads=params, optimizer=opt))  # grads: the padded output
        return found
    params = sum(p.numel for p in held) * itemsize
    if dp_sharding == "zero" and dp > 1 and slots:
        groups = [[p.numel for p in held if len(p.shape) >= 2], [p.numel for p in held if len(p.shape) < 2]]
        owned = [0] * dp  # each dp rank's optimizer bytes
        for group, owners in zip(groups, zero_owners(groups, dp), strict=True):
            for n, rank in zip(group, owners, strict=True):
                owned[rank] += slots * n * itemsize + step
        return [StateBytes(params=params, grads=params, optimizer=o) for o in owned]
    opt_all = sum(slots * p.numel * itemsize + step for p in held) if slots else 0
    return [StateBytes(params=params, grads=params, optimizer=opt_all)] * dp


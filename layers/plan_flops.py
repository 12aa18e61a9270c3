"""What a GPT step asks of the devices: model FLOPs (PaLM's and nanoGPT's count), the FLOPs each rank runs
(recomputation included), the dense peaks of the GPUs we know, and the lower bound on a step they imply::

    mfu = tokens_per_s * model_flops_per_token(...) / (devices * peak FLOP/s)
"""

from __future__ import annotations

from collections.abc import Sequence

from .config import GPTConfig
from .plan_state import HeldParameter

#: dense peak TFLOP/s (no structured sparsity) of the vendors' data sheets, by a part of the device's
#: name: (bf16 and fp16 on the tensor cores, plain fp32 without TF32, torch's default for matmuls).
#: The first name found in the device's name wins, so the PCIe H100 comes before the SXM one.
PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H200", 989.0, 67.0),
    ("H100 PCIe", 756.0, 51.0),
    ("H100", 989.0, 67.0),  # SXM
    ("A100", 312.0, 19.5),
)


def peak_tflops_by_name(name: str, half: bool) -> float | None:
    """The dense peak TFLOP/s of the device named ``name`` (e.g. ``"NVIDIA H100 80GB HBM3"``, ``"H100"``)
    in bf16/fp16 (``half``) or fp32; ``None`` when :data:`PEAKS` does not know it."""
    for part, bf16, fp32 in PEAKS:
        if part.lower() in name.lower():
            return bf16 if half else fp32
    return None


def model_flops_per_token(n_params: int, n_layer: int, n_head: int, head_dim: int, seq_len: int) -> float:
    """FLOPs of one token's forward and backward through a GPT, as PaLM and nanoGPT count them:
    ``6 N + 12 L H Q T``. Each of the ``N`` parameters that multiply (not the position table, a
    lookup; a head tied to the token table counts once) costs 2 FLOPs forward and 4 backward, and
    attention's scores and weighted sum cost ``12 Q T`` per head of ``Q`` features, layer and token
    over a context of ``T``. Recomputation (activation checkpointing) is not counted: it is not the
    model's work.

    Example::

        model_flops_per_token(123_650_000, 12, 12, 64, 1024)   # GPT-2 124M: about 8.6e8
    """
    return float(6 * n_params + 12 * n_layer * n_head * head_dim * seq_len)


def rank_flops_per_token(config: GPTConfig, held: Sequence[HeldParameter], query_heads: int, seq_len: int, *,
                         recompute: bool, tp: int) -> float:
    """FLOPs one rank runs per token of its micro-batches, counted as :func:`model_flops_per_token` counts
    them but over what the rank holds: 6 per held parameter (the position table and a token table that is
    not also the head excluded: lookups), ``12 Q T`` per layer and local query head; with ``recompute``
    (activation checkpointing) each block's forward once more, 2 per block parameter and ``4 Q T`` per
    layer and head, but for the MLP's output matmul at ``tp=1``: torch's non-reentrant checkpoint stops
    recomputing once the last tensor saved for backward is back, the input of that plain ``F.linear``
    (at tp > 1 the fused row-parallel autograd function saves its input after its forward has run, so
    it runs). Replicated parameters (LayerNorms, row-parallel biases, K and V held whole when there
    are fewer KV heads than ranks) count on every rank that holds them: each computes with them."""
    head = any(p.name == "transformer.ln_f.weight" for p in held)  # the last stage: the head's matmul is here
    dense = sum(p.numel for p in held if p.name != "transformer.wpe.weight"
                and (p.name != "transformer.wte.weight" or head))
    blocks = sum(p.numel for p in held if p.name.startswith("transformer.h."))
    layers = len({p.name.split(".")[2] for p in held if p.name.startswith("transformer.h.")})
    attention = layers * query_heads * (config.n_embd // config.n_head) * seq_len
    flops = 6 * dense + 12 * attention
    if recompute:
        skipped = sum(p.numel for p in held if p.name.endswith(".mlp.c_proj.weight")) if tp == 1 else 0
        flops += 2 * (blocks - skipped) + 4 * attention
    return float(flops)


def pipeline_bubble(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The idle fraction of a pipelined step: ``(pp - 1) / (v m + pp - 1)`` for ``m`` micro-batches and ``v``
    stages per rank (GPipe and 1F1B: ``v = 1``; the interleaved schedule's warm-up is ``v`` times shorter)."""
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)

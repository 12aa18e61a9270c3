"""What a device can do and what a GPT asks of it: the dense peak matmul rate of the GPUs we know,
and the model FLOPs of one token, the two halves of model FLOPs utilisation (MFU)::

    mfu = tokens_per_s * model_flops_per_token(...) / (devices * peak_tflops(device, dtype) * 1e12)
"""

from __future__ import annotations

import torch

#: dense peak TFLOP/s (no structured sparsity) of the vendors' data sheets, by a part of the device's
#: name: (bf16 and fp16 on the tensor cores, plain fp32 without TF32, torch's default for matmuls).
#: The first name found in the device's name wins, so the PCIe H100 comes before the SXM one.
PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H200", 989.0, 67.0),
    ("H100 PCIe", 756.0, 51.0),
    ("H100", 989.0, 67.0),  # SXM
    ("A100", 312.0, 19.5),
)


def peak_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The dense peak TFLOP/s of one ``device`` for matmuls in ``dtype`` (under autocast: the autocast
    dtype), or ``None`` when it is not known (a CPU, a GPU not in :data:`PEAKS`, another dtype): an MFU
    is then left out rather than guessed.

    Example::

        peak_tflops(torch.device("cuda", 0), torch.bfloat16)   # 989.0 on an H100 SXM
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for part, half, single in PEAKS:
        if part in name:
            return {torch.bfloat16: half, torch.float16: half, torch.float32: single}.get(dtype)
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

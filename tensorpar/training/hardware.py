"""Model FLOPs per token and the accelerators' dense peak rates, for model FLOPs utilisation (MFU).

MFU is the model's useful FLOPs per second (those of the math, not of recomputation) over
the device's dense peak for the dtype of its matmuls::

    tokens_per_s * model_flops_per_token(...) / (peak_tflops(device, dtype) * 1e12)
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

#: Dense (no sparsity) peak TFLOP/s of the matmul units by device name and dtype, from the
#: vendors' data sheets. A device matches when one of these keys is in its name.
PEAK_TFLOPS: Mapping[str, Mapping[torch.dtype, float]] = MappingProxyType({
    "H200": MappingProxyType({torch.bfloat16: 989.0, torch.float16: 989.0}),
    "H100": MappingProxyType({torch.bfloat16: 989.0, torch.float16: 989.0}),  # SXM
    "A100": MappingProxyType({torch.bfloat16: 312.0, torch.float16: 312.0}),
})


def peak_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The dense peak TFLOP/s of ``device`` for matmuls in ``dtype`` (the autocast dtype under
    autocast), or ``None`` when the device or dtype is not in :data:`PEAK_TFLOPS` (any CPU, or
    float32, whose rate depends on whether TF32 is allowed).

    Example::

        peak_tflops(torch.device("cuda"), torch.bfloat16)   # 989.0 on an H100 SXM
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            return peaks.get(dtype)
    return None


def model_flops_per_token(n_params: int, n_layer: int, n_head: int, head_dim: int, seq_len: int) -> int:
    """FLOPs of one token through a GPT's forward and backward (nanoGPT's and PaLM's count):
    ``6 N`` for the weight matmuls (2 forward, 4 backward per parameter) plus ``12 L H Q T``
    for attention's scores and weighted sums, with ``N`` the parameters doing matmuls (nanoGPT
    leaves out the position embedding, a lookup; a tied head counts once), ``L`` blocks, ``H``
    heads of ``Q`` features and ``T`` tokens of context.

    Example::

        model_flops_per_token(n_params, 12, 12, 64, 1024)   # GPT-2 124M (N = 123.7M): about 0.86 GFLOP
    """
    return 6 * n_params + 12 * n_layer * n_head * head_dim * seq_len

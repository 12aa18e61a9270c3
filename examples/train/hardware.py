"""What a device can do and what a GPT asks of it: the dense peak matmul rate of this run's GPU, and the
model FLOPs of one token (both defined once, in :mod:`layers.plan_flops`), the two halves of model FLOPs
utilisation (MFU)::

    mfu = tokens_per_s * model_flops_per_token(...) / (devices * peak_tflops(device, dtype) * 1e12)
"""

from __future__ import annotations

import torch

from layers.plan_flops import PEAKS, model_flops_per_token, peak_tflops_by_name

__all__ = ["PEAKS", "model_flops_per_token", "peak_tflops"]


def peak_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The dense peak TFLOP/s of one ``device`` for matmuls in ``dtype`` (under autocast: the autocast
    dtype), or ``None`` when it is not known (a CPU, a GPU not in :data:`PEAKS`, another dtype): an MFU
    is then left out rather than guessed.

    Example::

        peak_tflops(torch.device("cuda", 0), torch.bfloat16)   # 989.0 on an H100 SXM
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    return peak_tflops_by_name(torch.cuda.get_device_name(device), half=dtype != torch.float32)

"""The training app of ``examples/train_gpt.py``: token data (bytes of a text, or nanoGPT's ``uint16``
token files) with deterministic per-step batches and a validation split, the LR schedule, the
validation loss, the script's command line, the plan of a run (its memory checked before it starts,
``--dry-run``, ``--suggest``), the device and dtype a run computes in and its speed
(tokens/s, MFU, peak memory), the run's output directory (held by one run at a time), and the run's
log, progress bar, loss curve and optional TensorBoard / Weights & Biases logger. It is an example's
own code, built on the library, not part of it: nothing in ``tensorpar`` or ``layers`` imports it.
"""

from .cli import TrainConfig, build_parser, parse_args, resolve
from .data import VOCAB_SIZE, ByteData, TokenData, default_corpus, open_splits
from .device import (
    DTYPES,
    compute_dtype,
    cpu_fallback_warning,
    device_name,
    peak_memory_bytes,
    peak_memory_per_rank,
    reset_peak_memory,
    warn_if_gpus_unused,
)
from .evaluate import autocast_for, validation_loss
from .output import open_log, open_logger, plot, progress, read_log
from .planning import model_config
from .rundir import hold
from .schedule import cosine_lr
from .throughput import Throughput, hardware_summary

__all__ = ["DTYPES", "VOCAB_SIZE", "ByteData", "Throughput", "TokenData", "TrainConfig", "autocast_for",
           "build_parser", "compute_dtype", "cosine_lr", "cpu_fallback_warning", "default_corpus", "device_name",
           "hardware_summary", "hold", "model_config", "open_log", "open_logger", "open_splits", "parse_args",
           "peak_memory_bytes", "peak_memory_per_rank", "plot", "progress", "read_log", "reset_peak_memory", "resolve",
           "validation_loss", "warn_if_gpus_unused"]

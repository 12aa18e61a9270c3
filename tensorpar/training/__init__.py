"""Helpers for training loops: byte-level data with deterministic per-step batches, the LR
schedule, and the run's log, progress bar and loss curve. Not part of the runtime core:
``import tensorpar`` does not import this package, and nothing in the core imports it; the
example training script and the notebooks do.
"""

from .data import VOCAB_SIZE, ByteData, default_corpus
from .output import open_log, plot, progress
from .schedule import cosine_lr

__all__ = ["VOCAB_SIZE", "ByteData", "cosine_lr", "default_corpus", "open_log", "plot", "progress"]

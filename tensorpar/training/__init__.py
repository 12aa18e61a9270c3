"""Helpers for training loops: token data (bytes of a text, or nanoGPT's ``uint16`` token files)
with deterministic per-step batches and a validation split, the LR schedule, the validation loss,
the training script's command line, model FLOPs and device peaks for MFU (:mod:`.hardware`), and
the run's log, progress bar, loss curve and optional TensorBoard / Weights & Biases logger. Not
part of the runtime core: ``import tensorpar`` does not import this package, and nothing in the
core imports it; the example training script and the notebooks do.
"""

from .cli import TrainConfig, build_parser, parse_args, resolve
from .data import VOCAB_SIZE, ByteData, TokenData, default_corpus, open_splits
from .evaluate import autocast_for, validation_loss
from .output import open_log, open_logger, plot, progress
from .schedule import cosine_lr

__all__ = ["VOCAB_SIZE", "ByteData", "TokenData", "TrainConfig", "autocast_for", "build_parser", "cosine_lr",
           "default_corpus", "open_log", "open_logger", "open_splits", "parse_args", "plot", "progress", "resolve",
           "validation_loss"]

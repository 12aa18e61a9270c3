"""Distributed checkpoints on ``torch.distributed.checkpoint`` (DCP), loadable at any (tp, dp, pp), with or without
FSDP2; the README's "Checkpoints" says what one holds and what it guarantees.

Example::

    tensorpar.checkpoint.save("out", model, optimizer, step=step, extra={"tokens": tokens})
    meta = tensorpar.checkpoint.load("out", model, optimizer)          # at any (tp, dp, pp)
"""

from .files import FORMAT, MANIFEST, NAME, CheckpointError, resolve
from .loading import export_state_dict, load, read_meta
from .saving import PendingSave, async_save, save

__all__ = ["FORMAT", "MANIFEST", "NAME", "CheckpointError", "PendingSave", "async_save", "export_state_dict",
           "load", "read_meta", "resolve", "save"]

"""Unsharded exports of a checkpoint, read from its per-rank files (no process group needed).

:func:`export_state_dict` returns the plain model's state dict; :func:`export_safetensors`
writes it to one safetensors file and :func:`to_dcp` to a standard
``torch.distributed.checkpoint`` directory (torch's ``FileSystemWriter``: what
``dcp.load`` with its default reader and ``dcp_to_torch_save`` read). Each full
tensor is assembled by DCP's own resharding from the chunks that hold it, each
chunk checked against its SHA-256 before it is read (:class:`~.storage.ShardReader`);
an export holds one full tensor at a time, never the whole model.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex

from .manifest import CheckpointError, check_size
from .meta import MODEL
from .publish import remove, scratch
from .safetensors_file import FileWriter
from .storage import ShardReader, dcp_call


def _entries(path: str | Path) -> tuple[ShardReader, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """A reader of the checkpoint ``path`` names and ``{plain key: (full size, dtype)}`` of its model, after
    checking the manifest, the index and every file's size (so no declared size exceeds the files)."""
    reader = ShardReader.open(path)
    for file in reader.files:
        check_size(reader.directory, file, reader.listed[file])
    return reader, {k.removeprefix(MODEL): (e.size, e.dtype) for k, e in sorted(reader.entries.items())
                    if k.startswith(MODEL)}


def _tensors(reader: ShardReader, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(plain key, full tensor)`` of each of ``keys``, one at a time, read through ``dcp.load``."""
    for key in keys:
        size, dtype = reader.entries[MODEL + key].size, reader.entries[MODEL + key].dtype
        full = torch.empty(size, dtype=dtype)
        with dcp_call():
            dcp.load({MODEL + key: full}, storage_reader=reader, no_dist=True)
        yield key, full


def export_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The checkpoint's unsharded model state dict, for the plain (unsharded) model.

    Example::

        plain.load_state_dict(tensorpar.checkpoint.export_state_dict("out"))
    """
    reader, entries = _entries(path)
    return dict(_tensors(reader, list(entries)))


def export_safetensors(path: str | Path, out_file: str | Path) -> Path:
    """Write the checkpoint's unsharded model state dict to the safetensors file ``out_file`` (replaced
    atomically when complete), one tensor at a time; return its path.

    Example::

        tensorpar.checkpoint.export_safetensors("out", "model.safetensors")
        plain.load_state_dict(safetensors.torch.load_file("model.safetensors"))
    """
    out = Path(out_file)
    reader, entries = _entries(path)
    with FileWriter(out, [(k, size, dtype) for k, (size, dtype) in entries.items()], replace=True) as f:
        for key, tensor in _tensors(reader, list(entries)):
            f.write(key, tensor)
    return out


class _OneAtATime(DefaultSavePlanner):
    """Plans from tensors on the meta device (sizes and dtypes only) and hands the writer each full
    tensor when it asks for it, read then from the checkpoint."""

    def __init__(self, reader: ShardReader) -> None:
        super().__init__()
        self.reader = reader

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        return next(_tensors(self.reader, [index.fqn]))[1]


def to_dcp(path: str | Path, out_dir: str | Path) -> Path:
    """Write the checkpoint's unsharded model state dict (the plain model's keys) as a standard
    ``torch.distributed.checkpoint`` directory ``out_dir`` with torch's ``FileSystemWriter``, one tensor
    at a time; return its path. ``out_dir`` must not exist; it appears complete or not at all.

    The result is torch's format (a pickled ``.metadata``, each tensor a ``torch.save`` archive):
    torch's tools read it, tensorpar's :func:`load` does not (see the package's docstring for why).

    Example::

        tensorpar.checkpoint.to_dcp("out", "out-dcp")
        dcp.load(plain.state_dict(), checkpoint_id="out-dcp")          # torch's default reader
        dcp_to_torch_save("out-dcp", "model.pt")                       # torch's format_utils
    """
    out = Path(out_dir)
    if os.path.lexists(out):
        raise CheckpointError(f"{out} exists: to_dcp writes a new directory (remove it or name another)")
    reader, entries = _entries(path)
    planned = {k: torch.empty(size, dtype=dtype, device="meta") for k, (size, dtype) in entries.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = scratch(out.parent, out.name)
    try:
        writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, thread_count=1)
        with dcp_call():
            dcp.save(planned, storage_writer=writer, planner=_OneAtATime(reader), no_dist=True)
        os.rename(tmp, out)
    finally:
        if os.path.lexists(tmp):
            remove(tmp)
    return out

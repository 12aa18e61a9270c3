"""Unsharded exports of a checkpoint, read from its per-rank files (no process group needed).

:func:`export_state_dict` returns the plain model's state dict; :func:`export_safetensors`
writes it to one safetensors file, tensor by tensor: it holds one full tensor at
a time, never the whole model.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from .checked import read_checked
from .index import Entry, chunk_key
from .manifest import CheckpointError, check_file
from .meta import MODEL
from .publish import remove, scratch
from .reader import Reader
from .tensors import FileWriter


def _tensors(path: str | Path) -> Iterator[tuple[str, Entry, torch.Tensor]]:
    """Each model tensor of the checkpoint, assembled from its chunks: ``(key, entry, tensor)`` in key
    order, after every file has been checked against its hash."""
    directory, meta, entries, files = read_checked(path)
    for file in files:
        check_file(directory, file, meta["files"][file])
    with contextlib.ExitStack() as stack:
        opened: dict[int, Reader] = {}
        for name in sorted(k for k in entries if k.startswith(MODEL)):
            entry = entries[name]
            full = torch.empty(entry.size, dtype=entry.dtype)
            for chunk in entry.chunks:
                if chunk.rank not in opened:
                    opened[chunk.rank] = stack.enter_context(Reader(directory / files[chunk.rank]))
                f, key = opened[chunk.rank], chunk_key(name, entry, chunk)
                if f.info(key) != (chunk.sizes, entry.dtype):
                    raise CheckpointError(f"{f.path}: {key} is not the chunk meta.json describes")
                box = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True))
                f.read(key, out=full[box])
            yield name.removeprefix(MODEL), entry, full


def export_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The checkpoint's unsharded model state dict, for the plain (unsharded) model.

    Example::

        plain.load_state_dict(tensorpar.checkpoint.export_state_dict("out"))
    """
    return {key: tensor for key, _, tensor in _tensors(path)}


def export_safetensors(path: str | Path, out_file: str | Path) -> Path:
    """Write the checkpoint's unsharded model state dict to the safetensors file ``out_file`` (replaced
    atomically when complete), one tensor at a time; return its path.

    Example::

        tensorpar.checkpoint.export_safetensors("out", "model.safetensors")
        plain.load_state_dict(safetensors.torch.load_file("model.safetensors"))
    """
    out = Path(out_file)
    _, _, entries, _ = read_checked(path)
    planned = [(k.removeprefix(MODEL), e.size, e.dtype) for k, e in sorted(entries.items()) if k.startswith(MODEL)]
    tmp = scratch(out.parent, out.name)
    try:
        with FileWriter(tmp, planned) as f:
            for key, _, tensor in _tensors(path):
                f.write(key, tensor)
        os.replace(tmp, out)
    finally:
        if os.path.lexists(tmp):
            remove(tmp)
    return out

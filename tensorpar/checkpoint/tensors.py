"""Writing safetensors files without numpy or pickle, one tensor at a time while hashing.

A safetensors file is an 8-byte little-endian header length, a JSON header
(``{key: {"dtype", "shape", "data_offsets"}}``, padded with spaces to 8 bytes)
and then the raw little-endian bytes of each tensor. :class:`FileWriter` writes
that layout from a list of planned ``(key, shape, dtype)`` entries, so a file
is streamed tensor by tensor, each through a bounded buffer of its own bytes
(:mod:`.staging`): the writer never holds more than one block of the tensor it
is writing. :mod:`.reader` reads such files.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from .manifest import CheckpointError
from .staging import blocks

#: the dtypes a checkpoint may hold, with their safetensors names
DTYPES: tuple[tuple[torch.dtype, str], ...] = (
    (torch.float64, "F64"), (torch.float32, "F32"), (torch.float16, "F16"), (torch.bfloat16, "BF16"),
    (torch.int64, "I64"), (torch.int32, "I32"), (torch.int16, "I16"), (torch.int8, "I8"),
    (torch.uint64, "U64"), (torch.uint32, "U32"), (torch.uint16, "U16"), (torch.uint8, "U8"), (torch.bool, "BOOL"))
NAMES: Mapping[torch.dtype, str] = MappingProxyType(dict(DTYPES))
BY_NAME: Mapping[str, torch.dtype] = MappingProxyType({name: dtype for dtype, name in DTYPES})


def dtype_name(dtype: torch.dtype, key: str) -> str:
    """The safetensors name of ``dtype``, or a CheckpointError naming the tensor ``key``."""
    if dtype not in NAMES:
        raise CheckpointError(f"{key}: tensors of dtype {dtype} cannot be stored in a checkpoint")
    return NAMES[dtype]


def header(entries: Sequence[tuple[str, Sequence[int], torch.dtype]]) -> bytes:
    """The length-prefixed safetensors header for tensors ``(key, shape, dtype)``, laid out in that order."""
    if sys.byteorder != "little":  # pragma: no cover
        raise CheckpointError("checkpoints are written on little-endian machines only")
    layout: dict[str, Any] = {}
    offset = 0
    for key, shape, dtype in entries:
        if key in layout:
            raise CheckpointError(f"{key} appears twice in one file")
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        layout[key] = {"dtype": dtype_name(dtype, key), "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(layout, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class FileWriter:
    """Streams one safetensors file: the header of every planned tensor first, then each tensor's bytes
    in the planned order, hashing as it goes: :attr:`digests` holds each tensor's SHA-256, and
    :meth:`close` flushes the file to disk and returns ``{"sha256": ..., "bytes": ...}`` of the whole.

    Example::

        with FileWriter(path, [("w", (2, 3), torch.float32)]) as f:
            f.write("w", torch.ones(2, 3))
        entry = f.entry
    """

    def __init__(self, path: Path, entries: Sequence[tuple[str, Sequence[int], torch.dtype]]) -> None:
        self.path, self._planned = path, [(k, tuple(s), d) for k, s, d in entries]
        self._hash, self._next = hashlib.sha256(), 0
        self.entry: dict[str, Any] = {}
        self.digests: dict[str, str] = {}
        self._file = open(path, "xb")  # noqa: SIM115 - closed by close(); "xb": never over an existing file
        self._put(header(self._planned))

    def _put(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._hash.update(data)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Write the next planned tensor (its key, shape and dtype must be the planned ones)."""
        planned = self._planned[self._next] if self._next < len(self._planned) else None
        got = (key, tuple(tensor.shape), tensor.dtype)
        if planned != got:
            raise CheckpointError(f"{self.path}: wrote {got} where the plan has {planned}")
        digest = hashlib.sha256()
        for block in blocks(tensor):  # any strides and device: bytes staged in memory of our own
            self._put(block)
            digest.update(block)
        self.digests[key] = digest.hexdigest()
        self._next += 1

    def __enter__(self) -> FileWriter:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is None:
            self.close()
        else:
            self._file.close()

    def close(self) -> dict[str, Any]:
        if self._next != len(self._planned):
            raise CheckpointError(f"{self.path}: {len(self._planned) - self._next} planned tensors were not written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.entry = {"sha256": self._hash.hexdigest(), "bytes": os.path.getsize(self.path)}
        return self.entry


def write_file(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Write ``tensors`` (each in its own dtype, sorted by key) to the safetensors file ``path``."""
    keys = sorted(tensors)
    with FileWriter(path, [(k, tensors[k].shape, tensors[k].dtype) for k in keys]) as f:
        for k in keys:
            f.write(k, tensors[k])
    return f.entry

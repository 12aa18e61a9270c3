"""Tensors in safetensors files: written without numpy or pickle, one tensor at a time while hashing,
read lazily, with every failure a :class:`CheckpointError` naming the file and the tensor.

A safetensors file is an 8-byte little-endian header length, a JSON header
(``{key: {"dtype", "shape", "data_offsets"}}``, padded with spaces to 8 bytes)
and then the raw little-endian bytes of each tensor. :class:`FileWriter` writes
that layout from a list of planned ``(key, shape, dtype)`` entries, so a file
is streamed tensor by tensor: the writer never holds more than the tensor it is
writing. Reading goes through ``safetensors.safe_open``, which reads just the
slices asked for.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import struct
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from .manifest import CheckpointError

#: the dtypes a checkpoint may hold, with their safetensors names
DTYPES: tuple[tuple[torch.dtype, str], ...] = (
    (torch.float64, "F64"), (torch.float32, "F32"), (torch.float16, "F16"), (torch.bfloat16, "BF16"),
    (torch.int64, "I64"), (torch.int32, "I32"), (torch.int16, "I16"), (torch.int8, "I8"),
    (torch.uint64, "U64"), (torch.uint32, "U32"), (torch.uint16, "U16"), (torch.uint8, "U8"), (torch.bool, "BOOL"))
NAMES: Mapping[torch.dtype, str] = MappingProxyType(dict(DTYPES))
BY_NAME: Mapping[str, torch.dtype] = MappingProxyType({name: dtype for dtype, name in DTYPES})


def safetensors_module() -> Any:
    """The ``safetensors`` package (reading checkpoints needs it), or an ImportError naming the extra."""
    try:
        import safetensors
    except ImportError as e:  # pragma: no cover - the train extra installs it
        raise ImportError("reading checkpoints needs safetensors: pip install 'tensorpar[train]'") from e
    return safetensors


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


def memory(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (valid while ``t`` lives)."""
    size = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * size).from_address(t.data_ptr())).cast("B") if size else memoryview(b"")


class FileWriter:
    """Streams one safetensors file: the header of every planned tensor first, then each tensor's bytes
    in the planned order, hashing as it goes; :meth:`close` flushes it to disk and returns
    ``{"sha256": ..., "bytes": ...}``.

    Example::

        with FileWriter(path, [("w", (2, 3), torch.float32)]) as f:
            f.write("w", torch.ones(2, 3))
        entry = f.entry
    """

    def __init__(self, path: Path, entries: Sequence[tuple[str, Sequence[int], torch.dtype]]) -> None:
        self.path, self._planned = path, [(k, tuple(s), d) for k, s, d in entries]
        self._hash, self._next, self.entry = hashlib.sha256(), 0, {}
        self._file = open(path, "xb")  # never over an existing file
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
        self._put(memory(tensor.detach().to("cpu").contiguous()))
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


@contextlib.contextmanager
def failures(path: Path, key: str | None = None) -> Iterator[None]:
    """Turn any error of reading ``path`` (tensor ``key`` of it) into a CheckpointError naming both."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:  # safetensors' own error, an OSError, a malformed header or slice
        where = f"{path}: {key}" if key is not None else f"{path}"
        raise CheckpointError(f"{where} cannot be read ({type(e).__name__}: {e})") from None


class Reader:
    """An open safetensors file: its keys, each tensor's shape and dtype, and lazy (sliced) reads.

    Example::

        with Reader(path / "shard-00000-of-00002.safetensors") as f:
            shape, dtype = f.info("model.wte.weight")
            rows = f.read("model.wte.weight", (slice(0, 10),))
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Reader:
        safetensors = safetensors_module()  # an ImportError names the extra
        with failures(self.path):
            self._handle = self._stack.enter_context(safetensors.safe_open(str(self.path), framework="pt"))
            self._keys = list(self._handle.keys())
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def keys(self) -> list[str]:
        return list(self._keys)

    def info(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        """The shape and the dtype of ``key`` (from the header: no data is read)."""
        if key not in self._keys:
            raise CheckpointError(f"{self.path}: {key} is missing")
        with failures(self.path, key):
            view = self._handle.get_slice(key)
            shape, name = tuple(view.get_shape()), view.get_dtype()
        if name not in BY_NAME:
            raise CheckpointError(f"{self.path}: {key} has dtype {name}, which checkpoints do not use")
        return shape, BY_NAME[name]

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor ``key``, or just ``key[index]`` (only those bytes are read)."""
        with failures(self.path, key):
            return self._handle.get_tensor(key) if index is None else self._handle.get_slice(key)[index]

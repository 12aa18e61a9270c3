"""Reading safetensors files in pieces: the JSON header parsed and checked here, then just the rows a
read needs, read from the file into memory that is ours (no numpy, no pickle, no memory map).

A read of a box of a stored tensor reads the contiguous run of its rows in dim 0
that the box spans; when the box also spans every other dim whole and the target
is contiguous, the bytes go straight into the target (through one bounded
buffer of Python's own, :mod:`.staging`). So reading a rank's part of a
checkpoint costs its buffers plus, at most, one stored chunk's rows, and no file
stays mapped into the process. Every failure is a :class:`CheckpointError`
naming the file and the tensor.

Example::

    with Reader(path / "shard-00000-of-00002.safetensors") as f:
        shape, dtype = f.info("model.transformer.wte.weight")
        rows = f.read("model.transformer.wte.weight", (slice(0, 10), slice(0, 4)))
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import torch

from .manifest import CheckpointError
from .staging import fill
from .tensors import BY_NAME

MAX_HEADER = 100 << 20  # bytes: a larger header is no file this library wrote (safetensors' own limit too)


class Reader:
    """An open safetensors file: its keys, each tensor's shape and dtype, and reads of boxes of them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: io.BufferedIOBase | None = None
        self._tensors: dict[str, tuple[tuple[int, ...], torch.dtype, int]] = {}

    def _fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {what}")

    def __enter__(self) -> Reader:
        try:
            self._file = open(self.path, "rb")
            size = os.fstat(self._file.fileno()).st_size
            length = struct.unpack("<Q", self._file.read(8).ljust(8, b"\0"))[0]
            if size < 8 or length > min(MAX_HEADER, size - 8):
                raise self._fail(f"cannot be read (a header of {length} bytes in a file of {size})")
            header = json.loads(self._file.read(length).decode())
        except CheckpointError:
            self.__exit__()
            raise
        except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError and JSON errors are ValueErrors
            self.__exit__()
            raise self._fail(f"cannot be read ({type(e).__name__}: {e})") from None
        self._parse(header, size - 8 - length, 8 + length)
        return self

    def _parse(self, header: Any, data_bytes: int, start: int) -> None:
        """Check the header: each tensor's dtype, shape and byte range, the ranges tiling the data."""
        if not isinstance(header, dict):
            raise self._fail("cannot be read (its header is no JSON object)")
        spans = []
        for key, e in header.items():
            if key == "__metadata__":
                continue
            ok = (isinstance(e, dict) and e.get("dtype") in BY_NAME and isinstance(e.get("shape"), list)
                  and all(type(n) is int and n >= 0 for n in e["shape"]) and isinstance(e.get("data_offsets"), list)
                  and len(e["data_offsets"]) == 2 and all(type(n) is int for n in e["data_offsets"]))
            if not ok:
                raise self._fail(f"{key} cannot be read (its header entry is {e!r:.200})")
            dtype, (begin, end) = BY_NAME[e["dtype"]], e["data_offsets"]
            if end - begin != math.prod(e["shape"]) * torch.empty((), dtype=dtype).element_size() or begin < 0:
                raise self._fail(f"{key} cannot be read (bytes {begin}-{end} for {e['dtype']} of shape {e['shape']})")
            self._tensors[key] = (tuple(e["shape"]), dtype, start + begin)
            spans.append((begin, end))
        covered = 0
        for begin, end in sorted(spans):
            if begin != covered:
                raise self._fail(f"cannot be read (its tensors' bytes leave a gap or overlap at byte {begin})")
            covered = end
        if covered != data_bytes:
            raise self._fail(f"cannot be read (its tensors hold {covered} bytes of its {data_bytes})")

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def keys(self) -> list[str]:
        return list(self._tensors)

    def info(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        """The shape and the dtype of ``key`` (from the header: no data is read)."""
        if key not in self._tensors:
            raise self._fail(f"{key} is missing")
        shape, dtype, _ = self._tensors[key]
        return shape, dtype

    def sha256(self, key: str) -> str:
        """The SHA-256 of the bytes of ``key``, read in blocks of 1 MiB."""
        shape, dtype, offset = self._tensors[key]
        left = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        digest = hashlib.sha256()
        assert self._file is not None
        try:
            self._file.seek(offset)
            while left:
                block = self._file.read(min(left, 1 << 20))
                if not block:
                    raise self._fail(f"{key} cannot be read (the file ends {left} bytes early)")
                digest.update(block)
                left -= len(block)
        except OSError as e:
            raise self._fail(f"{key} cannot be read ({e})") from None
        return digest.hexdigest()

    def _rows(self, key: str, first: int, count: int, out: torch.Tensor) -> None:
        """Read rows ``[first, first + count)`` of ``key`` (all of a 0-dim tensor) into contiguous ``out``."""
        shape, _dtype, offset = self._tensors[key]
        row = math.prod(shape[1:]) * out.element_size()
        assert self._file is not None and out.is_contiguous() and out.numel() * out.element_size() == count * row
        if not count * row:
            return
        try:
            self._file.seek(offset + first * row)
            got = fill(self._file, out)
        except OSError as e:
            raise self._fail(f"{key} cannot be read ({e})") from None
        if got != count * row:
            raise self._fail(f"{key} cannot be read (the file ends {count * row - got} bytes early)")

    def read(self, key: str, index: tuple[slice, ...] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor ``key``, or its box ``key[index]`` (unit-step slices, one per dim); into ``out`` when given
        (of the box's shape and the tensor's dtype), which is returned."""
        shape, dtype = self.info(key)
        given = index or ()  # the dims after the index's are whole
        box = [*(range(*s.indices(n)) for s, n in zip(given, shape, strict=False)),
               *(range(n) for n in shape[len(given):])]
        if len(given) > len(shape) or any(r.step != 1 for r in box):
            raise self._fail(f"{key}: {index} is no box of shape {shape}")
        sizes = tuple(len(r) for r in box)
        if out is not None and (tuple(out.shape) != sizes or out.dtype != dtype):
            raise self._fail(f"{key}: cannot read {sizes} of {dtype} into {tuple(out.shape)} of {out.dtype}")
        whole_rows = all(len(r) == n for r, n in zip(box[1:], shape[1:], strict=True))
        first, count = (box[0].start, len(box[0])) if shape else (0, 1)
        if out is not None and whole_rows and out.is_contiguous():
            self._rows(key, first, count, out)  # straight into the target
            return out
        rows = torch.empty((count, *shape[1:]) if shape else (), dtype=dtype)
        self._rows(key, first, count, rows)
        inner = (slice(None), *(slice(r.start, r.stop) for r in box[1:]))  # the box within its rows
        value = rows[inner] if shape else rows
        return value if out is None else out.copy_(value)

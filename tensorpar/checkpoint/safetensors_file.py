"""Safetensors files, written and read by torch alone (no numpy, no pickle, no memory map), a tensor
at a time through a bounded buffer, hashed as they are written.

A safetensors file is an 8-byte little-endian header length, a JSON header
(``{key: {"dtype", "shape", "data_offsets"}}`` and an optional ``"__metadata__"``
object of strings, padded with spaces to 8 bytes), then the raw little-endian
bytes of each tensor, end to end.

* :class:`FileWriter` writes that layout from a list of planned
  ``(key, shape, dtype)`` entries, streaming each tensor's bytes and hashing them
  (a tensor's SHA-256, and the whole file's); :func:`write_file` writes a dict.
* :class:`Reader` parses and checks the header (dtypes, shapes, byte ranges
  tiling the data), then reads a box of a stored tensor as the contiguous run of
  its rows in dim 0 that the box spans: straight into the target when the box
  spans every other dim whole and the target is contiguous. Every failure is a
  :class:`CheckpointError` naming the file and the tensor.
* Bytes travel through a ``bytearray`` (:func:`blocks`, :func:`fill`): files take
  and give bytes-like objects, and a tensor is none (torch's CPU build offers no
  buffer of its own without numpy). A view over ``tensor.data_ptr()`` would keep
  nothing alive: when the tensor is a temporary (``.cpu()`` of a CUDA tensor,
  ``.contiguous()`` of a strided view) its memory is freed under the view, and
  the file would receive whatever lies there next. :func:`blocks` copies a tensor
  of any strides, dtype or device into the buffer a block of at most
  :data:`BLOCK` bytes at a time, in row-major order; :func:`fill` reads a file
  into it and copies each block into a contiguous tensor. Neither ever makes a
  copy of the whole tensor.

Example::

    write_file(path, {"w": weight.t()}, metadata={"format": "pt"})   # any strides and device
    with Reader(path) as f:
        shape, dtype = f.info("w")
        rows = f.read("w", (slice(0, 10), slice(0, 4)))
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import struct
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from .manifest import CheckpointError, sha256_bytes
from .publish import remove, scratch

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


BLOCK = 4 << 20  #: bytes staged at a time


def runs(t: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """Views of ``t`` that, in order, cover its elements in row-major order, each of at most ``limit``
    (>= 1) elements; ``t`` itself when it is that small."""
    if t.numel() <= limit:
        yield t
        return
    row = t[0].numel()  # t has a dim here: a 0-dim tensor holds 1 element
    step = limit // row
    for i in range(0, t.shape[0], max(step, 1)):
        if step:
            yield t[i:i + step]  # (<= step, *t.shape[1:])
        else:  # one row is more than a block: split it too
            yield from runs(t[i], limit)


def _buffer(nbytes: int, element: int, block: int) -> tuple[bytearray, torch.Tensor]:
    """A ``bytearray`` of whole elements, at most ``block`` bytes (at least one element) and at most
    ``nbytes``, and a uint8 tensor over it (which holds a reference to it)."""
    size = min(nbytes, max(block // element, 1) * element)
    data = bytearray(size)
    return data, torch.frombuffer(data, dtype=torch.uint8)


def blocks(tensor: torch.Tensor, *, block: int = BLOCK) -> Iterator[memoryview]:
    """The bytes of ``tensor`` (any strides, device and dtype) in row-major order, as consecutive views
    of one Python-owned buffer of at most ``block`` bytes; each view holds its bytes until the next is
    asked for."""
    t = tensor.detach()
    element = t.element_size()
    if not t.numel() * element:
        return
    data, staged = _buffer(t.numel() * element, element, block)
    for run in runs(t, len(data) // element):
        n = run.numel() * element
        staged[:n].view(t.dtype).view(run.shape).copy_(run)  # from any strides or device
        yield memoryview(data)[:n]


def fill(file: io.BufferedIOBase, out: torch.Tensor, *, block: int = BLOCK) -> int:
    """Read ``out``'s bytes (a contiguous tensor) from ``file`` at its position; return how many were
    read (fewer only where the file ends)."""
    assert out.is_contiguous()
    nbytes = out.numel() * out.element_size()
    if not nbytes:
        return 0
    # (nbytes,): out's own memory (a contiguous tensor may have any stride along a dim of size 1)
    target = out.as_strided((out.numel(),), (1,)).view(torch.uint8)
    data, staged = _buffer(nbytes, 1, block)
    view, done = memoryview(data), 0
    while done < nbytes:
        want = min(len(data), nbytes - done)
        got = file.readinto(view[:want]) or 0
        if not got:  # the file ends here
            break
        target[done:done + got].copy_(staged[:got])
        done += got
    return done


def header(entries: Sequence[tuple[str, Sequence[int], torch.dtype]],
           metadata: Mapping[str, str] | None = None) -> bytes:
    """The length-prefixed safetensors header for tensors ``(key, shape, dtype)``, laid out in that order,
    with ``metadata`` (strings) as its ``__metadata__`` when given."""
    if sys.byteorder != "little":  # pragma: no cover
        raise CheckpointError("safetensors files are written on little-endian machines only")
    layout: dict[str, Any] = {} if metadata is None else {"__metadata__": dict(metadata)}
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
    A new ``path`` is written in place (never over an existing file); with ``replace``, a temporary
    file beside it is renamed over ``path`` when complete (and removed on an error), so ``path`` is
    whole or as it was.

    Example::

        with FileWriter(path, [("w", (2, 3), torch.float32)]) as f:
            f.write("w", torch.ones(2, 3))
        entry = f.entry
    """

    def __init__(self, path: Path, entries: Sequence[tuple[str, Sequence[int], torch.dtype]], *,
                 metadata: Mapping[str, str] | None = None, replace: bool = False) -> None:
        self.path, self._planned = Path(path), [(k, tuple(s), d) for k, s, d in entries]
        self._hash, self._next = hashlib.sha256(), 0
        self.entry: dict[str, Any] = {}
        self.digests: dict[str, str] = {}
        self._written = scratch(self.path.parent, self.path.name) if replace else self.path
        self._file = open(self._written, "xb")  # noqa: SIM115 - closed by close(); "xb": never over an existing file
        try:
            self._put(header(self._planned, metadata))
        except BaseException:
            self._abandon()
            raise

    def _abandon(self) -> None:
        self._file.close()
        if self._written != self.path:
            remove(self._written)

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
            self._abandon()

    def close(self) -> dict[str, Any]:
        if self._next != len(self._planned):
            self._abandon()
            raise CheckpointError(f"{self.path}: {len(self._planned) - self._next} planned tensors were not written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.entry = {"sha256": self._hash.hexdigest(), "bytes": os.path.getsize(self._written)}
        if self._written != self.path:
            os.replace(self._written, self.path)
        return self.entry


def write_file(path: Path, tensors: Mapping[str, torch.Tensor], *, metadata: Mapping[str, str] | None = None,
               replace: bool = False) -> dict[str, Any]:
    """Write ``tensors`` (each in its own dtype, in key order) to the safetensors file ``path`` (see
    :class:`FileWriter` for ``metadata`` and ``replace``); return its size and SHA-256."""
    keys = sorted(tensors)
    with FileWriter(path, [(k, tensors[k].shape, tensors[k].dtype) for k in keys], metadata=metadata,
                    replace=replace) as f:
        for k in keys:
            f.write(k, tensors[k])
    return f.entry


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
        assert self._file is not None
        try:
            self._file.seek(offset)
            digest, done = sha256_bytes(self._file, left)
        except OSError as e:
            raise self._fail(f"{key} cannot be read ({e})") from None
        if done != left:
            raise self._fail(f"{key} cannot be read (the file ends {left - done} bytes early)")
        return digest

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

"""Tensors in safetensors form: written and exchanged without numpy or pickle, read lazily, with
every failure a :class:`CheckpointError` naming the file and the tensor.

Files are written here (a JSON header, then the raw little-endian bytes of each
tensor: the layout safetensors reads), keeping each tensor's own dtype; reading
goes through ``safetensors.safe_open``, which reads just the slices asked for.
:func:`gather` moves dicts of tensors between ranks as such bytes over tensor
collectives, so no rank ever unpickles what another sent.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import struct
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..comm.collectives import all_gather_along
from .manifest import CheckpointError

#: the dtypes a checkpoint may hold, with their safetensors names
DTYPES: tuple[tuple[torch.dtype, str], ...] = (
    (torch.float64, "F64"), (torch.float32, "F32"), (torch.float16, "F16"), (torch.bfloat16, "BF16"),
    (torch.int64, "I64"), (torch.int32, "I32"), (torch.int16, "I16"), (torch.int8, "I8"),
    (torch.uint64, "U64"), (torch.uint32, "U32"), (torch.uint16, "U16"), (torch.uint8, "U8"), (torch.bool, "BOOL"))


def _safetensors() -> Any:
    try:
        import safetensors
        import safetensors.torch
    except ImportError as e:  # pragma: no cover - the train extra installs it
        raise ImportError("checkpoints need safetensors: pip install 'tensorpar[train]'") from e
    return safetensors


def _layout(tensors: Mapping[str, torch.Tensor]) -> tuple[bytes, list[torch.Tensor]]:
    """The safetensors header (its length, then JSON padded to 8 bytes) and the contiguous CPU tensors
    whose bytes follow it, in the header's order."""
    if sys.byteorder != "little":  # pragma: no cover
        raise CheckpointError("checkpoints are written on little-endian machines only")
    names = dict(DTYPES)
    header: dict[str, Any] = {}
    blobs, offset = [], 0
    for key in sorted(tensors):
        t = tensors[key].detach().to("cpu").contiguous()
        if t.dtype not in names:
            raise CheckpointError(f"{key}: tensors of dtype {t.dtype} cannot be stored in a checkpoint")
        size = t.numel() * t.element_size()
        header[key] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        blobs.append(t)
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, blobs


def _memory(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (valid while ``t`` lives)."""
    size = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * size).from_address(t.data_ptr())).cast("B") if size else memoryview(b"")


def _to_bytes(t: torch.Tensor) -> bytes:
    """A copy of the bytes of tensor ``t`` (on any device)."""
    host = t.cpu().contiguous()
    return bytes(_memory(host))


def write_file(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write ``tensors`` (each in its own dtype) to the safetensors file ``path``."""
    header, blobs = _layout(tensors)
    with open(path, "wb") as f:
        f.write(header)
        for t in blobs:
            f.write(_memory(t))


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
    """An open safetensors file: its keys, each tensor's full shape and dtype, and lazy (sliced) reads.

    Example::

        with Reader(path / "model.safetensors") as f:
            shape, dtype = f.info("wte.weight")
            rows = f.read("wte.weight", (slice(0, 10),))
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Reader:
        with failures(self.path):
            self._handle = self._stack.enter_context(_safetensors().safe_open(str(self.path), framework="pt"))
            self._keys = list(self._handle.keys())
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def keys(self) -> list[str]:
        return list(self._keys)

    def info(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        """The full shape and the dtype of ``key`` (from the header: no data is read)."""
        if key not in self._keys:
            raise CheckpointError(f"{self.path}: {key} is missing")
        with failures(self.path, key):
            view = self._handle.get_slice(key)
            shape, name = tuple(view.get_shape()), view.get_dtype()
        dtype = {n: d for d, n in DTYPES}.get(name)
        if dtype is None:
            raise CheckpointError(f"{self.path}: {key} has dtype {name}, which checkpoints do not use")
        return shape, dtype

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor ``key``, or just ``key[index]`` (only those bytes are read)."""
        with failures(self.path, key):
            return self._handle.get_tensor(key) if index is None else self._handle.get_slice(key)[index]


def gather(tensors: Mapping[str, torch.Tensor], group: ProcessGroup | None,
           device: torch.device) -> list[dict[str, torch.Tensor]] | None:
    """Every rank's ``tensors`` (any keys, shapes and dtypes) in group-rank order on the group's first
    rank, None on the others. A collective: every rank of ``group`` calls it.

    Each rank's dict travels as safetensors bytes in a uint8 tensor (the lengths all-gathered, then
    the padded payloads gathered), so nothing is pickled and no object collective runs.
    """
    header, blobs = _layout(tensors)
    payload = torch.cat([torch.frombuffer(bytearray(header), dtype=torch.uint8),
                         *(t.reshape(-1).view(torch.uint8) for t in blobs)])
    n = dist.get_world_size(group)
    lengths = all_gather_along(torch.tensor([payload.numel()], device=device), 0, [1] * n,
                               group or dist.group.WORLD).tolist()
    send = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    send[:payload.numel()] = payload.to(device)
    first = dist.get_rank(group) == 0
    parts = [torch.empty_like(send) for _ in range(n)] if first else None
    dist.gather(send, parts, dst=0 if group is None else dist.get_global_rank(group, 0), group=group)
    if parts is None:
        return None
    load = _safetensors().torch.load
    return [{k: v.clone() for k, v in load(_to_bytes(part[:size])).items()} for part, size in zip(parts, lengths)]

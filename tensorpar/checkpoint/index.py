"""The chunk index of a checkpoint: where every part of every tensor lies, as JSON in ``meta.json``,
and as the ``Metadata`` that ``torch.distributed.checkpoint`` plans reads from.

``meta.json["tensors"]`` maps each tensor's name to::

    {"dtype": "F32", "size": [full shape], "chunks": [[rank, [offsets], [sizes], sha256], ...]}

Each chunk is a box of the full tensor, stored in the file of the rank that wrote
it under the tensor's name (or, where that file holds several chunks of the
tensor, the pieces of a fused projection's shard, under ``name@offsets``: see
:func:`file_key`), with the SHA-256 of its bytes: a load checks just the chunks it reads. The chunks of a
tensor lie inside it, do not overlap, and cover it exactly (their volumes add up
to the tensor's): this is checked when the index is assembled at save and again
on load, so a missing, duplicated or moved chunk is an error naming the tensor,
never a tensor read partly from uninitialised memory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from .manifest import HEX64, CheckpointError
from .meta import MAX_WORLD
from .safetensors_file import BY_NAME, NAMES


class Chunk(NamedTuple):
    """A box of a full tensor: the rank whose file holds it, its offsets, its sizes and its bytes' SHA-256."""

    rank: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    sha256: str


@dataclass
class Entry:
    """A tensor of the checkpoint: its dtype, its full size and its chunks."""

    dtype: torch.dtype
    size: tuple[int, ...]
    chunks: list[Chunk] = field(default_factory=list)


def file_key(name: str, offsets: Sequence[int], several: bool) -> str:
    """The key a chunk of tensor ``name`` at ``offsets`` has in its file: the name itself, or where the file
    holds ``several`` chunks of the tensor, ``name@o0,o1,...``."""
    return f"{name}@{','.join(map(str, offsets))}" if several else name


def chunk_key(name: str, entry: Entry, chunk: Chunk) -> str:
    """:func:`file_key` of ``chunk`` of the tensor ``name`` (``entry``), from the index."""
    return file_key(name, chunk.offsets, sum(c.rank == chunk.rank for c in entry.chunks) > 1)


def to_json(entries: Mapping[str, Entry]) -> dict[str, Any]:
    """The index as ``meta.json`` stores it (sorted by name, chunks by rank)."""
    return {name: {"dtype": NAMES[e.dtype], "size": list(e.size),
                   "chunks": [[c.rank, list(c.offsets), list(c.sizes), c.sha256] for c in sorted(e.chunks)]}
            for name, e in sorted(entries.items())}


def _ints(value: Any, length: int | None) -> bool:
    return (isinstance(value, list) and (length is None or len(value) == length)
            and all(type(v) is int and 0 <= v < 1 << 62 for v in value))


def check_cover(name: str, entry: Entry, where: Path | str) -> None:
    """Raise unless the chunks of ``entry`` lie inside it, do not overlap and cover it exactly."""
    size, dims = entry.size, len(entry.size)
    for c in entry.chunks:
        if any(o + s > n for o, s, n in zip(c.offsets, c.sizes, size, strict=True)):
            raise CheckpointError(f"{where}: {name}: chunk {list(c.offsets)} + {list(c.sizes)} of rank {c.rank} "
                                  f"lies outside its size {list(size)}")
    solid = sorted((c for c in entry.chunks if math.prod(c.sizes)), key=lambda c: c.offsets)
    for i, a in enumerate(solid):  # sorted by offsets: only chunks starting before a's end in dim 0 can overlap it
        for b in solid[i + 1:]:
            if dims and b.offsets[0] >= a.offsets[0] + a.sizes[0]:
                break
            if all(bo < ao + asz and ao < bo + bsz
                   for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)):
                raise CheckpointError(f"{where}: {name}: the chunks of ranks {a.rank} and {b.rank} overlap "
                                      f"(at {list(a.offsets)} and {list(b.offsets)})")
    volume = sum(math.prod(c.sizes) for c in entry.chunks)
    if volume != math.prod(size) or (not entry.chunks and dims == 0):
        raise CheckpointError(f"{where}: {name}: the chunks hold {volume} of its {math.prod(size)} elements")
    places = [(c.rank, c.offsets) for c in entry.chunks]
    if len(set(places)) != len(places):
        raise CheckpointError(f"{where}: {name}: a rank's file holds two chunks of it at the same offsets")


def parse(tensors: Any, where: Path, files: Sequence[tuple[str, int]]) -> dict[str, Entry]:
    """The index from ``meta.json["tensors"]`` of a checkpoint whose ranks' files are ``files`` (name and
    listed size, by rank), every field checked, and every chunk no larger than the file that holds it
    (so that no declared size makes a reader allocate more than the files hold)."""
    if not isinstance(tensors, dict):
        raise CheckpointError(f"{where}: tensors must be an object (it is {type(tensors).__name__})")
    world = len(files)
    entries = {}
    for name, e in tensors.items():
        shape = "{'dtype': a dtype name, 'size': [sizes], 'chunks': [[rank, [offsets], [sizes], sha256], ...]}"
        if not (isinstance(e, dict) and set(e) == {"dtype", "size", "chunks"} and e["dtype"] in BY_NAME
                and _ints(e["size"], None) and isinstance(e["chunks"], list)):
            raise CheckpointError(f"{where}: tensors[{name!r}] must be {shape} (it is {e!r})"[:2000])
        dims, chunks = len(e["size"]), []
        itemsize = BY_NAME[e["dtype"]].itemsize
        for c in e["chunks"]:
            if not (isinstance(c, list) and len(c) == 4 and type(c[0]) is int and 0 <= c[0] < min(world, MAX_WORLD)
                    and _ints(c[1], dims) and _ints(c[2], dims) and isinstance(c[3], str) and HEX64.fullmatch(c[3])):
                raise CheckpointError(f"{where}: tensors[{name!r}]: chunk {c!r} must be [a rank of 0-{world - 1}, "
                                      f"{dims} offsets, {dims} sizes, 64 hex digits]"[:2000])
            file, size = files[c[0]]
            if math.prod(c[2]) * itemsize > size:
                raise CheckpointError(f"{where}: tensors[{name!r}]: chunk {c[1]} + {c[2]} of rank {c[0]} holds "
                                      f"{math.prod(c[2]) * itemsize} bytes, more than its file {file} ({size} bytes)")
            chunks.append(Chunk(c[0], tuple(c[1]), tuple(c[2]), c[3]))
        entries[name] = Entry(BY_NAME[e["dtype"]], tuple(e["size"]), chunks)
        check_cover(name, entries[name], where)
    return entries


def merge(reports: Sequence[Mapping[str, Sequence[Sequence[Any]]]]) -> dict[str, Entry]:
    """The index from every rank's report ``{name: [[dtype name, size, offsets, sizes, sha256], ...]}`` of the
    chunks it wrote (rank order); the same dtype and size for a tensor on every rank, its chunks covering it."""
    entries: dict[str, Entry] = {}
    for rank, report in enumerate(reports):
        for name, (dtype, size, offsets, sizes, sha256) in ((n, row) for n, rows in report.items() for row in rows):
            entry = entries.setdefault(name, Entry(BY_NAME[dtype], tuple(size)))
            if (entry.dtype, entry.size) != (BY_NAME[dtype], tuple(size)):
                raise CheckpointError(f"{name}: rank {rank} holds it as {dtype} of size {list(size)}, an earlier "
                                      f"rank as {NAMES[entry.dtype]} of size {list(entry.size)}")
            entry.chunks.append(Chunk(rank, tuple(offsets), tuple(sizes), sha256))
    for name, entry in entries.items():
        check_cover(name, entry, "the ranks' shards")
    return entries


def metadata(entries: Mapping[str, Entry], files: Sequence[str]) -> Metadata:
    """``torch.distributed.checkpoint``'s description of the index; each chunk's storage data is the
    name of the file that holds it (``files[rank]``)."""
    described: dict[str, Any] = {}
    storage: dict[MetadataIndex, str] = {}
    for name, e in entries.items():
        chunks = [ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes))
                  for c in e.chunks if math.prod(c.sizes) or not e.size]
        described[name] = TensorStorageMetadata(properties=TensorProperties(dtype=e.dtype), size=torch.Size(e.size),
                                                chunks=chunks)
        for c in e.chunks:
            storage[MetadataIndex(name, c.offsets)] = files[c.rank]
    return Metadata(state_dict_metadata=described, storage_data=storage)

"""``torch.distributed.checkpoint`` storage: one safetensors file per rank, the index as JSON, nothing
pickled and no numpy.

Why not DCP's own storage: ``FileSystemWriter``/``FileSystemReader`` pickle the
``.metadata`` file (and load it with ``pickle``). torch's safetensors storage
(``HuggingFaceStorageWriter``/``HuggingFaceStorageReader``) keeps the index in
the files' JSON headers, but its writer serialises each file with
``safetensors.torch.save``, which needs numpy and builds the whole file in
memory; its distributed file names come from the coordinated global plan (an
object collective: pickled, and numpy again); and its reader takes every
``*.safetensors`` file of the directory as part of the checkpoint, with no
record of which files belong there or of their hashes. So the storage here is
small and our own:

* :class:`ShardWriter` streams this rank's chunks into its own safetensors file
  (:class:`~.safetensors_file.FileWriter`: a JSON header, then the raw bytes, tensor by
  tensor, hashed as written), one chunk per tensor, under the tensor's name;
* :class:`ShardReader` describes the checkpoint to DCP from the index in
  ``meta.json`` (JSON, see :mod:`.index`); before reading a chunk it checks the
  file's size, the chunk's shape and dtype in the file's header, and the
  SHA-256 of its bytes against the index (so a load reads and checks the chunks
  it needs, not the whole checkpoint), then reads just the rows the plan asks
  for (:class:`~.safetensors_file.Reader`). :func:`dcp_call` wraps DCP's calls.

Both work with DCP's own planners too: ``dcp.load`` with the default planner
and a :class:`ShardReader` loads a tensorpar checkpoint into plain or ``DTensor``
state dicts, resharding as DCP does.

Example::

    sd = {"model": plain_model.state_dict()}
    dcp.load(sd, storage_reader=ShardReader.open("out"), no_dist=True)   # the newest checkpoint
"""

from __future__ import annotations

import collections
import contextlib
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import index, publish
from .manifest import MANIFEST, CheckpointError, check_listing, check_size, read_manifest
from .meta import FORMAT, NAME, check_fields, shard_files, world_of
from .safetensors_file import FileWriter, Reader, dtype_name


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def resolve(path: str | Path) -> Path:
    """The checkpoint directory ``path`` names: the one its ``latest`` file points to, or itself."""
    path = Path(path)
    target = publish.resolve_latest(path, NAME) or path
    if not (target / MANIFEST).exists():
        raise CheckpointError(f"no checkpoint at {path} (no meta.json, and no 'latest' pointer)")
    return target


@contextlib.contextmanager
def dcp_call() -> Iterator[None]:
    """Around ``dcp.save`` and ``dcp.load`` with ``no_dist``: silence DCP's warning that this means one
    process (each rank saves or loads its own part on purpose, and the ranks agree through
    :mod:`.agree`), and raise the error DCP wraps in its ``CheckpointException`` (a BaseException)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        try:
            yield
        except CheckpointException as e:
            failures = [error for error, _ in e.failures.values()]
            if not failures:
                raise CheckpointError(str(e)) from None
            raise failures[0] from None


class ShardWriter(StorageWriter):
    """Writes a rank's save plan to the safetensors file ``path``; :attr:`entry` then holds its size and
    SHA-256 and :attr:`report` its chunks (``{name: [[dtype, full size, offsets, sizes, SHA-256], ...]}``)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.entry: dict[str, Any] = {}
        self.report: dict[str, list[list[Any]]] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        planned, results = [], []
        count = collections.Counter(item.index.fqn for item in plan.items)
        for item in plan.items:
            data = item.tensor_data
            if data is None:
                raise CheckpointError(f"{item.index.fqn} is not a tensor: checkpoints hold tensors only")
            key = index.file_key(item.index.fqn, data.chunk.offsets, count[item.index.fqn] > 1)
            planned.append((key, data.chunk.sizes, data.properties.dtype))
        with FileWriter(self.path, planned) as f:
            for item, (key, sizes, dtype) in zip(plan.items, planned, strict=True):
                f.write(key, planner.resolve_data(item))  # type: ignore[arg-type]
                assert item.tensor_data is not None
                name = item.index.fqn
                self.report.setdefault(name, []).append([dtype_name(dtype, name), list(item.tensor_data.size),
                                                         list(item.tensor_data.chunk.offsets), list(sizes),
                                                         f.digests[key]])
                results.append(WriteResult(index=item.index, size_in_bytes=torch.Size(sizes).numel(),
                                           storage_data=self.path.name))
        self.entry = f.entry
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        pass  # the index and the manifest are written once every rank has written its file

    def storage_meta(self) -> None:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


class ShardReader(StorageReader):
    """Reads the chunks of checkpoint ``directory`` (whose checked ``meta.json`` is ``meta``, its chunk
    index ``entries``, its data files ``files`` by rank) for any DCP load plan. :meth:`open` makes one
    from a path."""

    def __init__(self, directory: Path, meta: Mapping[str, Any], entries: Mapping[str, index.Entry],
                 files: Sequence[str]) -> None:
        super().__init__()
        self.directory, self.meta, self.files, self.entries = directory, meta, list(files), dict(entries)
        self.listed: Mapping[str, Any] = meta["files"]
        self.verified: set[tuple[str, str, tuple[int, ...]]] = set()
        self.chunks = {(name, c.offsets): (files[c.rank], c) for name, e in entries.items() for c in e.chunks}

    @classmethod
    def open(cls, path: str | Path) -> ShardReader:
        """A reader of the checkpoint ``path`` names (see :func:`resolve`), after checking the manifest's own
        hash, its fields, its list of files and its index (no chunk larger than its file is listed to be);
        each chunk is checked before it is first read. No data file is read here."""
        directory = resolve(path)
        meta = read_manifest(directory, FORMAT)
        where = directory / MANIFEST
        check_fields(meta, where)
        files = shard_files(world_of(meta))
        check_listing(directory, meta, files)
        entries = index.parse(meta.get("tensors"), where, [(f, meta["files"][f]["bytes"]) for f in files])
        return cls(directory, meta, entries, files)

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return index.metadata(self.entries, self.files)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def _where(self, at: MetadataIndex) -> tuple[str, index.Chunk]:
        key = (at.fqn, tuple(at.offset or ()))
        if key not in self.chunks:
            raise CheckpointError(f"{self.directory}: no chunk of {at.fqn} at {list(key[1])}")
        return self.chunks[key]

    def _place(self, at: MetadataIndex) -> tuple[str, str, tuple[int, ...]]:
        """``(file, tensor name, offsets)`` of the chunk ``at``."""
        file, chunk = self._where(at)
        return file, at.fqn, chunk.offsets

    def verify(self, wanted: Sequence[tuple[str, str, tuple[int, ...]]]) -> None:
        """Check each ``(file, tensor, offsets)`` chunk of ``wanted`` before it is read: the file's size, the
        chunk's shape and dtype against the index, and the SHA-256 of its bytes (each once per reader)."""
        by_file: dict[str, set[tuple[str, tuple[int, ...]]]] = {}
        for file, name, offsets in wanted:
            if (file, name, offsets) not in self.verified:
                by_file.setdefault(file, set()).add((name, offsets))
        for file, chunks in sorted(by_file.items()):
            check_size(self.directory, file, self.listed[file])
            with Reader(self.directory / file) as f:
                for name, offsets in sorted(chunks):
                    _, chunk = self.chunks[name, offsets]
                    key = index.chunk_key(name, self.entries[name], chunk)
                    shape, dtype = f.info(key)
                    if (shape, dtype) != (chunk.sizes, self.entries[name].dtype):
                        raise CheckpointError(f"{f.path}: {key} is {dtype} of shape {shape}, meta.json says "
                                              f"{self.entries[name].dtype} of shape {chunk.sizes}")
                    if f.sha256(key) != chunk.sha256:
                        raise CheckpointError(f"{f.path}: {key} is corrupt (its SHA-256 does not match meta.json)")
                    self.verified.add((file, name, offsets))

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        self.verify([self._place(item.storage_index) for item in plan.items])
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self._where(item.storage_index)[0], []).append(item)
        self.verify([self._place(item.storage_index) for items in per_file.values() for item in items])
        for file, items in sorted(per_file.items()):
            with Reader(self.directory / file) as f:
                for item in items:
                    target = planner.resolve_tensor(item).detach()
                    box = tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths, strict=True))
                    name = item.storage_index.fqn
                    f.read(index.chunk_key(name, self.entries[name], self._where(item.storage_index)[1]), box,
                           out=target)
                    planner.commit_tensor(item, target)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

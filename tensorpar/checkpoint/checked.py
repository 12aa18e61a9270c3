"""Finding a checkpoint and reading its manifest: every field the readers use checked for type, the
list of files checked against the names the code expects, the chunk index checked to cover each
tensor. Nothing here reads a data file; each is checked against its hash before it is read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import index, publish
from .manifest import MANIFEST, CheckpointError, check_listing, read_manifest
from .meta import FORMAT, NAME, check_fields, shard_files, world_of


def resolve(path: str | Path) -> Path:
    """The checkpoint directory ``path`` names: the one its ``latest`` file points to, or itself."""
    path = Path(path)
    target = publish.resolve_latest(path, NAME) or path
    if not (target / MANIFEST).exists():
        raise CheckpointError(f"no checkpoint at {path} (no meta.json, and no 'latest' pointer)")
    return target


def read_checked(path: str | Path) -> tuple[Path, dict[str, Any], dict[str, index.Entry], list[str]]:
    """``(directory, manifest, chunk index, data file names by rank)`` of the checkpoint ``path``
    names, after checking the manifest's own hash, its fields, its list of files and its index (no
    chunk larger than its file is listed to be)."""
    directory = resolve(path)
    meta = read_manifest(directory, FORMAT)
    where = directory / MANIFEST
    check_fields(meta, where)
    files = shard_files(world_of(meta))
    check_listing(directory, meta, files)
    entries = index.parse(meta.get("tensors"), where, [(f, meta["files"][f]["bytes"]) for f in files])
    return directory, meta, entries, files

"""The manifest of a checkpoint directory: one JSON file that sizes and hashes every file of the
checkpoint, and hashes itself, so that no byte of a checkpoint changes unnoticed.

The manifest (``meta.json``) is a JSON object holding the format's own fields plus

* ``"files"``: ``{name: {"sha256": hex digest, "bytes": size}}`` for exactly the
  files the format defines;
* ``"meta_sha256"``: the SHA-256 of the manifest's canonical JSON without this
  field (sorted keys, no spaces), so an edit of any field is detected.

The names of the files always come from the reader's code, never from the
manifest: a manifest cannot send the reader to another file, and a name it
lacks or adds is an error. Every file must be a regular file inside the
directory (a symbolic link or a device is refused). Nothing here knows what the
files hold.

Example::

    write_manifest(tmp, {"format": "my-format/1", "step": 3}, {"a.bin": entry})  # entry: its writer's
    meta = read_manifest(tmp, "my-format/1")      # checks its own hash and its format
    check_listing(tmp, meta, ["a.bin"])            # lists exactly these files
    check_file(tmp, "a.bin", meta["files"]["a.bin"])   # its size and hash
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

MANIFEST = "meta.json"
SELF_HASH = "meta_sha256"
MAX_MANIFEST_BYTES = 64 << 20  # a larger meta.json is no manifest this library wrote
HEX64 = re.compile(r"[0-9a-f]{64}")


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not fit the model it is loaded into."""


def sha256_bytes(file: io.BufferedIOBase, length: int | None = None) -> tuple[str, int]:
    """The hex SHA-256 of the next ``length`` bytes of ``file`` (all to its end when ``None``), read in
    1 MiB blocks, and how many bytes it read (fewer than ``length`` where the file ends)."""
    h, done = hashlib.sha256(), 0
    while length is None or done < length:
        block = file.read(1 << 20 if length is None else min(1 << 20, length - done))
        if not block:
            break
        h.update(block)
        done += len(block)
    return h.hexdigest(), done


def sha256_file(path: Path) -> str:
    """The hex SHA-256 of a file's bytes."""
    with open(path, "rb") as f:
        return sha256_bytes(f)[0]


def canonical_sha256(fields: Mapping[str, Any]) -> str:
    """The hex SHA-256 of ``fields`` as canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def regular_file(path: Path) -> int:
    """The size of ``path``, which must be a regular file (not a link, a directory or a device)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read: {e}") from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{path} is not a regular file (a link, a directory or a device)")
    return info.st_size


def fsync(path: Path) -> None:
    """Flush a file or a directory to disk (a rename is durable once its directory is flushed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: Path, fields: Mapping[str, Any],
                   files: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Write ``directory/meta.json``: ``fields``, ``files`` (``{name: {"sha256": ..., "bytes": ...}}`` of each
    file, flushed to disk and hashed by its writer) and its own hash. The manifest is on disk when this
    returns the manifest it wrote."""
    body = dict(fields) | {"files": {name: dict(entry) for name, entry in files.items()}}
    meta = body | {SELF_HASH: canonical_sha256(body)}
    with open(directory / MANIFEST, "w") as f:
        f.write(json.dumps(meta, indent=1))
        f.flush()
        os.fsync(f.fileno())
    return meta


def read_manifest(directory: Path, format: str) -> dict[str, Any]:
    """The manifest of ``directory``, after checking that it is unedited and of ``format``."""
    path = directory / MANIFEST
    if regular_file(path) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{path} is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        meta = json.loads(path.read_bytes().decode())
    except (ValueError, RecursionError) as e:  # JSON, UTF-8 and integer-size errors are ValueErrors
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    if meta.get("format") != format:
        raise CheckpointError(f"{directory} is not a {format} checkpoint (format {meta.get('format')!r})")
    digest = meta.get(SELF_HASH)
    body = {k: v for k, v in meta.items() if k != SELF_HASH}
    if not isinstance(digest, str) or canonical_sha256(body) != digest:
        raise CheckpointError(f"{path} was modified (its SHA-256 does not match)")
    return meta


def check_listing(directory: Path, meta: Mapping[str, Any], names: Sequence[str]) -> None:
    """Check that the manifest lists exactly ``names``, each with a well-formed size and SHA-256
    (no file is read: see :func:`check_file`)."""
    where = directory / MANIFEST
    files = meta.get("files")
    if not isinstance(files, dict) or set(files) != set(names):
        listed = sorted(files) if isinstance(files, dict) else files
        shown = sorted(names) if len(names) <= 8 else f"{len(names)} names: {sorted(names)[:2]}..."
        raise CheckpointError(f"{where}: files must list exactly {shown} (it lists {listed!r})"[:2000])
    for name in names:
        entry = files[name]
        if not (isinstance(entry, dict) and set(entry) == {"sha256", "bytes"}
                and isinstance(entry["sha256"], str) and HEX64.fullmatch(entry["sha256"])
                and type(entry["bytes"]) is int and entry["bytes"] >= 0):
            raise CheckpointError(f"{where}: files[{name!r}] must be {{'sha256': 64 hex digits, "
                                  f"'bytes': a size}} (it is {entry!r})")


def check_size(directory: Path, name: str, entry: Mapping[str, Any]) -> None:
    """Check that one file (a name from the reader's code) is a regular file of its listed size."""
    path = directory / name
    if regular_file(path) != entry["bytes"]:
        raise CheckpointError(f"{path} is corrupt or truncated (its size does not match meta.json)")


def check_file(directory: Path, name: str, entry: Mapping[str, Any]) -> None:
    """Check one file (a name from the reader's code) against its listed size and SHA-256."""
    check_size(directory, name, entry)
    if sha256_file(directory / name) != entry["sha256"]:
        raise CheckpointError(f"{directory / name} is corrupt or truncated (SHA-256 does not match meta.json)")

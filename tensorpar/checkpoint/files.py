"""A checkpoint directory on disk: ``meta.json`` (the run's fields, ``files``: the size and SHA-256 of
every other file, and ``meta_sha256``: its own), checked before any file is opened; the atomic publish
(a ``.tmp-...`` directory renamed into place, a replaced step renamed ``.old-...`` aside first),
``latest`` and keep-N. After a crash ``latest`` names a complete directory, or an aside copy that
:func:`recover` puts back once its writer is gone.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import stat
from pathlib import Path
from typing import Any

MANIFEST, SELF_HASH, LATEST = "meta.json", "meta_sha256", "latest"
FORMAT = "tensorpar-checkpoint/4"
NAME = re.compile(r"step-\d{6,}")  # a checkpoint directory's name
_ENTRY = re.compile(r"\.(tmp|old)-(\d+)-([A-Za-z0-9_.]*)-([0-9a-f]{8})-(.+)")
_MAX_MANIFEST = 64 << 20


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not fit the model it is loaded into."""


def canonical_sha256(fields: Any) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def regular_file(path: Path) -> int:
    """The size of ``path``, which must be a regular file (not a link, a directory or a device)."""
    try:
        info = os.lstat(path)
    except OSError:
        raise CheckpointError(f"{path} is missing") from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{path} is not a regular file (a link, a directory or a device)")
    return info.st_size


def file_entry(path: Path) -> dict[str, Any]:
    """``{"sha256", "bytes"}`` of a regular file."""
    size, h = regular_file(path), hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return {"sha256": h.hexdigest(), "bytes": size}


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_manifest(directory: Path, fields: dict[str, Any], files: dict[str, dict[str, Any]]) -> None:
    body = fields | {"files": files}
    _write(directory / MANIFEST, json.dumps(body | {SELF_HASH: canonical_sha256(body)}, indent=1))


def _whole(value: object, minimum: int) -> bool:
    return type(value) is int and value >= minimum


def read_manifest(directory: Path) -> dict[str, Any]:
    """``directory``'s manifest after checking its own hash, its format, its fields' types and that
    ``files`` lists exactly the directory's other files, each well-formed (no file is read)."""
    path = directory / MANIFEST
    if regular_file(path) > _MAX_MANIFEST:
        raise CheckpointError(f"{path} is larger than {_MAX_MANIFEST} bytes")
    try:
        meta = json.loads(path.read_bytes().decode())
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{directory} is not a {FORMAT} checkpoint (format {meta.get('format')!r})")
    if meta.get(SELF_HASH) != canonical_sha256({k: v for k, v in meta.items() if k != SELF_HASH}):
        raise CheckpointError(f"{path} was modified (its SHA-256 does not match)")
    for key, minimum in (("step", 0), ("tp", 1), ("dp", 1), ("pp", 1)):
        if not _whole(meta.get(key), minimum):
            raise CheckpointError(f"{path}: {key} must be an integer >= {minimum} (it is {meta.get(key)!r})")
    for key, kinds, kind in (("config", (dict, type(None)), "an object or null"), ("extra", dict, "an object"),
                             ("param_groups", list, "a list")):
        if not isinstance(meta.get(key), kinds):
            raise CheckpointError(f"{path}: {key} must be {kind} (it is {meta.get(key)!r})")
    for i, group in enumerate(meta["param_groups"]):
        names = group.get("params") if isinstance(group, dict) else None
        if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
            raise CheckpointError(f"{path}: param_groups[{i}] must be an object with a list of parameter "
                                  f"names under 'params' (it is {group!r})")
    world, files = meta["tp"] * meta["dp"] * meta["pp"], meta.get("files")
    if world > 1 << 16:
        raise CheckpointError(f"{path}: tp x dp x pp must be at most {1 << 16} (it is {world})")
    names = [".metadata"] + [f"__{r}_0.distcp" for r in range(world)]  # what FileSystemWriter writes
    present = sorted(set(os.listdir(directory)) - {MANIFEST})
    if not isinstance(files, dict) or sorted(files) != sorted(names) or present != sorted(names):
        listed = sorted(files) if isinstance(files, dict) else files
        raise CheckpointError(f"{path}: files must list exactly {names[:4]}{'...' * (world > 3)}, the files of "
                              f"the directory (it lists {listed!r}; the directory holds {present[:5]})"[:2000])
    for name, entry in files.items():
        if not (isinstance(entry, dict) and set(entry) == {"sha256", "bytes"} and isinstance(entry["sha256"], str)
                and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]) and _whole(entry["bytes"], 0)):
            raise CheckpointError(f"{path}: files[{name!r}] must be {{'sha256': 64 hex digits, 'bytes': a size}} "
                                  f"(it is {entry!r})")
    return meta


def check_file(directory: Path, name: str, entry: dict[str, Any], hash: bool = True) -> None:
    """Check one file (listed by a checked manifest) against its size, then (with ``hash``) its SHA-256."""
    if regular_file(directory / name) != entry["bytes"]:
        raise CheckpointError(f"{directory / name} is corrupt or truncated (its size does not match meta.json)")
    if hash and file_entry(directory / name)["sha256"] != entry["sha256"]:
        raise CheckpointError(f"{directory / name} is corrupt (its SHA-256 does not match meta.json)")


# --- publishing ---------------------------------------------------------------------------------

def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())


def scratch(parent: Path, name: str, kind: str = "tmp") -> Path:
    """A fresh temporary (or, ``kind="old"``, aside) path for ``name`` in ``parent``, of this process."""
    return parent / f".{kind}-{os.getpid()}-{_host()}-{secrets.token_hex(4)}-{name}"


def remove(path: Path) -> None:
    """Delete a file, a link, or a directory tree (never following a link)."""
    if stat.S_ISDIR(os.lstat(path).st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _writer_gone(pid: int, host: str) -> bool:
    if host != _host() or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists, as another user's
        pass
    return False


def unfinished(parent: Path) -> list[Path]:
    """The temporary checkpoint directories in ``parent`` that this very process is still writing."""
    return sorted(p for p in parent.iterdir() if (m := _ENTRY.fullmatch(p.name)) and m[1] == "tmp"
                  and int(m[2]) == os.getpid() and m[3] == _host() and NAME.fullmatch(m[5])) \
        if parent.is_dir() else []


def recover(parent: Path) -> None:
    """Finish what crashed writers left in ``parent``: put back an aside copy whose checkpoint is
    missing; delete other aside copies and temporary entries. Entries of live writers stay."""
    if not parent.is_dir():
        return
    for entry in sorted(parent.iterdir()):
        match = _ENTRY.fullmatch(entry.name)
        if not match or not _writer_gone(int(match[2]), match[3]):
            continue
        if match[1] == "old" and NAME.fullmatch(match[5]) and not os.path.lexists(parent / match[5]):
            os.rename(entry, parent / match[5])  # the crash came between moving the old copy aside and the new in
        else:
            remove(entry)
    fsync(parent)


def publish(tmp: Path, final: Path) -> None:
    """Rename the complete directory ``tmp`` to ``final`` (its sibling), replacing one there, and point
    ``latest`` at it. At no moment is there neither a complete ``final`` nor a complete aside copy."""
    parent, aside = tmp.parent, scratch(tmp.parent, final.name, "old")
    if os.path.lexists(final):
        os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except Exception:
        if os.path.lexists(aside) and not os.path.lexists(final):
            os.rename(aside, final)
        raise
    fsync(parent)
    _write(pointer := scratch(parent, LATEST), final.name + "\n")
    os.replace(pointer, parent / LATEST)
    fsync(parent)
    if os.path.lexists(aside):
        remove(aside)


def prune(parent: Path, keep: int, current: str) -> None:
    """Delete all but the newest ``keep`` checkpoints; ``current`` always stays. Each is renamed to a
    temporary name first, so a directory bearing a checkpoint's name is always complete."""
    others = sorted((p for p in parent.iterdir() if NAME.fullmatch(p.name) and p.name != current),
                    key=lambda p: int(p.name[5:]))
    for old in others[:max(0, len(others) - (keep - 1))]:
        doomed = scratch(parent, old.name)
        os.rename(old, doomed)
        remove(doomed)


def resolve(path: str | Path) -> Path:
    """The checkpoint directory ``path`` names: the one its ``latest`` file points to, or itself.
    ``latest`` must hold one checkpoint name, of a directory inside ``path``."""
    path = Path(path)
    pointer, target = path / LATEST, path
    if os.path.lexists(pointer):
        regular_file(pointer)
        data = pointer.read_bytes()[:257]
        text = data.decode("ascii", errors="replace")
        name = text.removesuffix("\n")
        if len(data) > 256 or not NAME.fullmatch(name):
            raise CheckpointError(f"{pointer} must hold one checkpoint name like 'step-000123' "
                                  f"(it holds {text[:80]!r})")
        target = path / name
        if not os.path.lexists(target):
            asides = sorted(p for p in path.glob(".old-*") if (m := _ENTRY.fullmatch(p.name)) and m[5] == name)
            if not asides:
                raise CheckpointError(f"{pointer} names {name}, which does not exist")
            target = asides[0]
        if target.resolve().parent != path.resolve() or not target.resolve().is_dir():
            raise CheckpointError(f"{pointer} names {name}, which is no directory in {path} (a link leads elsewhere)")
    if not (target / MANIFEST).exists():
        raise CheckpointError(f"no checkpoint at {path} (no meta.json, and no 'latest' pointer)")
    return target

"""A checkpoint directory on disk: its manifest ``meta.json`` (checked before DCP opens anything), publishing by
renames, ``latest``, keep-N, and the clean-up of what a crashed save left."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any

MANIFEST, LATEST, FORMAT = "meta.json", "latest", "tensorpar-checkpoint/5"
NAME = re.compile(r"step-\d{6,}")  # a checkpoint directory's name
_TMP = re.compile(r"\.tmp-(\d+)-(step-\d{6,}|latest)")
_FIELDS: tuple[tuple[str, Any, str], ...] = (
    ("step", int, "an integer >= 0"), ("tp", int, "an integer >= 1"), ("dp", int, "an integer >= 1"),
    ("pp", int, "an integer >= 1"), ("config", (dict, type(None)), "an object or null"), ("extra", dict, "an object"),
    ("param_groups", list, "a list"), ("files", dict, "an object"))


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not fit the model it is loaded into."""


def canonical_sha256(fields: Any) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_entry(path: Path, hash: bool = True) -> dict[str, Any]:
    """``{"sha256", "bytes"}`` of ``path``, a regular file (no link); ``"sha256": None`` unless ``hash``."""
    info = os.lstat(path) if os.path.lexists(path) else None
    if info is None or not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{path} is {'missing' if info is None else 'not a regular file (a link?)'}")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while hash and (block := f.read(1 << 20)):
            digest.update(block)
    return {"sha256": digest.hexdigest() if hash else None, "bytes": info.st_size}


def write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: Path, share: tuple[int, int] | None = (0, 1)) -> dict[str, Any]:
    """``directory``'s manifest (the run's fields, ``files``: every other file's size and SHA-256, ``meta_sha256``:
    its own) after checking it; ``share = (first, step)``: the files this rank hashes besides ``.metadata``."""
    path = directory / MANIFEST
    try:
        meta = json.loads(path.read_bytes()) if file_entry(path, hash=False)["bytes"] < 64 << 20 else None
        if not (isinstance(meta, dict) and meta.pop("meta_sha256", None) == canonical_sha256(meta)):
            raise ValueError
    except (ValueError, RecursionError):
        raise CheckpointError(f"{path}: not the JSON object whose SHA-256 it records (the file was edited)") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{directory} is not a {FORMAT} checkpoint (format {meta.get('format')!r})")
    for key, kinds, what in _FIELDS:
        value = meta.get(key)
        if not isinstance(value, kinds) or (kinds is int and (type(value) is bool or int(value) < (key != "step"))):
            raise CheckpointError(f"{path}: {key} must be {what} (it is {value!r})")
    files, present = meta["files"], sorted(set(os.listdir(directory)) - {MANIFEST})
    if sorted(files) != present:
        raise CheckpointError(f"{path}: files lists {sorted(files)[:5]}, the directory holds {present[:5]}"[:2000])
    if (world := meta["tp"] * meta["dp"] * meta["pp"]) != (held := sum(n.endswith(".distcp") for n in files)):
        raise CheckpointError(f"{path}: tp x dp x pp = {world} ranks, the checkpoint holds the files of {held}")
    for i, name in enumerate(present):
        mine = name == ".metadata" or (share is not None and i % share[1] == share[0])
        if file_entry(directory / name, mine) != (files[name] | {"sha256": None} if isinstance(files[name], dict)
                                                  and not mine else files[name]):
            raise CheckpointError(f"{directory / name}: size or SHA-256 does not match meta.json")
    return meta


def scratch(final: Path, pid: int | None = None) -> Path:
    """The temporary path for ``final`` of this process (or of process ``pid``)."""
    return final.parent / f".tmp-{pid or os.getpid()}-{final.name}"


def discard(path: Path) -> None:
    """Delete a file, a link, or a directory tree (never following a link), if there is one."""
    if os.path.lexists(path):
        shutil.rmtree(path) if stat.S_ISDIR(os.lstat(path).st_mode) else os.unlink(path)


def recover(parent: Path) -> None:
    """Before a save into ``parent``: refuse while this process's own save there is unfinished; put back an aside
    copy whose checkpoint is missing (a crash inside :func:`publish`); delete the other leftovers of crashes."""
    for entry in sorted(parent.iterdir()) if parent.is_dir() else []:
        if (match := _TMP.fullmatch(entry.name)) and int(match[1]) == os.getpid():
            raise CheckpointError(f"{entry} is a save of this process still being written: call the wait() of "
                                  "its async_save before saving again into the same directory")
        old = entry.name.startswith(".old-") and NAME.fullmatch(entry.name[5:])
        if old and not os.path.lexists(parent / entry.name[5:]):
            os.rename(entry, parent / entry.name[5:])
        elif match or old:
            discard(entry)


def publish(tmp: Path, final: Path, keep: int, fields: dict[str, Any]) -> None:
    """Write ``tmp``'s manifest of ``fields``, rename ``tmp`` to ``final`` (a replaced step waits aside), point
    ``latest`` at it, keep the newest ``keep``."""
    body = fields | {"files": {name: file_entry(tmp / name) for name in sorted(os.listdir(tmp))}}
    write_text(tmp / MANIFEST, json.dumps(body | {"meta_sha256": canonical_sha256(body)}, indent=1))
    parent, aside = final.parent, final.parent / f".old-{final.name}"
    if os.path.lexists(final):
        os.rename(final, aside)  # resolve() reads the aside copy until the new one is in place
    os.rename(tmp, final)
    write_text(pointer := scratch(parent / LATEST), final.name + "\n")
    os.replace(pointer, parent / LATEST)
    discard(aside)
    others = sorted((p for p in parent.iterdir() if NAME.fullmatch(p.name) and p != final),
                    key=lambda p: int(p.name[5:]))
    for old in others[:max(0, len(others) - keep + 1)]:
        os.rename(old, doomed := scratch(old))  # a checkpoint's name is always of a complete one
        discard(doomed)
    fd = os.open(parent, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def resolve(path: str | Path) -> Path:
    """The checkpoint directory ``path`` names: the one its ``latest`` file points to, or itself."""
    path = Path(path)
    pointer, target = path / LATEST, path
    if os.path.lexists(pointer):
        file_entry(pointer, hash=False)
        name = pointer.read_bytes()[:80].decode("ascii", errors="replace").removesuffix("\n")
        if not NAME.fullmatch(name):
            raise CheckpointError(f"{pointer} must hold one checkpoint name like 'step-000123' (it holds {name!r})")
        target = path / name if os.path.lexists(path / name) else path / f".old-{name}"
        if not target.is_dir() or target.is_symlink():
            raise CheckpointError(f"{pointer} names {name}, which is no directory in {path}")
    if not (target / MANIFEST).exists():
        raise CheckpointError(f"no checkpoint at {path} (no meta.json, and no 'latest' pointer)")
    return target

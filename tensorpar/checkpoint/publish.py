"""Publishing checkpoint directories so that a crash at any moment loses nothing, and the
``latest`` pointer.

A writer fills a private temporary directory beside the checkpoints, then
publishes it under its final name (:func:`publish`):

1. a directory already holding that name is renamed aside;
2. the new directory is renamed in;
3. ``latest`` is replaced by a file naming it (written aside, then renamed over);
4. the aside copy is deleted.

Each step is one rename, so after a crash at any point a complete copy exists:
``latest`` names it or, between steps 1 and 2, names a directory whose previous
copy is aside. :func:`resolve_latest` then returns the aside copy, and the next
writer's :func:`recover` renames it back. Pruning (:func:`discard`) renames a
checkpoint to a temporary name before deleting it, so a directory bearing a
checkpoint's name is always complete.

Temporary and aside entries are named ``.tmp-<pid>-<host>-<nonce>-<name>`` and
``.old-<pid>-<host>-<nonce>-<name>``. :func:`recover` removes (or puts back)
only those whose writer process is gone; an entry of a live process, or of
another host (whose processes cannot be seen from here), is left alone.

``latest`` must hold exactly one name of the caller's pattern (such as
``step-000123``), and the directory it names must lie in the same parent once
links are resolved: the pointer cannot lead anywhere else. Nothing here knows
what a checkpoint holds.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import stat
from collections.abc import Callable
from pathlib import Path

from .manifest import CheckpointError, fsync, regular_file

LATEST = "latest"
_ENTRY = re.compile(r"\.(tmp|old)-(\d+)-([A-Za-z0-9_.]*)-([0-9a-f]{8})-(.+)")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())


def _entry(kind: str, parent: Path, name: str) -> Path:
    """A fresh temporary (``kind`` "tmp") or aside ("old") path for ``name`` in ``parent``, of this process."""
    return parent / f".{kind}-{os.getpid()}-{_host()}-{secrets.token_hex(4)}-{name}"


def scratch(parent: Path, name: str) -> Path:
    """A fresh temporary path for ``name`` in ``parent``, of this process (removed by :func:`recover`
    once the process is gone)."""
    return _entry("tmp", parent, name)


def _writer_gone(pid: int, host: str) -> bool:
    """True when the process that made an entry is certainly gone (on this host, no such process)."""
    if host != _host() or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # PermissionError: it exists, as another user's
        return False
    return False


def remove(path: Path) -> None:
    """Delete a file, a link, or a directory tree (never following a link)."""
    if stat.S_ISDIR(os.lstat(path).st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def temporary(parent: Path, name: str) -> Path:
    """Create a private temporary directory in ``parent`` for the checkpoint to be called ``name``."""
    parent.mkdir(parents=True, exist_ok=True)
    path = _entry("tmp", parent, name)
    path.mkdir()
    return path


def unfinished(parent: Path, pattern: re.Pattern[str]) -> list[Path]:
    """The temporary checkpoint directories in ``parent`` that this very process is still writing
    (a save in a background thread, say)."""
    if not parent.is_dir():
        return []
    return sorted(p for p in parent.iterdir() if (m := _ENTRY.fullmatch(p.name)) and m[1] == "tmp"
                  and int(m[2]) == os.getpid() and m[3] == _host() and pattern.fullmatch(m[5]))


def recover(parent: Path, pattern: re.Pattern[str]) -> None:
    """Finish what crashed writers left in ``parent``: put back an aside copy whose checkpoint is
    missing; delete other aside copies and temporary entries. Entries of live writers stay."""
    if not parent.is_dir():
        return
    for entry in sorted(parent.iterdir()):
        match = _ENTRY.fullmatch(entry.name)
        if not match or not _writer_gone(int(match[2]), match[3]):
            continue
        final = parent / match[5]
        if match[1] == "old" and pattern.fullmatch(match[5]) and not os.path.lexists(final):
            os.rename(entry, final)  # the crash came between moving the old copy aside and the new one in
        else:
            remove(entry)
    fsync(parent)


def publish(tmp: Path, final: Path) -> None:
    """Rename the complete directory ``tmp`` to ``final`` (its sibling), replacing one there, and point
    ``latest`` at it. At no moment is there neither a complete ``final`` nor a complete aside copy."""
    parent = tmp.parent
    aside = _entry("old", parent, final.name)
    if os.path.lexists(final):
        os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except Exception:
        if os.path.lexists(aside) and not os.path.lexists(final):
            os.rename(aside, final)
        raise
    fsync(parent)
    write_latest(parent, final.name)
    if os.path.lexists(aside):
        remove(aside)


def write_latest(parent: Path, name: str) -> None:
    """Replace ``parent/latest`` atomically with a file holding ``name``."""
    pointer = _entry("tmp", parent, LATEST)
    with open(pointer, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, parent / LATEST)
    fsync(parent)


def resolve_latest(parent: Path, pattern: re.Pattern[str]) -> Path | None:
    """The directory ``parent/latest`` names (its aside copy where a crash left it there), or None when
    there is no ``latest``. The pointer must hold one name of ``pattern``, confined to ``parent``."""
    pointer = parent / LATEST
    if not os.path.lexists(pointer):
        return None
    regular_file(pointer)
    with open(pointer, "rb") as f:
        data = f.read(257)
    text = data.decode("ascii", errors="replace")
    name = text[:-1] if text.endswith("\n") else text
    if len(data) > 256 or not pattern.fullmatch(name):
        raise CheckpointError(f"{pointer} must hold one checkpoint name like 'step-000123' (it holds {text[:80]!r})")
    target = parent / name
    if not os.path.lexists(target):
        asides = sorted(p for p in parent.glob(".old-*") if (m := _ENTRY.fullmatch(p.name)) and m[5] == name)
        if not asides:
            raise CheckpointError(f"{pointer} names {name}, which does not exist")
        target = asides[0]
    if target.resolve().parent != parent.resolve() or not target.resolve().is_dir():
        raise CheckpointError(f"{pointer} names {name}, which is no directory in {parent} (a link leads elsewhere)")
    return target


def discard(path: Path) -> None:
    """Delete the directory ``path``, renamed to a temporary name first so that a crash leaves no half of it."""
    doomed = _entry("tmp", path.parent, path.name)
    os.rename(path, doomed)
    remove(doomed)


def prune(parent: Path, pattern: re.Pattern[str], order: Callable[[str], int], keep: int, current: str) -> None:
    """Delete all but the newest ``keep`` checkpoints (by ``order`` of their names); ``current`` always stays."""
    others = sorted((p for p in parent.iterdir() if pattern.fullmatch(p.name) and p.name != current),
                    key=lambda p: order(p.name))
    for old in others[:max(0, len(others) - (keep - 1))]:  # the newest keep - 1 others stay
        discard(old)

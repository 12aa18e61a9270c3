"""An output directory belongs to one run: usable before any rank starts, held by one job at a time,
and never silently reused by a new run.

* :func:`check_out`: the directory can be written (or made), is not a checkpoint
  directory, and holds no earlier run's files unless the run continues it
  (``--resume``) or sets it aside (``--overwrite``);
* :func:`claim`: an exclusive ``fcntl.flock`` on ``OUT/run.lock`` (holding the
  holder's pid), taken before the run writes anything and released by the
  kernel when the holder ends, however it ends; a second job is refused by the
  holder's pid. Under the lock the check above is made again (another job may
  have written in between), and ``--overwrite`` moves the earlier run's files
  into ``OUT/replaced-<time>/``, deleting nothing;
* :func:`hold`: :func:`claim` by the process that lives exactly as long as the
  job: the launcher of local ranks, or global rank 0 of ranks started by
  torchrun, the others waiting for its outcome.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tensorpar.checkpoint.agree import share
from tensorpar.checkpoint.manifest import MANIFEST
from tensorpar.checkpoint.meta import NAME
from tensorpar.mesh import Mesh

LOCK = "run.lock"
#: what a run writes into its directory, besides its checkpoints (``step-NNNNNN``)
RUN_FILES = ("metrics.jsonl", "loss.png", "latest", "tensorboard", "wandb")
#: where ``--overwrite`` moves an earlier run's files: a folder of the directory, by the time
ASIDE = "replaced-%Y%m%d-%H%M%S"


def earlier_run(out: Path) -> list[str]:
    """The names of the files and checkpoints a run left in ``out`` (sorted; none: no run there)."""
    if not out.is_dir():
        return []
    return sorted(p.name for p in out.iterdir() if p.name in RUN_FILES or NAME.fullmatch(p.name))


def check_out(out: Path, *, resume: str, overwrite: bool, held: bool = True) -> None:
    """Raise ``ValueError`` unless a run (``resume``: ``"never"``, ``"auto"`` or ``"must"``) may write
    into ``out``: a directory this process can write (or create), not a checkpoint directory (nor named
    like one), not held by another job (looked at when ``held``), holding no earlier run unless
    ``resume`` continues it or ``overwrite`` sets it aside."""
    if (out / MANIFEST).is_file():
        raise ValueError(f"--out {out} is a checkpoint directory: pass the run's directory, its parent (--out "
                         f"{out.parent}), with --resume to continue from its newest checkpoint")
    if NAME.fullmatch(out.name):
        raise ValueError(f"--out {out} is named like a checkpoint directory (a run in {out.parent} would prune it "
                         "as one): pass another --out")
    _check_writable(out)
    if held and (out / LOCK).is_file():
        fd = os.open(out / LOCK, os.O_RDONLY)
        try:
            _lock(fd, out, fcntl.LOCK_SH)  # released at once: only a job's exclusive lock stops it
        finally:
            os.close(fd)
    found = earlier_run(out)
    if found and resume == "never" and not overwrite:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise ValueError(f"--out {out} holds an earlier run ({shown}): pass --resume to continue it, or "
                         f"--overwrite to start afresh (its files are moved into {out}/replaced-<time>/), or "
                         "another --out")


def _check_writable(out: Path) -> None:
    """``out``, or the nearest folder above it that exists, is a directory this process can write in."""
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"--out {out}: {existing} is {'a file' if existing.is_file() else 'not a directory'}, "
                         "not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):  # made and gone at once (O_TMPFILE where it can)
            pass
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write in {existing} ({e.strerror or e})") from None


def _lock(fd: int, out: Path, kind: int) -> None:
    """``flock`` the lock file ``fd`` of ``out`` without waiting; ``ValueError`` naming the pid of the job
    that holds it."""
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
            raise
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        raise ValueError(f"--out {out} is in use by another run (pid {holder}, which holds {out / LOCK}): "
                         "wait for it to end, or pass another --out") from None


@contextlib.contextmanager
def claim(out: Path, *, resume: str, overwrite: bool) -> Iterator[Path | None]:
    """Hold ``out`` for this process (see the module's docstring) while the block runs; yield where
    ``overwrite`` moved an earlier run's files (None: nothing was there). ``ValueError`` when another
    job holds it, or when :func:`check_out` refuses it now."""
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the processes started below
    try:
        _lock(fd, out, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        check_out(out, resume=resume, overwrite=overwrite, held=False)
        yield _set_aside(out) if overwrite else None
    finally:
        os.close(fd)  # releases the lock; the file stays (removing it would let two jobs lock two files)


def _set_aside(out: Path) -> Path | None:
    """Move the earlier run's files in ``out`` into a new ``out/replaced-<time>`` folder; return it."""
    found = earlier_run(out)
    if not found:
        return None
    stamp = time.strftime(ASIDE)
    aside, n = out / stamp, 1
    while True:
        try:
            aside.mkdir()
            break
        except FileExistsError:  # another --overwrite within the same second
            n += 1
            aside = out / f"{stamp}-{n}"
    for name in found:
        os.rename(out / name, aside / name)
    return aside


@contextlib.contextmanager
def hold(out: str | None, *, resume: str, overwrite: bool, prog: str, mesh: Mesh | None = None) -> Iterator[None]:
    """:func:`claim` ``out`` (nothing when it is None) while the block runs: in this process when
    ``mesh`` is None (it launches the ranks), else on global rank 0 of ``mesh``, the other ranks
    learning its outcome (a collective). A refusal exits every rank as an argument error (code 2; the
    holder prints ``prog: error: ...`` on stderr); where ``--overwrite`` moved an earlier run is printed.

    Example::

        with hold(cfg.out, resume=cfg.resume, overwrite=cfg.overwrite, prog="train.py"):
            tensorpar.spawn(train, world, cfg)
    """
    with contextlib.ExitStack() as held:
        refusal = None
        if out is not None and (mesh is None or mesh.rank == 0):
            try:
                aside = held.enter_context(claim(Path(out), resume=resume, overwrite=overwrite))
            except ValueError as e:
                refusal = str(e)
            else:
                if aside is not None:
                    print(f"--overwrite: the earlier run's files in {out} are now in {aside}", flush=True)
        if out is not None and mesh is not None and mesh.world_size > 1:
            refusal = share({"refusal": refusal}, mesh)[0]["refusal"]  # JSON over a tensor: nothing pickled
        if refusal is not None:
            if mesh is None or mesh.rank == 0:
                print(f"{prog}: error: {refusal}", file=sys.stderr, flush=True)
            raise SystemExit(2)
        yield

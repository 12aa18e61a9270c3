"""Saving: every rank writes its own chunks, in parallel, through ``torch.distributed.checkpoint``;
the first rank then writes the manifest and publishes the directory.

1. *prepare* (a collective): each rank picks the chunks it writes (:mod:`.state`,
   :mod:`.optim`, :mod:`.rng`) and checks that its floating-point ones are finite
   (:mod:`.finite`: a NaN or an infinity anywhere refuses the save on every rank,
   so a diverged state never replaces good checkpoints); the first rank clears
   what dead writers left and makes a temporary directory, whose name every rank
   learns; the ranks compare ``step``, ``keep`` and a SHA-256 of ``extra``, and
   all refuse when they differ;
2. *write*: each rank saves its chunks with ``dcp.save`` (no coordination
   needed: each knows its boxes), :class:`~.planner.BoxSavePlanner` stating
   their offsets and :class:`~.storage.ShardWriter` streaming them, tensor by
   tensor, into its own file, hashing as it writes;
3. *finish* (a collective): the first rank gathers every rank's file hash and
   chunk list, checks that the chunks of each tensor cover it exactly, writes
   ``meta.json`` with the index and the hashes, publishes the directory
   (:mod:`.publish`) and prunes old checkpoints, unless the process that
   launched it is gone (:func:`tensorpar.lifeline.launcher_gone`: its ranks are
   about to end, and a restarted job may already be writing there); every rank
   learns the outcome.

:func:`async_save` copies this rank's chunks to CPU memory (its shard: a
bounded buffer), runs step 2 in a thread and returns a :class:`PendingSave`
whose ``wait()`` runs step 3: ``latest`` moves only then, once every file is
complete on disk.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from ..lifeline import launcher_gone
from ..mesh import Mesh
from . import index, optim, publish, rng, state
from .agree import collect, described, differences, settle, share
from .boxes import Box
from .finite import nonfinite
from .groups import grouped_names, hyperparameters, merged_names
from .manifest import CheckpointError, canonical_sha256, write_manifest
from .meta import FORMAT, NAME, as_json, config_dict, dirname, shard_file, shard_files, step_of, whole
from .planner import BoxSavePlanner
from .storage import ShardWriter, dcp_call

_SHOWN = 4  # the names of non-finite tensors an error lists


@dataclass
class Job:
    """One save: where it goes, what this rank writes, and the manifest's fields."""

    final: Path
    tmp: Path
    fields: dict[str, Any]
    keep: int
    mesh: Mesh
    tensors: dict[str, torch.Tensor] = field(repr=False)
    boxes: dict[str, Box] = field(repr=False)


def _fields(model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int, extra: Mapping[str, Any] | None,
            mesh: Mesh) -> dict[str, Any]:
    fields = {"format": FORMAT, "step": step, "tp": mesh.tp, "dp": mesh.dp, "pp": mesh.pp,
              "config": config_dict(model), "param_groups": [], "extra": as_json(dict(extra or {}), "extra")}
    if optimizer is not None:
        names = grouped_names(model, optimizer)
        if mesh.pp > 1:  # each stage's parameters: every group names those of all stages
            names = merged_names(share({"names": names}, mesh), len(names))
        fields["param_groups"] = [h | {"params": n} for h, n in zip(hyperparameters(optimizer), names, strict=True)]
    return fields


def prepare(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, step: int,
            extra: Mapping[str, Any] | None, keep: int, mesh: Mesh, stage: bool) -> Job:
    """Step 1 (a collective); ``stage`` copies this rank's chunks to CPU memory. The ranks must agree on
    ``step``, ``keep`` and ``extra``: every rank raises the same CheckpointError when they do not."""
    error: Exception | None = None
    tmp: Path | None = None
    try:
        if not whole(step, 0) or not whole(keep, 1):
            raise CheckpointError(f"step must be an integer >= 0 and keep one >= 1 (got step={step!r}, keep={keep!r})")
        final = Path(directory) / dirname(step)
        fields = _fields(model, optimizer, step, extra, mesh)
        tensors, boxes = state.pieces(model, mesh)
        if optimizer is not None:
            more, more_boxes = optim.pieces(model, optimizer, mesh)
            tensors, boxes = tensors | more, boxes | more_boxes
        bad = nonfinite(tensors)
        if bad:
            shown = ", ".join(bad[:_SHOWN]) + (f" and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else "")
            raise CheckpointError(f"the checkpoint of step {step} would hold NaN or infinite values (in {shown}): "
                                  "not saved, and the checkpoints already in the directory are left as they are")
        mine = rng.pieces(mesh)
        tensors |= mine
        boxes |= {k: Box((0,) * v.dim(), tuple(v.shape), tuple(v.shape)) for k, v in mine.items()}
        if stage:
            tensors = {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}
        if mesh.rank == 0:
            for pending in publish.unfinished(final.parent, NAME):
                raise CheckpointError(f"{pending} is a save of this process still being written: call the wait() "
                                      "of its async_save before saving again into the same directory")
            publish.recover(final.parent, NAME)
            tmp = publish.temporary(final.parent, final.name)
    except Exception as e:  # noqa: BLE001 - every rank learns of it below, then every rank raises
        error = e
    arguments = ({"step": step, "keep": keep, "extra's SHA-256": canonical_sha256(fields["extra"])[:16]}
                 if error is None else {})  # compared across ranks (once none failed)
    rows = share({"error": described(error), "tmp": tmp.name if tmp is not None else None} | arguments, mesh)
    disagreement = differences(rows, arguments, "save")
    if (disagreement or any(row["error"] is not None for row in rows)) and tmp is not None:
        publish.remove(tmp)
    settle(rows, error, mesh, "save the checkpoint")
    if disagreement:
        raise CheckpointError(disagreement)
    return Job(final, final.parent / rows[0]["tmp"], fields, keep, mesh, tensors, boxes)


def write(job: Job) -> dict[str, Any]:
    """Step 2: this rank's file; returns its hash entry and its chunks (no collective: any thread)."""
    writer = ShardWriter(job.tmp / shard_file(job.mesh.rank, job.mesh.world_size))
    with dcp_call():
        dcp.save(job.tensors, storage_writer=writer, planner=BoxSavePlanner(job.boxes), no_dist=True)
    return {"file": writer.entry, "chunks": writer.report}


def _publish(job: Job, reports: list[dict[str, Any]]) -> None:
    files = shard_files(job.mesh.world_size)
    entries = index.merge([r["chunks"] for r in reports])
    write_manifest(job.tmp, job.fields | {"tensors": index.to_json(entries)},
                   {name: r["file"] for name, r in zip(files, reports, strict=True)})
    _launcher_running(job.final, "is not published")
    publish.publish(job.tmp, job.final)
    _launcher_running(job.final, "is published, but older checkpoints are not pruned")
    publish.prune(job.final.parent, NAME, step_of, job.keep, job.final.name)


def _launcher_running(final: Path, otherwise: str) -> None:
    """Raise (saying that ``final`` ``otherwise``) unless the process that launched this rank still runs:
    a rank whose launcher is gone ends soon (see :mod:`tensorpar.lifeline`) and changes nothing meanwhile."""
    why = launcher_gone()
    if why is not None:
        raise CheckpointError(f"{why}: {final} {otherwise}")


def finish(job: Job, written: dict[str, Any] | None, error: BaseException | None) -> Path:
    """Step 3 (a collective): after every rank's :func:`write` (``written``, or its ``error``)."""
    mesh = job.mesh
    reports = collect({"error": described(error), **(written or {})}, mesh)
    outcome: str | None = None
    if reports is not None:  # the first rank
        failed = [(r, row["error"]) for r, row in enumerate(reports) if row["error"] is not None]
        try:
            if failed:
                outcome = f"rank {failed[0][0]}: {failed[0][1]}"
            else:
                _publish(job, reports)
        except Exception as e:  # noqa: BLE001 - a crash (a BaseException) leaves the directory to the next save's recover()
            error, outcome = e, f"rank 0: {described(e)}"
        if outcome is not None and os.path.lexists(job.tmp):
            publish.remove(job.tmp)
    rows = share({"error": outcome}, mesh)
    if error is not None:
        settle(rows, error, mesh, "save the checkpoint")
    if rows[0]["error"] is not None:
        raise CheckpointError(f"{rows[0]['error']} (so rank {mesh.rank} did not save the checkpoint either)")
    return job.final


class PendingSave:
    """A checkpoint being written in the background (from :func:`async_save`).

    Each rank's chunks were copied when the save began, so training may go on
    and change the model. :meth:`wait` (a collective: every rank calls it)
    waits for this rank's file, then publishes the checkpoint and returns its
    path; until then ``latest`` names the previous checkpoint.

    Example::

        pending = tensorpar.checkpoint.async_save("out", model, optimizer, step=step)
        ...                                    # more training steps
        path = pending.wait()                  # the checkpoint is complete and latest names it
    """

    def __init__(self, job: Job) -> None:
        self._job = job
        self._result: dict[str, Any] | None = None
        self._error: BaseException | None = None
        self._path: Path | None = None
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tensorpar-checkpoint", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = write(self._job)
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            self._error = e
        finally:
            self._job.tensors = {}  # the staged copy is written: free it

    def done(self) -> bool:
        """Whether this rank's file is written (the checkpoint is published by :meth:`wait`)."""
        return not self._thread.is_alive()

    def wait(self) -> Path:
        """Finish the save on every rank (a collective) and return the checkpoint's path."""
        if self._failed is not None:
            raise self._failed
        if self._path is None:
            self._thread.join()
            try:
                self._path = finish(self._job, self._result, self._error)
            except BaseException as e:
                self._failed = e
                raise
        return self._path

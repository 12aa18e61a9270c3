"""Saving: *prepare* (a collective: gather and check every rank's tensors, agree on the arguments,
make the temporary directory), *write* (``dcp.save`` or ``dcp.async_save`` with ``FileSystemWriter``),
*finish* (a collective: hash the files, write ``meta.json``, publish, prune)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from ..mesh import Mesh
from . import files, generators
from .contents import grouped_names, model_pieces, optim_pieces, param_groups
from .files import FORMAT, CheckpointError
from .layout import Box, BoxSavePlanner, whole


def agree(error: BaseException | None, mesh: Mesh, doing: str, value: Any = None,
          undo: Callable[[], None] | None = None) -> list[Any]:
    """Every rank's ``value`` (one ``all_gather_object``), after raising on every rank when any rank
    failed: its own error, or one naming the first rank that failed (``undo`` runs first)."""
    rows: list[Any] = [None] * dist.get_world_size()
    said = None if error is None else str(error) if isinstance(error, CheckpointError) else \
        f"{type(error).__name__}: {error}"
    dist.all_gather_object(rows, (said and said[:4000], value))
    failed = [(r, e) for r, (e, _) in enumerate(rows) if e is not None]
    if failed and undo is not None:
        undo()
    if isinstance(error, CheckpointError):
        raise CheckpointError(f"rank {mesh.rank}: {error}") from error
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"rank {failed[0][0]}: {failed[0][1]} (so rank {mesh.rank} did not {doing} either)")
    return [v for _, v in rows]


def config_dict(model: nn.Module) -> dict[str, Any] | None:
    """The model's ``config`` dataclass as JSON, without fields whose metadata says ``{"state": False}``."""
    config = getattr(model, "config", None)
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        return None
    kept = {f.name for f in dataclasses.fields(config) if f.metadata.get("state", True)}
    return json.loads(json.dumps({k: v for k, v in dataclasses.asdict(config).items() if k in kept}))


@dataclass
class Job:
    final: Path
    tmp: Path
    fields: dict[str, Any]
    keep: int
    mesh: Mesh
    tensors: dict[str, torch.Tensor] = field(repr=False)
    boxes: dict[str, Box] = field(repr=False)


def prepare(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, step: int,
            extra: Mapping[str, Any] | None, keep: int, mesh: Mesh) -> Job:
    """Step 1 (a collective): every rank raises the same CheckpointError when any failed or they disagree."""
    error, final, names, fields, mine = None, Path(), None, dict[str, Any](), dict[str, torch.Tensor]()
    tensors, boxes = dict[str, torch.Tensor](), dict[str, Box]()
    try:
        if type(step) is not int or step < 0 or type(keep) is not int or keep < 1:
            raise CheckpointError(f"step must be an integer >= 0 and keep one >= 1 (got step={step!r}, keep={keep!r})")
        final = Path(directory) / f"step-{step:06d}"
        fields = {"format": FORMAT, "step": step, "tp": mesh.tp, "dp": mesh.dp, "pp": mesh.pp,
                  "config": config_dict(model), "param_groups": [], "extra": dict(extra or {})}
        tensors, boxes = model_pieces(model)
        if optimizer is not None:
            names = grouped_names(model, optimizer)
            fields["param_groups"] = param_groups(optimizer, [names])
            more, more_boxes = optim_pieces(model, optimizer)
            tensors, boxes = tensors | more, boxes | more_boxes
        try:
            fields = json.loads(json.dumps(fields))
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"extra or the optimizer's hyper-parameters cannot be stored in JSON: {e}") from None
        if bad := [n for n, v in tensors.items() if v.is_floating_point() and not bool(v.isfinite().all())]:
            shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
            raise CheckpointError(f"the checkpoint of step {step} would hold NaN or infinite values (in {shown}): "
                                  "not saved, and the checkpoints already in the directory are left as they are")
        mine = generators.streams(mesh)
        if mesh.rank == 0:
            files.recover(final.parent)
            final.parent.mkdir(parents=True, exist_ok=True)
            files.scratch(final).mkdir()
    except Exception as e:  # noqa: BLE001 - every rank learns of it below, then every rank raises
        error = e
    undo = (lambda: files.discard(files.scratch(final))) if mesh.rank == 0 else None
    arguments = {"step": step, "keep": keep, "extra": fields.get("extra")}
    rows = agree(error, mesh, "save the checkpoint", (arguments, names, mine, os.getpid()), undo)
    if differ := "; ".join(f"{key}: " + ", ".join(f"{row[0][key]!r} on rank {r}" for r, row in enumerate(rows))
                           for key in arguments if any(row[0][key] != arguments[key] for row in rows)):
        if undo is not None:
            undo()
        raise CheckpointError(f"the ranks must save with the same arguments, and they differ ({differ[:2000]})")
    tmp = files.scratch(final, rows[0][3])  # named by rank 0's process
    if optimizer is not None:
        fields["param_groups"] = json.loads(json.dumps(param_groups(optimizer, [row[1] for row in rows])))
    states = generators.named([row[2] for row in rows], mesh.rank)
    return Job(final, tmp, fields, keep, mesh, tensors | states, boxes | {k: whole(v) for k, v in states.items()})


def finish(job: Job, error: BaseException | None) -> Path:
    """Step 3 (a collective), after every rank's write (or its ``error``): hash, publish, prune."""
    mesh, hashed = job.mesh, {}
    undo = (lambda: files.discard(job.tmp)) if mesh.rank == 0 else None
    try:
        if error is None:
            names = sorted(os.listdir(job.tmp))
            hashed = {n: files.file_entry(job.tmp / n) for n in names[mesh.rank::mesh.world_size]}
    except Exception as e:  # noqa: BLE001 - shared below
        error = e
    rows, published = agree(error, mesh, "save the checkpoint", hashed, undo), None
    if mesh.rank == 0:
        try:
            files.write_manifest(job.tmp, job.fields, {k: v for row in rows for k, v in row.items()})
            files.publish(job.tmp, job.final, job.keep)
        except Exception as e:  # noqa: BLE001 - a crash (a BaseException) leaves the directory to the next save
            published = e
            undo()  # type: ignore[misc]
    agree(published, mesh, "save the checkpoint")
    return job.final


def _dcp_error(e: BaseException, mesh: Mesh) -> BaseException:
    """What a failed ``dcp.save`` says; re-raised at once if it is this rank's interruption."""
    mine = (getattr(e, "failures", {}).get(mesh.rank) or (None,))[0]  # (exception, its stack)
    if mine is not None and not isinstance(mine, Exception):
        raise mine from None  # this rank was interrupted (KeyboardInterrupt, SystemExit): not a failed save
    return e


def write(job: Job) -> Path:
    """Steps 2 and 3 of a synchronous save."""
    error = None
    try:
        dcp.save(job.tensors, storage_writer=dcp.FileSystemWriter(job.tmp, single_file_per_rank=True, sync_files=True),
                 planner=BoxSavePlanner(job.boxes))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's (a BaseException) wraps every rank's failure
        error = _dcp_error(e, job.mesh)
    return finish(job, error)


class PendingSave:
    """A checkpoint being written in the background (from :func:`~tensorpar.checkpoint.async_save`);
    :meth:`wait` (a collective) publishes it and returns its path."""

    def __init__(self, job: Job) -> None:
        self._job, self._outcome = job, cast(Path | BaseException | None, None)  # what wait() returns or raises
        self._group = dist.new_group(backend="gloo")  # DCP's collectives run in its thread: not on the training's
        self._future: Future | None = None
        self._error: BaseException | None = None
        try:
            result = dcp.async_save(job.tensors, storage_writer=dcp.FileSystemWriter(job.tmp, single_file_per_rank=True,
                                                                                     sync_files=True),
                                    planner=BoxSavePlanner(job.boxes), process_group=self._group)
            self._future = cast(Future, getattr(result, "upload_completion", result))  # torch >= 2.9 may wrap it
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            self._error = e
        job.tensors = {}

    def done(self) -> bool:
        """Whether this rank's part is written (the checkpoint is published by :meth:`wait`)."""
        return self._future is None or self._future.done()

    def wait(self) -> Path:
        """Finish the save on every rank (a collective) and return the checkpoint's path."""
        if self._outcome is None:
            try:
                if self._future is not None:
                    self._future.result()
            except BaseException as e:  # noqa: BLE001 - shared in finish()
                self._error = e
            try:
                self._outcome = finish(self._job, self._error)
            except BaseException as e:  # noqa: BLE001 - raised below, and by every later wait()
                self._outcome = e
            finally:
                dist.destroy_process_group(self._group)
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome

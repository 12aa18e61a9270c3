"""Saving: *prepare* (a collective: gather and check every rank's tensors, agree on the arguments,
make the temporary directory), *write* (``dcp.save`` or ``dcp.async_save`` with ``FileSystemWriter``),
*finish* (a collective: hash the files, write ``meta.json``, publish, prune)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from ..mesh import Mesh, current_mesh
from . import files
from .contents import grouped_names, model_pieces, optim_pieces, param_groups, rng_streams
from .files import FORMAT, MANIFEST, CheckpointError
from .layout import Box, BoxSavePlanner, whole


def agree(error: BaseException | None, mesh: Mesh, doing: str, value: Any = None,
          undo: Callable[[], None] | None = None) -> list[Any]:
    """Every rank's ``value`` (one ``all_gather_object``), after raising on every rank when any rank
    failed: its own error, or one naming the first rank that failed (``undo`` runs first)."""
    rows: list[Any] = [None] * dist.get_world_size()
    said = error and (str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}")
    dist.all_gather_object(rows, (said and said[:4000], value))
    if (failed := [(r, e) for r, (e, _) in enumerate(rows) if e is not None]) and undo is not None:
        undo()
    if error is not None:
        raise CheckpointError(f"rank {mesh.rank}: {error}") if isinstance(error, CheckpointError) else error
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
    tensors: dict[str, torch.Tensor]
    boxes: dict[str, Box]


def prepare(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, step: int,
            extra: Mapping[str, Any] | None, keep: int, mesh: Mesh) -> Job:
    """Step 1 (a collective): every rank raises the same CheckpointError when any failed or they disagree."""
    error, final, names, fields = None, Path(), None, dict[str, Any]()
    tensors, boxes = dict[str, torch.Tensor](), dict[str, Box]()
    try:
        if type(step) is not int or step < 0 or type(keep) is not int or keep < 1:
            raise CheckpointError(f"step must be an integer >= 0 and keep one >= 1 (got step={step!r}, keep={keep!r})")
        final, tensors, boxes = Path(directory) / f"step-{step:06d}", *model_pieces(model)
        if optimizer is not None:
            names, (more, more_boxes) = grouped_names(model, optimizer), optim_pieces(model, optimizer)
            tensors, boxes = tensors | more, boxes | more_boxes
        try:
            fields = json.loads(json.dumps({
                "format": FORMAT, "step": step, "tp": mesh.tp, "dp": mesh.dp, "pp": mesh.pp,
                "config": config_dict(model), "extra": dict(extra or {}),
                "param_groups": param_groups(optimizer, [names or []]) if optimizer else []}))
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"extra or the optimizer's hyper-parameters cannot be stored in JSON: {e}") from None
        if bad := [n for n, v in tensors.items() if v.is_floating_point() and not bool(v.isfinite().all())]:
            raise CheckpointError(f"the checkpoint of step {step} would hold NaN or infinite values (in "
                                  f"{', '.join(bad[:4])}{f' and {len(bad) - 4} more' * (len(bad) > 4)}): not saved, "
                                  "and the checkpoints already in the directory are left as they are")
        states = rng_streams(mesh)
        tensors, boxes = tensors | states, boxes | {k: whole(v) for k, v in states.items()}
        if mesh.rank == 0:
            files.recover(final.parent)
            final.parent.mkdir(parents=True, exist_ok=True)
            files.scratch(final).mkdir()
    except Exception as e:  # noqa: BLE001 - every rank learns of it below, then every rank raises
        error = e
    undo = (lambda: files.discard(files.scratch(final))) if mesh.rank == 0 else None
    arguments = {"step": step, "keep": keep, "extra": fields.get("extra")}
    rows = agree(error, mesh, "save the checkpoint", (arguments, names, os.getpid()), undo)
    if differ := "; ".join(f"{key}: " + ", ".join(f"{row[0][key]!r} on rank {r}" for r, row in enumerate(rows))
                           for key in arguments if any(row[0][key] != arguments[key] for row in rows)):
        if undo is not None:
            undo()
        raise CheckpointError(f"the ranks must save with the same arguments, and they differ ({differ[:2000]})")
    if optimizer is not None:  # every rank's parameters: pipeline stages hold different ones
        fields["param_groups"] = json.loads(json.dumps(param_groups(optimizer, [row[1] for row in rows])))
    return Job(final, files.scratch(final, rows[0][2]), fields, keep, mesh, tensors, boxes)


def finish(job: Job, error: BaseException | None) -> Path:
    """Step 3 (a collective), after every rank's write (or its ``error``): hash, publish, prune."""
    mesh, hashed, published = job.mesh, {}, None
    undo = (lambda: files.discard(job.tmp)) if mesh.rank == 0 else None
    try:
        if error is None:
            hashed = {n: files.file_entry(job.tmp / n) for n in sorted(os.listdir(job.tmp))[mesh.rank::mesh.world_size]}
    except Exception as e:  # noqa: BLE001 - shared below
        error = e
    rows = agree(error, mesh, "save the checkpoint", hashed, undo)
    if undo is not None:
        try:
            body = job.fields | {"files": {k: v for row in rows for k, v in row.items()}}
            text = json.dumps(body | {"meta_sha256": files.canonical_sha256(body)}, indent=1)
            files.write_text(job.tmp / MANIFEST, text)
            files.publish(job.tmp, job.final, job.keep)
        except Exception as e:  # noqa: BLE001 - a crash (a BaseException) leaves the directory to the next save
            published = e
            undo()
    agree(published, mesh, "save the checkpoint")
    return job.final


def _writer(job: Job) -> dict[str, Any]:
    return {"storage_writer": dcp.FileSystemWriter(job.tmp, single_file_per_rank=True, sync_files=True),
            "planner": BoxSavePlanner(job.boxes)}


class PendingSave:
    """A checkpoint being written in the background (from :func:`~tensorpar.checkpoint.async_save`);
    :meth:`wait` (a collective) publishes it and returns its path (or raises, each time it is called)."""

    _future: Future | None = None
    _error: BaseException | None = None
    _path: Path | None = None

    def __init__(self, job: Job) -> None:
        self._job = job
        self._group: dist.ProcessGroup | None = dist.new_group(backend="gloo")  # DCP's collectives run in a thread
        try:
            result = dcp.async_save(job.tensors, process_group=self._group, **_writer(job))
            self._future = cast(Future, getattr(result, "upload_completion", result))  # torch >= 2.9 may wrap it
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            self._error = e
        job.tensors = {}

    def done(self) -> bool:
        """Whether this rank's part is written (the checkpoint is published by :meth:`wait`)."""
        return self._future is None or self._future.done()

    def wait(self) -> Path:
        """Finish the save on every rank (a collective) and return the checkpoint's path."""
        if self._group is not None:
            try:
                self._path = finish(self._job, (self._future and self._future.exception()) or self._error)
            except BaseException as e:  # noqa: BLE001 - raised below, and by every later wait()
                self._error = e
            finally:
                dist.destroy_process_group(self._group)
                self._group = None
        if self._path is None:
            raise cast(BaseException, self._error)
        return self._path


def save(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         step: int, extra: Mapping[str, Any] | None = None, keep: int = 2, mesh: Mesh | None = None) -> Path:
    """Write ``directory/step-NNNNNN`` (a collective) and return its path; keep the newest ``keep``.

    Each rank writes its chunks of the model, the optimizer's state (``ZeroRedundancyOptimizer``'s
    too) and its generator states; ``extra`` (JSON) goes to ``meta.json``. A NaN or an infinity on
    any rank, or ranks passing different ``step``, ``keep`` or ``extra``, raise the same
    :class:`CheckpointError` on every rank, and nothing on disk changes.
    """
    job = prepare(directory, model, optimizer, step=step, extra=extra, keep=keep, mesh=mesh or current_mesh())
    error = None
    try:
        dcp.save(job.tensors, **_writer(job))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's (a BaseException) wraps every rank's failure
        mine = (getattr(e, "failures", {}).get(job.mesh.rank) or (None,))[0]  # (exception, its stack)
        if mine is not None and not isinstance(mine, Exception):
            raise mine from None  # this rank was interrupted (KeyboardInterrupt, SystemExit): not a failed save
        error = e
    return finish(job, error)


def async_save(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
               step: int, extra: Mapping[str, Any] | None = None, keep: int = 2,
               mesh: Mesh | None = None) -> PendingSave:
    """:func:`save` through ``dcp.async_save``: the tensors are staged to CPU memory and written in a
    thread; ``PendingSave.wait()`` (a collective) publishes the checkpoint and moves ``latest``."""
    return PendingSave(prepare(directory, model, optimizer, step=step, extra=extra, keep=keep,
                               mesh=mesh or current_mesh()))

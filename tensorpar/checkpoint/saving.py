"""Saving, by DCP's names: ``model.<key>``; ``optim.state.<parameter>.<field>`` (lying like its parameter, the
groups in ``meta.json``); ``rng.rank<r>.<stream>`` (``cpu``, ``cuda``, the tp streams ``tp.<device>``, ``tp.base``)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from ..full import placements
from ..mesh import Mesh, current_mesh
from ..random import tracker as tp_streams
from . import files
from .files import FORMAT, CheckpointError
from .layout import Box, BoxSavePlanner, locate

MODEL, OPTIM = "model.", "optim.state."


def agree(error: BaseException | None, mesh: Mesh, doing: str, value: Any = None) -> list[Any]:
    """Every rank's ``value`` (one ``all_gather_object``), after raising on every rank when any rank failed:
    its own error, or one naming the first rank that failed."""
    rows: list[Any] = [None] * dist.get_world_size()
    said = error and (str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}")
    dist.all_gather_object(rows, (said and said[:4000], value))
    failed = [(r, e) for r, (e, _) in enumerate(rows) if e is not None]
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


def grouped_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The names of the parameters of each of the optimizer's groups."""
    names = {id(p): name for name, p in model.named_parameters()}
    if any(id(p) not in names for group in optimizer.param_groups for p in group["params"]):
        raise CheckpointError("the optimizer holds a tensor that is not a parameter of the model")
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, mesh: Mesh
                ) -> tuple[dict[str, torch.Tensor], dict[str, Box]]:
    """``(tensors, boxes)`` of this rank's model, optimizer state and generator states (whole: no box), by name."""
    where, tensors, boxes = placements(model), {}, {}
    for key, value in model.state_dict().items():
        tensors[MODEL + key], boxes[MODEL + key] = locate(value.detach(), *where.get(key, (None, None)))
    names = {id(p): n for n, p in model.named_parameters()}
    for param, fields in getattr(optimizer, "optim", optimizer).state.items() if optimizer else ():  # ZeRO's: local
        for field, value in ((f, torch.as_tensor(v).detach()) for f, v in fields.items() if v is not None):
            key = f"{OPTIM}{names[id(param)]}.{field}"  # a None: SGD without momentum, nothing to store
            if value.dim() and tuple(value.shape) != tuple(param.shape):
                raise CheckpointError(f"{key} has shape {tuple(value.shape)}, its parameter {tuple(param.shape)}: "
                                      "only states shaped like their parameter, and scalars, are checkpointed")
            tensors[key], boxes[key] = locate(value, *where.get(names[id(param)], (None, None)) if value.dim()
                                              else (None, None))
    tracker, states = tp_streams(mesh).state_dict(), {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    states |= {f"tp.{device}": state for device, state in tracker["states"].items()}
    if tracker["base"] is not None:
        states["tp.base"] = torch.tensor([tracker["base"]], dtype=torch.int64)
    return tensors | {f"rng.rank{mesh.rank}.{stream}": state for stream, state in states.items()}, boxes


class PendingSave:
    """A checkpoint being written: prepared (a collective: checked, agreed, its directory made), written by
    ``dcp.save`` or ``dcp.async_save``; :meth:`wait` (a collective) publishes it and returns its path (or raises)."""

    _future: Future | None = None
    _error: BaseException | None = None
    _group: dist.ProcessGroup | None = None
    _pending = True

    def __init__(self, directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, *,
                 step: int, extra: Mapping[str, Any] | None, keep: int, mesh: Mesh, background: bool) -> None:
        error, final, names, fields = None, Path(), list[list[str]](), dict[str, Any]()
        tensors, boxes, made = dict[str, torch.Tensor](), dict[str, Box](), None
        try:  # every rank raises the same CheckpointError below when any failed or they disagree
            if type(step) is not int or step < 0 or type(keep) is not int or keep < 1:
                raise CheckpointError(f"step must be an integer >= 0 and keep one >= 1 (got step={step!r}, "
                                      f"keep={keep!r})")
            final, names = Path(directory) / f"step-{step:06d}", grouped_names(model, optimizer) if optimizer else []
            groups = [g | {"params": []} for g in optimizer.param_groups] if optimizer else []
            fields = json.loads(json.dumps({"format": FORMAT, "step": step, "tp": mesh.tp, "dp": mesh.dp, "pp": mesh.pp,
                                            "config": config_dict(model), "extra": dict(extra or {}),
                                            "param_groups": groups}))  # a TypeError names what JSON cannot hold
            tensors, boxes = local_state(model, optimizer, mesh)
            if bad := [n for n, v in tensors.items() if v.is_floating_point() and not bool(v.isfinite().all())]:
                raise CheckpointError(f"the checkpoint of step {step} would hold NaN or infinite values (in "
                                      f"{', '.join(bad[:4])}{f' and {len(bad) - 4} more' * (len(bad) > 4)}): not "
                                      "saved, and the checkpoints already in the directory are left as they are")
            if mesh.rank == 0:
                files.recover(final.parent)
                (made := files.scratch(final)).mkdir(parents=True)
        except Exception as e:  # noqa: BLE001 - every rank learns of it below, then every rank raises
            error = e
        arguments = {"step": step, "keep": keep, "extra": fields.get("extra"), "optimizer groups": len(names)}
        try:
            rows = agree(error, mesh, "save the checkpoint", (arguments, names, os.getpid()))
            if differ := "; ".join(f"{k}: " + ", ".join(f"{row[0][k]!r} on rank {r}" for r, row in enumerate(rows))
                                   for k in arguments if any(row[0][k] != arguments[k] for row in rows)):
                raise CheckpointError(f"the ranks must save with the same arguments, and they differ ({differ[:2000]})")
        except BaseException:
            if made is not None:  # this save's only: another of this process may be under way
                files.discard(made)
            raise
        for i, group in enumerate(fields["param_groups"]):  # every rank's parameters: pipeline stages differ
            group["params"] = list(dict.fromkeys(n for row in rows for n in row[1][i]))
        self._final, self._fields, self._keep, self._mesh = final, fields, keep, mesh
        self._tmp = files.scratch(final, rows[0][2])
        writer: dict[str, Any] = {"planner": BoxSavePlanner(boxes), "storage_writer": dcp.FileSystemWriter(self._tmp)}
        try:
            if background:
                self._group = dist.new_group(backend="gloo")  # DCP's collectives run in a thread
                result = dcp.async_save(tensors, process_group=self._group, **writer)
                self._future = cast(Future, getattr(result, "upload_completion", result))  # torch >= 2.9 wraps it
            else:
                dcp.save(tensors, **writer)
        except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - DCP's (a BaseException) wraps each rank's
            mine = (getattr(e, "failures", {}).get(mesh.rank) or (None,))[0]  # (exception, its stack)
            if mine is not None and not isinstance(mine, Exception):
                raise mine from None  # this rank was interrupted (KeyboardInterrupt, SystemExit): not a failed save
            self._error = e

    def done(self) -> bool:
        """Whether this rank's part is written (the checkpoint is published by :meth:`wait`)."""
        return self._future is None or self._future.done()

    def wait(self) -> Path:
        """Finish the save on every rank (a collective) and return the checkpoint's path."""
        if self._pending:
            self._pending, error = False, (self._future and self._future.exception()) or self._error
            try:
                if self._mesh.rank == 0:  # DCP's collectives gave every rank each rank's write error
                    try:
                        if error is None:
                            files.publish(self._tmp, self._final, self._keep, self._fields)
                    except Exception as e:  # noqa: BLE001 - a crash (a BaseException) leaves it to the next save
                        error = e
                    if error is not None:
                        files.discard(self._tmp)
                agree(error, self._mesh, "save the checkpoint")
            except BaseException as e:  # noqa: BLE001 - raised below, and by every later wait()
                self._error = e
            finally:
                if self._group is not None:
                    dist.destroy_process_group(self._group)
        if self._error is not None:
            raise self._error
        return self._final


def save(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         step: int, extra: Mapping[str, Any] | None = None, keep: int = 2, mesh: Mesh | None = None) -> Path:
    """Write ``directory/step-NNNNNN`` (a collective; ``extra``, JSON, goes to ``meta.json``), keep the newest ``keep``,
    return its path. A NaN or an infinity on any rank, or ranks passing different ``step``, ``keep`` or ``extra``,
    raise the same :class:`CheckpointError` on every rank, and nothing on disk changes."""
    return PendingSave(directory, model, optimizer, step=step, extra=extra, keep=keep, mesh=mesh or current_mesh(),
                       background=False).wait()


def async_save(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
               step: int, extra: Mapping[str, Any] | None = None, keep: int = 2,
               mesh: Mesh | None = None) -> PendingSave:
    """:func:`save` through ``dcp.async_save`` (staged to CPU memory, written in a thread); ``wait()`` publishes."""
    return PendingSave(directory, model, optimizer, step=step, extra=extra, keep=keep, mesh=mesh or current_mesh(),
                       background=True)

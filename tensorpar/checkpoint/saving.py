"""Saving: *prepare* (a collective: gather and check every rank's tensors, agree on the arguments,
make the temporary directory), *write* (``dcp.save`` or ``dcp.async_save`` with ``FileSystemWriter``),
*finish* (a collective: hash the files, write ``meta.json``, publish, prune)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
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

_SHOWN = 4  # the names of non-finite tensors an error lists


def everyone(value: Any) -> list[Any]:
    """Every rank's JSON ``value``, in rank order: JSON bytes over one all-gather (nothing pickled)."""
    data, world = json.dumps(value).encode(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    sizes = torch.zeros(world, dtype=torch.int64, device=device)
    sizes[dist.get_rank()] = len(data)
    dist.all_reduce(sizes)
    send = torch.zeros(int(sizes.max()), dtype=torch.uint8)
    send[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = [torch.empty_like(send, device=device) for _ in range(world)]
    dist.all_gather(rows, send.to(device))
    return [json.loads(bytes(row[:n].tolist())) for row, n in zip(rows, sizes.tolist(), strict=True)]


def described(error: BaseException | None) -> str | None:
    if error is None:
        return None
    return (str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}")[:4000]


def settle(errors: list[str | None], error: BaseException | None, mesh: Mesh, doing: str) -> None:
    """Raise on every rank when any rank failed: its own error, or one naming the first that failed."""
    if error is not None:
        if isinstance(error, CheckpointError):
            raise CheckpointError(f"rank {mesh.rank}: {error}") from error
        raise error
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        raise CheckpointError(f"rank {failed[0][0]}: {failed[0][1]} (so rank {mesh.rank} did not {doing} either)")


def config_dict(model: nn.Module) -> dict[str, Any] | None:
    """The model's ``config`` dataclass as JSON, without fields whose metadata says ``{"state": False}``."""
    config = getattr(model, "config", None)
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        return None
    kept = {f.name for f in dataclasses.fields(config) if f.metadata.get("state", True)}
    return json.loads(json.dumps({k: v for k, v in dataclasses.asdict(config).items() if k in kept}))


def nonfinite(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of the floating-point ``tensors`` holding a NaN or an infinity (one read per device)."""
    by_device: dict[torch.device, list[str]] = {}
    for name, value in tensors.items():
        if value.is_floating_point() and value.numel():
            by_device.setdefault(value.device, []).append(name)
    bad = set()
    for names in by_device.values():
        peaks = torch._foreach_norm([tensors[n] for n in names], float("inf"))  # max |x| of each
        bad |= {n for n, ok in zip(names, torch.stack([torch.isfinite(p) for p in peaks]).tolist(), strict=True)
                if not ok}
    return [name for name in tensors if name in bad]


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
    error: Exception | None = None
    tmp, final, names, fields = None, Path(), None, dict[str, Any]()
    tensors, boxes, mine = dict[str, torch.Tensor](), dict[str, Box](), dict[str, torch.Tensor]()
    try:
        if type(step) is not int or step < 0 or type(keep) is not int or keep < 1:
            raise CheckpointError(f"step must be an integer >= 0 and keep one >= 1 (got step={step!r}, keep={keep!r})")
        final = Path(directory) / f"step-{step:06d}"
        try:
            extra = json.loads(json.dumps(dict(extra or {})))
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"extra is not JSON-serialisable: {e}") from None
        fields = {"format": FORMAT, "step": step, "tp": mesh.tp, "dp": mesh.dp, "pp": mesh.pp,
                  "config": config_dict(model), "param_groups": [], "extra": extra}
        tensors, boxes = model_pieces(model)
        if optimizer is not None:
            names = grouped_names(model, optimizer)
            param_groups(optimizer, [names])  # each rank checks its hyper-parameters
            more, more_boxes = optim_pieces(model, optimizer)
            tensors, boxes = tensors | more, boxes | more_boxes
        if bad := nonfinite(tensors):
            shown = ", ".join(bad[:_SHOWN]) + (f" and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else "")
            raise CheckpointError(f"the checkpoint of step {step} would hold NaN or infinite values (in {shown}): "
                                  "not saved, and the checkpoints already in the directory are left as they are")
        mine = generators.streams(mesh)
        if mesh.rank == 0:
            for pending in files.unfinished(final.parent):
                raise CheckpointError(f"{pending} is a save of this process still being written: call the wait() "
                                      "of its async_save before saving again into the same directory")
            files.recover(final.parent)
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = files.scratch(final.parent, final.name)
            tmp.mkdir()
    except Exception as e:  # noqa: BLE001 - every rank learns of it below, then every rank raises
        error = e
    arguments = {"step": step, "keep": keep, "extra's SHA-256": files.canonical_sha256(fields.get("extra"))[:16]}
    rows = everyone({"error": described(error), "tmp": tmp and tmp.name, "names": names,
                     "rng": generators.digests(mine), **arguments})
    differ = []
    for key in arguments:
        ranks: dict[str, list[str]] = {}
        for r, row in enumerate(rows):
            ranks.setdefault(json.dumps(row[key]), []).append(str(r))
        if len(ranks) > 1:
            differ.append(f"{key}: " + ", ".join(f"{v} on rank{'s' * (len(rs) > 1)} {', '.join(rs)}"
                                                 for v, rs in ranks.items()))
    if (differ or any(row["error"] for row in rows)) and tmp is not None:
        files.remove(tmp)
    settle([row["error"] for row in rows], error, mesh, "save the checkpoint")
    if differ:
        raise CheckpointError(f"the ranks must save with the same arguments, and they differ "
                              f"({'; '.join(differ)})")
    if optimizer is not None:
        fields["param_groups"] = param_groups(optimizer, [row["names"] for row in rows])
    states = generators.named(mine, [row["rng"] for row in rows], mesh.rank)
    return Job(final, final.parent / rows[0]["tmp"], fields, keep, mesh, tensors | states,
               boxes | {k: whole(v) for k, v in states.items()})


def _writer(job: Job) -> dcp.FileSystemWriter:
    return dcp.FileSystemWriter(job.tmp, single_file_per_rank=True, sync_files=True)


def finish(job: Job, error: BaseException | None) -> Path:
    """Step 3 (a collective), after every rank's write (or its ``error``)."""
    mesh, hashed, outcome = job.mesh, {}, None
    try:
        if error is None:
            names = sorted(os.listdir(job.tmp))
            hashed = {n: files.file_entry(job.tmp / n) for n in names[mesh.rank::mesh.world_size]}
    except Exception as e:  # noqa: BLE001 - shared below
        error = e
    rows = everyone({"error": described(error), "files": hashed})
    errors = [row["error"] for row in rows]
    if mesh.rank == 0:
        try:
            if all(e is None for e in errors):
                files.write_manifest(job.tmp, job.fields, {k: v for row in rows for k, v in row["files"].items()})
                files.publish(job.tmp, job.final)
                files.prune(job.final.parent, job.keep, job.final.name)
        except Exception as e:  # noqa: BLE001 - a crash (a BaseException) leaves the directory to the next recover()
            outcome = f"rank 0: {described(e)}"
        if os.path.lexists(job.tmp):
            files.remove(job.tmp)
    settle(errors, error, mesh, "save the checkpoint")  # every rank alike: none publishes
    if (result := everyone(outcome)[0]) is not None:
        raise CheckpointError(f"{result} (so rank {mesh.rank} did not save the checkpoint either)")
    return job.final


def write(job: Job) -> Path:
    """Steps 2 and 3 of a synchronous save."""
    error = None
    try:
        dcp.save(job.tensors, storage_writer=_writer(job), planner=BoxSavePlanner(job.boxes))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's (a BaseException) wraps every rank's failure
        mine = (getattr(e, "failures", {}).get(job.mesh.rank) or (None,))[0]  # (exception, its stack)
        if mine is not None and not isinstance(mine, Exception):
            raise mine from None  # this rank was interrupted (KeyboardInterrupt, SystemExit): not a failed save
        error = e
    return finish(job, error)


class PendingSave:
    _outcome: Path | BaseException | None
    """A checkpoint being written in the background (from :func:`~tensorpar.checkpoint.async_save`);
    :meth:`wait` (a collective) publishes it and returns its path."""

    def __init__(self, job: Job) -> None:
        self._job, self._outcome = job, None  # the outcome: the path, or what wait() raises
        self._group = dist.new_group(backend="gloo")  # DCP's collectives run in its thread: not on the training's
        self._future: Future | None = None
        self._error: BaseException | None = None
        try:
            result = dcp.async_save(job.tensors, storage_writer=_writer(job), planner=BoxSavePlanner(job.boxes),
                                    process_group=self._group)
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

"""Checkpoints that load at any (tp, dp): unsharded safetensors files and a hashed manifest,
published so that a crash at any moment loses nothing.

A checkpoint is a directory ``step-NNNNNN`` holding

* ``model.safetensors``: the *unsharded* state dict, each tensor in its own dtype
  (the keys of the plain model, so :func:`export_state_dict` loads into it directly);
* ``optimizer.safetensors``: each parameter's optimizer state, unsharded the same
  way (``"<param>/exp_avg"``...), gathered across tp and, for
  ``ZeroRedundancyOptimizer``, across dp;
* ``rng.safetensors``: every rank's generator states;
* ``meta.json``: step, tp, dp, model config, optimizer hyper-parameters, the
  caller's ``extra``, the size and SHA-256 of each file above, and a SHA-256 of
  itself (:mod:`.manifest`).

Only global rank 0 writes, into a temporary directory that is renamed into place
when complete; then the ``latest`` file is replaced atomically. An existing copy
of the same step is moved aside first and deleted last, and the next save cleans
up after writers that crashed (:mod:`.publish`). Nothing travels between ranks
or from disk through pickle.

Loading reads JSON and safetensors only. It checks the manifest's own hash, the
type of every field it uses, every file's size and hash, and then reads and
checks every tensor this rank needs (names, full shapes, dtypes, generator
states) *before* it modifies the model, the optimizer or any generator: a
refused checkpoint changes nothing, and every refusal is a
:class:`CheckpointError` naming the file and the field. Each rank reads only its
own slices, so a checkpoint saved at one (tp, dp) loads at any other.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..full import full_state_dict, placements
from ..mesh import Mesh, current_mesh
from . import optim, publish, rng
from .manifest import MANIFEST, CheckpointError, read_manifest, verify_files, write_manifest
from .meta import (FILES, FORMAT, MODEL, NAME, OPTIMIZER, RNG, as_json, check_config, check_fields, config_dict,
                   dirname, step_of, whole)
from .state import read_model
from .tensors import Reader, write_file

__all__ = ["FORMAT", "CheckpointError", "export_state_dict", "load", "read_meta", "resolve", "save"]


def save(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         step: int, extra: Mapping[str, Any] | None = None, keep: int = 2, mesh: Mesh | None = None) -> Path:
    """Write ``directory/step-NNNNNN`` (a collective: every rank calls it) and return its path.

    ``extra`` is stored in ``meta.json`` (JSON-serialisable: e.g. the data
    position and the run's arguments). The newest ``keep`` checkpoints stay.
    Saving a step that exists replaces it; until the new copy is in place, the
    old one stays reachable through ``latest``.

    Example::

        tensorpar.checkpoint.save("out", model, optimizer, step=step, extra={"tokens": tokens})
    """
    mesh = mesh or current_mesh()
    if not whole(step, 0) or not whole(keep, 1):  # checked on every rank, before any collective
        raise CheckpointError(f"step must be an integer >= 0 and keep one >= 1 (got step={step!r}, keep={keep!r})")
    fields = {"format": FORMAT, "step": step, "tp": mesh.tp, "dp": mesh.dp, "config": config_dict(model),
              "param_groups": [], "extra": as_json(dict(extra or {}), "extra")}
    if optimizer is not None:
        hyper = optim.hyperparameters(optimizer)
        names = optim.grouped_names(model, optimizer)
        fields["param_groups"] = [h | {"params": n} for h, n in zip(hyper, names)]
    gathers = mesh.dp_rank == 0  # one tp group gathers the shards; dp replicas hold the same
    model_state = full_state_dict(model) if gathers else {}
    optim_state = optim.collect(model, optimizer, mesh, gathers) if optimizer is not None else {}
    rng_states = rng.collect(mesh)
    final = Path(directory) / dirname(step)
    failed: Exception | None = None
    if mesh.rank == 0:
        try:
            _write(final, fields, {MODEL: model_state, OPTIMIZER: optim_state, RNG: rng_states or {}}, keep)
        except Exception as e:  # the other ranks learn of it below, then every rank raises
            failed = e
    status = torch.tensor([failed is not None], dtype=torch.int32, device=mesh.device)
    dist.broadcast(status, src=0)  # the checkpoint is complete on disk when save returns on any rank
    if failed is not None:
        raise failed
    if status.item():
        raise CheckpointError(f"rank 0 could not write {final} (its error is raised there)")
    return final


def _write(final: Path, fields: Mapping[str, Any], files: Mapping[str, Mapping[str, torch.Tensor]],
           keep: int) -> None:
    """Write the checkpoint's files into a temporary directory, publish it as ``final``, prune."""
    parent = final.parent
    publish.recover(parent, NAME)
    tmp = publish.temporary(parent, final.name)
    try:
        for name in FILES:
            write_file(tmp / name, files[name])
        write_manifest(tmp, fields, FILES)
        publish.publish(tmp, final)
    except Exception:  # a crash (or a BaseException) leaves the directory to the next save's recover()
        if os.path.lexists(tmp):
            publish.remove(tmp)
        raise
    publish.prune(parent, NAME, step_of, keep, final.name)


def resolve(path: str | Path) -> Path:
    """The checkpoint directory ``path`` names: the one its ``latest`` file points to, or itself."""
    path = Path(path)
    target = publish.resolve_latest(path, NAME) or path
    if not (target / MANIFEST).exists():
        raise CheckpointError(f"no checkpoint at {path} (no meta.json, and no 'latest' pointer)")
    return target


def read_meta(path: str | Path) -> dict[str, Any]:
    """The checkpoint's metadata (with ``"path"``: its directory), after checking the manifest's own
    hash, the type of each field, and every file against its recorded size and SHA-256."""
    directory = resolve(path)
    meta = read_manifest(directory, FORMAT)
    check_fields(meta, directory / MANIFEST)
    verify_files(directory, meta, FILES)
    return meta | {"path": str(directory)}


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         restore_rng: bool = True, cast: bool = False, mesh: Mesh | None = None) -> dict[str, Any]:
    """Load a checkpoint saved at any (tp, dp) into ``model`` (and ``optimizer``); return its metadata.

    Every rank reads only its own slices. Generator states are restored when the
    checkpoint was saved at the same (tp, dp) and ``restore_rng`` is set. A tensor
    stored in a dtype other than the model's (or than the optimizer keeps) is
    refused unless ``cast=True``, which converts it to the model's dtype. Raises
    :class:`CheckpointError` for a missing, corrupt, edited or mismatched
    checkpoint, and then nothing (model, optimizer, generators, files) is modified.

    Example::

        meta = tensorpar.checkpoint.load("out", model, optimizer)   # the newest one
        start = meta["step"] + 1
        tensorpar.checkpoint.load("bf16-run", fp32_model, cast=True)  # converts bf16 to float32
    """
    mesh = mesh or current_mesh()
    meta = read_meta(path)
    check_config(meta, model)
    directory, where = Path(meta["path"]), placements(model)
    with Reader(directory / MODEL) as f:
        local = read_model(f, model, where, cast=cast)
    state = None
    if optimizer is not None:
        with Reader(directory / OPTIMIZER) as f:
            state = optim.read_state(f, meta, directory / MANIFEST, model, optimizer, where, cast=cast)
    states = None
    if restore_rng and (meta["tp"], meta["dp"]) == (mesh.tp, mesh.dp):
        with Reader(directory / RNG) as f:
            states = rng.read(f, meta["tp"] * meta["dp"], mesh.rank)
    # everything is read and checked: only now is anything modified
    model.load_state_dict(local)
    if state is not None:
        optimizer.load_state_dict(state)  # type: ignore[union-attr]
    if states is not None:
        rng.restore(states, mesh)
    return meta


def export_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The checkpoint's unsharded model state dict, for the plain (unsharded) model; no process group needed.

    Example::

        plain.load_state_dict(tensorpar.checkpoint.export_state_dict("out"), strict=False)
    """
    meta = read_meta(path)
    with Reader(Path(meta["path"]) / MODEL) as f:
        return {key: f.read(key) for key in f.keys()}

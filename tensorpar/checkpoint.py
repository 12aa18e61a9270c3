"""Checkpoints that load at any (tp, dp): unsharded safetensors + JSON, written atomically.

A checkpoint is a directory ``step-NNNNNN`` holding

* ``model.safetensors``: the *unsharded* state dict (the keys of the plain
  model, so :func:`export_state_dict` loads into it directly);
* ``optimizer.safetensors``: each parameter's optimizer state, unsharded the
  same way (``"<param>/exp_avg"``, ...), gathered across tp and, for
  ``ZeroRedundancyOptimizer``, across dp;
* ``rng.safetensors``: every rank's generator states (byte tensors);
* ``meta.json``: step, tp, dp, model config, optimizer hyper-parameters, the
  data position, anything the caller adds, and each file's SHA-256.

Only global rank 0 writes, into a temporary directory that is renamed into
place when complete; then a ``latest`` file is replaced atomically. A crash
at any point leaves the previous checkpoint and ``latest`` intact. Loading
reads JSON and safetensors only (nothing is unpickled), checks every file's
hash and the model config, and reads just this rank's slice of each tensor,
so a checkpoint saved at one (tp, dp) loads at any other.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .full import Placements, full_shape, full_state_dict, placements, unshard
from .mesh import Mesh, current_mesh
from .sharding import Shard

FORMAT = "tensorpar-checkpoint/1"
FILES = ("model.safetensors", "optimizer.safetensors", "rng.safetensors")


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not fit the model it is loaded into."""


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as e:  # pragma: no cover - the train extra installs it
        raise ImportError("checkpoints need safetensors: pip install 'tensorpar[train]'") from e
    return safetensors


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _config_dict(model: nn.Module) -> dict[str, Any] | None:
    config = getattr(model, "config", None)
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else None


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh,
                     gather: bool) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Every parameter's optimizer state, unsharded (on the ranks that ``gather``), and the groups."""
    if hasattr(optimizer, "consolidate_state_dict"):  # ZeroRedundancyOptimizer: collect across dp first
        optimizer.consolidate_state_dict(to=0)
    if not gather:
        return {}, []
    state = optimizer.state_dict()
    names, where = _param_names(model), placements(model)
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    tensors = {}
    for index, name in enumerate(order):
        for key, value in state["state"].get(index, {}).items():
            value = torch.as_tensor(value)
            if name in where and value.dim() > 0:  # shaped like the shard: gather like it
                value = unshard(value.to(mesh.device), *where[name])
            tensors[f"{name}/{key}"] = value.detach().cpu().contiguous()
    groups, start = [], 0
    for group in state["param_groups"]:
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append(hyper | {"params": order[start:start + len(group["params"])]})
        start += len(group["params"])
    return tensors, groups


def _rng_states(mesh: Mesh) -> dict[str, torch.Tensor]:
    mine = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        mine["cuda"] = torch.cuda.get_rng_state()
    tracker = mesh.rng.state_dict()
    mine |= {f"tp/{device}": state for device, state in tracker["states"].items()}  # type: ignore[union-attr]
    if tracker["base"] is not None:
        mine["tp/base"] = torch.tensor([tracker["base"]], dtype=torch.int64)
    everyone: list[Any] = [None] * mesh.world_size
    dist.all_gather_object(everyone, mine)
    return {f"rank{r}/{k}": v for r, states in enumerate(everyone) for k, v in states.items()}


def save(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         step: int, extra: Mapping[str, Any] | None = None, keep: int = 2, mesh: Mesh | None = None) -> Path:
    """Write ``directory/step-NNNNNN`` (a collective: every rank calls it) and return its path.

    ``extra`` is stored in ``meta.json`` (JSON-serialisable: e.g. the data
    position and the run's arguments). The newest ``keep`` checkpoints stay.

    Example::

        tensorpar.checkpoint.save("out", model, optimizer, step=step, extra={"tokens": tokens})
    """
    mesh = mesh or current_mesh()
    extra = json.loads(json.dumps(dict(extra or {})))  # not JSON-serialisable: fails on every rank, before any collective
    writer = mesh.rank == 0
    gathers = mesh.dp_rank == 0  # one tp group gathers the shards; dp replicas hold the same
    model_state = full_state_dict(model) if gathers else {}
    optim_state, groups = _optimizer_state(model, optimizer, mesh, gathers) if optimizer else ({}, [])
    rng = _rng_states(mesh)
    final = Path(directory) / f"step-{step:06d}"
    if writer:
        st = _safetensors().torch
        tmp = Path(directory) / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        st.save_file({k: v.detach().cpu().contiguous() for k, v in model_state.items()}, str(tmp / FILES[0]))
        st.save_file(optim_state, str(tmp / FILES[1]))
        st.save_file(rng, str(tmp / FILES[2]))
        meta = {"format": FORMAT, "step": step, "tp": mesh.tp, "dp": mesh.dp, "config": _config_dict(model),
                "param_groups": groups, "extra": extra,
                "sha256": {name: _sha256(tmp / name) for name in FILES}}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        for name in (*FILES, "meta.json"):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        pointer = Path(directory) / ".latest.tmp"
        pointer.write_text(final.name + "\n")
        os.replace(pointer, Path(directory) / "latest")
        older = sorted((p for p in Path(directory).glob("step-*") if p != final and p.name[5:].isdigit()),
                       key=lambda p: int(p.name[5:]))
        for old in older[:max(0, len(older) - (keep - 1))]:  # the newest keep - 1 others stay
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()  # the checkpoint is complete on disk when save returns on any rank
    return final


def resolve(path: str | Path) -> Path:
    """The checkpoint directory ``path`` names: itself, or the one its ``latest`` file points to."""
    path = Path(path)
    if (path / "latest").is_file():
        path = path / (path / "latest").read_text().strip()
    if not (path / "meta.json").is_file():
        raise CheckpointError(f"no checkpoint at {path} (no meta.json, and no 'latest' pointer)")
    return path


def read_meta(path: str | Path) -> dict[str, Any]:
    """The checkpoint's metadata, after checking every file against its recorded SHA-256."""
    path = resolve(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / 'meta.json'} is not valid JSON: {e}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} checkpoint (format {meta.get('format')!r})")
    for name, digest in meta["sha256"].items():
        if not (path / name).is_file():
            raise CheckpointError(f"{path / name} is missing")
        if _sha256(path / name) != digest:
            raise CheckpointError(f"{path / name} is corrupt or truncated (SHA-256 does not match meta.json)")
    return meta | {"path": str(path)}


def _check_config(meta: Mapping[str, Any], model: nn.Module) -> None:
    ours, theirs = _config_dict(model), meta.get("config")
    if ours is not None and theirs is not None and ours != theirs:
        diff = ", ".join(f"{k}: checkpoint {theirs.get(k)!r}, model {ours.get(k)!r}"
                         for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k))
        raise CheckpointError(f"the checkpoint's model config does not match the model's ({diff})")


def _read_local(handle: Any, key: str, placement: Shard | None, group: Any, expected: torch.Size) -> torch.Tensor:
    """This rank's part of tensor ``key``: a slice along the placement's dim, or all of it."""
    view = handle.get_slice(key)
    full, want = tuple(view.get_shape()), full_shape(expected, placement)
    if full != want:
        raise CheckpointError(f"{key}: the checkpoint holds shape {full}, the model's full shape is {want}")
    if placement is None:
        return handle.get_tensor(key)
    return view[placement.index(len(full), dist.get_world_size(group), dist.get_rank(group))]


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         restore_rng: bool = True, mesh: Mesh | None = None) -> dict[str, Any]:
    """Load a checkpoint saved at any (tp, dp) into ``model`` (and ``optimizer``); return its metadata.

    Every rank reads only its own slices. Generator states are restored when
    the checkpoint was saved at the same (tp, dp) and ``restore_rng`` is set.
    Raises :class:`CheckpointError` (nothing is modified) for a missing,
    corrupt or mismatched checkpoint.

    Example::

        meta = tensorpar.checkpoint.load("out", model, optimizer)   # the newest one
        start = meta["step"] + 1
    """
    mesh = mesh or current_mesh()
    meta = read_meta(path)
    _check_config(meta, model)
    path, st = Path(meta["path"]), _safetensors()
    where = placements(model)
    with st.safe_open(str(path / FILES[0]), framework="pt") as handle:
        missing = sorted(set(model.state_dict()) - set(handle.keys()))
        if missing:
            raise CheckpointError(f"the checkpoint lacks {missing}")
        local = {key: _read_local(handle, key, *where.get(key, (None, None)), value.shape)
                 for key, value in model.state_dict().items()}
    optim = None
    if optimizer is not None:
        optim = _local_optimizer_state(path, meta, model, optimizer, where)
    model.load_state_dict(local)
    if optim is not None:
        optimizer.load_state_dict(optim)
    if restore_rng and (meta["tp"], meta["dp"]) == (mesh.tp, mesh.dp):
        _restore_rng(path, mesh)
    return meta


def _local_optimizer_state(path: Path, meta: Mapping[str, Any], model: nn.Module,
                           optimizer: torch.optim.Optimizer, where: Placements) -> dict[str, Any]:
    names = _param_names(model)
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    ours = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    if [group["params"] for group in meta["param_groups"]] != ours:
        raise CheckpointError("the optimizer's parameters (or their grouping) differ from the checkpoint's")
    params = dict(model.named_parameters())
    state: dict[int, dict[str, torch.Tensor]] = {}
    with _safetensors().safe_open(str(path / FILES[1]), framework="pt") as handle:
        for key in handle.keys():
            name, _, field = key.rpartition("/")
            value = handle.get_tensor(key) if handle.get_slice(key).get_shape() == [] else \
                _read_local(handle, key, *where.get(name, (None, None)), params[name].shape)
            state.setdefault(order.index(name), {})[field] = value
    groups, start = [], 0
    for group in meta["param_groups"]:
        groups.append({k: v for k, v in group.items() if k != "params"} |
                      {"params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    return {"state": state, "param_groups": groups}


def _restore_rng(path: Path, mesh: Mesh) -> None:
    prefix = f"rank{mesh.rank}/"
    with _safetensors().safe_open(str(path / FILES[2]), framework="pt") as handle:
        mine = {k[len(prefix):]: handle.get_tensor(k) for k in handle.keys() if k.startswith(prefix)}
    torch.set_rng_state(mine.pop("cpu"))
    if "cuda" in mine and torch.cuda.is_available():
        torch.cuda.set_rng_state(mine.pop("cuda"))
    mine.pop("cuda", None)
    base = mine.pop("tp/base", None)
    mesh.rng.load_state_dict({"rank": mesh.rng.rank, "base": None if base is None else int(base.item()),
                              "states": {k.removeprefix("tp/"): v for k, v in mine.items()}})


def export_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The checkpoint's unsharded model state dict, for the plain (unsharded) model; no process group needed.

    Example::

        plain.load_state_dict(tensorpar.checkpoint.export_state_dict("out"), strict=False)
    """
    meta = read_meta(path)
    return _safetensors().torch.load_file(str(Path(meta["path"]) / FILES[0]))

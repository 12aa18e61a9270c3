"""What the ranks tell each other during a save or a load: JSON over tensor collectives (nothing
pickled, no object collective, no numpy), and one outcome for all.

:func:`share` all-gathers a small JSON object from every rank; :func:`collect`
gathers one to the first rank only (for what only it needs, such as the chunk
index). :func:`differences` says what the ranks' arguments differ in, in the
same words on every rank. :func:`settle` makes every rank raise when any rank failed: a rank
re-raises its own error, tagged with its rank when it is a
:class:`CheckpointError`; the others raise a CheckpointError naming the first
rank that failed and its message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..mesh import Mesh, exchange_ints
from .manifest import CheckpointError
from .safetensors_file import blocks

_MESSAGE = 4000  # characters of an error message shared with the other ranks


def _padded(payload: Mapping[str, Any], mesh: Mesh) -> tuple[torch.Tensor, list[int]]:
    data = json.dumps(payload, separators=(",", ":")).encode()
    lengths = [row[0] for row in exchange_ints([len(data)], None, mesh.device)]
    send = torch.zeros(max(lengths), dtype=torch.uint8)
    send[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return send.to(mesh.device), lengths


def _decode(rows: torch.Tensor, lengths: Sequence[int]) -> list[dict[str, Any]]:
    rows = rows.cpu()
    return [json.loads(b"".join(blocks(rows[r, :n])).decode()) for r, n in enumerate(lengths)]


def share(payload: Mapping[str, Any], mesh: Mesh) -> list[dict[str, Any]]:
    """Every rank's ``payload`` (a JSON object), in rank order, on every rank (a collective)."""
    send, lengths = _padded(payload, mesh)
    if mesh.world_size == 1:
        return _decode(send.view(1, -1), lengths)
    rows = [torch.empty_like(send) for _ in range(mesh.world_size)]
    dist.all_gather(rows, send)  # a list of rows: the form every torch release names alike
    return _decode(torch.stack(rows), lengths)


def collect(payload: Mapping[str, Any], mesh: Mesh) -> list[dict[str, Any]] | None:
    """Every rank's ``payload`` in rank order on global rank 0, None on the others (a collective)."""
    send, lengths = _padded(payload, mesh)
    if mesh.world_size == 1:
        return _decode(send.view(1, -1), lengths)
    rows = [torch.empty_like(send) for _ in range(mesh.world_size)] if mesh.rank == 0 else None
    dist.gather(send, rows, dst=0)
    return None if rows is None else _decode(torch.stack(rows), lengths)


def described(error: BaseException | None) -> str | None:
    """``error`` as the other ranks are told of it (None: no error)."""
    if error is None:
        return None
    text = str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"
    return text[:_MESSAGE]


def differences(rows: Sequence[Mapping[str, Any]], fields: Mapping[str, Any], doing: str) -> str | None:
    """What the ranks disagree on among ``fields`` (keys of every rank's row in ``rows``), naming each
    value and the ranks that gave it, the same words on every rank; None when they agree."""
    found = []
    for key in fields:
        ranks: dict[str, list[int]] = {}
        for r, row in enumerate(rows):
            ranks.setdefault(json.dumps(row.get(key)), []).append(r)
        if len(ranks) > 1:
            found.append(f"{key}: " + ", ".join(f"{value} on rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}"
                                                for value, rs in ranks.items()))
    if not found:
        return None
    return f"the ranks must {doing} with the same arguments, and they differ ({'; '.join(found)})"


def settle(rows: Sequence[Mapping[str, Any]], error: BaseException | None, mesh: Mesh, doing: str) -> None:
    """Raise on every rank when any of ``rows`` (every rank's payload, shared) holds an ``"error"``:
    ``error`` (this rank's own) when there is one, else a CheckpointError naming the first rank that
    failed ``doing`` (such as "load the checkpoint") and what it said."""
    if error is not None:
        if isinstance(error, CheckpointError):
            raise CheckpointError(f"rank {mesh.rank}: {error}") from error
        raise error
    failed = [(r, row["error"]) for r, row in enumerate(rows) if row.get("error") is not None]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"rank {rank}: {message} (so rank {mesh.rank} did not {doing} either)")

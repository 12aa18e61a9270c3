"""Agreement on a collective's arguments across ranks, where only some ranks could tell them wrong.

A collective needs every rank to bring the same kind of tensor. Some mistakes
are visible on every rank alike (a bad ``dim`` given to all), and each rank
raises before the collective. Others are visible on one rank only: a shard of
the wrong size on rank 0 of an all-gather. That rank raises; its peers enter
the collective alone and wait for the group's timeout, or for ever where the
caller catches the error and carries on.

Comparing every collective's arguments across ranks costs one more small
collective per call, so it is a debugging switch: with
``TENSORPAR_CHECK_COLLECTIVES=1`` (or torch's own ``TORCH_DISTRIBUTED_DEBUG=DETAIL``)
each collective of :mod:`tensorpar.comm` first all-gathers a few integers
describing this rank's call (sizes, dtype, op) and the text of any problem
this rank found, and every rank raises the same ``ValueError`` when they
differ. The shared-memory collectives compare their calls always, at no cost
(see :mod:`tensorpar.comm.shm`); once a group's shared-memory channel has failed
(the ranks disagreed, say), its collectives go through gloo and compare their
calls this way always, so that a later mismatch is still an error on every rank.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..mesh import exchange_ints

#: dtypes by number, for describing a call in integers
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_TEXT = 256  # bytes of a rank's problem that travel with its description
#: the calls :func:`agree` compares, and the reductions, by number
CALLS = ("all-reduce", "broadcast", "all-gather", "reduce-scatter")
REDUCE_OPS = ("sum", "max")


def dtype_code(dtype: torch.dtype) -> int:
    """``dtype``'s number in :data:`DTYPES` (-1 for any other)."""
    return DTYPES.index(dtype) if dtype in DTYPES else -1


def dtype_name(code: int) -> str:
    return str(DTYPES[code]).removeprefix("torch.") if 0 <= code < len(DTYPES) else "another dtype"


def enabled() -> bool:
    """Whether collectives compare their arguments across ranks first (see the module's docstring)."""
    env = os.environ
    return (("TENSORPAR_CHECK_COLLECTIVES" in env and env["TENSORPAR_CHECK_COLLECTIVES"] not in ("", "0"))
            or ("TORCH_DISTRIBUTED_DEBUG" in env and env["TORCH_DISTRIBUTED_DEBUG"].upper() == "DETAIL"))


def agree(what: str, group: ProcessGroup, fields: Mapping[str, int], problem: str | None = None, *,
          device: torch.device | None = None, compare: bool = False) -> None:
    """Raise ``ValueError(problem)`` when this rank found one; with checks :func:`enabled` (or
    ``compare``), first compare the call (``what``, one of :data:`CALLS`), its ``fields`` (at most
    4 + the group's size) and the problems across the group, so that every rank raises when any
    rank found a problem or the calls differ. ``device``: where the group's tensors live."""
    if torch.compiler.is_compiling() or not (compare or enabled()):  # eager mode only (see tensorpar.comm.traced)
        if problem:
            raise ValueError(problem)
        return
    width = 4 + dist.get_world_size(group)  # every call's description fills as many words, whatever the call
    assert len(fields) <= width, f"{what}: {len(fields)} fields to compare, at most {width}"
    text = (problem or "").encode()[:_TEXT].ljust(_TEXT, b"\0")  # travels as int64 words
    mine = [CALLS.index(what), *fields.values()] + [0] * (width - len(fields))
    rows = exchange_ints(mine + list(struct.unpack(f"<{_TEXT // 8}q", text)), group, device)
    calls = [row[:1 + len(fields)] for row in rows]
    problems = {r: struct.pack(f"<{_TEXT // 8}q", *row[1 + width:]).rstrip(b"\0").decode(errors="replace")
                for r, row in enumerate(rows)}
    found = [f"rank {r}: {p}" for r, p in problems.items() if p]
    if not found and all(row[:1 + width] == rows[0][:1 + width] for row in rows):
        return
    views = "; ".join(f"rank {r}: " + (", ".join(f"{k}={_shown(k, v)}" for k, v in zip(fields, call[1:], strict=True))
                                       if call[0] == mine[0] else f"{_shown('call', call[0])}")
                      for r, call in enumerate(calls))
    raise ValueError(f"{what}: the ranks' calls do not match ({views})" + "".join(f"; {f}" for f in found))


def _shown(key: str, value: int) -> str:
    """A field of a call's description as the error shows it."""
    if key == "dtype":
        return dtype_name(value)
    names = {"op": REDUCE_OPS, "call": CALLS}.get(key)
    if names is None:
        return str(value)
    return names[value] if 0 <= value < len(names) else "another"

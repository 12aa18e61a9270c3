"""Checks of arguments whose errors name the argument and its value: sizes and counts (:func:`check_int`)
and ids within a range (:func:`check_ids`)."""

from __future__ import annotations

import torch


def check_int(value: object, name: str, *, minimum: int = 1, optional: bool = False) -> None:
    """Raise unless ``value`` is an ``int`` of at least ``minimum`` (or ``None`` when ``optional``): a
    ``TypeError`` for a non-integer (a ``bool`` too), a ``ValueError`` below ``minimum``, e.g.
    ``ValueError: n_head must be a positive integer, got 0``."""
    if optional and value is None:
        return
    is_int = isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)
    if is_int and value >= minimum:  # type: ignore[operator]
        return
    kind = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
    kind += " or None" if optional else ""
    raise (ValueError if is_int else TypeError)(f"{name} must be {kind}, got {value!r}")


def check_ids(ids: torch.Tensor, limit: int, what: str, detail: str, *, allowed: int | None = None) -> None:
    """Assert that every id in ``ids`` is in ``[0, limit)`` (or equals ``allowed``), without a host sync:
    ``torch._assert_async``, as ``nn.Embedding``'s own (on a GPU "a {what} is out of range for {detail}",
    raised by the next op that waits; in a compiled graph, part of it). On the CPU it fails at once, as a
    ``ValueError`` naming the first id out of range: "{what} {id} is out of range for {detail}".
    """
    ok = (ids >= 0) & (ids < limit)  # (*)
    if allowed is not None:
        ok |= ids == allowed
    message = f"a {what} is out of range for {detail}"
    if torch.compiler.is_compiling() or ids.device.type != "cpu":
        return torch._assert_async(ok.all(), message)
    try:  # the same op as on a GPU (no host sync to count); only the failing path reads an id back
        torch._assert_async(ok.all(), message)
    except RuntimeError:
        raise ValueError(f"{what} {ids[~ok][0].item()} is out of range for {detail}") from None

"""Checks of arguments, each failing with an error that names the argument and its value: sizes and
counts (:func:`check_int`) and ids within a range (:func:`check_ids`). The core and the modules built
on it check their arguments with these.

Whether the ranks of a group called a collective alike is torch's check, made under
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (see :mod:`tensorpar.comm.collectives`).
"""

from __future__ import annotations

import torch


def check_int(value: object, name: str, *, minimum: int = 1, optional: bool = False) -> None:
    """Raise unless ``value`` is an ``int`` of at least ``minimum`` (or ``None`` when ``optional``).

    A ``bool`` is no size or count, though Python makes it an ``int``: ``True``
    raises a ``TypeError``, as any other non-integer does; an integer below
    ``minimum`` raises a ``ValueError``. The message names ``name`` and the value.

    Example::

        >>> check_int(0, "n_head")
        Traceback (most recent call last):
        ValueError: n_head must be a positive integer, got 0
    """
    if optional and value is None:
        return
    is_int = isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)
    if is_int and value >= minimum:  # type: ignore[operator]
        return
    kind = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
    if optional:
        kind += " or None"
    raise (ValueError if is_int else TypeError)(f"{name} must be {kind}, got {value!r}")


def check_ids(ids: torch.Tensor, limit: int, what: str, detail: str, *, allowed: int | None = None) -> None:
    """Assert that every id in ``ids`` is in ``[0, limit)`` (or equals ``allowed``), without a host sync.

    The check is an assertion in the stream of ops (``torch._assert_async``), as ``nn.Embedding``'s
    own: on a GPU a device-side assertion with the message ``"a {what} is out of range for {detail}"``,
    raised by the next operation that waits for the device; in a ``torch.compile`` graph a part of the
    graph. On the CPU it fails at once, and the ``ValueError`` it becomes names the first id out of
    range: ``"{what} {id} is out of range for {detail}"``.
    """
    ok = (ids >= 0) & (ids < limit)  # (*)
    if allowed is not None:
        ok |= ids == allowed
    message = f"a {what} is out of range for {detail}"
    if torch.compiler.is_compiling() or ids.device.type != "cpu":
        torch._assert_async(ok.all(), message)
        return
    try:
        torch._assert_async(ok.all(), message)
    except RuntimeError:  # only the failing path reads an id back
        raise ValueError(f"{what} {ids[~ok][0].item()} is out of range for {detail}") from None

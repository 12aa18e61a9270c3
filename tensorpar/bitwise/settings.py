"""The bitwise mode's setting (which tp sizes agree bit for bit, and the CPU threads of a rank) and its
home: a context variable that modules read once, when they are built.

Example::

    tensorpar.init(tp=2)
    tensorpar.bitwise.enable()                    # modules built from here on compute in the mode
    with tensorpar.bitwise.use_bitwise(Bitwise(tp_sizes=(1, 2, 4, 8))):
        model = GPT(config)                       # or only those built inside the block
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ..checks import check_int
from ..mesh import current_mesh
from ..world import agree

#: tp sizes whose results agree when nothing else is asked: every size up to 4
DEFAULT_TP_SIZES = (1, 2, 3, 4)


@dataclass(frozen=True)
class Bitwise:
    """Bitwise mode: a model sharded over any tp in ``tp_sizes`` computes exactly the bits it computes
    at tp = 1 (see :mod:`tensorpar.bitwise`).

    ``key_block``: the keys attention takes at a time, in order (a query's bits are then the same alone or in
    a batch, decoding from a KV cache or in one forward: :func:`~.attention.attention_by_key_blocks`).

    ``threads``: each rank's CPU intra-op threads, set by :func:`enable` (CPU kernels split their sums
    between threads, so runs compared bit for bit need the same count; ``None`` leaves it as it is).

    Example::

        tensorpar.bitwise.enable()                                 # agrees with tp 1, 2, 3 and 4
        tensorpar.bitwise.enable(Bitwise(tp_sizes=(1, 2, 4, 8)))   # at tp = 8
    """

    tp_sizes: tuple[int, ...] = DEFAULT_TP_SIZES
    threads: int | None = 1
    key_block: int = 64

    def __post_init__(self) -> None:
        if isinstance(self.tp_sizes, (str, bytes)) or not isinstance(self.tp_sizes, Sequence) or not self.tp_sizes:
            raise TypeError(f"Bitwise: tp_sizes must be a non-empty sequence of positive integers, "
                            f"got {self.tp_sizes!r}")
        for size in self.tp_sizes:
            check_int(size, "Bitwise: a tp size")
        object.__setattr__(self, "tp_sizes", tuple(sorted(set(self.tp_sizes))))
        if self.threads is not None:
            check_int(self.threads, "Bitwise: threads")
        check_int(self.key_block, "Bitwise: key_block")

    @classmethod
    def of(cls, value: bool | Bitwise | Sequence[int] | None) -> Bitwise | None:
        """The mode ``enable(value)`` asks for: ``False``/``None`` off, ``True`` the defaults, a
        :class:`Bitwise` itself, or a sequence of tp sizes."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            return cls(tp_sizes=tuple(value))
        raise TypeError(f"bitwise must be a bool, a Bitwise or a sequence of tp sizes, got {value!r}")

    def check_tp(self, tp: int) -> None:
        """Raise unless ``tp`` is one of the sizes this mode makes agree."""
        if tp not in self.tp_sizes:
            raise ValueError(f"bitwise mode agrees across tp sizes {list(self.tp_sizes)}, and tp={tp} is not "
                             f"one of them: pass bitwise=Bitwise(tp_sizes=(..., {tp})) to include it")


# The mode of the modules built in this context (None: the default numerics), per thread.
_mode: contextvars.ContextVar[Bitwise | None] = contextvars.ContextVar("tensorpar_bitwise", default=None)


def current_bitwise() -> Bitwise | None:
    """The bitwise mode that modules built now compute in (``None``: off)."""
    return _mode.get()


@contextlib.contextmanager
def use_bitwise(mode: bool | Bitwise | Sequence[int] | None) -> Iterator[Bitwise | None]:
    """Build modules in ``mode`` inside the ``with`` block (see :meth:`Bitwise.of`). Neither compared
    across ranks nor setting the thread count, as :func:`enable` does: the caller makes every rank ask for
    the same mode, with the same threads."""
    token = _mode.set(Bitwise.of(mode))
    try:
        yield _mode.get()
    finally:
        _mode.reset(token)


def enable(mode: bool | Bitwise | Sequence[int] = True) -> Bitwise | None:
    """Turn the bitwise mode on (``False``: off) for the modules built afterwards in this context, after
    :func:`tensorpar.init`: every rank calls it, with the same mode (compared across the world: a
    collective; ranks that differ all raise). On a CPU it sets each rank's thread count
    (``Bitwise.threads``)."""
    chosen = Bitwise.of(mode)
    mesh = current_mesh()
    sizes = sum(1 << t for t in chosen.tp_sizes if t < 62) if chosen is not None else 0  # the tp sizes as bits
    # compared first: then a mode that leaves out this tp raises on every rank alike
    agree([sizes, -1 if chosen is None else chosen.threads or 0, 0 if chosen is None else chosen.key_block],
          "asked for different bitwise modes",
          lambda bits, threads, key_block: "off" if threads < 0 else
          f"tp sizes {[t for t in range(62) if bits >> t & 1]}, threads {threads or None}"
          + (f", key_block {key_block}" if key_block != Bitwise.key_block else ""))
    if chosen is not None:
        chosen.check_tp(mesh.tp)
        if chosen.threads is not None and mesh.device.type == "cpu":
            torch.set_num_threads(chosen.threads)
    _mode.set(chosen)
    return chosen

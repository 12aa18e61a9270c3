"""The bitwise mode's one setting: which tp sizes agree bit for bit, and the CPU threads of a rank."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..checks import check_int

#: tp sizes whose results agree when nothing else is asked: every size up to 4
DEFAULT_TP_SIZES = (1, 2, 3, 4)


@dataclass(frozen=True)
class Bitwise:
    """Bitwise mode: a model sharded over any tp in ``tp_sizes`` computes exactly the bits it computes
    at tp = 1 (see :mod:`tensorpar.bitwise`).

    ``threads`` is each rank's number of CPU threads for intra-op work (``torch.set_num_threads``),
    set by :func:`tensorpar.init`: CPU kernels split large products and reductions between their
    threads, and a different split adds in another order, so runs compared bit for bit must use the
    same count on every rank (``None`` leaves it as it is, for a caller who sets it alike everywhere).
    GPU kernels do not depend on it.

    Example::

        tensorpar.init(tp=2, bitwise=True)                         # agrees with tp 1, 3 and 4
        tensorpar.init(tp=8, bitwise=Bitwise(tp_sizes=(1, 2, 4, 8)))
    """

    tp_sizes: tuple[int, ...] = DEFAULT_TP_SIZES
    threads: int | None = 1

    def __post_init__(self) -> None:
        if isinstance(self.tp_sizes, (str, bytes)) or not isinstance(self.tp_sizes, Sequence) or not self.tp_sizes:
            raise TypeError(f"Bitwise: tp_sizes must be a non-empty sequence of positive integers, "
                            f"got {self.tp_sizes!r}")
        for size in self.tp_sizes:
            check_int(size, "Bitwise: a tp size")
        object.__setattr__(self, "tp_sizes", tuple(sorted(set(self.tp_sizes))))
        if self.threads is not None:
            check_int(self.threads, "Bitwise: threads")

    @classmethod
    def of(cls, value: bool | Bitwise | Sequence[int] | None) -> Bitwise | None:
        """The mode ``init(bitwise=value)`` asks for: ``False``/``None`` off, ``True`` the defaults, a
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

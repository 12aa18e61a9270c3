"""What the equivalence debugger reports: findings, and the report that lists them.

Plain data (numbers, strings, shapes): every rank holds rank 0's report (torch's ``broadcast_object_list``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Finding:
    """One tensor of the sharded model that differs from its dense twin beyond tolerance.

    ``module`` is the dotted module name (``""``: the model itself); ``phase`` is ``"forward output"``,
    ``"backward gradient"``, ``"parameter"`` or ``"parameter gradient"``; ``what`` says which tensor
    (``"output"``, ``"input gradient"``, a parameter's name); ``call`` counts the module's earlier calls.
    ``errors[r]`` is rank ``r``'s norm-wise relative error (its shard's, for a sharded tensor), ``ranks`` those
    beyond tolerance and ``rel_error`` their worst. ``downstream`` marks a divergence after the first of its
    phase (most likely its consequence; not diagnosed).
    """

    module: str
    phase: str
    what: str
    ranks: tuple[int, ...]
    rel_error: float
    errors: tuple[float, ...]
    full_shape: tuple[int, ...]
    local_shapes: tuple[tuple[int, ...], ...]
    call: int = 0
    diagnosis: str | None = None
    downstream: bool = False

    @property
    def name(self) -> str:
        """``module.what`` for a parameter, else ``module (what, call k)`` (``<model>``: the model itself)."""
        if self.phase.startswith("parameter"):
            return f"{self.module}.{self.what}" if self.module else self.what
        return f"{self.module or '<model>'} ({self.what}" + (f", call {self.call + 1})" if self.call else ")")

    def __str__(self) -> str:
        ranks = ", ".join(map(str, self.ranks))
        local = ("local = full" if all(s == self.full_shape for s in self.local_shapes)
                 else "local " + " | ".join(str(s) for s in self.local_shapes))
        text = (f"{self.phase} of {self.name}, rank{'s' if len(self.ranks) > 1 else ''} {ranks}: "
                f"rel err {self.rel_error:.3g} [full {self.full_shape}, {local}]")
        return text + (f"\n    diagnosis: {self.diagnosis}" if self.diagnosis else "")


@dataclass(frozen=True)
class DivergenceReport:
    """What :func:`~tensorpar.testing.find_divergence` found; the same on every rank.

    ``first_forward`` / ``first_backward``: the first module output (in forward order) and gradient (in
    backward order) that differ, or ``None``; ``findings``: every divergence, forward, backward, parameters,
    parameter gradients, in that order; ``compared``: how many tensors each phase compared.
    """

    tp: int
    first_forward: Finding | None
    first_backward: Finding | None
    findings: tuple[Finding, ...]
    compared: dict[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Whether nothing differs."""
        return not self.findings

    def __str__(self) -> str:
        counts = ", ".join(f"{n} {phase}s" for phase, n in self.compared.items())
        lines = [f"equivalence report at tp={self.tp} ({counts} compared): "
                 + (f"{len(self.findings)} finding{'s' * (len(self.findings) != 1)}" if self.findings
                    else "no divergence")]
        for phase, first in (("forward", self.first_forward), ("backward", self.first_backward)):
            lines.append(f"first {phase} divergence: {first if first else 'none'}")
            later = [f.name for f in self.findings if f.downstream and f.phase == first.phase] if first else []
            if later:
                shown = ", ".join(later[:6]) + (f" and {len(later) - 6} more" if len(later) > 6 else "")
                lines.append(f"  then (likely consequences) {len(later)} more: {shown}")
        for phase in ("parameter", "parameter gradient"):
            found = [f for f in self.findings if f.phase == phase]
            lines.append(f"{phase}s: {len(found)} differ" if found else f"{phase}s: all match")
            lines += [f"  {f}" for f in found[:12]] + ([f"  ... and {len(found) - 12} more"] if len(found) > 12 else [])
        return "\n".join(lines + [f"note: {n}" for n in self.notes])

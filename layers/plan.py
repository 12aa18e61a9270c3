"""What each rank of a GPT run will hold, and how long a step must take, before a rank starts.

(Skeleton: the public API; the counts are filled in by the modules that own them.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config import GPTConfig
from .plan_activations import activation_bytes, peak_bytes, transient_bytes

DP_SHARDINGS = ("ddp", "zero", "fsdp")
OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Layout:
    """How a run is laid out: the mesh, the dp sharding and what one step computes.

    ``micro_batch`` sequences of ``seq_len`` tokens (default: the config's ``block_size``) per
    micro-batch on one dp rank, ``microbatches`` of them per optimizer step (pipeline micro-batches,
    or gradient accumulation at ``pp=1``). ``dtype`` is the parameters' dtype, ``autocast`` the
    matmuls' (``None`` or ``"bfloat16"``).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    dp_sharding: str = "ddp"
    offload_optimizer: bool = False
    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    micro_batch: int = 1
    microbatches: int = 1
    seq_len: int | None = None
    schedule: str = "1f1b"
    dtype: str = "float32"
    autocast: str | None = None
    optimizer: str = "adamw"

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class RankPlan:
    """The bytes one rank holds during a training step (its device memory)."""

    tp_rank: int
    pp_stage: int
    dp_rank: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    transient_bytes: int
    peak_bytes: int


@dataclass(frozen=True)
class Plan:
    """A run's plan: every rank's :class:`RankPlan`, the largest, FLOPs and a step-time bound."""

    config: GPTConfig
    layout: Layout
    ranks: tuple[RankPlan, ...]
    flops_per_step: float
    peak_flops: float | None = None  # per device, FLOP/s
    notes: tuple[str, ...] = field(default=())

    @property
    def largest(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.peak_bytes)

    @property
    def step_time_s(self) -> float | None:
        """A lower bound on one optimizer step: every device busy at its peak, nothing else."""
        return None if self.peak_flops is None else self.flops_per_step / (self.layout.world * self.peak_flops)

    def as_dict(self) -> dict[str, Any]:
        big = self.largest
        return {"params_bytes": big.params_bytes, "grads_bytes": big.grads_bytes,
                "optimizer_bytes": big.optimizer_bytes, "activation_bytes": big.activation_bytes,
                "transient_bytes": big.transient_bytes, "peak_bytes": big.peak_bytes,
                "flops_per_step": self.flops_per_step, "step_time_s": self.step_time_s}

    def table(self) -> str:
        return "\n".join(f"{k}: {v}" for k, v in self.as_dict().items())


def plan(config: GPTConfig, layout: Layout, *, device: str | None = None,
         peak_flops: float | None = None) -> Plan:
    """The plan of training ``config`` laid out as ``layout`` (placeholder counts)."""
    params = config.parameter_count(non_embedding=False) * 4 // layout.tp
    ranks = []
    for stage in range(layout.pp):
        for dp_rank in range(layout.dp):
            for tp_rank in range(layout.tp):
                act = activation_bytes(config, layout, tp_rank=tp_rank, stage=stage)
                tr = transient_bytes(config, layout, tp_rank=tp_rank, stage=stage)
                peak = peak_bytes(config, layout, params=params, grads=params, optimizer=2 * params,
                                  tp_rank=tp_rank, stage=stage)
                ranks.append(RankPlan(tp_rank, stage, dp_rank, params, params, 2 * params, act, tr, peak))
    tokens = layout.dp * layout.micro_batch * layout.microbatches * (layout.seq_len or config.block_size)
    return Plan(config, layout, tuple(ranks), 6.0 * config.parameter_count() * tokens, peak_flops)


@dataclass(frozen=True)
class Suggestions:
    """The layouts of a world that fit a memory, fastest first, and why each other one does not."""

    fits: tuple[Plan, ...]
    rejected: tuple[tuple[Layout, str], ...]


def suggest(config: GPTConfig, world: int, memory_bytes: int, *, base: Layout = Layout(),
            device: str | None = None, peak_flops: float | None = None) -> Suggestions:
    """Every layout of ``world`` ranks (tp x pp x dp, dp sharding, sequence parallelism, activation
    checkpointing; the rest as in ``base``) whose plan fits ``memory_bytes`` per rank (placeholder)."""
    return Suggestions((), ())

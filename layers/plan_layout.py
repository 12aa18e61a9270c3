"""The planner's types: a run's :class:`Layout`, one rank's :class:`RankPlan`, the whole :class:`Plan`
(its bound on the step's time, its table and JSON), and :func:`check_layout`, which refuses what the
layers cannot build."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tensorpar.bitwise import Bitwise
from tensorpar.pipeline import stage_blocks
from tensorpar.sharding import partition_sizes

from .config import GPTConfig
from .heads import head_layout
from .plan_flops import pipeline_bubble
from .plan_table import format_table

DP_SHARDINGS = ("ddp", "zero", "fsdp")
OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Layout:
    """How a run is laid out: the mesh, the dp sharding and what one step computes.

    ``micro_batch`` sequences of ``seq_len`` tokens (default: the config's ``block_size``) per
    micro-batch on one dp rank, ``microbatches`` of them per optimizer step (pipeline micro-batches,
    or gradient accumulation at ``pp=1``). ``dtype`` is the parameters' dtype, ``autocast`` the
    matmuls' (``None`` or ``"bfloat16"``). ``stages_per_rank`` > 1: the interleaved schedule's loops.
    ``offload_optimizer``: FSDP2's ``CPUOffloadPolicy`` (needs ``dp_sharding="fsdp"``). ``bitwise``: the
    layers are built in :mod:`tensorpar.bitwise`'s mode (``True``: its defaults, or a
    :class:`~tensorpar.bitwise.Bitwise`), which saves other tensors for backward than the default numerics.
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
    stages_per_rank: int = 1
    bitwise: bool | Bitwise = False

    @property
    def numerics(self) -> Bitwise | None:
        """The bitwise mode the layers are built in (``None``: the default numerics)."""
        return Bitwise.of(self.bitwise)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def tokens(self, config: GPTConfig) -> int:
        """Tokens one dp rank runs per optimizer step."""
        return self.micro_batch * self.microbatches * (self.seq_len or config.block_size)


@dataclass(frozen=True)
class RankPlan:
    """The bytes one rank holds during a training step (its device memory; ``host_*``: in host memory,
    under ``offload_optimizer``) and the FLOPs it runs per step (recomputation included).
    ``ddp_bucket_bytes``: ``DistributedDataParallel``'s flat gradient buckets (counted in the peak)."""

    tp_rank: int
    pp_stage: int  # the pipeline rank (its stages: ``tensorpar.pipeline.rank_stages``)
    dp_rank: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    transient_bytes: int
    peak_bytes: int
    host_params_bytes: int = 0
    host_grads_bytes: int = 0
    host_optimizer_bytes: int = 0
    flops: float = 0.0
    ddp_bucket_bytes: int = 0

    @property
    def host_bytes(self) -> int:
        return self.host_params_bytes + self.host_grads_bytes + self.host_optimizer_bytes

    @property
    def where(self) -> str:
        return f"rank (tp {self.tp_rank}, pp {self.pp_stage}, dp {self.dp_rank})"


@dataclass(frozen=True)
class Plan:
    """A run's plan: every rank's :class:`RankPlan`, the largest, FLOPs and a step-time bound.

    ``flops_per_step``: the model FLOPs of one optimizer step over the whole world
    (:func:`~layers.plan_flops.model_flops_per_token` times its tokens); ``hardware_flops_per_step``: what
    the ranks run, replicated parameters on every rank and recomputation included."""

    config: GPTConfig
    layout: Layout
    ranks: tuple[RankPlan, ...]
    flops_per_step: float
    peak_flops: float | None = None  # per device, FLOP/s
    notes: tuple[str, ...] = field(default=())
    hardware_flops_per_step: float = 0.0
    device: str | None = None

    @property
    def largest(self) -> RankPlan:
        """The rank with the highest peak (the first such)."""
        return max(self.ranks, key=lambda r: r.peak_bytes)

    def rank(self, tp_rank: int, pp_stage: int, dp_rank: int) -> RankPlan:
        """The plan of rank (``tp_rank``, ``pp_stage``, ``dp_rank``)."""
        for r in self.ranks:
            if (r.tp_rank, r.pp_stage, r.dp_rank) == (tp_rank, pp_stage, dp_rank):
                return r
        lay = self.layout
        raise ValueError(f"no rank (tp {tp_rank}, pp {pp_stage}, dp {dp_rank}) in a layout of tp={lay.tp}, "
                         f"pp={lay.pp}, dp={lay.dp}")

    @property
    def bubble(self) -> float:
        """The pipeline's idle fraction (0 without a pipeline)."""
        lay = self.layout
        return pipeline_bubble(lay.pp, lay.microbatches, lay.stages_per_rank)

    @property
    def critical_flops(self) -> float:
        """FLOPs the busiest rank runs per step, stretched by the pipeline bubble: the step-time bound in
        FLOPs at 1 FLOP/s."""
        return max(r.flops for r in self.ranks) / (1 - self.bubble)

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step over every dp rank."""
        return self.layout.tokens(self.config) * self.layout.dp

    @property
    def step_time_s(self) -> float | None:
        """A lower bound on one optimizer step: the busiest rank at its device's peak, nothing but the
        pipeline's bubble idle; ``None`` without a peak."""
        return None if self.peak_flops is None else self.critical_flops / self.peak_flops

    @property
    def mfu(self) -> float | None:
        """The model FLOPs utilisation a step at :attr:`step_time_s` would reach (its upper bound)."""
        t = self.step_time_s
        return None if t is None or self.peak_flops is None else \
            self.flops_per_step / (t * self.layout.world * self.peak_flops)

    def as_dict(self) -> dict[str, Any]:
        """The plan as JSON-able values: the largest rank's bytes at the top, then every rank's."""
        big = self.largest
        return {"params_bytes": big.params_bytes, "grads_bytes": big.grads_bytes,
                "optimizer_bytes": big.optimizer_bytes, "activation_bytes": big.activation_bytes,
                "transient_bytes": big.transient_bytes, "peak_bytes": big.peak_bytes, "host_bytes": big.host_bytes,
                "largest_rank": {"tp_rank": big.tp_rank, "pp_stage": big.pp_stage, "dp_rank": big.dp_rank},
                "flops_per_step": self.flops_per_step, "hardware_flops_per_step": self.hardware_flops_per_step,
                "step_time_s": self.step_time_s, "mfu": self.mfu, "peak_flops": self.peak_flops,
                "device": self.device, "bubble": self.bubble, "notes": list(self.notes),
                "config": dataclasses.asdict(self.config), "layout": dataclasses.asdict(self.layout),
                "ranks": [dataclasses.asdict(r) for r in self.ranks]}

    def table(self) -> str:
        """A readable table: one row per distinct rank, then FLOPs, the step-time bound and its MFU."""
        return format_table(self)


def check_layout(config: GPTConfig, layout: Layout) -> None:
    """Raise a ``ValueError`` (``TypeError`` for a wrong type) naming the numbers unless the layers can build
    ``config`` laid out as ``layout``."""
    if not isinstance(config, GPTConfig):
        raise TypeError(f"expected a GPTConfig, got {type(config).__name__}")
    if not isinstance(layout, Layout):
        raise TypeError(f"expected a Layout, got {type(layout).__name__}")
    for name in ("tp", "pp", "dp", "micro_batch", "microbatches", "stages_per_rank"):
        value = getattr(layout, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"Layout.{name} must be a positive integer, got {value!r}")
    for name, allowed in (("dp_sharding", DP_SHARDINGS), ("optimizer", OPTIMIZERS), ("schedule", SCHEDULES),
                          ("dtype", DTYPES), ("autocast", (None, "bfloat16"))):
        if getattr(layout, name) not in allowed:
            raise ValueError(f"Layout.{name} must be one of {allowed}, got {getattr(layout, name)!r}")
    if layout.offload_optimizer and layout.dp_sharding != "fsdp":
        raise ValueError(f"offload_optimizer is FSDP2's CPUOffloadPolicy: it needs dp_sharding='fsdp', "
                         f"got {layout.dp_sharding!r}")
    if layout.seq_len is not None and not 1 <= layout.seq_len <= config.block_size:
        raise ValueError(f"seq_len ({layout.seq_len}) must be in 1..block_size ({config.block_size})")
    if layout.stages_per_rank > 1 and layout.pp == 1:
        raise ValueError(f"stages_per_rank ({layout.stages_per_rank}) > 1 needs pipeline ranks to loop over: pp is 1")
    head_layout(config.n_head, config.kv_heads, layout.tp, 0)  # "n_head (2) is smaller than tp (4)"
    mode = layout.numerics  # TypeError for what is no mode
    if mode is not None:
        mode.check_tp(layout.tp)
    for name, size in (("vocab_size", config.vocab_size), ("block_size", config.block_size),
                       ("mlp hidden features", config.mlp_hidden)):
        partition_sizes(size, layout.tp, name=name)
    stage_blocks(config.n_layer, layout.pp * layout.stages_per_rank)
    if layout.pp > 1:  # the schedule's own rules (tensorpar.pipeline.Pipeline)
        if layout.stages_per_rank > 1 and layout.schedule != "interleaved":
            raise ValueError(f"the {layout.schedule} schedule runs one stage per rank, got stages_per_rank "
                             f"{layout.stages_per_rank}: use schedule='interleaved' for several")
        if layout.schedule == "1f1b" and layout.microbatches < layout.pp:
            raise ValueError(f"the 1f1b schedule needs at least as many micro-batches as stages: microbatches "
                             f"({layout.microbatches}) is smaller than pp ({layout.pp})")
        if layout.schedule == "interleaved" and layout.microbatches % max(1, layout.microbatches // layout.pp):
            raise ValueError(f"interleaved 1F1B runs the micro-batches in rounds of pp ({layout.pp}): microbatches "
                             f"({layout.microbatches}) is not a multiple of {layout.microbatches // layout.pp}")

"""What each rank of a GPT run will hold, and how long a step must take, before a rank starts.

:func:`plan` counts, for a :class:`GPTConfig` laid out as a :class:`Layout`, every rank's bytes of
parameters, gradients and optimizer state (exactly: :mod:`layers.plan_state`), saved activations, the
largest transient and the peak (:mod:`layers.plan_activations`), the FLOPs of a step and, given a device,
a lower bound on the step's time (:mod:`layers.plan_flops`). :func:`plan_rank` counts this rank's from a
model already built; :func:`suggest` lists the layouts of a world that fit a memory, fastest first.

Example::

    p = plan(GPTConfig(n_layer=24, n_embd=1024, n_head=16), Layout(tp=2, dp=4, dp_sharding="zero"),
             device="H100")
    print(p.table())            # every distinct rank: GiB of parameters, gradients, state, activations
    p.largest.peak_bytes        # the rank that holds the most
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from torch import nn

import tensorpar

from .config import GPTConfig
from .heads import head_layout
from .plan_activations import activation_bytes, peak_bytes, transient_bytes
from .plan_flops import PEAKS, model_flops_per_token, peak_tflops_by_name, rank_flops_per_token
from .plan_layout import DP_SHARDINGS, OPTIMIZERS, SCHEDULES, Layout, Plan, RankPlan, check_layout
from .plan_state import DTYPE_BYTES, HeldParameter, StateBytes, dp_state_bytes, held_parameters

#: the fields :func:`suggest` varies, in the order :func:`nearest_fits` counts changes by
VARIED = ("tp", "pp", "dp", "dp_sharding", "sequence_parallel", "activation_checkpointing")

__all__ = ["DP_SHARDINGS", "OPTIMIZERS", "SCHEDULES", "VARIED", "Layout", "Plan", "RankPlan", "Suggestions",
           "changes", "check_layout", "nearest_fits", "plan", "plan_rank", "suggest"]


def _peak(device: str | None, peak_flops: float | None, layout: Layout) -> float | None:
    if peak_flops is not None:
        if isinstance(peak_flops, bool) or not isinstance(peak_flops, (int, float)) or not peak_flops > 0:
            raise ValueError(f"peak_flops must be a number above 0 (FLOP/s per device), got {peak_flops!r}")
        return float(peak_flops)
    if device is None:
        return None
    half = layout.dtype == "bfloat16" or layout.autocast == "bfloat16"
    tflops = peak_tflops_by_name(device, half)
    if tflops is None:
        raise ValueError(f"no peak is known for device {device!r} (known: {', '.join(n for n, _, _ in PEAKS)}): "
                         "give peak_flops=")
    return tflops * 1e12


def _ranks(config: GPTConfig, layout: Layout, held: list[HeldParameter], tp_rank: int, stage: int,
           dp_ranks: range | None = None, device_type: str = "cpu") -> list[RankPlan]:
    """The plans of the ranks (``tp_rank``, ``stage``, each of ``dp_ranks``, default all) holding ``held``."""
    states = dp_state_bytes(held, DTYPE_BYTES[layout.dtype], dp=layout.dp, dp_sharding=layout.dp_sharding,
                            optimizer=layout.optimizer, offload=layout.offload_optimizer)
    heads = len(head_layout(config.n_head, config.kv_heads, layout.tp, tp_rank).query)
    flops = rank_flops_per_token(config, held, heads, layout.seq_len or config.block_size,
                                 recompute=layout.activation_checkpointing, tp=layout.tp) * layout.tokens(config)
    where = dict(tp_rank=tp_rank, stage=stage)
    activations, transient = activation_bytes(config, layout, **where, device_type=device_type), \
        transient_bytes(config, layout, **where, device_type=device_type)
    # examples/train_gpt.py wraps a GPT (pp=1) in DDP at dp > 1 unless FSDP2 shards it: its reducer's buckets
    # (gradient_as_bucket_view=False) hold every gradient once more, for as long as the model lives
    ddp = layout.pp == 1 and layout.dp > 1 and layout.dp_sharding != "fsdp"
    peaks: dict[StateBytes, int] = {}
    found = []
    for dp_rank in range(layout.dp) if dp_ranks is None else dp_ranks:
        state = states[dp_rank]
        buckets = state.grads if ddp else 0
        if state not in peaks:
            peaks[state] = buckets + peak_bytes(config, layout, params=state.params, grads=state.grads,
                                                optimizer=state.optimizer, **where, device_type=device_type)
        found.append(RankPlan(tp_rank, stage, dp_rank, state.params, state.grads, state.optimizer, activations,
                              transient, peaks[state], state.host_params, state.host_grads, state.host_optimizer,
                              flops, buckets))
    return found


def _notes(layout: Layout) -> tuple[str, ...]:
    notes = []
    if layout.dp > 1 and layout.dp_sharding != "fsdp" and layout.pp == 1:
        notes.append("DistributedDataParallel's reducer keeps flat gradient buckets as large as the gradients: "
                     "ddp_bucket_bytes, in the peak")
    if layout.optimizer == "adamw":
        notes.append("AdamW's step counters (one float32 scalar per parameter) are counted with its state; "
                     "they stay on the host unless the optimizer is fused or capturable")
    return tuple(notes)


def plan(config: GPTConfig, layout: Layout, *, device: str | None = None,
         peak_flops: float | None = None) -> Plan:
    """The plan of training ``config`` laid out as ``layout``: every rank's bytes and FLOPs, and with
    ``device`` (``"H100"``, ``"H200"``, ``"A100"``, ``"H100 PCIe"``: their dense peak in the layout's
    dtype) or ``peak_flops`` (FLOP/s per device) a lower bound on the step's time. A named ``device`` is a
    GPU, whose dropout masks and attention kernels save other bytes than the CPU's (the default).

    Example::

        plan(GPTConfig(vocab_size=50257), Layout(tp=2, dp=2, dp_sharding="fsdp"), device="A100").table()
    """
    check_layout(config, layout)
    peak = _peak(device, peak_flops, layout)
    ranks = []
    for stage in range(layout.pp):
        for tp_rank in range(layout.tp):
            held = held_parameters(config, tp=layout.tp, tp_rank=tp_rank, pp=layout.pp, pp_rank=stage,
                                   stages_per_rank=layout.stages_per_rank)
            ranks += _ranks(config, layout, held, tp_rank, stage, device_type="cpu" if device is None else "cuda")
    ranks.sort(key=lambda r: (r.pp_stage, r.dp_rank, r.tp_rank))  # global rank order: (pp, dp, tp) row-major
    seq = layout.seq_len or config.block_size
    model = model_flops_per_token(config.parameter_count(), config.n_layer, config.n_head,
                                  config.n_embd // config.n_head, seq) * layout.tokens(config) * layout.dp
    hardware = sum(r.flops for r in ranks)
    return Plan(config, layout, tuple(ranks), model, peak, _notes(layout), hardware, device)


def plan_rank(model: nn.Module, layout: Layout, *, mesh: tensorpar.Mesh | None = None) -> RankPlan:
    """This rank's :class:`RankPlan`, its parameters counted from ``model``'s modules as built (a
    :class:`~layers.GPT` or :class:`~layers.PipelinedGPT`, under FSDP2 or DDP or neither, in the bitwise mode or
    not, as the layout says) rather than from its config; the dp rules, activations and FLOPs as
    :func:`plan`'s. ``mesh``: the model's (default: the current one), whose sizes must be the layout's."""
    from torch.distributed.tensor import DTensor  # FSDP2's parameters (loaded only when asked, as FSDP2 is)

    mesh = mesh or tensorpar.current_mesh()
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    config = getattr(model, "config", None)
    if not isinstance(config, GPTConfig):
        raise TypeError(f"plan_rank expects a GPT or PipelinedGPT (with a GPTConfig), got {type(model).__name__}")
    check_layout(config, layout)
    if (mesh.tp, mesh.pp, mesh.dp) != (layout.tp, layout.pp, layout.dp):
        raise ValueError(f"the mesh is tp={mesh.tp}, pp={mesh.pp}, dp={mesh.dp}; the layout tp={layout.tp}, "
                         f"pp={layout.pp}, dp={layout.dp}")
    params = dict(model.named_parameters())  # tied parameters once
    fsdp = any(isinstance(p, DTensor) for p in params.values())
    if fsdp != (layout.dp_sharding == "fsdp"):
        raise ValueError(f"the model's parameters are {'' if fsdp else 'not '}FSDP2's dp shards, the layout's "
                         f"dp_sharding is {layout.dp_sharding!r}")
    built = getattr(model, "numerics", None)  # the bitwise mode it was built in (None: the default numerics)
    if (built is None) != (layout.numerics is None):
        raise ValueError(f"the model was built {'outside' if built is None else 'in'} the bitwise mode, the layout's "
                         f"bitwise is {layout.bitwise!r}")
    layout = dataclasses.replace(layout, bitwise=built or False)  # its tp sizes and key blocks, as built
    itemsizes = {p.element_size() for p in params.values()}
    if itemsizes != {DTYPE_BYTES[layout.dtype]}:
        raise ValueError(f"the model's parameters have {sorted(itemsizes)} bytes an element, the layout's dtype "
                         f"{layout.dtype!r} {DTYPE_BYTES[layout.dtype]}")
    # a DTensor's shape is the tp shard FSDP2 splits over dp; a plain parameter is the tp shard itself
    held = [HeldParameter(name, tuple(p.shape)) for name, p in params.items()]
    (rank,) = _ranks(config, layout, held, mesh.tp_rank, mesh.pp_rank, range(mesh.dp_rank, mesh.dp_rank + 1),
                     "cuda" if next(iter(params.values())).device.type == "cuda" else "cpu")
    return rank


@dataclass(frozen=True)
class Suggestions:
    """The layouts of a world that fit a memory, fastest first, and why each other one does not."""

    fits: tuple[Plan, ...]
    rejected: tuple[tuple[Layout, str], ...]


def _layouts(world: int, base: Layout) -> list[Layout]:
    """Every layout of ``world`` ranks: tp x pp x dp, the dp sharding, sequence parallelism, activation
    checkpointing; the rest as in ``base``."""
    found = []
    for tp in (t for t in range(1, world + 1) if world % t == 0):
        for pp in (p for p in range(1, world // tp + 1) if world // tp % p == 0):
            dp = world // (tp * pp)
            shardings = ("fsdp",) if base.offload_optimizer else DP_SHARDINGS if dp > 1 else ("ddp",)
            for sharding, sp, ac in itertools.product(shardings, (False, True) if tp > 1 else (False,),
                                                      (False, True)):
                found.append(dataclasses.replace(base, tp=tp, pp=pp, dp=dp, dp_sharding=sharding, sequence_parallel=sp,
                                                 activation_checkpointing=ac,
                                                 stages_per_rank=base.stages_per_rank if pp > 1 else 1))
    return found


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def suggest(config: GPTConfig, world: int, memory_bytes: int, *, base: Layout | None = None,
            global_batch: int | None = None, device: str | None = None,
            peak_flops: float | None = None) -> Suggestions:
    """Every layout of ``world`` ranks (tp x pp x dp, dp sharding, sequence parallelism, activation
    checkpointing; the rest as in ``base``, default ``Layout()``) whose every rank's peak fits
    ``memory_bytes``, fastest first, and each other layout with the reason it was rejected.

    Each dp rank runs ``base``'s micro-batches, or with ``global_batch`` (sequences per optimizer step) its
    share of them, ``global_batch / (dp * microbatches)`` a micro-batch. Either way they are ordered by the
    step-time bound per token (the step time at an equal global batch), then by the peak."""
    for name, value in (("world", world), ("memory_bytes", memory_bytes), ("global_batch", global_batch or 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    base = Layout() if base is None else base
    check_layout(config, base)
    fits, rejected = [], []
    for layout in _layouts(world, base):
        if global_batch is not None:
            per_micro = layout.dp * layout.microbatches
            if global_batch % per_micro:
                rejected.append((layout, f"a batch of {global_batch} sequences does not split into dp ({layout.dp}) "
                                         f"x microbatches ({layout.microbatches}) equal micro-batches"))
                continue
            layout = dataclasses.replace(layout, micro_batch=global_batch // per_micro)
        try:
            p = plan(config, layout, device=device, peak_flops=peak_flops)
        except ValueError as e:
            rejected.append((layout, str(e)))
            continue
        big = p.largest
        if big.peak_bytes > memory_bytes:
            rejected.append((layout, f"needs {_gib(big.peak_bytes)} on {big.where}, more than {_gib(memory_bytes)}"))
        else:
            fits.append(p)
    fits.sort(key=lambda p: (p.critical_flops / p.tokens_per_step, p.largest.peak_bytes))
    return Suggestions(tuple(fits), tuple(rejected))


def changes(a: Layout, b: Layout) -> list[str]:
    """The fields :func:`suggest` varies that differ between ``a`` and ``b``."""
    return [name for name in VARIED if getattr(a, name) != getattr(b, name)]


def nearest_fits(config: GPTConfig, layout: Layout, memory_bytes: int, *, limit: int = 3,
                 global_batch: int | None = None, device: str | None = None,
                 peak_flops: float | None = None) -> tuple[Plan, ...]:
    """Up to ``limit`` layouts of the same world that fit ``memory_bytes`` (see :func:`suggest`), those that
    change the fewest of ``layout``'s fields (:data:`VARIED`) first, then the fastest."""
    found = suggest(config, layout.world, memory_bytes, base=layout, global_batch=global_batch, device=device,
                    peak_flops=peak_flops).fits
    order = {id(p): i for i, p in enumerate(found)}
    return tuple(sorted(found, key=lambda p: (len(changes(layout, p.layout)), order[id(p)]))[:limit])


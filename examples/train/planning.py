"""Plan before you launch: the run's options as a :class:`layers.plan.Layout`, the memory each rank
has, the check that the plan's largest rank fits it (refused with the numbers and the nearest layouts
that fit), and what ``--dry-run`` and ``--suggest`` print. Every count is :mod:`layers.plan`'s."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from layers import GPTConfig
from layers.plan import Layout, Plan, RankPlan, Suggestions, plan, suggest
from tensorpar.world import default_backend

from .device import local_ranks

if TYPE_CHECKING:
    from .cli import TrainConfig

#: the nearest layouts that fit, named when a layout is refused
NEAREST = 3
T = TypeVar("T")


def model_config(cfg: TrainConfig) -> GPTConfig:
    """The GPT the options describe."""
    assert cfg.vocab_size is not None  # resolve() fills it in
    return GPTConfig(vocab_size=cfg.vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                     n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias, mlp=cfg.mlp, norm=cfg.norm,
                     positions=cfg.positions,
                     activation_checkpointing=cfg.activation_checkpointing, sequence_parallel=cfg.sequence_parallel)


def _world(cfg: TrainConfig) -> int:
    assert cfg.dp is not None  # resolve() fills it in
    return cfg.tp * cfg.dp * cfg.pp


def on_gpu(cfg: TrainConfig) -> bool:
    """Whether the run computes on GPUs: one for each local rank (NCCL), or a GPU named by --device-name."""
    return cfg.device_name is not None or default_backend(local_ranks(_world(cfg))) == "nccl"


def layout_of(cfg: TrainConfig) -> Layout:
    """The layout the options describe. A rank's micro-batch is ``--batch-size / (dp x --grad-accum)``
    sequences at ``--pp 1`` (``--grad-accum`` of them a step), and that over ``--microbatches`` with
    pipeline stages (the schedule's micro-batches; ``--grad-accum`` repeats the whole schedule)."""
    assert cfg.dp is not None and cfg.microbatches is not None  # resolve() fills them in
    pipelined = cfg.pp > 1
    microbatches = cfg.microbatches if pipelined else cfg.grad_accum
    micro_batch = cfg.batch_size // (cfg.dp * cfg.grad_accum * (cfg.microbatches if pipelined else 1))
    compute = cfg.dtype or ("bf16" if on_gpu(cfg) else "fp32")  # the run's default (device.compute_dtype)
    layout = Layout(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp,
                  dp_sharding="fsdp" if cfg.fsdp else "zero" if cfg.zero else "ddp",
                  offload_optimizer=cfg.offload_optimizer, sequence_parallel=cfg.sequence_parallel,
                  activation_checkpointing=cfg.activation_checkpointing, micro_batch=micro_batch,
                  microbatches=microbatches, seq_len=cfg.block_size, schedule=cfg.schedule, dtype="float32",
                  autocast="bfloat16" if compute == "bf16" else None, optimizer="adamw",
                  stages_per_rank=cfg.stages_per_rank, bitwise=cfg.bitwise)
    return layout


def device_memory(cfg: TrainConfig) -> tuple[int, str]:
    """The bytes each rank may hold, and where they are: ``--memory``, else each GPU's total memory
    (a GPU for each local rank), else this host's available memory shared by its local ranks."""
    if cfg.memory is not None:
        return int(cfg.memory * 2**30), f"--memory {cfg.memory:g} GiB"
    local = local_ranks(_world(cfg))
    if cfg.device_name is not None and default_backend(local) != "nccl":
        raise ValueError(f"--device-name {cfg.device_name} plans for GPUs this host does not run the ranks on: give "
                         "their memory, --memory GIB (80 for an H100 80GB)")
    if default_backend(local) == "nccl":
        return torch.cuda.get_device_properties(0).total_memory, "the total memory of each rank's GPU"
    host = available_memory()
    return host // local, f"this host's {size(host)} of available memory over its {local} rank{'s' * (local > 1)}"


def available_memory() -> int:
    """This host's memory available to new processes (Linux's MemAvailable; else its physical memory)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_of(cfg: TrainConfig) -> str | None:
    """The device whose peak bounds the step time: --device-name, else this host's GPU when the run uses it."""
    if cfg.device_name is not None:
        return cfg.device_name
    return torch.cuda.get_device_name(0) if on_gpu(cfg) else None


def plan_of(cfg: TrainConfig, *, timed: bool = True) -> Plan:
    """The plan of the run; ``timed``: with the device's peak (:func:`timed_by`) for the step-time bound."""
    config, layout = model_config(cfg), layout_of(cfg)
    if not timed:
        return plan(config, layout)
    return timed_by(cfg, lambda device, peak: plan(config, layout, device=device, peak_flops=peak))


def timed_by(cfg: TrainConfig, call: Callable[[str | None, float | None], T]) -> T:
    """``call(device, peak_flops)`` with the run's device (:func:`device_of`) and --peak-tflops; again
    without the device when the planner does not know this host's GPU (no bound rather than no plan)."""
    peak, device = cfg.peak_tflops * 1e12 if cfg.peak_tflops is not None else None, device_of(cfg)
    try:
        return call(device, peak)
    except ValueError:
        if device is None or cfg.device_name is not None:
            raise
        return call(None, peak)


def need_bytes(cfg: TrainConfig, rank: RankPlan) -> int:
    """The bytes of ``rank`` that its memory must hold: its peak, and on the CPU also what it offloads
    to host memory (the same memory there; ``host_bytes``, where the planner counts it apart)."""
    return rank.peak_bytes + (0 if on_gpu(cfg) else rank.host_bytes)


def check(cfg: TrainConfig) -> None:
    """The plan's checks before a run (:func:`check_fits`) or before it is printed (--dry-run and
    --suggest: each rank's memory is known and the planner takes the layout and the device)."""
    if cfg.dry_run or cfg.suggest:
        device_memory(cfg)
        plan_of(cfg)
    elif not cfg.force:
        check_fits(cfg)


def check_fits(cfg: TrainConfig) -> None:
    """``ValueError`` when the plan's largest rank needs more than each rank's memory, naming the
    numbers and the nearest layouts of the same world that fit."""
    big = plan_of(cfg, timed=False).largest
    memory, where = device_memory(cfg)
    need = need_bytes(cfg, big)
    if need <= memory:
        return
    world = _world(cfg)
    config, layout = model_config(cfg), layout_of(cfg)
    found = timed_by(cfg, lambda device, peak: suggest(config, world, memory, base=layout, device=device,
                                                       peak_flops=peak))
    fits = nearest(Suggestions(tuple(p for p in found.fits if need_bytes(cfg, p.largest) <= memory), ()), cfg)
    fitting = (f"layouts of {world} rank{'s' * (world > 1)} that fit: "
               + "; ".join(f"{flags(p.layout, cfg, changed=True)} (peak {size(p.largest.peak_bytes)})" for p in fits)
               if fits else f"no layout of {world} rank{'s' * (world > 1)} fits (--suggest says why)")
    offloaded = f"; {size(need - big.peak_bytes)} offloaded to the same memory" if need > big.peak_bytes else ""
    raise ValueError(f"the plan's largest rank (tp rank {big.tp_rank}, stage {big.pp_stage}, dp rank {big.dp_rank}) "
                     f"peaks at {size(big.peak_bytes)} ({breakdown(big)}{offloaded}), more than the {size(memory)} "
                     f"each rank has ({where}); {fitting}; --force launches anyway, --dry-run shows the plan")


def nearest(suggestions: Suggestions, cfg: TrainConfig, count: int = NEAREST) -> list[Plan]:
    """The fitting layouts that change the fewest options of ``cfg``, the faster first among equals."""
    order = sorted(range(len(suggestions.fits)), key=lambda i: (len(options(suggestions.fits[i].layout, cfg,
                                                                                   changed=True)), i))
    return [suggestions.fits[i] for i in order[:count]]


def flags(layout: Layout, cfg: TrainConfig, *, changed: bool = False) -> str:
    """:func:`options` as a command line's words."""
    return " ".join(options(layout, cfg, changed=changed)) or "(as given)"


def options(layout: Layout, cfg: TrainConfig, *, changed: bool = False) -> list[str]:
    """The options that run ``layout`` on top of ``cfg``'s: those that differ (``changed``), or those
    and the mesh and every switch that is on. A layout of another dp keeps the micro-batch per rank:
    its ``--batch-size`` is scaled with it."""
    assert cfg.microbatches is not None  # resolve() fills it in
    pipelined = layout.pp > 1
    accum = cfg.grad_accum if pipelined else layout.microbatches
    microbatches = layout.microbatches if pipelined else 1
    batch = layout.micro_batch * layout.dp * accum * microbatches
    numbers: dict[str, tuple[object, object]] = {
        "tp": (layout.tp, cfg.tp), "dp": (layout.dp, cfg.dp), "pp": (layout.pp, cfg.pp),
        "schedule": (layout.schedule, cfg.schedule),
        "stages-per-rank": (layout.stages_per_rank, cfg.stages_per_rank),
        "microbatches": (microbatches, cfg.microbatches if cfg.pp > 1 else 1),
        "grad-accum": (accum, cfg.grad_accum), "batch-size": (batch, cfg.batch_size)}
    offload = layout.offload_optimizer
    switches = {"offload-optimizer": (offload, cfg.offload_optimizer),
                "fsdp": (layout.dp_sharding == "fsdp" and not offload, cfg.fsdp and not cfg.offload_optimizer),
                "zero": (layout.dp_sharding == "zero", cfg.zero),
                "sequence-parallel": (layout.sequence_parallel, cfg.sequence_parallel),
                "activation-checkpointing": (layout.activation_checkpointing, cfg.activation_checkpointing)}
    mesh = ("tp", "dp", "pp", "microbatches") if pipelined else ("tp", "dp", "pp")
    if pipelined and layout.pp != cfg.pp:  # --microbatches defaults to --pp: said whenever --pp changes
        numbers["microbatches"] = (microbatches, None)
    shown = [f"--{name} {new}" for name, (new, old) in numbers.items() if new != old or (not changed and name in mesh)]
    shown += [f"--{'' if new else 'no-'}{name}" for name, (new, old) in switches.items()
              if new != old or (not changed and new)]
    return shown


def breakdown(rank: RankPlan) -> str:
    """A rank's bytes by kind: ``parameters 1.2 GiB, gradients ...``."""
    kinds = (("parameters", "params_bytes"), ("gradients", "grads_bytes"), ("optimizer state", "optimizer_bytes"),
             ("activations", "activation_bytes"), ("largest transient", "transient_bytes"))
    return ", ".join(f"{name} {size(getattr(rank, attr))}" for name, attr in kinds)


def size(n: float) -> str:
    """Bytes for people: ``1.25 GiB``, ``310.4 MiB``, ``12.0 KiB``, ``512 B``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{int(n)} B"


def tokens(config: GPTConfig, layout: Layout) -> int:
    """The tokens of one optimizer step of ``layout``, over every dp rank."""
    return layout.dp * layout.micro_batch * layout.microbatches * (layout.seq_len or config.block_size)


def seconds(s: float | None) -> str:
    """A step-time bound for people (``-`` without a device peak)."""
    if s is None:
        return "-"
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"


def dry_run(cfg: TrainConfig) -> str:
    """What ``--dry-run`` prints: the plan as a table (with ``--json``: one JSON object, the plan's
    largest rank and step, the layout, the memory and whether it fits)."""
    p = plan_of(cfg)
    memory, where = device_memory(cfg)
    fits = need_bytes(cfg, p.largest) <= memory
    if cfg.json:
        return json.dumps({"layout": dataclasses.asdict(p.layout), "device": device_of(cfg), "memory_bytes": memory,
                           "fits": fits, **p.as_dict()})
    lines = [p.table()]
    if cfg.pp > 1 and cfg.grad_accum > 1:
        lines.append(f"(--grad-accum {cfg.grad_accum} runs the schedule {cfg.grad_accum} times a step: its FLOPs and "
                     "time are that many times those above; its memory is the same)")
    verdict = "fits" if fits else "does not fit: a run would be refused (--force launches anyway; --suggest lists " \
                                  "the layouts that fit)"
    lines.append(f"memory: the largest rank peaks at {size(p.largest.peak_bytes)} of the {size(memory)} each rank has "
                 f"({where}): {verdict}")
    return "\n".join(lines)


def suggestions(cfg: TrainConfig) -> str:
    """What ``--suggest`` prints: the layouts of the run's world that fit each rank's memory, fastest
    first (per token: a layout of another dp runs another batch), then every one rejected with its reason."""
    world, (memory, where) = _world(cfg), device_memory(cfg)
    config, base = model_config(cfg), layout_of(cfg)
    found = timed_by(cfg, lambda device, peak: suggest(config, world, memory, base=base, device=device,
                                                       peak_flops=peak))
    shown = [flags(p.layout, cfg) for p in found.fits] + [flags(layout, cfg) for layout, _ in found.rejected]
    width = max(map(len, shown), default=0)
    lines = [f"layouts of {world} rank{'s' * (world > 1)} with {size(memory)} each ({where}), the micro-batch per "
             f"rank and the rest as given; device {device_of(cfg) or 'cpu'}",
             f"fit ({len(found.fits)}, fastest first):"]
    lines += [f"  {flags(p.layout, cfg):<{width}}  peak {size(p.largest.peak_bytes):>10}  step >= "
              f"{seconds(p.step_time_s)} for {tokens(config, p.layout):,} tokens" for p in found.fits]
    lines.append(f"rejected ({len(found.rejected)}):")
    lines += [f"  {flags(layout, cfg):<{width}}  {reason}" for layout, reason in found.rejected]
    return "\n".join(lines)

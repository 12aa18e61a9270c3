"""A plan as a readable table: one row per distinct rank (the ranks that hold the same bytes together),
then the step's FLOPs, its time bound and the MFU that bound implies."""

from __future__ import annotations

from typing import Any

COLUMNS = (("params", "params_bytes"), ("grads", "grads_bytes"), ("optimizer", "optimizer_bytes"),
           ("activations", "activation_bytes"), ("transient", "transient_bytes"), ("peak", "peak_bytes"))
HOST = ("host", "host_bytes")
BUCKETS = ("DDP buckets", "ddp_bucket_bytes")


def format_bytes(n: float) -> str:
    """``n`` bytes in GiB from 1 GiB up, else MiB from 1 MiB up, else KiB (``0`` for none)."""
    if n == 0:
        return "0"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 2**10:.2f} KiB"


def format_flops(n: float) -> str:
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.3g} FLOP"


def _span(values: set[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"``."""
    runs: list[list[int]] = []
    for v in sorted(values):
        if runs and v == runs[-1][-1] + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)


def _label(ranks: list[Any]) -> str:
    return (f"tp {_span({r.tp_rank for r in ranks})} pp {_span({r.pp_stage for r in ranks})} "
            f"dp {_span({r.dp_rank for r in ranks})}" + (f" ({len(ranks)})" if len(ranks) > 1 else ""))


def format_table(plan: Any) -> str:
    """The table of ``plan`` (see the module's docstring)."""
    columns = COLUMNS[:3] + ((BUCKETS,) if any(r.ddp_bucket_bytes for r in plan.ranks) else ()) + COLUMNS[3:] \
        + ((HOST,) if any(r.host_bytes for r in plan.ranks) else ()) + (("FLOPs", "flops"),)
    groups: dict[tuple[float, ...], list[Any]] = {}
    for r in plan.ranks:
        groups.setdefault(tuple(getattr(r, key) for _, key in columns), []).append(r)
    header = ["ranks", *(name for name, _ in columns)]
    rows = [[_label(ranks), *(format_flops(v) if key == "flops" else format_bytes(v)
                              for (_, key), v in zip(columns, values, strict=True))]
            for values, ranks in groups.items()]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in [header, *rows]]
    lay, big = plan.layout, plan.largest
    sharding = lay.dp_sharding + (" + offload" if lay.offload_optimizer else "")
    title = (f"plan: tp={lay.tp} pp={lay.pp} dp={lay.dp} ({sharding}), "
             f"{'sequence parallel, ' if lay.sequence_parallel else ''}"
             f"{'activation checkpointing, ' if lay.activation_checkpointing else ''}"
             f"micro-batch {lay.micro_batch} x {lay.seq_len or plan.config.block_size} tokens x "
             f"{lay.microbatches}, {lay.dtype}{' autocast ' + lay.autocast if lay.autocast else ''}, {lay.optimizer}")
    lines = [title, lines[0], "  ".join("-" * w for w in widths), *lines[1:]]
    lines.append(f"largest: {big.where}, peak {format_bytes(big.peak_bytes)}")
    lines.append(f"FLOPs per step: {format_flops(plan.flops_per_step)} model, "
                 f"{format_flops(plan.hardware_flops_per_step)} run by the ranks"
                 + (f"; pipeline bubble {plan.bubble:.1%}" if lay.pp > 1 else ""))
    time, mfu = plan.step_time_s, plan.mfu
    if time is None or mfu is None or plan.peak_flops is None:
        lines.append("step time: no bound (give a device or a peak FLOP/s)")
    else:
        lines.append(f"step time >= {time * 1e3:.3g} ms at {plan.peak_flops / 1e12:g} TFLOP/s per device"
                     + (f" ({plan.device})" if plan.device else "") + f": MFU <= {mfu:.1%}")
    return "\n".join(lines + [f"note: {n}" for n in plan.notes])

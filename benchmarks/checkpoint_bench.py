"""Distributed checkpoints: save and load time and peak memory per rank against model size, at tp 1, 2, 4.

    python benchmarks/checkpoint_bench.py [--tp 1 2 4] [--n-layer 4] [--n-embd 384] [--vocab-size 8192]

Each rank (one thread) builds the GPT, takes one AdamW step (so the optimizer
holds its state), then saves a checkpoint with ``tensorpar.checkpoint.save`` and
loads it into a second, identical model and optimizer with
``tensorpar.checkpoint.load``. Times are the slowest rank's. Memory is the
rank's peak resident set during the call less its resident set just before
(Linux: freed heap memory is first returned to the system with ``malloc_trim``,
then the peak is reset through ``/proc/self/clear_refs``); it counts the
pages of the checkpoint files a load maps. A rank's checkpoint shard is the
file it writes: its tp shard of the model and the optimizer state, its share of
the replicated tensors, and its generator states. A save streams the shard
from the model's own memory; a load reads it into fresh buffers before
anything is modified, so its peak should be about the shard, never the model.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import tensorpar
from layers import GPT, GPTConfig
from tensorpar import checkpoint

CONFIG = dict(n_layer=4, n_head=6, n_embd=384, vocab_size=8192, block_size=256, bias=False)
_ELEMENT = {"F32": 4, "F64": 8, "BF16": 2, "F16": 2, "U8": 1, "I64": 8, "I32": 4}


def _status(field: str) -> int | None:
    """A ``/proc/self/status`` figure in bytes (None where there is no such file)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak() -> None:
    """Return freed heap memory to the system (else new buffers reuse it unseen), then reset the peak."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
    except OSError:
        pass


def _measured(fn: Any) -> tuple[float, int | None]:
    """``(seconds, peak resident bytes above the start)`` of ``fn()``, after every rank is ready."""
    dist.barrier()
    _reset_peak()
    before = _status("VmRSS")
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    return seconds, None if peak is None or before is None else max(peak - before, 0)


def _trained(config: dict[str, Any]) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**config))
    optimizer = torch.optim.AdamW(model.parameters())
    idx = torch.randint(0, config["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(0))
    model(idx, idx).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def rank_figures(config: dict[str, Any], directory: str) -> dict[str, Any]:
    """On every rank: save and load seconds and peak bytes, this rank's shard and held bytes."""
    mesh = tensorpar.init()
    torch.set_num_threads(1)
    model, optimizer = _trained(config)
    save_s, save_peak = _measured(lambda: checkpoint.save(directory, model, optimizer, step=0, keep=1))
    other, other_optimizer = _trained(config)
    load_s, load_peak = _measured(lambda: checkpoint.load(directory, other, other_optimizer))
    meta = checkpoint.read_meta(directory)
    shard = Path(meta["path"]) / f"__{mesh.rank}_0.distcp"  # DCP's FileSystemWriter: one file per rank
    model_bytes = sum(t.numel() * t.element_size() for t in tensorpar.full_state_dict(model).values())  # after timing
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    held += sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values())
    return {"save s": save_s, "load s": load_s, "save peak": save_peak, "load peak": load_peak,
            "shard": shard.stat().st_size, "held": held, "model": model_bytes,
            "checkpoint": sum(f["bytes"] for f in meta["files"].values())}


def measure(tp_sizes: list[int], config: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    """``{tp: every rank's figures}``, each tp in its own processes and its own directory."""
    results = {}
    for tp in tp_sizes:
        with tempfile.TemporaryDirectory(prefix="tensorpar-ckpt-bench-") as directory:
            results[tp] = tensorpar.spawn(rank_figures, tp, config, directory)
    return results


def table(results: dict[int, list[dict[str, Any]]]) -> str:
    """A markdown table of ``measure``'s figures (times: the slowest rank; memory: the largest rank)."""
    mib = 2**20

    def most(rows: list[dict[str, Any]], key: str) -> str:
        values = [r[key] for r in rows]
        return "n/a" if None in values else f"{max(values) / mib:.1f}"

    head = ("| tp | save s | load s | peak RSS delta per rank, save MiB | load MiB | model MiB | checkpoint MiB "
            "| largest rank shard MiB | largest rank holds (model + AdamW) MiB |")
    lines = [head, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for tp, rows in results.items():
        lines.append(f"| {tp} | {max(r['save s'] for r in rows):.2f} | {max(r['load s'] for r in rows):.2f} "
                     f"| {most(rows, 'save peak')} | {most(rows, 'load peak')} | {rows[0]['model'] / mib:.1f} "
                     f"| {rows[0]['checkpoint'] / mib:.1f} | {most(rows, 'shard')} | {most(rows, 'held')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--n-layer", type=int, default=CONFIG["n_layer"])
    parser.add_argument("--n-embd", type=int, default=CONFIG["n_embd"])
    parser.add_argument("--n-head", type=int, default=CONFIG["n_head"])
    parser.add_argument("--vocab-size", type=int, default=CONFIG["vocab_size"])
    args = parser.parse_args()
    config = dict(CONFIG, n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, vocab_size=args.vocab_size)
    results = measure(args.tp, config)
    print(f"Checkpoint save and load (model + AdamW state, fp32, one thread per rank), GPT n_layer={args.n_layer}, "
          f"n_embd={args.n_embd}, {args.n_head} heads, vocab {args.vocab_size}:\n")
    print(table(results))


if __name__ == "__main__":
    main()

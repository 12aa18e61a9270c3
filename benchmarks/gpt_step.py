"""The whole GPT training step: our GPT at tp=1 against a plain nanoGPT-style model, eager and compiled.

    PYTHONPATH=. python benchmarks/gpt_step.py [--device cuda|cpu] [--size gpt2|small|tiny] [--batch 16 --seq 1024]
                                  [--dtype bf16|fp32] [--no-compile] [--json PATH] [--write] [--ops-only]

One step is what a training loop does: forward with targets to the loss (under
bf16 autocast on a GPU by default), backward, gradient clipping to norm 1
(``tensorpar.clip_grad_norm_`` for ours, ``torch.nn.utils.clip_grad_norm_`` for
the plain model), an AdamW step (``fused=True``) and ``zero_grad``. Both models
have the same configuration and the same weights (our full state dict, with Q, K
and V concatenated where ours keeps them apart, is loaded into the plain one).
Rounds interleave the four contenders (ours and plain, eager and
``torch.compile``\\ d); figures are medians of the rounds, each timed over several
steps with the device synchronised around them.

Printed: ms per step, tokens/s, model-FLOPs utilisation against the device's dense
peak for the dtype (:mod:`examples.train.hardware`; blank where the device is
not known, any CPU), and the ratio plain / ours (>= 1.0: ours is as fast or
faster). Then the aten ops dispatched by one whole eager step of each model, counted
by a ``TorchDispatchMode`` (after a first step, so AdamW's state exists), their
ratio ours / plain, and the ops ours runs more often than the plain model.

Defaults: GPT-2 124M (vocab 50304), B16 x T1024 in bf16 on a GPU; a small model in
float32 on CPU, eager only, which runs in seconds.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import tensorpar
from examples.train.hardware import model_flops_per_token, peak_tflops
from gpu import timer
from layers import GPT, GPTConfig
from plain_gpt import PlainGPT
from results import machine, write_section

#: (model shape, batch, sequence length) of each ``--size``.
SIZES: dict[str, tuple[dict[str, int], int, int]] = {
    "gpt2": (dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, block_size=1024), 16, 1024),
    "small": (dict(n_layer=4, n_head=4, n_embd=128, vocab_size=4096, block_size=128), 4, 128),
    "tiny": (dict(n_layer=2, n_head=4, n_embd=32, vocab_size=256, block_size=32), 2, 32),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def plain_state_dict(ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our GPT's full state dict with nanoGPT's fused ``c_attn`` (``[Q | K | V]``) where ours has
    ``q_proj``, ``k_proj`` and ``v_proj``."""
    out = {}
    for key, value in ours.items():
        prefix, found, leaf = key.rpartition(".q_proj.")
        if found:
            out[f"{prefix}.c_attn.{leaf}"] = torch.cat([ours[f"{prefix}.{p}.{leaf}"] for p in ("q_proj", "k_proj",
                                                                                               "v_proj")])
        elif ".k_proj." not in key and ".v_proj." not in key:
            out[key] = value
    return out


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active, by name (``aten.mm.default`` ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager[Any]:
    """Autocast to ``dtype`` on ``device``; nothing for float32."""
    return torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()


def training_phases(model: nn.Module, clip: Callable[[], Any], optimizer: torch.optim.Optimizer,
                    idx: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype) -> dict[str, Callable[[], None]]:
    """The phases of one training step of ``model`` on ``idx``/``targets``, to be run in order."""
    loss: list[torch.Tensor] = []

    def forward() -> None:
        with autocast(idx.device, dtype):
            loss.append(model(idx, targets))

    def optimize() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"forward": forward, "backward": lambda: loss.pop().backward(), "clip": clip, "optimizer": optimize}


def whole_step(phases: dict[str, Callable[[], None]]) -> Callable[[], None]:
    def step() -> None:
        for phase in phases.values():
            phase()
    return step


def count_ops(phases: dict[str, Callable[[], None]]) -> dict[str, collections.Counter[str]]:
    """The aten ops each phase of one training step dispatches."""
    counts = {}
    for name, phase in phases.items():
        with OpCounter() as counter:
            phase()
        counts[name] = counter.counts
    return counts


def op_table(ours: dict[str, collections.Counter[str]], plain: dict[str, collections.Counter[str]],
             top: int = 8) -> str:
    """The ops of each phase and of the whole step, and the ops ours runs most often more than plain."""
    rows = [(phase, ours[phase].total(), plain[phase].total()) for phase in ours]
    rows.append(("whole step", sum(r[1] for r in rows), sum(r[2] for r in rows)))
    every_ours, every_plain = sum(ours.values(), collections.Counter()), sum(plain.values(), collections.Counter())
    more = sorted(((every_ours[k] - every_plain[k], k) for k in every_ours.keys() | every_plain.keys()
                   if every_ours[k] > every_plain[k]), reverse=True)
    return ("aten ops per eager training step (target: whole step ours / plain <= 1.10)\n\n"
            "| phase | ours | plain | ours / plain |\n|---|---:|---:|---:|\n"
            + "\n".join(f"| {name} | {o} | {p} | {o / max(p, 1):.3f} |" for name, o, p in rows)
            + "\n\n| op ours runs more | ours | plain |\n|---|---:|---:|\n"
            + "\n".join(f"| {k} | {every_ours[k]} | {every_plain[k]} |" for _, k in more[:top]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=SIZES, help="the model, batch and length (default: gpt2 on a GPU, "
                                                      "small on CPU)")
    parser.add_argument("--batch", type=int, help="rows per step (default: the size's)")
    parser.add_argument("--seq", type=int, help="tokens per row (default: the size's block_size)")
    parser.add_argument("--dtype", choices=DTYPES, help="autocast dtype of the forward; fp32: no autocast "
                                                        "(default: bf16 on a GPU, fp32 on CPU)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction,
                        help="also time both models torch.compile'd (default: on a GPU)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default: 7 on a GPU, 5 on CPU)")
    parser.add_argument("--iters", type=int, help="steps timed per round (default: 10 on a GPU, 2 on CPU)")
    parser.add_argument("--ops-only", action="store_true", help="count the aten ops only (no timing)")
    parser.add_argument("--json", type=Path, help="write the figures to this JSON file")
    parser.add_argument("--write", action="store_true", help="record the figures in benchmarks/RESULTS.md")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    for name, on_gpu, on_cpu in (("size", "gpt2", "small"), ("dtype", "bf16", "fp32"), ("compile", True, False),
                                 ("rounds", 7, 5), ("iters", 10, 2)):
        if getattr(args, name) is None:
            setattr(args, name, on_gpu if cuda else on_cpu)
    shape, batch, seq = SIZES[args.size]
    batch, seq = args.batch or batch, args.seq or seq
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    config = GPTConfig(**{**shape, "block_size": max(seq, shape["block_size"])})

    tensorpar.init(tp=1, backend=None if cuda else "gloo")  # one process: a world of one
    torch.manual_seed(0)
    ours = GPT(config, device=device)
    plain = PlainGPT(config).to(device)
    plain.load_state_dict(plain_state_dict(ours.full_state_dict()))
    idx = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    targets = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    with torch.no_grad(), autocast(device, dtype):  # the same function: rounding apart
        loss, plain_loss = ours(idx, targets).item(), plain(idx, targets).item()
    gap = abs(loss - plain_loss)
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
                  for name, model in (("ours", ours), ("plain", plain))}
    clips = {"ours": lambda: tensorpar.clip_grad_norm_(ours, 1.0),
             "plain": lambda: torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)}
    models: dict[str, nn.Module] = {"ours": ours, "plain": plain}
    phases = {name: training_phases(model, clips[name], optimizers[name], idx, targets, dtype)
              for name, model in models.items()}
    steps = {name: whole_step(p) for name, p in phases.items()}
    for step in steps.values():  # AdamW creates its state; nothing is counted yet
        step()
    ops = {name: count_ops(p) for name, p in phases.items()}
    total = {name: sum(c.total() for c in counts.values()) for name, counts in ops.items()}
    op_text = op_table(ops["ours"], ops["plain"])
    figures: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "CPU", "torch": torch.__version__,
        "config": asdict(config), "batch": batch, "seq": seq, "dtype": args.dtype,
        "loss": plain_loss, "loss_gap": gap,
        "ops": {"ours": total["ours"], "plain": total["plain"], "ratio": total["ours"] / total["plain"],
                "phases": {name: {phase: c.total() for phase, c in counts.items()} for name, counts in ops.items()}}}
    print(f"{figures['device']}, torch {torch.__version__}; {args.size}: {shape}, B={batch}, T={seq}, {args.dtype}; "
          f"loss {plain_loss:.4f}; |loss ours - loss plain| at the same weights: {gap:.2e}\n")
    print(op_text)
    if not args.ops_only:
        if args.compile:
            steps |= {f"{name} compiled": whole_step(training_phases(torch.compile(model), clips[name],
                                                                     optimizers[name], idx, targets, dtype))
                      for name, model in models.items()}
        med = time_steps(steps, args.rounds, args.iters, device)
        n_params = sum(p.numel() for p in plain.parameters()) - plain.transformer.wpe.weight.numel()
        per_token = model_flops_per_token(n_params, config.n_layer, config.n_head, config.n_embd // config.n_head, seq)
        peak = peak_tflops(device, dtype)
        figures |= {"flops_per_token": per_token, "peak_tflops": peak,
                    "steps": step_figures(med, batch * seq, per_token, peak)}
        text = step_table(figures["steps"])
        print("\n" + text)
        if args.write:
            write_section(f"Whole training step: GPT at tp=1 against a plain nanoGPT-style model ({figures['device']})",
                          f"{machine()}; {args.size} {shape}, B={batch}, T={seq}, {args.dtype}; medians of "
                          f"{args.rounds} interleaved rounds x {args.iters} steps (`python benchmarks/gpt_step.py "
                          f"--write`).\n\n{text}\n\n{op_text}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


def time_steps(steps: dict[str, Callable[[], None]], rounds: int, iters: int,
               device: torch.device) -> dict[str, float]:
    """Median seconds per step of each of ``steps``, over ``rounds`` interleaved rounds of ``iters`` steps."""
    run = timer(device)

    def repeat(step: Callable[[], None]) -> Callable[[], None]:
        def fn() -> None:
            for _ in range(iters):
                step()
        return fn

    for step in steps.values():  # warm-up (and compilation)
        for _ in range(2):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(run(repeat(step)) / iters)
    return {name: statistics.median(t) for name, t in times.items()}


def step_figures(med: dict[str, float], tokens: int, per_token: int, peak: float | None) -> dict[str, dict[str, Any]]:
    """For each timed contender: ms per step, tokens/s, MFU (``None`` without a known peak) and, for
    ours, the ratio plain / ours of the same mode (eager or compiled)."""
    figures = {}
    for name, s in med.items():
        mode = name.removeprefix("ours").removeprefix("plain")
        figures[name] = {"ms": s * 1e3, "tokens_per_s": tokens / s,
                         "mfu": tokens * per_token / s / (peak * 1e12) if peak else None,
                         "plain_over_ours": med["plain" + mode] / s if name.startswith("ours") else None}
    return figures


def step_table(figures: dict[str, dict[str, Any]]) -> str:
    rows = [f"| {name if ' ' in name else name + ' eager'} | {f['ms']:.2f} | {f['tokens_per_s']:,.0f} | "
            + (f"{100 * f['mfu']:.1f}%" if f["mfu"] is not None else "") + " | "
            + (f"{f['plain_over_ours']:.3f}" if f["plain_over_ours"] is not None else "") + " |"
            for name, f in figures.items()]
    return ("| model | ms / step | tokens / s | MFU | plain / ours (target >= 1.0) |\n|---|---:|---:|---:|---:|\n"
            + "\n".join(rows))


if __name__ == "__main__":
    main()

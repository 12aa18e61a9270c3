"""Pipeline bubbles: each stage's idle fraction and peak in-flight micro-batches, GPipe against 1F1B.

    python benchmarks/pipeline_bubble.py [--pp 2 4] [--microbatches 4 8] [--steps 3] [--write]

A stage's idle fraction is the part of a step it spends outside its forward and
backward chunks (:class:`tensorpar.pipeline.StageTimes`): waiting for a
neighbour. With ``p`` stages of equal cost and ``m`` micro-batches, both
schedules leave each stage idle ``(p - 1) / (m + p - 1)`` of the step. GPipe
holds the activations of all ``m`` micro-batches at its peak, 1F1B at most
``p - s`` on stage ``s``.

Two kinds of stage are measured, under ``tensorpar.spawn`` (one process per stage):

* *timed*: each stage's forward sleeps ``--forward-ms`` and its backward twice
  as long. Sleeping needs no CPU, so stages do not compete for cores and the
  waiting measured is the schedule's own even at pp=4 on 2 cores;
* *GPT*: a small GPT, one block per stage (pp=2 only by default: a stage per core).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from torch import nn

import tensorpar
from layers import GPTConfig, PipelinedGPT
from results import machine, write_section
from tensorpar.pipeline import Pipeline


class _Sleep(torch.autograd.Function):
    """Identity that costs ``seconds`` forward and twice that backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(2 * ctx.seconds)
        return grad, None


class TimedStage(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x * self.weight, self.seconds)


def measure(kind: str, schedule: str, microbatches: int, steps: int, seconds: float) -> list[tuple[int, float, int]]:
    """``(stage, idle fraction, peak in-flight)`` of this rank's stage over ``steps`` steps after one warm-up."""
    mesh = tensorpar.current_mesh()
    torch.set_num_threads(1)
    if kind == "timed":
        pipe = Pipeline([TimedStage(seconds)], [mesh.pp_rank], schedule=schedule, microbatches=microbatches,
                        loss_fn=lambda out, _: out.mean(), stage_shapes=lambda stage, micro: (micro, micro), timed=True)
        batch = torch.ones(microbatches, 8), torch.zeros(microbatches)
    else:
        tensorpar.manual_seed(0)
        config = GPTConfig(n_layer=mesh.pp, n_head=4, n_embd=256, vocab_size=256, block_size=128, bias=False)
        pipe = PipelinedGPT(config).pipeline(schedule, microbatches, timed=True)
        idx = torch.randint(0, 256, (2 * microbatches, 128))
        batch = idx, idx
    pipe.step(*batch)  # warm-up
    pipe.reset_times()
    for _ in range(steps):
        pipe.step(*batch)
    return [(t.stage, t.idle_fraction, t.peak_in_flight) for t in pipe.times()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--forward-ms", type=float, default=20.0)
    parser.add_argument("--gpt-pp", type=int, nargs="*", default=[2], help="pipeline sizes for the GPT stages")
    parser.add_argument("--write", action="store_true", help="record the table in benchmarks/RESULTS.md")
    args = parser.parse_args()
    lines = ["| stages | kind | m | schedule | ideal (p-1)/(m+p-1) | idle fraction by stage "
             "| peak in-flight by stage |",
             "|---:|---|---:|---|---:|---|---|"]
    print("\n".join(lines))
    for kind, sizes in (("timed", args.pp), ("GPT", args.gpt_pp)):
        for pp in sizes:
            cases = [(m, schedule) for m in args.microbatches for schedule in ("gpipe", "1f1b")
                     if schedule == "gpipe" or m >= pp]  # 1F1B needs a micro-batch per stage
            if not cases:
                continue
            per_rank = tensorpar.spawn(_run, pp, kind, cases, args.steps, args.forward_ms / 1000)  # one job per size
            for i, (m, schedule) in enumerate(cases):
                rows = sorted(r for rank in per_rank for r in rank[i])
                idle = ", ".join(f"{f:.3f}" for _, f, _ in rows)
                peak = ", ".join(str(n) for _, _, n in rows)
                lines.append(f"| {pp} | {kind} | {m} | {schedule} | {(pp - 1) / (m + pp - 1):.3f} | {idle} | "
                             f"{peak} |")
                print(lines[-1], flush=True)
    if args.write:
        write_section("Pipeline bubbles (benchmarks/pipeline_bubble.py)",
                      f"{machine()}; gloo, one thread per rank, {args.steps} steps after a warm-up; timed stages "
                      f"sleep {args.forward_ms:g} ms forward and twice that backward.\n\n" + "\n".join(lines))


def _run(kind: str, cases: list[tuple[int, str]], steps: int,
         seconds: float) -> list[list[tuple[int, float, int]]]:
    """On each rank of one job: every ``(microbatches, schedule)`` case in turn, each a fresh pipeline."""
    tensorpar.init(tp=1, pp=torch.distributed.get_world_size())  # one stage per rank
    return [measure(kind, schedule, m, steps, seconds) for m, schedule in cases]


if __name__ == "__main__":
    main()

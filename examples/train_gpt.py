"""Train a small byte-level GPT with tensor x data parallelism.

    python examples/train_gpt.py                         # tp=2, dp=1 on local CPU processes
    python examples/train_gpt.py --tp 2 --dp 2 --zero    # 4 processes, optimizer state sharded over dp
    python examples/train_gpt.py --tp 2 --dp 2 --fsdp    # parameters, gradients and optimizer state too
    python examples/train_gpt.py --data my.txt --steps 2000 --out run1
    torchrun --nproc-per-node 8 examples/train_gpt.py --tp 4 --n-layer 12 --n-embd 768 --n-head 12

With plain ``python`` it starts tp x dp local processes itself (gloo on CPU,
NCCL when there is a GPU per rank); under ``torchrun`` each process is one
rank and dp = world / tp. Tensor parallelism is inside a node-local group of
tp ranks, data parallelism (``DistributedDataParallel`` on the dp group,
optionally ``ZeroRedundancyOptimizer``) across them, or FSDP2 with the tp
shards inside (``--fsdp``: ``tensorpar.fully_shard_dp``). AdamW, cosine LR with
warmup, gradient clipping by the norm of the whole unsharded gradient,
gradient accumulation; float32 on CPU, bf16 autocast on GPU. ``--compile``
compiles each block whole (``torch.compile``), ``--activation-checkpointing``
recomputes each block in backward. Checkpoints go through
``torch.distributed.checkpoint``: each rank writes its own shards.

The data is bytes of text (the built-in corpus unless ``--data``), drawn
deterministically per step: a run resumed from a checkpoint (``--resume``, at
any tp or dp) continues exactly where it stopped. Rank 0 shows a progress bar,
writes ``OUT/metrics.jsonl`` and ``OUT/loss.png``, and prints a sample.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import tensorpar
from layers import GPT, GPTConfig
from tensorpar import checkpoint
from tensorpar.random import mix_seed
from tensorpar.training import VOCAB_SIZE, ByteData, cosine_lr, default_corpus, open_log, plot, progress


@dataclass
class TrainConfig:
    tp: int = 2
    dp: int = 1
    steps: int = 500
    batch_size: int = 16  # sequences per optimizer step, over all dp ranks and micro-batches
    grad_accum: int = 1
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False  # nanoGPT's train.py default
    activation_checkpointing: bool = False  # recompute each block in backward: less memory, one more forward
    compile: bool = False  # torch.compile each block whole (fullgraph), its collectives in the graph
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 20
    weight_decay: float = 0.1
    clip: float = 1.0  # 0: no clipping
    zero: bool = False
    fsdp: bool = False  # FSDP2 over dp instead of DDP (and instead of --zero)
    seed: int = 1337
    data: str | None = None
    out: str | None = "out"
    ckpt_every: int = 100
    resume: bool = False
    stop_at: int | None = None  # end this run after this step (with a checkpoint); resume it later
    sample_tokens: int = 200
    progress: bool = True

    def __post_init__(self) -> None:
        if self.fsdp and self.zero:
            raise ValueError("--fsdp and --zero exclude each other: --fsdp shards the optimizer state over dp itself")


def build(cfg: TrainConfig, mesh: tensorpar.Mesh) -> tuple[GPT, torch.optim.Optimizer]:
    tensorpar.manual_seed(cfg.seed)  # the same full weights at any tp and dp
    model = GPT(GPTConfig(vocab_size=VOCAB_SIZE, block_size=cfg.block_size, n_layer=cfg.n_layer,
                          n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias,
                          activation_checkpointing=cfg.activation_checkpointing),
                device=mesh.device)
    if cfg.fsdp:  # before the optimizer: FSDP2 replaces the parameters by their dp shards
        tensorpar.fully_shard_dp(model, mesh, modules=model.transformer.h)
    if cfg.compile:  # block by block, as FSDP2 and activation checkpointing wrap them
        for block in model.transformer.h:
            block.compile(fullgraph=True)
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # no decay: biases, norms
    if cfg.zero and mesh.dp > 1:
        optimizer: torch.optim.Optimizer = ZeroRedundancyOptimizer(
            groups, optimizer_class=torch.optim.AdamW, process_group=mesh.dp_group, lr=cfg.lr, betas=(0.9, 0.95))
    else:
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))
    return model, optimizer


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run on every rank of the current mesh; rank 0 returns the losses and the final full weights."""
    mesh = tensorpar.current_mesh()
    lead = mesh.rank == 0
    data = ByteData.from_file(cfg.data, seed=cfg.seed) if cfg.data else ByteData.from_text(default_corpus(),
                                                                                          seed=cfg.seed)
    model, optimizer = build(cfg, mesh)
    start = 0
    out = Path(cfg.out) if cfg.out else None
    if cfg.resume and out and (out / "latest").exists():
        meta = checkpoint.load(out, model, optimizer)
        start = meta["step"] + 1
    ddp = DistributedDataParallel(model, process_group=mesh.dp_group) if mesh.dp > 1 and not cfg.fsdp else model
    cuda = mesh.device.type == "cuda"
    if lead and out:
        out.mkdir(parents=True, exist_ok=True)
    log = open_log(out, start) if lead and out else None
    bar = progress(cfg.steps, start, f"train tp={cfg.tp} dp={cfg.dp}") if lead and cfg.progress else None
    losses: dict[int, float] = {}
    norms: dict[int, float] = {}
    tokens_per_step = cfg.batch_size * cfg.block_size
    last = cfg.steps - 1 if cfg.stop_at is None else min(cfg.stop_at, cfg.steps - 1)
    for step in range(start, last + 1):
        began = time.perf_counter()
        lr = cosine_lr(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup=cfg.warmup, total=cfg.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        tensorpar.manual_seed(mix_seed(cfg.seed, step, 1), mesh)  # dropout depends on the step alone
        loss_sum = torch.zeros((), device=mesh.device)
        for micro in range(cfg.grad_accum):
            x, y = data.batch(step, micro, batch_size=cfg.batch_size, block_size=cfg.block_size,
                              accum=cfg.grad_accum, dp=mesh.dp, dp_rank=mesh.dp_rank)
            reduce = micro == cfg.grad_accum - 1  # the gradients go over dp after the last micro-batch only
            if cfg.fsdp:
                model.set_requires_gradient_sync(reduce)
            sync = contextlib.nullcontext() if mesh.dp == 1 or cfg.fsdp or reduce else ddp.no_sync()
            autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
            with sync:  # no gradient all-reduce over dp until the last micro-batch
                with autocast:
                    loss = ddp(x.to(mesh.device), y.to(mesh.device)) / cfg.grad_accum
                loss.backward()
            loss_sum += loss.detach()
        norm = tensorpar.clip_grad_norm_(model, cfg.clip) if cfg.clip else tensorpar.grad_norm(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if mesh.dp > 1:  # the step's loss over the whole batch, for the log
            dist.all_reduce(loss_sum, group=mesh.dp_group)
            loss_sum /= mesh.dp
        losses[step], norms[step] = loss_sum.item(), norm.item()
        seconds = time.perf_counter() - began
        if out and ((cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0) or step == last):
            checkpoint.save(out, model, optimizer, step=step, mesh=mesh,
                            extra={"data_position": {"step": step + 1, "tokens": (step + 1) * tokens_per_step},
                                   "train_config": dataclasses.asdict(cfg)})
        if log:
            log.write(json.dumps({"step": step, "loss": losses[step], "lr": lr, "grad_norm": norm.item(),
                                  "tokens_per_s": tokens_per_step / seconds, "tp": mesh.tp, "dp": mesh.dp}) + "\n")
            log.flush()
        if bar:
            bar.set_postfix(loss=f"{losses[step]:.3f}", tok_s=f"{tokens_per_step / seconds:,.0f}")
            bar.update()
    if bar:
        bar.close()
    if log:
        log.close()
    sample = _sample(model, cfg, mesh) if cfg.sample_tokens and last == cfg.steps - 1 else None
    full = model.full_state_dict() if mesh.dp_rank == 0 or cfg.fsdp else None  # FSDP: gathered over dp too
    if not lead:
        return {}
    if out and losses:
        plot(out)
    return {"losses": losses, "grad_norms": norms, "sample": sample, "state": full}


def _sample(model: GPT, cfg: TrainConfig, mesh: tensorpar.Mesh) -> str:
    model.eval()
    if cfg.fsdp:  # generate() reads the root's own parameters outside its forward
        model.unshard()
    prompt = torch.tensor([list(b"The ")], device=mesh.device)
    torch.manual_seed(cfg.seed)
    tokens = model.generate(prompt, cfg.sample_tokens, temperature=0.8, top_k=40)[0].tolist()
    if cfg.fsdp:
        model.reshard()
    model.train()
    return ByteData.decode(tokens)


def spawned(cfg: TrainConfig) -> dict[str, Any]:
    """One rank of a local run started by ``tensorpar.spawn``."""
    tensorpar.init(cfg.tp, cfg.dp)
    torch.set_num_threads(1)
    return train(cfg)


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(TrainConfig):
        name = "--" + f.name.replace("_", "-")
        kind = str(f.type).removesuffix(" | None")
        if kind == "bool":
            parser.add_argument(name, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            parser.add_argument(name, type={"int": int, "float": float}.get(kind, str), default=f.default)
    try:
        cfg = TrainConfig(**vars(parser.parse_args(argv)))
    except ValueError as e:
        parser.error(str(e))
    if cfg.out in ("", "none"):
        cfg.out = None
    return cfg


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    began = time.perf_counter()
    if "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        mesh = tensorpar.init(cfg.tp, None if cfg.dp == 1 else cfg.dp)
        cfg = dataclasses.replace(cfg, dp=mesh.dp)
        result = train(cfg)
        if mesh.rank:
            return
    else:
        result = tensorpar.spawn(spawned, cfg.tp * cfg.dp, cfg)[0]
    losses = result["losses"]
    if losses:
        first, last = losses[min(losses)], losses[max(losses)]
        print(f"loss {first:.3f} -> {last:.3f} over steps {min(losses)}-{max(losses)} "
              f"in {time.perf_counter() - began:.0f} s (tp={cfg.tp}, dp={cfg.dp})")
    if cfg.out:
        print(f"metrics: {cfg.out}/metrics.jsonl, curve: {cfg.out}/loss.png, checkpoint: {cfg.out}/latest")
    if result.get("sample"):
        print("sample:\n" + result["sample"])
    if losses and not math.isfinite(losses[max(losses)]):
        raise SystemExit("the loss is not finite")


if __name__ == "__main__":
    main()

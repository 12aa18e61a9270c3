"""Train a small GPT with tensor x data parallelism, nanoGPT style.

With plain `python` it starts tp x dp x pp local processes itself (gloo on
CPU, NCCL when there is a GPU per rank); under `torchrun` each process is one
rank and dp = world / (tp x pp). Tensor parallelism is inside a node-local
group of tp ranks; data parallelism across them is DistributedDataParallel
(optionally with ZeroRedundancyOptimizer: --zero), or FSDP2 with the tp shards
inside (--fsdp); with --pp the blocks are split into pipeline stages run by a
schedule of torch.distributed.pipelining (--schedule gpipe, 1f1b or
interleaved, over --microbatches). AdamW (its state optionally in host memory,
stepping there: --offload-optimizer, FSDP2's CPUOffloadPolicy), cosine learning rate with warmup, gradient clipping by
the norm of the whole unsharded gradient, gradient accumulation; bf16 autocast
on a GPU, float32 on the CPU, or --dtype. A host with fewer GPUs than local
ranks trains on the CPU (with a warning when it has GPUs). --bitwise trains in
tensorpar's bitwise mode: --tp 1, 2, 3 and 4 log the same losses and gradient
norms, bit for bit (tensorpar.bitwise; slower, one CPU thread per rank).

Data: bytes of a text (the built-in corpus unless --data names a file; its
last --val-fraction held out for validation), or a directory holding
nanoGPT's train.bin and val.bin (uint16 token ids, memory-mapped) with
--vocab-size. Batches are drawn deterministically per step, so a run resumed
from a checkpoint (at any tp or dp) continues exactly where it stopped.

Steps count from 1: step N is logged after N optimizer steps, and a
checkpoint at step N resumes with step N + 1. Rank 0 shows a progress bar,
writes OUT/metrics.jsonl (one JSON line per step: loss, lr, grad_norm,
tokens_per_s, and val_loss after every --eval-every steps) and OUT/loss.png,
and prints a sample. Each rank writes its own shards of each checkpoint
(torch.distributed.checkpoint) into OUT/step-NNNNNN; --export-hf DIR saves the
final model as a Hugging Face GPT-2 directory, or a Llama one for a model with
--norm rmsnorm --positions rope --mlp swiglu (with --export-only, the newest
checkpoint in OUT, training nothing: a finished run exported afterwards).

The bar, metrics.jsonl and the summary show tokens_per_s (last 20 steps), mfu,
peak memory (rank 0's; the summary every rank's), step_s, device and dtype.

A run never destroys its own work:
- A step whose loss or gradient norm is NaN or infinite (a diverging run) is
  noticed at that step, by every rank alike (both values are the same on every
  rank, and are read for the log anyway): --on-nonfinite stop (the default)
  ends the run there with exit code 1 and a message naming the step and the
  values, writing no checkpoint, so the earlier checkpoints stay; --on-nonfinite
  skip drops that step's update on every rank (its gradients discarded, the
  optimizer not stepped, the step logged with "skipped": true) and goes on.
  A checkpoint holding a NaN or an infinity is never written (the save is
  refused; the run stops with that message), so retention never replaces good
  checkpoints by a diverged state.
- OUT belongs to one run: the launching process (under torchrun, rank 0) holds
  a lock on OUT/run.lock (with its pid) for the whole run, so a second job on
  the same OUT is refused, naming that pid; the kernel releases the lock
  however the holder ends. A new run into an OUT holding an earlier run's
  checkpoints or metrics is refused unless it continues it (--resume) or sets
  it aside (--overwrite: its files are moved into OUT/replaced-<time>/, nothing
  deleted). OUT must not be a checkpoint directory (pass its parent).
- A last line of metrics.jsonl cut short by a crash is dropped on --resume,
  with a warning; any other unreadable line is refused before a rank starts.
- Every numeric option must be finite; the seed, the output directory and the
  memory are checked before any rank starts: a layout whose plan (layers.plan:
  parameters, gradients, optimizer state, activations and the largest transient
  of the fullest rank) exceeds each rank's memory (each GPU's, or this host's
  available memory over its ranks; --memory) is refused, naming the nearest
  layouts that fit (--force launches anyway).

Plan before you launch: --dry-run prints the plan (--json: as one JSON object)
and --suggest the layouts of the world that fit, fastest first, and why each
other one does not; neither starts a rank nor looks at OUT.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import tensorpar
from layers import GPT, PipelinedGPT
from layers.hf import export_hf
from tensorpar import checkpoint
from tensorpar.random import mix_seed

# The training app (examples/train/) sits beside this script: importable as `python examples/train_gpt.py`
# makes it, and also when the script is run by runpy or a launcher that does not put its folder first.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import (
    DTYPES,
    ByteData,
    Throughput,
    TokenData,
    TrainConfig,
    autocast_for,
    compute_dtype,
    cosine_lr,
    device_name,
    hardware_summary,
    hold,
    model_config,
    open_log,
    open_logger,
    open_splits,
    peak_memory_bytes,
    peak_memory_per_rank,
    plot,
    progress,
    reset_peak_memory,
    validation_loss,
    warn_if_gpus_unused,
)
from train import parse_args as parse_training_args
from train.hardware import model_flops_per_token, peak_tflops
from train.planning import dry_run, suggestions

EPILOG = """examples:
  python examples/train_gpt.py                          # tp=2 on 2 local CPU processes, the built-in corpus
  python examples/train_gpt.py --tp 2 --dp 2 --zero     # 4 processes, optimizer state sharded over dp
  python examples/train_gpt.py --tp 2 --dp 2 --fsdp     # parameters, gradients and optimizer state too
  python examples/train_gpt.py --tp 4 --sequence-parallel   # activations split along the tokens too
  python examples/train_gpt.py --tp 2 --pp 2 --schedule 1f1b --microbatches 4   # 2 pipeline stages of tp=2
  python examples/train_gpt.py --data my.txt --steps 2000 --out run1 --stop-at 1000
  python examples/train_gpt.py --data my.txt --steps 2000 --out run1 --resume    # steps 1001-2000
  python examples/train_gpt.py --data my.txt --out run1 --overwrite    # run1's earlier run moved to run1/replaced-*
  python examples/train_gpt.py --lr 1e-2 --on-nonfinite skip    # a step with a NaN loss is skipped, not fatal
  python examples/train_gpt.py --tp 1 --export-hf run1/hf   # one GPU, bf16; then GPT2LMHeadModel.from_pretrained
  python examples/train_gpt.py --out run1 --export-only --export-hf run1/hf   # run1's newest checkpoint, no training
  python examples/train_gpt.py --norm rmsnorm --positions rope --mlp swiglu --export-hf llama   # LlamaForCausalLM
  python examples/train_gpt.py --data data/shakespeare --vocab-size 50257 --eval-every 50 --logger tensorboard
  python examples/train_gpt.py --tp 2 --dp 2 --fsdp --dry-run   # each rank's bytes, the step's FLOPs; no rank starts
  python examples/train_gpt.py --n-layer 12 --n-embd 768 --n-head 12 --world 8 --device-name H100 --memory 80 --suggest
  torchrun --nproc-per-node 8 examples/train_gpt.py --tp 4 --n-layer 12 --n-embd 768 --n-head 12
"""


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """The run's options, checked before any rank starts (a bad one exits with code 2)."""
    return parse_training_args(argv, prog=Path(__file__).name, description=__doc__, epilog=EPILOG)


def build(cfg: TrainConfig, mesh: tensorpar.Mesh) -> tuple[GPT | PipelinedGPT, torch.optim.Optimizer]:
    tensorpar.manual_seed(cfg.seed)  # the same full weights at any tp, dp and pp
    config = model_config(cfg)
    model: GPT | PipelinedGPT
    fsdp_options: dict[str, Any] = {}  # --offload-optimizer (which implies --fsdp): FSDP2 keeps its shards on the host
    if cfg.offload_optimizer:
        from torch.distributed.fsdp import CPUOffloadPolicy  # FSDP2's API: torch >= 2.6, as --fsdp needs
        fsdp_options["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device.type == "cuda")
    if mesh.pp > 1:
        model = PipelinedGPT(config, stages_per_rank=cfg.stages_per_rank, mesh=mesh)
        if cfg.fsdp:  # each stage its own FSDP2 root, its blocks the units
            for stage in model.stages:
                tensorpar.fully_shard_dp(stage, mesh, modules=stage.blocks, **fsdp_options)
    else:
        model = GPT(config, device=mesh.device)
        if cfg.fsdp:  # before the optimizer: FSDP2 replaces the parameters by their dp shards
            tensorpar.fully_shard_dp(model, mesh, modules=model.transformer.h, **fsdp_options)
    if cfg.compile:  # block by block, as FSDP2 and activation checkpointing wrap them
        for block in blocks(model):
            block.compile(fullgraph=True)
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # no decay: biases, norms
    if cfg.zero and mesh.dp > 1:
        optimizer: torch.optim.Optimizer = ZeroRedundancyOptimizer(
            groups, optimizer_class=torch.optim.AdamW, process_group=mesh.dp_group, lr=cfg.lr, betas=(0.9, 0.95))
    else:  # under --offload-optimizer its state follows the parameters' shards into host memory, and so does its step
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))
    return model, optimizer


def blocks(model: GPT | PipelinedGPT) -> list[nn.Module]:
    """The model's transformer blocks (this rank's, when pipelined)."""
    h = model.transformer.h
    return list(h.values()) if isinstance(h, nn.ModuleDict) else list(h)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run on every rank of the current mesh; rank 0 returns the losses, validation losses and gradient
    norms by step, the steps skipped (``skipped``), why the run stopped early (``stopped``: a message,
    or None), the sample, the final full weights and what the hardware did (``hardware``)."""
    mesh = tensorpar.current_mesh()
    lead = mesh.rank == 0
    dtype_name = compute_dtype(cfg.dtype, mesh.device)
    dtype = DTYPES[dtype_name]
    reset_peak_memory(mesh.device)
    data, val = open_splits(cfg.data, seed=cfg.seed, val_fraction=cfg.val_fraction, vocab_size=cfg.vocab_size)
    model, optimizer = build(cfg, mesh)
    done = 0  # optimizer steps already taken
    out = Path(cfg.out) if cfg.out else None
    if cfg.resume != "never" and out and (out / "latest").exists():
        done = checkpoint.load(out, model, optimizer)["step"]
    if cfg.export_only:  # the checkpoint, written as it is
        assert isinstance(model, GPT)  # --export-hf needs --pp 1
        export_hf(model, cfg.export_hf)
        return {"losses": {}, "val_losses": {}, "grad_norms": {}, "skipped": [], "stopped": None, "sample": None,
                "hardware": {}, "step": done} if lead else {}
    pipe = None
    if isinstance(model, PipelinedGPT):  # gradients averaged over dp once per step (or reduced by FSDP2)
        pipe = model.pipeline(cfg.schedule, cfg.microbatches)
        ddp: nn.Module = model
    else:
        ddp = DistributedDataParallel(model, process_group=mesh.dp_group) if mesh.dp > 1 and not cfg.fsdp else model
    if lead and out:
        out.mkdir(parents=True, exist_ok=True)
    log = open_log(out, done + 1) if lead and out else None
    logger = open_logger(cfg.logger, out, start=done + 1, config=dataclasses.asdict(cfg)) if lead and out else None
    layout = f"tp={mesh.tp} dp={mesh.dp}" + (f" pp={mesh.pp} {cfg.schedule}" if mesh.pp > 1 else "")
    bar = progress(cfg.steps, done, f"train {layout} {mesh.device} {dtype_name}") if lead and cfg.progress else None
    c, device = model.config, device_name(mesh.device)
    flops = model_flops_per_token(c.parameter_count(), c.n_layer, c.n_head, c.n_embd // c.n_head, c.block_size)
    tokens_per_step = cfg.batch_size * cfg.block_size
    meter = Throughput(tokens_per_step=tokens_per_step, flops_per_token=flops, devices=mesh.world_size,
                       peak_tflops=cfg.peak_tflops or peak_tflops(mesh.device, dtype))  # MFU: with a known peak
    losses: dict[int, float] = {}
    norms: dict[int, float] = {}
    vals: dict[int, float] = {}
    skipped: list[int] = []
    stopped: str | None = None
    newest = checkpoint.resolve(out) if done and out else None  # the newest checkpoint in out
    last = cfg.stop_at or cfg.steps
    for step in range(done + 1, last + 1):
        began = time.perf_counter()
        index = step - 1  # from 0: the step's batches, dropout and learning rate
        lr = cosine_lr(index, lr=cfg.lr, min_lr=cfg.min_lr, warmup=cfg.warmup, total=cfg.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        tensorpar.manual_seed(mix_seed(cfg.seed, index, 1), mesh)  # dropout depends on the step alone
        loss_sum = torch.zeros((), device=mesh.device)
        for micro in range(cfg.grad_accum):
            x, y = data.batch(index, micro, batch_size=cfg.batch_size, block_size=cfg.block_size,
                              accum=cfg.grad_accum, dp=mesh.dp, dp_rank=mesh.dp_rank)
            if pipe is not None:  # forward and backward, micro-batch by micro-batch through the stages
                with autocast_for(mesh.device, dtype):
                    loss_sum += pipe.step(x.to(mesh.device), y.to(mesh.device), loss_scale=1 / cfg.grad_accum)
                continue
            reduce = micro == cfg.grad_accum - 1  # the gradients go over dp after the last micro-batch only
            if cfg.fsdp:
                model.set_requires_gradient_sync(reduce)
            sync = contextlib.nullcontext() if mesh.dp == 1 or cfg.fsdp or reduce else ddp.no_sync()
            with sync:  # no gradient all-reduce over dp until the last micro-batch
                with autocast_for(mesh.device, dtype):
                    loss = ddp(x.to(mesh.device), y.to(mesh.device)) / cfg.grad_accum
                loss.backward()
            loss_sum += loss.detach()
        if isinstance(model, PipelinedGPT):  # the whole model's norm, over the stages too
            model.finish_gradients()  # averaged over dp (unless FSDP2 did), the tied head's copies summed
            norm = model.clip_grad_norm_(cfg.clip) if cfg.clip else model.grad_norm()
        else:
            norm = tensorpar.clip_grad_norm_(model, cfg.clip) if cfg.clip else tensorpar.grad_norm(model)
        if mesh.dp > 1:  # the step's loss over the whole batch, for the log
            dist.all_reduce(loss_sum, group=mesh.dp_group)
            loss_sum /= mesh.dp
        # Read for the log (the step's one wait for the device), and alike on every rank: the norm is summed
        # over tp, dp and pp, the loss combined over tp (vocab-parallel), dp (above) and the stages (the
        # pipeline's). So every rank takes the same step, or skips it (a NaN or an infinity anywhere
        # reaches both sums).
        losses[step], norms[step] = loss_sum.item(), norm.item()
        finite = math.isfinite(losses[step]) and math.isfinite(norms[step])
        if finite:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - began  # the device's work included: .item() waited for it
        speed = meter.step(seconds)
        memory = peak_memory_bytes(mesh.device)  # rank 0's; every rank's at the end
        row = {"step": step, "loss": losses[step], "lr": lr, "grad_norm": norms[step], **speed, "step_s": seconds,
               "peak_memory_mib": memory / 2**20, "device": device, "dtype": dtype_name,
               "tp": mesh.tp, "dp": mesh.dp, "pp": mesh.pp}
        if not finite:
            row["skipped"] = True
            skipped.append(step)
            what = f"step {step}: the loss is {losses[step]}, the gradient norm {norms[step]}"
            if cfg.on_nonfinite == "stop":
                kept = f"the newest checkpoint, {newest}, is untouched" if newest else "no checkpoint was written"
                stopped = (f"{what}: the run stopped there (--on-nonfinite stop), with no checkpoint of it"
                           + (f"; {kept}" if out else ""))
            elif lead:
                (bar.write if bar else print)(f"warning: {what}: its update is skipped (--on-nonfinite skip)",
                                              file=sys.stderr)
        if not stopped and cfg.eval_every and step % cfg.eval_every == 0:
            row["val_loss"] = vals[step] = validation_loss(model, val, iters=cfg.eval_iters, mesh=mesh,
                                                           batch_size=cfg.batch_size // cfg.grad_accum,
                                                           block_size=cfg.block_size,
                                                           loss_of=pipe.evaluate if pipe else None, dtype=dtype)
        if out and not stopped and ((cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == last):
            try:  # refused on every rank alike, for a state holding a NaN or an infinity say
                newest = checkpoint.save(out, model, optimizer, step=step, mesh=mesh,
                                         extra={"data_position": {"step": step, "tokens": step * tokens_per_step},
                                                "train_config": dataclasses.asdict(cfg)})
            except checkpoint.CheckpointError as e:
                stopped = f"step {step}: the run stopped: {e}"
        if log:
            log.write(json.dumps(row) + "\n")
            log.flush()
        if logger:
            logger.log(row)
        if bar:
            shown = {"val": f"{vals[max(vals)]:.3f}"} if vals else {}
            shown |= {"mfu": f"{speed['mfu']:.1%}"} if "mfu" in speed else {}
            bar.set_postfix(loss=f"{losses[step]:.3f}", **shown, tok_s=f"{speed['tokens_per_s']:,.0f}",
                            mem=f"{memory / 2**30:.2f}GiB")
            bar.update()
        if stopped:
            break
    for opened in (bar, log, logger):
        if opened:
            opened.close()
    hardware = meter.summary() | dict(device=device, dtype=dtype_name, peak_memory_bytes=peak_memory_per_rank(mesh))
    if cfg.export_hf and isinstance(model, GPT) and not stopped:  # every rank: each tp group gathers, rank 0 writes
        export_hf(model, cfg.export_hf)
    sample = None
    finished = last == cfg.steps and not stopped
    if cfg.sample_tokens and finished and isinstance(model, GPT):  # a pipeline holds part of the model
        sample = _sample(model, cfg, mesh, val)
    full = None
    if isinstance(model, GPT) and (mesh.dp_rank == 0 or cfg.fsdp):  # FSDP: gathered over dp too
        full = model.full_state_dict()
    if not lead:
        return {}
    if out and (losses or done):
        plot(out, unit="byte" if isinstance(val, ByteData) else "token")
    return {"losses": losses, "val_losses": vals, "grad_norms": norms, "skipped": skipped, "stopped": stopped,
            "sample": sample, "state": full, "hardware": hardware}


def _sample(model: GPT, cfg: TrainConfig, mesh: tensorpar.Mesh, val: TokenData) -> str:
    """Text after "The " for bytes; for token ids (no tokenizer here), the ids after val.bin's first one."""
    model.eval()
    if cfg.fsdp:  # generate() reads the root's own parameters outside its forward
        model.unshard()
    start = list(b"The ") if isinstance(val, ByteData) else val.tokens[:1].tolist()
    torch.manual_seed(cfg.seed)
    tokens = model.generate(torch.tensor([start], device=mesh.device), cfg.sample_tokens, temperature=0.8,
                            top_k=40)[0].tolist()
    if cfg.fsdp:
        model.reshard()
    model.train()
    return val.decode(tokens)


def spawned(cfg: TrainConfig) -> dict[str, Any]:
    """One rank of a local run started by ``tensorpar.spawn``."""
    tensorpar.init(cfg.tp, cfg.dp, pp=cfg.pp)
    tensorpar.bitwise.enable(cfg.bitwise)
    torch.set_num_threads(1)
    return train(cfg)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    if cfg.dry_run or cfg.suggest:  # a plan, printed once (under torchrun by rank 0); no rank starts
        if os.environ.get("RANK", "0") == "0":
            print(dry_run(cfg) if cfg.dry_run else suggestions(cfg))
        return
    warn_if_gpus_unused(tp=cfg.tp, dp=cfg.dp, pp=cfg.pp)
    began = time.perf_counter()
    held = functools.partial(hold, cfg.out, resume=cfg.resume, overwrite=cfg.overwrite, prog=Path(__file__).name)
    if "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank; rank 0 holds --out
        mesh = tensorpar.init(cfg.tp, cfg.dp, pp=cfg.pp)
        tensorpar.bitwise.enable(cfg.bitwise)  # the mode its layers are built in (off without --bitwise)
        with held(mesh=mesh):
            result = train(cfg)
        if mesh.rank:
            return
    else:  # this process holds --out while its ranks run
        with held():
            result = tensorpar.spawn(spawned, cfg.tp * cfg.dp * cfg.pp, cfg)[0]
    losses, vals = result["losses"], result["val_losses"]
    if losses:
        first, last = losses[min(losses)], losses[max(losses)]
        print(f"loss {first:.3f} -> {last:.3f} over steps {min(losses)}-{max(losses)} "
              f"in {time.perf_counter() - began:.0f} s (tp={cfg.tp}, dp={cfg.dp}"
              + (f", pp={cfg.pp} {cfg.schedule} x {cfg.microbatches} micro-batches)" if cfg.pp > 1 else ")"))
    if vals:
        print(f"validation loss {vals[max(vals)]:.3f} after step {max(vals)}")
    if "tokens_per_s" in result["hardware"]:
        print(hardware_summary(result["hardware"]))
    if cfg.out:
        print(f"metrics: {cfg.out}/metrics.jsonl, curve: {cfg.out}/loss.png, checkpoint: {cfg.out}/latest"
              + (f", {cfg.logger}: {cfg.out}" if cfg.logger != "none" else ""))
    if cfg.export_only:
        print(f"step {result['step']} of {cfg.out}: ", end="")
    if cfg.export_hf:
        name, kind = ("GPT-2", "GPT2LMHeadModel") if (cfg.norm, cfg.positions) == ("layernorm", "learned") \
            else ("Llama", "LlamaForCausalLM")
        print(f"Hugging Face {name}: {cfg.export_hf} (transformers.{kind}.from_pretrained loads it)")
    if result.get("sample"):
        print("sample:\n" + result["sample"])
    elif cfg.pp > 1 and cfg.sample_tokens and cfg.out:
        print(f"no sample: each pipeline rank holds part of the model; load {cfg.out}/latest at --pp 1 to sample")
    if result["skipped"] and not result["stopped"]:
        steps = result["skipped"]
        print(f"{len(steps)} step{'s' if len(steps) > 1 else ''} skipped for a NaN or infinite loss or gradient "
              f"norm (--on-nonfinite skip): {', '.join(map(str, steps[:20]))}{' ...' if len(steps) > 20 else ''}")
    if result["stopped"]:
        raise SystemExit(result["stopped"])


if __name__ == "__main__":
    main()

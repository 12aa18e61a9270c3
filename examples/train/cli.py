"""The training script's command line: every option with its help and default, and every check that
can be made before a rank starts (sizes, finite numbers, the seed's range, world, data files, the output
directory, the checkpoint and metrics log to resume, the plan's memory against each rank's, the logger's
package), each failing as an argument error (exit code 2, one line naming the numbers)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tensorpar.bitwise import DEFAULT_TP_SIZES
from tensorpar.checkpoint import CheckpointError
from tensorpar.checkpoint import files as checkpoint_files

from .data import SCANNED_TOKENS, VOCAB_SIZE, open_splits
from .device import DTYPES
from .output import read_log
from .planning import check as check_plan
from .rundir import check_out

GROUPS = ("model", "parallelism", "optimisation", "data and validation", "checkpoints and output", "planning")
RESUME = ("never", "auto", "must")
ON_NONFINITE = ("stop", "skip")
#: the seeds torch.manual_seed accepts
SEEDS = (-2**63, 2**64 - 1)
LOGGERS = ("none", "tensorboard", "wandb")
#: the package each logger needs, and how to install it
LOGGER_PACKAGES = (("tensorboard", "tensorboard", "pip install -e \".[tensorboard]\""),
                   ("wandb", "wandb", "pip install wandb"))


def _opt(default: Any, group: str, help: str, **argparse_options: Any) -> Any:
    return field(default=default, metadata={"group": group, "help": help, **argparse_options})


@dataclass
class TrainConfig:
    """One training run's options; the command line is made from these fields."""

    n_layer: int = _opt(4, "model", "transformer blocks")
    n_head: int = _opt(4, "model", "attention heads (split over tp by whole heads; at least tp)")
    n_embd: int = _opt(128, "model", "embedding width (a multiple of --n-head)")
    block_size: int = _opt(64, "model", "context length in tokens")
    dropout: float = _opt(0.0, "model", "dropout probability (attention, residual, embedding)")
    bias: bool = _opt(False, "model", "biases in linears and LayerNorms (nanoGPT's default: none)")
    mlp: str = _opt("gelu", "model", "MLP: GELU (GPT-2) or SwiGLU (Llama)", choices=("gelu", "swiglu"))
    norm: str = _opt("layernorm", "model", "norm: LayerNorm (GPT-2) or RMSNorm (Llama)",
                     choices=("layernorm", "rmsnorm"))
    positions: str = _opt("learned", "model", "positions: a learned table (GPT-2) or rotary embeddings (Llama)",
                          choices=("learned", "rope"))
    vocab_size: int | None = _opt(None, "model", "vocabulary size; required with token data, at least 256 "
                                  "for bytes", shown="256 (bytes)")
    tp: int = _opt(2, "parallelism", "tensor-parallel ranks (one node)")
    dp: int | None = _opt(None, "parallelism", "data-parallel ranks; tp x dp x pp ranks in all",
                          shown="world / (tp x pp) under torchrun, else 1")
    pp: int = _opt(1, "parallelism", "pipeline stages (ranks), each holding whole blocks; tp x dp x pp ranks in all")
    schedule: str = _opt("1f1b", "parallelism", "pipeline schedule (torch.distributed.pipelining)",
                         choices=("gpipe", "1f1b", "interleaved"))
    microbatches: int | None = _opt(None, "parallelism", "pipeline micro-batches per batch", shown="--pp")
    stages_per_rank: int | None = _opt(None, "parallelism", "pipeline stages per rank (the interleaved schedule "
                                       "loops over the ranks this many times)", shown="2 for interleaved, else 1")
    zero: bool = _opt(False, "parallelism", "shard the optimizer state over dp (ZeroRedundancyOptimizer)")
    fsdp: bool = _opt(False, "parallelism", "FSDP2 over dp: parameters, gradients and optimizer state sharded "
                      "(instead of DDP; excludes --zero)")
    sequence_parallel: bool = _opt(False, "parallelism", "sequence parallelism: LayerNorm, dropout and the residual "
                                   "stream split along the tokens over tp (about 1/tp of the activations, the same "
                                   "traffic)")
    compile: bool = _opt(False, "parallelism", "torch.compile each block whole (fullgraph)")
    bitwise: bool = _opt(False, "parallelism", "bitwise mode: the losses, gradient norms and weights are the same "
                         "bits at --tp 1, 2, 3 and 4 (tensorpar.bitwise; slower; one CPU thread per rank)")
    activation_checkpointing: bool = _opt(False, "parallelism", "recompute each block in backward: less memory, "
                                          "one more forward")
    dtype: str | None = _opt(None, "parallelism", "the dtype of the computation: bf16 through autocast (on a GPU "
                             "or the CPU; the weights and optimizer stay float32), or fp32 (fp16 is refused: it "
                             "needs loss scaling)", shown="bf16 on a GPU, fp32 on the CPU", choices=tuple(DTYPES))
    steps: int = _opt(500, "optimisation", "optimizer steps in the whole run (a resumed run continues to it)")
    batch_size: int = _opt(16, "optimisation", "sequences per optimizer step, over all dp ranks and micro-batches "
                           "(a multiple of dp x --grad-accum)")
    grad_accum: int = _opt(1, "optimisation", "micro-batches per optimizer step (gradient accumulation)")
    lr: float = _opt(3e-3, "optimisation", "peak learning rate (AdamW, betas 0.9, 0.95)")
    min_lr: float = _opt(3e-4, "optimisation", "learning rate at the end of the cosine decay")
    warmup: int = _opt(20, "optimisation", "steps of linear warmup")
    weight_decay: float = _opt(0.1, "optimisation", "AdamW weight decay of matrices (none on biases and norms)")
    clip: float = _opt(1.0, "optimisation", "clip the norm of the whole unsharded gradient to this; 0: no clipping")
    on_nonfinite: str = _opt("stop", "optimisation", "a step whose loss or gradient norm is NaN or infinite: "
                             "'stop' ends the run there (exit code 1, naming the step and the values; no "
                             "checkpoint of it, the earlier ones untouched), 'skip' drops that step's update on "
                             "every rank (its gradients discarded, the optimizer not stepped; logged with "
                             "\"skipped\": true) and goes on", choices=ON_NONFINITE)
    offload_optimizer: bool = _opt(False, "optimisation", "keep the parameters' dp shards, their gradients and "
                                   "the AdamW state in host memory, stepping there (ZeRO-Offload through FSDP2's "
                                   "CPUOffloadPolicy: implies --fsdp, whose dp shards of the state stand for --zero)")
    seed: int = _opt(1337, "optimisation", "seed of the weights, the batches and dropout")
    data: str | None = _opt(None, "data and validation", "a text file (trained on as bytes), or a directory "
                            "holding nanoGPT's train.bin and val.bin (uint16 token ids; needs --vocab-size)",
                            shown="the built-in corpus", metavar="PATH")
    val_fraction: float = _opt(0.1, "data and validation", "the last part of a text kept for validation")
    eval_every: int = _opt(100, "data and validation", "validation loss after every N steps; 0: never",
                           metavar="N")
    eval_iters: int = _opt(20, "data and validation", "batches in each validation (the same ones each time)",
                           metavar="M")
    out: str | None = _opt("out", "checkpoints and output", "directory of checkpoints, metrics.jsonl and "
                           "loss.png; 'none': write nothing", metavar="DIR")
    ckpt_every: int = _opt(100, "checkpoints and output", "checkpoint every N steps (and at the last one); 0: "
                           "at the last one only", metavar="N")
    resume: str = _opt("never", "checkpoints and output", "continue from the newest checkpoint in --out: 'must' "
                       "(what --resume alone means) fails without one, 'auto' starts afresh without one",
                       nargs="?", const="must", choices=RESUME)
    overwrite: bool = _opt(False, "checkpoints and output", "start afresh in an --out holding an earlier run "
                           "(refused without this or --resume): its checkpoints, metrics and plots are moved "
                           "into OUT/replaced-<time>/, nothing deleted")
    stop_at: int | None = _opt(None, "checkpoints and output", "end this run after step N, with a checkpoint "
                               "(--resume continues it to --steps)", shown="--steps", metavar="N")
    sample_tokens: int = _opt(200, "checkpoints and output", "tokens to sample at the end; 0: none")
    progress: bool = _opt(True, "checkpoints and output", "progress bar (needs tqdm)")
    peak_tflops: float | None = _opt(None, "checkpoints and output", "one device's dense peak TFLOP/s in --dtype, "
                                     "for the MFU shown and logged and the plan's step-time bound",
                                     shown="known for H100, H200 and A100; otherwise no MFU", metavar="TFLOPS")
    export_hf: str | None = _opt(None, "checkpoints and output", "at the end, save the model as a Hugging Face "
                                 "GPT-2 directory, or Llama's with --norm rmsnorm --positions rope --mlp swiglu "
                                 "(from_pretrained loads it; needs --pp 1)",
                                 shown="none", metavar="DIR")
    export_only: bool = _opt(False, "checkpoints and output", "train nothing: load the newest checkpoint in --out "
                             "(at any --tp and --dp; the model options are the checkpoint's) and write it to "
                             "--export-hf (implies --resume)")
    logger: str = _opt("none", "checkpoints and output", "also log to TensorBoard (OUT/tensorboard) or Weights & "
                       "Biases (offline unless WANDB_MODE says otherwise)", choices=LOGGERS)
    dry_run: bool = _opt(False, "planning", "print the plan (each rank's parameters, gradients, optimizer state, "
                         "activations and peak, the step's FLOPs and a bound on its time; layers.plan) and exit: "
                         "no rank starts, --out is not looked at")
    json: bool = _opt(False, "planning", "with --dry-run: the plan as one JSON object (the largest rank's bytes, "
                      "the step's FLOPs and time bound, the layout, each rank's memory and whether it fits)")
    suggest: bool = _opt(False, "planning", "list the layouts of the world (tp x dp x pp, sharding, sequence "
                         "parallelism, activation checkpointing) that fit each rank's memory, fastest first, and "
                         "why each other one does not; then exit, as --dry-run")
    world: int | None = _opt(None, "planning", "with --dry-run or --suggest: plan for N ranks (dp = N / (tp x pp))",
                             shown="tp x dp x pp, or torchrun's world", metavar="N")
    memory: float | None = _opt(None, "planning", "GiB of memory each rank has: the plan is checked against it "
                                "before a run, and --dry-run and --suggest plan for it",
                                shown="each GPU's total memory, or this host's available memory over its ranks",
                                metavar="GIB")
    device_name: str | None = _opt(None, "planning", "with --dry-run or --suggest: plan for this GPU (H100, H200, "
                                   "A100: its peak bounds the step time; --peak-tflops for another; bf16 by "
                                   "default, as on a GPU; with --memory unless the ranks run on this host's GPUs)",
                                   shown="this host's GPU when the run uses it", metavar="NAME")
    force: bool = _opt(False, "planning", "launch even when the plan's largest rank needs more than each rank's "
                       "memory (refused without it)")

    def __post_init__(self) -> None:
        """Checks of the options among themselves (the environment is checked by :func:`resolve`)."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("float", "float | None") and value is not None and not math.isfinite(value):
                raise ValueError(f"--{_flag(f.name)} must be a finite number, got {value}")
        if self.offload_optimizer:  # FSDP2's CPUOffloadPolicy: the state sharded over dp (ZeRO's) and on the host
            if self.bitwise:
                raise ValueError("--bitwise does not take --offload-optimizer: it runs through FSDP2, whose sharded "
                                 "gradients are reduced in an order of its own; use DDP over dp (no --fsdp)")
            self.fsdp, self.zero = True, False
        if self.fsdp and self.zero:
            raise ValueError("--fsdp and --zero exclude each other: --fsdp shards the optimizer state over dp itself")
        if self.bitwise and self.fsdp:
            raise ValueError("--bitwise does not take --fsdp: FSDP2's sharded gradients are reduced in an order of "
                             "its own; use DDP over dp (no --fsdp)")
        if self.bitwise and self.compile:
            raise ValueError("--bitwise and --compile exclude each other: inductor fuses each rank's graph into "
                             "kernels of its own, which keep the bits at some tp and not at others")
        if self.bitwise and self.tp not in DEFAULT_TP_SIZES:
            raise ValueError(f"--bitwise makes --tp {', '.join(map(str, DEFAULT_TP_SIZES))} agree; --tp {self.tp} "
                             "is not one of them")
        if self.export_only:
            if self.export_hf is None:
                raise ValueError("--export-only writes the checkpoint in --out to --export-hf DIR: give --export-hf")
            if self.overwrite:
                raise ValueError("--export-only and --overwrite exclude each other: --export-only reads the run in "
                                 "--out")
            self.resume = "must"
        if self.overwrite and self.resume != "never":
            raise ValueError("--overwrite and --resume exclude each other: --overwrite sets the earlier run aside, "
                             "--resume continues it")
        if not SEEDS[0] <= self.seed <= SEEDS[1]:
            raise ValueError(f"--seed {self.seed} is outside the range torch.manual_seed accepts (-2**63 to "
                             "2**64 - 1)")
        if self.stages_per_rank is None:
            self.stages_per_rank = 2 if self.schedule == "interleaved" else 1
        if self.microbatches is None:
            self.microbatches = self.pp
        for name in ("n_layer", "n_head", "n_embd", "block_size", "tp", "pp", "microbatches", "stages_per_rank",
                     "steps", "batch_size", "grad_accum", "eval_iters") + (("dp",) if self.dp is not None else ()):
            if getattr(self, name) < 1:
                raise ValueError(f"--{_flag(name)} must be at least 1, got {getattr(self, name)}")
        for name in ("warmup", "ckpt_every", "eval_every", "sample_tokens", "clip", "weight_decay", "lr", "min_lr"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{_flag(name)} must be at least 0, got {getattr(self, name)}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"--val-fraction must be in (0, 1), got {self.val_fraction}")
        if self.n_embd % self.n_head:
            raise ValueError(f"--n-embd {self.n_embd} is not divisible by --n-head {self.n_head}")
        if self.n_head < self.tp:
            raise ValueError(f"--n-head {self.n_head} is smaller than --tp {self.tp}: each tp rank needs a head")
        stages = self.pp * self.stages_per_rank
        if self.n_layer < stages:
            raise ValueError(f"--n-layer {self.n_layer} is smaller than the pipeline's {stages} stages "
                             f"(--pp {self.pp} x {self.stages_per_rank} per rank)")
        if self.stages_per_rank > 1 and (self.schedule != "interleaved" or self.pp == 1):
            raise ValueError(f"--stages-per-rank {self.stages_per_rank} needs --schedule interleaved and --pp > 1")
        if self.schedule == "1f1b" and self.microbatches < self.pp:
            raise ValueError(f"--schedule 1f1b needs at least --pp ({self.pp}) micro-batches, got --microbatches "
                             f"{self.microbatches}")
        if self.dtype == "fp16":
            raise ValueError("--dtype fp16 needs loss scaling, which this script does not do (a step skipped for an "
                             "overflow must be skipped by every tp, dp and pp rank alike): use --dtype bf16 (CPUs, "
                             "A100, H100 and newer GPUs) or --dtype fp32")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(f"--peak-tflops must be above 0, got {self.peak_tflops}")
        if self.export_hf is not None and self.pp > 1:
            raise ValueError(f"--export-hf needs --pp 1 (each of the {self.pp} pipeline ranks holds part of the "
                             "model): train at --pp 1, or load the checkpoint into a GPT at --pp 1 and call "
                             "export_hf")
        if self.json and not self.dry_run:
            raise ValueError("--json prints the plan of --dry-run: give --dry-run")
        if self.dry_run and self.suggest:
            raise ValueError("--dry-run and --suggest exclude each other: --dry-run plans this layout, --suggest "
                             "lists the layouts that fit")
        for name in ("world", "device_name"):
            if getattr(self, name) is not None and not (self.dry_run or self.suggest):
                raise ValueError(f"--{_flag(name)} is for planning: give --dry-run or --suggest")
        if self.world is not None and self.world < 1:
            raise ValueError(f"--world must be at least 1, got {self.world}")
        if self.memory is not None and not self.memory > 0:
            raise ValueError(f"--memory must be above 0 GiB, got {self.memory}")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            raise ValueError(f"--stop-at {self.stop_at} is not a step of the run (1 to --steps {self.steps})")


def _flag(name: str) -> str:
    return name.replace("_", "-")


def build_parser(prog: str | None = None, *, description: str = "", epilog: str = "") -> argparse.ArgumentParser:
    """The parser of :class:`TrainConfig`'s fields, grouped, each option's help ending with its default."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    groups = {name: parser.add_argument_group(name) for name in GROUPS}
    for f in dataclasses.fields(TrainConfig):
        meta = dict(f.metadata)
        group, shown = groups[meta.pop("group")], meta.pop("shown", None)
        kind = str(f.type).removesuffix(" | None")
        if kind == "bool":
            action = group.add_argument("--" + _flag(f.name), action=argparse.BooleanOptionalAction,
                                        default=f.default, **meta)
        else:
            meta.setdefault("type", {"int": int, "float": float}.get(kind, str))
            action = group.add_argument("--" + _flag(f.name), default=f.default, **meta)
        if "(default:" not in (action.help or ""):  # some Python versions add it to boolean flags themselves
            action.help = f"{action.help} (default: {shown or '%(default)s'})"
    return parser


def parse_args(argv: list[str] | None = None, *, prog: str | None = None, description: str = "",
               epilog: str = "") -> TrainConfig:
    """The run's options from the command line, checked and resolved (:func:`resolve`); a bad one
    exits as an argument error (code 2) before any rank starts.

    Example::

        cfg = parse_args(["--tp=2", "--steps=100"])
    """
    parser = build_parser(prog, description=description, epilog=epilog)
    options = vars(parser.parse_args(argv))
    if options["out"] in ("", "none"):
        options["out"] = None
    try:
        return resolve(TrainConfig(**options))
    except ValueError as e:
        parser.error(str(e))


def resolve(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with ``dp`` and ``vocab_size`` filled in, after checking it against the world (--world or
    torchrun's ``WORLD_SIZE``), the data, the output directory (:func:`~.rundir.check_out`), the
    checkpoint and the metrics log to resume, each rank's memory (the plan's largest rank must fit it,
    :func:`~.planning.check`, unless --force) and the logger's package (``ValueError``). With
    --dry-run or --suggest, --out and the checkpoint are not looked at, and a plan over the memory is
    printed, not refused."""
    dp = _world_dp(cfg)
    assert cfg.microbatches is not None  # __post_init__ fills it in
    if cfg.vocab_size is not None and cfg.vocab_size < cfg.tp:
        raise ValueError(f"--vocab-size {cfg.vocab_size} is smaller than --tp {cfg.tp}")
    if cfg.batch_size % (dp * cfg.grad_accum * cfg.microbatches):
        pipelined = f" x --microbatches ({cfg.microbatches})" if cfg.pp > 1 or cfg.microbatches > 1 else ""
        raise ValueError(f"--batch-size {cfg.batch_size} is not divisible by dp ({dp}) x --grad-accum "
                         f"({cfg.grad_accum}){pipelined}")
    cfg = dataclasses.replace(cfg, dp=dp, vocab_size=_check_data(cfg))
    planning = cfg.dry_run or cfg.suggest
    if cfg.out is not None and not planning:
        # another job's lock: not on torchrun's other ranks (their rank 0 may hold it for them already)
        check_out(Path(cfg.out), resume=cfg.resume, overwrite=cfg.overwrite, held=os.environ.get("RANK", "0") == "0")
    if not planning:
        cfg = _check_resume(cfg)
    if not cfg.export_only:  # which trains nothing
        check_plan(cfg)
    for name, package, install in LOGGER_PACKAGES:
        if cfg.logger == name and importlib.util.find_spec(package) is None:
            raise ValueError(f"--logger {name} needs the {package} package: {install}")
    if cfg.logger != "none" and cfg.out is None:
        raise ValueError(f"--logger {cfg.logger} writes into --out, which is 'none'")
    return cfg


def _world_dp(cfg: TrainConfig) -> int:
    """dp: as given, or the world (--world, or torchrun's) over tp x pp (checked against it), else 1."""
    if "WORLD_SIZE" in os.environ and cfg.world is not None and cfg.world != int(os.environ["WORLD_SIZE"]):
        raise ValueError(f"--world {cfg.world}, but torchrun's world has {os.environ['WORLD_SIZE']} ranks")
    if cfg.world is None and "WORLD_SIZE" not in os.environ:
        return cfg.dp or 1
    world, stage = cfg.world or int(os.environ["WORLD_SIZE"]), cfg.tp * cfg.pp
    shown = f"--tp {cfg.tp} x --pp {cfg.pp}" if cfg.pp > 1 else f"--tp {cfg.tp}"
    if world % stage:
        raise ValueError(f"{shown} does not divide the world of {world} ranks")
    if cfg.dp is not None and stage * cfg.dp != world:
        raise ValueError(f"{shown} x --dp {cfg.dp} = {stage * cfg.dp} ranks, but the world has {world}")
    return world // stage


def _check_data(cfg: TrainConfig) -> int:
    """The vocabulary size, after checking that the data exists, has room for a block in each split
    and (small token files: all of them) holds ids below the vocabulary."""
    if cfg.data is not None and not Path(cfg.data).exists():
        raise ValueError(f"--data {cfg.data}: no such file or directory")
    token_dir = Path(cfg.data) if cfg.data is not None and Path(cfg.data).is_dir() else None
    if token_dir is not None:
        missing = [name for name in ("train.bin", "val.bin") if not (token_dir / name).is_file()]
        if missing:
            raise ValueError(f"--data {cfg.data}: a directory of token data needs train.bin and val.bin; "
                             f"{' and '.join(missing)} missing")
        if cfg.vocab_size is None:
            raise ValueError(f"--data {cfg.data} holds token ids: give their --vocab-size (GPT-2's: 50257)")
    elif (cfg.vocab_size or VOCAB_SIZE) < VOCAB_SIZE:
        raise ValueError(f"--vocab-size {cfg.vocab_size} is below 256, the number of byte values")
    vocab = cfg.vocab_size or VOCAB_SIZE
    splits = open_splits(cfg.data, seed=cfg.seed, val_fraction=cfg.val_fraction, vocab_size=vocab)
    for name, split in zip(("train", "val"), splits, strict=True):
        where = (f"{cfg.data}/{name}.bin" if token_dir is not None
                 else f"the {name} split of {cfg.data or 'the built-in corpus'}")
        if len(split) <= cfg.block_size:
            raise ValueError(f"{where} holds {len(split)} tokens, fewer than --block-size + 1 ({cfg.block_size + 1})")
        if len(split) <= SCANNED_TOKENS:
            split.check_ids(where)
    return vocab


def _check_resume(cfg: TrainConfig) -> TrainConfig:
    """With ``--resume must``: a checkpoint exists; with any resume, a checkpoint found is of the same
    model and has steps left to run. With ``--export-only``: ``cfg`` with the checkpoint's model options."""
    if cfg.resume == "never":
        return cfg
    if cfg.out is None:
        raise ValueError("--resume needs --out (the directory holding the checkpoint)")
    try:
        meta = checkpoint_files.read_manifest(checkpoint_files.resolve(cfg.out), None)  # load hashes the files
    except CheckpointError as e:
        if cfg.resume == "auto" and not Path(cfg.out, "latest").exists() and not Path(cfg.out, "meta.json").exists():
            return cfg
        raise ValueError(f"--resume: nothing to resume from: {e}") from None
    log = Path(cfg.out, "metrics.jsonl")
    if log.is_file():
        read_log(log)  # a torn last line is dropped when the run resumes; any other bad line is refused now
    # the model's config as the checkpoint holds it (the fields that say what the model is): each that
    # an option sets must be the same now
    saved, ours = meta.get("config") or {}, dataclasses.asdict(cfg)
    if cfg.export_only:  # the model as it was trained, whatever the options say
        return dataclasses.replace(cfg, **{k: v for k, v in saved.items() if k in ours})
    diff = ", ".join(f"--{_flag(k)}: checkpoint {value}, now {ours[k]}" for k, value in saved.items()
                     if k in ours and value != ours[k])
    if diff:
        raise ValueError(f"--resume: the checkpoint in {cfg.out} is of another model ({diff})")
    last = cfg.stop_at or cfg.steps
    if meta["step"] >= last and not cfg.export_only:
        raise ValueError(f"--resume: the checkpoint in {cfg.out} is at step {meta['step']}, nothing left to run "
                         f"up to step {last} (raise {'--stop-at' if cfg.stop_at else '--steps'} to train further)")
    return cfg

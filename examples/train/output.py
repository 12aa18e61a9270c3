"""What a training run's first rank writes and shows: the metrics log (``metrics.jsonl``), a
progress bar, the loss curve, and optionally TensorBoard or Weights & Biases. tqdm and matplotlib
are optional (the ``train`` and ``plot`` extras): without them there is no bar or no picture, and a
line saying which extra to install."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

#: the metrics a logger sends, and their names there (the log's other fields describe the run)
SCALARS = (("loss", "train/loss"), ("val_loss", "val/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
           ("tokens_per_s", "train/tokens_per_s"), ("mfu", "train/mfu"), ("peak_memory_mib", "train/peak_memory_mib"))


def read_log(path: Path) -> tuple[list[tuple[str, dict[str, Any]]], int | None]:
    """The lines of the metrics log ``path`` with their rows, and the number of a torn last line (cut
    short by a run that ended while writing it: left out), or None. Any other line that is not a JSON
    object with a ``step`` is a ``ValueError`` naming the file and the line."""
    lines = [(number, line) for number, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    rows, torn = [], None
    for position, (number, line) in enumerate(lines, 1):
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or "step" not in row:
                raise ValueError("not a JSON object with a step")
        except ValueError as e:
            if position == len(lines):
                torn = number
                break
            raise ValueError(f"{path}, line {number}: not a line of a metrics log ({e}): {line[:80]!r}") from None
        rows.append((line, row))
    return rows, torn


def open_log(out: Path, start: int) -> Any:
    """The metrics log, one JSON line per step: a new run starts it afresh; a run resumed at step
    ``start`` keeps the lines of the steps before it and drops any later ones (steps run after the
    checkpoint it resumes from, by a run that then stopped or died), so the log stays one line per step.
    A last line cut short by a run that died while writing it is dropped, with a warning."""
    path = out / "metrics.jsonl"
    kept = []
    if start > 1 and path.exists():
        rows, torn = read_log(path)
        if torn is not None:
            print(f"warning: {path}: line {torn} was cut short (a run ended while writing it): dropped",
                  file=sys.stderr, flush=True)
        kept = [line for line, row in rows if row["step"] < start]
    log = open(path, "w")  # noqa: SIM115 - the caller closes it
    log.writelines(line + "\n" for line in kept)
    return log


def progress(steps: int, done: int, desc: str) -> Any:
    """A progress bar over ``steps``, ``done`` of them already (none without tqdm)."""
    try:
        from tqdm import tqdm
    except ImportError:
        print("tqdm is not installed (pip install 'tensorpar[train]'): no progress bar")
        return None
    return tqdm(total=steps, initial=done, desc=desc, unit="step")


def plot(out: Path, *, unit: str = "byte") -> None:
    """The loss curve logged in ``out/metrics.jsonl`` (and the validation loss where it was measured),
    as ``out/loss.png``."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'tensorpar[plot]'): no loss.png")
        return
    rows = [row for _, row in read_log(out / "metrics.jsonl")[0]]
    val = [r for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1, label="train")
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", lw=1.5, ms=3, label="validation")
        ax.legend()
    ax.set(xlabel="step", ylabel=f"loss (nats / {unit})", title="GPT training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    plt.close(fig)


class TensorBoardLogger:
    """Scalars into ``out/tensorboard`` (``torch.utils.tensorboard``; the ``tensorboard`` extra). A
    resumed run drops what an earlier run logged from step ``start`` on."""

    def __init__(self, out: Path, start: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=start if start > 1 else None)

    def log(self, row: dict[str, Any]) -> None:
        for key, name in SCALARS:
            if key in row:
                self.writer.add_scalar(name, row[key], row["step"])

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """Scalars into a Weights & Biases run in ``out`` (offline unless ``WANDB_MODE`` says otherwise)."""

    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        import wandb

        os.environ.setdefault("WANDB_MODE", "offline")
        self.run = wandb.init(project="tensorpar", dir=str(out), config=config)

    def log(self, row: dict[str, Any]) -> None:
        self.run.log({name: row[key] for key, name in SCALARS if key in row}, step=row["step"])

    def close(self) -> None:
        self.run.finish()


def open_logger(kind: str, out: Path, *, start: int, config: dict[str, Any]) -> TensorBoardLogger | WandbLogger | None:
    """The logger ``kind`` names (``"tensorboard"``, ``"wandb"``), or None for ``"none"``."""
    if kind == "tensorboard":
        return TensorBoardLogger(out, start)
    if kind == "wandb":
        return WandbLogger(out, config)
    return None

"""What a training run's first rank writes and shows: the metrics log (``metrics.jsonl``), a
progress bar and the loss curve. tqdm and matplotlib are optional (the ``train`` and ``plot``
extras): without them there is no bar or no picture, and a line saying which extra to install."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def open_log(out: Path, start: int) -> Any:
    """The metrics log: a new run starts it afresh; a resumed one keeps the steps before ``start``."""
    path = out / "metrics.jsonl"
    kept = []
    if start and path.exists():
        kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] < start]
    log = open(path, "w")  # noqa: SIM115 - the caller closes it
    log.writelines(line + "\n" for line in kept)
    return log


def progress(steps: int, start: int, desc: str) -> Any:
    """A progress bar over ``steps`` (none without tqdm)."""
    try:
        from tqdm import tqdm
    except ImportError:
        print("tqdm is not installed (pip install 'tensorpar[train]'): no progress bar")
        return None
    return tqdm(total=steps, initial=start, desc=desc, unit="step")


def plot(out: Path) -> None:
    """The loss curve of every run logged in ``out/metrics.jsonl``, as ``out/loss.png``."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'tensorpar[plot]'): no loss.png")
        return
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1)
    ax.set(xlabel="step", ylabel="loss (nats / byte)", title="byte-level GPT training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    plt.close(fig)

"""The whole-training-step benchmark on CPU at a toy size: its figures, the plain model it measures
against, and the aten ops per step of ours against that plain model (no timing is asserted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run_gpt_step(directory, *options):
    """benchmarks/gpt_step.py on the tiny model for one round of one step: its stdout and figures."""
    out = directory / "figures.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # the MFU's peak table is the training app's (examples/train)
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpt_step.py"), "--size=tiny", "--rounds=1",
                           "--iters=1", f"--json={out}", *options], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, json.loads(out.read_text())


@pytest.fixture(scope="module")
def gpt_step(tmp_path_factory):
    return run_gpt_step(tmp_path_factory.mktemp("gpt_step"), "--no-compile", "--device=cpu")


def test_gpt_step_script_reports_every_figure(gpt_step):
    stdout, figures = gpt_step
    for row in ("| ours eager |", "| plain eager |", "| whole step |", "plain / ours"):
        assert row in stdout
    steps = figures["steps"]
    assert set(steps) == {"ours", "plain"} and all(f["ms"] > 0 and f["mfu"] is None for f in steps.values())
    assert steps["ours"]["plain_over_ours"] == pytest.approx(steps["plain"]["ms"] / steps["ours"]["ms"])
    assert figures["peak_tflops"] is None  # no dense peak is known for a CPU: MFU is left blank
    # the plain model, loaded with our weights, is the same function: float32 round-off apart at most
    assert figures["loss_gap"] <= 1e-5 * figures["loss"]


def test_ours_dispatches_at_most_10_percent_more_aten_ops_than_plain(gpt_step):
    """One whole eager step at tp=1 (forward, loss, backward, clipping, fused AdamW, zero_grad):
    every aten op of ours against nanoGPT's plain model of the same shape."""
    ops = gpt_step[1]["ops"]
    assert all(count > 0 for counts in ops["phases"].values() for count in counts.values()), ops["phases"]
    assert ops["ours"] / ops["plain"] <= 1.10, ops["phases"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gpt_step_on_cuda_times_eager_and_compiled_in_bf16(tmp_path):
    stdout, figures = run_gpt_step(tmp_path)  # the GPU defaults: bf16 autocast, fused AdamW, compiled too
    assert figures["dtype"] == "bf16"
    assert set(figures["steps"]) == {"ours", "plain", "ours compiled", "plain compiled"}
    assert "| ours compiled |" in stdout
    # both models do the same math under bf16 autocast; the sum order of their matmuls may differ
    assert figures["loss_gap"] <= 2e-2 * figures["loss"]
    if any(name in figures["device"] for name in ("H100", "H200", "A100")):
        assert figures["peak_tflops"] and "%" in stdout.split("| ours compiled |")[1].splitlines()[0]

"""The GPU benchmark script's logic, run on CPU at toy sizes (no timing is asserted)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_script_runs_and_reports_every_figure():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--n-embd=32", "--n-head=8",
                           "--seq=16", "--batch=2", "--rounds=1", "--iters=1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "plain / ours" in done.stdout and "MFU" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    assert [int(r.split("|")[1]) for r in rows] == [1, 2, 4, 8]
    assert rows[0].rstrip(" |").endswith("1.000")  # tp=1 is its own reference


def test_pipeline_bubble_script_reports_every_stage():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pipeline_bubble.py"), "--pp", "2",
                           "--microbatches", "2", "--steps", "1", "--forward-ms", "1", "--gpt-pp"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| 2 |")]
    assert [(r[3].strip(), r[-1].strip()) for r in rows] == [("gpipe", "2, 2"), ("1f1b", "2, 1")]
    assert all(len(r[-2].split(",")) == 2 for r in rows)  # an idle fraction for each stage

"""``make gpu-check``'s driver (benchmarks/gpu_check.py): how it reads pytest's tally, the block
benchmark's table and the step benchmark's JSON, and when it calls a resumed run the same as an
uninterrupted one. The whole driver runs end to end with ``--small`` (tens of seconds: three
training processes), by hand: ``PYTHONPATH=. python benchmarks/gpu_check.py --small``."""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_the_gpu_tests_are_collected_from_the_files_that_mark_them():
    files = [p.name for p in gpu_check.gpu_test_files(Path("tests"))]
    assert {"test_gpu.py", "test_dcp_cuda.py", "test_compile.py"} <= set(files)
    assert "test_notebooks.py" not in files and "test_gpu_check.py" not in files


def test_pytest_tally():
    text = "....s\n==== 12 passed, 1 failed, 3 skipped, 2 errors, 400 deselected in 61.2s ====\n"
    assert gpu_check.pytest_counts(text) == {"passed": 12, "failed": 1, "skipped": 3, "error": 2, "deselected": 400}
    assert gpu_check.pytest_counts("9 skipped, 612 deselected in 20.1s") == {"skipped": 9, "deselected": 612}
    assert gpu_check.pytest_counts("ImportError while loading conftest") == {}


def test_block_figures_from_the_benchmarks_table():
    text = ("| device | dtype | B×T×C, heads | ours ms | plain ms | plain / ours (target ≥ 1.0) | matmul TFLOP/s | "
            "our TFLOP/s | MFU (target ≥ 60%) |\n|---|---|---|---:|---:|---:|---:|---:|---:|\n"
            "| NVIDIA H100 80GB HBM3 | bfloat16 | 1×2048×4096, 32 | 9.10 | 9.56 | 1.050 | 760.1 | 695.3 | 91.5% |\n")
    assert gpu_check.block_figures(text) == {"plain / ours": "1.050", "MFU of the matmul rate": "91.5%",
                                             "shape": "1×2048×4096, 32"}
    assert gpu_check.block_figures("Traceback (most recent call last):") == {}


def test_step_figures_are_read_whatever_the_nesting(tmp_path):
    path = tmp_path / "gpt_step.json"
    path.write_text(json.dumps({"device": "H100", "eager": {"plain": {"ms": 250.0, "tokens_per_s": 65536.0,
                                                                      "mfu": 0.38}, "ratio": 0.85},
                                "compiled": [{"mfu": 0.41, "name": "ours"}]}))
    assert gpu_check.step_figures(path) == {"eager.plain.mfu": 0.38, "eager.ratio": 0.85, "compiled[0].mfu": 0.41}


def test_resume_verdict():
    straight = {1: 5.0, 2: 4.0, 3: 3.5, 4: 3.0}
    same = gpu_check.resume_verdict(straight, dict(straight), 2)
    assert same["ok"] and same["bitwise"]
    # deterministic kernels (the first halves agree bitwise): any later difference is the checkpoint's
    lost = gpu_check.resume_verdict(straight, straight | {4: 3.0 * (1 + 1e-6)}, 2)
    assert not lost["ok"] and not lost["bitwise"] and "3-4: max relative loss difference 1.00e-06" in lost["why"]
    # kernels that drift run to run: within bf16's tolerance passes, beyond it does not
    drifting = straight | {1: 5.0 * (1 + 1e-4)}
    assert gpu_check.resume_verdict(straight, drifting | {3: 3.5 * (1 + 1e-3)}, 2)["ok"]
    assert not gpu_check.resume_verdict(straight, drifting | {3: 3.5 * 1.1}, 2)["ok"]
    missing = gpu_check.resume_verdict(straight, {1: 5.0, 2: 4.0, 4: 3.0}, 2)
    assert not missing["ok"] and missing["why"] == "logged steps [1, 2, 4], expected [1, 2, 3, 4]"


def test_without_torch_or_without_a_gpu_it_stops_at_once_saying_what_it_needs(tmp_path):
    """``make gpu-check`` on a machine without a GPU (here: none visible), or with a Python that has no
    torch (here: ``python -S``, without site-packages), ends within 10 s, before any step, naming it."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    for flags, needs in ((["-S"], "gpu-check needs torch, which"), ([], "gpu-check needs an NVIDIA GPU, and this")):
        began = time.monotonic()
        done = subprocess.run([sys.executable, *flags, str(ROOT / "benchmarks" / "gpu_check.py"), "--out",
                               str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=60)
        took = time.monotonic() - began
        assert done.returncode == 2 and done.stderr.startswith(f"[gpu-check] {needs}"), done.stderr[-2000:]
        assert took < 10, f"it took {took:.1f} s to say so"
        assert not (tmp_path / "out").exists()  # no step ran

"""One command for a machine with a GPU (``make gpu-check``): the GPU tests, the benchmarks, and a
GPT-2 124M training run checked for exact resumption, ending in one summary table.

    PYTHONPATH=. python benchmarks/gpu_check.py [--out DIR] [--small]

1. Every test marked ``gpu`` (``pytest -m gpu`` on the files that mark some): passed, failed, skipped.
2. ``benchmarks/gpu.py``: our GPT block at tp=1 against plain PyTorch, and its MFU; then
   ``benchmarks/gpt_step.py --json DIR/gpt_step.json``, the whole model's step against a plain
   nanoGPT-style model, eager and compiled (its figures are shown as the file gives them; a missing
   script or file is reported, not fatal).
3. ``examples/train_gpt.py --tp 1`` at GPT-2 124M size (12 layers, 12 heads, 768 wide, 1024 tokens
   of context, 50304 tokens of vocabulary over the built-in byte corpus, 16 sequences a step, bf16):
   one run of ``STEPS`` steps, and one stopped at ``STEPS / 2`` with a checkpoint and resumed from
   it. The resumed run's losses must equal the uninterrupted run's step for step. Where they are not
   bitwise equal, the first halves of the two runs (the same steps, both from scratch) measure how
   far two runs of this machine's kernels drift apart anyway; the resumed losses then pass when
   they are as close as that drift allows (within bf16's 2e-2 relative), and never when the first
   halves were bitwise equal: then any difference is the checkpoint's.

Every step's log and figures go into ``DIR`` (default ``out/gpu-check``), the table into
``DIR/summary.md`` as well. Exit status 1 when a test failed, a step could not run, or the resumed
run differs; 2, at once, when this Python has no torch or torch sees no GPU. ``--small`` shrinks
everything to seconds on a CPU (the block benchmark's smallest sizes, a tiny GPT, no GPT-2 step
benchmark, the GPU tests collected and skipped), to check this script itself.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: GPT-2 124M (nanoGPT's padded vocabulary) at nanoGPT's micro-batch, in bf16
GPT2_SMALL = ["--n-layer=12", "--n-head=12", "--n-embd=768", "--block-size=1024", "--vocab-size=50304",
              "--batch-size=16", "--dtype=bf16", "--lr=6e-4", "--min-lr=6e-5"]  # nanoGPT's rates for this size
TINY = ["--n-layer=1", "--n-head=2", "--n-embd=32", "--block-size=16", "--batch-size=4", "--dtype=fp32"]
#: relative loss difference bf16 allows (the project's bf16 tolerance)
BF16_TOLERANCE = 2e-2


def run(name: str, argv: list[str], out: Path, timeout: float) -> tuple[int | None, str]:
    """``python argv`` from the repository root with ``PYTHONPATH=.``; its exit status (None when it
    ran past ``timeout`` seconds) and its output, also written to ``out/name.log``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    began = time.perf_counter()
    print(f"[gpu-check] {name}: python {' '.join(argv)}", flush=True)
    try:
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout, check=False)
        code, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code, text = None, f"{_text(e.stdout)}{_text(e.stderr)}\n[gpu-check] timed out after {timeout:.0f} s\n"
    (out / f"{name}.log").write_text(text)
    print(f"[gpu-check] {name}: {'timed out' if code is None else f'exit {code}'} in "
          f"{time.perf_counter() - began:.0f} s (log: {out / f'{name}.log'})", flush=True)
    return code, text


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def gpu_test_files(where: Path) -> list[Path]:
    """The test files under ``where`` (or ``where`` itself) that mark tests ``gpu``: collecting only
    those, a test module needing a package this machine lacks (notebooks, say) stops nothing."""
    if where.is_file():
        return [where]
    return sorted(p for p in (ROOT / where).rglob("test_*.py") if re.search(r"mark\.gpu\b", p.read_text()))


def pytest_counts(text: str) -> dict[str, int]:
    """pytest's closing tally (``3 passed, 1 failed, 2 skipped in 4.2s``) as ``{"passed": 3, ...}``."""
    lines = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|error|deselected)", line)]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", lines[-1])} if lines else {}
    if "errors" in counts:
        counts["error"] = counts.pop("errors")
    return counts


def block_figures(text: str) -> dict[str, str]:
    """The plain / ours ratio and the MFU from ``benchmarks/gpu.py``'s first table."""
    rows = [line for line in text.splitlines() if line.startswith("|") and not line.startswith("|---")]
    if len(rows) < 2 or "plain / ours" not in rows[0]:
        return {}
    cells = [c.strip() for c in rows[1].strip("|").split("|")]
    return {"plain / ours": cells[5], "MFU of the matmul rate": cells[8], "shape": cells[2]}


def flatten(data: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted path, value)`` of every number or string in nested dicts and lists."""
    if isinstance(data, dict):
        for key, value in data.items():
            yield from flatten(value, f"{path}.{key}" if path else str(key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from flatten(value, f"{path}[{i}]")
    elif isinstance(data, (int, float, str)) and not isinstance(data, bool):
        yield path, data


def step_figures(path: Path) -> dict[str, Any]:
    """The whole-model step benchmark's ratios (plain / ours) and MFUs, by their path in its JSON file."""
    data = json.loads(path.read_text())
    return {k: v for k, v in flatten(data) if re.search(r"ratio|mfu|plain_?/_?ours", k, flags=re.I)
            and isinstance(v, (int, float))}


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def resume_verdict(straight: dict[int, float], resumed: dict[int, float], stop: int) -> dict[str, Any]:
    """Whether a run stopped after step ``stop`` and resumed (``resumed``: its losses by step, the
    first run's before ``stop``) trained as the uninterrupted run did (``straight``)."""
    steps = sorted(straight)
    if sorted(resumed) != steps:
        return {"ok": False, "bitwise": False, "why": f"logged steps {sorted(resumed)}, expected {steps}"}

    def worst(part: list[int]) -> float:
        return max((abs(resumed[s] - straight[s]) / abs(straight[s]) for s in part), default=0.0)

    before, after = [s for s in steps if s <= stop], [s for s in steps if s > stop]
    drift, diff = worst(before), worst(after)
    bitwise = all(resumed[s] == straight[s] for s in after)
    ok = bitwise or (drift > 0 and diff <= BF16_TOLERANCE)
    why = (f"steps {after[0]}-{after[-1]}: max relative loss difference {diff:.2e}; two fresh runs of steps "
           f"1-{stop} differ by {drift:.2e}")
    return {"ok": ok, "bitwise": bitwise, "why": why, "max_rel_diff": diff, "drift": drift}


def train_and_resume(out: Path, *, small: bool, steps: int, timeout: float) -> dict[str, Any]:
    """The straight run, the stopped one and its resumption; the verdict and the straight run's figures."""
    common = ["examples/train_gpt.py", "--tp=1", *(TINY if small else GPT2_SMALL), f"--steps={steps}",
              "--warmup=5", "--eval-every=0", "--sample-tokens=0", "--no-progress", "--ckpt-every=0"]
    stop = steps // 2
    runs = {"train_straight": [f"--out={out / 'straight'}", "--overwrite"],  # a check run again sets its last aside
            "train_stopped": [f"--out={out / 'resumed'}", f"--stop-at={stop}", "--overwrite"],
            "train_resumed": [f"--out={out / 'resumed'}", "--resume"]}
    for name, extra in runs.items():
        code, text = run(name, [*common, *extra], out, timeout)
        if code != 0:
            said = (text.strip().splitlines() or [""])[-1]
            return {"ok": False, "bitwise": False,
                    "why": f"{name} {'timed out' if code is None else 'failed'}: {said} (see {name}.log)"}
    verdict = resume_verdict(losses(out / "straight"), losses(out / "resumed"), stop)
    last = json.loads((out / "straight" / "metrics.jsonl").read_text().splitlines()[-1])
    return verdict | {"train": last}


def missing(small: bool) -> str | None:
    """What this machine lacks for the check (torch; an NVIDIA GPU unless ``small``), or None. Asked
    first, without importing torch (seconds on a busy host), so that a machine without them stops at
    once instead of failing every step in turn."""
    if importlib.util.find_spec("torch") is None:
        return (f"gpu-check needs torch, which {sys.executable} cannot import; run it with a Python that has "
                "torch, e.g. `make gpu-check PYTHON=.venv/bin/python` after `make test`")
    if small:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=8, check=False)
        gpus = listed.stdout.count("GPU ") if listed.returncode == 0 else 0
    except (OSError, subprocess.TimeoutExpired):
        gpus = 0
    if gpus == 0 or visible in ("", "-1"):
        seen = "nvidia-smi lists no GPU" if gpus == 0 else f"CUDA_VISIBLE_DEVICES={visible!r} hides its {gpus}"
        return (f"gpu-check needs an NVIDIA GPU, and this machine has none visible ({seen}); run it on a "
                "machine with a GPU, or with --small to check the script itself on a CPU")
    return None


def table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(["| check | result |", "|---|---|"] + [f"| {k.ljust(width)} | {v} |" for k, v in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "out" / "gpu-check"), help="where logs and figures go")
    parser.add_argument("--small", action="store_true", help="tiny sizes that run in seconds on a CPU")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 40; --small: 6)")
    parser.add_argument("--tests", default="tests", help="the folder (or one file) of the gpu-marked tests")
    args = parser.parse_args(argv)
    lacking = missing(args.small)
    if lacking is not None:
        print(f"[gpu-check] {lacking}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    rows: list[tuple[str, str]] = []
    failed: list[str] = []

    code, text = run("gpu_tests", ["-m", "pytest", "-q", "-m", "gpu", *map(str, gpu_test_files(Path(args.tests)))],
                     out, 300)
    counts = pytest_counts(text)
    rows.append(("GPU tests (pytest -m gpu)", ", ".join(f"{n} {w}" for w, n in counts.items()
                                                        if w in ("passed", "failed", "skipped", "error"))
                 or f"no tally ({'timed out' if code is None else f'exit {code}'})"))
    if code not in (0, 5) or counts.get("failed") or counts.get("error"):  # 5: nothing collected
        failed.append("GPU tests")

    small_block = ["--n-embd=64", "--n-head=8", "--seq=32", "--batch=2", "--rounds=1", "--iters=1"]
    code, text = run("block_benchmark", ["benchmarks/gpu.py", *(small_block if args.small else [])], out, 180)
    block = block_figures(text)
    if code != 0 or not block:
        failed.append("block benchmark")
    rows.append(("block at tp=1: plain / ours (target >= 1.0)",
                 f"{block['plain / ours']} ({block['shape']})" if block else "not measured (see block_benchmark.log)"))
    rows.append(("block MFU of the measured matmul rate", block.get("MFU of the matmul rate", "not measured")))

    step_json = out / "gpt_step.json"
    step_json.unlink(missing_ok=True)
    script = ROOT / "benchmarks" / "gpt_step.py"
    if args.small:
        rows.append(("GPT-2 step: plain / ours, MFU", "not run (--small)"))
    elif not script.exists():
        rows.append(("GPT-2 step: plain / ours, MFU", "not run: benchmarks/gpt_step.py is missing"))
    else:
        code, _ = run("gpt_step", ["benchmarks/gpt_step.py", "--json", str(step_json)], out, 240)
        if step_json.exists():
            figures = step_figures(step_json)
            rows += [(f"GPT-2 step: {k}", f"{v:.4g}") for k, v in figures.items()] or \
                [("GPT-2 step", f"no ratio, MFU or tokens/s in {step_json}")]
        else:
            rows.append(("GPT-2 step: plain / ours, MFU", f"no {step_json.name} (exit {code})"))
            failed.append("GPT-2 step benchmark")

    steps = args.steps or (6 if args.small else 40)
    verdict = train_and_resume(out, small=args.small, steps=steps, timeout=120 if args.small else 180)
    train = verdict.get("train", {})
    if train:
        mfu = f"MFU {train['mfu']:.1%}" if "mfu" in train else "MFU unknown (no known peak)"
        rows.append((f"train_gpt.py --tp 1 ({'tiny' if args.small else 'GPT-2 124M'}, {train['dtype']})",
                     f"{train['tokens_per_s']:,.0f} tokens/s, {mfu}, peak memory "
                     f"{train['peak_memory_mib'] / 1024:.2f} GiB, {train['device']}"))
    rows.append((f"checkpoint resume bitwise (stop at {steps // 2} of {steps})",
                 f"{'yes' if verdict['bitwise'] else 'no'}: {verdict['why']}"))
    if not verdict["ok"]:
        failed.append("checkpoint resume")

    rows.append(("gpu-check", f"{'FAILED: ' + ', '.join(failed) if failed else 'passed'} in "
                              f"{time.perf_counter() - began:.0f} s"))
    summary = table(rows)
    (out / "summary.md").write_text(summary + "\n")
    print("\n" + summary)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

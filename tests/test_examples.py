"""The scripts in examples/ run their command lines and report OK.

    pytest -q tests/test_examples.py

``gpt_block.py`` runs exactly as a user runs it: a subprocess from the repository
root that starts its own ranks with ``tensorpar.spawn``. The others run their
``main()`` in this process, with ``sys.argv`` set to the same command line and
their ``tensorpar.spawn(fn, n, ...)`` served by the persistent n-process pool
(what ``spawn`` does, without starting n new processes per script: starting
ranks costs seconds; ``spawn`` itself is tested in ``tests/test_launch.py``).
The GPT-2 example runs on a tiny random Hugging Face model saved to a temporary
directory; its greedy output must equal Hugging Face's own greedy ``generate``.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import tensorpar

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 180  # seconds per script; each normally takes under 10


def run_example(script: str, *args: Any) -> str:
    """Run ``python examples/<script> args`` from the repository root; its stdout, after checking it exited 0."""
    cmd = [sys.executable, str(ROOT / "examples" / script), *map(str, args)]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, (f"{' '.join(cmd[1:])} exited with {proc.returncode}\n"
                                  f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc.stdout


def run_example_on_pool(worlds: Any, monkeypatch: pytest.MonkeyPatch, script: str, *args: Any) -> str:
    """``examples/<script> args`` as :func:`run_example` runs it, but in this process with its ranks on
    ``worlds[n]``: the script is imported by name (the ranks import its functions the same way) and
    its ``main()`` is called; its stdout, after checking it did not exit with an error."""
    def on_pool(fn: Any, nprocs: int, *fn_args: Any, **options: Any) -> list[Any]:
        assert not options, f"{script} passed spawn options {options} that the pool does not serve"
        return worlds[nprocs].run(fn, *fn_args, mesh=False, timeout=TIMEOUT)

    name = Path(script).stem
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.setattr(sys, "argv", [str(ROOT / "examples" / script), *map(str, args)])
    monkeypatch.setattr(tensorpar, "spawn", on_pool)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            importlib.import_module(name).main()
    except SystemExit as e:
        assert e.code in (None, 0), f"{script} exited with {e.code!r}\n--- stdout\n{out.getvalue()}"
    finally:
        sys.modules.pop(name, None)
    return out.getvalue()


def line_starting(stdout: str, prefix: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, f"expected one line starting {prefix!r} in:\n{stdout}"
    return lines[0]


def test_swap_linear_matches_the_dense_model_with_a_shard_of_its_memory(worlds, monkeypatch):
    out = run_example_on_pool(worlds, monkeypatch, "swap_linear.py", "--tp", 2, "--vocab", 37, "--d", 16,
                              "--hidden", 45, "--layers", 1, "--batch", 2, "--seq", 5)
    assert "OK: the parallelized model matches the dense one at tp=2" in line_starting(out, "OK")
    # the memory table: one row per rank, the embedding and fc1 split unevenly (37 = 19 + 18, 45 = 23 + 22)
    rows = [line for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert len(rows) == 2 and "(19, 16)" in rows[0] and "(23, 16)" in rows[0], out
    assert "(18, 16)" in rows[1] and "(22, 16)" in rows[1], out
    ratios = [float(row.split()[-1]) for row in rows]  # parameter bytes vs the dense model's / tp
    assert all(0.9 < r < 1.2 for r in ratios), out  # replicated LayerNorms and biases: a little over 1
    assert "MISMATCH" not in out


def test_gpt_block_matches_the_dense_block():
    out = run_example("gpt_block.py", "--tp", 2, "--n-embd", 24, "--n-head", 3, "--batch", 2, "--seq", 5)
    assert line_starting(out, "OK").startswith("OK: the sharded block matches the dense one at tp=2")
    assert line_starting(out, "rank 0:").startswith("rank 0: 2 heads")  # 3 heads: 2 + 1
    assert line_starting(out, "rank 1:").startswith("rank 1: 1 heads")
    for name in ("output", "input grad", "grad attn.c_attn.weight", "grad mlp.c_proj.weight", "grad ln_1.weight"):
        assert f"    {name} " in out, out


# ---------------------------------------------------------------- Hugging Face GPT-2

PROMPT_IDS = [1, 2, 3]
TOKENS = ["<|endoftext|>", *"abcdefghijklmnopqrstuvwxyz", "Ġ", ",", ".", *"0123456789", *"ABCDEFGHIJ"]  # 50


def save_tiny_gpt2(path: Path, *, tokenizer: bool = False) -> Any:
    """A tiny random ``GPT2LMHeadModel`` saved to ``path`` (and a 50-token byte-level tokenizer); the model."""
    transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=len(TOKENS), n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(path)
    if tokenizer:  # byte-level BPE with single characters only: no merges
        (path / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(TOKENS)}))
        (path / "merges.txt").write_text("#version: 0.2\n")
        transformers.GPT2Tokenizer(str(path / "vocab.json"), str(path / "merges.txt")).save_pretrained(path)
    return model


def test_hf_gpt2_greedy_generation_equals_hugging_face(worlds, monkeypatch, tmp_path):
    hf = save_tiny_gpt2(tmp_path)
    new = 8
    out = run_example_on_pool(worlds, monkeypatch, "hf_gpt2_generate.py", "--model-dir", tmp_path, "--tp", 2,
                              "--prompt-ids", ",".join(map(str, PROMPT_IDS)), "--max-new-tokens", new,
                              "--temperature", 0)
    assert line_starting(out, "OK") == f"OK: all 2 ranks generated the same {new} new tokens"
    tokens = ast.literal_eval(line_starting(out, "tokens: ").removeprefix("tokens: "))

    prompt = torch.tensor([PROMPT_IDS])
    with torch.no_grad():  # eos_token_id=None: do not stop early at token 0, as GPT.generate does not
        expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0].tolist()
    assert len(expected) == len(PROMPT_IDS) + new
    assert tokens == expected


def test_hf_gpt2_samples_text_with_a_tokenizer(worlds, monkeypatch, tmp_path):
    save_tiny_gpt2(tmp_path, tokenizer=True)
    out = run_example_on_pool(worlds, monkeypatch, "hf_gpt2_generate.py", "--model-dir", tmp_path, "--tp", 2,
                              "--prompt", "hello, world", "--max-new-tokens", 5, "--temperature", 0.8, "--top-k", 10,
                              "--seed", 3)
    assert line_starting(out, "OK") == "OK: all 2 ranks generated the same 5 new tokens"
    prompt_ids = ast.literal_eval(line_starting(out, "prompt ids: ").removeprefix("prompt ids: "))
    assert prompt_ids == [TOKENS.index(c if c != " " else "Ġ") for c in "hello, world"]
    text = ast.literal_eval(line_starting(out, "text: ").removeprefix("text: "))
    assert text.startswith("hello, world") and len(text) > len("hello, world")


# ---------------------------------------------------------------- training: what the hardware did, and the export

def test_train_gpt_reports_the_hardware_and_exports_to_hugging_face(worlds, monkeypatch, tmp_path):
    """tp=2 in bf16 autocast on the CPU with a given peak: every metrics line and the summary carry
    tokens/s, MFU, peak memory, device and dtype; --export-hf writes a GPT-2 directory whose logits
    are those of the final checkpoint's weights (the script's default: no biases)."""
    transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
    from examples.train.hardware import model_flops_per_token
    from layers import GPTConfig
    from reference_gpt import RefConfig, RefGPT
    from tensorpar import checkpoint

    out, hf_dir = tmp_path / "run", tmp_path / "hf"
    sizes = dict(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16, bias=False)
    stdout = run_example_on_pool(worlds, monkeypatch, "train_gpt.py", "--tp", 2, "--steps", 3, "--n-layer", 1,
                                 "--n-head", 2, "--n-embd", 16, "--block-size", 16, "--batch-size", 4,
                                 "--dtype", "bf16", "--peak-tflops", 1, "--sample-tokens", 0, "--no-progress",
                                 "--out", out, "--export-hf", hf_dir)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    flops = model_flops_per_token(GPTConfig(**sizes).parameter_count(), 1, 2, 8, 16)  # 6N + 12LHQT
    for r in rows:
        assert (r["device"], r["dtype"]) == ("cpu", "bf16")
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0 and r["peak_memory_mib"] > 0
        assert 0 < r["mfu"] < 1  # these few FLOPs are far below a TFLOP/s per rank
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * flops / (2 * 1e12), rel=1e-9)  # 2 ranks of 1 TFLOP/s
    speed = line_starting(stdout, "cpu, bf16: ")
    assert "tokens/s (last 3 steps), MFU " in speed and "of 2 x 1 TFLOP/s" in speed
    memory = line_starting(stdout, "peak memory per rank (GiB, peak resident set): ").split(": ")[1].split(", ")
    assert len(memory) == 2 and all(float(m) > 0 for m in memory)
    assert line_starting(stdout, "Hugging Face GPT-2: ").startswith(f"Hugging Face GPT-2: {hf_dir} ")

    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir, local_files_only=True).eval()
    plain = RefGPT(RefConfig(**sizes)).eval()
    plain.load_state_dict(checkpoint.export_state_dict(out))  # the weights the run ended with
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, logits = plain(idx), hf(idx).logits
    assert (logits - expected).norm() <= 1e-5 * expected.norm()

"""The training script's command line, checked in this process (no rank starts): every option
explained with its default, and every bad argument an argument error (exit code 2, one line naming
the numbers) before any rank would start."""

import argparse
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorpar
from examples.train import build_parser, parse_args
from layers import GPTConfig

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"


@pytest.fixture(autouse=True)
def not_under_torchrun(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def refused(capsys, *argv):
    """The one-line error of a refused command line (argparse's exit code 2)."""
    with pytest.raises(SystemExit) as exit_:
        parse_args(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err[0].startswith("usage:") and "Traceback" not in "\n".join(err)
    return err[-1].split("error: ", 1)[1]


def write_tokens(folder, train, val):
    """nanoGPT's layout: flat uint16 ids in train.bin and val.bin (written by numpy, as nanoGPT does)."""
    folder.mkdir(exist_ok=True)
    np.asarray(train, dtype=np.uint16).tofile(folder / "train.bin")
    np.asarray(val, dtype=np.uint16).tofile(folder / "val.bin")
    return folder


def test_help_explains_every_option_with_its_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # help lines unwrapped
    script = runpy.run_path(str(SCRIPT), run_name="train_gpt")  # its functions; main() does not run
    with pytest.raises(SystemExit) as exit_:
        script["parse_args"](["--help"])
    text = capsys.readouterr().out
    assert exit_.value.code == 0 and text.startswith("usage: train_gpt.py")
    for group in ("model:", "parallelism:", "optimisation:", "data and validation:", "checkpoints and output:",
                  "planning:", "examples:"):
        assert f"\n{group}\n" in text, group
    options = [a for a in build_parser()._actions if not isinstance(a, argparse._HelpAction)]
    assert len(options) >= 30
    for action in options:
        assert action.help and "(default: " in action.help, action.option_strings
        assert action.option_strings[0] in text
    assert "--resume [{never,auto,must}]" in text and "'must' (what --resume alone means)" in text


def test_defaults_and_torchrun_world(monkeypatch):
    cfg = parse_args([])
    assert (cfg.tp, cfg.dp, cfg.vocab_size, cfg.resume, cfg.out, cfg.stop_at) == (2, 1, 256, "never", "out", None)
    assert (cfg.dtype, cfg.peak_tflops, cfg.export_hf) == (None, None, None)  # bf16 on a GPU, fp32 on the CPU
    assert (parse_args(["--dtype=bf16", "--peak-tflops=312"]).dtype, parse_args(["--peak-tflops=312"]).peak_tflops) \
        == ("bf16", 312.0)
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert parse_args(["--tp=3"]).dp == 2 and parse_args(["--tp=2", "--dp=3", "--batch-size=12"]).dp == 3


def test_bad_arguments_are_argument_errors(capsys, monkeypatch, tmp_path):
    text = tmp_path / "small.txt"
    text.write_bytes(b"x" * 200)  # 180 bytes to train on, 20 held out
    missing = f"{tmp_path}/missing.txt"
    assert refused(capsys, f"--data={missing}") == f"--data {missing}: no such file or directory"
    assert refused(capsys, f"--data={text}", "--block-size=32") == \
        f"the val split of {text} holds 20 tokens, fewer than --block-size + 1 (33)"
    assert refused(capsys, f"--data={text}", "--block-size=190") == \
        f"the train split of {text} holds 180 tokens, fewer than --block-size + 1 (191)"
    assert refused(capsys, "--n-embd=30", "--n-head=4") == "--n-embd 30 is not divisible by --n-head 4"
    assert refused(capsys, "--n-head=2", "--tp=4") == "--n-head 2 is smaller than --tp 4: each tp rank needs a head"
    assert refused(capsys, "--batch-size=6", "--dp=2", "--grad-accum=2") == \
        "--batch-size 6 is not divisible by dp (2) x --grad-accum (2)"
    assert refused(capsys, "--fsdp", "--zero").startswith("--fsdp and --zero exclude each other")
    assert refused(capsys, "--vocab-size=100") == "--vocab-size 100 is below 256, the number of byte values"
    assert refused(capsys, "--steps=10", "--stop-at=11") == "--stop-at 11 is not a step of the run (1 to --steps 10)"
    assert refused(capsys, "--steps=0") == "--steps must be at least 1, got 0"
    assert refused(capsys, "--dropout=1") == "--dropout must be in [0, 1), got 1.0"
    assert refused(capsys, "--out=none", "--resume") == "--resume needs --out (the directory holding the checkpoint)"
    assert refused(capsys, "--dtype=fp16") == (
        "--dtype fp16 needs loss scaling, which this script does not do (a step skipped for an overflow must be "
        "skipped by every tp, dp and pp rank alike): use --dtype bf16 (CPUs, A100, H100 and newer GPUs) or "
        "--dtype fp32")
    assert "--dtype: invalid choice: 'float16'" in refused(capsys, "--dtype=float16")
    assert refused(capsys, "--peak-tflops=0") == "--peak-tflops must be above 0, got 0.0"
    assert refused(capsys, "--export-hf=hf", "--pp=2", "--n-layer=2").startswith(
        "--export-hf needs --pp 1 (each of the 2 pipeline ranks holds part of the model)")
    assert refused(capsys, "--export-only") == (
        "--export-only writes the checkpoint in --out to --export-hf DIR: give --export-hf")
    assert refused(capsys, f"--out={tmp_path}/empty", "--export-only", "--export-hf=hf").startswith(
        f"--resume: nothing to resume from: no checkpoint at {tmp_path}/empty")
    assert refused(capsys, f"--out={tmp_path}/empty", "--resume").startswith(
        f"--resume: nothing to resume from: no checkpoint at {tmp_path}/empty")
    assert parse_args([f"--out={tmp_path}/empty", "--resume=auto"]).resume == "auto"  # starts afresh
    assert "--resume" in refused(capsys, "--resume=sometimes")  # not one of never, auto, must
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert refused(capsys, "--tp=3", "--n-head=3", "--n-embd=96") == "--tp 3 does not divide the world of 4 ranks"
    assert refused(capsys, "--tp=2", "--dp=3") == "--tp 2 x --dp 3 = 6 ranks, but the world has 4"


def test_bad_token_data_is_an_argument_error(capsys, tmp_path):
    write_tokens(tmp_path / "odd", range(100), range(50))
    (tmp_path / "odd" / "val.bin").unlink()
    assert refused(capsys, f"--data={tmp_path}/odd", "--vocab-size=100") == \
        f"--data {tmp_path}/odd: a directory of token data needs train.bin and val.bin; val.bin missing"
    tokens = write_tokens(tmp_path / "tokens", [i % 70 for i in range(500)], [i % 50 for i in range(100)])
    assert refused(capsys, f"--data={tokens}") == \
        f"--data {tokens} holds token ids: give their --vocab-size (GPT-2's: 50257)"
    assert refused(capsys, f"--data={tokens}", "--vocab-size=60") == \
        f"{tokens}/train.bin holds token id 69, not below the vocabulary size 60"
    assert refused(capsys, f"--data={tokens}", "--vocab-size=300", "--block-size=100") == \
        f"{tokens}/val.bin holds 100 tokens, fewer than --block-size + 1 (101)"
    assert refused(capsys, f"--data={tokens}", "--vocab-size=1", "--tp=2", "--n-head=2") == \
        "--vocab-size 1 is smaller than --tp 2"
    with open(tokens / "val.bin", "ab") as f:
        f.write(b"\0")
    assert refused(capsys, f"--data={tokens}", "--vocab-size=300") == \
        f"{tokens}/val.bin holds 201 bytes, not a whole number of torch.uint16 tokens (2 bytes each)"
    cfg = parse_args([f"--data={write_tokens(tmp_path / 'good', range(70), range(50))}", "--vocab-size=70",
                      "--block-size=8"])
    assert (cfg.vocab_size, cfg.data) == (70, str(tmp_path / "good"))


def test_a_missing_logger_package_names_the_extra(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert refused(capsys, "--logger=tensorboard") == \
        '--logger tensorboard needs the tensorboard package: pip install -e ".[tensorboard]"'
    assert refused(capsys, "--logger=wandb") == "--logger wandb needs the wandb package: pip install wandb"


@settings(max_examples=40)
@given(tp=st.integers(1, 4), dp=st.integers(1, 4), n_head=st.integers(1, 6), head=st.integers(1, 3),
       n_embd_extra=st.integers(0, 2), batch=st.integers(1, 12), accum=st.integers(1, 3))
def test_sizes_are_accepted_exactly_when_they_fit(tp, dp, n_head, head, n_embd_extra, batch, accum):
    """The script accepts a layout iff the GPT can be split and the batch divides over dp and micro-batches."""
    n_embd = n_head * head + n_embd_extra
    argv = [f"--tp={tp}", f"--dp={dp}", f"--n-head={n_head}", f"--n-embd={n_embd}", f"--batch-size={batch}",
            f"--grad-accum={accum}"]
    fits = n_embd % n_head == 0 and n_head >= tp and batch % (dp * accum) == 0
    try:
        cfg = parse_args(argv)
    except SystemExit as e:
        assert not fits and e.code == 2
    else:
        assert fits and (cfg.tp, cfg.dp, cfg.n_embd) == (tp, dp, n_embd)


def test_a_bad_argument_exits_before_any_rank_starts(capsys, monkeypatch, tmp_path):
    """The script's main as a user runs it: exit code 2 and one error line, no rank started, nothing written."""
    main = runpy.run_path(str(SCRIPT), run_name="train_gpt")["main"]

    def no_ranks(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(tensorpar, "spawn", no_ranks)
    monkeypatch.setattr(tensorpar, "init", no_ranks)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        main([f"--data={tmp_path}/missing.txt", f"--out={out}"])
    captured = capsys.readouterr()
    assert exit_.value.code == 2 and captured.out == "" and not out.exists()
    assert captured.err.strip().splitlines()[-1] == \
        f"train_gpt.py: error: --data {tmp_path}/missing.txt: no such file or directory"


def test_numbers_seeds_and_output_directories_are_checked_before_any_rank_starts(capsys, tmp_path):
    """NaN and infinities, a seed torch cannot take and an --out that cannot be written are argument
    errors naming the numbers (a model larger than the memory: tests/test_train_plan.py)."""
    for flag in ("lr", "min-lr", "clip", "weight-decay", "dropout", "val-fraction", "peak-tflops"):
        for value in ("nan", "inf", "-inf"):
            assert refused(capsys, f"--{flag}={value}") == f"--{flag} must be a finite number, got {float(value)}"
    for seed in (-2**63, 2**64 - 1):  # the range torch.manual_seed accepts, and just outside it
        torch.manual_seed(seed)
        assert parse_args([f"--seed={seed}"]).seed == seed
    for seed in (-2**63 - 1, 2**64, 10**29):
        with pytest.raises(ValueError, match="Overflow"):
            torch.manual_seed(seed)
        assert refused(capsys, f"--seed={seed}") == \
            f"--seed {seed} is outside the range torch.manual_seed accepts (-2**63 to 2**64 - 1)"
    file = tmp_path / "file"
    file.write_text("")
    assert refused(capsys, f"--out={file}") == f"--out {file}: {file} is a file, not a directory"
    assert refused(capsys, f"--out={file}/run") == f"--out {file}/run: {file} is a file, not a directory"
    assert refused(capsys, "--out=/proc/x").startswith("--out /proc/x: cannot write in /proc (")
    assert not (tmp_path / "new").exists() and parse_args([f"--out={tmp_path}/new/run"]).out == f"{tmp_path}/new/run"
    assert not (tmp_path / "new").exists()  # checked, not made

def save_gpt(out, config):
    from layers import GPT
    tensorpar.checkpoint.save(out, GPT(GPTConfig(**config)), step=1)


def test_resume_compares_the_fields_of_the_checkpoints_model_config(worlds, capsys, tmp_path):
    """A resumed run must describe the checkpoint's model: every field of the config the checkpoint
    holds that an option sets (the MLP kind included). Fields no option sets (grouped-query heads) are not
    compared."""
    config = dict(vocab_size=256, block_size=16, n_layer=1, n_head=4, n_kv_head=2, n_embd=16, bias=False, mlp="swiglu")
    worlds[1].run(save_gpt, str(tmp_path), config)
    same = [f"--out={tmp_path}", "--resume", "--tp=1", "--n-layer=1", "--n-head=4", "--n-embd=16", "--block-size=16",
            "--mlp=swiglu"]
    assert parse_args(same).resume == "must"
    assert refused(capsys, *same, "--n-layer=2", "--n-embd=32", "--bias") == (
        f"--resume: the checkpoint in {tmp_path} is of another model (--n-layer: checkpoint 1, now 2, --n-embd: "
        "checkpoint 16, now 32, --bias: checkpoint False, now True)")

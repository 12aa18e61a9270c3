"""What the training script says about the hardware, checked without ranks: the GPT's parameter
count against the plain model's, model FLOPs per token, the peak table, the tokens/s window and
MFU, peak memory, and the warning when a run falls back to the CPU although GPUs are present (with
a faked ``torch.cuda``)."""

import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorpar
from examples.train import (
    Throughput,
    compute_dtype,
    cpu_fallback_warning,
    hardware_summary,
    peak_memory_bytes,
    warn_if_gpus_unused,
)
from examples.train.hardware import model_flops_per_token, peak_tflops
from layers import GPTConfig
from reference_gpt import RefConfig, RefGPT

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"


class RanksWouldStart(Exception):
    pass


@settings(max_examples=15, deadline=None)
@given(n_head=st.integers(1, 4), head=st.integers(1, 4), kv_divisor=st.sampled_from([1, 2, 4]),
       bias=st.booleans(), mlp=st.sampled_from(["gelu", "swiglu"]), n_layer=st.integers(1, 3),
       vocab=st.integers(2, 40), block=st.integers(1, 9))
def test_parameter_count_is_the_plain_models(n_head, head, kv_divisor, bias, mlp, n_layer, vocab, block):
    kv = n_head // kv_divisor if n_head % kv_divisor == 0 else n_head
    cfg = dict(vocab_size=vocab, block_size=block, n_layer=n_layer, n_head=n_head, n_embd=n_head * head * 3,
               bias=bias, n_kv_head=kv, mlp=mlp)
    plain = RefGPT(RefConfig(**cfg))
    total = sum(p.numel() for p in plain.parameters())  # the tied head once
    config = GPTConfig(**cfg)
    assert config.parameter_count(non_embedding=False) == total
    assert config.parameter_count() == total - plain.transformer.wpe.weight.numel()


def test_model_flops_per_token_of_gpt2_small():
    """nanoGPT's figures for GPT-2 124M: 123.65M parameters without the positions, 6N + 12LHQT FLOPs."""
    n = GPTConfig(vocab_size=50257).parameter_count()
    assert n == 123_653_376
    assert model_flops_per_token(n, 12, 12, 64, 1024) == 6 * n + 12 * 12 * 12 * 64 * 1024


@pytest.mark.parametrize("name, dtype, peak", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.0), ("NVIDIA H100 80GB HBM3", torch.float16, 989.0),
    ("NVIDIA H100 80GB HBM3", torch.float32, 67.0), ("NVIDIA H100 PCIe", torch.bfloat16, 756.0),
    ("NVIDIA H200", torch.bfloat16, 989.0), ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0),
    ("NVIDIA A100-SXM4-40GB", torch.float32, 19.5), ("Tesla T4", torch.bfloat16, None),
    ("NVIDIA H100 80GB HBM3", torch.float64, None)])
def test_peak_tflops_of_known_gpus(monkeypatch, name, dtype, peak):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_tflops(torch.device("cuda", 0), dtype) == peak


def test_the_default_dtype_is_bf16_on_a_gpu_and_fp32_on_the_cpu():
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert (compute_dtype(None, gpu), compute_dtype(None, cpu)) == ("bf16", "fp32")
    assert (compute_dtype("fp32", gpu), compute_dtype("bf16", cpu)) == ("fp32", "bf16")


def test_no_peak_and_no_mfu_on_the_cpu():
    assert peak_tflops(torch.device("cpu"), torch.bfloat16) is None
    assert Throughput(tokens_per_step=10, flops_per_token=1.0, peak_tflops=None, devices=1).step(1.0) == \
        {"tokens_per_s": 10.0}


def test_throughput_is_over_the_window_and_mfu_over_every_device():
    meter = Throughput(tokens_per_step=1000, flops_per_token=2e9, peak_tflops=100.0, devices=2, window=3)
    first = meter.step(10.0)  # a slow first step (compilation, warm-up)
    assert first == {"tokens_per_s": 100.0, "mfu": 100.0 * 2e9 / 200e12}
    for _ in range(3):
        figures = meter.step(0.5)
    assert figures["tokens_per_s"] == 2000.0  # the first step has left the window
    assert figures["mfu"] == pytest.approx(2000 * 2e9 / (2 * 100e12), rel=1e-12)
    assert meter.summary() == dict(figures, window=3, devices=2, peak_tflops=100.0)
    assert hardware_summary(meter.summary() | dict(device="cuda:0 (NVIDIA H100 80GB HBM3)", dtype="bf16",
                                                   peak_memory_bytes=[3 * 2**30, 2**29])) == (
        "cuda:0 (NVIDIA H100 80GB HBM3), bf16: 2,000 tokens/s (last 3 steps), MFU 2.0% of 2 x 100 TFLOP/s\n"
        "peak memory per rank (GiB, max allocated on the GPU): 3.00, 0.50")
    with pytest.raises(ValueError, match="window must be at least 1 step, got 0"):
        Throughput(tokens_per_step=1, flops_per_token=1.0, peak_tflops=None, devices=1, window=0)


def test_peak_memory_of_this_process_on_the_cpu():
    before = peak_memory_bytes(torch.device("cpu"))
    block = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, touched
    assert peak_memory_bytes(torch.device("cpu")) >= max(before, block.numel())


def test_cpu_fallback_warning_says_why_and_how_to_use_the_gpu():
    assert cpu_fallback_warning(tp=2, dp=1, pp=1, local_ranks=2, cuda_devices=1) == (
        "CUDA is available (1 device) but tp x dp x pp = 2 x 1 x 1 = 2 ranks need 2 GPUs (NCCL: one GPU per "
        "rank); this run uses the CPU. Use --tp 1 to train on the GPU.")
    assert cpu_fallback_warning(tp=2, dp=2, pp=2, local_ranks=8, cuda_devices=1).endswith(
        "Use --tp 1 --dp 1 --pp 1 to train on the GPU.")
    assert cpu_fallback_warning(tp=2, dp=2, pp=1, local_ranks=4, cuda_devices=2).endswith(
        "this run uses the CPU. Use at most 2 ranks (tp x dp x pp <= 2) to train on the GPUs.")
    assert "CUDA is available (2 devices) but torchrun's 4 processes on this host need 4 GPUs" in \
        cpu_fallback_warning(tp=2, dp=2, pp=1, local_ranks=4, cuda_devices=2, torchrun=True)
    for ranks, devices in ((1, 1), (2, 2), (2, 8), (2, 0), (1, 0)):  # GPUs for every rank, or none at all
        assert cpu_fallback_warning(tp=ranks, dp=1, pp=1, local_ranks=ranks, cuda_devices=devices) is None


@pytest.mark.parametrize("argv, devices, warned", [(["--tp=2"], 1, True), (["--tp=1"], 1, False),
                                                   (["--tp=2"], 0, False), (["--tp=2"], 2, False)])
def test_the_script_warns_before_its_ranks_start(monkeypatch, capsys, tmp_path, argv, devices, warned):
    """The script's main with torch.cuda faked, stopped where it would start its ranks: the warning
    goes to stderr exactly when it applies."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: devices > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 << 30))

    def no_ranks(*args, **kwargs):
        raise RanksWouldStart

    monkeypatch.setattr(tensorpar, "spawn", no_ranks)
    with pytest.raises(RanksWouldStart):
        runpy.run_path(str(SCRIPT), run_name="train_gpt")["main"]([*argv, f"--out={tmp_path}"])
    captured = capsys.readouterr()
    assert captured.out == ""
    assert (captured.err == "warning: CUDA is available (1 device) but tp x dp x pp = 2 x 1 x 1 = 2 ranks need 2 "
                            "GPUs (NCCL: one GPU per rank); this run uses the CPU. Use --tp 1 to train on the GPU.\n"
            ) if warned else captured.err == ""


def test_under_torchrun_only_rank_0_warns(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for rank, expected in (("1", ""), ("0", "torchrun's 2 processes on this host need 2 GPUs")):
        monkeypatch.setenv("RANK", rank)
        warn_if_gpus_unused(tp=2, dp=1, pp=1)
        err = capsys.readouterr().err
        assert expected in err and (err == "") == (expected == "")
    assert "--nproc-per-node 1" in err

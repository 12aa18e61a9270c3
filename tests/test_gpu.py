"""The layer checks on CUDA tensors: NCCL at world size 1, gloo over CUDA tensors at world size 2.

Skipped where no CUDA device is present; everything they check also runs on CPU elsewhere.
"""

import pytest
import torch

import tensorpar
from tensorpar.testing import TOLERANCES
from test_linear import check_linear, check_mlp

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def cuda_layer_checks(dtype):
    tensorpar.init()  # tp = every rank of the spawned group
    # bf16 needs enough elements for a norm-wise bound (see test_linear.sized_for)
    batch = (16, 3)
    results = [check_linear(kind, 48, 80, batch, dtype, True, option, seed, device="cuda")
               for seed, (kind, option) in enumerate([("column", False), ("column", True), ("row", True),
                                                      ("row", False)])]
    results.append(check_mlp(48, 200, batch, dtype, True, 7, device="cuda"))
    return max(max(r.values()) for r in results)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_on_cuda_with_nccl_at_world_size_1(dtype):
    assert max(tensorpar.spawn(cuda_layer_checks, 1, dtype, backend="nccl")) <= TOLERANCES[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_on_cuda_tensors_with_gloo_at_world_size_2(dtype):
    assert max(tensorpar.spawn(cuda_layer_checks, 2, dtype, backend="gloo")) <= TOLERANCES[dtype]


def cuda_gpt_checks(dtype):
    """A Block against its plain twin on CUDA, a GPT's loss against the reference's, and the tp streams."""
    from gpt_cases import batch, twins
    from tensorpar.testing import assert_sharded_equivalent
    from test_blocks import sharded_twin
    from test_dropout import stream_draws

    mesh = tensorpar.init()
    cfg = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, vocab_size=97, block_size=32, bias=True, mlp="swiglu")
    torch.manual_seed(0)
    sharded, dense = sharded_twin("block", cfg, dtype)
    x = torch.randn(2, 32, 64, dtype=dtype, device="cuda")
    errors = assert_sharded_equivalent(sharded.cuda(), dense.cuda(), x)
    ref, model = twins(cfg, dtype, 0)
    ref, model = ref.cuda(), model.cuda()
    idx, targets = batch(cfg, 2, 32, 0)
    loss, ref_loss = model(idx.cuda(), targets.cuda()), ref(idx.cuda(), targets.cuda())
    errors["loss"] = tensorpar.testing.rel_error(loss, ref_loss)
    first, second, untouched = stream_draws(0, "cuda")
    return max(errors.values()), untouched and not torch.equal(first, second), mesh.tp_rank, first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world, backend", [(1, "nccl"), (2, "gloo")])
def test_gpt_on_cuda(dtype, world, backend):
    results = tensorpar.spawn(cuda_gpt_checks, world, dtype, backend=backend)
    for err, stream_ok, _, _ in results:
        assert err <= TOLERANCES[dtype] and stream_ok
    if world == 2:
        assert not torch.equal(results[0][3], results[1][3]), "both tp ranks drew the same attention-dropout stream"


def test_training_on_cuda_in_bf16_with_a_checkpoint(tmp_path, capfd):
    """The training script on one GPU (NCCL, bf16 autocast): the loss falls and the checkpoint reloads."""
    import json
    from pathlib import Path

    from tensorpar import checkpoint
    from tensorpar.testing import run_script

    script = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
    tensorpar.spawn(run_script, 1, str(script), "--tp=1", "--steps=30", "--n-layer=2", "--n-embd=64",
                    "--block-size=32", f"--out={tmp_path}", "--ckpt-every=30", "--sample-tokens=16",
                    "--no-progress", backend="nccl")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    assert len(losses) == 30 and losses[29] < losses[0] - 1.0
    name = torch.cuda.get_device_name(0)
    known = any(part in name for part in ("H100", "H200", "A100"))
    total_mib = torch.cuda.get_device_properties(0).total_memory / 2**20
    for r in rows:  # what the hardware did: the GPU by name, bf16, its memory, an MFU where its peak is known
        assert (r["device"], r["dtype"]) == (f"cuda:0 ({name})", "bf16")
        assert r["tokens_per_s"] > 0 and 0 < r["peak_memory_mib"] < total_mib
        assert ("mfu" in r) == known and 0 < r.get("mfu", 0.5) < 1
    assert "sample:" in capfd.readouterr().out
    assert checkpoint.read_meta(tmp_path)["step"] == 30
    assert tensorpar.spawn(load_on_cpu, 1, str(tmp_path), backend="gloo") == [30]


def load_on_cpu(path):
    """The checkpoint loads into a CPU model, without the GPU it was written on."""
    from layers import GPT, GPTConfig
    from tensorpar import checkpoint

    tensorpar.init()
    model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64, bias=False))
    return checkpoint.load(path, model)["step"]

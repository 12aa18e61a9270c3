"""The layer checks on CUDA tensors: NCCL at world size 1, gloo over CUDA tensors at world size 2.

Skipped where no CUDA device is present; everything they check also runs on CPU elsewhere.
"""

import pytest
import torch
from test_linear import check_linear, check_mlp

import tensorpar
from tensorpar.testing import TOLERANCES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def cuda_layer_checks(dtype):
    tensorpar.init()  # tp = every rank of the spawned group
    # bf16 needs enough elements for a norm-wise bound (see test_linear.sized_for)
    batch = (16, 3)
    results = [check_linear(kind, 48, 80, batch, dtype, True, option, seed, device="cuda")
               for seed, (kind, option) in enumerate([("column", False), ("column", True), ("row", True), ("row", False)])]
    results.append(check_mlp(48, 200, batch, dtype, True, 7, device="cuda"))
    return max(max(r.values()) for r in results)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_on_cuda_with_nccl_at_world_size_1(dtype):
    assert max(tensorpar.spawn(cuda_layer_checks, 1, dtype, backend="nccl")) <= TOLERANCES[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_on_cuda_tensors_with_gloo_at_world_size_2(dtype):
    assert max(tensorpar.spawn(cuda_layer_checks, 2, dtype, backend="gloo")) <= TOLERANCES[dtype]

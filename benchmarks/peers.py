"""The same MLP (h -> 4h -> GELU -> h) built by each library, for side-by-side timing.

Each builder runs inside a rank of an initialised process group (a benchmark
pool worker) and returns a module mapping ``(tokens, h) -> (tokens, h)`` with
the input replicated and the output replicated, as tensorpar's column -> row
MLP does. The peers are optional (the ``bench`` extra, plus ``megatron-core``
installed with ``--no-deps``); a missing one is reported, not fatal.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tensorpar
from layers import ColumnParallelLinear, RowParallelLinear


def dense(h: int) -> nn.Module:
    return nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))


def ours(h: int) -> nn.Module:
    return nn.Sequential(ColumnParallelLinear(h, 4 * h), nn.GELU(), RowParallelLinear(4 * h, h))


def dtensor(h: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return parallelize_module(dense(h), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def fairscale(h: int) -> nn.Module:
    from fairscale.nn.model_parallel import initialize as fs_init
    from fairscale.nn.model_parallel.layers import ColumnParallelLinear as FsColumn
    from fairscale.nn.model_parallel.layers import RowParallelLinear as FsRow

    if not fs_init.model_parallel_is_initialized():
        fs_init.initialize_model_parallel(dist.get_world_size())
    return nn.Sequential(FsColumn(h, 4 * h, gather_output=False), nn.GELU(), FsRow(4 * h, h, input_is_parallel=True))


class _MegatronMLP(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        from megatron.core import ModelParallelConfig
        from megatron.core.tensor_parallel import ColumnParallelLinear as McColumn
        from megatron.core.tensor_parallel import RowParallelLinear as McRow

        config = ModelParallelConfig(tensor_model_parallel_size=dist.get_world_size(), use_cpu_initialization=True)
        init = nn.init.xavier_uniform_
        self.fc1 = McColumn(h, 4 * h, config=config, init_method=init, bias=True, gather_output=False)
        self.fc2 = McRow(4 * h, h, config=config, init_method=init, bias=True, input_is_parallel=True,
                         skip_bias_add=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.fc1(x)  # Megatron's layers return (output, bias)
        y, _ = self.fc2(F.gelu(h))
        return y


def megatron(h: int) -> nn.Module:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    return _MegatronMLP(h)


BUILDERS: dict[str, Callable[[int], nn.Module]] = {
    "tensorpar": ours, "DTensor": dtensor, "fairscale": fairscale, "Megatron-Core": megatron,
}


def available(name: str) -> str | None:
    """``None`` when the peer can be built here, else why not."""
    module = {"fairscale": "fairscale", "Megatron-Core": "megatron.core"}.get(name)
    if module is None:
        return None
    try:
        __import__(module)
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return f"{type(e).__name__}: {e}"
    return None


__all__ = ["BUILDERS", "available", "dense", "ours", "tensorpar"]

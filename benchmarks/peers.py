"""The same MLP (h -> 4h -> GELU -> h) built by each library, for side-by-side timing.

Each builder runs inside a rank of an initialised process group (a benchmark
pool worker) and returns a module mapping ``(tokens, h) -> (tokens, h)`` with
the input replicated and the output replicated, as tensorpar's column -> row
MLP does; the sequence-parallel builders (``SEQUENCE_BUILDERS``) map this
rank's tokens ``(tokens / tp, h)`` to this rank's tokens, all-gathering before
the column layer and reduce-scattering after the row layer. ``no communication``
is the compute of one tp=2 rank alone, ``h -> 2h -> h`` with no collective: the
cap on the tp=2 speed-up. The peers are optional (the ``bench`` extra, plus ``megatron-core``
installed with ``--no-deps``); a missing one is reported, not fatal.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from layers import ColumnParallelLinear, RowParallelLinear


def dense(h: int) -> nn.Module:
    return nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))


def ours(h: int) -> nn.Module:
    return nn.Sequential(ColumnParallelLinear(h, 4 * h), nn.GELU(), RowParallelLinear(4 * h, h))


class _OursSequence(nn.Module):
    def __init__(self, h: int, tokens: int) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(h, 4 * h, sequence_parallel=True)
        self.fc2 = RowParallelLinear(4 * h, h, sequence_parallel=True)
        self.tokens = tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x, self.tokens)))  # (tokens / tp, h) -> (tokens / tp, h)


def ours_sequence(h: int, tokens: int) -> nn.Module:
    return _OursSequence(h, tokens)


def no_communication(h: int, tokens: int = 0) -> nn.Module:
    n = dist.get_world_size()
    return nn.Sequential(nn.Linear(h, 4 * h // n), nn.GELU(), nn.Linear(4 * h // n, h))


def dtensor(h: int, sequence_parallel: bool = False) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if sequence_parallel:  # the tokens sharded outside: gathered by the column layer, scattered by the row layer
        plan = {"0": ColwiseParallel(input_layouts=Shard(0)), "2": RowwiseParallel(output_layouts=Shard(0))}
    else:
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    return parallelize_module(dense(h), mesh, plan)


def fairscale(h: int) -> nn.Module:
    from fairscale.nn.model_parallel import initialize as fs_init
    from fairscale.nn.model_parallel.layers import ColumnParallelLinear as FsColumn
    from fairscale.nn.model_parallel.layers import RowParallelLinear as FsRow

    if not fs_init.model_parallel_is_initialized():
        fs_init.initialize_model_parallel(dist.get_world_size())
    return nn.Sequential(FsColumn(h, 4 * h, gather_output=False), nn.GELU(), FsRow(4 * h, h, input_is_parallel=True))


class _MegatronMLP(nn.Module):
    def __init__(self, h: int, sequence_parallel: bool = False) -> None:
        super().__init__()
        from megatron.core import ModelParallelConfig
        from megatron.core.tensor_parallel import ColumnParallelLinear as McColumn
        from megatron.core.tensor_parallel import RowParallelLinear as McRow

        config = ModelParallelConfig(tensor_model_parallel_size=dist.get_world_size(), use_cpu_initialization=True,
                                     sequence_parallel=sequence_parallel)
        init = nn.init.xavier_uniform_
        self.fc1 = McColumn(h, 4 * h, config=config, init_method=init, bias=True, gather_output=False)
        self.fc2 = McRow(4 * h, h, config=config, init_method=init, bias=True, input_is_parallel=True,
                         skip_bias_add=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.fc1(x)  # Megatron's layers return (output, bias)
        y, _ = self.fc2(F.gelu(h))
        return y


def megatron(h: int, sequence_parallel: bool = False) -> nn.Module:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    return _MegatronMLP(h, sequence_parallel)


BUILDERS: dict[str, Callable[[int], nn.Module]] = {
    "tensorpar": ours, "DTensor": dtensor, "fairscale": fairscale, "Megatron-Core": megatron,
}
# (h, tokens) -> a module from this rank's tokens to this rank's tokens (fairscale has no sequence parallelism)
SEQUENCE_BUILDERS: dict[str, Callable[[int, int], nn.Module]] = {
    "tensorpar SP": ours_sequence, "DTensor SP": lambda h, _: dtensor(h, True),
    "Megatron-Core SP": lambda h, _: megatron(h, True),
}


def available(name: str) -> str | None:
    """``None`` when the peer can be built here, else why not."""
    if name == "Megatron-Core SP" and not torch.cuda.is_available():
        return "its sequence-parallel layers allocate their all-gather buffer on the current CUDA device"
    module = {"fairscale": "fairscale", "Megatron-Core": "megatron.core", "Megatron-Core SP": "megatron.core"}.get(name)
    if module is None:
        return None
    try:
        __import__(module)
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return f"{type(e).__name__}: {e}"
    return None


__all__ = ["BUILDERS", "SEQUENCE_BUILDERS", "available", "dense", "no_communication", "ours", "ours_sequence"]

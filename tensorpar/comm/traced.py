"""The collectives' two other routes: inside a ``torch.compile`` graph, and under torch's tools.

**Traced.** While ``torch.compile`` traces (``torch.compiler.is_compiling()``),
every collective of :mod:`tensorpar.comm` is a *functional* collective
(``torch.ops._c10d_functional``): an out-of-place op that returns a new tensor
and a ``wait_tensor`` that marks where the result is needed. Dynamo puts both
in the graph, so a whole layer, block or GPT compiles with ``fullgraph=True``
and the compiler may schedule other work between a collective's start and its
wait. They are called from inside tensorpar's autograd functions, whose own
backward stays in charge (the functional all-reduce is differentiable itself
and would otherwise add a second ``g``). The process group was resolved when
the layer was built, outside the traced region; only its name enters the graph.
Nothing here reads a context variable or the environment, which Dynamo cannot
trace: collective counters and argument agreement are eager-mode tools.

**Observed.** The shared-memory and point-to-point routes of a CPU all-reduce
are invisible to torch's ``CommDebugMode`` (a dispatch mode) and to
``torch.profiler``. While either is active, an all-reduce takes the plain
``c10d`` route (``dist.all_reduce``), the route every other backend takes, so
the tools count exactly the collectives a CUDA/NCCL run would show. Turn the
tools on on every rank of a group: ranks that disagree on the route wait for
each other and fail with a rank-tagged error at the group's timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

_functional = torch.ops._c10d_functional


def tracing() -> bool:
    """Whether ``torch.compile`` is tracing this call (constant ``True`` inside a traced region)."""
    return torch.compiler.is_compiling()


def observed() -> bool:
    """Whether ``torch.profiler`` or a dispatch mode (``CommDebugMode``, ``FlopCounterMode``...) is active."""
    return torch._C._autograd._profiler_enabled() or torch._C._len_torch_dispatch_stack() > 0


class PendingTraced:
    """A functional all-reduce in a graph; ``wait()`` is where its result is used."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def wait(self) -> torch.Tensor:
        return _functional.wait_tensor(self._tensor)


def _staged(x: torch.Tensor, group: ProcessGroup) -> bool:
    """gloo reduces CUDA tensors only through host memory."""
    return x.is_cuda and dist.get_backend(group) == "gloo"


def start_all_reduce(x: torch.Tensor, group: ProcessGroup, op: str) -> PendingTraced:
    """``op`` ("sum" or "max") of ``x`` over ``group``, into a new tensor."""
    if _staged(x, group):
        return PendingTraced(_functional.all_reduce(x.cpu(), op, group.group_name).to(x.device))
    return PendingTraced(_functional.all_reduce(x, op, group.group_name))


def all_gather_flat(x: torch.Tensor, n: int, group: ProcessGroup) -> torch.Tensor:
    """The ``n`` ranks' flat ``x`` concatenated, ``(n * x.numel(),)``."""
    source = x.cpu() if _staged(x, group) else x
    out = _functional.wait_tensor(_functional.all_gather_into_tensor(source, n, group.group_name))
    return out.to(x.device)


def reduce_scatter_flat(x: torch.Tensor, n: int, group: ProcessGroup) -> torch.Tensor:
    """This rank's ``x.numel() / n`` elements of the sum of the ranks' flat ``x``."""
    source = x.cpu() if _staged(x, group) else x
    out = _functional.wait_tensor(_functional.reduce_scatter_tensor(source, "sum", n, group.group_name))
    return out.to(x.device)

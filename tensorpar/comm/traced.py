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

**Watched.** Under ``torch.profiler`` every collective keeps its route; each
call shows as a span ``tensorpar::<op>`` (its wait as ``tensorpar::<op>.wait``)
around whatever that route runs: the shared-memory round, the point-to-point
messages, or gloo's ``c10d::allreduce_``. So the profile shows what runs
unwatched, row-parallel outputs reduced in chunks included. A *dispatch mode*
(``CommDebugMode``, ``FlopCounterMode``, one's own ``TorchDispatchMode``) sees only
dispatched ops, and the shared-memory and point-to-point routes dispatch none:
while one is active, a CPU all-reduce, all-gather or reduce-scatter takes the
plain ``c10d`` route and a row-parallel output is reduced whole (one call per
layer), so the mode counts exactly the collectives a CUDA/NCCL run shows. That
switch costs what gloo costs over the shared-memory route: measured with 2
CPU ranks under a do-nothing dispatch mode, a median all-reduce of 4 KiB to 256
KiB took 0.7-1.6 ms instead of 0.14-0.27 ms, and one of 4 MiB 4.0-5.2 ms
instead of 2.2-2.9 ms. Results are the same bits either way. Turn a dispatch mode on
on every rank of a group: ranks that disagree on the route wait for each other
and fail with a rank-tagged error at the group's timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

_functional = torch.ops._c10d_functional


def profiling() -> bool:
    """Whether ``torch.profiler`` (or ``torch.autograd.profiler``) is recording; never while traced (a
    graph's collectives are its own ops, which the profiler records)."""
    return not tracing() and torch._C._autograd._profiler_enabled()


def dispatch_watched() -> bool:
    """Whether a dispatch mode (``CommDebugMode``, ``FlopCounterMode``, ...) is active; never while traced."""
    return not tracing() and torch._C._len_torch_dispatch_stack() > 0


def tracing() -> bool:
    """Whether ``torch.compile`` is tracing this call (constant ``True`` inside a traced region)."""
    return torch.compiler.is_compiling()


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

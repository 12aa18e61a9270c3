"""torch's own tools see every collective: ``CommDebugMode`` and ``torch.profiler`` around a tp=2
block count Megatron's 2 all-reduces of B·T·C in forward and 2 in backward, as
``count_collectives`` does; the profiler sees each as the functional all-reduce it is, watched or not,
with gloo's all-reduce under it; and the layers stay equal to their plain twins while the tools watch."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

import tensorpar
from gpt_cases import gpt_configs
from tensorpar.testing import TOLERANCES, assert_sharded_equivalent, count_collectives
from test_blocks import sharded_twin

ALL_REDUCES = ("allreduce", "all_reduce")


def is_all_reduce(op):
    return any(name in str(op) for name in ALL_REDUCES)


class AllReduceShapes(TorchDispatchMode):
    """A dispatch mode of our own: the shapes of the tensors every all-reduce reduces."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if is_all_reduce(func):  # a functional all-reduce takes a tensor, c10d's a list of them
            self.shapes += [tuple(t.shape) for t in (args[0] if isinstance(args[0], list) else [args[0]])]
        return func(*args, **(kwargs or {}))


def forward_backward(module, x):
    y = module(x.clone().requires_grad_())
    y.backward(torch.ones_like(y))


def block_under_tools(cfg, b, t, device, seed):
    """A block's forward and backward under CommDebugMode, the profiler, a dispatch mode of our
    own and count_collectives; what each saw, and the block's error against its plain twin."""
    torch.manual_seed(seed)
    sharded, dense = sharded_twin("block", cfg, torch.float64)
    sharded, dense = sharded.to(device), dense.to(device)
    x = torch.randn(b, t, cfg["n_embd"], dtype=torch.float64, device=device)
    forward_backward(sharded, x)  # a first run, unwatched
    with CommDebugMode() as debug:
        forward_backward(sharded, x)
    total = debug.comm_module_counts["Global"]  # every module's collectives, by phase
    seen_debug = {phase: sum(n for op, n in total[phase].items() if is_all_reduce(op)) for phase in total}
    other_debug = sum(n for op, n in debug.get_comm_counts().items() if not is_all_reduce(op))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        forward_backward(sharded, x)
    events = [e.name for e in prof.events()]
    profiled = events.count("c10d::allreduce_")
    with AllReduceShapes() as mode:
        forward_backward(sharded, x)
    with count_collectives() as counts:
        forward_backward(sharded, x)
    ours = {phase: [r.numel for r in counts.select("all_reduce", phase)] for phase in ("forward", "backward")}
    sharded.zero_grad()
    with CommDebugMode():  # and the block stays equal to its plain twin while watched
        error = max(assert_sharded_equivalent(sharded, dense, x, seed=seed).values())
    return error, seen_debug, other_debug, profiled, mode.shapes, ours


def check_tools(cfg, b, t, results):
    """Every tool sees the 4 all-reduces; the profiler sees each as c10d's all-reduce."""
    for error, seen_debug, other_debug, profiled, shapes, ours in results:
        assert error <= TOLERANCES[torch.float64]
        assert seen_debug == {"forward": 2, "backward": 2} and other_debug == 0
        assert profiled == 4 and shapes == [(b, t, cfg["n_embd"])] * 4
        assert ours == {"forward": [b * t * cfg["n_embd"]] * 2, "backward": [b * t * cfg["n_embd"]] * 2}


@settings(max_examples=6)
@given(tp=st.integers(2, 4), data=st.data())
def test_comm_debug_mode_and_profiler_see_megatrons_all_reduces(worlds, tp, data):
    cfg = data.draw(gpt_configs(tp, max_layer=1))
    cfg["n_kv_head"] = cfg["n_head"]  # no replicated KV heads: their weight all-reduces would add to the 2 + 2
    b, t = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 9))
    check_tools(cfg, b, t, worlds[tp].run(block_under_tools, cfg, b, t, "cpu", data.draw(st.integers(0, 2**31))))


def small_all_reduces_under_tools(n):
    """All-reduces small and large under CommDebugMode, then outside it: the same results."""
    from tensorpar.comm.collectives import all_reduce_sum
    group, rank = tensorpar.current_mesh().tp_group, tensorpar.current_mesh().tp_rank
    xs = [torch.full((size,), float(rank + 1)) for size in (1, 1000, 100_000)]
    with CommDebugMode() as debug:
        watched = [all_reduce_sum(x, group) for x in xs]
    unwatched = [all_reduce_sum(x, group) for x in xs]
    expected = n * (n + 1) / 2
    return debug.get_total_counts(), all(bool((y == expected).all()) for y in watched + unwatched)


def test_tools_see_all_reduces_of_every_size(worlds):
    for n in (2, 3):
        assert worlds[n].run(small_all_reduces_under_tools, n) == [(3, True)] * n


@pytest.mark.gpu
def test_tools_count_the_same_on_cuda(worlds):
    """The same counts with CUDA tensors (gloo stages them through host memory)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cfg = dict(n_layer=1, n_head=4, n_kv_head=4, n_embd=16, vocab_size=37, block_size=8, bias=True, mlp="gelu")
    check_tools(cfg, 2, 5, worlds[2].run(block_under_tools, cfg, 2, 5, "cuda", 0))

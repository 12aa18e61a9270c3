"""A training step of the GPT makes no host sync: no op that reads a device value back to the host.

Such an op stalls the host until the device has caught up (on a GPU, with every kernel queued before
it): ``aten._local_scalar_dense`` (``.item()``, ``int(t)``, ``float(t)``, ``bool(t)``, ``tolist()``),
``aten.is_nonzero``, ``aten.equal``, and the ops whose output's size depends on the data
(``nonzero``, ``masked_select``, indexing by a boolean mask...). On the CPU they wait for nothing,
but they are the same ops, so a ``TorchDispatchMode`` counting them over a step on the CPU counts
what the step would wait for on a GPU. The step is the whole of one: forward with targets (the loss),
backward, :func:`tensorpar.clip_grad_norm_` and an AdamW step. The range checks of token ids and
targets stay, as assertions in the stream of ops (``torch._assert_async``), which are no syncs.
"""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tensorpar
from gpt_cases import batch
from layers import GPT, GPTConfig

#: the ops that read a device value back to the host, or whose output's size depends on one
SYNCS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "masked_select", "_unique", "_unique2",
         "unique_dim", "unique_consecutive", "repeat_interleave"}
#: the ops that sync when an index is a boolean mask (its true elements are found with nonzero)
INDEXING = {"index", "index_put", "index_put_", "_index_put_impl", "_index_put_impl_"}


def syncs(func, args) -> bool:
    """Whether calling ``func`` on ``args`` waits for a value on the device."""
    name = func.overloadpacket.__name__
    if name in INDEXING:
        masks = (torch.bool, torch.uint8)
        return any(isinstance(i, torch.Tensor) and i.dtype in masks for i in args[1] if i is not None)
    return name in SYNCS


class SyncCounter(TorchDispatchMode):
    """Counts, by op, the host-syncing ops that run under it on tensors of ``device`` (a device type)."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.device = device
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        on_device = any(isinstance(a, torch.Tensor) and a.device.type == self.device
                        for a in torch.utils._pytree.tree_leaves((args, kwargs)))
        if on_device and syncs(func, args):
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


class AssertionMessages(TorchDispatchMode):
    """The messages of the in-stream assertions (``torch._assert_async``) that run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "_assert_async" and len(args) > 1:
            self.messages.append(args[1])
        return func(*args, **(kwargs or {}))


CONFIG = dict(vocab_size=37, block_size=8, n_layer=2, n_head=4, n_embd=16)


def step_syncs(overrides, fsdp=False, device="cpu"):
    """The host-syncing ops of each part of a training step of a GPT (the second step, with AdamW's
    state made) on this rank, on tensors of ``device``.

    AdamW is torch's fused one, whose step counters stay tensors. The ``foreach`` one reads each
    parameter's step counter with ``.item()`` (2 per parameter and step); torch keeps those
    counters in host memory for a GPU's parameters too, so there they wait for nothing, but on the
    CPU they cannot be told apart from reads of the model's tensors.
    """
    cfg = dict(CONFIG, **overrides)
    tensorpar.manual_seed(0)
    model = GPT(GPTConfig(**cfg), device=device)
    if fsdp:
        tensorpar.fully_shard_dp(model, modules=model.transformer.h)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    idx, targets = (t.to(device) for t in batch(cfg, 2, cfg["block_size"], 0))
    counts = {}
    for _ in range(2):
        parts = {part: SyncCounter(device) for part in ("forward", "backward", "clip", "adamw")}
        with parts["forward"]:
            loss = model(idx, targets)
        with parts["backward"]:
            loss.backward()
        with parts["clip"]:
            norm = tensorpar.clip_grad_norm_(model, 1e-3)
        with parts["adamw"]:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        counts = {part: dict(counter.counts) for part, counter in parts.items()}
    assert norm > 1e-3, "clipping was not active"  # read after the counting: the gradients were scaled
    return counts


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("overrides", [{}, dict(dropout=0.1, sequence_parallel=True)], ids=["plain", "sp-dropout"])
def test_a_training_step_makes_no_host_sync(worlds, tp, overrides):
    for rank, counts in enumerate(worlds[tp].run(step_syncs, overrides)):
        assert counts == {part: {} for part in counts}, f"rank {rank} of tp={tp}: host syncs {counts}"


def test_a_training_step_under_fsdp_makes_no_host_sync(worlds):
    for rank, counts in enumerate(worlds[4].run(step_syncs, {}, True, tp=2, dp=2)):
        assert counts == {part: {} for part in counts}, f"rank {rank} of tp=2 dp=2 under FSDP2: host syncs {counts}"


def range_checks():
    """The messages of the range checks of a forward with targets, and the errors of bad ids on the CPU."""
    model = GPT(GPTConfig(**CONFIG))
    idx, targets = batch(CONFIG, 2, 5, 0)
    with AssertionMessages() as recorded:
        model(idx, targets)
    errors = []
    for bad_idx, bad_targets in ((idx.index_fill(1, torch.tensor([2]), 37), targets),
                                 (idx, targets.index_fill(1, torch.tensor([4]), -3))):
        with pytest.raises(ValueError) as error:
            model(bad_idx, bad_targets)
        errors.append(str(error.value))
    return recorded.messages, errors


def test_the_range_checks_stay_and_name_the_limits(worlds):
    for messages, errors in worlds[2].run(range_checks):
        assert messages == ["a token id is out of range for num_embeddings 37 (ids must be in [0, 37))",
                            "a target id is out of range for vocab_size 37 (and is not ignore_index -1)"]
        assert errors == ["token id 37 is out of range for num_embeddings 37 (ids must be in [0, 37))",
                          "target id -3 is out of range for vocab_size 37 (and is not ignore_index -1)"]


def cuda_step_syncs():
    tensorpar.init()
    return step_syncs({}, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_training_step_on_cuda_makes_no_host_sync():
    counts = tensorpar.spawn(cuda_step_syncs, 1, backend="nccl")[0]
    assert counts == {part: {} for part in counts}, f"host syncs on CUDA tensors: {counts}"

"""OffloadedOptimizer with the sharded GPT on the pool's ranks: its trajectory at tp=2 against the plain
``RefGPT`` trained with torch's AdamW, a checkpoint saved at tp=2 resumed at tp=1 x dp=2 (under
ZeroRedundancyOptimizer too), and DTensor parameters refused by name."""

import pytest
import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

import tensorpar
from gpt_cases import batch, twins
from offload_cases import ADAMW, LRS, groups, train
from tensorpar import OffloadedOptimizer, checkpoint
from tensorpar.full import placements, unshard
from tensorpar.testing import assert_all_close

# No biases: a key bias has a zero gradient in exact arithmetic, so AdamW's update of it is round-off over
# round-off, of the order of lr, in two runs whose sums run in different orders (no tolerance holds it).
GPT_CFG = dict(n_layer=2, n_head=3, n_kv_head=3, n_embd=12, vocab_size=29, block_size=6, bias=False, mlp="gelu")


def gpt_loss(model, step):
    idx, targets = batch(GPT_CFG, 2, GPT_CFG["block_size"], step)
    return model(idx, targets)


def offloaded_gpt(seed, dtype=torch.float32, zero=False):
    """The sharded GPT (weights from ``seed``'s plain model) and its OffloadedOptimizer (each dp rank that
    of the parameters it owns under ZeroRedundancyOptimizer when ``zero``); the plain model."""
    ref, model = twins(GPT_CFG, dtype, seed)
    if zero:
        return model, ZeroRedundancyOptimizer(groups(model.parameters()), optimizer_class=OffloadedOptimizer,
                                              process_group=tensorpar.current_mesh().dp_group, lr=LRS[0], **ADAMW), ref
    return model, OffloadedOptimizer(groups(model.parameters()), lr=LRS[0], **ADAMW), ref


def gpt_trajectories():
    """Five steps of the sharded GPT with OffloadedOptimizer, with torch's AdamW (bitwise the same), and
    the plain GPT with torch's AdamW: (bitwise, the worst parameter and loss errors against the plain)."""
    model, optimizer, ref = offloaded_gpt(0)
    twin = twins(GPT_CFG, torch.float32, 0)[1]
    losses = train(model, optimizer, 5, gpt_loss)
    same = train(twin, torch.optim.AdamW(groups(twin.parameters()), lr=LRS[0], **ADAMW), 5, gpt_loss) == losses
    same &= all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))
    ref_losses = train(ref, torch.optim.AdamW(groups(ref.parameters()), lr=LRS[0], **ADAMW), 5, gpt_loss)
    full, expected = tensorpar.full_state_dict(model), ref.state_dict()
    norm = torch.cat([v.flatten() for v in expected.values()]).norm().item()
    errors = assert_all_close({k: (full[k], v, norm) for k, v in expected.items()}, rtol=1e-5)
    return same, max(errors.values()), max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))


def test_the_sharded_gpt_follows_torch_adamw_at_tp_2(worlds):
    """Bitwise the same sharded GPT trained with torch's AdamW; within float32's 1e-5 (norm-wise, each
    tensor against the whole model's norm where that is larger) of the plain GPT, whose sums run in
    another order."""
    for same, params, losses in worlds[2].run(gpt_trajectories, tp=2):
        assert same and params <= 1e-5 and losses <= 1e-5, (same, params, losses)


def full_masters(model, optimizer):
    """Every parameter's master copy, unsharded (a collective)."""
    where = placements(model)
    return {n: unshard(optimizer.master(p), *where[n]) if n in where else optimizer.master(p).clone()
            for n, p in model.named_parameters()}


def save_at_step_2(out, dtype):
    """Steps 0-1, a checkpoint, steps 2-3: the full weights and the masters saved."""
    model, optimizer, _ = offloaded_gpt(0, dtype)
    train(model, optimizer, 2, gpt_loss)
    checkpoint.save(out, model, optimizer, step=2)
    saved = full_masters(model, optimizer)
    train(model, optimizer, 2, gpt_loss, first=2)
    return tensorpar.full_state_dict(model), saved


def resume_at_step_2(out, dtype, zero):
    """Load into a GPT of other weights at tp=1: whether every state tensor is on the host, the masters
    loaded (under ZeRO, of the parameters this rank owns), then steps 2-3: the full weights."""
    model, optimizer, _ = offloaded_gpt(7, dtype, zero)
    checkpoint.load(out, model, optimizer)
    local = optimizer.optim if zero else optimizer
    host = all(v.device.type == "cpu" for s in local.state.values() for v in s.values())
    loaded = {n: local.master(p).clone() for n, p in model.named_parameters() if p in local.state}
    train(model, optimizer, 2, gpt_loss, first=2)
    return host, loaded, tensorpar.full_state_dict(model)


@pytest.mark.parametrize("dtype, zero", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_a_checkpoint_resumes_at_another_tp(worlds, tmp_path, dtype, zero):
    """Saved at tp=2, resumed at tp=1 x dp=2 (each dp rank takes the same batches; under
    ZeroRedundancyOptimizer too): the float32 masters come back bitwise (for bfloat16 parameters too:
    not rounded to them), and in float32 the resumed run ends within 1e-5 of the uninterrupted one
    (their sums run in another order)."""
    straight, saved = worlds[2].run(save_at_step_2, str(tmp_path), dtype, tp=2)[0]
    rows = worlds[2].run(resume_at_step_2, str(tmp_path), dtype, zero, tp=1, dp=2)
    assert set().union(*(loaded for _, loaded, _ in rows)) == set(saved)
    for host, loaded, resumed in rows:
        assert host and all(v.dtype == torch.float32 and torch.equal(v, saved[k]) for k, v in loaded.items())
        if dtype == torch.float32:
            norm = torch.cat([v.flatten() for v in straight.values()]).norm().item()
            errors = assert_all_close({k: (resumed[k], v, norm) for k, v in straight.items()}, rtol=1e-5)
            assert max(errors.values()) <= 1e-5


def dtensor_refused():
    from torch.distributed.tensor import Replicate, distribute_tensor

    tp = tensorpar.current_mesh().device_mesh["tp"]
    weight = nn.Parameter(distribute_tensor(torch.ones(4, 2), tp, [Replicate()]))
    try:
        OffloadedOptimizer([("h.0.mlp.fc1.weight", weight)])
    except TypeError as e:
        return str(e)


def test_dtensor_parameters_are_refused_by_name(worlds):
    message = worlds[2].run(dtensor_refused, tp=2)[0]
    assert message.startswith("h.0.mlp.fc1.weight is a DTensor (FSDP2's, say): OffloadedOptimizer takes plain")

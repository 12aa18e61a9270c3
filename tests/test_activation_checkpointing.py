"""Activation checkpointing in the sharded GPT (``GPTConfig(activation_checkpointing=True)``).

Two sharded GPTs with the same weights, one checkpointing every block, run the
same batch from the same seeds with dropout 0.3 (embedding, residual and MLP
dropout on the default generator, attention-probability dropout on the tp
stream of each rank's heads). Checkpointing recomputes the same operations on
the same values, so logits, loss and every gathered gradient must be *bitwise*
equal, and so must the masks drawn during the recomputation (each block's, in
reverse block order) be to those of the forward, and the generators after the
step. The checkpointed model is also checked against the unsharded reference
fed its masks (as in test_dropout), within the dtype's tolerance.

Its memory: the bytes saved for backward, seen by a ``saved_tensors_hooks``
pack hook, drop to exactly one block input per checkpointed block.
"""

import functools

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorpar
from gpt_cases import batch, gpt_configs, twins
from layers import GPT, GPTConfig
from tensorpar.testing import assert_all_close
from tensorpar.testing.strategies import tp_sizes
from test_dropout import recording, replaying

P = 0.3


def _count(calls, i, *_):
    calls[i] += 1


def one_step(model, idx, targets, seed):
    """Logits, loss, gathered gradients, the masks drawn (forward and during backward), block
    forward calls and the generators' next draws, from ``seed``. Calls are counted by pre-hooks:
    a recomputation stops as soon as it has what backward needs, before the block returns."""
    mesh = tensorpar.current_mesh()
    calls = [0] * len(model.transformer.h)
    hooks = [block.register_forward_pre_hook(functools.partial(_count, calls, i))
             for i, block in enumerate(model.transformer.h)]
    tensorpar.manual_seed(seed)
    logit_masks, masks, recomputed = [], [], []
    with recording(logit_masks):
        logits = model(idx)  # (B, T, V)
    with recording(masks):
        loss = model(idx, targets)
    with recording(recomputed):  # a recomputation draws (or replays) here
        loss.backward()
    for hook in hooks:
        hook.remove()
    with tensorpar.random.tracker(mesh).fork():
        tp_next = torch.rand(8)
    return dict(logits=logits.detach(), loss=loss.detach(), grads=tensorpar.full_grads(model), calls=calls,
                logit_masks=logit_masks, masks=masks, recomputed=recomputed, next=[torch.rand(8), tp_next])


def full_masks(masks):
    """Each mask as the unsharded reference draws it: attention masks of every rank's heads in rank order."""
    mesh = tensorpar.current_mesh()
    per_rank = [None] * mesh.tp
    dist.all_gather_object(per_rank, masks, group=mesh.tp_group)
    full = []
    for i, (kind, _) in enumerate(masks):
        parts = [rank_masks[i][1] for rank_masks in per_rank]
        full.append(parts[0] if kind == "replicated" else torch.cat(parts, dim=1))  # (B, n_head, T, T)
    return full


def same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def checkpointed_twins(cfg, b, t, dtype, seed):
    ref, plain = twins(cfg, dtype, seed, dropout=P)
    model = GPT(GPTConfig(**cfg, dropout=P, activation_checkpointing=True), device="meta", dtype=dtype)
    model.to_empty(device="cpu")
    model.load_full_state_dict(ref.state_dict())
    idx, targets = batch(cfg, b, t, seed)
    expected, got = one_step(plain, idx, targets, seed), one_step(model, idx, targets, seed)
    with replaying(full_masks(got["logit_masks"])):
        ref_logits = ref(idx)
    with replaying(full_masks(got["masks"])):
        ref_loss = ref(idx, targets)
    ref_loss.backward()
    # every collective is done: check (a failure is raised on every rank alike)
    n = cfg["n_layer"]
    per_block = (len(got["masks"]) - 1) // n  # the first mask is the embedding dropout's
    blocks = [got["masks"][1 + i * per_block:1 + (i + 1) * per_block] for i in range(n)]
    failures = [f"{key} differs from the model without checkpointing"
                for key in ("logits", "loss", "grads", "masks", "logit_masks", "next")
                if not same(got[key], expected[key])]
    if expected["calls"] != [2] * n or got["calls"] != [3] * n:
        failures.append(f"block forward calls {got['calls']} (checkpointed), {expected['calls']} (plain): "
                        "expected 3 and 2 (logits, loss, and the recomputation)")
    if expected["recomputed"] or not same(got["recomputed"], [m for block in reversed(blocks) for m in block]):
        failures.append("the recomputation did not draw each block's forward masks again, in reverse block order")
    if failures:
        raise AssertionError("; ".join(failures))
    # each gradient against the whole gradient's norm when larger (see test_gpt)
    scale = torch.cat([p.grad.flatten() for p in ref.parameters()]).norm().item()
    ref_grads = {f"grad {k}": p.grad for k, p in ref.named_parameters()}
    pairs = {name: (got["grads"][name.removeprefix("grad ")], g, scale) for name, g in ref_grads.items()}
    pairs |= {"logits": (got["logits"], ref_logits), "loss": (got["loss"], ref_loss)}
    return max(assert_all_close(pairs, what="checkpointed GPT differs from the reference fed its masks").values())


@st.composite
def cases(draw, max_layer=2):
    """(tp, config, batch, tokens, seed): uneven heads, features and vocabularies at tp 1-4."""
    tp = draw(tp_sizes())
    cfg = draw(gpt_configs(tp, max_layer=max_layer))
    return tp, cfg, draw(st.integers(1, 3)), draw(st.integers(1, cfg["block_size"])), draw(st.integers(0, 2**31))


@settings(max_examples=3)
@given(case=cases(), dtype=st.sampled_from([torch.float64, torch.float32]))
def test_checkpointing_changes_nothing_but_memory(worlds, case, dtype):
    tp, cfg, b, t, seed = case
    worst = max(worlds[tp].run(checkpointed_twins, cfg, b, t, dtype, seed))
    assert worst <= {torch.float64: 1e-10, torch.float32: 1e-5}[dtype]


def saved_bytes(cfg, b, t, seed):
    """Bytes of the distinct non-parameter storages saved for backward by one forward with loss."""
    tensorpar.manual_seed(seed)
    model = GPT(GPTConfig(**cfg))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(x):
        if x.untyped_storage().data_ptr() not in params:
            storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    idx, targets = batch(cfg, b, t, seed)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model(idx, targets)
    return sum(storages.values())


def block_bytes(cfg, b, t, seed):
    """One block's saved bytes (a 2-layer GPT's less a 1-layer one's), without and with checkpointing."""
    return [saved_bytes(dict(cfg, n_layer=2, activation_checkpointing=ac), b, t, seed)
            - saved_bytes(dict(cfg, n_layer=1, activation_checkpointing=ac), b, t, seed) for ac in (False, True)]


@settings(max_examples=3)
@given(case=cases(), dropout=st.sampled_from([0.0, P]))
def test_a_checkpointed_block_keeps_only_its_input(worlds, case, dropout):
    tp, cfg, b, t, seed = case
    for plain, checkpointed in worlds[tp].run(block_bytes, dict(cfg, dropout=dropout), b, t, seed):
        assert checkpointed == b * t * cfg["n_embd"] * 4  # float32 (B, T, C): the block's input alone
        assert plain > checkpointed


def test_activation_checkpointing_must_be_a_bool():
    with pytest.raises(TypeError, match="activation_checkpointing must be a bool, got 1"):
        GPTConfig(n_embd=8, n_head=2, activation_checkpointing=1)

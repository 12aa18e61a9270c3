"""Dropout in the sharded GPT, checked by replaying its masks in the reference.

On each rank, the sharded model's dropout masks are recorded as they are drawn
(dropout and scaled-dot-product attention are swapped for versions that draw
their mask with ``torch.rand_like`` from the same generator and keep it). The
masks of the replicated regions (embedding and residual dropout) must be
identical on every tp rank; the attention-probability masks of each rank's
heads are gathered in head order. The reference GPT then runs with its
dropouts replaying those masks, in call order, and must give the same loss and
gradients: the sharded model drew each mask where, and on the stream, it should.
With sequence parallelism every dropout outside attention acts on this rank's
tokens: its masks must differ between ranks and are replayed concatenated
along the sequence.
"""

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorpar
from gpt_cases import batch, gpt_configs, twins
from layers import ShardedDropout
from tensorpar.testing import assert_all_close
from tensorpar.testing.strategies import tp_sizes


@contextlib.contextmanager
def patched(**replacements):
    saved = {name: getattr(F, name) for name in replacements}
    for name, fn in replacements.items():
        setattr(F, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(F, name, fn)


def _keep(x, p, masks, kind):
    mask = torch.rand_like(x) >= p
    masks.append((kind, mask))
    return x * mask / (1 - p)


@contextlib.contextmanager
def recording(masks):
    """Dropout and attention that draw their masks as usual and append them to ``masks``."""
    def dropout(x, p=0.5, training=True, inplace=False):
        return _keep(x, p, masks, "replicated") if training and p > 0 else x

    def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        assert is_causal and attn_mask is None and scale is None
        if enable_gqa:  # SDPA's grouping: query head i reads KV head i // (h / h_kv)
            k, v = (z.repeat_interleave(q.shape[1] // z.shape[1], dim=1) for z in (k, v))
        t = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, h, T, T)
        scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        probs = scores.softmax(-1)
        if dropout_p > 0:
            probs = _keep(probs, dropout_p, masks, "attention")
        return probs @ v

    with patched(dropout=dropout, scaled_dot_product_attention=attention):
        yield


@contextlib.contextmanager
def replaying(masks):
    """Dropout that applies the given masks in order instead of drawing."""
    queue = list(masks)

    def dropout(x, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return x
        mask = queue.pop(0)
        assert mask.shape == x.shape, f"replayed mask {tuple(mask.shape)} for a {tuple(x.shape)} tensor"
        return x * mask / (1 - p)

    with patched(dropout=dropout):
        yield
    assert not queue, f"{len(queue)} masks were not used"


def dropout_twins(cfg, b, t, seed, sequence_parallel=False):
    ref, model = twins(cfg, torch.float64, seed, dropout=0.3, sequence_parallel=sequence_parallel)
    mesh = tensorpar.current_mesh()
    tensorpar.manual_seed(seed)
    idx, targets = batch(cfg, b, t, seed)
    masks = []
    with recording(masks):
        loss = model(idx, targets)
    loss.backward()
    grads = tensorpar.full_grads(model)
    per_rank = [None] * mesh.tp
    dist.all_gather_object(per_rank, masks, group=mesh.tp_group)

    failures, replay = [], []
    for i, (kind, _) in enumerate(masks):
        parts = [rank_masks[i][1] for rank_masks in per_rank]
        if kind == "replicated" and not sequence_parallel:
            if not all(torch.equal(part, parts[0]) for part in parts):
                failures.append(f"replicated dropout mask {i} differs between tp ranks")
            replay.append(parts[0])
        else:
            # (B, n_head, T, T): heads in rank order; or (B, T, C): tokens in rank order
            replay.append(torch.cat(parts, dim=1))
            # different heads (tokens) need independent masks: equal ones on two ranks mean a shared
            # stream (64 elements at p = 0.3 agree by chance with probability 0.58^64 < 1e-15)
            if any(torch.equal(a, b) for r, a in enumerate(parts) for b in parts[r + 1:] if a.numel() >= 64):
                failures.append(f"{kind} dropout mask {i} is the same on two tp ranks")
    with replaying(replay):
        ref_loss = ref(idx, targets)
    ref_loss.backward()
    if failures:
        raise AssertionError("; ".join(failures))
    scale = torch.cat([p.grad.flatten() for p in ref.parameters()]).norm().item()  # see test_gpt
    pairs = {"loss": (loss, ref_loss)}
    pairs |= {f"grad {k}": (grads[k], p.grad, scale) for k, p in ref.named_parameters()}
    errors = assert_all_close(pairs, what="sharded GPT with dropout differs from the reference fed its masks")
    return max(errors.values())


@settings(max_examples=20)
@given(tp=tp_sizes(), data=st.data())
def test_dropout_masks_replay_in_reference(worlds, tp, data):
    cfg = data.draw(gpt_configs(tp, max_layer=2))
    t = data.draw(st.integers(1, cfg["block_size"]))
    results = worlds[tp].run(dropout_twins, cfg, data.draw(st.integers(1, 3)), t, data.draw(st.integers(0, 2**31)),
                             data.draw(st.booleans(), label="sequence_parallel"))
    assert max(results) <= 1e-10


SEQUENCE_CFG = dict(n_layer=1, n_head=3, n_kv_head=3, n_embd=24, vocab_size=31, block_size=12, bias=True, mlp="gelu")


@pytest.mark.parametrize("tp", [2, 3])
def test_sequence_parallel_dropout_draws_each_ranks_tokens_from_its_own_stream(worlds, tp):
    """With sequence parallelism each rank's tokens (12 over 2 or 3 ranks: 2 x 6 x 24 or 2 x 4 x 24
    elements, each the same shape on every rank) get their own mask, so the masks of two ranks differ;
    a mask drawn from the default generator, which every rank holds in step, would be the same."""
    assert max(worlds[tp].run(dropout_twins, SEQUENCE_CFG, 2, 12, 5, True)) <= 1e-10


def sharded_dropout_draws(seed):
    """A ShardedDropout's mask on this rank's (4, 64) tokens, and whether the default generator is where
    the same draws without the dropout leave it."""
    tensorpar.manual_seed(seed)
    keep = ShardedDropout(0.5)(torch.ones(2, 4, 64), 4 * tensorpar.current_mesh().tp) > 0
    after = torch.rand(8)
    tensorpar.manual_seed(seed)
    return keep, torch.equal(after, torch.rand(8))


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_dropout_leaves_the_default_generator_in_step(worlds, tp):
    """512 elements at p = 0.5 agree by chance with probability 2^-512."""
    results = worlds[tp].run(sharded_dropout_draws, 3)
    assert all(untouched for _, untouched in results), "ShardedDropout drew from the default generator"
    masks = [keep for keep, _ in results]
    assert all(not torch.equal(a, b) for r, a in enumerate(masks) for b in masks[r + 1:]), "two ranks drew one mask"


def stream_draws(seed, device):
    tracker = tensorpar.random.tracker()
    tensorpar.manual_seed(seed)
    with tracker.fork(device):
        first = torch.rand(4096, device=device)
    default_after_fork = torch.rand(8, device=device)
    with tracker.fork(device):
        second = torch.rand(4096, device=device)
    tensorpar.manual_seed(seed)
    default_alone = torch.rand(8, device=device)
    try:
        with tracker.fork(device), tracker.fork(device):  # would replay the outer stream's numbers
            nested = "allowed"
    except RuntimeError as e:
        nested = str(e)
    return first.cpu(), second.cpu(), torch.equal(default_after_fork, default_alone) and "already active" in nested


@given(tp=st.integers(2, 4), seed=st.integers(0, 2**31))
@settings(max_examples=4)
def test_tp_streams_differ_per_rank_and_leave_the_default_alone(worlds, tp, seed):
    results = worlds[tp].run(stream_draws, seed, "cpu")
    firsts = [r[0] for r in results]
    for rank, (first, second, default_untouched) in enumerate(results):
        assert default_untouched, f"rank {rank}: forking changed the default generator, or nested forks ran"
        assert not torch.equal(first, second), "the stream did not advance"
        assert all(not torch.equal(first, other) for other in firsts[rank + 1:]), "two ranks drew the same"
    again = worlds[tp].run(stream_draws, seed, "cpu")
    assert all(torch.equal(a[0], b[0]) for a, b in zip(results, again, strict=True)), "same seed, different draws"


def streams_of_two_meshes():
    pairs, whole = tensorpar.init(tp=2), tensorpar.init(tp=1)  # `whole` is the default
    with tensorpar.use_mesh(pairs):
        drop, found = ShardedDropout(0.5), tensorpar.random.tracker()

    def mask(seed):
        tensorpar.manual_seed(seed, pairs)
        return drop(torch.ones(1, 4, 64), 8) > 0

    first, again, other = mask(7), mask(7), mask(8)
    return {"layer holds the mesh's": drop.rng is found is tensorpar.random.tracker(pairs),
            "one per mesh": tensorpar.random.tracker() is tensorpar.random.tracker(whole) is not found,
            "ranks": (found.rank, tensorpar.random.tracker(whole).rank),
            "reseeded": torch.equal(first, again) and not torch.equal(first, other), "mask": first}


def test_each_mesh_has_one_tp_stream_that_manual_seed_reaches(worlds):
    """Two meshes at once: a layer built under ``use_mesh`` holds that mesh's stream, and seeding that mesh
    while another is the default reseeds it (256 elements at p = 0.5 agree by chance with probability 2^-256)."""
    results = worlds[2].run(streams_of_two_meshes, mesh=False)
    for rank, r in enumerate(results):
        assert r["layer holds the mesh's"] and r["one per mesh"] and r["reseeded"], (rank, r)
        assert r["ranks"] == (rank, 0)
    assert not torch.equal(results[0]["mask"], results[1]["mask"]), "both tp ranks drew one mask"

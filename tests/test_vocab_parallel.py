"""Vocab-parallel embedding and cross-entropy against nn.Embedding and F.cross_entropy."""

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tensorpar
from layers import VocabParallelEmbedding
from tensorpar.testing import TOLERANCES, assert_all_close, count_collectives, rel_error
from tensorpar.testing.strategies import dtypes, tp_sizes


def check_embedding(vocab, dim, shape, dtype, seed):
    torch.manual_seed(seed)
    dense = nn.Embedding(vocab, dim, dtype=dtype)
    sharded = VocabParallelEmbedding.from_embedding(dense)
    ids = torch.randint(0, vocab, shape)
    grad = torch.randn(*shape, dim, dtype=dtype)
    y, y_dense = sharded(ids), dense(ids)
    y.backward(grad)
    y_dense.backward(grad)
    full = tensorpar.full_grads(sharded)["weight"]
    back = sharded.to_embedding()
    errors = assert_all_close({"output": (y, y_dense), "grad weight": (full, dense.weight.grad)})
    return max(errors.values()), torch.equal(back.weight, dense.weight)


@settings(max_examples=25)
@given(tp=tp_sizes(), data=st.data())
def test_embedding_matches_nn_embedding(worlds, tp, data):
    vocab = data.draw(st.integers(tp, 97))
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=2)))
    dtype = data.draw(dtypes())
    for err, roundtrip in worlds[tp].run(check_embedding, vocab, data.draw(st.integers(1, 12)), shape, dtype,
                                         data.draw(st.integers(0, 2**31))):
        assert err <= TOLERANCES[dtype] and roundtrip


def test_gpt2_vocabulary_at_tp4_is_not_padded(worlds):
    """50257 rows over 4 ranks: 12565 + 3 x 12564, and the same lookups as unsharded."""
    results = worlds[4].run(check_embedding, 50257, 4, (3, 7), torch.float32, 0)
    assert all(err == 0.0 and roundtrip for err, roundtrip in results)


def check_cross_entropy(vocab, shape, dtype, ignore_index, reduction, scale, seed):
    mesh = tensorpar.current_mesh()
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(*shape, vocab, generator=g, dtype=torch.float64) * scale).to(dtype)
    targets = torch.randint(0, vocab, shape, generator=g)
    targets[torch.rand(shape, generator=g) < 0.25] = ignore_index
    targets.view(-1)[0] = 1 if ignore_index == 0 else 0  # at least one counted target
    local = tensorpar.scatter_to_tp(full, -1).detach().requires_grad_()
    dense = full.clone().requires_grad_()
    with count_collectives() as counts:
        loss = tensorpar.vocab_parallel_cross_entropy(local, targets, vocab, ignore_index=ignore_index,
                                                      reduction=reduction)
    expected = F.cross_entropy(dense.reshape(-1, vocab), targets.reshape(-1), ignore_index=ignore_index,
                               reduction=reduction)
    expected = expected.reshape(shape) if reduction == "none" else expected
    out_grad = torch.randn(loss.shape, generator=g, dtype=torch.float64).to(dtype)
    loss.backward(out_grad)
    expected.backward(out_grad)
    grad = tensorpar.all_gather(local.grad, -1, vocab)
    # log Σ exp(z − m) sums terms the largest of which is 1, so each position's loss is accurate to
    # a few ulps of 1, not of itself (a confident prediction's loss can be 1e-8): the loss is
    # measured against one per position, and each row of the gradient, (softmax − onehot) × its
    # weight in the loss, against that weight.
    valid = (targets != ignore_index).double()
    weight = out_grad.double() * valid / (valid.sum() if reduction == "mean" else 1.0)
    errors = assert_all_close({"loss": (loss, expected, loss.numel() ** 0.5),
                               "grad": (grad, dense.grad, weight.norm().item())})
    return max(errors.values()), counts.summary(), loss.dtype, mesh.tp


@settings(max_examples=40)
@given(tp=tp_sizes(), data=st.data())
def test_cross_entropy_matches_f_cross_entropy(worlds, tp, data):
    dtype = data.draw(dtypes())
    vocab = data.draw(st.integers(max(tp, 2), 67) if dtype != torch.bfloat16 else st.integers(16, 67))
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=2)))
    if dtype == torch.bfloat16:  # enough positions for a norm-wise bound (see test_linear)
        shape = (16, *shape)
    args = (vocab, shape, dtype, data.draw(st.sampled_from([-100, -1, 0])),
            data.draw(st.sampled_from(["mean", "sum", "none"])),
            data.draw(st.sampled_from([1.0, 30.0, 1e4]) if dtype == torch.float64 else st.just(1.0)),
            data.draw(st.integers(0, 2**31)))
    for err, counts, out_dtype, n in worlds[tp].run(check_cross_entropy, *args):
        # 16-bit logits give a float32 loss, at every tp (Megatron's choice; F.cross_entropy under autocast)
        assert err <= TOLERANCES[dtype] and out_dtype == (torch.float32 if dtype == torch.bfloat16 else dtype)
        tokens = torch.Size(shape).numel()
        expected = {} if n == 1 else {("forward", "all_reduce", torch.float64 if dtype == torch.float64
                                       else torch.float32, tokens): 3}
        assert dict(counts) == expected


def test_cross_entropy_at_vocabularies_barely_above_tp(worlds):
    """Vocabularies of tp, tp + 1 and 2 * tp - 1 entries: ranks of one entry each, one rank of two, and
    one rank of one among ranks of two."""
    for tp in (2, 3, 4):
        for vocab in (tp, tp + 1, 2 * tp - 1):
            for err, *_ in worlds[tp].run(check_cross_entropy, vocab, (2, 3), torch.float64, -100, "mean", 1.0, vocab):
                assert err <= 1e-10, (tp, vocab)


def check_stability():
    """Logits far beyond exp's range, in float32: finite, and equal to F.cross_entropy's."""
    torch.manual_seed(0)
    full = torch.randn(6, 40) * 1e3 + 5e4
    targets = torch.randint(0, 40, (6,))
    local = tensorpar.scatter_to_tp(full, -1).detach().requires_grad_()
    loss = tensorpar.vocab_parallel_cross_entropy(local, targets, 40)
    loss.backward()
    dense = full.clone().requires_grad_()
    expected = F.cross_entropy(dense, targets)
    expected.backward()
    grad = tensorpar.all_gather(local.grad, -1, 40)
    return bool(torch.isfinite(loss)), assert_all_close({"loss": (loss, expected), "grad": (grad, dense.grad)})


def test_cross_entropy_is_stable_for_huge_logits(worlds):
    for finite, _ in worlds[3].run(check_stability):
        assert finite


def check_all_ignored():
    """Every target ignored: F.cross_entropy's mean is nan, its gradient zero; int32 targets are fine."""
    full = torch.randn(3, 10, requires_grad=True)
    local = tensorpar.scatter_to_tp(full.detach(), -1).requires_grad_()
    loss = tensorpar.vocab_parallel_cross_entropy(local, torch.full((3,), -100, dtype=torch.int32), 10)
    loss.backward()
    expected = F.cross_entropy(full, torch.full((3,), -100))
    expected.backward()
    return loss.isnan().item(), expected.isnan().item(), torch.equal(local.grad, torch.zeros_like(local.grad)), \
        torch.equal(full.grad, torch.zeros_like(full.grad))


def test_all_ignored_is_nan_with_zero_gradient_like_f_cross_entropy(worlds):
    assert worlds[2].run(check_all_ignored) == [(True, True, True, True)] * 2


def check_16_bit_logits_and_target_widths(seed):
    """bf16 and fp16 logits against F.cross_entropy of their float32 values; every integer target width."""
    g = torch.Generator().manual_seed(seed)
    vocab, shape = 37, (4, 6)
    targets = torch.randint(0, vocab, shape, generator=g)
    results = {}
    for dtype in (torch.bfloat16, torch.float16):
        full = torch.randn(*shape, vocab, generator=g).to(dtype)
        dense = full.float().requires_grad_()
        expected = F.cross_entropy(dense.reshape(-1, vocab), targets.reshape(-1))
        expected.backward()
        local = tensorpar.scatter_to_tp(full, -1).detach().requires_grad_()
        loss = tensorpar.vocab_parallel_cross_entropy(local, targets, vocab)
        loss.backward()
        grad = tensorpar.all_gather(local.grad, -1, vocab)
        results[dtype] = (loss.item(), expected.item(), loss.dtype, local.grad.dtype,
                          rel_error(grad, dense.grad))
    logits = tensorpar.scatter_to_tp(torch.randn(*shape, vocab, generator=g), -1)
    widths = {}
    for dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        local = logits.clone().requires_grad_()
        loss = tensorpar.vocab_parallel_cross_entropy(local, targets.to(dtype), vocab, reduction="none")
        loss.sum().backward()
        widths[dtype] = (loss.detach(), local.grad)
    same_as_int64 = {dtype: torch.equal(loss, widths[torch.int64][0]) and torch.equal(grad, widths[torch.int64][1])
                     for dtype, (loss, grad) in widths.items()}
    return results, same_as_int64


def test_16_bit_logits_give_the_float32_loss_at_every_tp_and_any_integer_targets_work(worlds):
    losses = {torch.bfloat16: [], torch.float16: []}
    for tp in (1, 2, 3, 4):
        for results, same_as_int64 in worlds[tp].run(check_16_bit_logits_and_target_widths, 7):
            assert all(same_as_int64.values()), (tp, same_as_int64)
            for dtype, (loss, expected, loss_dtype, grad_dtype, grad_error) in results.items():
                assert abs(loss - expected) <= 1e-5 * abs(expected), (tp, dtype, loss, expected)
                assert loss_dtype == torch.float32 and grad_dtype == dtype
                # the gradient is computed in float32 and rounded once to the logits' dtype (half an ulp)
                assert grad_error <= torch.finfo(dtype).eps, (tp, dtype, grad_error)
                losses[dtype].append(loss)
    for dtype, values in losses.items():  # one loss, whatever the tp: its spread is float32 round-off
        assert max(values) - min(values) <= 1e-5 * abs(values[0]), (dtype, values)

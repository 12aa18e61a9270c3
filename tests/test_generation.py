"""Per-token training losses and generation with the head-sharded KV cache, against the plain reference
GPT in tests/reference_gpt.py at tp 1-4 (default numerics; the bitwise mode's parity is in
tests/test_logprob_parity.py)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

import tensorpar
from gpt_cases import batch, gpt_configs, twins
from layers.sampling import sample
from tensorpar.sharding import partition_bounds
from tensorpar.testing import TOLERANCES, assert_all_close
from tensorpar.testing.strategies import tp_sizes


def per_token_losses(cfg, b, t, seed, temperature, sequence_parallel):
    """``reduction="none"`` of the sharded GPT and ``F.cross_entropy(reduction="none")`` of the reference's
    logits / temperature (targets -1 ignored: 0 in both), float64."""
    ref, model = twins(cfg, torch.float64, seed, sequence_parallel=sequence_parallel)
    idx, targets = batch(cfg, b, t, seed)
    ours = model(idx, targets, reduction="none", temperature=temperature)
    logits = ref(idx) / temperature
    theirs = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1, reduction="none")
    summed = model(idx, targets, reduction="sum", temperature=temperature)
    return ours.detach(), theirs.view(b, t).detach(), summed.detach()


@settings(max_examples=4)
@given(tp=tp_sizes(), data=st.data())
def test_per_token_loss_is_the_references(worlds, tp, data):
    cfg = data.draw(gpt_configs(tp, max_layer=1))
    b, t = data.draw(st.integers(1, 3)), data.draw(st.integers(1, cfg["block_size"]))
    temperature = data.draw(st.sampled_from([1.0, 0.7]))
    sp = data.draw(st.booleans(), label="sequence_parallel")
    for ours, theirs, summed in worlds[tp].run(per_token_losses, cfg, b, t, 0, temperature, sp):
        assert ours.shape == (b, t)
        assert_all_close({"per-token loss": (ours, theirs), "sum": (summed, theirs.sum())},
                         rtol=TOLERANCES[torch.float64])


GEN_CFG = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=16, vocab_size=37, block_size=24, bias=True, mlp="gelu")


def generated(cfg, seed, sequence_parallel, lengths, new):
    """Greedy tokens with the cache, without it and from the reference; sampled tokens' log-probs against
    the training path's ``-loss``; prompts of different lengths against each row alone; the cache's logits
    (prefill, then decode) against one forward of the whole sequence."""
    ref, model = twins(cfg, torch.float64, seed, sequence_parallel=sequence_parallel)
    model.eval(), ref.eval()
    b, t = len(lengths), max(lengths)
    idx = torch.randint(0, cfg["vocab_size"], (b, t), generator=torch.Generator().manual_seed(seed))
    out = {"cached": model.generate(idx, new, temperature=0),
           "recomputed": model.generate(idx, new, 0, use_cache=False),
           "reference": ref.generate(idx, new, temperature=0)}
    torch.manual_seed(seed)
    sampled, logprobs = model.generate(idx, new, 1.0, return_logprobs=True)
    losses = model(sampled[:, :-1], sampled[:, 1:], reduction="none")[:, t - 1:]
    ragged, ragged_lp = model.generate(idx, new, 0, prompt_lengths=lengths, return_logprobs=True)
    ragged_recomputed = model.generate(idx, new, 0, prompt_lengths=lengths, use_cache=False)
    alone = [model.generate(idx[r:r + 1, :n], new, 0, return_logprobs=True) for r, n in enumerate(lengths)]
    cache = model.new_cache(b)
    steps = [model(sampled[:, :t], cache=cache)] + [model(sampled[:, i:i + 1], cache=cache)
                                                    for i in range(t, sampled.shape[1])]
    cache = model.new_cache(b)  # the rest in chunks of 2 tokens: several queries after the cache's tokens
    chunks = [model(sampled[:, :t], cache=cache)] + [model(sampled[:, i:i + 2], cache=cache)
                                                     for i in range(t, sampled.shape[1], 2)]
    whole = model(sampled)
    ragged = {"cached": ragged, "recomputed": ragged_recomputed}
    return out, logprobs, -losses, ragged, ragged_lp, alone, torch.cat(steps, 1), torch.cat(chunks, 1), whole


@settings(max_examples=5)
@given(tp=tp_sizes(), data=st.data())
@example(tp=1, data=None)  # a short prompt beside a longer one: the padding after it is not copied to the result
def test_generation_with_the_cache_is_generation_without_it(worlds, tp, data):
    if data is None:
        cfg, lengths, new, sp = GEN_CFG | dict(n_head=4, n_embd=8, n_kv_head=2, mlp="gelu"), [1, 3], 1, False
    else:
        n_head = data.draw(st.integers(tp, 6))
        cfg = GEN_CFG | dict(n_head=n_head, n_embd=2 * n_head, n_kv_head=data.draw(
            st.sampled_from([d for d in range(1, n_head + 1) if n_head % d == 0])),
            mlp=data.draw(st.sampled_from(["gelu", "swiglu"])), vocab_size=data.draw(st.integers(tp, 53)),
            norm=data.draw(st.sampled_from(["layernorm", "rmsnorm"])),
            positions=data.draw(st.sampled_from(["learned", "rope"])))  # rotary: each row at its own positions
        lengths = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=3), label="prompt lengths")
        new = data.draw(st.integers(1, cfg["block_size"] - max(lengths)))
        sp = data.draw(st.booleans(), label="sequence_parallel")
    results = worlds[tp].run(generated, cfg, 0, sp, lengths, new)
    for out, logprobs, training, ragged, ragged_lp, alone, steps, chunks, whole in results:
        assert out["cached"].tolist() == out["recomputed"].tolist() == out["reference"].tolist()
        assert logprobs.shape == (len(lengths), new)
        for path, tokens in ragged.items():  # each row's tokens left-aligned, then pad_token (0)
            for r, n in enumerate(lengths):
                assert tokens[r, :n + new].tolist() == alone[r][0][0].tolist(), (path, r, n)
                assert (tokens[r, n + new:] == 0).all(), (path, r, n, tokens[r].tolist())
        assert_all_close({"log-probs": (logprobs, training), "steps": (steps, whole), "chunks": (chunks, whole),
                          "ragged log-probs": (ragged_lp, torch.cat([a[1] for a in alone]))},
                         rtol=TOLERANCES[torch.float64])
    assert all(r[0]["cached"].tolist() == results[0][0]["cached"].tolist() for r in results)


def stopping(cfg, seed):
    _, model = twins(cfg, torch.float64, seed)
    model.eval()
    idx = torch.randint(0, cfg["vocab_size"], (3, 2), generator=torch.Generator().manual_seed(seed))
    free = model.generate(idx, 8, 0)
    stop = int(free[0, 4])  # row 0's third new token
    out, logprobs = model.generate(idx, 8, 0, stop_tokens=[stop], return_logprobs=True)
    return free, stop, out, logprobs


def test_a_row_that_samples_a_stop_token_repeats_it(worlds):
    free, stop, out, logprobs = worlds[2].run(stopping, GEN_CFG, 0)[0]
    assert out.shape == free.shape and logprobs.shape == (3, 8)
    for r in range(3):
        hits = (free[r, 2:] == stop).nonzero()
        end = 2 + int(hits[0]) + 1 if len(hits) else free.shape[1]
        assert out[r, :end].tolist() == free[r, :end].tolist()
        assert (out[r, end:] == stop).all() and (logprobs[r, end - 2:] == 0).all()
        assert (logprobs[r, :end - 2] < 0).all()


def draws(logits, temperature, top_k, seed):
    """Tokens and log-probs :func:`layers.sampling.sample` draws for the rows of the full ``logits`` (B, V),
    each rank from its vocabulary slice, the default generator seeded with ``seed`` on every rank."""
    group = tensorpar.tp_group()
    lo, n = partition_bounds(logits.shape[-1], group.size(), group.rank())
    torch.manual_seed(seed)
    return sample(logits[:, lo:lo + n], logits.shape[-1], temperature, top_k, group, scored=True)[:2]


SAMPLED_LOGITS = torch.tensor([1.0, -0.5, 2.0, 0.3, 2.0, -3.0, 0.9], dtype=torch.float64)  # V = 7: uneven at tp 2-4


@pytest.mark.parametrize("temperature,top_k", [(0.0, None), (1.0, None), (0.6, None), (1.3, 3)])
def test_sampling_draws_from_the_distribution_and_the_same_tokens_at_every_tp(worlds, temperature, top_k):
    rows = 4000
    logits = SAMPLED_LOGITS.expand(rows, -1)
    results = {tp: worlds[tp].run(draws, logits, temperature, top_k, 0) for tp in (1, 2, 3)}
    tokens, logprobs = results[1][0]
    for tp, per_rank in results.items():  # one all-gather of a few numbers: the same draw everywhere
        for other_tokens, other_logprobs in per_rank:
            assert torch.equal(other_tokens, tokens), tp
            assert_all_close({f"log-probs at tp {tp}": (other_logprobs, logprobs)}, rtol=TOLERANCES[torch.float64])
    if temperature == 0:  # the first of the largest, as a full argmax picks it
        assert (tokens == 2).all()
        expected = F.log_softmax(SAMPLED_LOGITS, -1)[2].expand(rows)
    else:
        scaled = SAMPLED_LOGITS / temperature
        if top_k is not None:
            scaled = scaled.masked_fill(scaled < scaled.topk(top_k).values[-1], -torch.inf)
        probs = F.softmax(scaled, -1)
        freq = torch.bincount(tokens, minlength=len(probs)).double() / rows
        bound = 4 * (probs * (1 - probs) / rows).sqrt() + 1e-12  # 4 standard deviations
        assert ((freq - probs).abs() <= bound).all(), (freq.tolist(), probs.tolist())
        expected = F.log_softmax(scaled, -1)[tokens]
    assert_all_close({"log-probs": (logprobs, expected)}, rtol=TOLERANCES[torch.float64])

"""Bitwise mode: the log-probs ``GPT.generate`` returns for the tokens it sampled at tp = a equal, bit for bit,
``-loss`` of the training forward (``reduction="none"``) on the generated sequences at tp = b, for a, b in
1-4, float32 and bfloat16 autocast, at the sampling temperature; whatever the batch around a row (a prompt
alone, or among prompts of other lengths) and however the sequence was cut (prefill and decode from the KV
cache, against one forward of the whole). Without the mode they agree to round-off only."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import tensorpar
from layers import GPT, GPTConfig
from tensorpar.bitwise import Bitwise

CFG = dict(n_layer=2, n_head=6, n_kv_head=2, n_embd=24, vocab_size=41, block_size=20, bias=True, mlp="gelu")


def sample(cfg, lengths, new, temperature, autocast, seed):
    """Prompts of ``lengths`` (right-padded) continued by ``new`` sampled tokens and their log-probs; and
    greedy continuations (the same tokens whatever the batch, when the logits are) of the batch and of its
    first row alone: their tokens and log-probs."""
    tensorpar.manual_seed(seed)
    model = GPT(GPTConfig(**cfg)).eval()
    idx = torch.randint(0, cfg["vocab_size"], (len(lengths), max(lengths)), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        torch.manual_seed(seed)
        out, logprobs = model.generate(idx, new, temperature, prompt_lengths=lengths, return_logprobs=True)
        greedy = model.generate(idx, new, 0, prompt_lengths=lengths, return_logprobs=True)
        alone = model.generate(idx[:1, :lengths[0]], new, 0, return_logprobs=True,
                               use_cache=len(lengths) > 1)  # and, for one row, recomputing: no cache at all
    return out, logprobs, [(t[:1, :lengths[0] + new], lp[:1]) for t, lp in (greedy, alone)]


def score(cfg, out, lengths, new, temperature, autocast, seed):
    """``-loss`` per token of the training forward on the generated rows, as one batch (targets past a row's
    end ignored), at the positions of the sampled tokens: (B, new)."""
    tensorpar.manual_seed(seed)
    model = GPT(GPTConfig(**cfg)).eval()
    idx, targets = out[:, :-1], out[:, 1:].clone()
    ends = torch.tensor(lengths) + new - 1
    targets[torch.arange(targets.shape[1]) >= ends[:, None]] = -1
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        losses = model(idx, targets, reduction="none", temperature=temperature)
    at = torch.tensor(lengths)[:, None] - 1 + torch.arange(new)
    return -losses.gather(1, at)


@settings(max_examples=8)
@given(a=st.integers(1, 4), b=st.integers(1, 4), data=st.data())
@example(a=3, b=2, data=None)
@example(a=1, b=4, data="llama")  # RMSNorm and rotary positions: a token's angles alike in prefill and decode
@example(a=1, b=1, data="vocab 4")  # one-token segments of the vocabulary: products of one output feature
@example(a=1, b=1, data="bf16 rows")  # bf16 products of 39 rows and of 8: row-count-dependent bf16 GEMMs
@example(a=2, b=1, data="odd width")  # n_embd 30, head size 5: a row's bits would depend on where it lies
def test_generation_log_probs_are_the_training_log_probs_bit_for_bit(worlds, a, b, data):
    if data == "vocab 4":
        cfg, lengths, new, temperature, autocast, key_block = CFG | dict(vocab_size=4), [1], 10, 1.0, False, 64
    elif data == "bf16 rows":
        cfg, lengths, new, temperature, autocast, key_block = CFG | dict(mlp="swiglu", vocab_size=43), [7, 4, 1], 6, \
            0.7, True, 4
    elif data == "odd width":
        cfg, lengths, new, temperature, autocast, key_block = CFG | dict(n_embd=30), [5, 2, 7], 9, 1.0, False, 3
    elif data is None or data == "llama":
        cfg, lengths, new, temperature, autocast, key_block = CFG | dict(sequence_parallel=True), [5, 2, 7], 9, 1.0, \
            True, 4
        if data == "llama":
            cfg |= dict(norm="rmsnorm", positions="rope", mlp="swiglu", bias=False)
    else:
        cfg = CFG | dict(mlp=data.draw(st.sampled_from(["gelu", "swiglu"])), vocab_size=data.draw(st.integers(4, 67)),
                         sequence_parallel=data.draw(st.booleans(), label="sequence_parallel"),
                         norm=data.draw(st.sampled_from(["layernorm", "rmsnorm"])),
                         positions=data.draw(st.sampled_from(["learned", "rope"])))
        cfg["n_embd"] = CFG["n_head"] * data.draw(st.integers(1, 7).filter(  # rotary positions: an even head size
            lambda d: d % 2 == 0 or cfg["positions"] == "learned"), label="head size")
        lengths = data.draw(st.lists(st.integers(1, 8), min_size=1, max_size=3), label="prompt lengths")
        new = data.draw(st.integers(1, cfg["block_size"] - max(lengths)))
        temperature = data.draw(st.sampled_from([1.0, 0.7]))
        autocast = data.draw(st.booleans(), label="bfloat16 autocast")
        key_block = data.draw(st.sampled_from([3, 4, 64]), label="key block")
    mode = Bitwise(key_block=key_block)
    out, logprobs, alone = worlds[a].run(sample, cfg, lengths, new, temperature, autocast, 0, bitwise=mode)[0]
    for trained in worlds[b].run(score, cfg, out, lengths, new, temperature, autocast, 0, bitwise=mode):
        assert torch.equal(logprobs, trained), f"tp {a} -> {b}: {(logprobs - trained).abs().max()}"
    (batch_tokens, batch_lp), (alone_tokens, alone_lp) = alone
    assert torch.equal(batch_tokens, alone_tokens) and torch.equal(batch_lp, alone_lp), \
        "a row alone and inside the batch differ"


def test_the_mode_samples_the_same_tokens_at_every_tp(worlds):
    """Gumbel-max sampling draws its noise per vocabulary entry, alike on every rank: the mode's logits, equal
    at every tp, give the same tokens (and log-probs) at tp 1-4, from the same seed."""
    runs = {tp: worlds[tp].run(sample, CFG, [5, 2, 7], 8, 1.0, False, 0, bitwise=Bitwise())[0] for tp in (1, 2, 3, 4)}
    out, logprobs, _ = runs[1]
    for tp, (other, other_logprobs, _) in runs.items():
        assert torch.equal(other, out) and torch.equal(other_logprobs, logprobs), f"tp {tp}"


def lm_head_rows(vocab_size, counts):
    """The bitwise LM head's logits of the first ``n`` of 40 hidden states, together, for each ``n`` of
    ``counts``; and of each state alone (a batch of one decoding)."""
    tensorpar.manual_seed(0)
    head = GPT(GPTConfig(**CFG | dict(vocab_size=vocab_size))).eval().lm_head
    h = torch.randn(40, CFG["n_embd"], generator=torch.Generator().manual_seed(0))  # (40, C)
    with torch.no_grad():
        return [head(h[:n]) for n in counts], torch.cat([head(h[i:i + 1]) for i in range(40)])


@pytest.mark.parametrize("vocab_size", [1, 4, 6, 9, 41])
def test_a_rows_logits_have_the_same_bits_alone_or_among_any_number_of_rows(worlds, vocab_size):
    """Small vocabularies have segments of one token (at the mode's tp 1-4): their products too."""
    counts = [*range(1, 17), 23, 31, 33, 40]
    for tp in [t for t in (1, 3) if t <= vocab_size]:
        for together, alone in worlds[tp].run(lm_head_rows, vocab_size, counts, bitwise=Bitwise()):
            for n, logits in zip(counts, together, strict=True):
                assert torch.equal(logits, alone[:n]), f"tp {tp}, {n} rows"


def test_without_the_mode_they_agree_to_round_off_only(worlds):
    """The counter-test: default numerics, sampled at tp 1 and scored at tp 3, agree to within round-off
    but not bit for bit (so the mode, not the case, makes them equal)."""
    cfg, lengths, new = CFG | dict(n_embd=48, vocab_size=97), [6, 3], 10
    out, logprobs, _ = worlds[1].run(sample, cfg, lengths, new, 1.0, False, 0)[0]
    trained = worlds[3].run(score, cfg, out, lengths, new, 1.0, False, 0)[0]
    assert not torch.equal(logprobs, trained)
    torch.testing.assert_close(logprobs, trained, rtol=1e-5, atol=1e-5)

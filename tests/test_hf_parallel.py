"""layers.parallelize_hf against the unsharded ``transformers`` model, at tp 1-4.

Each example draws an architecture's tiny random config (head counts that do
not divide by tp, fewer KV heads than ranks, grouped-query attention, odd
vocabularies, tied or untied heads, a padding token, eager or sdpa attention),
builds the dense model from a seed on every rank, shards a deep copy, and
compares logits, Hugging Face's own loss (``labels=``), every gradient
(``tensorpar.full_grads`` against the dense ``.grad``\\ s, same keys) and every
parameter after 3 AdamW steps (``tensorpar.full_state_dict`` against the dense
state dict, same keys and shapes). The worst relative error per dtype is
printed at the end of the module.
"""

import copy
from collections import Counter

import pytest
import torch
import transformers  # noqa: F401  (the hf extra: make test installs it, so a missing one fails)
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorpar
from hf_cases import batch, build
from tensorpar.testing import TOLERANCES, assert_all_close, count_collectives

ARCHS = ("gpt2", "llama", "mistral", "qwen2")
WORST: dict[str, float] = {}  # worst relative error per dtype over this module's examples


@pytest.fixture(scope="module", autouse=True)
def report_worst(request):
    yield
    if WORST:
        line = ", ".join(f"{dtype} {err:.2g}" for dtype, err in sorted(WORST.items()))
        with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
            print(f"\nparallelize_hf equivalence, worst relative error: {line}")


def train_hf(arch, spec, dtype, b, t, seed, steps=3):
    """Forward, backward and ``steps`` AdamW steps on the dense model and its sharded copy."""
    from layers import parallelize_hf

    dense = build(arch, spec, dtype, seed)
    model = parallelize_hf(copy.deepcopy(dense))
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    ids, labels = batch(spec, b, t, seed)
    out, ref = model(ids, labels=labels), dense(ids, labels=labels)
    out.loss.backward()
    ref.loss.backward()
    grads = tensorpar.full_grads(model)
    ref_grads = {k: p.grad.clone() for k, p in dense.named_parameters()}
    # AdamW steps by g / (√v + eps): a gradient element at the level of round-off steps by up to lr
    # when eps is below that level, so that the round-off, not the gradient, decides the step. In
    # float32 such elements (a few 1e-9) occur, below the default eps of 1e-8: eps = 1e-6 keeps
    # their steps as small as they are. (float64 round-off is far below 1e-8.)
    eps = 1e-6 if dtype == torch.float32 else 1e-8
    for m in (model, dense):  # each with its own AdamW; the first step uses the gradients above
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, eps=eps)
        opt.step()
        for step in range(1, steps):
            ids2, labels2 = batch(spec, b, t, seed + step)
            opt.zero_grad()
            m(ids2, labels=labels2).loss.backward()
            opt.step()
    full, ref_state = tensorpar.full_state_dict(model), dense.state_dict()
    # every collective is done: compare (a failure is raised on every rank alike)
    shapes = {k: tuple(v.shape) for k, v in full.items()}
    if set(grads) != set(ref_grads) or shapes != {k: tuple(v.shape) for k, v in ref_state.items()}:
        raise AssertionError(f"keys or shapes differ: {sorted(set(full) ^ set(ref_state))} "
                             f"{sorted(set(grads) ^ set(ref_grads))}")
    # Gradients against the whole gradient's norm when larger (some, such as GPT-2's key biases,
    # whose gradient is zero in exact arithmetic, hold round-off alone).
    scale = torch.cat([g.flatten() for g in ref_grads.values()]).norm().item()
    pairs = {"logits": (out.logits, ref.logits), "loss": (out.loss, ref.loss)}
    pairs |= {f"grad {k}": (grads[k], ref_grads[k], scale) for k in ref_grads}
    # AdamW divides by a gradient's RMS, turning the round-off of a zero gradient (GPT-2's key biases:
    # a key bias adds one constant to a softmax row) into steps of up to lr either way: those are
    # compared to within the steps; the rest against the whole parameter norm when larger.
    drift = 0.0
    if arch == "gpt2":
        for k in [k for k in ref_state if k.endswith("attn.c_attn.bias")]:
            (q, key, v), (ref_q, ref_key, ref_v) = full.pop(k).chunk(3), ref_state.pop(k).chunk(3)
            drift = max(drift, (key - ref_key).abs().max().item())
            full[k], ref_state[k] = torch.cat([q, v]), torch.cat([ref_q, ref_v])
    norm = torch.cat([v.flatten() for v in ref_state.values()]).norm().item()
    pairs |= {f"after {steps} steps {k}": (full[k], ref_state[k], norm) for k in ref_state}
    errors = assert_all_close(pairs, what=f"{arch} differs from its dense model at tp={tensorpar.current_mesh().tp}")
    if drift > 2 * steps * 1e-3:
        raise AssertionError(f"key biases moved apart by {drift:.3g}, more than AdamW's steps allow")
    return errors, tied, str(out.loss.dtype)


@st.composite
def hf_specs(draw, arch, tp, dtype):
    """A tiny config of ``arch`` valid at ``tp``, with each architecture's options that change the
    computation (biases, head sizes apart from the hidden size, sliding windows, scalings)."""
    n_head = draw(st.integers(tp, 8))
    head_dim = draw(st.sampled_from([2, 4, 6]))  # even: rotary embeddings rotate pairs
    spec = dict(vocab_size=draw(st.integers(8, 67)), attn=draw(st.sampled_from(["eager", "sdpa"])))
    if arch == "gpt2":
        return spec | dict(n_layer=2, n_head=n_head, n_embd=n_head * head_dim, n_positions=16,
                           n_inner=draw(st.sampled_from([None, 4 * tp + 3])),
                           scale_attn_by_inverse_layer_idx=draw(st.booleans()),
                           # upcasting adds a float64 mask to float32 scores: HF refuses it in float64
                           reorder_and_upcast_attn=dtype == torch.float32 and draw(st.booleans()))
    n_kv = draw(st.sampled_from([d for d in range(1, n_head + 1) if n_head % d == 0]))
    spec |= dict(num_hidden_layers=2, num_attention_heads=n_head, num_key_value_heads=n_kv,
                 hidden_size=n_head * head_dim, intermediate_size=draw(st.integers(tp, 40)),
                 tie_word_embeddings=draw(st.booleans()))
    if arch == "llama":
        spec |= dict(attention_bias=draw(st.booleans()), mlp_bias=draw(st.booleans()),
                     pad_token_id=draw(st.sampled_from([None, spec["vocab_size"] - 1])))
    if arch == "mistral":  # heads of their own size (q_proj: hidden -> n_head * head_dim), a short window
        spec |= dict(hidden_size=draw(st.integers(3, 20)), head_dim=head_dim,
                     sliding_window=draw(st.sampled_from([None, 3])))
    if arch == "qwen2":  # layers from the second on attend through a window of 3 tokens, or none do
        spec |= dict(use_sliding_window=draw(st.booleans()), sliding_window=3, max_window_layers=1)
    return spec


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
@pytest.mark.parametrize("arch", ARCHS)
@settings(max_examples=1)
@given(data=st.data())
def test_matches_the_dense_model(worlds, arch, tp, data):
    dtype = data.draw(st.sampled_from([torch.float64, torch.float32]))
    spec = data.draw(hf_specs(arch, tp, dtype))
    b, t, seed = data.draw(st.integers(1, 2)), data.draw(st.integers(3, 8)), data.draw(st.integers(0, 2**31))
    results = worlds[tp].run(train_hf, arch, spec, dtype, b, t, seed)
    for errors, tied, _loss_dtype in results:
        assert tied == (arch == "gpt2" or spec["tie_word_embeddings"])
        worst = max(errors.values())
        name = str(dtype).removeprefix("torch.")
        WORST[name] = max(WORST.get(name, 0.0), worst)
        assert worst <= TOLERANCES[dtype]


UNEVEN_KV = dict(vocab_size=29, attn="eager", num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                 hidden_size=16, intermediate_size=11, tie_word_embeddings=True, attention_bias=True,
                 mlp_bias=False, pad_token_id=3)


def layout_and_training(spec):
    """The KV heads and groups each rank's attention uses, then :func:`train_hf` in float64."""
    from layers import parallelize_hf

    model = parallelize_hf(build("llama", spec, torch.float64, 0))
    attn = model.model.layers[0].self_attn
    layout = (list(attn.k_proj.heads), attn.num_key_value_groups, attn.q_proj.weight.shape[0] // 2)
    return layout, train_hf("llama", spec, torch.float64, 2, 6, 7)


def test_query_heads_reading_kv_heads_unevenly(worlds):
    """8 query heads in 2 groups of 4 over 3 ranks (3, 3, 2 heads) with fewer KV heads than ranks:
    rank 1's query heads 3-5 read KV head 0 once and KV head 1 twice, so it holds one KV head per
    query head; the others read one KV head each, repeated. Tied embeddings, a padding token, biases."""
    results = worlds[3].run(layout_and_training, UNEVEN_KV)
    layouts = [layout for layout, _ in results]
    assert layouts == [([0], 3, 3), ([0, 1, 1], 1, 3), ([1], 2, 2)]
    for _, (errors, tied, _) in results:
        assert tied and max(errors.values()) <= TOLERANCES[torch.float64]


def count_hf(arch, spec, b, t):
    """Collectives of forward+backward with ``labels=`` for 1 and 2 decoder layers."""
    from layers import parallelize_hf

    counts = []
    for n_layer in (1, 2):
        layers_key = "n_layer" if arch == "gpt2" else "num_hidden_layers"
        model = parallelize_hf(build(arch, dict(spec, **{layers_key: n_layer}), torch.float32, 0))
        ids, labels = batch(spec, b, t, 0)
        with count_collectives() as counter:
            model(ids, labels=labels).loss.backward()
        counts.append(counter.summary())
    return counts


@pytest.mark.parametrize("arch, tp, n_kv", [("gpt2", 2, None), ("gpt2", 4, None), ("llama", 2, 2),
                                            ("llama", 4, 3), ("qwen2", 3, 1), ("mistral", 1, 2)])
def test_two_all_reduces_forward_and_two_backward_per_layer(worlds, arch, tp, n_kv):
    """Per decoder layer: g after attention and after the MLP forward, f before each backward
    (and, with K and V held whole, one all-reduce of each one's weight gradients). Outside the
    layers: the embedding's g, the LM head's f and the all-gather of its logits. At tp=1, none."""
    b, t, n_head, d, vocab = 2, 3, 6, 2, 23  # 6 heads: 2, 2, 1, 1 at tp=4
    if arch == "gpt2":
        spec = dict(vocab_size=vocab, attn="sdpa", n_head=n_head, n_embd=n_head * d, n_positions=8)
    else:
        spec = dict(vocab_size=vocab, attn="eager", num_attention_heads=n_head, num_key_value_heads=n_kv,
                    hidden_size=n_head * d, intermediate_size=10, tie_word_embeddings=False)
    one, two = worlds[tp].run(count_hf, arch, spec, b, t)[0]
    f32, act = torch.float32, b * t * n_head * d
    layer = Counter({("forward", "all_reduce", f32, act): 2, ("backward", "all_reduce", f32, act): 2})
    if arch != "gpt2" and n_kv < tp:
        bias = arch == "qwen2"  # Qwen2's K and V have biases, summed with their weights
        layer[("backward", "all_reduce", f32, (n_kv * d) * (n_head * d + bias))] += 2
    logits = b * t * tp * -(-vocab // tp)  # the vocabulary's shards travel padded to the largest
    outside = Counter({("forward", "all_reduce", f32, act): 1, ("forward", "all_gather", f32, logits): 1,
                       ("backward", "all_reduce", f32, act): 1})
    if tp == 1:
        layer, outside = Counter(), Counter()
    assert two - one == layer and one - layer == outside and two == one + layer


def generate_both(spec, prompt_seed):
    from layers import parallelize_hf

    dense = build("llama", spec, torch.float64, 0).eval()
    model = parallelize_hf(copy.deepcopy(dense))
    ids = torch.randint(1, spec["vocab_size"], (2, 3), generator=torch.Generator().manual_seed(prompt_seed))
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    return model.generate(ids, **options).tolist(), dense.generate(ids, **options).tolist()


@pytest.mark.parametrize("n_kv", [2, 1])
def test_greedy_generate_gives_the_dense_models_tokens(worlds, n_kv):
    """Cached decoding at tp=2 (sdpa with one query token: its grouped-query path), KV heads split
    (2) or held whole (1)."""
    spec = dict(vocab_size=41, attn="sdpa", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=n_kv,
                hidden_size=16, intermediate_size=24, tie_word_embeddings=False)
    for ours, theirs in worlds[2].run(generate_both, spec, 5):
        assert ours == theirs and len(ours[0]) == 3 + 6

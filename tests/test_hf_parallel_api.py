"""layers.parallelize_hf beyond equivalence: refusals that name the numbers, full state dicts
that load back, and the sharded GPT-2 ``Conv1D``'s tp-invariant initialisation."""

import hashlib

import torch
import transformers  # the hf extra: make test installs it, so a missing one fails

import tensorpar
from hf_cases import batch, build
from tensorpar.sharding import Shard
from tensorpar.testing import count_collectives

LLAMA = dict(vocab_size=19, attn="eager", num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
             hidden_size=8, intermediate_size=6)
GPT2 = dict(vocab_size=19, attn="eager", n_layer=1, n_head=4, n_embd=8, n_positions=8)


def refusals():
    """Each refusal on every rank alike (tp=3), before any collective; returns ``type: message``s."""
    from layers import parallelize_hf

    def attempt(make):
        try:
            make()
        except (TypeError, ValueError) as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    def flex():
        model = build("llama", LLAMA, torch.float32, 0)
        model.config._attn_implementation = "flex_attention"
        parallelize_hf(model)

    def twice():
        parallelize_hf(parallelize_hf(build("llama", LLAMA, torch.float32, 0)))

    def cross_attention():
        parallelize_hf(transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=19, n_layer=1, n_head=3, n_embd=6, n_positions=8, add_cross_attention=True)))

    with count_collectives() as counter:
        messages = [attempt(make) for make in (
            lambda: parallelize_hf(torch.nn.Linear(2, 2)),
            lambda: parallelize_hf(build("gpt2", GPT2, torch.float32, 0).transformer),
            lambda: parallelize_hf(build("llama", dict(LLAMA, num_attention_heads=2, num_key_value_heads=1),
                                         torch.float32, 0)),
            lambda: parallelize_hf(build("gpt2", dict(GPT2, vocab_size=2), torch.float32, 0)),
            lambda: parallelize_hf(build("qwen2", dict(LLAMA, intermediate_size=2), torch.float32, 0)),
            flex, twice, cross_attention)]
    return messages, len(counter.records)


def test_refusals_name_the_model_and_the_numbers(worlds):
    results = worlds[3].run(refusals)
    assert all(r == results[0] for r in results)
    messages, collectives = results[0]
    assert collectives == 0
    linear, bare, heads, vocab, inner, flex, twice, cross = messages
    supported = "supported: GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"
    assert linear == f"TypeError: parallelize_hf does not support Linear (model_type None); {supported}"
    assert bare == f"TypeError: parallelize_hf does not support GPT2Model (model_type 'gpt2'); {supported}"
    assert heads == "ValueError: num_attention_heads (2) is smaller than tp (3)"
    assert vocab == "ValueError: vocab_size (2) is smaller than tp (3)"
    assert inner == "ValueError: intermediate_size (2) is smaller than tp (3)"
    assert flex == "ValueError: parallelize_hf supports attn_implementation 'eager' or 'sdpa', got 'flex_attention'"
    assert twice == "ValueError: this LlamaForCausalLM is already parallelized"
    assert cross == "ValueError: parallelize_hf does not support GPT-2 with add_cross_attention=True"


class RandDropout(torch.overrides.TorchFunctionMode):
    """The dense reference's attention dropout (a 4-D ``F.dropout``, on the probabilities) with the mask
    ``torch.rand(probs.shape) >= p`` (float32 draws); the residual dropouts (3-D) run as they are."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.dropout and args[0].dim() == 4:
            probs, p = args[0], kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            return probs * (torch.rand(probs.shape, device=probs.device) >= p) / (1 - p) if training and p else probs
        return func(*args, **kwargs)


def attention_dropout(arch, spec):
    """A training step with attention dropout (and residual dropout) on the sharded model and on the dense
    model drawing its masks as ``rand >= p`` from the same seed: loss and every gradient, on every rank."""
    import copy

    from layers import parallelize_hf

    dense = build(arch, spec, torch.float64, 0)
    model = parallelize_hf(copy.deepcopy(dense)).train()
    dense.config._attn_implementation = "eager"  # the reference's dropout is an F.dropout the mode sees
    dense.train()
    ids, labels = batch(spec, 2, 6, 0)
    torch.manual_seed(7)
    out = model(ids, labels=labels)
    torch.manual_seed(7)
    with RandDropout():
        ref = dense(ids, labels=labels)
    torch.manual_seed(7)
    no_drop = dense.eval()(ids, labels=labels).loss
    out.loss.backward()
    ref.loss.backward()
    grads = tensorpar.full_grads(model)
    worst = max((grads[k] - p.grad).abs().max().item() for k, p in dense.named_parameters())
    return (out.loss - ref.loss).abs().item(), worst, (ref.loss - no_drop).abs().item()


def test_attention_dropout_draws_the_dense_models_masks(worlds):
    # float64, but Llama's RMSNorm computes in float32: 1e-6 is round-off, a head's wrong mask moves ~1e-1
    gpt2 = dict(GPT2, attn_pdrop=0.3, resid_pdrop=0.1, embd_pdrop=0.1, n_head=3, n_embd=6)
    for arch, spec in (("gpt2", gpt2), ("gpt2", dict(gpt2, attn="sdpa")),
                       ("llama", dict(LLAMA, attn="sdpa", attention_dropout=0.3))):
        for loss_gap, grad_gap, dropped in worlds[3].run(attention_dropout, arch, spec):
            assert loss_gap < 1e-6 and grad_gap < 1e-6, (arch, spec["attn"], loss_gap, grad_gap)
            assert dropped > 1e-3, (arch, dropped)  # the masks changed the loss


def reordered_attention_dropout():
    """GPT-2 with reorder_and_upcast_attn (its own eager path): training with attention dropout raises at
    tp > 1, the same on every rank; evaluation runs."""
    from layers import parallelize_hf

    model = parallelize_hf(build("gpt2", dict(GPT2, attn_pdrop=0.1, reorder_and_upcast_attn=True), torch.float32, 0))
    ids = torch.randint(0, GPT2["vocab_size"], (1, 4))
    try:
        model.train()(ids)
        message = "no error"
    except ValueError as e:
        message = str(e)
    return message, model.eval()(ids).logits.shape


def test_attention_dropout_with_gpt2s_reordered_attention_is_refused(worlds):
    for message, shape in worlds[2].run(reordered_attention_dropout):
        assert message.startswith("attention dropout (attn_pdrop=0.1) in training is not supported by "
                                  "parallelize_hf at tp > 1 with reorder_and_upcast_attn=True")
        assert shape == (1, 4, GPT2["vocab_size"])


def load_back(seed):
    """A dense GPT-2's state dict loaded into another seed's sharded copy gives back that state dict
    and its logits; the fused ``c_attn``'s shard is a piece of each of its three blocks (how a checkpoint holds it)."""
    from layers import parallelize_hf
    from tensorpar.checkpoint.layout import locate

    dense = build("gpt2", GPT2, torch.float64, seed).eval()
    model = parallelize_hf(build("gpt2", GPT2, torch.float64, seed + 1)).eval()
    tensorpar.load_full_state_dict(model, dense.state_dict())
    full, expected = tensorpar.full_state_dict(model), dense.state_dict()
    same = set(full) == set(expected) and all(torch.equal(full[k], v) for k, v in expected.items())
    ids = torch.randint(0, GPT2["vocab_size"], (2, 5))
    with torch.no_grad():
        logits_equal = torch.allclose(model(ids).logits, dense(ids).logits, rtol=1e-12, atol=1e-12)
    c_attn = model.transformer.h[0].attn.c_attn
    pieces = len(locate(c_attn.weight, c_attn.sharding()["weight"], c_attn.tp_group)[1].parts())
    return same, logits_equal, pieces


def test_full_state_dict_loads_back(worlds):
    for same, logits_equal, pieces in worlds[3].run(load_back, 4):
        assert same and logits_equal
        assert pieces == 3  # a checkpoint holds the fused [Q | K | V]'s shard as its piece of each block


def conv1d_digests(seed):
    """Full weights of sharded Conv1Ds built from ``seed``: a fused [Q | K | V] one and a row one."""
    from layers.hf_modules import ColumnParallelConv1D, RowParallelConv1D

    torch.manual_seed(seed)
    column = ColumnParallelConv1D(3 * 12, 12, unit=3, blocks=3)  # 4 heads of 3 in each of Q, K, V
    row = RowParallelConv1D(12, 12, unit=3)
    full = {f"column.{k}": v for k, v in tensorpar.full_state_dict(column).items()}
    full |= {f"row.{k}": v for k, v in tensorpar.full_state_dict(row).items()}
    assert column.sharding()["weight"] == Shard(1, 36, (3, 3, 3))
    return {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in full.items()}, full["column.weight"].std()


def test_conv1d_initialisation_is_the_same_at_every_tp(worlds):
    digests = {tp: worlds[tp].run(conv1d_digests, 3) for tp in (1, 2, 3, 4)}
    expected, std = digests[1][0]
    assert abs(std / 0.02 - 1) < 0.2  # GPT-2's N(0, 0.02²)
    for tp, results in digests.items():
        assert all(digest == expected for digest, _ in results), f"tp={tp}: full weights differ from tp=1"

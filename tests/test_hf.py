"""GPT.from_hf: a randomly initialised Hugging Face GPT-2, sharded, gives HF's logits at tp 1-4."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from layers import GPT
from tensorpar.testing import TOLERANCES, assert_all_close
from tensorpar.testing.strategies import tp_sizes

pytest.importorskip("transformers", reason="the hf extra is not installed")


def check_from_hf(n_layer, n_head, head_dim, vocab, positions, dtype, seed):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_head * head_dim, vocab_size=vocab,
                        n_positions=positions, bos_token_id=0, eos_token_id=0)
    hf = GPT2LMHeadModel(config).to(dtype).eval()
    model = GPT.from_hf(hf)
    idx = torch.randint(0, vocab, (2, positions))
    with torch.no_grad():
        ours, theirs = model(idx), hf(idx).logits
    return max(assert_all_close({"logits": (ours, theirs)}).values()), model.training


@settings(max_examples=12)
@given(tp=tp_sizes(), data=st.data())
def test_from_hf_gives_hugging_face_logits(worlds, tp, data):
    dtype = data.draw(st.sampled_from([torch.float64, torch.float32]))
    args = (data.draw(st.integers(1, 2)), data.draw(st.integers(tp, 4)), data.draw(st.integers(2, 8)),
            data.draw(st.integers(tp, 67)), data.draw(st.integers(max(tp, 2), 9)), dtype,
            data.draw(st.integers(0, 2**31)))
    for err, training in worlds[tp].run(check_from_hf, *args):
        assert err <= TOLERANCES[dtype] and not training


def check_unsupported():
    from transformers import GPT2Config, GPT2LMHeadModel

    hf = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=11, n_positions=4,
                                    activation_function="relu", scale_attn_by_inverse_layer_idx=True))
    messages = []
    for model in (hf, hf.transformer):
        try:
            GPT.from_hf(model)
        except (ValueError, TypeError) as e:
            messages.append(f"{type(e).__name__}: {e}")
    return messages


def test_from_hf_refuses_variants_it_would_compute_differently(worlds):
    variant, headless = worlds[1].run(check_unsupported)[0]
    assert "activation_function='relu'" in variant and "scale_attn_by_inverse_layer_idx=True" in variant
    assert headless.startswith("ValueError") or headless == ("TypeError: from_hf expects a GPT2LMHeadModel "
                                                             "(with its LM head), got GPT2Model")

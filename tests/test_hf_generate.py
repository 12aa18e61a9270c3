"""Parallelized Hugging Face models generate with Hugging Face's own KV cache at tp 2 and 3 and give the
dense model's greedy tokens (GPT-2: heads split unevenly at tp 3; Llama: grouped-query attention, KV heads
split or fewer than the ranks)."""

import copy

import pytest
import torch

import hf_cases

SPECS = {"gpt2": dict(vocab_size=37, attn="sdpa", n_layer=2, n_head=6, n_embd=24, n_positions=16),
         "llama": dict(vocab_size=41, attn="sdpa", num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                       hidden_size=24, intermediate_size=20, tie_word_embeddings=False)}


def generate_both(arch, spec):
    from layers import parallelize_hf

    dense = hf_cases.build(arch, spec, torch.float64, 0).eval()
    model = parallelize_hf(copy.deepcopy(dense))
    ids = torch.randint(1, spec["vocab_size"], (2, 3), generator=torch.Generator().manual_seed(1))
    options = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, use_cache=True)
    return model.generate(ids, **options).tolist(), dense.generate(ids, **options).tolist()


@pytest.mark.parametrize("tp", [2, 3])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hugging_face_cached_generation_gives_the_dense_models_greedy_tokens(worlds, arch, tp):
    for ours, theirs in worlds[tp].run(generate_both, arch, SPECS[arch]):
        assert ours == theirs and len(ours[0]) == 3 + 8

"""The GPT's Llama options (RMSNorm, rotary positions, SwiGLU, grouped-query attention) and their export:
a sharded GPT saved by ``layers.hf.export_hf`` / ``export_llama`` loads into transformers'
``LlamaForCausalLM.from_pretrained`` with our logits and our greedy tokens, at tp 1-3, and reads back
through ``GPT.from_hf`` bitwise; what Llama cannot express is refused, naming the option (generation with
the KV cache at each row's own rotary positions: tests/test_generation.py, which draws these options)."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from layers import GPT, GPTConfig
from layers.hf import export_gpt2, export_hf, export_llama
from tensorpar.testing import TOLERANCES, assert_all_close, count_collectives
from test_hf_export import load_hf

pytest.importorskip("transformers", reason="the hf extra is not installed")

LLAMA = dict(norm="rmsnorm", positions="rope", mlp="swiglu")


@st.composite
def llama_configs(draw, tp):
    """Llama-shaped configs valid at ``tp``: head counts that need not divide by it, fewer KV heads than
    it, even head sizes (rotary pairs), biases or none, Llama's and GPT-2's norm epsilons."""
    n_head = draw(st.integers(tp, 5))
    return dict(LLAMA, n_layer=draw(st.integers(1, 2)), n_head=n_head,
                n_kv_head=draw(st.sampled_from([d for d in range(1, n_head + 1) if n_head % d == 0])),
                n_embd=n_head * draw(st.sampled_from([2, 4, 6])), vocab_size=draw(st.integers(tp, 67)),
                block_size=draw(st.integers(8, 16)), bias=draw(st.booleans()),
                rope_theta=draw(st.sampled_from([10000.0, 500000.0])), norm_eps=draw(st.sampled_from([1e-5, 1e-6])))


def random_state(model, seed):
    """Full weights drawn from ``seed`` alone (the same at every tp), norm scales around 1, the LM head tied."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for key, value in model.full_state_dict().items():
        noise = 0.3 * torch.randn(value.shape, generator=g, dtype=torch.float64).to(value.dtype)
        state[key] = 1 + noise if ".ln_" in key and key.endswith(".weight") else noise
    state["lm_head.weight"] = state["transformer.wte.weight"]
    return state


def check_llama_export(cfg, seed, directory, new):
    """On every rank: export a GPT with random weights, load it with transformers, compare logits, greedy
    tokens and the weights read back."""
    config = GPTConfig(**cfg)
    model = GPT(config).eval()
    state = random_state(model, seed)
    model.load_full_state_dict(state)
    written = export_hf(model, directory)  # Llama's options: a Llama directory
    hf = load_hf(written, "LlamaForCausalLM")
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, config.vocab_size, (2, config.block_size - new), generator=g)
    with torch.no_grad():
        ours, theirs = model(idx), hf(idx).logits  # (B, T, V) each
        hf_tokens = hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=new, do_sample=False,
                                pad_token_id=0)
    our_tokens = model.generate(idx, new, temperature=0)
    back = GPT.from_hf(hf)
    round_trip = back.full_state_dict()
    same = all(torch.equal(round_trip[k], v) for k, v in state.items()) and round_trip.keys() == state.keys()
    architectures = json.loads((Path(directory) / "config.json").read_text())["architectures"]
    # relative to the logits' norm: the same computation, in transformers' order (its RMSNorm and RoPE
    # tables in float32 by other kernels, eager attention): float32 round-off, within float32's 1e-5
    return (assert_all_close({"logits": (theirs, ours)})["logits"], our_tokens.tolist() == hf_tokens.tolist(),
            same, back.config == config, architectures)


@pytest.mark.parametrize("tp", [1, 2, 3])
@settings(max_examples=3)
@given(data=st.data())
def test_exported_llama_gives_our_logits_and_greedy_tokens(worlds, tmp_path_factory, tp, data):
    cfg = data.draw(llama_configs(tp))
    seed, new = data.draw(st.integers(0, 2**31)), data.draw(st.integers(1, 5))
    directory = tmp_path_factory.mktemp("llama") / "out"
    for err, tokens, same, same_config, architectures in worlds[tp].run(check_llama_export, cfg, seed,
                                                                       str(directory), new):
        assert err <= TOLERANCES[torch.float32] and tokens and same and same_config
        assert architectures == ["LlamaForCausalLM"]
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors"]


def test_a_gpt_without_positions_has_no_position_table():
    config = GPTConfig(vocab_size=11, block_size=6, n_layer=1, n_head=2, n_embd=8, **LLAMA)
    plain = dataclasses.replace(config, positions="learned")
    assert config.parameter_count(non_embedding=False) == config.parameter_count()
    assert plain.parameter_count(non_embedding=False) == plain.parameter_count() + 6 * 8
    with pytest.raises(ValueError, match=r"head_dim \(n_embd // n_head = 3\) must be even"):
        GPTConfig(n_head=2, n_embd=6, positions="rope")
    for bad, match in (({"norm": "batchnorm"}, "norm must be one of"), ({"positions": "alibi"}, "positions must"),
                       ({"rope_theta": 0.0}, "rope_theta must be a number > 0"),
                       ({"norm_eps": -1e-6}, "norm_eps must be a number > 0")):
        with pytest.raises(ValueError, match=match):
            GPTConfig(**bad)


def check_refusals(directory):
    """Each refusal alike on every rank, before any collective."""
    messages = []
    small = dict(vocab_size=11, block_size=4, n_layer=1, n_head=4, n_embd=8)
    cases = [(export_llama, GPTConfig(**small)), (export_hf, GPTConfig(**small, positions="rope")),
             (export_gpt2, GPTConfig(**small, **LLAMA))]
    with count_collectives() as counter:
        for export, config in cases:
            try:
                export(GPT(config), directory)
            except ValueError as e:
                messages.append(str(e))
    return messages, len(counter.records), Path(directory).exists()


def test_export_refuses_what_llama_cannot_express(worlds, tmp_path):
    results = worlds[2].run(check_refusals, str(tmp_path / "never"))
    assert results[0] == results[1]
    (gpt2_shaped, rope_with_layernorm, llama_as_gpt2), collectives, written = results[0]
    assert collectives == 0 and not written
    assert gpt2_shaped.startswith("export_llama: GPTConfig fields Llama cannot express")
    for option in ("norm='layernorm' (Llama needs 'rmsnorm')", "positions='learned' (Llama needs 'rope')",
                   "mlp='gelu' (Llama needs 'swiglu')"):
        assert option in gpt2_shaped
    assert "norm='layernorm'" in rope_with_layernorm and "positions" not in rope_with_layernorm
    assert "norm='rmsnorm' (GPT-2 has no such setting; keep 'layernorm')" in llama_as_gpt2
    assert "positions='rope'" in llama_as_gpt2


def test_llama_config_round_trips_through_transformers():
    """The config half alone, no ranks: transformers' own LlamaConfig reads what we write, and from_hf's
    reading of it is the GPT's config; a Llama our GPT cannot compute is refused, naming the setting."""
    from transformers import LlamaConfig

    from layers import hf_llama

    config = GPTConfig(vocab_size=101, block_size=64, n_layer=3, n_head=6, n_kv_head=2, n_embd=48, bias=False,
                       rope_theta=500000.0, norm_eps=1e-6, **LLAMA)
    fields = hf_llama.llama_config(config, torch.bfloat16, eos_token_id=7)
    hf = LlamaConfig(**{k: v for k, v in fields.items() if k not in ("model_type", "architectures")})
    assert hf.intermediate_size == 8 * 48 // 3 and hf.num_key_value_heads == 2 and hf.tie_word_embeddings
    assert GPTConfig(**hf_llama.gpt_config(hf)) == config and hf.eos_token_id == 7
    untied = LlamaConfig(hidden_size=48, num_attention_heads=6, intermediate_size=100, tie_word_embeddings=False)
    with pytest.raises(ValueError, match=r"intermediate_size=100 .*tie_word_embeddings=False"):
        hf_llama.gpt_config(untied)


def test_train_gpt_with_llama_options_exports_a_llama(worlds, monkeypatch, tmp_path):
    """``train_gpt.py --norm rmsnorm --positions rope --mlp swiglu --export-hf DIR`` at tp=2: the directory is
    a LlamaForCausalLM whose logits are those of the final checkpoint's weights in the plain reference."""
    from reference_gpt import RefConfig, RefGPT
    from tensorpar import checkpoint
    from test_examples import line_starting, run_example_on_pool

    out, hf_dir = tmp_path / "run", tmp_path / "hf"
    stdout = run_example_on_pool(worlds, monkeypatch, "train_gpt.py", "--tp", 2, "--steps", 2, "--n-layer", 1,
                                 "--n-head", 2, "--n-embd", 16, "--block-size", 16, "--batch-size", 4,
                                 "--norm", "rmsnorm", "--positions", "rope", "--mlp", "swiglu",
                                 "--sample-tokens", 0, "--no-progress", "--out", out, "--export-hf", hf_dir)
    assert line_starting(stdout, "Hugging Face Llama: ").startswith(f"Hugging Face Llama: {hf_dir} ")
    hf = load_hf(hf_dir, "LlamaForCausalLM")
    plain = RefGPT(RefConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16, bias=False,
                             **LLAMA)).eval()
    plain.load_state_dict(checkpoint.export_state_dict(out))  # the weights the run ended with
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, logits = plain(idx), hf(idx).logits
    assert (logits - expected).norm() <= TOLERANCES[torch.float32] * expected.norm()


def test_gpt2_export_carries_the_norm_epsilon():
    """``norm_eps`` is GPT-2's ``layer_norm_epsilon`` both ways (no ranks: the config half alone)."""
    from transformers import GPT2Config

    from layers.hf import gpt2_config, gpt_config

    config = GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=8, norm_eps=1e-6)
    fields = gpt2_config(config, torch.float32)
    hf = GPT2Config(**{k: v for k, v in fields.items() if k not in ("model_type", "architectures")})
    assert hf.layer_norm_epsilon == 1e-6 and GPTConfig(**gpt_config(hf)) == config

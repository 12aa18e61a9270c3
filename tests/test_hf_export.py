"""layers.hf.export_gpt2: a sharded GPT saved as a Hugging Face GPT-2 directory loads into
``GPT2LMHeadModel.from_pretrained`` with our logits, every key of GPT-2 present, and reads back
through GPT.from_hf bitwise; a GPT without biases (nanoGPT's default) exports with zero biases."""

import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorpar
from layers import GPT, GPTConfig
from layers.hf import export_gpt2, gpt_config
from tensorpar.testing import TOLERANCES, assert_all_close, count_collectives
from tensorpar.testing.strategies import tp_sizes

pytest.importorskip("transformers", reason="the hf extra is not installed")


def random_full_state(model, seed):
    """Full weights drawn from ``seed`` alone (the same on every rank and at every tp), biases and
    LayerNorms included, so that every key's mapping matters; the LM head tied to the embedding."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for key, value in model.full_state_dict().items():
        noise = 0.3 * torch.randn(value.shape, generator=g, dtype=torch.float64).to(value.dtype)
        state[key] = 1 + noise if ".ln_" in key and key.endswith(".weight") else noise  # LayerNorm scales
    state["lm_head.weight"] = state["transformer.wte.weight"]
    return state


def load_hf(directory, architecture="GPT2LMHeadModel"):
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model, info = getattr(transformers, architecture).from_pretrained(directory, local_files_only=True,
                                                                      output_loading_info=True)
    assert not any(info.values()), f"keys transformers did not load as saved: {info}"  # none initialised afresh
    return model


def check_export(cfg, dtype, seed, directory):
    """On every rank: export a GPT with random weights, load it with transformers, compare."""
    config = GPTConfig(**cfg)
    model = GPT(config, dtype=dtype).eval()
    state = random_full_state(model, seed)
    model.load_full_state_dict(state)
    written = export_gpt2(model, directory)
    hf = load_hf(written)  # every rank: from_hf below is a collective over ranks holding the same model
    idx = torch.randint(0, config.vocab_size, (2, config.block_size), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ours, theirs = model(idx), hf(idx).logits  # (B, T, V) each
    back = GPT.from_hf(hf)  # GPT-2 has biases: bias=True, with zeros where ours had none
    round_trip = back.full_state_dict()
    errors = assert_all_close({"logits": (theirs, ours)})
    same = sorted(k for k in state if torch.equal(round_trip[k], state[k]) and round_trip[k].dtype == dtype)
    added = {k: v for k, v in round_trip.items() if k not in state}
    zero_biases = all(k.endswith(".bias") and not v.any() for k, v in added.items()) and bool(added) != config.bias
    return (errors["logits"], hf.dtype, same == sorted(state) and zero_biases,
            replace(back.config, n_kv_head=back.config.kv_heads) == replace(config, n_kv_head=config.kv_heads,
                                                                            bias=True),
            hf.training)


@st.composite
def exportable_configs(draw, tp):
    """GPT-2-shaped configs valid at ``tp``: head counts and vocabularies that need not divide by it."""
    n_head = draw(st.integers(tp, 5))
    return dict(n_layer=draw(st.integers(1, 2)), n_head=n_head, n_embd=n_head * draw(st.integers(2, 6)),
                vocab_size=draw(st.integers(tp, 67)), block_size=draw(st.integers(max(tp, 2), 9)),
                dropout=draw(st.sampled_from([0.0, 0.1])), n_kv_head=draw(st.sampled_from([None, n_head])),
                bias=draw(st.booleans()))


@settings(max_examples=10)
@given(tp=tp_sizes(), data=st.data())
def test_exported_gpt2_gives_our_logits_and_reads_back_bitwise(worlds, tp, data):
    cfg = data.draw(exportable_configs(tp))
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64]))
    seed = data.draw(st.integers(0, 2**31))
    with tempfile.TemporaryDirectory() as tmp:
        results = worlds[tp].run(check_export, cfg, dtype, seed, str(Path(tmp) / "gpt2"))
        assert sorted(p.name for p in (Path(tmp) / "gpt2").iterdir()) == ["config.json", "model.safetensors"]
    for err, hf_dtype, bitwise, same_config, training in results:
        assert err <= TOLERANCES[dtype] and hf_dtype == dtype  # the config's dtype: loaded as saved
        assert bitwise and same_config and not training


def check_trained_export(directory, seed):
    """A bias-free GPT (the training script's default) after a few AdamW steps, exported: transformers'
    logits against the live model's."""
    tensorpar.manual_seed(seed)
    config = GPTConfig(vocab_size=29, block_size=8, n_layer=2, n_head=4, n_embd=16, bias=False)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):  # LayerNorm scales and every matrix move away from their initial values
        idx, targets = torch.randint(0, 29, (2, 2, 8), generator=g)
        model(idx, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    hf = load_hf(export_gpt2(model, directory))
    idx = torch.randint(0, 29, (3, 8), generator=g)
    with torch.no_grad():
        ours, theirs = model(idx), hf(idx).logits  # (B, T, V) each
    biases = {k: v for k, v in hf.state_dict().items() if k.endswith(".bias") and ".attn.bias" not in k}
    moved = not torch.equal(model.full_state_dict()["transformer.h.0.ln_1.weight"], torch.ones(16))
    zeros = all(not v.any() for v in biases.values())
    return assert_all_close({"logits": (theirs, ours)})["logits"], len(biases), zeros, moved


@pytest.mark.parametrize("tp", [1, 2])
def test_a_trained_gpt_without_biases_exports_with_its_logits(worlds, tmp_path, tp):
    for err, biases, zeros, moved in worlds[tp].run(check_trained_export, str(tmp_path / "gpt2"), 4):
        # per block ln_1, c_attn, attn.c_proj, ln_2, c_fc, mlp.c_proj; and ln_f
        assert err <= TOLERANCES[torch.float32] and biases == 2 * 6 + 1 and zeros and moved


def check_dp_export(directory):
    """tp=2 x dp=2: every tp group gathers, global rank 0 writes, every rank returns after it."""
    from safetensors import safe_open

    tensorpar.manual_seed(5)
    model = GPT(GPTConfig(vocab_size=13, block_size=4, n_layer=1, n_head=3, n_embd=9))
    export_gpt2(model, directory, eos_token_id=12)
    hf = load_hf(directory)
    expected = model.full_state_dict()
    got = GPT.from_hf(hf).full_state_dict()
    with safe_open(str(Path(directory) / "model.safetensors"), framework="pt") as f:
        metadata = f.metadata()  # transformers before 4.48.2 refuses a file without {"format": "pt"}
    return all(torch.equal(got[k], v) for k, v in expected.items()), hf.config.eos_token_id, metadata


def test_export_under_data_parallelism_writes_once(worlds, tmp_path):
    for bitwise, eos, metadata in worlds[4].run(check_dp_export, str(tmp_path / "m"), tp=2, dp=2):
        assert bitwise and eos == 12 and metadata == {"format": "pt"}


def check_refusals(directory):
    """Each refusal on every rank alike, before any collective."""
    messages = []
    cases = [GPTConfig(vocab_size=11, block_size=4, n_layer=1, n_head=4, n_embd=8, **kw)
             for kw in ({"mlp": "swiglu"}, {"n_kv_head": 2}, {"sequence_parallel": True, "mlp": "swiglu",
                                                                        "n_kv_head": 1, "bias": False})]
    with count_collectives() as counter:
        for config in cases:
            model = GPT(config)
            try:
                export_gpt2(model, directory)
            except ValueError as e:
                messages.append(str(e))
        for bad in ({"eos_token_id": 11}, {"eos_token_id": -1}):
            try:
                export_gpt2(model, directory, **bad)
            except ValueError as e:
                messages.append(str(e))
        try:
            export_gpt2(torch.nn.Linear(2, 2), directory)
        except TypeError as e:
            messages.append(str(e))
    return messages, len(counter.records), Path(directory).exists()


def test_export_refuses_what_gpt2_cannot_express(worlds, tmp_path):
    results = worlds[2].run(check_refusals, str(tmp_path / "never"))
    assert results[0] == results[1]
    messages, collectives, written = results[0]
    assert collectives == 0 and not written
    swiglu, gqa, both, eos_high, eos_low, not_gpt = messages
    assert "mlp='swiglu' (GPT-2 needs 'gelu')" in swiglu
    assert "n_kv_head=2 (GPT-2 needs None or 4)" in gqa
    assert "mlp='swiglu'" in both and "n_kv_head=1" in both  # bias=False and sequence parallelism export
    assert "bias" not in both and "sequence_parallel" not in both
    assert "eos_token_id must be a token id in [0, 11), got 11" in eos_high and "got -1" in eos_low
    assert not_gpt == "export_gpt2 expects a layers.GPT, got Linear"


def check_unwritable(directory):
    model = GPT(GPTConfig(vocab_size=7, block_size=3, n_layer=1, n_head=2, n_embd=4))
    try:
        export_gpt2(model, directory)
    except (OSError, RuntimeError) as e:
        return type(e).__name__
    return "written"


def test_a_failed_write_fails_every_rank(worlds, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    kinds = worlds[2].run(check_unwritable, str(blocker / "gpt2"))
    assert kinds[0] in ("FileExistsError", "NotADirectoryError") and kinds[1] == "RuntimeError"


def test_exported_config_is_the_one_from_hf_reads():
    """The config half alone, no ranks: a round trip through transformers' own GPT2Config."""
    from transformers import GPT2Config

    from layers.hf import gpt2_config

    config = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768, dropout=0.1)
    fields = gpt2_config(config, torch.bfloat16, eos_token_id=50256)
    hf = GPT2Config(**{k: v for k, v in fields.items() if k not in ("model_type", "architectures")})
    assert GPTConfig(**gpt_config(hf)) == config and hf.eos_token_id == 50256 and hf.dtype == torch.bfloat16

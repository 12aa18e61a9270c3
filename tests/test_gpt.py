"""The sharded GPT against the plain reference GPT in tests/reference_gpt.py, at tp 1-4.

Every example draws a configuration (head counts that do not divide by tp, KV
heads fewer than tp, odd vocabularies, either MLP), builds the reference from a
seed and loads its weights into the sharded model, then compares logits, loss,
every parameter gradient (gathered), of the loss and of the logits, and the parameters after
3 AdamW steps, with and without sequence parallelism.
"""

import hashlib

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorpar
from gpt_cases import batch, gpt_configs, key_bias_drift, note_errors, twins
from layers import GPT, GPTConfig
from tensorpar.testing import TOLERANCES, assert_all_close
from tensorpar.testing.strategies import tp_sizes


def train_twins(cfg, b, t, dtype, seed, steps=3, sequence_parallel=False):
    """Forward, backward and ``steps`` AdamW steps on both twins; the relative errors."""
    ref, model = twins(cfg, dtype, seed, sequence_parallel=sequence_parallel)
    idx, targets = batch(cfg, b, t, seed)
    logits, ref_logits = model(idx), ref(idx)
    # backward through the gathered logits (B, T, V): each rank must keep its own vocabulary slice of the
    # same gradient (a gather whose backward summed over the group would give tp times the gradients)
    probe = torch.randn(ref_logits.shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    (logits * probe).sum().backward()
    (ref_logits * probe).sum().backward()
    logit_grads = tensorpar.full_grads(model)
    ref_logit_grads = {k: p.grad.clone() for k, p in ref.named_parameters()}
    model.zero_grad(), ref.zero_grad()
    loss, ref_loss = model(idx, targets), ref(idx, targets)
    loss.backward()
    ref_loss.backward()
    grads = tensorpar.full_grads(model)
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}
    # AdamW steps by g / (√v + eps): a gradient element at the level of round-off (a few 1e-9 in
    # float32, below the default eps of 1e-8) steps by up to lr, so the round-off, not the gradient,
    # decides the step. eps = 1e-6 in float32 keeps such steps as small as the gradients are.
    eps = 1e-6 if dtype == torch.float32 else 1e-8
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, eps=eps) for m in (model, ref)]
    for step in range(steps):
        if step:  # the first step uses the gradients compared above
            idx2, targets2 = batch(cfg, b, t, seed + step)
            for m, opt in zip((model, ref), opts, strict=True):
                opt.zero_grad()
                m(idx2, targets2).backward()
        for opt in opts:
            opt.step()
    full = model.full_state_dict()
    ref_state = ref.state_dict()
    # every collective is done: compare (a failure is raised on every rank alike)
    if set(grads) != set(ref_grads) or set(full) != set(ref_state):
        raise AssertionError(f"keys differ: {sorted(set(full) ^ set(ref_state))} {sorted(set(grads) ^ set(ref_grads))}")
    # Each gradient is measured against the whole gradient's norm when that is larger: some are
    # zero or nearly so in exact arithmetic (a key bias adds the same amount to every score of a
    # softmax row, so its gradient is identically zero) and hold nothing but round-off.
    scale = torch.cat([g.flatten() for g in ref_grads.values()]).norm().item()
    pairs = {"logits": (logits, ref_logits), "loss": (loss, ref_loss)}
    pairs |= {f"grad {k}": (grads[k], ref_grads[k], scale) for k in ref_grads}
    logit_scale = torch.cat([g.flatten() for g in ref_logit_grads.values()]).norm().item()
    pairs |= {f"logits' grad {k}": (logit_grads[k], g, logit_scale) for k, g in ref_logit_grads.items()}
    # AdamW divides by a gradient's own RMS, so it turns a zero gradient's round-off into steps of
    # up to lr in either direction: the key biases (and with one token, every query and key row) are
    # compared to within that after the steps.
    # It also magnifies the round-off of tiny gradients (float32 configs with a few features have
    # them), so parameters are measured against the whole model's parameter norm when larger.
    drift = key_bias_drift(full, ref_state, cfg, t)
    norm = torch.cat([v.flatten() for v in ref_state.values()]).norm().item()
    pairs |= {f"after {steps} steps {k}": (full[k], ref_state[k], norm) for k in ref_state}
    errors = assert_all_close(pairs, what=f"GPT differs from its reference at tp={tensorpar.current_mesh().tp}")
    if any(d > 2 * steps * 1e-3 for d in drift.values()):
        raise AssertionError(f"key biases moved apart by more than AdamW's steps allow: {drift}")
    digest = hashlib.sha256(logits.detach().numpy().tobytes() + loss.detach().numpy().tobytes()).hexdigest()
    return errors, digest


@st.composite
def gpt_training_cases(draw):
    tp = draw(tp_sizes())
    cfg = draw(gpt_configs(tp))
    t = draw(st.integers(1, cfg["block_size"]))
    return tp, cfg, draw(st.integers(1, 3)), t, draw(st.sampled_from([torch.float64, torch.float32])), \
        draw(st.integers(0, 2**31)), draw(st.booleans(), label="sequence_parallel")


@settings(max_examples=30)
@given(case=gpt_training_cases())
def test_gpt_matches_reference(worlds, case):
    tp, cfg, b, t, dtype, seed, sequence_parallel = case
    results = worlds[tp].run(train_twins, cfg, b, t, dtype, seed, 3, sequence_parallel)
    assert len({digest for _, digest in results}) == 1, "logits or loss differ between tp ranks"
    worst = max(max(errors.values()) for errors, _ in results)
    note_errors(dtype, [worst])
    assert worst <= TOLERANCES[dtype]


def full_weights_digest(cfg, seed):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**cfg))
    full = model.full_state_dict()
    stds = {k: v.std().item() for k, v in full.items() if v.dim() == 2 and v.numel() >= 2000}
    return {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in full.items()}, stds


@settings(max_examples=6)
@given(cfg=gpt_configs(4, max_layer=2), seed=st.integers(0, 2**31))
def test_init_is_bitwise_identical_at_every_tp(worlds, cfg, seed):
    digests = {tp: worlds[tp].run(full_weights_digest, cfg, seed) for tp in (1, 2, 3, 4)}
    for tp, results in digests.items():
        for rank, (digest, _) in enumerate(results):
            assert digest == digests[1][0][0], f"full weights at tp={tp} (rank {rank}) differ from tp=1"


def test_init_follows_gpt2(worlds):
    """nanoGPT's scheme: N(0, 0.02) weights and embeddings, N(0, 0.02/sqrt(2 n_layer)) residual projections."""
    cfg = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, vocab_size=101, block_size=40, bias=True, mlp="gelu")
    (_, stds), *_ = worlds[2].run(full_weights_digest, cfg, 0)
    for key, std in stds.items():
        expected = 0.02 / 2 if key.endswith("c_proj.weight") else 0.02
        assert abs(std / expected - 1) < 0.1, f"{key}: std {std:.4g}, expected {expected:.4g}"


def generate_twins(cfg, seed, temperature, top_k, sequence_parallel=False):
    ref, model = twins(cfg, torch.float64, seed, sequence_parallel=sequence_parallel)
    model.eval()
    ref.eval()
    idx, _ = batch(cfg, 2, 3, seed, ignore=False)
    torch.manual_seed(seed)
    ours = model.generate(idx, cfg["block_size"] + 2, temperature=temperature, top_k=top_k)
    torch.manual_seed(seed)
    theirs = ref.generate(idx, cfg["block_size"] + 2, temperature=temperature, top_k=top_k)
    return ours.tolist(), theirs.tolist()


@settings(max_examples=10)
@given(tp=tp_sizes(), data=st.data())
def test_generate_matches_reference(worlds, tp, data):
    cfg = data.draw(gpt_configs(tp, max_layer=2))
    temperature, top_k = data.draw(st.sampled_from([(0.0, None), (1.0, None), (0.8, 3)]))
    results = worlds[tp].run(generate_twins, cfg, data.draw(st.integers(0, 2**31)), temperature, top_k,
                             data.draw(st.booleans(), label="sequence_parallel"))
    for ours, theirs in results:
        assert ours == theirs == results[0][0]



def check_tie_survives_moves_and_loads():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=11, n_layer=1, n_head=2, n_embd=8, block_size=4)
    model = GPT(cfg)
    full = model.full_state_dict()
    ties = {}
    for name, make in {
        "to(float64)": lambda: GPT(cfg).to(torch.float64),
        "to_empty from meta": lambda: GPT(cfg, device="meta").to_empty(device="cpu"),
        "load_state_dict(assign=True)": lambda: _assigned(GPT(cfg, device="meta"), model.state_dict()),
    }.items():
        m = make()
        ties[name] = m.lm_head.weight is m.transformer.wte.weight and len(list(m.parameters())) == len(
            list(model.parameters()))
    again = GPT(cfg, device="meta")
    again.to_empty(device="cpu")
    again.load_full_state_dict(full)
    ties["full state dict round trip"] = all(torch.equal(v, again.full_state_dict()[k]) for k, v in full.items())
    return ties


def _assigned(model, state):
    model.load_state_dict(state, assign=True)
    return model


def test_lm_head_stays_tied_to_the_token_embedding(worlds):
    for ties in worlds[2].run(check_tie_survives_moves_and_loads):
        assert all(ties.values()), ties

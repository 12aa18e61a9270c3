"""Gradient clipping of sharded models: the norm is the unsharded model's (split parameters summed
over the tp group, replicated ones counted once), whatever the gradients' dtypes, and the clipped
gradients are the unsharded model's clipped ones."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorpar
from gpt_cases import batch, gpt_configs, twins
from layers import ColumnParallelLinear, RowParallelLinear
from tensorpar.testing import TOLERANCES, assert_all_close, rel_error
from tensorpar.testing.strategies import tp_sizes


def clipped_twins(cfg, seed, max_norm):
    """The float64 sharded GPT clipped by us and its unsharded twin by torch, after one backward: our norm,
    torch's, our gathered clipped gradients, the twin, and the norm of its clipped gradients."""
    ref, model = twins(cfg, torch.float64, seed)
    idx, targets = batch(cfg, 2, cfg["block_size"], seed)
    model(idx, targets).backward()
    ref(idx, targets).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    norm = tensorpar.clip_grad_norm_(model, max_norm)
    clipped = torch.cat([p.grad.flatten() for p in ref.parameters()]).norm().item()  # see test_gpt: zero grads
    return norm, expected, tensorpar.full_grads(model), ref, clipped


def norm_twins(cfg, seed):
    """The sharded GPT's global gradient norm and clipped gradients against the plain twin's."""
    norm, expected, grads, ref, scale = clipped_twins(cfg, seed, 0.1)
    pairs = {"norm": (norm.double(), expected)}
    pairs |= {k: (grads[k], p.grad, scale) for k, p in ref.named_parameters()}
    return max(assert_all_close(pairs, rtol=TOLERANCES[torch.float64]).values())  # float64, as torch's


@settings(max_examples=10)
@given(tp=tp_sizes(), data=st.data())
def test_clipping_uses_the_unsharded_gradient_norm(worlds, tp, data):
    cfg = data.draw(gpt_configs(tp, max_layer=2))
    assert max(worlds[tp].run(norm_twins, cfg, data.draw(st.integers(0, 2**31)))) <= TOLERANCES[torch.float64]


def float64_clipping(cfg, seed):
    """Both norms' dtypes, and the relative errors of our norm and of every clipped gradient (against the
    clipped gradients' norm)."""
    norm, expected, grads, ref, clipped = clipped_twins(cfg, seed, 0.01)
    errors = [rel_error(grads[k], p.grad, clipped) for k, p in ref.named_parameters()]
    return norm.dtype, expected.dtype, rel_error(norm, expected), max(errors)


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_a_float64_model_is_clipped_in_float64_as_torch_clips_it(worlds, tp):
    """torch's ``clip_grad_norm_`` of float64 gradients returns a float64 norm and scales by a float64
    factor: so do we (a norm taken in float32 was off by about 1e-7, and so were the clipped gradients)."""
    cfg = dict(n_layer=2, n_head=3, n_kv_head=1, n_embd=12, vocab_size=13, block_size=5, bias=True, mlp="gelu")
    for dtype, torch_dtype, norm_error, grad_error in worlds[tp].run(float64_clipping, cfg, 5):
        assert dtype == torch_dtype == torch.float64
        assert norm_error <= TOLERANCES[torch.float64] and grad_error <= TOLERANCES[torch.float64], (norm_error,
                                                                                                     grad_error)


def clipping_on_both_sides_of_the_limit(cfg, seed):
    """A limit above the gradient norm leaves every gradient as it is, bit for bit; one below scales
    them to it, as ``torch.nn.utils.clip_grad_norm_`` scales the plain twin's."""
    ref, model = twins(cfg, torch.float64, seed)
    idx, targets = batch(cfg, 2, cfg["block_size"], seed)
    model(idx, targets).backward()
    ref(idx, targets).backward()
    norm = torch.cat([p.grad.flatten() for p in ref.parameters()]).norm().item()
    before = {k: p.grad.clone() for k, p in model.named_parameters()}
    below = tensorpar.clip_grad_norm_(model, 2 * norm)
    unchanged = [k for k, p in model.named_parameters() if torch.equal(p.grad, before[k])]
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), norm / 4)
    above = tensorpar.clip_grad_norm_(model, norm / 4)
    grads = tensorpar.full_grads(model)
    clipped = torch.cat([p.grad.flatten() for p in ref.parameters()]).norm().item()
    pairs = {"norm below the limit": (below.double(), torch.tensor(norm, dtype=torch.float64)),
             "norm above the limit": (above.double(), expected)}
    pairs |= {k: (grads[k], p.grad, clipped) for k, p in ref.named_parameters()}
    errors = assert_all_close(pairs, rtol=TOLERANCES[torch.float64])
    return sorted(unchanged) == sorted(before), max(errors.values()), clipped / norm


def test_clipping_changes_nothing_below_the_limit_and_scales_to_it_above(worlds):
    cfg = dict(n_layer=1, n_head=2, n_kv_head=1, n_embd=8, vocab_size=13, block_size=5, bias=True, mlp="gelu")
    for unchanged, err, ratio in worlds[2].run(clipping_on_both_sides_of_the_limit, cfg, 7):
        assert unchanged and err <= TOLERANCES[torch.float64] and abs(ratio - 0.25) <= 1e-6


def mixed_dtype_layers():
    """A column-parallel layer in bfloat16, a row-parallel one in float64 and a replicated LayerNorm in
    float32: gradients that the norm takes in several buckets, at every tp."""
    return torch.nn.ModuleDict(dict(up=ColumnParallelLinear(6, 10, dtype=torch.bfloat16),
                                    down=RowParallelLinear(10, 5, dtype=torch.float64), ln=torch.nn.LayerNorm(7)))


def mixed_dtype_clipping(seed):
    """Our norm and clipped gradients against those of given full gradients (the same on every rank)."""
    model, holder = mixed_dtype_layers(), mixed_dtype_layers()
    generator = torch.Generator().manual_seed(seed)
    full = {k: torch.randn(v.shape, generator=generator).to(v.dtype)
            for k, v in tensorpar.full_state_dict(model).items()}
    tensorpar.load_full_state_dict(holder, full)  # this rank's shard (or copy) of each full gradient
    for p, grad in zip(model.parameters(), holder.parameters(), strict=True):
        p.grad = grad.detach().clone()
    expected = torch.linalg.vector_norm(torch.stack([g.double().norm() for g in full.values()]))
    norm = tensorpar.clip_grad_norm_(model, expected.item() / 2)
    clipped = tensorpar.full_grads(model)
    # the norm is float64 (a gradient is), the bfloat16 part of it accumulated in float32; clipped bfloat16
    # gradients are rounded to bfloat16 (2^-8)
    errors = assert_all_close({"norm": (norm.double(), expected)}, rtol=1e-6)
    for k, g in clipped.items():
        errors |= assert_all_close({k: (g.double(), full[k].double() / 2)}, rtol=1e-2 if k.startswith("up.") else 1e-6)
    return errors


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_clipping_takes_gradients_of_several_dtypes_at_once(worlds, tp):
    errors = worlds[tp].run(mixed_dtype_clipping, tp)
    assert all(e["norm"] <= 1e-6 for e in errors)


def clip_like_torch(case):
    """Our clipping of the sharded GPT and torch's of the plain twin, after the same backward, with a NaN
    or an infinity put into a replicated gradient (ln_f's, held whole by every rank) or none:
    (norms, clipped gradients) of both, or the errors both raise (and whether the gradients kept still)."""
    cfg = dict(n_layer=1, n_head=2, n_kv_head=2, n_embd=8, vocab_size=16, block_size=4, bias=True, mlp="gelu")
    ref, model = twins(cfg, torch.float64, 0)
    idx, targets = batch(cfg, 2, 4, 0)
    model(idx, targets).backward()
    ref(idx, targets).backward()
    bad, max_norm, error_if_nonfinite = case
    if bad is not None:
        model.transformer.ln_f.weight.grad[1] = bad
        ref.transformer.ln_f.weight.grad[1] = bad
    before = {k: g.clone() for k, g in tensorpar.full_grads(model).items()}
    outcome = {}
    for name, clip in (("ours", lambda: tensorpar.clip_grad_norm_(model, max_norm,
                                                                  error_if_nonfinite=error_if_nonfinite)),
                       ("torch", lambda: torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm,
                                                                        error_if_nonfinite=error_if_nonfinite))):
        try:
            outcome[name] = float(clip())
        except (RuntimeError, ValueError) as e:
            outcome[name] = f"{type(e).__name__}: {e}"
    grads = tensorpar.full_grads(model)
    kept = all(torch.equal(before[k].nan_to_num(), g.nan_to_num()) for k, g in grads.items())
    ref_grads = {k: p.grad for k, p in ref.named_parameters()} | {"lm_head.weight": ref.transformer.wte.weight.grad}
    same = all(torch.allclose(g, ref_grads[k], rtol=1e-6, atol=1e-12, equal_nan=True) for k, g in grads.items())
    return outcome, same, kept


def test_clipping_matches_torch_on_non_finite_gradients_and_refuses_a_negative_max_norm(worlds):
    nan, inf = float("nan"), float("inf")
    cases = {"nan": (nan, 1.0, False), "inf": (inf, 1.0, False), "zero max_norm": (None, 0.0, False),
             "nan, error": (nan, 1.0, True), "inf, error": (inf, 1.0, True), "finite, error": (None, 0.1, True),
             "negative max_norm": (None, -1.0, False), "nan max_norm": (None, nan, False)}
    for name, case in cases.items():
        results = worlds[2].run(clip_like_torch, case)
        assert str(results[0]) == str(results[1]), results  # the same on every rank (str: NaN != NaN)
        outcome, same, kept = results[0]
        ours, theirs = outcome["ours"], outcome["torch"]
        if name in ("nan", "inf"):  # the norm is torch's, and so are the gradients: NaN, or 0 and NaN
            assert str(ours) == str(theirs) == name and same and not kept
        elif name.endswith(", error") and name != "finite, error":
            assert theirs.startswith("RuntimeError: The total norm of order 2") and kept, outcome
            assert ours == (f"RuntimeError: clip_grad_norm_: the total norm of the gradients is {name[:3]}, not "
                            "finite, so it cannot be clipped (error_if_nonfinite=False scales the gradients by it "
                            "anyway)")
        elif name.endswith("max_norm") and name != "zero max_norm":
            assert ours == (f"ValueError: clip_grad_norm_: max_norm must be a number >= 0, got {case[1]} (a negative "
                            "one would flip the gradients)") and kept
        else:  # zero max_norm zeroes the gradients; a finite norm passes error_if_nonfinite
            assert abs(ours - theirs) <= 1e-6 * theirs and same and not kept

"""Gradient clipping of sharded models: the norm is the unsharded model's (split parameters summed
over the tp group, replicated ones counted once), whatever the gradients' dtypes, and the clipped
gradients are the unsharded model's clipped ones."""

import pytest
import torch
from gpt_cases import batch, gpt_configs, twins
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorpar
from layers import ColumnParallelLinear, RowParallelLinear
from tensorpar.testing import assert_all_close
from tensorpar.testing.strategies import tp_sizes


def norm_twins(cfg, seed):
    """The sharded GPT's global gradient norm and clipped gradients against the plain twin's."""
    ref, model = twins(cfg, torch.float64, seed)
    idx, targets = batch(cfg, 2, cfg["block_size"], seed)
    model(idx, targets).backward()
    ref(idx, targets).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    norm = tensorpar.clip_grad_norm_(model, 0.1)
    grads = tensorpar.full_grads(model)
    scale = torch.cat([p.grad.flatten() for p in ref.parameters()]).norm().item()  # see test_gpt: zero grads
    pairs = {"norm": (norm.double(), expected)}
    pairs |= {k: (grads[k], p.grad, scale) for k, p in ref.named_parameters()}
    return max(assert_all_close(pairs, rtol=1e-6).values())  # the norm is accumulated in float32


@settings(max_examples=10)
@given(tp=tp_sizes(), data=st.data())
def test_clipping_uses_the_unsharded_gradient_norm(worlds, tp, data):
    cfg = data.draw(gpt_configs(tp, max_layer=2))
    assert max(worlds[tp].run(norm_twins, cfg, data.draw(st.integers(0, 2**31)))) <= 1e-6


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
    for p, grad in zip(model.parameters(), holder.parameters()):
        p.grad = grad.detach().clone()
    expected = torch.linalg.vector_norm(torch.stack([g.double().norm() for g in full.values()]))
    norm = tensorpar.clip_grad_norm_(model, expected.item() / 2)
    clipped = tensorpar.full_grads(model)
    # the norm is accumulated in float32; clipped bfloat16 gradients are rounded to bfloat16 (2^-8)
    errors = assert_all_close({"norm": (norm.double(), expected)}, rtol=1e-6)
    for k, g in clipped.items():
        errors |= assert_all_close({k: (g.double(), full[k].double() / 2)}, rtol=1e-2 if k.startswith("up.") else 1e-6)
    return errors


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_clipping_takes_gradients_of_several_dtypes_at_once(worlds, tp):
    errors = worlds[tp].run(mixed_dtype_clipping, tp)
    assert all(e["norm"] <= 1e-6 for e in errors)

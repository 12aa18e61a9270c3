"""The module tree is honest: every submodule of a sharded GPT runs as a module (its forward hooks
fire), so wrapping one changes the model as it would change the dense twin.

The adapter below is a LoRA-style low-rank term around a projection. On the dense twin it is three
``nn.Linear``\\ s; on the sharded model the base is the sharded ``c_attn`` (Q, K and V in one), the
up-projection is split like it (its ``[Q | K | V]`` blocks, and with fewer KV heads than ranks its
K and V rows held whole), and the down-projection is replicated (its gradient, partial on each rank, is summed
like any replicated weight inside the tensor-parallel region).
"""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tensorpar
from gpt_cases import batch, gpt_configs, twins
from layers import ColumnParallelLinear, ReplicatedLinear
from tensorpar.testing import assert_all_close
from tensorpar.testing.strategies import tp_sizes

CONTAINERS = (nn.ModuleDict, nn.ModuleList)  # hold modules, have no forward of their own


def count_hook_calls(cfg, seed):
    """How many times each submodule's forward hooks fire in one forward with a loss, and one without."""
    _, model = twins(cfg, torch.float32, seed)
    idx, targets = batch(cfg, 2, cfg["block_size"], seed)
    calls = {}

    def hook(module, args, output, name):
        calls[name] = calls.get(name, 0) + 1

    names = [name for name, m in model.named_modules() if not isinstance(m, CONTAINERS)]
    for name in names:
        model.get_submodule(name).register_forward_hook(lambda m, a, o, name=name: hook(m, a, o, name))
    model(idx, targets).backward()
    with_loss, calls = calls, {}
    model(idx)
    return names, with_loss, calls


@settings(max_examples=8)
@given(tp=tp_sizes(), data=st.data())
def test_every_submodule_of_the_gpt_runs_once_per_forward(worlds, tp, data):
    cfg = data.draw(gpt_configs(tp, max_layer=2))
    for names, with_loss, without in worlds[tp].run(count_hook_calls, cfg, data.draw(st.integers(0, 2**31))):
        assert "transformer.h.0.attn.c_attn" in names and "transformer.h.0.attn.copy_in" in names
        for calls in (with_loss, without):
            assert calls == dict.fromkeys(names, 1), {n: calls.get(n, 0) for n in names if calls.get(n) != 1}


class LowRank(nn.Module):
    """``base(x) + scale * up(down(x))``: a LoRA-style adapter around a linear module."""

    def __init__(self, base, down, up, scale=0.5):
        super().__init__()
        self.base, self.down, self.up, self.scale = base, down, up, scale

    def forward(self, x):
        return self.base(x) + self.scale * self.up(self.down(x))


def check_adapter(cfg, rank, seed):
    """The same adapter around block 0's c_attn of the dense twin and of the sharded GPT."""
    ref, model = twins(cfg, torch.float64, seed)
    idx, targets = batch(cfg, 2, cfg["block_size"], seed)
    unadapted = model(idx).detach()
    c = cfg["n_embd"]
    torch.manual_seed(seed + 1)
    dense_attn, attn = ref.transformer.h[0].attn, model.transformer.h[0].attn
    out = dense_attn.c_attn.out_features  # [Q | K | V]
    down, up = nn.Linear(c, rank, bias=False, dtype=torch.float64), nn.Linear(rank, out, dtype=torch.float64)
    dense_attn.c_attn = LowRank(dense_attn.c_attn, down, up)
    sharded_down = ReplicatedLinear(c, rank, bias=False, dtype=torch.float64)
    sharded_down.load_state_dict(down.state_dict())
    sharded_up = ColumnParallelLinear.from_linear(up, copy_input=False, unit=attn.c_attn.unit,  # split like c_attn
                                                  replicated=attn.c_attn.placement.replicated)
    attn.c_attn = LowRank(attn.c_attn, sharded_down, sharded_up)

    loss, ref_loss = model(idx, targets), ref(idx, targets)
    loss.backward()
    ref_loss.backward()
    logits, ref_logits = model(idx), ref(idx)
    grads = tensorpar.full_grads(model)
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}
    if set(grads) != set(ref_grads):
        raise AssertionError(f"gradient keys differ: {sorted(set(grads) ^ set(ref_grads))}")
    scale = torch.cat([g.flatten() for g in ref_grads.values()]).norm().item()  # see test_gpt: zero grads
    pairs = {"logits": (logits, ref_logits), "loss": (loss, ref_loss)}
    pairs |= {f"grad {k}": (grads[k], ref_grads[k], scale) for k in ref_grads}
    errors = assert_all_close(pairs)
    return max(errors.values()), tensorpar.testing.rel_error(logits, unadapted)


@settings(max_examples=8)
@given(tp=tp_sizes(), data=st.data())
def test_an_adapter_around_c_attn_matches_the_same_adapter_on_the_dense_twin(worlds, tp, data):
    cfg = data.draw(gpt_configs(tp, max_layer=2))
    for err, change in worlds[tp].run(check_adapter, cfg, data.draw(st.integers(1, 4)),
                                      data.draw(st.integers(0, 2**31))):
        assert err <= 1e-10 and change > 1e-8  # equal to the dense twin's, and the adapter did something

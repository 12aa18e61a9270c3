"""Attention, MLP and Block against their plain twins in tests/reference_gpt.py.

Each sharded module is loaded with the reference's weights and compared with
``assert_sharded_equivalent``: output, input gradient and every parameter
gradient, in float64, float32 and bfloat16, at tp 1-4.
"""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference_gpt as ref
import tensorpar
from gpt_cases import gpt_configs
from layers import Block, ColumnParallelLinear, CopyToTP, GPTConfig, ParallelMLP, ParallelSelfAttention
from layers.rotary import RotaryEmbedding
from tensorpar.testing import TOLERANCES, assert_all_close, assert_sharded_equivalent, count_collectives
from tensorpar.testing.strategies import dtypes, tp_sizes


def sharded_twin(kind, cfg, dtype):
    cfg = cfg | {"block_size": max(cfg["block_size"], 64)}  # a module alone takes any length: rotary angles for 64
    c = GPTConfig(**cfg)
    if kind == "attention":
        dense = ref.CausalSelfAttention(ref.RefConfig(**cfg))
        rotary = RotaryEmbedding(c.n_embd // c.n_head, c.block_size, c.rope_theta, dtype=dtype) \
            if c.positions == "rope" else None
        sharded = ParallelSelfAttention(c.n_embd, c.n_head, n_kv_head=c.kv_heads, bias=c.bias, rotary=rotary,
                                        dtype=dtype)
    elif kind == "mlp":
        dense = ref.MLP(ref.RefConfig(**cfg))
        sharded = ParallelMLP(c.n_embd, c.mlp_hidden, activation=c.mlp, bias=c.bias, dtype=dtype)
    else:
        dense = ref.Block(ref.RefConfig(**cfg))
        sharded = Block(c, dtype=dtype)
    dense = dense.to(dtype)
    tensorpar.load_full_state_dict(sharded, dense.state_dict())
    return sharded, dense


def check_module(kind, cfg, b, t, dtype, seed):
    torch.manual_seed(seed)
    sharded, dense = sharded_twin(kind, cfg, dtype)
    x = torch.randn(b, t, cfg["n_embd"], dtype=dtype)
    return max(assert_sharded_equivalent(sharded, dense, x, seed=seed).values())


@settings(max_examples=40)
@given(tp=tp_sizes(), kind=st.sampled_from(["attention", "mlp", "block"]), dtype=dtypes(), data=st.data())
def test_modules_match_their_plain_twins(worlds, tp, kind, dtype, data):
    cfg = data.draw(gpt_configs(tp, max_layer=1))
    if dtype == torch.bfloat16:  # enough elements for a norm-wise bf16 bound to mean something (see test_linear)
        head_dim = data.draw(st.integers(-(-16 // cfg["n_head"]), 16))
        cfg |= dict(n_embd=cfg["n_head"] * (head_dim + head_dim % 2 if cfg["positions"] == "rope" else head_dim))
        b, t = data.draw(st.integers(2, 3)), data.draw(st.integers(8, 12))
    else:
        b, t = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 12))
    errors = worlds[tp].run(check_module, kind, cfg, b, t, dtype, data.draw(st.integers(0, 2**31)))
    assert max(errors) <= TOLERANCES[dtype]


def check_attention_layout(n_embd, n_head, n_kv_head):
    attn = ParallelSelfAttention(n_embd, n_head, n_kv_head=n_kv_head)
    return attn.local_heads, attn.local_kv_heads, attn.kv_replicated, tuple(attn.c_attn.weight.shape)


def test_heads_are_split_whole_and_balanced(worlds):
    """12 heads of 8 over tp=4 (3 each); 6 heads over tp=4 (2, 2, 1, 1); 1 KV head at tp 4: replicated."""
    assert [r[0] for r in worlds[4].run(check_attention_layout, 96, 12, 12)] == [3, 3, 3, 3]
    assert worlds[4].run(check_attention_layout, 48, 6, 6) == [
        (2, 2, False, (48, 48)), (2, 2, False, (48, 48)), (1, 1, False, (24, 48)), (1, 1, False, (24, 48))]
    # grouped-query, 8 heads in 4 groups of 2 over 3 ranks: whole groups, 2 + 1 + 1
    assert [r[:3] for r in worlds[3].run(check_attention_layout, 32, 8, 4)] == [(4, 2, False), (2, 1, False),
                                                                                  (2, 1, False)]
    # multi-query over 4 ranks: query heads split alone, the single KV head held by all (c_attn: [Q_r | K | V])
    assert worlds[4].run(check_attention_layout, 32, 8, 1) == [(2, 1, True, (16, 32))] * 4


def check_linears(n_in, outs, used, seed):
    """Several column-parallel layers behind one shared f, some outputs unused, against nn.Linear."""
    torch.manual_seed(seed)
    dense = [torch.nn.Linear(n_in, o, dtype=torch.float64) for o in outs]
    sharded = [ColumnParallelLinear.from_linear(d, copy_input=False) for d in dense]
    x = torch.randn(2, 3, n_in, dtype=torch.float64)
    x_dense, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    with count_collectives() as counts:
        shared = CopyToTP()(x_ours)
        ys = [s(shared) for s in sharded]
        full = [tensorpar.gather_from_tp(y, -1, o) for y, o in zip(ys, outs, strict=True)]
        sum(f.pow(2).sum() * (i + 1) for i, f in enumerate(full) if used[i]).backward()
    sum(d(x_dense).pow(2).sum() * (i + 1) for i, d in enumerate(dense) if used[i]).backward()
    pairs = {"input grad": (x_ours.grad, x_dense.grad)}
    for i, (s, d) in enumerate(zip(sharded, dense, strict=True)):
        grads = tensorpar.full_grads(s)
        if used[i]:
            pairs |= {f"{i} {k}": (grads[k], p.grad) for k, p in d.named_parameters()}
        elif grads:
            raise AssertionError(f"map {i} is unused but got gradients {sorted(grads)}")
    return max(assert_all_close(pairs).values()), counts.count("all_reduce", "backward")


@settings(max_examples=12)
@given(tp=tp_sizes(), data=st.data())
def test_column_parallel_layers_share_one_f(worlds, tp, data):
    n = data.draw(st.integers(1, 3))
    outs = [data.draw(st.integers(tp, 12)) for _ in range(n)]
    used = data.draw(st.lists(st.booleans(), min_size=n, max_size=n).filter(any))
    for err, reduces in worlds[tp].run(check_linears, data.draw(st.integers(1, 8)), outs, used,
                                       data.draw(st.integers(0, 2**31))):
        assert err <= 1e-10 and reduces == (tp > 1)

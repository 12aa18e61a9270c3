"""Bitwise mode: at every tp of the mode a model computes exactly what it computes at tp = 1.

Every comparison here is ``torch.equal`` between a run on the pool's world of one and the same run
on a world of tp ranks, both in bitwise mode: the layers (float64, float32, bfloat16 weights), the
GPT (float32 and bfloat16 autocast; uneven heads and vocabularies, fewer KV heads than ranks, dropout,
sequence parallelism, activation checkpointing) through the logits, the loss, every gradient, the
clipped gradient norm and the parameters and AdamW state after steps, and the training script's logged
losses and gradient norms. The same cases without the mode are not all equal (so the mode, not luck,
makes them equal), and the mode at tp = 1 still equals the plain reference GPT to within round-off.
"""

import math
import os

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import hf_cases
import tensorpar
from gpt_cases import batch, gpt_configs, twins
from layers import (
    GPT,
    ColumnParallelLinear,
    GPTConfig,
    HeadRow,
    ParallelMLP,
    ParallelSelfAttention,
    QKVColumn,
    RowParallelLinear,
    Segmentwise,
    parallelize,
    parallelize_hf,
)
from layers.numerics import SegmentedColumn
from tensorpar.bitwise import Bitwise, SegmentTree, layouts
from tensorpar.bitwise.segments import PlacedTree, placed_split
from tensorpar.bitwise.tree_sum import tree_sum
from tensorpar.sharding import Shard
from tensorpar.testing import TOLERANCES, assert_all_close
from test_parallelize import NanoBlock
from test_training import SCRIPT, SMALL, flags, metrics

# ---------------------------------------------------------------- segments and the tree


def test_segments_are_cut_wherever_a_shard_at_any_tp_ends():
    """Pinned: the cuts of 12 and 10 features over tp 1-4, the tree's nodes, and how many partial sums
    each rank sends (one per rank at tp 2 and 4 where the shards nest, more at tp 3)."""
    def tree(size, tp_sizes=(1, 2, 3, 4)):
        return SegmentTree.build(size, layouts(Shard(0, size).pieces, tp_sizes))

    twelve = tree(12)
    assert twelve.segments == ((0, 3), (3, 1), (4, 2), (6, 2), (8, 1), (9, 3))
    assert twelve.nodes == {(0, 6), (0, 3), (3, 6), (1, 3), (3, 5)}  # halves and the quarters inside them
    assert [twelve.children(n) for n in [(0, 6), (0, 3), (1, 3)]] == [((0, 3), (3, 6)), ((0, 1), (1, 3)),
                                                                        ((1, 2), (2, 3))]
    sent = {tp: [len(PlacedTree.place(twelve, layouts(Shard(0, 12).pieces, [tp])[tp], r).sent[r])
                 for r in range(tp)] for tp in (1, 2, 3, 4)}
    assert sent == {1: [0], 2: [1, 1], 3: [2, 2, 2], 4: [1, 1, 1, 1]}
    assert tree(10).segments == ((0, 3), (3, 1), (4, 1), (5, 1), (6, 1), (7, 1), (8, 2))
    assert tree(10, (1, 2, 4)).segments == ((0, 3), (3, 2), (5, 1), (6, 2), (8, 2))  # no tp 3: fewer cuts
    assert tree(1).segments == ((0, 1),) and tree(1).children((0, 1)) == ()
    with pytest.raises(ValueError, match="does not start and end on a segment cut"):
        twelve.segments_of([(0, 5)])


def sum_by_tree(size, tp_sizes):
    """The tree sum of rows of a fixed random matrix, one partial sum per segment, on this rank."""
    rank, tp = tensorpar.group_rank_size(tensorpar.tp_group())
    placed = placed_split(Shard(0, size).pieces, size, tp, rank, tp_sizes)
    x = torch.randn(size, 5, generator=torch.Generator().manual_seed(size))
    return tree_sum(lambda s: x.narrow(0, *placed.tree.segments[s]).sum(0), placed, tensorpar.tp_group(), (5,), x)


def fold(size, tp_sizes):
    """The same sum, by the tree, computed here from the tree's description alone."""
    tree = SegmentTree.build(size, layouts(Shard(0, size).pieces, tp_sizes))
    x = torch.randn(size, 5, generator=torch.Generator().manual_seed(size))

    def value(node):
        lo, hi = node
        if hi - lo == 1:
            return x.narrow(0, *tree.segments[lo]).sum(0)
        children = [value(c) for c in tree.children(node)]
        total = children[0]
        for c in children[1:]:
            total = total + c
        return total

    return value(tree.root)


@pytest.mark.parametrize("size", [12, 10, 7, 97])
def test_the_tree_sum_is_the_trees_fold_on_every_rank_at_every_tp(worlds, size):
    expected = fold(size, (1, 2, 3, 4))
    for tp in (1, 2, 3, 4):
        for got in worlds[tp].run(sum_by_tree, size, (1, 2, 3, 4)):
            assert torch.equal(got, expected), (size, tp)


# ---------------------------------------------------------------- the setting


def init_with(bitwise):
    tensorpar.init(tp=2)
    enabled = tensorpar.bitwise.enable(bitwise)
    built = ColumnParallelLinear(4, 6)
    return enabled, tensorpar.current_bitwise(), isinstance(built.product, SegmentedColumn), torch.get_num_threads()


def test_enable_sets_the_mode_checks_it_and_compares_it_across_ranks(worlds):
    assert Bitwise.of(True) == Bitwise() == Bitwise(tp_sizes=[4, 2, 3, 1, 2]) and Bitwise.of(False) is None
    assert Bitwise.of((1, 2, 4, 8)).tp_sizes == (1, 2, 4, 8)
    for bad, error in [((), TypeError), ((0, 2), ValueError), ((1, True), TypeError), ("12", TypeError)]:
        with pytest.raises(error):
            Bitwise(tp_sizes=bad)
    with pytest.raises(TypeError, match="bitwise must be a bool"):
        Bitwise.of(2)
    enabled, current, segmented, threads = worlds[2].run(init_with, Bitwise(threads=1), mesh=False)[0]
    assert enabled == current == Bitwise() and segmented and threads == 1
    assert worlds[2].run(init_with, False, mesh=False)[0][:3] == (None, None, False)  # off: the default product
    with pytest.raises(tensorpar.RankError, match=r"tp=2 is not one of them: pass bitwise=Bitwise\(tp_sizes="):
        worlds[2].run(init_with, (1, 4), mesh=False)


def init_per_rank(first, others):
    tensorpar.init(tp=2)
    tensorpar.bitwise.enable(first if os.environ["RANK"] == "0" else others)


def test_ranks_that_disagree_on_the_mode_all_raise(worlds):
    disagree = r"different bitwise modes \(rank 0: tp sizes \[1, 2, 3, 4\], threads 1; rank 1: off\)"
    with pytest.raises(tensorpar.RankError, match=disagree):
        worlds[2].run(init_per_rank, True, False, mesh=False)
    # a mode that leaves out tp 2 on rank 0 alone: both ranks raise the disagreement, neither waits for the other
    with pytest.raises(tensorpar.RankError, match=r"different bitwise modes \(rank 0: tp sizes \[1, 4\]"):
        worlds[2].run(init_per_rank, (1, 4), True, mesh=False)


# ---------------------------------------------------------------- layers


def layer_run(kind, sizes, b, dtype, seed, sequence_parallel):
    """A layer built from ``seed`` in the current mode, run forward and backward on fixed inputs: its
    output, input gradient and full parameter gradients (full tensors, the same on every rank)."""
    rank, tp = tensorpar.group_rank_size(tensorpar.tp_group())
    torch.manual_seed(seed)
    c, h, n_kv = sizes
    if kind == "mlp":
        module = ParallelMLP(c, h, activation="swiglu" if n_kv else "gelu", sequence_parallel=sequence_parallel,
                             dtype=dtype)
    elif kind == "attention":
        module = ParallelSelfAttention(c, h, n_kv_head=n_kv, sequence_parallel=sequence_parallel, dtype=dtype)
    else:
        module = torch.nn.Sequential(ColumnParallelLinear(c, h, dtype=dtype), RowParallelLinear(h, c, dtype=dtype))
    t = 7
    g = torch.Generator().manual_seed(seed + 1)
    x, gy = (torch.randn(b, t, c, generator=g).to(dtype) for _ in range(2))
    if sequence_parallel:
        sizes_t = tensorpar.sequence_sizes(t, tp)
        lo = sum(sizes_t[:rank])
        x, gy = (z[:, lo:lo + sizes_t[rank]].contiguous() for z in (x, gy))
    x.requires_grad_()
    y = module(x, t) if sequence_parallel else module(x)
    y.backward(gy)
    out = {"y": y.detach(), "x.grad": x.grad}
    if sequence_parallel:
        out = {k: tensorpar.all_gather(v.contiguous(), 1, t) for k, v in out.items()}
    return out | {f"grad {k}": v for k, v in tensorpar.full_grads(module).items()}


def differing(a, b):
    return sorted(k for k in a if not torch.equal(a[k], b[k]))


@settings(max_examples=12)
@given(kind=st.sampled_from(["linear", "mlp", "attention"]), tp=st.integers(2, 4),
       dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]), data=st.data())
@example(kind="attention", tp=4, dtype=torch.float32, data=None)  # 6 heads reading 2 KV heads: uneven readers
@example(kind="mlp", tp=3, dtype=torch.float32, data=None)  # hidden 13: segments of 1 to 3 features
@example(kind="attention", tp=2, dtype=torch.float64, data=((2, 2, 1), 1, False))  # one-feature heads, one row
def test_layers_compute_the_same_bits_at_every_tp(worlds, kind, tp, dtype, data):
    if data is None:
        sizes, b, sp = ((24, 6, 2) if kind == "attention" else (5, 13, 0)), 2, True
    elif isinstance(data, tuple):  # an example's sizes, batch and sequence parallelism
        sizes, b, sp = data
    else:
        n_head = data.draw(st.integers(tp, 6))
        sizes = ((n_head * data.draw(st.integers(1, 4)), n_head,
                  data.draw(st.sampled_from([d for d in range(1, n_head + 1) if n_head % d == 0])))
                 if kind == "attention" else (data.draw(st.integers(1, 12)), data.draw(st.integers(tp, 40)),
                                              data.draw(st.integers(0, 1))))
        b, sp = data.draw(st.integers(1, 3)), kind != "linear" and data.draw(st.booleans())
    one = worlds[1].run(layer_run, kind, sizes, b, dtype, 0, sp, bitwise=True)[0]
    for got in worlds[tp].run(layer_run, kind, sizes, b, dtype, 0, sp, bitwise=True):
        assert not differing(one, got), f"{kind} {sizes} at tp={tp}: {differing(one, got)} differ from tp=1"


def kept_operands_run(dtype):
    """Column then row layer in the mode, twice from one seed: the outputs of one run only without gradients
    (which keeps its weights' operands from call to call) and of the other only with gradients (which keeps
    nothing), as the weights of both change in place and are replaced."""
    def built():
        torch.manual_seed(0)
        return torch.nn.Sequential(ColumnParallelLinear(12, 10, dtype=dtype), RowParallelLinear(10, 12, dtype=dtype))

    kept, fresh = built(), built()
    x = torch.randn(1, 1, 12).to(dtype)  # one token, as decoding runs it
    runs = []
    for change in (None, "in place", "replaced"):
        for module in (kept, fresh):
            if change == "in place":
                with torch.no_grad():
                    for p in module.parameters():
                        p.mul_(1.5)
            elif change == "replaced":
                module[1].weight = torch.nn.Parameter(module[1].weight.detach() * -2)
        with torch.no_grad():
            without = kept(x), kept(x)
        runs.append((*without, fresh(x).detach()))
    return runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_without_gradients_keep_their_weights_operands_only_while_unchanged(worlds, dtype):
    for runs in worlds[2].run(kept_operands_run, dtype, bitwise=True):
        for kept, again, fresh in runs:
            assert torch.equal(kept, fresh) and torch.equal(again, fresh)
        assert not torch.equal(runs[0][0], runs[1][0]) and not torch.equal(runs[1][0], runs[2][0])


# ---------------------------------------------------------------- the GPT


def gpt_run(cfg, b, t, seed, steps, autocast, device="cpu"):
    """A GPT from ``seed`` trained ``steps`` AdamW steps with clipping, in the current mode: the logits
    and every gradient of its first step, the loss and clipped norm of every step, and its parameters
    and AdamW state after the last (full tensors, the same on every rank)."""
    tensorpar.manual_seed(seed)
    model = GPT(GPTConfig(**cfg), device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out = {}
    for step in range(steps):
        idx, targets = (ids.to(device) for ids in batch(cfg, b, t, seed + step))
        with torch.autocast(device, torch.bfloat16, enabled=autocast):
            if step == 0:
                with torch.no_grad():
                    out["logits"] = model(idx)
            loss = model(idx, targets)
        optimizer.zero_grad()
        loss.backward()
        out[f"step {step} norm"] = tensorpar.clip_grad_norm_(model, 0.5)
        out[f"step {step} loss"] = loss.detach()
        if step == 0:
            out |= {f"grad {k}": v for k, v in tensorpar.full_grads(model).items()}
        optimizer.step()
    split = tensorpar.full.placements(model)
    for name, p in model.named_parameters():
        for key, value in optimizer.state[p].items():
            whole = name not in split or value.dim() == 0  # replicated, or the step count
            out[f"adamw {name}.{key}"] = value if whole else tensorpar.unshard(value, *split[name])
    return out | {f"param {k}": v for k, v in model.full_state_dict().items()}


GQA_FEWER_THAN_TP = dict(n_layer=1, n_head=6, n_kv_head=2, n_embd=12, vocab_size=37, block_size=8, bias=True,
                         mlp="gelu")


@settings(max_examples=10)
@given(tp=st.integers(2, 4), data=st.data())
@example(tp=4, data=None)  # 6 heads over 4 ranks reading 2 KV heads; 37 tokens of vocabulary; SP with T < tp
@example(tp=3, data=None)
def test_the_gpt_computes_the_same_bits_at_every_tp(worlds, tp, data):
    """Logits, loss, every gradient, clipped norms, and parameters and AdamW state after two steps; with
    sequence parallelism against tp = 1 without it (so turning it on changes no bit either)."""
    if data is None:
        cfg = GQA_FEWER_THAN_TP | dict(sequence_parallel=True, dropout=0.1)
        b, t, autocast = 2, 3, tp == 3
    else:
        cfg = data.draw(gpt_configs(tp, max_layer=2)) | dict(
            sequence_parallel=data.draw(st.booleans(), label="sequence_parallel"),
            dropout=data.draw(st.sampled_from([0.0, 0.1]), label="dropout"),
            activation_checkpointing=data.draw(st.booleans(), label="activation_checkpointing"))
        b, t = data.draw(st.integers(1, 3)), data.draw(st.integers(1, cfg["block_size"]))
        autocast = data.draw(st.booleans(), label="bfloat16 autocast")
    # tp = 1 without sequence parallelism, where nothing else differs (dropout draws its masks otherwise)
    plain = cfg | dict(sequence_parallel=False) if not cfg["dropout"] else cfg
    one = worlds[1].run(gpt_run, plain, b, t, 0, 2, autocast, bitwise=True)[0]
    for got in worlds[tp].run(gpt_run, cfg, b, t, 0, 2, autocast, bitwise=True):
        assert not differing(one, got), f"tp={tp} {cfg}: {differing(one, got)[:8]} differ from tp=1"


@pytest.mark.parametrize("kind", ["linear", "mlp", "attention", "gpt"])
def test_without_the_mode_the_same_cases_differ(worlds, kind):
    """The counter-test: the default mode at tp = 3 adds in another order than at tp = 1, and some
    element of some result differs in its last bits (the mode makes the equality, not the cases)."""
    if kind == "gpt":
        cfg = GQA_FEWER_THAN_TP | dict(n_embd=48, vocab_size=97)
        one, three = (worlds[tp].run(gpt_run, cfg, 2, 8, 0, 1, False)[0] for tp in (1, 3))
    else:
        sizes = (24, 6, 2) if kind == "attention" else (48, 96, 0)
        one, three = (worlds[tp].run(layer_run, kind, sizes, 2, torch.float32, 0, False)[0] for tp in (1, 3))
    assert differing(one, three), f"{kind}: without the bitwise mode every result was equal at tp 1 and 3"
    compared = [k for k in one if not k.startswith(("param", "adamw", "grad"))] if kind == "gpt" else list(one)
    assert_all_close({k: (three[k], one[k]) for k in compared}, rtol=1e-5, what="(equal to within round-off)")


def against_reference(cfg, b, t, seed):
    """The bitwise GPT's loss, gradients and gradient norm against the plain reference GPT with the same
    weights."""
    ref, model = twins(cfg, torch.float64, seed)  # the GPT built in the current (bitwise) mode
    idx, targets = batch(cfg, b, t, seed)
    loss, ref_loss = model(idx, targets), ref(idx, targets)
    loss.backward()
    ref_loss.backward()
    grads = tensorpar.full_grads(model)
    scale = math.sqrt(sum(p.grad.square().sum().item() for p in ref.parameters()))
    errors = assert_all_close({"loss": (loss, ref_loss)} | {k: (grads[k], p.grad, scale)
                                                           for k, p in ref.named_parameters()},
                              rtol=TOLERANCES[torch.float64], what="the bitwise GPT against the reference")
    norm, ref_norm = tensorpar.grad_norm(model), torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    assert norm.dtype == ref_norm.dtype == torch.float64, (norm.dtype, ref_norm.dtype)
    return errors | assert_all_close({"norm": (norm, ref_norm)}, rtol=TOLERANCES[torch.float64])


def test_the_mode_still_computes_the_unsharded_gpt(worlds):
    """Bits aside, the mode computes the model: float64 loss, gradients and clipped gradients against the
    plain reference at tp 1 and 3 (uneven heads, fewer KV heads than ranks, uneven vocabulary)."""
    for tp in (1, 3):
        worlds[tp].run(against_reference, GQA_FEWER_THAN_TP | dict(n_layer=2), 2, 7, 3, bitwise=True)


# ---------------------------------------------------------------- the training script


def test_train_gpt_bitwise_logs_the_same_losses_and_norms_at_every_tp(worlds, tmp_path):
    """``train_gpt.py --bitwise`` at tp 2, 3 and 4 logs exactly tp 1's losses and gradient norms and ends
    with the same weights, and so does a run stopped at tp 2 and resumed at tp 3 from its checkpoint;
    without ``--bitwise`` tp 3 does not."""
    run = SMALL | dict(steps=4, eval_every=0, n_head=6, n_embd=36, dropout=0.1)

    def train(tp, bitwise=True, name=None, **more):
        out = tmp_path / (name or f"tp{tp}-{bitwise}")
        worlds[tp].run(tensorpar.testing.run_script, str(SCRIPT),
                       *flags(run | dict(tp=tp, out=out, bitwise=bitwise) | more))
        logged = [(r["loss"], r["grad_norm"]) for r in metrics(out)]
        return logged, tensorpar.checkpoint.export_state_dict(out)

    (logged, weights), plain = train(1), train(3, bitwise=False)
    assert len(logged) == 4 and plain[0] != logged
    train(2, name="resharded", stop_at=2, ckpt_every=2)
    for tp, other in [(2, train(2)), (3, train(3)), (4, train(4)), ("2, then 3", train(3, name="resharded",
                                                                                        resume="must"))]:
        other_logged, other_weights = other
        assert other_logged == logged, f"tp={tp}"
        assert all(torch.equal(other_weights[k], v) for k, v in weights.items()), f"tp={tp}: weights differ"


# ---------------------------------------------------------------- converted models


def nano_block_run(n_head, head_dim, seed):
    """nanoGPT's block (float32, tanh GELU) converted by a plan with ``Segmentwise`` for its activation:
    output, input gradient and full gradients."""
    torch.manual_seed(seed)
    dense = NanoBlock(n_head * head_dim, n_head).float()
    dense.mlp.act = torch.nn.GELU(approximate="tanh")
    c = n_head * head_dim
    model = parallelize(dense, {"attn.c_attn": QKVColumn(n_head), "attn.c_proj": HeadRow(n_head),
                                "mlp.fc1": "column", "mlp.act": Segmentwise(4 * c), "mlp.fc2": "row"})
    x = torch.randn(2, 5, c, generator=torch.Generator().manual_seed(seed)).requires_grad_()
    y = model(x)
    y.backward(torch.ones_like(y))
    return {"y": y.detach(), "x.grad": x.grad} | {f"grad {k}": v for k, v in tensorpar.full_grads(model).items()}


def hf_run(arch, spec, seed):
    """A ``transformers`` model converted by ``parallelize_hf``, two AdamW steps with clipping."""
    model = parallelize_hf(hf_cases.build(arch, spec, torch.float32, seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = {}
    for step in range(2):
        ids, labels = hf_cases.batch(spec, 2, 6, seed + step)
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        out |= {f"step {step} loss": loss.detach(), f"step {step} norm": tensorpar.clip_grad_norm_(model, 1.0)}
        optimizer.step()
    return out | {f"param {k}": v for k, v in tensorpar.full_state_dict(model).items()}


HF_SPECS = {"gpt2": dict(vocab_size=37, attn="sdpa", n_layer=1, n_head=6, n_embd=24, n_positions=16),
            "llama": dict(vocab_size=41, attn="eager", num_hidden_layers=1, num_attention_heads=8,
                          num_key_value_heads=4, hidden_size=32, intermediate_size=44, tie_word_embeddings=False)}


def test_parallelized_and_hugging_face_models_compute_the_same_bits_at_every_tp(worlds):
    """A plan-converted nanoGPT block (its activation by ``Segmentwise``) and ``parallelize_hf``'s GPT-2 (6
    heads: uneven at tp 4; also with attention and residual dropout) and Llama (grouped-query, 4 KV heads)
    at tp 2, 3 and 4 against tp 1."""
    dropout = dict(attn_pdrop=0.2, resid_pdrop=0.1, embd_pdrop=0.1)
    cases = [(nano_block_run, (6, 3, 0))] + [(hf_run, (arch, spec, 0)) for arch, spec in HF_SPECS.items()]
    cases.append((hf_run, ("gpt2", HF_SPECS["gpt2"] | dropout, 0)))
    for fn, args in cases:
        one = worlds[1].run(fn, *args, bitwise=True)[0]
        for tp in (2, 3, 4):
            for got in worlds[tp].run(fn, *args, bitwise=True):
                assert not differing(one, got), f"{fn.__name__}{args[:1]} at tp={tp}: {differing(one, got)[:5]}"


def refuse_grouped_llama():
    spec = HF_SPECS["llama"] | dict(num_key_value_heads=2)
    try:
        parallelize_hf(hf_cases.build("llama", spec, torch.float32, 0))
    except ValueError as e:
        return str(e)


def test_parallelize_hf_refuses_fewer_kv_heads_than_a_tp_of_the_mode(worlds):
    assert worlds[2].run(refuse_grouped_llama, bitwise=True)[0].startswith(
        "parallelize_hf in bitwise mode needs at least as many KV heads as ranks at every tp of the mode: "
        "num_key_value_heads 2 < tp 3")


# ---------------------------------------------------------------- the debugger


def divergence_against_the_tp1_twin(cfg, plant):
    """find_divergence of a bitwise GPT against its twin at tp = 1 (a group of this rank alone), exact;
    with ``plant``, one block's MLP output projection sums by the default all-reduce instead of its tree."""
    tensorpar.manual_seed(0)
    model = GPT(GPTConfig(**cfg))
    twin = GPT(GPTConfig(**cfg), group=tensorpar.testing.group_of_one())
    twin.load_full_state_dict(model.full_state_dict())
    if plant:
        c_proj = model.transformer.h[1].mlp.c_proj
        c_proj.product = c_proj._product  # the bug: this layer leaves the mode
    idx, targets = batch(cfg, 2, 6, 0)
    report = tensorpar.testing.find_divergence(model, twin, idx, targets, loss_fn=None)
    return report.ok, str(report)


def test_find_divergence_in_bitwise_mode_reports_any_difference_at_all(worlds):
    """Against the twin at tp = 1 every tensor is equal bit for bit; a layer that sums by the all-reduce
    (equal to within 1e-7, which the default float32 tolerance of 1e-5 would let pass) is named."""
    cfg = GQA_FEWER_THAN_TP | dict(n_layer=2, n_embd=36, vocab_size=97)
    ok, text = worlds[3].run(divergence_against_the_tp1_twin, cfg, False, bitwise=True)[0]
    assert ok, text
    ok, text = worlds[3].run(divergence_against_the_tp1_twin, cfg, True, bitwise=True)[0]
    assert not ok and "transformer.h.1.mlp.c_proj" in text, text


# ---------------------------------------------------------------- on a GPU


def cuda_gpt_run(cfg, autocast):
    """``gpt_run`` on CUDA tensors in a spawned group (gloo over CUDA tensors), its results on the CPU."""
    tensorpar.init()
    tensorpar.bitwise.enable()
    return {k: v.cpu() for k, v in gpt_run(cfg, 2, 16, 0, 2, autocast, "cuda").items()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("autocast", [False, True])
def test_the_gpt_computes_the_same_bits_at_tp_1_and_2_on_cuda(autocast):
    """cuBLAS picks its kernels by shape: the segments give every product the same shape at every tp."""
    cfg = GQA_FEWER_THAN_TP | dict(n_layer=2, n_embd=96, vocab_size=101, block_size=16)
    one = tensorpar.spawn(cuda_gpt_run, 1, cfg, autocast, backend="gloo")[0]
    for got in tensorpar.spawn(cuda_gpt_run, 2, cfg, autocast, backend="gloo"):
        assert not differing(one, got), differing(one, got)[:8]

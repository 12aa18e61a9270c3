"""The planner (``layers.plan``) against what runs: every rank's bytes of parameters, gradients and optimizer
state, measured on real ranks after one optimizer step (DDP, ZeRO, FSDP2, offload; tp 1-4, pp 1-2, uneven
heads, KV heads and vocabularies, fp32 and bf16) and on the meta device at GPT-2 124M's shapes; the FLOPs
against torch's ``FlopCounterMode``; ``suggest``'s order and reasons; the errors."""

import dataclasses
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import tensorpar
from gpt_cases import batch, gpt_configs
from layers import GPT, GPTConfig, Layout, PipelinedGPT, nearest_fits, plan, plan_flops, plan_rank, suggest
from layers.plan import VARIED, check_layout
from layers.plan_measure import STATE_FIELDS, measure_state
from layers.plan_state import held_parameters, zero_owners
from tensorpar.bitwise.settings import use_bitwise

GPT2 = dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
#: (tp, pp, dp) of at most 4 ranks
MESHES = [(1, 1, 1), (2, 1, 1), (3, 1, 1), (4, 1, 1), (1, 1, 2), (1, 1, 3), (1, 1, 4), (2, 1, 2), (1, 2, 1),
          (2, 2, 1), (1, 2, 2)]


def measure_step(cfg, layout_fields, seed):
    """One optimizer step of the layout's model on this rank; then the bytes it holds, this rank's entry
    of ``plan`` and ``plan_rank``'s."""
    mesh = tensorpar.current_mesh()
    config, layout = GPTConfig(**cfg), Layout(**layout_fields)
    idx, targets = batch(cfg, 2, cfg["block_size"], seed + mesh.dp_rank)
    measured, stepped = measure_state(config, layout, idx, targets, seed=seed)
    planned = plan(config, layout).rank(mesh.tp_rank, mesh.pp_rank, mesh.dp_rank)
    return measured, dataclasses.asdict(planned), dataclasses.asdict(plan_rank(stepped, layout))  # DDP: unwrapped


def state_of(rank):
    return {k: rank[k] for k in STATE_FIELDS}


@st.composite
def layouts(draw):
    tp, pp, dp = draw(st.sampled_from(MESHES))
    sharding = draw(st.sampled_from(["ddp", "zero", "fsdp"]))
    offload = sharding == "fsdp" and draw(st.booleans())
    return dict(tp=tp, pp=pp, dp=dp, microbatches=pp, dp_sharding=sharding, offload_optimizer=offload,
                dtype=draw(st.sampled_from(["float32", "bfloat16"])), optimizer=draw(st.sampled_from(["adamw", "sgd"])))


@settings(max_examples=24)
@given(layout=layouts(), data=st.data())
def test_state_bytes_are_exact_on_every_rank_after_a_step(worlds, layout, data):
    cfg = data.draw(gpt_configs(layout["tp"], max_layer=3))
    if layout["pp"] > 1:
        cfg["n_layer"] = max(cfg["n_layer"], layout["pp"])
    results = worlds[layout["tp"] * layout["pp"] * layout["dp"]].run(
        measure_step, cfg, layout, data.draw(st.integers(0, 2**31)), tp=layout["tp"], dp=layout["dp"],
        pp=layout["pp"])
    for rank, (measured, planned, from_model) in enumerate(results):
        differences = {k: state_of(planned)[k] - v for k, v in measured.items()}
        assert not any(differences.values()), f"rank {rank}: planned - measured bytes: {differences}"
        assert from_model == planned, f"rank {rank}: plan_rank differs from plan"


def meta_shapes(cfg, pp, sharding, loops=1):
    """GPT-2 124M on the meta device: this rank's parameter names and local shapes, and where FSDP2 or
    ZeRO put them (FSDP2's padded and unpadded chunks; ZeRO's owner of each param group's parameters)."""
    mesh = tensorpar.current_mesh()
    config = GPTConfig(**cfg)
    model = PipelinedGPT(config, mesh=mesh, device="meta", stages_per_rank=loops) if pp > 1 \
        else GPT(config, device="meta")
    shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    extra = None
    if sharding == "fsdp":
        tensorpar.fully_shard_dp(model, mesh)
        extra = [(p.to_local().shape[0], p.to_local().untyped_storage().nbytes() // p.element_size()
                  // max(1, math.prod(p.shape[1:]))) for p in model.parameters()]
    elif sharding == "zero":
        params = list(model.parameters())
        groups = [[p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]]
        zero = ZeroRedundancyOptimizer([{"params": g} for g in groups], optimizer_class=torch.optim.SGD,
                                       process_group=mesh.dp_group, lr=1e-3)
        owner = {id(p): r for r, rank_groups in enumerate(zero._partition_parameters())
                 for g in rank_groups for p in g["params"]}
        extra = [[owner[id(p)] for p in g] for g in groups]
    return mesh.tp_rank, mesh.pp_rank, mesh.dp_rank, shapes, extra


@pytest.mark.parametrize("tp, pp, dp, sharding, loops", [
    (1, 1, 1, None, 1), (2, 1, 1, None, 1), (3, 1, 1, None, 1), (4, 1, 1, None, 1), (1, 2, 1, None, 1),
    (2, 2, 1, None, 1), (1, 2, 1, None, 3), (1, 1, 4, "zero", 1), (1, 1, 3, "fsdp", 1), (2, 1, 2, "fsdp", 1)])
def test_gpt2_shapes_on_the_meta_device_are_the_planned_ones(worlds, tp, pp, dp, sharding, loops):
    """GPT-2 124M: the names and shapes each rank holds (``loops`` stages per pipeline rank), FSDP2's chunks
    and ZeRO's owners, as planned."""
    config = GPTConfig(**GPT2)
    layout = Layout(tp=tp, pp=pp, dp=dp, dp_sharding=sharding or "ddp", microbatches=pp, stages_per_rank=loops,
                    schedule="interleaved" if loops > 1 else "1f1b")
    full = plan(config, layout)
    for tp_rank, pp_rank, dp_rank, shapes, extra in worlds[tp * pp * dp].run(meta_shapes, GPT2, pp, sharding, loops,
                                                                             tp=tp, dp=dp, pp=pp):
        held = held_parameters(config, tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank, stages_per_rank=loops)
        assert shapes == [(p.name, p.shape) for p in held]
        planned = full.rank(tp_rank, pp_rank, dp_rank)
        rows = [s[0] for _, s in shapes]
        row_bytes = [math.prod(s[1:]) * 4 for _, s in shapes]
        if sharding == "fsdp":  # (rows held, rows of the padded buffer) per parameter, as FSDP2 holds them
            padded = [-(-n // dp) for n in rows]
            assert extra == [(max(0, min(p, n - dp_rank * p)), p) for n, p in zip(rows, padded, strict=True)]
            assert planned.params_bytes == sum(p * b for p, b in zip(padded, row_bytes, strict=True))
        else:
            assert planned.params_bytes == sum(n * b for n, b in zip(rows, row_bytes, strict=True))
        if sharding == "zero":  # torch's owners are the planned ones; this rank's AdamW state is theirs
            sizes = [[math.prod(s) for _, s in shapes if len(s) >= 2], [math.prod(s) for _, s in shapes if len(s) < 2]]
            assert zero_owners(sizes, dp) == extra
            mine = [n for g, o in zip(sizes, extra, strict=True) for n, r in zip(g, o, strict=True) if r == dp_rank]
            assert planned.optimizer_bytes == sum(2 * 4 * n + 4 for n in mine)


def count_flops(cfg, recompute):
    """FLOPs ``FlopCounterMode`` counts on this rank for a forward and backward of 2 sequences (SDPA's math
    kernel: its matmuls counted; with activation checkpointing, what torch recomputes), and the element
    count of the rank's vector parameters (LayerNorms, biases: 6 FLOPs a token each in the 6N count, none
    in torch's) and of those inside blocks."""
    config = GPTConfig(**cfg, activation_checkpointing=recompute)
    tensorpar.manual_seed(0)
    model = GPT(config)
    idx, targets = batch(cfg, 2, cfg["block_size"], 0)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(idx, targets).backward()
    vectors = [(n, p.numel()) for n, p in model.named_parameters() if p.dim() == 1]
    mesh = tensorpar.current_mesh()
    return (mesh.tp_rank, counter.get_total_flops(), sum(n for _, n in vectors),
            sum(n for name, n in vectors if name.startswith("transformer.h.")))


@pytest.mark.parametrize("tp", [1, 2, 3])
@pytest.mark.parametrize("recompute", [False, True])
@settings(max_examples=2)
@given(data=st.data())
def test_flops_are_those_torch_counts(worlds, tp, recompute, data):
    cfg = data.draw(gpt_configs(tp, max_layer=2))
    layout = Layout(tp=tp, micro_batch=2, activation_checkpointing=recompute)
    planned = plan(GPTConfig(**cfg), layout, peak_flops=1e12)
    for tp_rank, counted, vectors, block_vectors in worlds[tp].run(count_flops, cfg, recompute, tp=tp):
        tokens = 2 * cfg["block_size"]
        not_counted = tokens * (6 * vectors + (2 * block_vectors if recompute else 0))
        assert planned.ranks[tp_rank].flops == counted + not_counted
    if tp == 1 and not recompute:  # one rank: its FLOPs are the model's
        assert planned.hardware_flops_per_step == planned.flops_per_step
    assert planned.step_time_s == max(r.flops for r in planned.ranks) / 1e12


def test_model_flops_bubble_and_mfu_of_gpt2():
    config = GPTConfig(**GPT2)
    p = plan(config, Layout(pp=2, dp=2, micro_batch=4, microbatches=6, autocast="bfloat16"), device="H100")
    n = config.parameter_count()
    assert p.flops_per_step == (6 * n + 12 * 12 * 768 * 1024) * 1024 * 4 * 6 * 2
    assert p.peak_flops == 989e12 and p.bubble == 1 / 7
    assert p.step_time_s == pytest.approx(max(r.flops for r in p.ranks) / 989e12 * 7 / 6, rel=1e-12)
    assert p.mfu == pytest.approx(p.flops_per_step / (4 * 989e12 * p.step_time_s), rel=1e-12)
    assert plan(config, Layout(), device="A100").peak_flops == 19.5e12  # fp32
    assert plan(config, Layout(dtype="bfloat16"), device="NVIDIA H100 PCIe").peak_flops == 756e12
    assert plan(config, Layout()).step_time_s is None


def test_the_training_scripts_figures_are_the_planners():
    from examples.train import hardware

    assert hardware.PEAKS is plan_flops.PEAKS and hardware.model_flops_per_token is plan_flops.model_flops_per_token


def test_table_and_dict():
    p = plan(GPTConfig(**GPT2), Layout(tp=3, dp=2, dp_sharding="fsdp"), device="H200")
    text = p.table()
    assert "MiB" in text and "MFU" in text and "tp 0 pp 0 dp 0" in text
    d = json.loads(json.dumps(p.as_dict()))
    big = p.largest
    assert d["params_bytes"] == big.params_bytes and d["peak_bytes"] == big.peak_bytes
    assert len(d["ranks"]) == 6 and {"grads_bytes", "optimizer_bytes", "activation_bytes"} <= set(d)
    assert big.peak_bytes == max(r.peak_bytes for r in p.ranks)
    rows = [line for line in text.splitlines() if line.startswith("tp ")]
    assert len(rows) == len({(r.params_bytes, r.grads_bytes, r.optimizer_bytes, r.peak_bytes, r.flops)
                             for r in p.ranks})


SMALL = dict(vocab_size=1000, block_size=64, n_layer=4, n_head=6, n_embd=96)


def test_suggest_orders_fits_and_names_every_rejection():
    config, base = GPTConfig(**SMALL, n_kv_head=2), Layout(microbatches=8)
    everything = suggest(config, 8, 2**40, base=base, device="H100")
    budget = sorted(p.largest.peak_bytes for p in everything.fits)[len(everything.fits) // 2]
    s = suggest(config, 8, budget, base=base, device="H100")
    assert s.fits and s.rejected
    keys = [(p.critical_flops / p.tokens_per_step, p.largest.peak_bytes) for p in s.fits]
    assert keys == sorted(keys)
    assert all(p.largest.peak_bytes <= budget for p in s.fits)
    meshes = [(t, q, 8 // (t * q)) for t in (1, 2, 4, 8) for q in (1, 2, 4, 8) if 8 % (t * q) == 0]
    # each mesh: ddp, zero, fsdp where dp > 1; sequence parallelism where tp > 1; checkpointing or not
    assert len(s.fits) + len(s.rejected) == sum((3 if d > 1 else 1) * (2 if t > 1 else 1) * 2 for t, _, d in meshes)
    for layout, reason in s.rejected:
        if layout.tp == 8:  # 6 heads
            assert reason == "n_head (6) is smaller than tp (8)"
        elif layout.pp == 8:  # 4 blocks
            assert reason == "n_layer (4) is smaller than the number of pipeline stages (8)"
        else:
            p = plan(config, layout, device="H100")
            big = p.largest
            assert reason == (f"needs {big.peak_bytes / 2**30:.1f} GiB on rank (tp {big.tp_rank}, pp {big.pp_stage}, "
                              f"dp {big.dp_rank}), more than {budget / 2**30:.1f} GiB")
            assert big.peak_bytes > budget
    assert {(p.layout.tp, p.layout.pp, p.layout.dp) for p in everything.fits} == {
        (t, q, d) for t, q, d in meshes if t < 8 and q < 8}


def test_suggest_with_a_global_batch_and_the_nearest_fits():
    config = GPTConfig(**SMALL)
    s = suggest(config, 4, 2**40, global_batch=6)
    assert all(p.layout.micro_batch * p.layout.dp == 6 for p in s.fits)
    assert any("does not split into dp (4)" in reason for _, reason in s.rejected)
    wanted = Layout(dp=4)
    budget = plan(config, dataclasses.replace(wanted, dp_sharding="fsdp")).largest.peak_bytes
    near = nearest_fits(config, wanted, budget, limit=4)
    assert near and all(p.largest.peak_bytes <= budget for p in near)
    changed = [sum(getattr(p.layout, f) != getattr(wanted, f) for f in VARIED) for p in near]
    assert changed == sorted(changed) and changed[0] == 1  # ZeRO or FSDP2 at the same mesh


@pytest.mark.parametrize("layout, message", [
    (Layout(tp=0), "Layout.tp must be a positive integer, got 0"),
    (Layout(dp_sharding="zero3"), "Layout.dp_sharding must be one of ('ddp', 'zero', 'fsdp'), got 'zero3'"),
    (Layout(offload_optimizer=True), "it needs dp_sharding='fsdp', got 'ddp'"),
    (Layout(seq_len=65), "seq_len (65) must be in 1..block_size (64)"),
    (Layout(tp=7), "n_head (6) is smaller than tp (7)"),
    (Layout(pp=5), "n_layer (4) is smaller than the number of pipeline stages (5)"),
    (Layout(stages_per_rank=2), "stages_per_rank (2) > 1 needs pipeline ranks to loop over: pp is 1"),
    (Layout(dtype="float16"), "Layout.dtype must be one of ('float32', 'bfloat16'), got 'float16'"),
    (Layout(pp=2), "the 1f1b schedule needs at least as many micro-batches as stages: microbatches (1) is smaller "
                   "than pp (2)"),
    (Layout(pp=2, microbatches=2, stages_per_rank=2), "the 1f1b schedule runs one stage per rank, got "
                                                      "stages_per_rank 2: use schedule='interleaved' for several"),
])
def test_bad_layouts_are_refused_with_the_numbers(layout, message):
    with pytest.raises(ValueError) as e:
        check_layout(GPTConfig(**SMALL), layout)
    assert message in str(e.value)
    with pytest.raises(ValueError):
        plan(GPTConfig(**SMALL), layout)


def test_bad_arguments_are_refused():
    config = GPTConfig(**SMALL)
    with pytest.raises(ValueError, match=r"no peak is known for device 'TPU' \(known: H200, H100 PCIe, H100, A100\)"):
        plan(config, Layout(), device="TPU")
    with pytest.raises(ValueError, match="peak_flops must be a number above 0"):
        plan(config, Layout(), peak_flops=0)
    with pytest.raises(ValueError, match="memory_bytes must be a positive integer, got -1"):
        suggest(config, 4, -1)
    with pytest.raises(ValueError, match="world must be a positive integer, got 0"):
        suggest(config, 0, 2**30)
    with pytest.raises(ValueError, match=r"no rank \(tp 2, pp 0, dp 0\) in a layout of tp=2, pp=1, dp=1"):
        plan(config, Layout(tp=2)).rank(2, 0, 0)
    with pytest.raises(TypeError, match="expected a GPTConfig"):
        plan(SMALL, Layout())


def plan_of_a_bitwise_model(cfg):
    """On every rank: plan_rank of a GPT built in the bitwise mode, under a bitwise and a default layout."""
    mesh = tensorpar.current_mesh()
    config = GPTConfig(**cfg)
    with use_bitwise(True):
        model = GPT(config)
    layout = Layout(tp=mesh.tp, seq_len=8)
    try:
        plan_rank(model, layout)
        refused = ""
    except ValueError as e:
        refused = str(e)
    planned = plan(config, dataclasses.replace(layout, bitwise=True)).rank(mesh.tp_rank, 0, 0)
    return dataclasses.asdict(plan_rank(model, dataclasses.replace(layout, bitwise=True))), \
        dataclasses.asdict(planned), refused


def test_plan_rank_plans_a_bitwise_model_as_built(worlds):
    for from_model, planned, refused in worlds[2].run(plan_of_a_bitwise_model, SMALL):
        assert from_model == planned
        assert refused == "the model was built in the bitwise mode, the layout's bitwise is False"

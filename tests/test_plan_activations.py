"""The plan's activations and peak (:mod:`layers.plan_activations`) against what real ranks hold.

Each example trains a sharded GPT on every rank of a tp group (uneven heads, KV heads fewer than ranks,
odd vocabularies and sequence lengths, either MLP, dropout on or off, sequence parallelism and activation
checkpointing on or off, float32 or bfloat16 autocast) and measures, per rank, the bytes autograd saves
for backward (a ``saved_tensors_hooks`` pack hook, each storage once, parameters excluded) and the peak
of the live tensors over a whole step, optimizer step included (a ``TorchDispatchMode`` following every
storage; :mod:`layers.plan_measure`). The plan, given the parameter, gradient and optimizer bytes
measured from the model, must be within 5% of the saved bytes and 10% of the peak on every rank.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorpar
from gpt_cases import gpt_configs
from layers import GPTConfig
from layers.pipeline import PipelinedGPT
from layers.plan import Layout, check_layout
from layers.plan_activations import activation_bytes, peak_bytes, transient_bytes
from layers.plan_measure import LiveBytes, measure_step, peak_saved_bytes
from layers.plan_schedule import in_flight, moments
from tensorpar.bitwise.settings import use_bitwise
from tensorpar.testing.strategies import tp_sizes

SAVED_BOUND, PEAK_BOUND = 0.05, 0.10


def planned_and_measured(cfg, b, t, autocast, seed, bitwise=False):
    """On every rank: (measured figures, the plan's activations, the plan's peak); ``bitwise``: the model built
    in the bitwise mode, on one CPU thread (as ``tensorpar.bitwise.enable`` sets it)."""
    mesh = tensorpar.current_mesh()
    config = GPTConfig(**cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if bitwise else threads)
    try:
        with use_bitwise(bitwise):
            found = measure_step(config, b, t, autocast=torch.bfloat16 if autocast else None, seed=seed)
    finally:
        torch.set_num_threads(threads)
    layout = Layout(tp=mesh.tp, sequence_parallel=config.sequence_parallel,
                    activation_checkpointing=config.activation_checkpointing, micro_batch=b, seq_len=t,
                    autocast="bfloat16" if autocast else None, bitwise=bitwise)
    acts = activation_bytes(config, layout, tp_rank=mesh.tp_rank)
    peak = peak_bytes(config, layout, params=found["params"], grads=found["grads"], optimizer=found["optimizer"],
                      tp_rank=mesh.tp_rank)
    return found, acts, peak


@st.composite
def options(draw):
    return dict(dropout=draw(st.sampled_from([0.0, 0.2])), sequence_parallel=draw(st.booleans()),
                activation_checkpointing=draw(st.booleans()))


@settings(max_examples=24)
@given(tp=tp_sizes(), data=st.data(), extra=options(), autocast=st.booleans(), seed=st.integers(0, 2**31))
def test_saved_activations_are_planned_within_5_percent(worlds, tp, data, extra, autocast, seed):
    cfg = dict(data.draw(gpt_configs(tp, max_layer=3)), **extra)
    b, t = data.draw(st.integers(1, 3)), data.draw(st.integers(1, cfg["block_size"]))
    for rank, (found, acts, _) in enumerate(worlds[tp].run(planned_and_measured, cfg, b, t, autocast, seed)):
        assert abs(acts / found["saved"] - 1) <= SAVED_BOUND, (rank, acts, found)


@st.composite
def small_configs(draw, tp):
    """GPTs small enough for a fast test, down to toy sizes where fixed overheads weigh (the generators'
    5 KB states, a loss's scalars): 8-48 features in all, 16-96 tokens of vocabulary, 4-32 tokens."""
    n_head = draw(st.integers(tp, 6))
    n_kv_head = draw(st.sampled_from([d for d in range(1, n_head + 1) if n_head % d == 0]))
    return dict(n_layer=draw(st.integers(1, 3)), n_head=n_head, n_kv_head=n_kv_head,
                n_embd=n_head * draw(st.integers(-(-8 // n_head), max(1, 48 // n_head))),
                vocab_size=draw(st.integers(16, 96)),
                block_size=draw(st.integers(4, 32)), bias=draw(st.booleans()),
                mlp=draw(st.sampled_from(["gelu", "swiglu"])))


@settings(max_examples=16)
@given(tp=tp_sizes(), data=st.data(), extra=options(), autocast=st.booleans(), seed=st.integers(0, 2**31))
def test_the_peak_of_a_step_is_planned_within_10_percent(worlds, tp, data, extra, autocast, seed):
    cfg = dict(data.draw(small_configs(tp)), **extra)
    b, t = data.draw(st.integers(1, 3)), data.draw(st.integers(max(2, cfg["block_size"] // 2), cfg["block_size"]))
    for rank, (found, _, peak) in enumerate(worlds[tp].run(planned_and_measured, cfg, b, t, autocast, seed)):
        assert abs(peak / found["peak"] - 1) <= PEAK_BOUND, (rank, peak, found)


@settings(max_examples=16)
@given(tp=tp_sizes(), data=st.data(), extra=options(), autocast=st.booleans(), seed=st.integers(0, 2**31))
def test_saved_activations_of_the_bitwise_mode_are_planned_within_5_percent(worlds, tp, data, extra, autocast, seed):
    cfg = dict(data.draw(gpt_configs(tp, max_layer=3)), **extra)
    b, t = data.draw(st.integers(1, 3)), data.draw(st.integers(1, cfg["block_size"]))
    for rank, (found, acts, _) in enumerate(worlds[tp].run(planned_and_measured, cfg, b, t, autocast, seed, True)):
        assert abs(acts / found["saved"] - 1) <= SAVED_BOUND, (rank, acts, found)


@settings(max_examples=16)
@given(tp=tp_sizes(), data=st.data(), extra=options(), autocast=st.booleans(), seed=st.integers(0, 2**31))
def test_the_peak_of_a_bitwise_step_is_planned_within_10_percent(worlds, tp, data, extra, autocast, seed):
    cfg = dict(data.draw(small_configs(tp)), **extra)
    tokens = st.integers(max(2, cfg["block_size"] // 2), cfg["block_size"])
    b, t = data.draw(st.integers(1, 3)), data.draw(st.just(1) | tokens)  # one token too (a decode-sized step)
    for rank, (found, _, peak) in enumerate(worlds[tp].run(planned_and_measured, cfg, b, t, autocast, seed, True)):
        assert abs(peak / found["peak"] - 1) <= PEAK_BOUND, (rank, peak, found)


@pytest.mark.parametrize("tp, dropout", [(2, 0.0), (1, 0.2), (2, 0.2)])
def test_a_bitwise_recomputation_s_transients_are_planned(worlds, tp, dropout):
    """Toy checkpointed GPTs whose peak is a recomputation in backward: without dropout its attention, where
    the scores, their shifted copy and their exponentials are live at once; with dropout its MLP's row map,
    holding every leaf's padded weight columns and product (the plan once missed them: 0.894 and 0.898)."""
    cfg = dict(n_layer=1, n_head=2, n_kv_head=1, n_embd=8, vocab_size=16, block_size=4, bias=False, mlp="gelu",
               dropout=dropout, sequence_parallel=False, activation_checkpointing=True)
    for rank, (found, _, peak) in enumerate(worlds[tp].run(planned_and_measured, cfg, 1, 2, False, 0, True)):
        assert abs(peak / found["peak"] - 1) <= PEAK_BOUND, (rank, peak, found)


@pytest.mark.parametrize("n_head, sequence_parallel", [(6, False), (6, True), (4, False)])
def test_a_bitwise_recomputation_s_row_map_exchanges_are_planned(worlds, n_head, sequence_parallel):
    """A checkpointed block at tp 4 with dropout whose peak is its recomputation's exchange of a row map's
    partial sums: the output projection's, before the MLP half and the output dropouts run, with the fused
    QKV output attention's forward still holds (6 heads: 1.109-1.156 once, the whole recomputation counted
    under it), or the MLP's, whose received buffer is its join (4 heads: 1.113 once, a join counted)."""
    cfg = dict(n_layer=1, n_head=n_head, n_embd=48, vocab_size=101, block_size=48, dropout=0.1,
               sequence_parallel=sequence_parallel, activation_checkpointing=True)
    for rank, (found, _, peak) in enumerate(worlds[4].run(planned_and_measured, cfg, 2, 48, False, 0, True)):
        assert abs(peak / found["peak"] - 1) <= PEAK_BOUND, (rank, peak, found)


def test_live_bytes_follow_storages_until_they_are_freed():
    with LiveBytes() as live:
        a = torch.zeros(100)  # 400 bytes
        b = a + 1  # 800
        view = b[:10]  # a view: nothing new
        del b
        assert live.live == 800  # the view keeps b's storage
        del view
        assert live.live == 400
        torch.ones(1000).sum()  # 4000 bytes, gone at once
    assert (live.live, live.peak) == (400, 4000 + 400 + 4)  # the sum's 4 bytes while both lived


def test_live_bytes_count_the_generator_states_made_outside_the_dispatcher():
    get_state = torch.get_rng_state
    with LiveBytes() as live:
        state = torch.get_rng_state()  # the CPU generator's, 5056 bytes
        assert live.live == state.untyped_storage().nbytes() > 0
        del state
        assert live.live == 0
    assert torch.get_rng_state is get_state  # unwrapped again


def collective_buffer_peak():
    """The peak of: a 4000-byte buffer all-reduced, read once, then held only by the collective's work while
    an 8000-byte tensor is made (as a gloo worker thread may hold a finished collective's buffers)."""
    group = tensorpar.current_mesh().tp_group
    with LiveBytes() as live:
        x = torch.ones(1000)
        work = group.allreduce([x])
        work.wait()
        y = x + 1  # x's last use
        del x
        z = torch.ones(2000)
        del work, y, z
    return live.peak


def test_live_bytes_count_a_collective_buffer_freed_after_its_last_use(worlds):
    # x and y (8000 bytes) while y is made; then y and z (12000): x is no longer counted, whoever holds it
    assert worlds[2].run(collective_buffer_peak) == [12000, 12000]


def pipeline_step(cfg, schedule, microbatches, b, t, stages_per_rank=1):
    """On every rank of a pp=2 pipeline (no optimizer): (the peak of the live tensors over its first step,
    and the plan's; the most bytes held saved at once over a second step, and the plan's; each of its stages'
    most micro-batches in flight, as the pipeline counted them and as the plan does)."""
    mesh = tensorpar.current_mesh()
    tensorpar.manual_seed(0)
    config = GPTConfig(**cfg)
    model = PipelinedGPT(config, stages_per_rank=stages_per_rank)
    pipe = model.pipeline(schedule, microbatches)
    g = torch.Generator().manual_seed(0)
    idx, targets = (torch.randint(0, config.vocab_size, (b * microbatches, t), generator=g) for _ in range(2))
    with LiveBytes() as live:
        live.track([*model.parameters(), idx, targets])
        pipe.step(idx, targets)  # the schedule is built: its receive buffers made
    saved = peak_saved_bytes(model, lambda: pipe.step(idx, targets))
    layout = Layout(tp=mesh.tp, pp=mesh.pp, micro_batch=b, microbatches=microbatches, seq_len=t,
                    schedule=schedule, sequence_parallel=config.sequence_parallel,
                    activation_checkpointing=config.activation_checkpointing, optimizer="sgd",
                    stages_per_rank=stages_per_rank)
    where = dict(tp_rank=mesh.tp_rank, stage=mesh.pp_rank)
    params = sum(p.untyped_storage().nbytes() for p in model.parameters())
    planned_peak = peak_bytes(config, layout, params=params, grads=params, optimizer=0, **where)
    counted = {i: max(n for m in moments(layout, mesh.pp_rank) for j, n, _ in m if j == i)
               for i, _, _ in moments(layout, mesh.pp_rank)[0]}
    measured = {st.stage: st.peak_in_flight for st in pipe.times()}
    return live.peak, planned_peak, saved, activation_bytes(config, layout, **where), measured, counted


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("recompute", [False, True])
def test_pipeline_stages_hold_their_micro_batches_in_flight(worlds, tp, schedule, recompute):
    """GPipe holds all 4 micro-batches on each stage, 1F1B 2 on the first and 1 on the last; a stage after
    the first also keeps torch's receive buffers of the other micro-batches' inputs (the pack hook sees each
    as its first block's saved input, and it lives on); the first those of its output's gradients, and
    each the outputs of the micro-batches in flight (the last: their logits)."""
    cfg = dict(n_layer=3, n_head=3, n_embd=24, vocab_size=41, block_size=9, dropout=0.1,  # 2 blocks, then 1
               sequence_parallel=tp > 1, activation_checkpointing=recompute)
    for rank, (peak, planned_peak, saved, planned, _, _) in enumerate(
            worlds[2 * tp].run(pipeline_step, cfg, schedule, 4, 2, 7, tp=tp, pp=2)):
        assert abs(planned / saved - 1) <= SAVED_BOUND, (rank, saved, planned)
        assert abs(planned_peak / peak - 1) <= PEAK_BOUND, (rank, peak, planned_peak)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize(("microbatches", "recompute"), [(4, False), (6, True), (2, False)])
def test_interleaved_pipeline_stages_hold_their_micro_batches_in_flight(worlds, tp, microbatches, recompute):
    """Two stages on each of two ranks (5 blocks: 2, 1, 1, 1), interleaved 1F1B in torch's order: each stage's
    micro-batches in flight as the pipeline counts them, the bytes held saved at the fullest moment and the
    step's peak, against the plan's."""
    cfg = dict(n_layer=5, n_head=3, n_embd=24, vocab_size=41, block_size=9, dropout=0.1,
               sequence_parallel=tp > 1, activation_checkpointing=recompute)
    for rank, (peak, planned_peak, saved, planned, measured, counted) in enumerate(
            worlds[2 * tp].run(pipeline_step, cfg, "interleaved", microbatches, 2, 7, 2, tp=tp, pp=2)):
        assert measured == counted, (rank, measured, counted)
        assert abs(planned / saved - 1) <= SAVED_BOUND, (rank, saved, planned)
        assert abs(planned_peak / peak - 1) <= PEAK_BOUND, (rank, peak, planned_peak)


@pytest.mark.parametrize(("pp", "loops", "microbatches", "recompute"), [(2, 3, 6, True), (4, 2, 4, False)])
def test_deeper_interleaved_pipelines_are_planned(worlds, pp, loops, microbatches, recompute):
    """Three stages on each of two ranks, and two on each of four: the micro-batches each stage holds as the
    pipeline counts them, the saved bytes and the peak, against the plan's."""
    cfg = dict(n_layer=pp * loops + 1, n_head=3, n_embd=24, vocab_size=41, block_size=9, dropout=0.1,
               activation_checkpointing=recompute)
    for rank, (peak, planned_peak, saved, planned, measured, counted) in enumerate(
            worlds[pp].run(pipeline_step, cfg, "interleaved", microbatches, 2, 7, loops, tp=1, pp=pp)):
        assert measured == counted, (rank, measured, counted)
        assert abs(planned / saved - 1) <= SAVED_BOUND, (rank, saved, planned)
        assert abs(planned_peak / peak - 1) <= PEAK_BOUND, (rank, peak, planned_peak)


def test_pipeline_schedules_hold_their_micro_batches_in_flight():
    config = GPTConfig(n_layer=4, n_head=2, n_embd=8, vocab_size=32, block_size=8)
    one = Layout(pp=2, microbatches=4)
    assert [in_flight(Layout(pp=2, microbatches=4, schedule="gpipe"), s) for s in (0, 1)] == [4, 4]
    assert [in_flight(Layout(pp=4, microbatches=8), s) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight(Layout(microbatches=8), 0) == 1  # accumulated one after the other
    # interleaved 1F1B, two stages a rank: rank 0 runs stage 0 three micro-batches ahead and stage 2 two (five in
    # all) before its first backward, rank 1 stages 1 and 3 at most three in all
    interleaved = Layout(pp=2, microbatches=4, schedule="interleaved", stages_per_rank=2)
    assert max(moments(interleaved, 0), key=lambda m: sum(n for _, n, _ in m)) == ((0, 3, 3), (2, 2, 2))
    assert [in_flight(interleaved, s) for s in (0, 1)] == [5, 3]
    # a middle stage's blocks alone: the same bytes per micro-batch on each of two middle stages
    four = Layout(pp=4, microbatches=8, schedule="gpipe")
    assert activation_bytes(config, four, stage=1) == activation_bytes(config, four, stage=2)
    assert activation_bytes(config, one, stage=0) > 0 and transient_bytes(config, one, stage=1) > 0


def test_bad_layouts_are_refused_with_their_numbers():
    config = GPTConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=32, block_size=8)
    with pytest.raises(ValueError, match=r"seq_len \(9\) must be in \[1, block_size \(8\)\]"):
        activation_bytes(config, Layout(seq_len=9))
    with pytest.raises(ValueError, match="tp_rank 2 is out of range for tp 2"):
        activation_bytes(config, Layout(tp=2), tp_rank=2)
    with pytest.raises(ValueError, match="stage 2 is out of range for pp 2"):
        transient_bytes(config, Layout(pp=2), stage=2)
    with pytest.raises(ValueError, match="device_type must be one of"):
        peak_bytes(config, Layout(), params=0, grads=0, optimizer=0, device_type="tpu")
    with pytest.raises(ValueError, match=r"Layout\.autocast must name a floating-point torch dtype, got 'int8'"):
        activation_bytes(config, Layout(autocast="int8"))
    with pytest.raises(ValueError, match=r"bitwise mode agrees across tp sizes \[1, 2\], and tp=4 is not one"):
        check_layout(GPTConfig(n_layer=2, n_head=4, n_embd=8, vocab_size=32), Layout(tp=4, bitwise=[1, 2]))
    with pytest.raises(TypeError, match="bitwise must be a bool, a Bitwise or a sequence of tp sizes"):
        check_layout(config, Layout(bitwise="yes"))


def test_the_benchmark_prints_every_layout_within_the_bounds():
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "plan.py"), "--n-layer=1", "--n-embd=24",
                           "--n-head=3", "--vocab-size=41", "--tokens=9", "--tp", "1", "3"], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ") and
            line.split("|")[1].strip().isdigit()]
    assert [int(r[0]) for r in rows] == [1] * 4 + [3] * 8  # sequence parallelism only where tp > 1
    assert all(abs(float(r[6]) - 1) <= SAVED_BOUND and abs(float(r[9]) - 1) <= PEAK_BOUND for r in rows), rows

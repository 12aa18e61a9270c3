"""Pipeline parallelism: a GPT split into stages of whole blocks, tensor-parallel inside, trained by
torch.distributed.pipelining's schedules, against the plain unsharded GPT of tests/reference_gpt.py.

Every example runs on real ranks of a (pp, dp, tp) mesh; the reference runs the whole batch at once.
The pipeline cuts the batch into equal micro-batches and sums their mean losses divided by their
number, so losses, gradients (the tied head included: its two copies are summed over their stages)
and parameters after AdamW steps agree to round-off."""

import copy

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorpar
from checkpoint_cases import blocked
from gpt_cases import gpt_configs, key_bias_drift
from layers import GPT, GPTConfig, PipelinedGPT
from reference_gpt import RefConfig, RefGPT
from tensorpar.pipeline import rank_stages, stage_blocks
from tensorpar.testing import assert_all_close, rel_error

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
NORM_TOLERANCE = {torch.float64: 1e-6, torch.float32: 5e-5}  # see train_against_reference


@given(n_blocks=st.integers(1, 40), n_stages=st.integers(1, 12))
def test_stages_hold_balanced_runs_of_whole_blocks(n_blocks, n_stages):
    if n_blocks < n_stages:
        with pytest.raises(ValueError, match=rf"n_layer \({n_blocks}\) is smaller than the number of pipeline "
                                             rf"stages \({n_stages}\)"):
            stage_blocks(n_blocks, n_stages)
        return
    runs = stage_blocks(n_blocks, n_stages)
    assert [i for run in runs for i in run] == list(range(n_blocks))  # every block once, in order
    sizes = [len(run) for run in runs]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1


def test_stage_placement_loops_over_the_pipeline_ranks():
    assert stage_blocks(5, 2) == [range(3), range(3, 5)]
    assert [rank_stages(r, 2, 2) for r in range(2)] == [[0, 2], [1, 3]]
    assert [rank_stages(r, 4) for r in range(4)] == [[0], [1], [2], [3]]


def full_weights(cfg, seed, stages_per_rank):
    """The full weights of this rank's stages of a PipelinedGPT (or a GPT at pp=1) built from ``seed``."""
    mesh = tensorpar.current_mesh()
    tensorpar.manual_seed(seed)
    config = GPTConfig(**cfg)
    model = PipelinedGPT(config, stages_per_rank=stages_per_rank) if mesh.pp > 1 else GPT(config)
    after = torch.randint(0, 2**31, ()).item()  # every layout leaves the generator alike
    return tensorpar.full_state_dict(model) if mesh.dp_rank == 0 else {}, after


@pytest.mark.parametrize("world, pp, stages_per_rank", [(2, 2, 1), (4, 2, 1), (4, 4, 1), (2, 2, 2)])
def test_a_pipelined_gpt_has_the_gpts_weights_bitwise(worlds, world, pp, stages_per_rank):
    cfg = dict(n_layer=4, n_head=2, n_embd=8, vocab_size=37, block_size=8)
    whole, after = worlds[1].run(full_weights, cfg, 3, 1)[0]
    parts = worlds[world].run(full_weights, cfg, 3, stages_per_rank, pp=pp)
    merged = {k: v for part, _ in parts for k, v in part.items()}
    assert set(merged) == set(whole)  # both copies of the tied head among them
    assert all(torch.equal(merged[k], v) for k, v in whole.items())
    assert {a for _, a in parts} == {after}


def float32_roundoff(ref, idx, targets, grads, scale):
    """How far the float32 reference's gradients ``grads`` are from the float64 ones at the same
    weights and batch, relative to the whole gradient's norm ``scale`` where larger."""
    exact = copy.deepcopy(ref).double()
    exact.zero_grad()
    exact(idx, targets).backward()
    return max(rel_error(grads[k].double(), p.grad, scale) for k, p in exact.named_parameters())


def train_against_reference(cfg, dtype, seed, schedule, microbatches, stages_per_rank, sequence_parallel, rows, t):
    """Two AdamW steps with clipping of the pipelined GPT and of the plain one, each from the same weights;
    the relative errors of losses, norms, every gradient and every parameter, and the tolerance."""
    torch.manual_seed(seed)
    ref = RefGPT(RefConfig(**cfg)).to(dtype)
    model = PipelinedGPT(GPTConfig(**cfg, sequence_parallel=sequence_parallel), stages_per_rank=stages_per_rank,
                         dtype=dtype)
    model.load_full_state_dict(ref.state_dict())
    pipe = model.pipeline(schedule, microbatches)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg["vocab_size"], (2, rows, t + 1), generator=g)

    def adamw(m):  # eps: see test_gpt.train_twins (round-off-sized gradients in float32)
        ps = list(m.parameters())
        return torch.optim.AdamW([{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
                                  {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}], lr=1e-3,
                                 eps=1e-6 if dtype == torch.float32 else 1e-8)

    def parameters(step):
        # As in test_gpt.train_twins: key biases have identically zero gradients, whose round-off AdamW turns into
        # steps of up to lr either way; other parameters are measured against the whole model's norm when larger.
        weights = {k: v.clone() for k, v in ref.state_dict().items()}
        full = {k: v.clone() for k, v in tensorpar.full_state_dict(model).items()}
        drift = key_bias_drift(full, weights, cfg)
        if any(d > 2 * 1e-3 for d in drift.values()):
            raise AssertionError(f"key biases moved apart by more than AdamW's step allows: {drift}")
        size = torch.cat([w.flatten() for w in weights.values()]).norm().item()
        return {f"step {step} parameter {k}": (v, weights[k], size) for k, v in full.items()}

    opt, ref_opt = adamw(model), adamw(ref)
    pairs, norms, roundoff = {}, {}, 0.0
    for step in range(2):
        if step:  # the second step starts from the pipelined GPT's weights, every stage's: gradients of round-off
            # size in the first step moved single weights apart by up to 2 lr (AdamW's steps), which LayerNorm
            # over 3 features magnifies into gradients 1e-3 apart
            stages = [None] * dist.get_world_size()
            dist.all_gather_object(stages, tensorpar.full_state_dict(model))
            ref.load_state_dict({k: v for stage in stages for k, v in stage.items()})
        idx, targets = tokens[step, :, :-1].contiguous(), tokens[step, :, 1:].contiguous()
        loss = pipe.step(idx, targets)
        model.finish_gradients()  # the tied head's two copies: their gradients summed
        ref_loss = ref(idx, targets)
        ref_loss.backward()
        grads = tensorpar.full_grads(model)
        ref_grads = {k: p.grad.clone() for k, p in ref.named_parameters()}
        ref_grads["lm_head.weight"] = ref_grads["transformer.wte.weight"]  # the tied head, under its other name
        scale = torch.cat([g.flatten() for g in ref_grads.values()]).norm().item()
        if dtype == torch.float32:
            roundoff = max(roundoff, float32_roundoff(ref, idx, targets, ref_grads, scale))
        norm, ref_norm = model.clip_grad_norm_(0.5), torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
        # the reference clipped by our (float32) norm's factor, so that the parameters compare the gradients
        torch.nn.utils.clip_grads_with_norm_(ref.parameters(), 0.5, norm.to(dtype))
        pairs[f"step {step} loss"] = (loss.to(dtype), ref_loss.detach())
        norms[f"step {step} norm"] = (norm.double(), ref_norm.double())
        pairs |= {f"step {step} grad {k}": (v, ref_grads[k], scale) for k, v in grads.items()}
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        pairs |= parameters(step)
    # The micro-batches sum their gradients in another order than the whole batch does. At widths of 3-24 with
    # head sizes down to 1, LayerNorm's backward over a few features magnifies such float32 round-off: the float32
    # reference's own gradients are off the float64 ones by up to ~3e-5 of the gradient norm for some weights
    # (measured), and the pipelined GPT's own round-off is another draw of that size. So the tolerance is the usual
    # one or, where larger, five times the reference's own float32 error measured at these weights and batches
    # (over 600 draws at width 3, the two models stood up to 3.5 times that error apart).
    rtol = max(TOLERANCE[dtype], 5 * roundoff)
    errors = assert_all_close(pairs, rtol=rtol, what="the pipelined GPT differs from the reference")
    # Gradient norms are accumulated in float32 (as torch's clip_grad_norm_ does in float32); in float32 the
    # micro-batches' gradients are summed in another order than the whole batch's, and at widths of 3-24 the
    # squares of nearly cancelling LayerNorm gradients put that round-off at up to ~1e-5 of the norm. The norm
    # moves by at most the whole gradient's change, which the gradients' tolerance bounds up to a small factor
    # (measured: up to 1.4 times it over 600 draws at width 3).
    errors |= assert_all_close(norms, rtol=norm_tolerance(dtype, rtol), what="the gradient norms differ")
    return errors, rtol


def norm_tolerance(dtype, rtol):
    return max(NORM_TOLERANCE[dtype], 2 * rtol)


LAYOUTS = [  # world, pp, schedule, stages per rank, sequence parallel
    (2, 2, "gpipe", 1, False),
    (4, 2, "1f1b", 1, True),  # tp=2 inside each stage
    (4, 2, "gpipe", 1, False),
    (4, 4, "1f1b", 1, False),
    (2, 2, "interleaved", 2, False),
]


@pytest.mark.parametrize("world, pp, schedule, stages_per_rank, sequence_parallel", LAYOUTS)
@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_pipelined_training_equals_the_unsharded_gpt(worlds, world, pp, schedule, stages_per_rank,
                                                      sequence_parallel, data):
    tp = world // pp
    stages = pp * stages_per_rank
    cfg = data.draw(gpt_configs(tp, max_layer=1))
    cfg.pop("n_kv_head"), cfg.pop("mlp")
    cfg["n_layer"] = data.draw(st.integers(stages, stages + 2), label="n_layer")
    dtype = data.draw(st.sampled_from([torch.float64, torch.float32]), label="dtype")
    microbatches = data.draw(st.sampled_from([pp, 2 * pp] if schedule != "gpipe" else [1, 2, 3]), label="m")
    rows = microbatches * data.draw(st.integers(1, 2), label="rows per micro-batch")
    t = data.draw(st.integers(1, cfg["block_size"]), label="T")
    results = worlds[world].run(train_against_reference, cfg, dtype, data.draw(st.integers(0, 2**31)), schedule,
                                microbatches, stages_per_rank, sequence_parallel, rows, t, pp=pp)
    for errors, rtol in results:
        worst = {"norm" in k: v for k, v in sorted(errors.items(), key=lambda kv: kv[1])}
        assert worst.get(False, 0) <= rtol <= 5e-4 and worst.get(True, 0) <= norm_tolerance(dtype, rtol)


def steps_without_unpickling(schedule, stages_per_rank, sequence_parallel):
    """A training step in float32, one under bfloat16 autocast and an evaluation of the pipelined GPT while
    every way to unpickle (``recv_object_list`` included) raises; the plain GPT's losses on the same batch
    (under the same autocast)."""
    cfg = dict(n_layer=tensorpar.current_mesh().pp * stages_per_rank, n_head=2, n_embd=16, vocab_size=32,
               block_size=8)
    torch.manual_seed(0)
    ref = RefGPT(RefConfig(**cfg))
    model = PipelinedGPT(GPTConfig(**cfg, sequence_parallel=sequence_parallel), stages_per_rank=stages_per_rank)
    model.load_full_state_dict(ref.state_dict())
    pipe = model.pipeline(schedule, 2)
    idx = torch.randint(0, 32, (4, 7), generator=torch.Generator().manual_seed(1))
    with blocked():
        losses = [pipe.step(idx, idx)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(pipe.step(idx, idx))
        losses.append(pipe.evaluate(idx, idx))
    with torch.no_grad():
        expected = [ref(idx, idx)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected.append(ref(idx, idx))
    return [float(loss) for loss in losses], [float(loss) for loss in expected]


@pytest.mark.parametrize("world, pp, schedule, stages_per_rank, sequence_parallel",
                         [(4, 2, "1f1b", 1, True), (2, 2, "interleaved", 2, False)])
def test_no_rank_unpickles_what_a_peer_stage_sends(worlds, world, pp, schedule, stages_per_rank, sequence_parallel):
    """The stages are built with their shapes, so torch's pipelining receives no pickled description."""
    results = worlds[world].run(steps_without_unpickling, schedule, stages_per_rank, sequence_parallel, pp=pp)
    (step, autocast, evaluation), (expected, expected_autocast) = results[0]
    assert all(r == results[0] for r in results)  # every rank of the pipeline gets the same losses
    assert abs(step - expected) <= 1e-5 * expected and evaluation == step  # no optimizer step in between
    assert abs(autocast - expected_autocast) <= 2e-2 * expected_autocast  # bfloat16 round-off


def in_flight(schedule, microbatches):
    """Each stage's peak number of micro-batches held between their forward and their backward."""
    tensorpar.manual_seed(0)
    cfg = GPTConfig(n_layer=tensorpar.current_mesh().pp, n_head=2, n_embd=8, vocab_size=16, block_size=4)
    pipe = PipelinedGPT(cfg).pipeline(schedule, microbatches)
    idx = torch.randint(0, 16, (microbatches, 4))
    pipe.step(idx, idx)
    return [(t.stage, t.peak_in_flight) for t in pipe.times()]


@pytest.mark.parametrize("world", [2, 4])
def test_gpipe_holds_every_micro_batch_and_1f1b_at_most_the_stages_ahead(worlds, world):
    m = 2 * world
    gpipe = dict(s for rank in worlds[world].run(in_flight, "gpipe", m, pp=world) for s in rank)
    one_f_one_b = dict(s for rank in worlds[world].run(in_flight, "1f1b", m, pp=world) for s in rank)
    assert gpipe == dict.fromkeys(range(world), m)
    assert one_f_one_b == {s: world - s for s in range(world)}  # stage s: p - s warm-up forwards


def misuse():
    tensorpar.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=16, block_size=4)
    model = PipelinedGPT(cfg)
    messages = []
    for call in (lambda: model.pipeline("zigzag", 2), lambda: model.pipeline("1f1b", 1),
                 lambda: model.pipeline("gpipe", 2).step(torch.zeros(3, 4, dtype=torch.long),
                                                         torch.zeros(3, 4, dtype=torch.long)),
                 lambda: PipelinedGPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=16, block_size=4)),
                 lambda: model.pipeline("gpipe", 2, wrap=None).step(torch.zeros(2, 4), torch.zeros(2, 4))):
        try:
            call()
            messages.append(None)
        except (ValueError, TypeError, RuntimeError) as e:
            messages.append(f"{type(e).__name__}: {e}")
    return messages


def test_pipeline_misuse_is_a_clear_error(worlds):
    messages = worlds[2].run(misuse, pp=2)[0]
    assert messages[0] == "ValueError: schedule must be one of ('gpipe', '1f1b', 'interleaved'), got 'zigzag'"
    assert messages[1] == ("ValueError: the 1f1b schedule needs at least as many micro-batches as stages: "
                           "microbatches (1) is smaller than pp (2)")
    assert messages[2] == ("ValueError: the batch of 3 rows (inputs) does not split into microbatches (2) of "
                           "equal size")
    assert messages[3] == "ValueError: n_layer (1) is smaller than the number of pipeline stages (2)"
    assert messages[4] == "TypeError: GPT expects integer token ids, got torch.float32"


def norm_reads_only():
    """A step at pp=2 x dp=2: grad_norm before finish_gradients (refused), then after it twice, with the
    gradients before and after."""
    tensorpar.manual_seed(0)
    model = PipelinedGPT(GPTConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=16, block_size=4))
    pipe = model.pipeline("1f1b", 2)
    mesh = tensorpar.current_mesh()
    idx = torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(mesh.dp_rank))  # dp ranks differ
    pipe.step(idx[:, :-1], idx[:, 1:])
    try:
        model.grad_norm()
        refused = None
    except RuntimeError as e:
        refused = str(e)
    model.finish_gradients()
    finished = [p.grad.clone() for p in model.parameters()]
    norms = [model.grad_norm(), model.grad_norm()]
    model.finish_gradients()  # nothing left to finish: no second average, no second sum of the tied head
    same = all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), finished, strict=True))
    return refused, norms, same


def test_grad_norm_only_reads_the_finished_gradients(worlds):
    """grad_norm refuses gradients that finish_gradients has not averaged yet (alike on every rank), and
    afterwards reads them without changing them: the same norm twice, the gradients as they were."""
    for refused, (first, second), same in worlds[4].run(norm_reads_only, tp=1, dp=2, pp=2):
        assert refused.startswith("PipelinedGPT.grad_norm: the gradients of the last step are not finished")
        assert torch.equal(first, second) and same

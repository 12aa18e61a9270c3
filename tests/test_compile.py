"""torch.compile: every layer, Block and GPT compiles with ``fullgraph=True`` at tp 1-4, forward and
backward, with its collectives in the graphs as functional collectives; compiled equals eager
and equals the plain twin.

Most examples compile through AOTAutograd with graph-recording compilers (the graphs AOTAutograd
hands to inductor, run as they are), which is fast enough to draw many shapes; the functional
collectives in the forward and backward graphs are counted there and must equal what
``CommDebugMode`` (``count_collectives``) records for the eager module. The inductor examples then run the real CPU
backend on a Block and a GPT.
"""

import collections

import pytest
import torch
import torch._inductor.config
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorpar
from gpt_cases import batch, gpt_configs, twins
from layers import GPT, ColumnParallelLinear, GPTConfig, RowParallelLinear, VocabParallelEmbedding
from tensorpar.testing import TOLERANCES, assert_all_close, assert_sharded_equivalent, count_collectives
from tensorpar.testing.strategies import batch_shapes, features, tp_sizes
from test_blocks import sharded_twin
from test_fsdp import run_training, train_here

FLOATS = st.sampled_from([torch.float64, torch.float32])
#: the functional collectives in a graph, by the name ``count_collectives`` gives them
FUNCTIONAL = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
              "reduce_scatter_tensor": "reduce_scatter"}


def recording_backend(graphs):
    """An AOTAutograd backend that counts the functional collectives of the forward and backward
    graphs in ``graphs`` and runs the graphs as they are."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def compiler(phase):
        def compile_graph(gm, _inputs):
            for node in gm.graph.nodes:
                target = str(node.target)
                if node.op == "call_function" and target.startswith("_c10d_functional."):
                    op = target.split(".")[1]
                    if op in FUNCTIONAL:
                        graphs[phase][FUNCTIONAL[op]] += 1
            return make_boxed_func(gm.forward)
        return compile_graph

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"))


def eager_counts(run):
    """The collectives ``run()`` issues eagerly, by phase and op."""
    with count_collectives() as counts:
        run()
    out = {"forward": collections.Counter(), "backward": collections.Counter()}
    for r in counts.records:
        out[r.phase][r.op] += 1
    return out


def compile_(module, backend):
    """Compile ``module`` in place with ``fullgraph=True``; the graphs' collectives when recorded."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    graphs = {"forward": collections.Counter(), "backward": collections.Counter()}
    torch._inductor.config.compile_threads = 1  # no pool of compiler processes in each rank
    module.compile(fullgraph=True, backend=recording_backend(graphs) if backend == "graphs" else backend)
    return graphs


def graph_breaks():
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def layer_twins(kind, n_in, n_out, tp_opt, dtype):
    """A sharded layer and its plain twin with the same weights; the input and output shards."""
    tensorpar.manual_seed(0)
    if kind == "embedding":
        dense = torch.nn.Embedding(n_in, n_out, dtype=dtype)
        return VocabParallelEmbedding.from_embedding(dense), dense, None, None
    dense = torch.nn.Linear(n_in, n_out, dtype=dtype)
    if kind == "column":
        out = None if tp_opt else tensorpar.Shard(-1, n_out)
        return ColumnParallelLinear.from_linear(dense, gather_output=tp_opt), dense, None, out
    return RowParallelLinear.from_linear(dense, input_is_parallel=tp_opt), dense, \
        tensorpar.Shard(-1, n_in) if tp_opt else None, None


def check_compiled_layer(kind, n_in, n_out, tp_opt, lead, dtype, seed):
    torch.manual_seed(seed)
    sharded, dense, input_shard, output_shard = layer_twins(kind, n_in, n_out, tp_opt, dtype)
    x = torch.randint(0, n_in, lead or (1,)) if kind == "embedding" else torch.randn(*lead, n_in, dtype=dtype)
    if kind == "embedding":  # integer ids: no input gradient; compare output and weight gradient
        expected = eager_counts(lambda: sharded(x).sum().backward())
        sharded.weight.grad = None
        graphs = compile_(sharded, "graphs")
        y, y_dense = sharded(x), dense(x)
        y.backward(torch.ones_like(y))
        y_dense.backward(torch.ones_like(y_dense))
        w = tensorpar.full_grads(sharded)["weight"]
        errors = assert_all_close({"output": (y, y_dense), "grad weight": (w, dense.weight.grad)})
    else:
        x_in = tensorpar.shard(x, input_shard, *_n_rank()) if input_shard else x
        expected = eager_counts(lambda: sharded(x_in.clone().requires_grad_()).sum().backward())
        sharded.zero_grad()
        graphs = compile_(sharded, "graphs")
        errors = assert_sharded_equivalent(sharded, dense, x, input_shard=input_shard, output_shard=output_shard,
                                           seed=seed)
    return max(errors.values()), graph_breaks(), graphs, expected


def _n_rank():
    mesh = tensorpar.current_mesh()
    return mesh.tp, mesh.tp_rank


@settings(max_examples=4)
@given(tp=tp_sizes(), kind=st.sampled_from(["column", "row", "embedding"]), tp_opt=st.booleans(),
       dtype=FLOATS, data=st.data())
def test_layers_compile_whole_and_equal_their_plain_twins(worlds, tp, kind, tp_opt, dtype, data):
    n_in, n_out = data.draw(features(tp, 24)), data.draw(features(tp, 24))
    lead = data.draw(batch_shapes(2, 4))
    results = worlds[tp].run(check_compiled_layer, kind, n_in, n_out, tp_opt, lead, dtype,
                             data.draw(st.integers(0, 2**31)))
    for err, breaks, graphs, expected in results:
        assert err <= TOLERANCES[dtype] and breaks == 0
        assert graphs == expected  # the eager collectives, each in the compiled graphs
        if tp > 1 and kind != "embedding":
            assert sum(graphs["forward"].values()) + sum(graphs["backward"].values()) >= 1


def check_compiled_module(kind, cfg, b, t, dtype, seed, backend="graphs"):
    torch.manual_seed(seed)
    sharded, dense = sharded_twin(kind, cfg, dtype)
    x = torch.randn(b, t, cfg["n_embd"], dtype=dtype)
    expected = eager_counts(lambda: sharded(x.clone().requires_grad_()).sum().backward())
    sharded.zero_grad()
    graphs = compile_(sharded, backend)
    errors = assert_sharded_equivalent(sharded, dense, x, seed=seed)
    return max(errors.values()), graph_breaks(), graphs, expected


@settings(max_examples=4)
@given(tp=tp_sizes(), kind=st.sampled_from(["attention", "mlp", "block"]), dtype=FLOATS, data=st.data())
def test_blocks_compile_whole_with_megatrons_collectives_in_the_graphs(worlds, tp, kind, dtype, data):
    cfg = data.draw(gpt_configs(tp, max_layer=1))
    b, t = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 12))
    results = worlds[tp].run(check_compiled_module, kind, cfg, b, t, dtype, data.draw(st.integers(0, 2**31)))
    for err, breaks, graphs, expected in results:
        assert err <= TOLERANCES[dtype] and breaks == 0 and graphs == expected
        if tp > 1 and kind == "block" and cfg["n_kv_head"] >= tp:  # Megatron's 2 + 2
            assert graphs["forward"] == {"all_reduce": 2} and graphs["backward"] == {"all_reduce": 2}


def check_compiled_gpt(cfg, b, t, dtype, seed, backend, device="cpu", sequence_parallel=False, logits=True):
    """Loss, logits and every gradient of the compiled GPT against the eager GPT and the reference
    (``logits=False``: the loss and the gradients, one forward graph compiled instead of two)."""
    reference, model = (m.to(device) for m in twins(cfg, dtype, seed, sequence_parallel=sequence_parallel))
    idx, targets = (ids.to(device) for ids in batch(cfg, b, t, seed))
    eager_loss = model(idx, targets)
    eager_loss.backward()
    eager_grads = tensorpar.full_grads(model)
    model.zero_grad()
    compile_(model, backend)
    loss = model(idx, targets)
    loss.backward()
    grads = tensorpar.full_grads(model)
    ref_loss = reference(idx, targets)
    ref_loss.backward()
    ref_grads = {k: p.grad for k, p in reference.named_parameters()}
    # gradients that are zero in exact arithmetic (key biases) are measured against the whole
    # gradient's norm, as in test_gpt
    scale = torch.cat([g.flatten() for g in ref_grads.values()]).norm().item()
    pairs = {"loss vs eager": (loss, eager_loss), "loss": (loss, ref_loss)}
    if logits:
        pairs["logits"] = (model(idx), reference(idx))
    pairs |= {f"grad {k} vs eager": (grads[k], eager_grads[k], scale) for k in ref_grads}
    pairs |= {f"grad {k}": (grads[k], ref_grads[k], scale) for k in ref_grads}
    return max(assert_all_close(pairs).values()), graph_breaks()


@settings(max_examples=3)
@given(tp=tp_sizes(), dtype=FLOATS, data=st.data())
def test_gpt_compiles_whole_and_equals_eager_and_reference(worlds, tp, dtype, data):
    cfg = data.draw(gpt_configs(tp, max_layer=1))  # one block: blocks compose in the compiled training run below
    t = data.draw(st.integers(1, cfg["block_size"]))
    sp = data.draw(st.booleans(), label="sequence_parallel")
    for err, breaks in worlds[tp].run(check_compiled_gpt, cfg, 2, t, dtype, data.draw(st.integers(0, 2**31)),
                                      "graphs", "cpu", sp):
        assert err <= TOLERANCES[dtype] and breaks == 0


def test_inductor_compiles_the_gpt_on_cpu(worlds):
    """The real CPU backend, at an uneven tp: 3 heads over tp 2, a vocabulary of 37 (one layer: the
    compiled training run below compiles blocks with inductor too)."""
    cfg = dict(n_layer=1, n_head=3, n_kv_head=3, n_embd=12, vocab_size=37, block_size=8, bias=True, mlp="gelu")
    # inductor generates and builds C++ kernels in each rank: a minute or more on a busy machine. The loss
    # and its gradients only: the logits graph is checked by the property test above.
    for err, breaks in worlds[2].run(check_compiled_gpt, cfg, 2, 7, torch.float64, 1, "inductor", "cpu", False,
                                     False, timeout=600):
        assert err <= TOLERANCES[torch.float64] and breaks == 0


def train_counting_graphs(argv):
    """The training script on this rank; its result with the graphs compiled and broken on the way."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    result = train_here(argv)
    return result | {"graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"], "graph_breaks": graph_breaks()}


def test_training_with_compiled_blocks_follows_the_eager_trajectory(worlds, tmp_path):
    """``train_gpt.py --compile`` (inductor, each block whole) at tp=2 against the eager tp=1 run."""
    eager, _ = run_training(worlds, tmp_path / "eager", 1, 1, sample_tokens=0)
    compiled, _ = run_training(worlds, tmp_path / "compiled", 2, 1, sample_tokens=0, compile=True,
                               rank_fn=train_counting_graphs)
    assert compiled["graphs"] >= 1 and compiled["graph_breaks"] == 0
    for step, loss in eager["losses"].items():
        assert abs(compiled["losses"][step] - loss) <= 1e-5 * abs(loss), f"step {step}: loss differs"
    size = torch.cat([v.flatten() for v in eager["state"].values()]).norm().item()
    assert_all_close({k: (compiled["state"][k], v, size) for k, v in eager["state"].items()}, rtol=1e-5,
                     what="parameters differ from the eager tp=1 run")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("tp", [1, 2])
def test_inductor_compiles_the_gpt_on_cuda(worlds, tp):
    """CUDA tensors (at tp=2 the pool's gloo group stages them through host memory)."""
    cfg = dict(n_layer=2, n_head=3, n_kv_head=3, n_embd=12, vocab_size=37, block_size=8, bias=True, mlp="gelu")
    for err, breaks in worlds[tp].run(check_compiled_gpt, cfg, 2, 7, torch.float32, 1, "inductor", "cuda",
                                      timeout=600):
        assert err <= TOLERANCES[torch.float32] and breaks == 0


def attention_by_hand(dense, x, keep, p):
    """The plain twin's attention written out, its probabilities dropped by the mask ``keep``."""
    b, t, _ = x.shape
    h, d = dense.n_head, dense.head_dim
    kv = dense.n_kv_head * d
    q, k, v = (z.view(b, t, -1, d).transpose(1, 2) for z in dense.c_attn(x).split([h * d, kv, kv], dim=-1))
    k, v = (z.repeat_interleave(h // z.shape[1], dim=1) for z in (k, v))  # grouped-query: a KV head per group
    scores = (q @ k.transpose(-2, -1)) / d ** 0.5
    probs = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    return dense.c_proj(((probs * keep / (1 - p)) @ v).transpose(1, 2).reshape(b, t, h * d))


def check_compiled_attention_dropout(cfg, b, t, p, seed):
    """The compiled attention drops its heads' slice of one mask for all heads, drawn from the
    default generator: the plain twin fed that mask gives the same output and input gradient."""
    torch.manual_seed(seed)
    sharded, dense = sharded_twin("attention", cfg, torch.float64)
    sharded.dropout = p  # on the probabilities alone (the twins are built without dropout)
    compile_(sharded, "graphs")
    x = torch.randn(b, t, cfg["n_embd"], dtype=torch.float64)
    xs, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(seed + 1)
    y = sharded(xs)
    torch.manual_seed(seed + 1)
    keep = torch.rand(b, cfg["n_head"], t, t) >= p
    y_dense = attention_by_hand(dense, xd, keep, p)
    y.sum().backward()
    y_dense.sum().backward()
    errors = assert_all_close({"output": (y, y_dense), "input grad": (xs.grad, xd.grad)})
    return max(errors.values()), graph_breaks()


@settings(max_examples=4)
@given(tp=tp_sizes(), data=st.data())
def test_compiled_attention_dropout_draws_each_heads_mask_once(worlds, tp, data):
    cfg = data.draw(gpt_configs(tp, max_layer=1)) | {"positions": "learned"}  # attention_by_hand: no rotation
    b, t = data.draw(st.integers(1, 3)), data.draw(st.integers(2, 9))
    for err, breaks in worlds[tp].run(check_compiled_attention_dropout, cfg, b, t, 0.5,
                                      data.draw(st.integers(0, 2**31))):
        assert err <= TOLERANCES[torch.float64] and breaks == 0


def compiled_bitwise_gpt(cfg):
    """A bitwise GPT with each block compiled whole by the graph-recording backend: loss, gradients and
    graph breaks."""
    tensorpar.manual_seed(0)
    model = GPT(GPTConfig(**cfg))
    for block in model.transformer.h:
        compile_(block, "graphs")
    idx, targets = batch(cfg, 2, 7, 0)
    loss = model(idx, targets)
    loss.backward()
    return {"loss": loss.detach()} | tensorpar.full_grads(model), graph_breaks()


def test_the_bitwise_mode_compiles_whole_and_keeps_its_bits(worlds):
    """In bitwise mode a block compiles with fullgraph=True, and graphs that run as traced keep tp = 1's bits
    at tp = 3, with one KV head for three query heads (inductor's fused kernels do not: see the README)."""
    cfg = dict(n_layer=1, n_head=3, n_kv_head=1, n_embd=12, vocab_size=37, block_size=8, bias=True, mlp="gelu")
    one, breaks = worlds[1].run(compiled_bitwise_gpt, cfg, bitwise=True)[0]
    assert breaks == 0
    for got, breaks in worlds[3].run(compiled_bitwise_gpt, cfg, bitwise=True):
        assert breaks == 0 and all(torch.equal(got[k], v) for k, v in one.items())


def compiled_decoding(cfg, steps):
    """The last position's logits (B, 1 + steps, V) of a prefill and ``steps`` greedy decode steps through the
    KV cache, eager and with the GPT compiled whole; the compiled run's graph breaks and graphs."""
    _, model = twins(cfg, torch.float32, 0)
    model.eval()
    idx = torch.randint(0, cfg["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(1))

    def decode():
        cache = model.new_cache(2)
        logits = [model(idx, cache=cache)[:, -1]]  # (B, V)
        for _ in range(steps):
            logits.append(model(logits[-1].argmax(-1, keepdim=True), cache=cache)[:, -1])
        return torch.stack(logits, 1)

    with torch.no_grad():
        eager = decode()
        compile_(model, "graphs")
        compiled = decode()
    return eager, compiled, graph_breaks(), torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("tp", [1, 2])
def test_decoding_through_the_kv_cache_compiles_once_for_every_length(worlds, tp):
    """The cache is preallocated, so a decode step compiles whole (fullgraph) and is not compiled again as the
    rows grow: one graph for the prefill and one for every decode step after it, equal to eager."""
    cfg = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=16, vocab_size=37, block_size=16, bias=True, mlp="gelu")
    for eager, compiled, breaks, graphs in worlds[tp].run(compiled_decoding, cfg, 8):
        assert breaks == 0 and graphs == 2, (breaks, graphs)
        torch.testing.assert_close(compiled, eager, rtol=TOLERANCES[torch.float32], atol=1e-6)

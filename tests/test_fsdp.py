"""FSDP2 on the dp dimension with tensor parallelism inside (``tensorpar.fully_shard_dp``).

Against the plain unsharded GPT (``reference_gpt``) fed the whole global batch: full state
dicts load and gather exactly, the gradient norm and clipped gradients equal
``torch.nn.utils.clip_grad_norm_``'s, an AdamW step lands on the same parameters; parameters,
gradients and optimizer state really are split over dp; and the training script with
``--fsdp`` follows the tp=1 dp=1 trajectory. Layouts (tp, dp) up to a world of 4, with
hypothesis-drawn shapes that do not divide by tp or dp.
"""

import json
import math
import runpy
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import DTensor

import tensorpar
from gpt_cases import batch, gpt_configs
from layers import GPT, GPTConfig
from reference_gpt import RefConfig, RefGPT
from tensorpar import checkpoint
from tensorpar.testing import assert_all_close

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"

#: (tp, dp) layouts that fit a world of at most 4 ranks
LAYOUTS = [(2, 2), (1, 4), (3, 1), (1, 2), (2, 1), (1, 3)]


def fsdp_twins(cfg, seed):
    """A plain ``RefGPT`` from ``seed`` (float64), and a sharded GPT under FSDP2 on the current
    mesh into which the plain weights were loaded *after* sharding."""
    torch.manual_seed(seed)
    ref = RefGPT(RefConfig(**cfg)).double()
    model = GPT(GPTConfig(**cfg), dtype=torch.float64)  # its own initial weights, replaced below
    tensorpar.fully_shard_dp(model, modules=model.transformer.h)
    model.load_full_state_dict(ref.state_dict())
    return ref, model


def dp_batches(cfg, seed, dp):
    """One (idx, targets) part of 2 sequences per dp rank, each with at least one counted target."""
    return [batch(cfg, 2, cfg["block_size"], seed + r) for r in range(dp)]


def check_round_trip(cfg, seed):
    """Under FSDP2: the loaded full state dict comes back bitwise, and the logits are the plain model's."""
    ref, model = fsdp_twins(cfg, seed)
    full = model.full_state_dict()
    exact = sorted(full) == sorted(ref.state_dict()) and all(
        torch.equal(full[k], v) for k, v in ref.state_dict().items())
    idx, _ = batch(cfg, 2, cfg["block_size"], seed)
    logits = model(idx)  # (B, T, V): all-gathered over dp, then gathered over tp
    with torch.no_grad():
        expected = ref(idx)
    return exact, assert_all_close({"logits": (logits, expected)})["logits"]


@settings(max_examples=6)
@given(layout=st.sampled_from(LAYOUTS), data=st.data())
def test_full_state_dict_round_trips_under_fsdp(worlds, layout, data):
    tp, dp = layout
    cfg = data.draw(gpt_configs(tp, max_layer=2))
    results = worlds[tp * dp].run(check_round_trip, cfg, data.draw(st.integers(0, 2**31)), tp=tp, dp=dp)
    assert all(exact for exact, _ in results), "full_state_dict under FSDP2 differs from what was loaded"
    assert max(err for _, err in results) <= 1e-10


def local_bytes(tensors):
    """Bytes of the distinct storages behind these tensors' local parts (FSDP2 pads each dp chunk)."""
    storages = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def check_step(cfg, seed, max_norm):
    """One clipped AdamW step of the FSDP2 GPT on this rank's dp part, against the plain model on
    the whole batch; then what this rank stores of parameters, gradients and optimizer state."""
    mesh = tensorpar.current_mesh()
    ref, model = fsdp_twins(cfg, seed)
    parts = dp_batches(cfg, seed, mesh.dp)
    loss = model(*parts[mesh.dp_rank])
    loss.backward()  # gradients reduce-scattered (averaged) over dp
    ref_losses = [ref(idx, targets) for idx, targets in parts]
    (sum(ref_losses) / mesh.dp).backward()  # the mean of the dp ranks' mean losses, as FSDP averages
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    norm = tensorpar.clip_grad_norm_(model, max_norm)
    grads = tensorpar.full_grads(model)
    options = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), **options)
    optimizer.step()
    torch.optim.AdamW(ref.parameters(), **options).step()
    after = model.full_state_dict()

    params = list(model.parameters())  # the registered (sharded) parameters, tied ones once
    states = [v for p in params for v in optimizer.state[p].values() if v.dim() > 0]  # exp_avg, exp_avg_sq
    padded = sum(math.ceil(p.shape[0] / mesh.dp) * (p.numel() // p.shape[0]) * p.element_size() for p in params)
    stored = {"tp_shard": sum(p.numel() * p.element_size() for p in params),  # the DTensors' global size
              "padded": padded,  # this rank's dp chunks of it, each ⌈d0 / dp⌉ rows
              "row": sum(p.numel() // p.shape[0] * p.element_size() for p in params),  # one row of each
              "param_numel": sum(p.to_local().numel() for p in params),
              "params": local_bytes(params), "grads": local_bytes([p.grad for p in params]),
              "optimizer": local_bytes(states),
              "dtensors": all(isinstance(p, DTensor) and isinstance(p.grad, DTensor) for p in params)
              and all(isinstance(s, DTensor) for s in states)}

    scale = torch.cat([p.grad.flatten() for p in ref.parameters()]).norm().item()  # see test_gpt: zero grads
    size = torch.cat([p.flatten() for p in ref.parameters()]).norm().item()
    pairs = {"norm": (norm.double(), expected)}
    pairs |= {f"grad {k}": (grads[k], p.grad, scale) for k, p in ref.named_parameters()}
    # the norm is accumulated in float32 and scales the clipped gradients: 1e-6 for both
    errors = assert_all_close(pairs, rtol=1e-6)
    # AdamW divides each gradient by its own root mean square, which undoes the float32 clipping factor:
    # float64's 1e-10, measured against the whole model's norm (some entries are zero or nearly)
    pairs = {f"param {k}": (after[k], p, size) for k, p in ref.state_dict().items()}
    errors |= assert_all_close(pairs | {"loss": (loss, ref_losses[mesh.dp_rank])}, rtol=1e-10)
    return max(errors.values()), norm.item(), stored


@settings(max_examples=8)
@given(layout=st.sampled_from(LAYOUTS), data=st.data())
def test_clipping_and_a_step_under_fsdp_match_the_unsharded_model(worlds, layout, data):
    tp, dp = layout
    cfg = data.draw(gpt_configs(tp, max_layer=2))
    max_norm = data.draw(st.sampled_from([0.05, 100.0]))  # clipping active, and not
    results = worlds[tp * dp].run(check_step, cfg, data.draw(st.integers(0, 2**31)), max_norm, tp=tp, dp=dp)
    assert max(err for err, _, _ in results) <= 1e-6
    assert len({norm for _, norm, _ in results}) == 1, "the ranks disagree on the gradient norm"


@settings(max_examples=3)
@given(layout=st.sampled_from([(2, 2), (1, 4)]), data=st.data())
def test_parameters_gradients_and_optimizer_state_are_sharded_over_dp(worlds, layout, data):
    """Each rank stores its dp chunk of its tp shard: the chunks of one tp shard partition it
    exactly, and a rank's storage is at most its padded chunks, about 1/dp of the tp shard."""
    tp, dp = layout
    cfg = data.draw(gpt_configs(tp, max_layer=2))
    results = worlds[tp * dp].run(check_step, cfg, data.draw(st.integers(0, 2**31)), 1.0, tp=tp, dp=dp)
    stored = [s for _, _, s in results]
    assert all(s["dtensors"] for s in stored), "a parameter, gradient or optimizer state is not sharded"
    for tp_rank in range(tp):  # ranks tp_rank, tp_rank + tp, ... hold the dp chunks of one tp shard
        chunks = stored[tp_rank::tp]
        itemsize = torch.finfo(torch.float64).bits // 8
        assert sum(s["param_numel"] for s in chunks) * itemsize == chunks[0]["tp_shard"]
    for s in stored:
        assert s["params"] <= s["padded"] and s["grads"] <= s["padded"] and s["optimizer"] <= 2 * s["padded"]
        # ⌈d0 / dp⌉ ≤ d0 / dp + 1 rows: 1/dp of the tp shard, plus at most one row of each parameter
        assert s["params"] <= s["tp_shard"] / dp + s["row"] and s["grads"] <= s["tp_shard"] / dp + s["row"]


def train_here(argv):
    """The training script's ``train`` on this rank, as its ``main`` runs it under torchrun; rank 0
    returns the losses and gradient norms and the final unsharded parameters (gathered in-process:
    as the script's own final full state dict)."""
    script = runpy.run_path(str(SCRIPT), run_name="train_gpt")  # its functions; main() does not run
    cfg = script["parse_args"](argv)
    tensorpar.init(cfg.tp, cfg.dp)
    return script["train"](cfg)


#: a small run: 5 steps, 2 micro-batches, clipping active; 3 heads of 10 (uneven over tp=2, and
#: 30 features in chunks of 8, 8, 8, 6 over dp=4)
SMALL = dict(steps=5, batch_size=8, grad_accum=2, block_size=16, n_layer=2, n_head=3, n_embd=30, warmup=2,
             clip=0.5, sample_tokens=6, progress=False)


def run_training(worlds, out, tp, dp, *, rank_fn=train_here, **options):
    argv = [(f"--{k}" if v else f"--no-{k}") if isinstance(v, bool) else f"--{k}={v}"
            for k, v in ((k.replace("_", "-"), v) for k, v in (SMALL | options | dict(tp=tp, dp=dp, out=out)).items())]
    result = worlds[tp * dp].run(rank_fn, argv, timeout=300)[0]
    return result, (Path(out) / "metrics.jsonl").read_text().splitlines()


@pytest.fixture(scope="module")
def reference_run(worlds, tmp_path_factory):
    """tp=1, dp=1, no FSDP: the whole batch of each step in one process."""
    return run_training(worlds, tmp_path_factory.mktemp("reference"), 1, 1)


@pytest.mark.parametrize("tp, dp", [(2, 2), (1, 4)])
def test_fsdp_training_follows_the_tp1_trajectory(worlds, reference_run, tmp_path, tp, dp):
    reference, _ = reference_run
    result, logged = run_training(worlds, tmp_path, tp, dp, fsdp=True)
    rows = [json.loads(line) for line in logged]
    assert [r["step"] for r in rows] == list(range(1, SMALL["steps"] + 1))
    assert max(reference["grad_norms"].values()) > SMALL["clip"], "clipping was not active"
    for r in rows:
        loss, norm = reference["losses"][r["step"]], reference["grad_norms"][r["step"]]
        assert abs(r["loss"] - loss) <= 1e-5 * abs(loss), f"step {r['step']}: loss differs"
        assert abs(r["grad_norm"] - norm) <= 1e-5 * norm, f"step {r['step']}: gradient norm differs"
    expected = reference["state"]
    size = torch.cat([v.flatten() for v in expected.values()]).norm().item()
    errors = assert_all_close({k: (result["state"][k], v, size) for k, v in expected.items()}, rtol=1e-5,
                              what="parameters differ from the tp=1 dp=1 run")
    assert sorted(result["state"]) == sorted(expected) and max(errors.values()) <= 1e-5
    assert result["sample"] == reference["sample"]  # generate() works on the FSDP2 model
    saved = checkpoint.export_state_dict(tmp_path)  # the last checkpoint, written by every rank, its own shards
    assert all(torch.equal(saved[k], v) for k, v in result["state"].items())


def test_bad_arguments_get_clear_errors(capsys):
    with pytest.raises(TypeError, match=r"expects an nn\.Module, got str"):
        tensorpar.fully_shard_dp("model")
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"modules\[1\] \(Linear\) is not a submodule of the model"):
        tensorpar.fully_shard_dp(model, modules=[model[0], nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="more than once"):
        tensorpar.fully_shard_dp(model, modules=[model[0], model[0]])
    with pytest.raises(TypeError, match="reshard_after_forward must be a bool"):
        tensorpar.fully_shard_dp(model, reshard_after_forward=2)
    parse_args = runpy.run_path(str(SCRIPT), run_name="train_gpt")["parse_args"]
    assert parse_args(["--fsdp", "--tp=2", "--dp=2"]).fsdp
    with pytest.raises(SystemExit):
        parse_args(["--fsdp", "--zero"])
    assert "--fsdp and --zero exclude each other" in capsys.readouterr().err

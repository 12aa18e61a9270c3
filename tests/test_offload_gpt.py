"""The sharded GPT with its optimizer in host memory (FSDP2's ``CPUOffloadPolicy`` over dp, tp inside) on
the pool's ranks: its trajectory at tp=2 against the plain ``RefGPT`` trained with torch's AdamW, a
checkpoint saved at tp=2 resumed at tp=1 x dp=2, and what ``train_gpt.py --offload-optimizer`` builds.
test_offload.py says what offloading means on this CPU-only machine and what the tests can see of it."""

import runpy
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.optim import ZeroRedundancyOptimizer

import tensorpar
from gpt_cases import batch, twins
from offload_cases import ADAMW, LRS, groups, train
from tensorpar import checkpoint
from tensorpar.testing import assert_all_close
from test_offload import offload_flags, placements

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"

# No biases: a key bias has a zero gradient in exact arithmetic, so AdamW's update of it is round-off over
# round-off, of the order of lr, in two runs whose sums run in different orders (no tolerance holds it).
GPT_CFG = dict(n_layer=2, n_head=3, n_kv_head=3, n_embd=12, vocab_size=29, block_size=6, bias=False, mlp="gelu")


def gpt_loss(model, step):
    """Every dp rank takes the step's whole batch (the reference's), so the dp average is exact."""
    idx, targets = batch(GPT_CFG, 2, GPT_CFG["block_size"], step)
    return model(idx, targets)


def offloaded_gpt(seed):
    """The sharded GPT (weights from ``seed``'s plain model) under FSDP2 with CPU offload over dp, each block
    its own unit, and torch's AdamW over its shards; the plain model."""
    ref, model = twins(GPT_CFG, torch.float32, seed)
    tensorpar.fully_shard_dp(model, modules=model.transformer.h, offload_policy=CPUOffloadPolicy(pin_memory=False))
    return model, torch.optim.AdamW(groups(model.parameters()), lr=LRS[0], **ADAMW), ref


def gpt_trajectories():
    """Five steps of the offloaded GPT, of the same sharded GPT without FSDP2 (whether bitwise the same),
    and of the plain GPT: (bitwise, the worst parameter and loss errors against the plain, FSDP2's flags)."""
    model, optimizer, ref = offloaded_gpt(0)
    twin = twins(GPT_CFG, torch.float32, 0)[1]
    losses = train(model, optimizer, 5, gpt_loss)
    same = train(twin, torch.optim.AdamW(groups(twin.parameters()), lr=LRS[0], **ADAMW), 5, gpt_loss) == losses
    full, here = tensorpar.full_state_dict(model), tensorpar.full_state_dict(twin)
    same &= all(torch.equal(full[k], v) for k, v in here.items())
    ref_losses = train(ref, torch.optim.AdamW(groups(ref.parameters()), lr=LRS[0], **ADAMW), 5, gpt_loss)
    expected = ref.state_dict()
    norm = torch.cat([v.flatten() for v in expected.values()]).norm().item()
    errors = assert_all_close({k: (full[k], v, norm) for k, v in expected.items()}, rtol=1e-5)
    losses_off = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    return same, max(errors.values()), losses_off, offload_flags(model)


def test_the_sharded_gpt_follows_torch_adamw_at_tp_2(worlds):
    """Bitwise the same sharded GPT trained with torch's AdamW without FSDP2; within float32's 1e-5
    (norm-wise, each tensor against the whole model's norm where that is larger) of the plain GPT, whose
    sums run in another order."""
    for same, params, losses, flags in worlds[2].run(gpt_trajectories, tp=2):
        assert same and params <= 1e-5 and losses <= 1e-5, (same, params, losses)
        assert flags and all(flags)


def save_at_step_2(out):
    """Steps 0-1, a checkpoint, steps 2-3: the full weights at the end."""
    model, optimizer, _ = offloaded_gpt(0)
    train(model, optimizer, 2, gpt_loss)
    checkpoint.save(out, model, optimizer, step=2)
    train(model, optimizer, 2, gpt_loss, first=2)
    return tensorpar.full_state_dict(model)


def resume_at_step_2(out):
    """Load into an offloaded GPT of other weights at the current layout, then steps 2-3: whether every
    parameter and AdamW moment is a dp shard in host memory after loading, and the full weights."""
    model, optimizer, _ = offloaded_gpt(7)
    checkpoint.load(out, model, optimizer)
    where = placements(model, optimizer)
    loaded = all(sharded and devices == {"cpu"} and moments == 2
                 for _, _, devices, sharded, _, moments in where.values())
    train(model, optimizer, 2, gpt_loss, first=2)
    return loaded, tensorpar.full_state_dict(model)


def test_a_checkpoint_resumes_at_another_layout(worlds, tmp_path):
    """Saved at tp=2, resumed at tp=1 x dp=2 (each dp rank takes the same batches): the AdamW state comes
    back into host memory as each rank's dp shards, and the resumed run ends within float32's 1e-5 of the
    uninterrupted one (their sums run in another order)."""
    straight = worlds[2].run(save_at_step_2, str(tmp_path), tp=2)[0]
    norm = torch.cat([v.flatten() for v in straight.values()]).norm().item()
    for loaded, resumed in worlds[2].run(resume_at_step_2, str(tmp_path), tp=1, dp=2):
        errors = assert_all_close({k: (resumed[k], v, norm) for k, v in straight.items()}, rtol=1e-5)
        assert loaded and max(errors.values()) <= 1e-5


def built_by_the_script(argv):
    """``train_gpt.py``'s model and optimizer for ``argv``: FSDP2's offload flags, the optimizer's class,
    and whether it steps the model's own (FSDP2) parameters."""
    script = runpy.run_path(str(SCRIPT), run_name="train_gpt")  # its functions; main() does not run
    cfg = script["parse_args"](argv)
    model, optimizer = script["build"](cfg, tensorpar.current_mesh())
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return offload_flags(model), type(optimizer), stepped == {id(p) for p in model.parameters()}


@pytest.mark.parametrize("extra", [[], ["--zero"], ["--fsdp"]])
def test_the_training_script_offloads_through_fsdp2(worlds, extra):
    """``--offload-optimizer`` (with --zero, whose dp shards of the state FSDP2 makes, or --fsdp) builds the
    GPT under FSDP2 with every parameter offloaded, and torch's AdamW over those parameters."""
    argv = ["--tp=1", "--dp=2", "--n-layer=2", "--n-head=2", "--n-embd=8", "--offload-optimizer", *extra]
    for flags, kind, stepped in worlds[2].run(built_by_the_script, argv, tp=1, dp=2):
        assert flags and all(flags) and kind is torch.optim.AdamW and kind is not ZeroRedundancyOptimizer
        assert stepped


def test_the_options_say_what_offloading_implies(capsys):
    parse_args = runpy.run_path(str(SCRIPT), run_name="train_gpt")["parse_args"]
    cfg = parse_args(["--tp=1", "--dp=2", "--offload-optimizer", "--zero"])
    assert cfg.fsdp and not cfg.zero  # FSDP2's dp shards of the AdamW state stand for ZeRO's
    with pytest.raises(SystemExit):
        parse_args(["--offload-optimizer", "--bitwise"])
    assert "--bitwise does not take --offload-optimizer: it runs through FSDP2" in capsys.readouterr().err

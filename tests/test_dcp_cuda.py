"""Checkpoints of CUDA models: NCCL at world size 1, gloo over CUDA tensors at world size 2; saved at
one, loaded at the other, and at the same one with the CUDA generators restored.

Skipped where no CUDA device is present; everything they check also runs on CPU in test_dcp."""

import pytest
import torch
from checkpoint_cases import bitwise_equal

import tensorpar
from layers import GPT, GPTConfig
from tensorpar import checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

CFG = dict(n_layer=1, n_head=3, n_kv_head=3, n_embd=12, vocab_size=29, block_size=8, bias=True, mlp="gelu",
           dropout=0.1)


def trained(seed, device):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**CFG), device=device)
    optimizer = torch.optim.AdamW(model.parameters())
    idx = torch.randint(0, CFG["vocab_size"], (2, CFG["block_size"]), device=device)
    model(idx, idx).backward()  # dropout draws from the CUDA generators
    optimizer.step()
    return model, optimizer


def draws(mesh, device):
    with mesh.rng.fork(device):
        tp = torch.rand(4, device=device)
    return torch.rand(4, device=device).cpu(), tp.cpu()


def round_trip(mine, theirs, device="cuda"):
    """Save here; load it into another model here (generators restored) and the other world's checkpoint
    (saved at another tp): each bitwise the checkpoint's own unsharded export."""
    mesh = tensorpar.init()
    model, optimizer = trained(0, device)
    checkpoint.save(mine, model, optimizer, step=1)
    after_save = draws(mesh, device)
    state = [{k: v.cpu() for k, v in optimizer.state[p].items()} for p in model.parameters()]
    other, other_optimizer = trained(1, device)
    checkpoint.load(mine, other, other_optimizer)
    after_load = draws(mesh, device)
    loaded = [{k: v.cpu() for k, v in other_optimizer.state[p].items()} for p in other.parameters()]
    same = [bitwise_equal(after_save, after_load), bitwise_equal(state, loaded),
            bitwise_equal({k: v.cpu() for k, v in tensorpar.full_state_dict(other).items()},
                          checkpoint.export_state_dict(mine))]
    if theirs is not None:
        third = trained(2, device)[0]
        checkpoint.load(theirs, third)
        same.append(bitwise_equal({k: v.cpu() for k, v in tensorpar.full_state_dict(third).items()},
                                  checkpoint.export_state_dict(theirs)))
    return all(same)


def test_cuda_checkpoints_round_trip_and_reshard(tmp_path):
    one, two = str(tmp_path / "nccl"), str(tmp_path / "gloo")
    assert all(tensorpar.spawn(round_trip, 1, one, None, backend="nccl"))
    assert all(tensorpar.spawn(round_trip, 2, two, one, backend="gloo"))
    assert all(tensorpar.spawn(round_trip, 1, str(tmp_path / "again"), two, backend="nccl"))

"""Checkpoints of CUDA models, each load compared bitwise with the live model and optimizer it was saved
from (never with the checkpoint's own view of itself): NCCL at world size 1, gloo over CUDA tensors at
world size 2, saved at one and loaded at the other; a GPT-2 124M model with its AdamW state and
generators; a run stopped and resumed against the same run uninterrupted.

Skipped where no CUDA device is present. The same code paths run on CPU in test_checkpoint_memory
(tensors of any strides; on CUDA each chunk is copied to the host before DCP writes it) and test_dcp
(resharding, resuming with the generators restored)."""

import os

import pytest
import torch

import tensorpar
from checkpoint_cases import bitwise_equal
from gpt_cases import batch
from layers import GPT, GPTConfig
from tensorpar import checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

CFG = dict(n_layer=1, n_head=3, n_kv_head=3, n_embd=12, vocab_size=29, block_size=8, bias=True, mlp="gelu",
           dropout=0.1)
GPT2 = dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, block_size=1024)  # GPT-2 124M


def trained(seed, device, cfg=CFG, steps=1, tokens=None):
    """A GPT of ``cfg`` from ``seed`` and its AdamW after ``steps`` steps on random batches."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**cfg), device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(steps):
        idx = torch.randint(0, cfg["vocab_size"], (2, tokens or cfg["block_size"]), device=device)
        model(idx, idx).backward()  # dropout draws from the CUDA generators
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def on_host(tensors):
    return {k: v.detach().cpu() for k, v in tensors.items()}


def tensors_of(model, optimizer):
    """The live tensors of this rank's model and optimizer, by name (no copies)."""
    names = {id(p): n for n, p in model.named_parameters()}
    found = {f"model.{k}": v for k, v in model.state_dict(keep_vars=True).items()}
    for p, fields in optimizer.state.items():
        found |= {f"optim.{names[id(p)]}.{field}": v for field, v in fields.items()}
    return found


def generators(mesh):
    """torch's CPU and CUDA generators and the mesh's tp streams, as a checkpoint records them."""
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(),
            "tp": tensorpar.random.tracker(mesh).state_dict()}


def draws(mesh, device):
    with tensorpar.random.tracker(mesh).fork(device):
        tp = torch.rand(4, device=device)
    return torch.rand(4, device=device).cpu(), tp.cpu()


def round_trip(mine, theirs, their_model, device="cuda"):
    """Save here and load into another model and optimizer here (generators restored): each tensor of
    both, the full model and the next draws bitwise the live ones. Then load ``theirs`` (saved by the
    other world, at another tp) into a third model: its full model bitwise ``their_model``, the full
    model that world saved. Returns (all equal, the full model saved here)."""
    mesh = tensorpar.init()
    model, optimizer = trained(0, device)
    live_full = on_host(tensorpar.full_state_dict(model))  # a collective
    checkpoint.save(mine, model, optimizer, step=1)
    after_save = draws(mesh, device)
    other, other_optimizer = trained(1, device, steps=2)
    checkpoint.load(mine, other, other_optimizer)
    after_load = draws(mesh, device)
    live, loaded = tensors_of(model, optimizer), tensors_of(other, other_optimizer)
    same = [len(live) > 0, bitwise_equal(after_save, after_load), bitwise_equal(live, loaded),
            bitwise_equal(live_full, on_host(tensorpar.full_state_dict(other)))]
    if theirs is not None:
        third = trained(2, device)[0]
        checkpoint.load(theirs, third)
        same.append(bitwise_equal(on_host(tensorpar.full_state_dict(third)), their_model))
    return all(same), live_full


def test_cuda_checkpoints_round_trip_and_reshard(tmp_path):
    one, two, again = str(tmp_path / "nccl"), str(tmp_path / "gloo"), str(tmp_path / "again")
    (ok, saved_one), = tensorpar.spawn(round_trip, 1, one, None, None, backend="nccl")
    assert ok
    rows = tensorpar.spawn(round_trip, 2, two, one, saved_one, backend="gloo")
    assert all(ok for ok, _ in rows)
    assert all(ok for ok, _ in tensorpar.spawn(round_trip, 1, again, two, rows[0][1], backend="nccl"))


# --- GPT-2 124M: every tensor and generator state against the live ones -------------------------------

def gpt2_round_trip(out):
    """GPT-2 124M on CUDA after two AdamW steps, saved and loaded into another (two steps from another
    seed): the names of the tensors that differ from the live ones, whether the generators are those
    at the save, the number and bytes of the tensors compared, whether those of the model and of its
    moments are on CUDA, and the model's number of parameters."""
    mesh = tensorpar.init()
    model, optimizer = trained(0, "cuda", GPT2, steps=2, tokens=128)
    at_save = generators(mesh)
    checkpoint.save(out, model, optimizer, step=2)
    fresh, fresh_optimizer = trained(1, "cuda", GPT2, steps=2, tokens=128)  # the generators move on
    torch.rand(3), torch.rand(3, device="cuda")
    live, before = tensors_of(model, optimizer), tensors_of(fresh, fresh_optimizer)
    assert not bitwise_equal(at_save, generators(mesh))
    assert before.keys() == live.keys() and not bitwise_equal(before, live)
    checkpoint.load(out, fresh, fresh_optimizer)
    loaded = tensors_of(fresh, fresh_optimizer)
    wrong = sorted(k for k in live if k not in loaded or not bitwise_equal(live[k], loaded[k]))
    nbytes = sum(v.numel() * v.element_size() for v in live.values())
    on_cuda = all(v.is_cuda for v in live.values() if v.dim())  # AdamW keeps its step counters on the host
    params = sum(p.numel() for p in model.parameters())
    return wrong, bitwise_equal(at_save, generators(mesh)), len(live), nbytes, on_cuda, params


def test_a_gpt2_checkpoint_on_cuda_loads_bitwise(tmp_path):
    (wrong, same_generators, count, nbytes, on_cuda, params), = tensorpar.spawn(gpt2_round_trip, 1, str(tmp_path),
                                                                                 backend="nccl")
    assert not wrong and same_generators and on_cuda, wrong
    assert params > 124_000_000 and nbytes > 3 * params * 4, (params, nbytes)  # float32 weights and both moments
    assert count > 3 * 12 * 12, count  # 12 blocks of at least 12 parameters, each with 2 moments and a step


# --- stopped and resumed against uninterrupted ---------------------------------------------------------

RESUME = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, vocab_size=97, block_size=32, bias=True, mlp="gelu",
              dropout=0.1)


def resume_against_straight(out):
    """Four steps straight; two steps, save, load into another model, two more: the losses of steps 3-4,
    the final model and optimizer and the next draws of every generator, for both runs.

    Bitwise is expected: both runs execute the same kernels on the same shapes in one process, with
    torch's deterministic algorithms (sort-based embedding and scatter backward instead of atomics),
    cuBLAS's fixed workspace, and the math attention kernel (flash and memory-efficient attention
    accumulate their backward with atomics)."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # before this process's first cuBLAS call
    torch.use_deterministic_algorithms(True, warn_only=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = tensorpar.init()

    def steps(model, optimizer, numbers):
        losses = []
        for s in numbers:
            idx, targets = batch(RESUME, 4, RESUME["block_size"], s)
            loss = model(idx.cuda(), targets.cuda())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return losses

    def after(model, optimizer, losses):
        return {"losses": losses, "tensors": on_host(tensors_of(model, optimizer)), "draws": draws(mesh, "cuda")}

    with sdpa_kernel(SDPBackend.MATH):
        model, optimizer = trained(0, "cuda", RESUME, steps=0)
        steps(model, optimizer, [0, 1])
        checkpoint.save(out, model, optimizer, step=2)
        straight = after(model, optimizer, steps(model, optimizer, [2, 3]))
        model, optimizer = trained(1, "cuda", RESUME, steps=1)
        checkpoint.load(out, model, optimizer)
        resumed = after(model, optimizer, steps(model, optimizer, [2, 3]))
    return bitwise_equal(straight, resumed), len(straight["tensors"])


def test_a_run_stopped_and_resumed_on_cuda_is_the_run_uninterrupted(tmp_path):
    (same, count), = tensorpar.spawn(resume_against_straight, 1, str(tmp_path), backend="nccl")
    assert same and count > 0

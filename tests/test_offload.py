"""The optimizer in host memory (``train_gpt.py --offload-optimizer``): FSDP2's ``CPUOffloadPolicy``
through ``tensorpar.fully_shard_dp``, against torch's AdamW on a plain, unsharded copy of the model.

On a GPU the policy keeps each rank's dp shards of the parameters, their gradients and the AdamW
state built over them in host memory (the parameters' shards pinned): FSDP2 copies a unit's shards
to the device to gather them for its forward and backward, moves the reduce-scattered gradients
back to the host, and the optimizer steps there. On this CPU the device *is* the host, so where a
tensor lives cannot tell offloading from none. What is tested here holds either way: FSDP2 took
the policy (its record of each sharded parameter says it offloads), each rank holds only its dp
shard of every parameter, gradient and AdamW moment, all in host memory, and the training is
torch's AdamW's on the plain model: bitwise when every dp rank gets the same batch (the average
of equal gradients is exact), within the dtype's tolerance when the ranks split the batch. The GPU
test checks what differs on a device: the parameters' shards pinned on the host, the activations
on the device.
"""

import copy

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor, Shard

import tensorpar
from offload_cases import ADAMW, LRS, groups, train
from tensorpar.testing import TOLERANCES, assert_all_close


class Net(nn.Module):
    """Two linear layers, and a parameter the forward never uses (it never has a gradient)."""

    def __init__(self, width=16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, width), nn.Linear(width, 5)
        self.spare = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return self.fc2(nn.functional.gelu(self.fc1(x))).square().mean()


def inputs(step, dtype, device):
    """The step's batch of 6 rows (split alike over 1, 2 or 3 dp ranks)."""
    return torch.randn(6, 6, generator=torch.Generator().manual_seed(step), dtype=torch.float64).to(device, dtype)


def offloaded_twins(seed, dtype, device="cpu", pin=False):
    """A plain Net from ``seed``, and a copy under FSDP2 with CPU offload over the mesh's dp ranks (fc1 its
    own unit), each with torch's AdamW."""
    torch.manual_seed(seed)
    ref = Net().to(device, dtype)
    model = copy.deepcopy(ref)
    tensorpar.fully_shard_dp(model, modules=[model.fc1], offload_policy=CPUOffloadPolicy(pin_memory=pin))
    optimizers = [torch.optim.AdamW(groups(m.parameters()), lr=LRS[0], **ADAMW) for m in (model, ref)]
    return model, ref, optimizers


def offload_flags(model):
    """FSDP2's own record, per sharded parameter, of whether it offloads it (private: read by tests only)."""
    flags = []
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        flags += [p.offload_to_cpu for p in group.fsdp_params] if group is not None else []
    return flags


def placements(model, optimizer):
    """Per parameter: (its global shape, its dp shard's and each AdamW moment's local shapes, their devices,
    whether each is a dp shard of a DTensor, whether the parameter's shard is pinned, and how many moments)."""
    mesh = tensorpar.current_mesh()
    rows = {}
    for name, p in model.named_parameters():
        state = optimizer.state.get(p, {})
        moments = [state[k] for k in ("exp_avg", "exp_avg_sq") if k in state]
        tensors = [p, *moments] + ([p.grad] if p.grad is not None else [])
        sharded = all(isinstance(t, DTensor) and t.placements == (Shard(0),) and t.device_mesh.size() == mesh.dp
                      for t in tensors)
        local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        rows[name] = (tuple(p.shape), [tuple(t.shape) for t in local], {t.device.type for t in local},
                      sharded, local[0].is_pinned(), len(moments))
    return rows


def split_loss(model, step, dtype):
    """This dp rank's rows of the step's batch (its mean loss: the ranks' average is the batch's)."""
    mesh = tensorpar.current_mesh()
    x = inputs(step, dtype, "cpu")
    return model(x.tensor_split(mesh.dp)[mesh.dp_rank])


def offloaded_training(dtype, same_batch):
    """Five AdamW steps of both twins, a new learning rate at each; whether the losses are bitwise the
    same, the largest parameter error, FSDP2's offload flags, and the placements."""
    model, ref, (optimizer, ref_optimizer) = offloaded_twins(0, dtype)
    loss = (lambda m, step: m(inputs(step, dtype, "cpu"))) if same_batch else \
        (lambda m, step: split_loss(m, step, dtype))
    losses = train(model, optimizer, 5, loss)
    ref_losses = train(ref, ref_optimizer, 5, lambda m, step: m(inputs(step, dtype, "cpu")))
    for p in model.parameters():  # gradients of a last step, for the placements (not stepped)
        p.grad = None
    loss(model, 5).backward()
    where = placements(model, optimizer)
    full, expected = tensorpar.full_state_dict(model), ref.state_dict()
    bitwise = all(torch.equal(full[k], v) for k, v in expected.items())
    norm = torch.cat([v.flatten() for v in expected.values()]).norm().item()
    errors = assert_all_close({k: (full[k], v, norm) for k, v in expected.items()}, rtol=TOLERANCES[dtype])
    return losses == ref_losses, bitwise, max(errors.values()), offload_flags(model), where


@pytest.mark.parametrize("dp, dtype, same_batch", [
    (1, torch.float32, True), (2, torch.float32, True), (2, torch.float64, True),
    (2, torch.float32, False), (3, torch.float64, False)])
def test_offloaded_adamw_follows_torch_adamw_with_each_rank_holding_its_shards(worlds, dp, dtype, same_batch):
    for rank, (same_losses, bitwise, error, flags, where) in enumerate(worlds[dp].run(
            offloaded_training, dtype, same_batch, tp=1, dp=dp)):
        assert flags and all(flags), f"rank {rank}: FSDP2 does not offload every parameter: {flags}"
        if same_batch:  # every rank's gradients are the batch's: their average is exact
            assert same_losses and bitwise, f"rank {rank}: not bitwise torch's AdamW (error {error:.3g})"
        assert error <= TOLERANCES[dtype], f"rank {rank}: parameters {error:.3g} off torch's AdamW"
        for name, (shape, local, devices, sharded, _, moments) in where.items():
            assert sharded and devices == {"cpu"}, f"rank {rank}: {name} is not a dp shard in host memory"
            rows = len(range(shape[0])[rank * -(-shape[0] // dp):(rank + 1) * -(-shape[0] // dp)])  # torch.chunk's
            assert all(s == (rows, *shape[1:]) for s in local), f"rank {rank}: {name} holds {local}, not its shard"
            assert moments == (0 if name == "spare" else 2), f"rank {rank}: {name} has {moments} AdamW moments"


def cuda_offloaded_training():
    """On one GPU: the model's activations on the device, its shards pinned on the host; the parameters
    against AdamW on the GPU."""
    tensorpar.init()
    model, ref, (optimizer, ref_optimizer) = offloaded_twins(0, torch.float32, "cuda", pin=True)
    activation = model.fc1(inputs(0, torch.float32, "cuda"))
    train(model, optimizer, 5, lambda m, step: m(inputs(step, torch.float32, "cuda")))
    train(ref, ref_optimizer, 5, lambda m, step: m(inputs(step, torch.float32, "cuda")))
    torch.cuda.synchronize()
    full, expected = tensorpar.full_state_dict(model), ref.state_dict()
    errors = assert_all_close({k: (full[k].cuda(), v) for k, v in expected.items()}, rtol=1e-5)
    return activation.device.type, placements(model, optimizer), offload_flags(model), max(errors.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_the_shards_and_the_adamw_state_are_in_host_memory():
    """Within float32's 1e-5 of AdamW on the GPU (the CPU and CUDA AdamW kernels round differently). The
    parameters' shards are pinned (FSDP2 copies them to the device every step); the AdamW moments, which
    never travel, are ordinary host memory (measured on an H100 with torch 2.11)."""
    device, where, flags, error = tensorpar.spawn(cuda_offloaded_training, 1, backend="nccl")[0]
    assert device == "cuda" and flags and all(flags) and error <= 1e-5
    for name, (_, _, devices, sharded, pinned, _) in where.items():
        assert sharded and devices == {"cpu"} and pinned, f"{name}: {devices}, pinned: {pinned}"

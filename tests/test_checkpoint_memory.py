"""Checkpoint bytes against the live tensors they came from: a model of tp-split linears
whose weights are stored transposed, a sliced parameter, a channels-last convolution, an expanded
buffer, bfloat16 and integer tensors, with AdamW state inheriting the strides, saved at tp 1-4 with
and without FSDP2 and loaded into a fresh model and optimizer: every tensor bitwise the live one
(never the checkpoint's own view of itself); and one tensor above 64 MB.
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import tensorpar
from checkpoint_cases import bitwise_equal
from layers import ColumnParallelLinear, RowParallelLinear
from tensorpar import checkpoint

# --- whole checkpoints against the live model and optimizer -------------------------------------------

class Strided(nn.Module):
    """What a checkpoint must copy out of strided memory: tp-split linears whose weights (so their
    AdamW moments too) are stored column-major, a bfloat16 one likewise, a sliced parameter and a
    channels-last convolution (all contiguous unless ``strided_parameters``: FSDP2 refuses strided
    parameters), an expanded buffer (dense unless ``expanded``: nothing can be loaded into an
    expanded tensor), strided int64, int32 and bool buffers."""

    def __init__(self, seed, *, expanded, strided_parameters):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = ColumnParallelLinear(6, 11)                        # weight (11 / tp, 6)
        self.fc2 = RowParallelLinear(11, 5)                           # weight (5, 11 / tp)
        self.bf16 = ColumnParallelLinear(6, 7, dtype=torch.bfloat16)  # weight (7 / tp, 6)
        self.scale = nn.Parameter(torch.randn(5, 9)[:, 1:8:2])        # (5, 4) of strides (9, 2)
        self.conv = nn.Conv2d(3, 4, 2)
        if strided_parameters:
            for linear in (self.fc1, self.fc2, self.bf16):
                linear.weight.data = linear.weight.data.t().contiguous().t()  # the same values, column-major
            self.conv.to(memory_format=torch.channels_last)
        else:
            self.scale.data = self.scale.data.contiguous()
        mask = torch.randn(1, 5)
        self.register_buffer("mask", mask.expand(3, 5) if expanded else mask.repeat(3, 1))
        self.register_buffer("count", (torch.arange(12, dtype=torch.int64) * 2**40 + seed).view(3, 4).t())
        self.register_buffer("small", (torch.arange(-6, 6, dtype=torch.int32) * (seed + 1)).view(2, 6)[:, ::2])
        self.register_buffer("flags", (torch.randn(4, 3) > 0).t())

    def forward(self, x, image):
        y = self.fc2(torch.nn.functional.gelu(self.fc1(x)))  # (B, 5), the same on every tp rank
        z = self.bf16(x.to(torch.bfloat16)).float()           # (B, 7 / tp)
        return (y @ self.scale).sum() + z.square().sum() + self.conv(image).square().sum()


def strided_trained(seed, mesh, *, fsdp, expanded, steps):
    """A :class:`Strided` (under FSDP2 over dp when ``fsdp``; the bfloat16 linear its own unit, as FSDP2
    wants one dtype per unit) and its AdamW after ``steps`` steps; every rank takes the same batches."""
    model = Strided(seed, expanded=expanded, strided_parameters=not fsdp)
    if fsdp:
        tensorpar.fully_shard_dp(model, mesh, modules=[model.bf16])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(3, 6, generator=g), torch.randn(2, 3, 5, 5, generator=g)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def local(value):
    return value.to_local() if isinstance(value, DTensor) else value


def live_tensors(model, optimizer):
    """This rank's own tensors of the model and the optimizer, by name: the live ones, not copies."""
    names = {id(p): n for n, p in model.named_parameters()}
    found = {f"model.{k}": local(v) for k, v in model.state_dict(keep_vars=True).items()}
    for p, fields in optimizer.state.items():
        found |= {f"optim.{names[id(p)]}.{field}": local(v) for field, v in fields.items()}
    return found


def generators(mesh):
    return {"cpu": torch.get_rng_state(), "tp": tensorpar.random.tracker(mesh).state_dict()}


def loaded_against_live(out, fsdp):
    """Save a trained :class:`Strided`; load it into one of another seed and more steps (so every
    tensor differs before): the tensors that differ from the live model and optimizer after the load
    (by name), whether the generators are those at the save, and, for the report, every live tensor's
    name, shape, dtype and whether it is contiguous."""
    mesh = tensorpar.current_mesh()
    model, optimizer = strided_trained(0, mesh, fsdp=fsdp, expanded=True, steps=1)
    at_save = generators(mesh)
    checkpoint.save(out, model, optimizer, step=1)
    fresh, fresh_optimizer = strided_trained(1, mesh, fsdp=fsdp, expanded=False, steps=2)  # generators move on
    live, before = live_tensors(model, optimizer), live_tensors(fresh, fresh_optimizer)
    assert live.keys() == before.keys() and not any(bitwise_equal(live[k], before[k]) for k in live)
    checkpoint.load(out, fresh, fresh_optimizer)
    loaded = live_tensors(fresh, fresh_optimizer)
    wrong = sorted(k for k in live if not bitwise_equal(live[k], loaded[k]))
    return (loaded.keys() == live.keys(), wrong, bitwise_equal(at_save, generators(mesh)),
            {k: (tuple(v.shape), v.dtype, v.is_contiguous()) for k, v in live.items()})


#: tensors that are strided on every rank: the buffers, and (but under FSDP2) these parameters and states
STRIDED_BUFFERS = {"model.mask", "model.count", "model.small", "model.flags"}
STRIDED_PARAMETERS = {"model.scale", "model.fc1.weight", "model.fc2.weight", "model.conv.weight",
                      "optim.fc1.weight.exp_avg", "optim.fc2.weight.exp_avg_sq", "optim.conv.weight.exp_avg"}


def test_a_loaded_checkpoint_is_bitwise_the_live_model_and_optimizer(worlds, tmp_path):
    """tp 1-4, with and without FSDP2: every tensor of every rank (parameters, buffers, AdamW moments
    and step counters) bitwise the live one it was saved from, the generators as they were at the save."""
    layouts = [(1, 1, False), (2, 1, False), (3, 1, False), (4, 1, False),
               (1, 2, True), (2, 2, True), (3, 1, True), (4, 1, True)]
    for i, (tp, dp, fsdp) in enumerate(layouts):
        rows = worlds[tp * dp].run(loaded_against_live, str(tmp_path / str(i)), fsdp, tp=tp, dp=dp)
        for rank, (same_keys, wrong, same_generators, live) in enumerate(rows):
            assert same_keys and not wrong and same_generators, (tp, dp, fsdp, rank, wrong)
            assert len(live) == 13 + 3 * 9  # the state dict, and exp_avg, exp_avg_sq and step of 9 parameters
            strided = {k for k, (*_, contiguous) in live.items() if not contiguous}
            assert STRIDED_BUFFERS | (set() if fsdp else STRIDED_PARAMETERS) <= strided, (tp, dp, fsdp, rank, strided)
            assert {dtype for _, dtype, _ in live.values()} == {torch.float32, torch.bfloat16, torch.int64,
                                                                 torch.int32, torch.bool}


class Large(nn.Module):
    """A small linear beside a uint8 table of 8200 x 8200 (67.2 MB, above 64 MiB) sliced from rows of
    8208: many staging blocks, and a contiguous copy that would be unmapped as soon as it was freed."""

    def __init__(self, seed, *, random):
        super().__init__()
        torch.manual_seed(seed)
        self.linear = ColumnParallelLinear(4, 3)
        g = torch.Generator().manual_seed(seed)
        words = torch.randint(-2**31, 2**31 - 1, (8200, 8208 // 4), dtype=torch.int32, generator=g) if random \
            else torch.zeros(8200, 8208 // 4, dtype=torch.int32)
        self.register_buffer("table", words.view(torch.uint8)[:, :8200])  # (8200, 8200) of strides (8208, 1)

    def forward(self, x):
        return self.linear(x).square().sum()


def large_round_trip(out):
    """Save a :class:`Large` and its AdamW, load into a zeroed one: (the tensors that differ from the
    live ones, the live table's bytes, whether it is contiguous)."""
    model = Large(0, random=True)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).backward()
    optimizer.step()
    checkpoint.save(out, model, optimizer, step=1)
    fresh = Large(1, random=False)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    checkpoint.load(out, fresh, fresh_optimizer)
    live, loaded = live_tensors(model, optimizer), live_tensors(fresh, fresh_optimizer)
    wrong = [k for k in live if k not in loaded or not bitwise_equal(live[k], loaded[k])]
    return wrong, len(live), model.table.numel() * model.table.element_size(), model.table.is_contiguous()


def test_a_tensor_above_64_mb_loads_bitwise(worlds, tmp_path):
    (wrong, count, nbytes, contiguous), = worlds[1].run(large_round_trip, str(tmp_path))
    assert not wrong and count == 3 + 3 * 2 and nbytes > 64 << 20 and not contiguous, (wrong, count, nbytes)

"""Checkpoint bytes against the live tensors they came from.

The writer on its own: tensors whose contiguous copy is a temporary (transposed, sliced, expanded,
channels-last; one larger than the allocator's mmap threshold, so that its temporary is unmapped
when freed), written, read back and compared with the live tensor, and the hash of what was
written with the hash the writer recorded. Then whole checkpoints: a model of tp-split linears
whose weights are stored transposed, a sliced parameter, a channels-last convolution, an expanded
buffer, bfloat16 and integer tensors, with AdamW state inheriting the strides, saved at tp 1-4 with
and without FSDP2 and loaded into a fresh model and optimizer: every tensor bitwise the live one
(never the checkpoint's own view of itself); and one tensor above 64 MB.
"""

import io

import torch
from checkpoint_cases import bitwise_equal, raw_bytes
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import DTensor

import tensorpar
from layers import ColumnParallelLinear, RowParallelLinear
from tensorpar import checkpoint
from tensorpar.checkpoint.reader import Reader
from tensorpar.checkpoint.staging import blocks, fill
from tensorpar.checkpoint.tensors import FileWriter


def contiguous_bytes(t):
    """The row-major bytes of ``t``, by torch alone (an independent reference for the staging)."""
    return bytes(raw_bytes(t).tolist())


# --- the writer on its own -----------------------------------------------------------------------------

def strided_tensors():
    """Tensors of every kind of stride, each of which ``.contiguous()`` copies into a temporary."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(40, 30, generator=g)
    return {"transposed": base.t(), "sliced": base[3:17, 5:26:2], "expanded": torch.randn(1, 30, generator=g).expand(20, 30),
            "channels_last": torch.randn(2, 3, 4, 5, generator=g).contiguous(memory_format=torch.channels_last),
            "bf16": base.to(torch.bfloat16).t()[::2], "int64": (torch.arange(60, dtype=torch.int64) << 40).view(6, 10).t(),
            "bool": (base > 0).t(), "uint8": torch.randint(0, 256, (50, 70), dtype=torch.uint8, generator=g).t(),
            "scalar": torch.tensor(3.5), "empty": torch.empty(0, 3).t()}


def written_and_read(path, tensors):
    """Write ``tensors`` with the writer; then, per key, (bytes read back, the SHA-256 of the bytes in
    the file, the SHA-256 the writer recorded)."""
    with FileWriter(path, [(k, v.shape, v.dtype) for k, v in tensors.items()]) as writer:
        for k, v in tensors.items():
            writer.write(k, v)
    with Reader(path) as f:
        return {k: (f.read(k), f.sha256(k), writer.digests[k]) for k in tensors}


def test_the_writer_writes_the_bytes_of_strided_tensors(tmp_path):
    """Every tensor's contiguous copy is a temporary: what is read back is the live tensor, and the
    hash the writer recorded is that of the bytes in the file."""
    tensors = strided_tensors()
    assert not any(v.is_contiguous() for k, v in tensors.items() if k not in ("scalar", "empty"))
    for k, (read, on_disk, recorded) in written_and_read(tmp_path / "f.safetensors", tensors).items():
        assert bitwise_equal(read, tensors[k]), k
        assert on_disk == recorded, k


def test_the_writer_writes_a_large_strided_tensor(tmp_path):
    """A transposed tensor of 36 MiB: its contiguous copy is above glibc's largest mmap threshold
    (32 MiB), so a temporary copy is unmapped as soon as it is freed."""
    live = torch.arange(3072 * 3072, dtype=torch.int32).view(3072, 3072).t()  # (3072, 3072), 36 MiB
    (read, on_disk, recorded), = written_and_read(tmp_path / "f.safetensors", {"t": live}).values()
    assert bitwise_equal(read, live) and on_disk == recorded


@settings(max_examples=40)
@given(shape=st.lists(st.integers(1, 6), min_size=0, max_size=4), dtype=st.sampled_from(
    [torch.float64, torch.bfloat16, torch.int32, torch.bool, torch.uint8]), data=st.data())
def test_staging_a_tensor_in_blocks_gives_its_row_major_bytes(shape, dtype, data):
    """Any shape, a permutation of its dims and a step along one: the staged blocks, each at most one
    block (or one element) long, are the tensor's row-major bytes; reading them back in blocks of
    another size into a contiguous tensor gives the tensor."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    t = (torch.rand(shape, generator=g) * 100).to(dtype)
    t = t.permute(data.draw(st.permutations(range(len(shape))))) if shape else t
    if shape:
        dim = data.draw(st.integers(0, len(shape) - 1))
        t = t[(slice(None),) * dim + (slice(None, None, data.draw(st.integers(1, 2))),)]
    size, expected = t.element_size(), contiguous_bytes(t)
    block = data.draw(st.integers(1, 4 * size * max(t.numel(), 1)))
    staged = [bytes(b) for b in blocks(t, block=block)]
    assert b"".join(staged) == expected
    assert all(len(b) <= max(block // size, 1) * size for b in staged)
    out = torch.full_like(t, 7, memory_format=torch.contiguous_format)
    assert fill(io.BytesIO(expected), out, block=data.draw(st.integers(1, 64))) == len(expected)
    assert bitwise_equal(out, t)
    assert fill(io.BytesIO(expected[:len(expected) // 2]), out) == len(expected) // 2  # a file that ends early

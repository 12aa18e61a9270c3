"""A checkpoint's files on their own: the reader against slicing and against safetensors' own reader,
damaged bytes, and checkpoints on a plain install (torch only) with nothing unpickled."""

import os
import subprocess
import sys
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint_cases import bitwise_equal
from tensorpar import checkpoint
from tensorpar.checkpoint.safetensors_file import Reader, write_file

ROOT = Path(__file__).resolve().parents[1]


def test_checkpoints_work_without_numpy_and_without_unpickling(tmp_path):
    """As after a plain ``pip install tensorpar`` (torch only: neither numpy nor safetensors): save,
    verify, load and export, with every way to unpickle replaced by an error."""
    code = f"""
import sys
sys.modules["numpy"] = sys.modules["safetensors"] = None  # importing either fails
import pickle, torch, tensorpar
from tensorpar import checkpoint
sys.path.insert(0, {str(ROOT / "tests")!r})
from checkpoint_cases import BLOCKED, bitwise_equal
for module, name, replacement in BLOCKED:
    setattr(module, name, replacement)
tensorpar.init()
torch.manual_seed(0)
model, other = torch.nn.Linear(3, 2).to(torch.bfloat16), torch.nn.Linear(3, 2).to(torch.bfloat16)
optimizer, other_optimizer = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(other.parameters())
model(torch.ones(1, 3, dtype=torch.bfloat16)).sum().backward()
optimizer.step()
checkpoint.save("ckpt", model, optimizer, step=1)
checkpoint.load("ckpt", other, other_optimizer)
checkpoint.export_safetensors("ckpt", "model.safetensors")
print(checkpoint.read_meta("ckpt")["step"], bitwise_equal(model.state_dict(), other.state_dict()),
      bitwise_equal(optimizer.state_dict()["state"], other_optimizer.state_dict()["state"]))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["1", "True", "True"], done.stdout


@settings(max_examples=60)
@given(shape=st.lists(st.integers(0, 5), max_size=3), dtype=st.sampled_from([torch.float64, torch.bfloat16, torch.int32,
                                                                             torch.bool, torch.uint8]), data=st.data())
def test_the_reader_reads_any_box_as_slicing_does(tmp_path_factory, shape, dtype, data):
    """Any box of a stored tensor, read alone, into a contiguous or a strided target: equal to slicing
    the tensor, and to safetensors' own sliced read of the same file."""
    import safetensors

    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    tensor = (torch.rand(shape, generator=g) * 100).to(dtype)
    path = tmp_path_factory.mktemp("reader") / "f.safetensors"
    write_file(path, {"t": tensor, "s": torch.arange(3)})
    starts = [data.draw(st.integers(0, n)) for n in shape]
    box = tuple(slice(a, data.draw(st.integers(a, n))) for a, n in zip(starts, shape, strict=True))
    expected = tensor[box].contiguous()
    strided = torch.zeros(tuple(reversed(expected.shape)), dtype=dtype).permute(tuple(reversed(range(len(shape)))))
    with Reader(path) as f, safetensors.safe_open(str(path), framework="pt") as theirs:
        assert f.info("t") == (tuple(shape), dtype)
        reads = [f.read("t", box), f.read("t", box, out=torch.empty_like(expected)), f.read("t", box, out=strided),
                 theirs.get_slice("t")[box] if shape else theirs.get_tensor("t")]
        assert all(bitwise_equal(read.contiguous(), expected) for read in reads)


@settings(max_examples=60)
@given(data=st.data())
def test_a_damaged_file_is_a_checkpoint_error_never_another(tmp_path_factory, data):
    """Bytes of a file overwritten or cut anywhere (header included): reading it either works or
    raises CheckpointError (the manifest's hash catches the damage first; this is the reader alone)."""
    path = tmp_path_factory.mktemp("damaged") / "f.safetensors"
    write_file(path, {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)})
    raw = bytearray(path.read_bytes())
    at = data.draw(st.integers(0, len(raw) - 1))
    raw[at:at + data.draw(st.integers(1, 8))] = data.draw(st.binary(min_size=1, max_size=8))
    path.write_bytes(raw[:data.draw(st.integers(0, len(raw)))])
    try:
        with Reader(path) as f:
            for key in f.keys():  # noqa: SIM118 - a Reader lists its keys; it is no mapping to iterate
                f.read(key)
    except checkpoint.CheckpointError:
        pass

"""Checkpoints to test the checkpoint code with: a small trained GPT, every tensor of a checkpoint read
by torch's own dcp_to_torch_save, a bitwise picture of everything a load could modify, a save killed
part-way, a model of mixed dtypes, and replacements for every way to unpickle (forgeries of a
checkpoint are in ``checkpoint_damages``)."""

import contextlib
import copy
import hashlib
import os
import pickle
import subprocess
import tempfile
from pathlib import Path

import torch
from torch.distributed import distributed_c10d
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import tensorpar
from layers import GPT, GPTConfig
from tensorpar import checkpoint

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)


# --- building and photographing checkpoints ------------------------------------------

def trained(seed):
    """A small GPT and its AdamW after one step (so both hold state that a load would overwrite)."""
    torch.manual_seed(seed)
    model = GPT(CFG)
    optimizer = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.95), weight_decay=0.1)
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.block_size))
    model(idx, idx).backward()
    optimizer.step()
    return model, optimizer


def everything(path):
    """Every tensor of a checkpoint, unsharded, as torch's ``dcp_to_torch_save`` reads it."""
    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(checkpoint.resolve(path), Path(scratch) / "all.pt")
        return torch.load(Path(scratch) / "all.pt", weights_only=True)


def disk(root):
    """Every entry below ``root``: a file's SHA-256, a link's target, or "dir"."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(folder) / name
            found[str(p.relative_to(root))] = ("-> " + os.readlink(p) if p.is_symlink() else
                                               hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
    return found


def picture(model, optimizer, root):
    """Everything a load could modify: parameters and buffers, optimizer state and hyper-parameters,
    torch's and the mesh's generators, and the files below ``root``."""
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": copy.deepcopy(optimizer.state_dict()), "rng": torch.get_rng_state(),
            "tp rng": tensorpar.random.tracker().state_dict(), "disk": disk(root)}


def raw_bytes(t):
    """The row-major bytes of ``t`` (any strides and device) as a uint8 tensor on its device."""
    return t.detach().clone(memory_format=torch.contiguous_format).view(-1).view(torch.uint8)


def bitwise_equal(a, b):
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(raw_bytes(a), raw_bytes(b)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(bitwise_equal, a, b))
    return a == b


# --- a save that dies part-way ------------------------------------------------------------------

class Crash(BaseException):
    """The process dies here: no ``except Exception`` or cleanup for it runs."""


def dead_pid():
    """The id of a process that has exited (and been reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def killed_save(out, model, step, n):
    """Save ``step`` as a process whose id is ``dead_pid()`` and that dies at its n-th rename or deletion
    of a file or directory; True when it died."""
    calls = [0]
    saved = {name: getattr(os, name) for name in ("rename", "replace", "unlink", "rmdir", "getpid")}

    def dying(fn):
        def call(*args, **kwargs):
            calls[0] += 1
            if calls[0] == n:
                raise Crash
            return fn(*args, **kwargs)
        return call

    pid = dead_pid()
    try:
        for name in ("rename", "replace", "unlink", "rmdir"):
            setattr(os, name, dying(saved[name]))
        os.getpid = lambda: pid
        checkpoint.save(out, model, step=step, keep=1)
        return False
    except Crash:
        return True
    finally:
        for name, fn in saved.items():
            setattr(os, name, fn)


# --- dtypes and unpickling ------------------------------------------------------------------------

class Mixed(torch.nn.Module):
    """A GPT (in bfloat16 unless told) beside integer buffers that float32 cannot hold exactly."""

    def __init__(self, seed, dtype=torch.bfloat16, count_dtype=torch.int32):
        super().__init__()
        torch.manual_seed(seed)
        self.gpt = GPT(CFG).to(dtype)
        self.register_buffer("count", torch.tensor([1, -2, 2**24 + 1], dtype=count_dtype) + seed)
        self.register_buffer("tokens", torch.tensor([2**53 + 1 + seed], dtype=torch.int64))

    def forward(self, idx):
        return self.gpt(idx, idx)


def mixed_trained(seed, **options):
    model = Mixed(seed, **options)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.arange(8).reshape(1, 8) + seed).backward()
    optimizer.step()
    return model, optimizer


def refuse_unpickling(*args, **kwargs):
    raise AssertionError("the code under test unpickled data or ran an object collective")


class RefusedUnpickler(pickle.Unpickler):
    def __init__(self, *args, **kwargs):
        refuse_unpickling()


#: (module, name, replacement): every way to unpickle, and the object collectives (which unpickle, through
#: the Unpickler that torch.distributed holds as its own)
BLOCKED = [(pickle, "Unpickler", RefusedUnpickler), (distributed_c10d, "_unpickler", RefusedUnpickler)] + [
    (module, name, refuse_unpickling) for module, names in ((pickle, ("loads", "load")), (torch, ("load",)),
                                                            (torch.distributed, ("all_gather_object", "gather_object",
                                                                                 "broadcast_object_list",
                                                                                 "scatter_object_list",
                                                                                 "recv_object_list")))
    for name in names]


@contextlib.contextmanager
def blocked(object_collectives=True):
    """Every way to unpickle, and (unless told) the object collectives, raise inside the block."""
    chosen = [b for b in BLOCKED if object_collectives or b[0] not in (distributed_c10d, torch.distributed)]
    originals = [(module, name, getattr(module, name)) for module, name, _ in chosen]
    try:
        for module, name, replacement in chosen:
            setattr(module, name, replacement)
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)

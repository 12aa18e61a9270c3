"""Checkpoints to test the checkpoint code with: a small trained GPT, forgers' edits of a checkpoint
directory (each with the words its refusal must contain), a bitwise picture of everything a load could
modify, a save killed part-way, a model of mixed dtypes, and replacements for every way to unpickle."""

import copy
import hashlib
import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import safetensors.torch
import torch

import tensorpar
from layers import GPT, GPTConfig
from tensorpar import checkpoint

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)


# --- building, damaging and photographing checkpoints ------------------------------------------

def trained(seed):
    """A small GPT and its AdamW after one step (so both hold state that a load would overwrite)."""
    torch.manual_seed(seed)
    model = GPT(CFG)
    optimizer = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.95), weight_decay=0.1)
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.block_size))
    model(idx, idx).backward()
    optimizer.step()
    return model, optimizer


def canonical_sha256(meta):
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def edit_meta(path, edit, rehash=True):
    """Apply ``edit`` to meta.json's object; with ``rehash``, recompute its self-hash as a forger would."""
    meta = json.loads((path / "meta.json").read_text())
    edit(meta)
    if rehash:
        meta["meta_sha256"] = canonical_sha256(meta)
    (path / "meta.json").write_text(json.dumps(meta))


def edit_tensors(path, name, edit):
    """Apply ``edit`` to a safetensors file's dict and record the new file in meta.json as a forger would."""
    tensors = safetensors.torch.load_file(path / name)
    edit(tensors)
    safetensors.torch.save_file(tensors, path / name)
    data = (path / name).read_bytes()
    entry = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    edit_meta(path, lambda meta: meta["files"].update({name: entry}))


def in_meta(edit, rehash=True):
    return lambda path: edit_meta(path, edit, rehash)


def in_file(name, edit):
    return lambda path: edit_tensors(path, name, edit)


def group(key, value):
    """Set hyper-parameter ``key`` of the first optimizer group."""
    return lambda meta: meta["param_groups"][0].update({key: value})


def pointer(text):
    return lambda path: (path.parent / "latest").write_text(text)


def replace_file(path, name, data):
    (path / name).write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    edit_meta(path, lambda meta: meta["files"].update({name: {"sha256": digest, "bytes": len(data)}}))


def link_outside(path, name):
    """Replace a file of the checkpoint by a link to an identical file outside it (its hash still matches)."""
    outside = path.parent.parent / "outside"
    outside.mkdir(exist_ok=True)
    (outside / name).write_bytes((path / name).read_bytes())
    (path / name).unlink()
    (path / name).symlink_to(outside / name)


def latest_outside(path, via_link):
    """Point ``latest`` at a valid copy of the checkpoint outside the directory: by a relative path,
    or through a checkpoint-named link inside the directory."""
    outside = path.parent.parent / "elsewhere" / path.name
    shutil.copytree(path, outside)
    if via_link:
        (path.parent / "step-000999").symlink_to(outside)
    (path.parent / "latest").write_text("step-000999\n" if via_link else f"../elsewhere/{path.name}\n")


def latest_a_link(path):
    (path.parent / "latest").unlink()
    (path.parent / "latest").symlink_to(path / "meta.json")


def first(tensors, suffix):
    return next(k for k in sorted(tensors) if k.endswith(suffix))


GROUP0, NO_SHA = "meta.json: param_groups[0]", "meta.json was modified (its SHA-256 does not match)"
FILES = "meta.json: files must list exactly"
RANK1 = "rng of rank 1 missing"  # a damage for 2 ranks
#: damage name -> (what it does to the checkpoint directory, words the error must contain). A forger
#: edits the JSON, a file, or both, and records the new hashes; a plain edit records nothing.
DAMAGES = {
    "weight decay edited": (in_meta(group("weight_decay", 9.1), rehash=False), [NO_SHA]),
    "betas edited": (in_meta(group("betas", "x"), rehash=False), [NO_SHA]),
    "sha256 entry removed": (in_meta(lambda m: m["files"].pop("rng.safetensors"), rehash=False), [NO_SHA]),
    "old format": (in_meta(lambda m: m.update(format="tensorpar-checkpoint/1"), rehash=False),
                   ["is not a tensorpar-checkpoint/2 checkpoint (format 'tensorpar-checkpoint/1')"]),
    "forged betas": (in_meta(group("betas", "x")), [f"{GROUP0}.betas must be a list of 2", "(it is 'x')"]),
    "forged betas of 3": (in_meta(group("betas", [0.9, 0.9, 0.9])), [f"{GROUP0}.betas must be a list of 2"]),
    "forged weight decay": (in_meta(group("weight_decay", "0.1")), [f"{GROUP0}.weight_decay must be float"]),
    "forged flag": (in_meta(group("amsgrad", 1)), [f"{GROUP0}.amsgrad must be bool"]),
    "forged hyper-parameter": (in_meta(group("momentum", 0.9)),
                               [f"{GROUP0} has ['momentum'], which the optimizer lacks"]),
    "forged missing lr": (in_meta(lambda m: m["param_groups"][0].pop("lr")), [f"{GROUP0} lacks ['lr']"]),
    "forged step": (in_meta(lambda m: m.update(step=-1)), ["meta.json: step must be an integer >= 0"]),
    "forged tp": (in_meta(lambda m: m.update(tp="1")), ["meta.json: tp must be an integer >= 1"]),
    "forged groups": (in_meta(lambda m: m.update(param_groups={})), ["meta.json: param_groups must be a list"]),
    "forged files": (in_meta(lambda m: m["files"].pop("rng.safetensors")), [FILES, "rng.safetensors"]),
    "absolute file name": (in_meta(lambda m: m["files"].update({"/etc/hostname": m["files"]["rng.safetensors"]})),
                           [FILES, "/etc/hostname"]),
    "dotdot file name": (in_meta(lambda m: m["files"].update({"../meta.json": m["files"].pop("model.safetensors")})),
                         [FILES, "../meta.json"]),
    "bad files entry": (in_meta(lambda m: m["files"]["model.safetensors"].update(bytes="12")),
                        ["meta.json: files['model.safetensors'] must be"]),
    "meta not json": (lambda p: (p / "meta.json").write_text("{not json"), ["meta.json is not valid JSON"]),
    "meta a list": (lambda p: (p / "meta.json").write_text("[]"), ["meta.json does not hold a JSON object"]),
    "model truncated": (lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:99]),
                        ["model.safetensors is corrupt or truncated (SHA-256 does not match meta.json)"]),
    "model garbage": (lambda p: replace_file(p, "model.safetensors", b"\x10" + b"\0" * 7 + b"garbage!"),
                      ["model.safetensors cannot be read"]),
    "model a link outside": (lambda p: link_outside(p, "model.safetensors"), ["model.safetensors is not a regular"]),
    "model lacks a key": (in_file("model.safetensors", lambda t: t.pop("lm_head.weight")),
                          ["model.safetensors: the checkpoint lacks ['lm_head.weight']"]),
    "model holds another key": (in_file("model.safetensors", lambda t: t.update(x=torch.ones(1))),
                                ["model.safetensors: the checkpoint holds ['x']"]),
    "model in bf16": (in_file("model.safetensors", lambda t: t.update({k: v.bfloat16() for k, v in t.items()})),
                      ["model.safetensors: ", " is stored as torch.bfloat16, the model's is torch.float32"]),
    "optimizer lacks a key": (in_file("optimizer.safetensors", lambda t: t.pop(first(t, "/exp_avg"))),
                              ["optimizer.safetensors: the state of ",
                               " holds ['exp_avg_sq', 'step'], the optimizer's holds ['exp_avg', "]),
    "optimizer holds another key": (in_file("optimizer.safetensors", lambda t: t.update(x=torch.ones(1))),
                                    ["optimizer.safetensors: x is not the state of a parameter"]),
    "optimizer state misshapen": (in_file("optimizer.safetensors", lambda t: t.update({first(t, "/exp_avg"):
                                                                                         torch.ones(3)})),
                                  ["optimizer.safetensors: ", "/exp_avg: the checkpoint holds shape (3,)"]),
    "rng state wrong size": (in_file("rng.safetensors", lambda t: t.update({"rank0/cpu": t["rank0/cpu"][:100]})),
                             ["rng.safetensors: rank0/cpu must be ", " bytes (it is torch.uint8 of shape (100,))"]),
    "rng state garbage": (in_file("rng.safetensors", lambda t: t["rank0/tp/cpu"].fill_(255)),
                          ["rng.safetensors: rank0/tp/cpu is no valid generator state"]),
    "rng rank missing": (in_file("rng.safetensors", lambda t: t.pop("rank0/cpu")),
                         ["rng.safetensors: rank0/cpu is missing"]),
    "rng rank unknown": (in_file("rng.safetensors", lambda t: t.update({"rank7/cpu": t["rank0/cpu"].clone()})),
                         ["rng.safetensors: rank7/cpu is not a generator state of ranks 0-0"]),
    "latest outside": (lambda p: latest_outside(p, via_link=False), ["latest must hold one checkpoint name"]),
    "latest absolute": (pointer("/etc\n"), ["latest must hold one checkpoint name"]),
    "latest a link outside": (lambda p: latest_outside(p, via_link=True),
                              ["latest names step-000999, which is no directory in"]),
    "latest names nothing": (pointer("step-000042\n"), ["latest names step-000042, which does not exist"]),
    "latest itself a link": (latest_a_link, ["latest is not a regular file"]),
    RANK1: (in_file("rng.safetensors", lambda t: [t.pop(k) for k in list(t) if k.startswith("rank1/")]),
            ["rng.safetensors: rank1/cpu is missing"]),
}


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
            "tp rng": tensorpar.current_mesh().rng.state_dict(), "disk": disk(root)}


def bitwise_equal(a, b):
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
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
    raise AssertionError("checkpoint code unpickled data or ran an object collective")


class RefusedUnpickler(pickle.Unpickler):
    def __init__(self, *args, **kwargs):
        refuse_unpickling()


#: (module, name, replacement): every way to unpickle, and the object collectives (which unpickle)
BLOCKED = [(pickle, "Unpickler", RefusedUnpickler)] + [
    (module, name, refuse_unpickling) for module, names in ((pickle, ("loads", "load")), (torch, ("load",)),
                                                            (torch.distributed, ("all_gather_object", "gather_object",
                                                                                 "broadcast_object_list",
                                                                                 "scatter_object_list")))
    for name in names]

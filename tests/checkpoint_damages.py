"""A checkpoint's forgeries: edits of its directory as a careless hand or a forger would make them
(a forger rewrites the hashes too, and rewrites data files with torch's own DCP tools), each with the
words its refusal must contain."""

import copy
import hashlib
import json
import pickle
import shutil
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


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


SHARD, METADATA = "__0_0.distcp", ".metadata"  # rank 0's data file, and DCP's (pickled) index


def rehash_files(path):
    """Record every data file's size and SHA-256 in meta.json, as a forger would."""
    def forge(meta):
        for name in meta["files"]:
            data = (path / name).read_bytes()
            meta["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    edit_meta(path, forge)


def rewrite(edit):
    """A forger's rewrite of the checkpoint's tensors: every tensor read by torch's dcp_to_torch_save,
    ``edit`` applied to the flat dict, written back by ``dcp.save`` as rank 0's file, hashes recorded."""
    def damage(path):
        dcp_to_torch_save(path, path.parent / "all.pt")
        tensors = torch.load(path.parent / "all.pt", weights_only=True)
        (path.parent / "all.pt").unlink()
        edit(tensors)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
        rehash_files(path)
    return damage


def in_metadata(edit):
    """A forger's edit of DCP's ``.metadata`` (unpickled, edited, pickled again), hashes recorded."""
    def damage(path):
        metadata = pickle.loads((path / METADATA).read_bytes())
        edit(metadata.state_dict_metadata)
        (path / METADATA).write_bytes(pickle.dumps(metadata))
        rehash_files(path)
    return damage


def flip_last_bytes(name):
    def damage(path):
        data = bytearray((path / name).read_bytes())
        data[-4:] = bytes(255 - b for b in data[-4:])
        (path / name).write_bytes(data)
    return damage


def in_meta(edit, rehash=True):
    return lambda path: edit_meta(path, edit, rehash)


def group(key, value):
    """Set hyper-parameter ``key`` of the first optimizer group."""
    return lambda meta: meta["param_groups"][0].update({key: value})


def pointer(text):
    return lambda path: (path.parent / "latest").write_text(text)


def garbage(name):
    """The file replaced by bytes of its size that no reader can read, its hash recorded."""
    def damage(path):
        size = (path / name).stat().st_size
        (path / name).write_bytes((b"garbage!" * (1 + size // 8))[:size])
        rehash_files(path)
    return damage


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


def first(names, suffix):
    return next(k for k in sorted(names) if k.endswith(suffix))


def to_bf16(tensors):
    tensors.update({k: v.bfloat16() for k, v in tensors.items() if k.startswith("model.")})


def pop_first(suffix):
    return lambda t: t.pop(first(t, suffix))


def declared(name, size):
    """DCP's metadata declares tensor ``name`` of ``size`` elements, in one chunk (no data behind it)."""
    def edit(entries):
        entries[name].size = torch.Size([size])
        entries[name].chunks = [type(entries[name].chunks[0])(offsets=torch.Size([0]), sizes=torch.Size([size]))]
    return edit


def huge_cuda_state(entries):
    """A CUDA generator state of 2**40 bytes declared in DCP's metadata."""
    entries["rng.rank0.cuda"] = copy.deepcopy(entries["rng.rank0.cpu"])
    declared("rng.rank0.cuda", 2**40)(entries)


GROUP0 = "meta.json: param_groups[0]"
NO_SHA = "meta.json: not the JSON object whose SHA-256 it records (the file was edited)"
FILES, DIFFER = "meta.json: files lists", "size or SHA-256 does not match meta.json"
FIELDS = "meta.json: the states of the parameters hold the fields"
RANK1 = "rng of rank 1 missing"  # a damage for 2 ranks
WTE = "model.transformer.wte.weight"
#: damage name -> (what it does to the checkpoint directory, words the error must contain). A forger
#: edits the JSON, a file, or both, and records the new hashes; a plain edit records nothing.
DAMAGES = {
    "weight decay edited": (in_meta(group("weight_decay", 9.1), rehash=False), [NO_SHA]),
    "betas edited": (in_meta(group("betas", "x"), rehash=False), [NO_SHA]),
    "sha256 entry removed": (in_meta(lambda m: m["files"].pop(SHARD), rehash=False), [NO_SHA]),
    "old format": (in_meta(lambda m: m.update(format="tensorpar-checkpoint/3")),
                   ["is not a tensorpar-checkpoint/5 checkpoint (format 'tensorpar-checkpoint/3')"]),
    "old format, not rehashed": (in_meta(lambda m: m.update(format="tensorpar-checkpoint/3"), rehash=False),
                                 [NO_SHA]),
    "forged betas": (in_meta(group("betas", "x")), [f"{GROUP0}.betas is 'x', which cannot stand for the "
                                                    "optimizer's (0.9, 0.95)"]),
    "forged betas of 3": (in_meta(group("betas", [0.9, 0.9, 0.9])), [f"{GROUP0}.betas is [0.9, 0.9, 0.9], which"]),
    "forged weight decay": (in_meta(group("weight_decay", "0.1")), [f"{GROUP0}.weight_decay is '0.1', which"]),
    "forged flag": (in_meta(group("amsgrad", 1)), [f"{GROUP0}.amsgrad is 1, which cannot stand for the "
                                                   "optimizer's False"]),
    "forged hyper-parameter": (in_meta(group("momentum", 0.9)), [f"{GROUP0} has the keys ['amsgrad', ", "'momentum'"]),
    "forged missing lr": (in_meta(lambda m: m["param_groups"][0].pop("lr")),
                          [f"{GROUP0} has the keys ['amsgrad', ", "'fused', 'maximize', 'params'", "group ['amsgrad'"]),
    "forged step": (in_meta(lambda m: m.update(step=-1)), ["meta.json: step must be an integer >= 0 (it is -1)"]),
    "forged tp": (in_meta(lambda m: m.update(tp="1")), ["meta.json: tp must be an integer >= 1 (it is '1')"]),
    "forged world": (in_meta(lambda m: m.update(tp=2)), ["meta.json: tp x dp x pp = 2 ranks, the checkpoint holds "
                                                         "the files of 1"]),
    "forged huge world": (in_meta(lambda m: m.update(tp=2**20)), ["meta.json: tp x dp x pp = 1048576 ranks"]),
    "forged group count": (in_meta(lambda m: m["param_groups"].append(dict(m["param_groups"][0]))),
                           ["meta.json: param_groups lists 2 groups, the optimizer has 1"]),
    "forged groups": (in_meta(lambda m: m.update(param_groups={})),
                      ["meta.json: param_groups must be a list (it is {})"]),
    "forged files": (in_meta(lambda m: m["files"].pop(SHARD)), [FILES, "the directory holds ['.metadata', '__0_0"]),
    "absolute file name": (in_meta(lambda m: m["files"].update({"/etc/hostname": m["files"][SHARD]})),
                           [FILES, "/etc/hostname"]),
    "dotdot file name": (in_meta(lambda m: m["files"].update({"../meta.json": m["files"].pop(SHARD)})),
                         [FILES, "../meta.json"]),
    "a file added": (lambda p: (p / "extra.distcp").write_bytes(b"x"), [FILES, "extra.distcp"]),
    "bad files entry": (in_meta(lambda m: m["files"][SHARD].update(bytes="12")), [f"{SHARD}: {DIFFER}"]),
    "meta not json": (lambda p: (p / "meta.json").write_text("{not json"), [NO_SHA]),
    "meta a list": (lambda p: (p / "meta.json").write_text("[]"), [NO_SHA]),
    "shard truncated": (lambda p: (p / SHARD).write_bytes((p / SHARD).read_bytes()[:99]), [f"{SHARD}: {DIFFER}"]),
    "shard bytes flipped": (flip_last_bytes(SHARD), [f"{SHARD}: {DIFFER}"]),
    "metadata bytes flipped": (flip_last_bytes(METADATA), [f"{METADATA}: {DIFFER}"]),
    "shard garbage": (garbage(SHARD), ["its files cannot be read"]),
    "metadata garbage": (garbage(METADATA), [f"{METADATA} cannot be read"]),
    "shard a link outside": (lambda p: link_outside(p, SHARD), [f"{SHARD} is not a regular"]),
    "metadata a link outside": (lambda p: link_outside(p, METADATA), [f"{METADATA} is not a regular"]),
    "chunk missing": (in_metadata(lambda e: setattr(e[WTE], "chunks", [])),
                      [f"{METADATA}: the chunks of {WTE} do not tile its size [64, 16] ([])"]),
    "chunk outside": (in_metadata(lambda e: setattr(e[WTE], "chunks", [type(e[WTE].chunks[0])(
        offsets=torch.Size([1, 0]), sizes=e[WTE].chunks[0].sizes)])), [f"the chunks of {WTE} do not tile"]),
    "a tensor of 2**40 elements": (in_metadata(declared(WTE, 2**40)),
                                   [f"{METADATA}: {WTE} of size [1099511627776] would hold more than the"]),
    "model lacks a key": (rewrite(lambda t: t.pop("model.lm_head.weight")),
                          ["meta.json: the checkpoint lacks model.lm_head.weight"]),
    "model holds another key": (rewrite(lambda t: t.update({"model.x": torch.zeros(1)})),
                                ["meta.json: the checkpoint holds ['model.x'], which the model lacks"]),
    "model in bf16": (rewrite(to_bf16),
                      ["meta.json: model.", " is stored as torch.bfloat16 of shape (", "the model's is torch.float32",
                       "(load(..., cast=True) converts it)"]),
    "optimizer lacks a key": (rewrite(pop_first(".exp_avg")),
                              [f"{FIELDS} [['exp_avg', 'exp_avg_sq', 'step'], ['exp_avg_sq', 'step']]"]),
    "optimizer holds another key": (rewrite(lambda t: t.update({"optim.state.x": torch.zeros(1)})),
                                    ["meta.json: optim.state.x is not the state of a parameter"]),
    "optimizer state misshapen": (rewrite(lambda t: t.update({first(t, ".exp_avg"): torch.zeros(3)})),
                                  ["meta.json: optim.state.", ".exp_avg is stored as torch.float32 of shape (3,), "
                                   "the model's is torch.float32 of shape ("]),
    "rng state wrong size": (rewrite(lambda t: t.update({"rng.rank0.cpu": torch.zeros(100, dtype=torch.uint8)})),
                             ["meta.json: rng.rank0.cpu is no valid generator state (", "size to be 100"]),
    "rng state garbage": (rewrite(lambda t: t["rng.rank0.tp.cpu"].fill_(255)),
                          ["meta.json: rng.rank0.tp.cpu is no valid generator state"]),
    "seed misshapen": (rewrite(lambda t: t.update({"rng.rank0.tp.base": torch.zeros(2, dtype=torch.int64)})),
                       ["meta.json: rng.rank0.tp.base is no valid generator state (a seed is one int64, not "
                        "torch.int64 of shape (2,))"]),
    "rng state of 2**40 bytes": (in_metadata(huge_cuda_state),
                                 [f"{METADATA}: rng.rank0.cuda of size [1099511627776] would hold more than the"]),
    "model config forged": (in_meta(lambda m: m["config"].update(n_embd=24)),
                            ["meta.json: config does not match the model's (n_embd: checkpoint 24, model 16)"]),
    "optimizer groups forged": (in_meta(lambda m: m["param_groups"][0]["params"].pop()),
                                ["meta.json: param_groups[0] lacks ['", "(its parameters, or their grouping, differ"]),
    "rng missing": (rewrite(lambda t: t.pop("rng.rank0.cpu")), ["meta.json: rng.rank0.cpu is missing"]),
    "rng rank unknown": (rewrite(lambda t: t.update({"rng.rank7.cpu": t["rng.rank0.cpu"]})),
                         ["meta.json: rng.rank7.cpu is not a generator state of ranks 0-0"]),
    "latest outside": (lambda p: latest_outside(p, via_link=False), ["latest must hold one checkpoint name"]),
    "latest absolute": (pointer("/etc\n"), ["latest must hold one checkpoint name"]),
    "latest a link outside": (lambda p: latest_outside(p, via_link=True),
                              ["latest names step-000999, which is no directory in"]),
    "latest names nothing": (pointer("step-000042\n"), ["latest names step-000042, which is no directory in"]),
    "latest itself a link": (latest_a_link, ["latest is not a regular file"]),
    RANK1: (rewrite(lambda t: [t.pop(k) for k in list(t) if k.startswith("rng.rank1.")]),
            ["meta.json: rng.rank1.cpu is missing"]),
}

"""A checkpoint's forgeries: edits of its directory as a careless hand or a forger would make them
(a forger rewrites the hashes too), each with the words its refusal must contain."""

import hashlib
import json
import shutil
import struct

import safetensors.torch


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


SHARD = "shard-00000-of-00001.safetensors"  # the one data file of a checkpoint saved by one rank


def digests(path):
    """The SHA-256 of each tensor's bytes in a safetensors file, from its header's offsets."""
    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header, start = json.loads(data[8:8 + length]), 8 + length
    return {k: hashlib.sha256(data[start + v["data_offsets"][0]:start + v["data_offsets"][1]]).hexdigest()
            for k, v in header.items() if k != "__metadata__"}


def edit_tensors(path, edit, index_edit=None):
    """Apply ``edit`` to the data file's dict (and ``index_edit`` to meta.json's index) and record the
    new file and its chunks' hashes in meta.json as a forger would."""
    tensors = safetensors.torch.load_file(path / SHARD)
    edit(tensors)
    safetensors.torch.save_file(tensors, path / SHARD)
    data, chunks = (path / SHARD).read_bytes(), digests(path / SHARD)
    entry = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}

    def forge(meta):
        meta["files"][SHARD] = entry
        if index_edit:
            index_edit(meta["tensors"])
        for name, e in meta["tensors"].items():
            if name in chunks:
                e["chunks"][0][3] = chunks[name]
    edit_meta(path, forge)


def flip_last_bytes(path):
    data = bytearray((path / SHARD).read_bytes())
    data[-4:] = bytes(255 - b for b in data[-4:])
    (path / SHARD).write_bytes(data)


def in_meta(edit, rehash=True):
    return lambda path: edit_meta(path, edit, rehash)


def in_index(edit):
    """A forger's edit of the chunk index (meta.json's tensors), rehashed."""
    return in_meta(lambda meta: edit(meta["tensors"]))


def in_file(edit, index_edit=None):
    return lambda path: edit_tensors(path, edit, index_edit)


def group(key, value):
    """Set hyper-parameter ``key`` of the first optimizer group."""
    return lambda meta: meta["param_groups"][0].update({key: value})


def pointer(text):
    return lambda path: (path.parent / "latest").write_text(text)


def replace_file(path, name, data):
    (path / name).write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    edit_meta(path, lambda meta: meta["files"].update({name: {"sha256": digest, "bytes": len(data)}}))


def garbage(path):
    """Bytes of the size of ``path`` that no safetensors reader can read (a header of 16 bytes of garbage)."""
    return (b"\x10" + b"\0" * 7 + b"garbage!").ljust(path.stat().st_size, b"\0")


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


def bf16_index(index):
    for name, entry in index.items():
        if name.startswith("model."):
            entry["dtype"] = "BF16"


def scalar(dtype, size):
    return {"dtype": dtype, "size": [size], "chunks": [[0, [0], [size], "0" * 64]]}


def add(name, entry):
    return in_index(lambda t: t.update({name: entry}))


def huge_cuda_state(meta, file_bytes=None):
    """A CUDA generator state of 2**40 bytes for rank 0 (and, with ``file_bytes``, its file listed that large)."""
    meta["tensors"]["rng.rank0.cuda"] = scalar("U8", 2**40)
    if file_bytes:
        meta["files"][SHARD]["bytes"] = file_bytes


def resize_rank0_cpu(index):
    index["rng.rank0.cpu"] = scalar("U8", 100)


GROUP0, NO_SHA = "meta.json: param_groups[0]", "meta.json was modified (its SHA-256 does not match)"
FILES = "meta.json: files must list exactly"
RANK1 = "rng of rank 1 missing"  # a damage for 2 ranks
WTE = "model.transformer.wte.weight"
#: damage name -> (what it does to the checkpoint directory, words the error must contain). A forger
#: edits the JSON, a file, or both, and records the new hashes; a plain edit records nothing.
DAMAGES = {
    "weight decay edited": (in_meta(group("weight_decay", 9.1), rehash=False), [NO_SHA]),
    "betas edited": (in_meta(group("betas", "x"), rehash=False), [NO_SHA]),
    "sha256 entry removed": (in_meta(lambda m: m["files"].pop(SHARD), rehash=False), [NO_SHA]),
    "index edited": (in_meta(lambda m: m["tensors"].pop(WTE), rehash=False), [NO_SHA]),
    "old format": (in_meta(lambda m: m.update(format="tensorpar-checkpoint/2"), rehash=False),
                   ["is not a tensorpar-checkpoint/3 checkpoint (format 'tensorpar-checkpoint/2')"]),
    "forged betas": (in_meta(group("betas", "x")), [f"{GROUP0}.betas must be a list of 2", "(it is 'x')"]),
    "forged betas of 3": (in_meta(group("betas", [0.9, 0.9, 0.9])), [f"{GROUP0}.betas must be a list of 2"]),
    "forged weight decay": (in_meta(group("weight_decay", "0.1")), [f"{GROUP0}.weight_decay must be float"]),
    "forged flag": (in_meta(group("amsgrad", 1)), [f"{GROUP0}.amsgrad must be bool"]),
    "forged hyper-parameter": (in_meta(group("momentum", 0.9)),
                               [f"{GROUP0} has ['momentum'], which the optimizer lacks"]),
    "forged missing lr": (in_meta(lambda m: m["param_groups"][0].pop("lr")), [f"{GROUP0} lacks ['lr']"]),
    "forged step": (in_meta(lambda m: m.update(step=-1)), ["meta.json: step must be an integer >= 0"]),
    "forged tp": (in_meta(lambda m: m.update(tp="1")), ["meta.json: tp must be an integer >= 1"]),
    "forged world": (in_meta(lambda m: m.update(tp=2)), [FILES, "shard-00000-of-00002.safetensors"]),
    "forged groups": (in_meta(lambda m: m.update(param_groups={})), ["meta.json: param_groups must be a list"]),
    "forged files": (in_meta(lambda m: m["files"].pop(SHARD)), [FILES, SHARD]),
    "absolute file name": (in_meta(lambda m: m["files"].update({"/etc/hostname": m["files"][SHARD]})),
                           [FILES, "/etc/hostname"]),
    "dotdot file name": (in_meta(lambda m: m["files"].update({"../meta.json": m["files"].pop(SHARD)})),
                         [FILES, "../meta.json"]),
    "bad files entry": (in_meta(lambda m: m["files"][SHARD].update(bytes="12")),
                        [f"meta.json: files['{SHARD}'] must be"]),
    "meta not json": (lambda p: (p / "meta.json").write_text("{not json"), ["meta.json is not valid JSON"]),
    "meta a list": (lambda p: (p / "meta.json").write_text("[]"), ["meta.json does not hold a JSON object"]),
    "shard truncated": (lambda p: (p / SHARD).write_bytes((p / SHARD).read_bytes()[:99]),
                        [f"{SHARD} is corrupt or truncated (its size does not match meta.json)"]),
    "shard bytes flipped": (flip_last_bytes, [f"{SHARD}: ", " is corrupt (its SHA-256 does not match meta.json)"]),
    "shard garbage": (lambda p: replace_file(p, SHARD, garbage(p / SHARD)),
                      [f"{SHARD}", "cannot be read"]),
    "shard a link outside": (lambda p: link_outside(p, SHARD), [f"{SHARD} is not a regular"]),
    "index not an object": (in_meta(lambda m: m.update(tensors=[])), ["meta.json: tensors must be an object"]),
    "index entry malformed": (in_index(lambda t: t[WTE].update(dtype="F13")), [f"meta.json: tensors['{WTE}'] must be"]),
    "chunk of another rank": (in_index(lambda t: t[WTE]["chunks"][0].__setitem__(0, 1)),
                              [f"meta.json: tensors['{WTE}']: chunk [1, ",
                               "must be [a rank of 0-0, 2 offsets, 2 sizes, 64 hex digits]"]),
    "chunk missing": (in_index(lambda t: t[WTE].update(chunks=[])), [f"meta.json: {WTE}: the chunks hold 0 of its"]),
    "chunk outside": (in_index(lambda t: t[WTE]["chunks"][0][1].__setitem__(0, 1)),
                      [f"meta.json: {WTE}: chunk [1, 0] + ", "lies outside its size"]),
    "chunk not in its file": (in_file(lambda t: t.update({WTE: t[WTE][:3]})),
                              [f"{SHARD}: {WTE} is torch.float32 of shape (3, 16), meta.json says"]),
    "model lacks a key": (in_index(lambda t: t.pop("model.lm_head.weight")),
                          ["meta.json: the checkpoint lacks ['lm_head.weight']"]),
    "model holds another key": (add("model.x", scalar("F32", 1)),
                                ["meta.json: the checkpoint holds ['x'], which the model lacks"]),
    "model in bf16": (in_file(to_bf16, bf16_index),
                      ["meta.json: model.", " is stored as torch.bfloat16, the model's is torch.float32"]),
    "optimizer lacks a key": (in_index(lambda t: t.pop(first(t, ".exp_avg"))),
                              ["meta.json: the state of ", " holds ['exp_avg_sq', 'step'], the optimizer's holds "
                               "['exp_avg', "]),
    "optimizer holds another key": (add("optim.state.x", scalar("F32", 1)),
                                    ["meta.json: optim.state.x is not the state of a parameter"]),
    "optimizer state misshapen": (in_index(lambda t: t.update({first(t, ".exp_avg"): scalar("F32", 3)})),
                                  ["meta.json: optim.state.", ".exp_avg: the checkpoint holds shape (3,)"]),
    "rng state wrong size": (in_index(resize_rank0_cpu),
                             ["meta.json: rng.rank0.cpu must be ", " bytes (it is torch.uint8 of shape (100,))"]),
    "rng state garbage": (in_file(lambda t: t["rng.rank0.tp.cpu"].fill_(255)),
                          [f"{SHARD}: rng.rank0.tp.cpu is no valid generator state"]),
    "rng state of 2**40 bytes": (in_meta(huge_cuda_state),
                                 ["meta.json: tensors['rng.rank0.cuda']: chunk [0] + [1099511627776] of rank 0 holds "
                                  f"1099511627776 bytes, more than its file {SHARD} ("]),
    "rng state of 2**40 bytes in a file listed larger": (in_meta(lambda m: huge_cuda_state(m, 2**41)),
                                                         ["meta.json: rng.rank0.cuda must be a generator state of at "
                                                          "most ",
                                                          " bytes (it is torch.uint8 of shape (1099511627776,))"]),
    "model config forged": (in_meta(lambda m: m["config"].update(n_embd=24)),
                            ["meta.json: config does not match the model's (n_embd: checkpoint 24, model 16)"]),
    "optimizer groups forged": (in_meta(lambda m: m["param_groups"][0]["params"].pop()),
                                ["meta.json: param_groups[0] lacks ['", "(its parameters, or their grouping, differ"]),
    "rng rank missing": (in_index(lambda t: t.pop("rng.rank0.cpu")), ["meta.json: rng.rank0.cpu is missing"]),
    "rng rank unknown": (add("rng.rank7.cpu", scalar("U8", 5056)),
                         ["meta.json: rng.rank7.cpu is not a generator state of ranks 0-0"]),
    "latest outside": (lambda p: latest_outside(p, via_link=False), ["latest must hold one checkpoint name"]),
    "latest absolute": (pointer("/etc\n"), ["latest must hold one checkpoint name"]),
    "latest a link outside": (lambda p: latest_outside(p, via_link=True),
                              ["latest names step-000999, which is no directory in"]),
    "latest names nothing": (pointer("step-000042\n"), ["latest names step-000042, which does not exist"]),
    "latest itself a link": (latest_a_link, ["latest is not a regular file"]),
    RANK1: (in_meta(lambda m: [m["tensors"].pop(k) for k in list(m["tensors"]) if k.startswith("rng.rank1.")]),
            ["meta.json: rng.rank1.cpu is missing"]),
}

"""Distributed checkpoints through torch.distributed.checkpoint: saved at one (tp, dp), with or
without FSDP2 or ZeRO, loaded at any other; every rank writes only its own shards; resume at the
same layout is bitwise; a damaged checkpoint is refused before anything is unpickled; an asynchronous
save equals a synchronous one; torch's own tools read a checkpoint as it is.

References are independent: the plain ``RefGPT`` trained with torch's AdamW on the same batches,
the checkpoint's own files read back unsharded, and torch's DTensor chunking read through DCP's
default planner."""

import hashlib
import math
import warnings
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import tensorpar
from checkpoint_cases import BLOCKED, bitwise_equal, blocked
from examples.export_safetensors import export_safetensors
from examples.export_safetensors import main as export_command
from gpt_cases import batch, gpt_configs
from layers import GPT, GPTConfig
from reference_gpt import RefConfig, RefGPT
from tensorpar import checkpoint
from tensorpar.checkpoint.layout import locate
from tensorpar.full import placements, unshard
from tensorpar.testing import assert_all_close

LAYOUTS = [(1, 1), (2, 1), (3, 1), (4, 1), (1, 2), (2, 2), (1, 3), (1, 4)]
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


# --- models, optimizers and their unsharded views ------------------------------------------------

def reference(cfg, seed, steps):
    """The plain model and torch's AdamW after ``steps`` steps on batches ``seed``, ``seed + 1``..."""
    torch.manual_seed(seed)
    ref = RefGPT(RefConfig(**cfg)).double()
    optimizer = torch.optim.AdamW(ref.parameters(), **ADAMW)
    for s in range(steps):
        idx, targets = batch(cfg, 2, cfg["block_size"], seed + s)
        ref(idx, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return ref, optimizer


def build(cfg, seed, mode, mesh):
    """A sharded GPT with the plain model's initial weights from ``seed``; FSDP2 over dp for mode
    "fsdp"; torch's AdamW, or ZeroRedundancyOptimizer over dp for mode "zero"."""
    ref, _ = reference(cfg, seed, 0)
    model = GPT(GPTConfig(**cfg), dtype=torch.float64)
    model.load_full_state_dict(ref.state_dict())
    if mode == "fsdp":
        tensorpar.fully_shard_dp(model, mesh, modules=model.transformer.h)
    if mode == "zero":
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                              process_group=mesh.dp_group, **ADAMW)
    return model, torch.optim.AdamW(model.parameters(), **ADAMW)


def train_step(model, optimizer, cfg, seed):
    """One step on batch ``seed``; every dp rank takes the same batch, so no gradient sync is needed
    (FSDP2 averages equal gradients)."""
    idx, targets = batch(cfg, 2, cfg["block_size"], seed)
    model(idx, targets).backward()
    optimizer.step()
    optimizer.zero_grad()


def unsharded(value, where, name):
    """The full tensor of a rank's ``value`` (FSDP2 DTensor or plain) of parameter ``name`` (a collective)."""
    value = value.full_tensor() if isinstance(value, DTensor) else value
    return unshard(value, *where[name]) if name in where and value.dim() else value.detach().clone()


def full_optimizer_state(model, optimizer):
    """``{param name: {field: full tensor}}`` of a torch optimizer over a sharded model (a collective)."""
    where = placements(model)
    return {name: {k: unsharded(v, where, name) for k, v in sorted(optimizer.state[p].items())}
            for name, p in model.named_parameters()}


def compare(model, optimizer, ref, ref_optimizer, what):
    """Relative errors of the sharded model (and its optimizer, unless ZeRO) against the plain one,
    each tensor measured against the norm of all tensors of its kind: the attention's key bias has a
    zero gradient in exact arithmetic, so its moments are round-off alone, and AdamW scales that
    round-off by 1/eps into the bias itself."""
    full, expected = tensorpar.full_state_dict(model), ref.state_dict()
    norm = math.sqrt(sum(v.double().norm().item() ** 2 for v in expected.values()))
    pairs = {f"{what} {k}": (full[k], v, norm) for k, v in expected.items()}
    if optimizer is not None:
        ours, theirs = full_optimizer_state(model, optimizer), dict(ref.named_parameters())
        expected = {name: ref_optimizer.state[theirs[name]] for name in ours}
        scale = {field: math.sqrt(sum(s[field].double().norm().item() ** 2 for s in expected.values()))
                 for field in next(iter(expected.values()))}
        for name, fields in ours.items():
            for field, value in fields.items():
                pairs[f"{what} {name}.{field}"] = (value, expected[name][field], scale[field])
    return max(assert_all_close(pairs, rtol=1e-10).values())


# --- saved at one layout, loaded at another ------------------------------------------------------

def train_and_save(cfg, seed, mode, out):
    """One step at this layout, then a checkpoint; the error against the plain model."""
    mesh = tensorpar.current_mesh()
    model, optimizer = build(cfg, seed, mode, mesh)
    train_step(model, optimizer, cfg, seed)
    checkpoint.save(out, model, optimizer, step=1)
    ref, ref_optimizer = reference(cfg, seed, 1)
    return compare(model, None if mode == "zero" else optimizer, ref, ref_optimizer, "saved")


def load_and_step(cfg, seed, mode, out):
    """Load into a model of other weights at this layout: the loaded state (bitwise the checkpoint's
    own files, and against the plain model), then one more step against the plain model's second."""
    mesh = tensorpar.current_mesh()
    model, optimizer = build(cfg, seed + 1000, mode, mesh)
    checkpoint.load(out, model, optimizer)
    exact = bitwise_equal(tensorpar.full_state_dict(model), checkpoint.export_state_dict(out))
    ref, ref_optimizer = reference(cfg, seed, 1)
    loaded = compare(model, None if mode == "zero" else optimizer, ref, ref_optimizer, "loaded")
    train_step(model, optimizer, cfg, seed + 1)
    ref, ref_optimizer = reference(cfg, seed, 2)
    return exact, loaded, compare(model, None if mode == "zero" else optimizer, ref, ref_optimizer, "resumed")


@settings(max_examples=6)
@given(data=st.data())
def test_a_checkpoint_saved_at_any_layout_loads_at_any_other(worlds, tmp_path_factory, data):
    """(tp, dp) drawn on each side, FSDP2 or ZeRO or neither on each side, uneven vocab, heads and
    features: the loaded model and optimizer state are the saved ones, and training goes on as the
    plain model's does."""
    (tp_a, dp_a), (tp_b, dp_b) = data.draw(st.sampled_from(LAYOUTS)), data.draw(st.sampled_from(LAYOUTS))
    mode_a, mode_b = (data.draw(st.sampled_from(["plain", "fsdp", "zero"][:3 if dp > 1 else 2])) for dp in (dp_a, dp_b))
    cfg = data.draw(gpt_configs(max(tp_a, tp_b), max_layer=2))
    seed = data.draw(st.integers(0, 2**16))
    out = str(tmp_path_factory.mktemp("dcp"))
    saved = worlds[tp_a * dp_a].run(train_and_save, cfg, seed, mode_a, out, tp=tp_a, dp=dp_a)
    assert max(saved) <= 1e-10
    for exact, loaded, resumed in worlds[tp_b * dp_b].run(load_and_step, cfg, seed, mode_b, out, tp=tp_b, dp=dp_b):
        assert exact and loaded <= 1e-10 and resumed <= 1e-10, (exact, loaded, resumed)


# --- the same layout: bitwise, generators included ------------------------------------------------

def resume_bitwise(cfg, mode, out):
    """Steps 1 and 2 straight; step 1, save, load into another model, step 2: bitwise the same
    (dropout draws from the restored generators)."""
    mesh = tensorpar.current_mesh()
    model, optimizer = build(cfg, 0, mode, mesh)
    train_step(model, optimizer, cfg, 1)
    checkpoint.save(out, model, optimizer, step=1)
    train_step(model, optimizer, cfg, 2)
    straight = tensorpar.full_state_dict(model), torch.rand(3), mode == "zero" or full_optimizer_state(model, optimizer)
    model, optimizer = build(cfg, 5, mode, mesh)
    torch.rand(7)  # the generators move on
    checkpoint.load(out, model, optimizer)
    train_step(model, optimizer, cfg, 2)
    resumed = tensorpar.full_state_dict(model), torch.rand(3), mode == "zero" or full_optimizer_state(model, optimizer)
    return bitwise_equal(straight, resumed)


def test_resume_at_the_same_layout_is_bitwise(worlds, tmp_path):
    cfg = dict(n_layer=1, n_head=3, n_kv_head=3, n_embd=9, vocab_size=23, block_size=5, bias=True, mlp="gelu",
               dropout=0.3)
    for i, (tp, dp, mode) in enumerate([(2, 2, "fsdp"), (2, 2, "zero"), (3, 1, "plain")]):
        assert all(worlds[tp * dp].run(resume_bitwise, cfg, mode, str(tmp_path / str(i)), tp=tp, dp=dp)), (tp, dp, mode)


# --- each rank writes its own shards only ---------------------------------------------------------

def written_and_held(cfg, mode, out):
    """Save; then this rank's bytes written, the bytes of every box it holds, the total bytes of all
    tensors, and whether each chunk DCP's metadata puts in this rank's file is a box (or piece of one)
    this rank holds."""
    mesh = tensorpar.current_mesh()
    model, optimizer = build(cfg, 0, mode, mesh)
    train_step(model, optimizer, cfg, 0)
    path = checkpoint.save(out, model, optimizer, step=0)
    metadata = dcp.FileSystemReader(path).read_metadata()
    where, names = placements(model), {id(p): n for n, p in model.named_parameters()}
    held = {f"model.{k}": locate(v, *where.get(k, (None, None)))[1] for k, v in model.state_dict().items()}
    for p, fields in (optimizer.optim if mode == "zero" else optimizer).state.items():  # ZeRO: the owned state
        for field, v in fields.items():
            name = names[id(p)]
            placement = where.get(name, (None, None)) if v.dim() else (None, None)
            held[f"optim.state.{name}.{field}"] = locate(v, *placement)[1]
    mine, generators, total, own_boxes = 0, 0, 0, True
    for name, entry in metadata.state_dict_metadata.items():
        element = entry.properties.dtype.itemsize
        total += math.prod(entry.size) * element
        for chunk in entry.chunks:
            if metadata.storage_data[MetadataIndex(name, chunk.offsets)].relative_path != f"__{mesh.rank}_0.distcp":
                continue
            if name.startswith("rng."):
                generators += math.prod(chunk.sizes) * element
            else:
                mine += math.prod(chunk.sizes) * element
                # a box this rank holds (a fused projection's shard: one of its pieces)
                own_boxes &= (tuple(chunk.offsets), tuple(chunk.sizes)) in {(b.offsets, b.sizes)
                                                                            for _, b, _ in held[name].parts()}
    # the model is float64; the optimizer's step counters are float32 scalars
    holding = sum(math.prod(b.sizes) * (8 if b.sizes else 4) for b in held.values())
    file = path / f"__{mesh.rank}_0.distcp"
    return mine, generators, holding, total, own_boxes and mine + generators < file.stat().st_size


def test_each_rank_writes_only_its_own_shards_once(worlds, tmp_path):
    cfg = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=24, vocab_size=67, block_size=6, bias=True, mlp="swiglu")
    for i, (tp, dp, mode) in enumerate([(2, 2, "fsdp"), (4, 1, "plain"), (1, 3, "zero")]):
        rows = worlds[tp * dp].run(written_and_held, cfg, mode, str(tmp_path / str(i)), tp=tp, dp=dp)
        total = rows[0][3]
        assert all(own for *_, own in rows), "a rank wrote a chunk that is not its own box"
        assert sum(mine + generators for mine, generators, *_ in rows) == total  # each element once, none missing
        for mine, _, holding, _, _ in rows:  # a rank writes part of what it holds, and holds part of the model
            assert mine <= holding < 0.6 * total, (mine, holding, total)


# --- nothing unpickled from a damaged checkpoint; asynchronous saves -------------------------------

def damaged_metadata_blocked(cfg, out):
    """Save, flip a byte of DCP's pickled ``.metadata``: the load is refused by the manifest's hash with
    nothing read from disk unpickled (the ranks agree by an object collective: it unpickles only what
    they sent), and the model is unchanged."""
    mesh = tensorpar.current_mesh()
    model, optimizer = build(cfg, 0, "fsdp", mesh)
    train_step(model, optimizer, cfg, 0)
    path = checkpoint.save(out, model, optimizer, step=0)
    other, other_optimizer = build(cfg, 1, "fsdp", mesh)
    before = tensorpar.full_state_dict(other)
    dist.barrier()
    if mesh.rank == 0:
        data = bytearray((path / ".metadata").read_bytes())
        data[len(data) // 2] ^= 1
        (path / ".metadata").write_bytes(data)
    dist.barrier()
    try:
        with blocked(object_collectives=False):
            checkpoint.load(out, other, other_optimizer)
        return "loaded"
    except checkpoint.CheckpointError as e:
        refused = ".metadata: size or SHA-256 does not match meta.json" in str(e)
    return refused and bitwise_equal(before, tensorpar.full_state_dict(other))


def test_a_damaged_metadata_file_is_refused_before_it_is_unpickled(worlds, tmp_path):
    cfg = dict(n_layer=1, n_head=2, n_kv_head=1, n_embd=6, vocab_size=11, block_size=4, bias=False, mlp="gelu")
    assert BLOCKED and all(r is True for r in worlds[4].run(damaged_metadata_blocked, cfg, str(tmp_path), tp=2, dp=2))


def async_against_sync(cfg, out):
    """A synchronous and an asynchronous save of the same state, the model changed right after the
    asynchronous one began: (latest before wait, after wait, the two checkpoints' files and index,
    whether a save meanwhile into the same directory is refused)."""
    mesh = tensorpar.current_mesh()
    model, optimizer = build(cfg, 0, "fsdp", mesh)
    train_step(model, optimizer, cfg, 0)
    sync = checkpoint.save(Path(out) / "sync", model, optimizer, step=1)
    checkpoint.save(Path(out) / "async", model, optimizer, step=0)
    pending = checkpoint.async_save(Path(out) / "async", model, optimizer, step=1)
    train_step(model, optimizer, cfg, 1)  # the saved copy is already taken
    before, refused = checkpoint.read_meta(Path(out) / "async")["step"], False
    try:
        checkpoint.save(Path(out) / "async", model, optimizer, step=2)
    except checkpoint.CheckpointError as e:
        refused = "is a save of this process still being written" in str(e)
    path = pending.wait()
    after = checkpoint.read_meta(Path(out) / "async")["step"]
    digests = [{p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in d.glob("*.distcp")} for d in (sync, path)]
    indexes = [dcp.FileSystemReader(d).read_metadata().state_dict_metadata for d in (sync, path)]
    return before, after, digests[0] == digests[1] and indexes[0] == indexes[1] and refused, pending.done()


def test_an_asynchronous_save_equals_a_synchronous_one_and_latest_waits_for_it(worlds, tmp_path):
    cfg = dict(n_layer=1, n_head=3, n_kv_head=1, n_embd=9, vocab_size=13, block_size=4, bias=True, mlp="gelu")
    for before, after, same, done in worlds[4].run(async_against_sync, cfg, str(tmp_path), tp=2, dp=2):
        assert (before, after, same, done) == (0, 1, True, True)


# --- read by torch's own planner and DTensor chunking; exported unsharded -----------------------------

def dtensor_load(out):
    """Load the checkpoint through ``dcp.load`` and its default planner into DTensors chunked by torch's
    rule over this tp mesh: each rank's chunk against the exported full tensor."""
    mesh = tensorpar.current_mesh()
    full = checkpoint.export_state_dict(out)
    sd = {k: distribute_tensor(torch.zeros_like(v), mesh.device_mesh["tp"], [Shard(0) if v.dim() else Replicate()])
          for k, v in full.items()}
    with warnings.catch_warnings():  # that no_dist means one process: each rank reads its own part
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": sd}, storage_reader=dcp.FileSystemReader(checkpoint.resolve(out)), no_dist=True)
    return all(torch.equal(sd[k].full_tensor(), v) for k, v in full.items())


def test_torch_s_default_planner_reads_a_checkpoint_into_dtensors(worlds, tmp_path):
    """tensorpar's balanced shards of 67 rows at tp=4 (17, 17, 17, 16) read into DTensors chunked by
    torch's rule over 3 ranks (23, 23, 21), through DCP's own resharding."""
    cfg = dict(n_layer=1, n_head=4, n_kv_head=4, n_embd=8, vocab_size=67, block_size=5, bias=True, mlp="gelu")
    worlds[4].run(train_and_save, cfg, 3, "plain", str(tmp_path), tp=4)
    assert all(worlds[3].run(dtensor_load, str(tmp_path), tp=3))


def test_the_safetensors_export_is_the_unsharded_state_dict(worlds, tmp_path):
    cfg = dict(n_layer=1, n_head=3, n_kv_head=3, n_embd=6, vocab_size=19, block_size=5, bias=True, mlp="gelu")
    worlds[4].run(train_and_save, cfg, 4, "fsdp", str(tmp_path), tp=2, dp=2)
    out = export_safetensors(tmp_path, tmp_path / "model.safetensors")
    exported = safetensors.torch.load_file(out)
    assert bitwise_equal(exported, checkpoint.export_state_dict(tmp_path))
    RefGPT(RefConfig(**cfg)).double().load_state_dict(exported)  # strict: exactly the plain model's keys


def train_save_and_gather(cfg, seed, mode, out):
    """One step, a checkpoint, and the live model's and optimizer's full tensors (gathered, on every rank)."""
    model, optimizer = build(cfg, seed, mode, tensorpar.current_mesh())
    train_step(model, optimizer, cfg, seed)
    checkpoint.save(out, model, optimizer, step=1)
    return {f"model.{k}": v for k, v in tensorpar.full_state_dict(model).items()} | {
        f"optim.state.{name}.{field}": v for name, fields in full_optimizer_state(model, optimizer).items()
        for field, v in fields.items()}


def test_torch_s_dcp_tools_read_a_checkpoint_as_it_is(worlds, tmp_path):
    """A checkpoint of uneven shards (tp=2, FSDP2 over dp=2) read by torch's ``dcp_to_torch_save``
    directly: every tensor of the model and the optimizer is bitwise the live one; ``dcp.load`` with
    torch's default reader and the safetensors export give the same model."""
    cfg = dict(n_layer=1, n_head=3, n_kv_head=1, n_embd=9, vocab_size=19, block_size=5, bias=True, mlp="gelu")
    live = worlds[4].run(train_save_and_gather, cfg, 5, "fsdp", str(tmp_path / "run"), tp=2, dp=2)[0]
    dcp_to_torch_save(checkpoint.resolve(tmp_path / "run"), tmp_path / "model.pt")
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    assert live.keys() <= saved.keys() and all(torch.equal(saved[k], v) for k, v in live.items())
    assert {k for k in saved if not k.startswith("rng.")} == live.keys()
    exported = safetensors.torch.load_file(export_safetensors(tmp_path / "run", tmp_path / "m.safetensors"))
    plain = {f"model.{k}": torch.zeros_like(v) for k, v in RefGPT(RefConfig(**cfg)).double().state_dict().items()}
    with warnings.catch_warnings():  # that no_dist means one process
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(plain, checkpoint_id=checkpoint.resolve(tmp_path / "run"), no_dist=True)
    assert bitwise_equal({f"model.{k}": v for k, v in exported.items()}, plain)
    assert bitwise_equal(plain, {k: v for k, v in live.items() if k.startswith("model.")})
    assert export_command([str(tmp_path / "run"), str(tmp_path / "cli.safetensors")]) == 0
    assert bitwise_equal(safetensors.torch.load_file(tmp_path / "cli.safetensors"), exported)


# --- generator states across layouts ------------------------------------------------------------------

DROPOUT = dict(n_layer=1, n_head=4, n_kv_head=4, n_embd=16, vocab_size=23, block_size=6, bias=True, mlp="gelu",
               dropout=0.1)


def dropout_run(out, resume):
    """A GPT with dropout 0.1 and AdamW: steps 0 and 1, a checkpoint, steps 2 and 3 (or, with ``resume``,
    a fresh model whose generators moved on, the checkpoint loaded, steps 2 and 3): the last two losses,
    the full weights after them, and the warnings the load gave."""
    def step(s):
        idx, targets = batch(DROPOUT, 2, DROPOUT["block_size"], s)
        loss = model(idx, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    torch.manual_seed(0)
    tensorpar.manual_seed(0)
    model = GPT(GPTConfig(**DROPOUT))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        if resume:
            torch.rand(5)
            with tensorpar.random.tracker().fork():
                torch.rand(5)
            checkpoint.load(out, model, optimizer)
        else:
            step(0), step(1)
            checkpoint.save(out, model, optimizer, step=1)
    losses = [step(2), step(3)]
    return losses, tensorpar.full_state_dict(model), [str(w.message) for w in said]


def test_the_bitwise_mode_resumes_dropout_bitwise_at_another_tp_and_a_lost_stream_is_named(worlds, tmp_path):
    """Saved at tp=2 and resumed at tp=4 in the bitwise mode (dropout 0.1), the run goes on exactly as
    the uninterrupted one: its dropout masks come from torch's generator, the same on every rank and
    restored at any layout. In the default mode the attention's tp streams differ by rank: resumed at
    another tp they cannot be restored, and the load says so, naming them."""
    (losses, weights, _), _ = worlds[2].run(dropout_run, str(tmp_path / "bitwise"), False, tp=2, bitwise=True)
    for resumed, resumed_weights, said in worlds[4].run(dropout_run, str(tmp_path / "bitwise"), True, tp=4,
                                                        bitwise=True):
        assert resumed == losses and bitwise_equal(resumed_weights, weights) and not said, (resumed, losses, said)
    worlds[2].run(dropout_run, str(tmp_path / "default"), False, tp=2)
    for *_, said in worlds[4].run(dropout_run, str(tmp_path / "default"), True, tp=4):
        assert any("saved at (tp, dp, pp) = (2, 1, 1), this run is (4, 1, 1): the generator streams ['tp.cpu'] "
                   "differ by rank and are not restored" in s for s in said), said

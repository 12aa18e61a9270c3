"""Checkpoints against damaged, edited or hostile directories and against crashes during save.

Every refused load must raise CheckpointError naming the file and the field, and leave the model,
the optimizer, torch's and the mesh's generators and every file on disk bitwise as they were. A save
killed at any point must leave a valid checkpoint reachable through ``latest``, and the next save
must clean up what the killed one left (one process saves into a directory at a time)."""

import os
import re
from pathlib import Path

import pytest
import torch

import tensorpar
from checkpoint_cases import (
    Mixed,
    bitwise_equal,
    dead_pid,
    everything,
    killed_save,
    mixed_trained,
    picture,
    trained,
)
from checkpoint_damages import DAMAGES, RANK1, WTE, declared, in_metadata
from tensorpar import checkpoint

ROOT = Path(__file__).resolve().parents[1]


# --- damaged, edited and hostile checkpoints ------------------------------------------------------

def refused_load(root, damage, **options):
    """Save a checkpoint, damage it, load it into another trained model: (error type, message, whether
    nothing changed). Every rank damages nothing but the first; all load."""
    out, mesh = Path(root) / "run", tensorpar.current_mesh()
    model, optimizer = trained(0)
    with tensorpar.random.tracker(mesh).fork():  # the tp streams hold a state to save
        torch.rand(1)
    path = checkpoint.save(out, model, optimizer, step=3)
    if mesh.rank == 0:
        DAMAGES[damage][0](path)
    torch.distributed.barrier()
    target, target_optimizer = trained(1)
    torch.rand(3)  # the generators move on from the saved states
    with tensorpar.random.tracker(mesh).fork():
        torch.rand(3)
    before = picture(target, target_optimizer, root)
    try:
        checkpoint.load(out, target, target_optimizer, **options)
        kind, message = "no error", ""
    except Exception as e:  # noqa: BLE001 - the test checks the type
        kind, message = type(e).__name__, str(e)
    torch.distributed.barrier()
    return kind, message, bitwise_equal(before, picture(target, target_optimizer, root))


@pytest.mark.parametrize("damage", sorted(set(DAMAGES) - {RANK1}))
def test_a_damaged_checkpoint_is_refused_by_name_and_changes_nothing(worlds, tmp_path, damage):
    kind, message, unchanged = worlds[1].run(refused_load, str(tmp_path), damage)[0]
    assert kind == "CheckpointError", (kind, message)
    assert issubclass(checkpoint.CheckpointError, ValueError)
    for words in DAMAGES[damage][1]:
        assert words in message, message
    assert unchanged, f"{damage}: the refused load modified something"


def test_every_rank_refuses_what_only_another_rank_needs(worlds, tmp_path):
    """Rank 1's generator states are missing: rank 0, which has its own, refuses too, so no rank
    loads a checkpoint that another rank refuses (load is no collective that could tell them)."""
    for kind, message, unchanged in worlds[2].run(refused_load, str(tmp_path), RANK1):
        assert kind == "CheckpointError" and DAMAGES[RANK1][1][0] in message, message
        assert unchanged


def export_of_forged_sizes(root):
    """The token embedding declared in DCP's metadata as 2**40 elements, the hashes recorded: what
    exporting the checkpoint raises (a declared size must never reach the allocator)."""
    path = checkpoint.save(Path(root) / "run", trained(0)[0], step=1)
    in_metadata(declared(WTE, 2**40))(path)
    try:
        checkpoint.export_state_dict(path)
    except Exception as e:  # noqa: BLE001 - the test checks the type
        return type(e).__name__, str(e)
    return "no error", ""


def test_an_export_checks_declared_sizes_before_allocating(worlds, tmp_path):
    kind, message = worlds[1].run(export_of_forged_sizes, str(tmp_path))[0]
    assert kind == "CheckpointError", message
    total = sum(p.stat().st_size for p in (tmp_path / "run" / "step-000001").iterdir() if p.name != "meta.json")
    assert message.endswith(f".metadata: {WTE} of size [1099511627776] would hold more than the {total} bytes of the "
                            "checkpoint's files"), message


def saves_that_disagree(root):
    """Saves whose step, keep or extra differ between the ranks (or whose step only one rank gets wrong):
    what each raised, and what each left in its directory."""
    rank = tensorpar.current_mesh().rank
    model = trained(0)[0]
    cases = {"step": dict(step=3 + rank), "keep": dict(step=3, keep=2 + rank),
             "extra": dict(step=3, extra={"tokens": [rank]}), "one bad step": dict(step=-1 if rank else 3),
             "async step": dict(step=5 + rank)}
    raised = {}
    for name, options in cases.items():
        save = checkpoint.async_save if name.startswith("async") else checkpoint.save
        try:
            result = save(Path(root) / name, model, **options)
            raised[name] = f"saved {result if isinstance(result, Path) else result.wait()}"
        except checkpoint.CheckpointError as e:
            raised[name] = str(e)
    torch.distributed.barrier()
    return raised, {name: sorted(os.listdir(Path(root) / name)) for name in cases if (Path(root) / name).exists()}


def test_ranks_that_disagree_on_a_save_all_refuse_it_and_nothing_is_written(worlds, tmp_path):
    (raised0, left), (raised1, _) = worlds[2].run(saves_that_disagree, str(tmp_path))
    differ = "the ranks must save with the same arguments, and they differ"
    assert raised0["step"] == raised1["step"] == f"{differ} (step: 3 on rank 0, 4 on rank 1)"
    assert raised0["keep"] == raised1["keep"] == f"{differ} (keep: 2 on rank 0, 3 on rank 1)"
    assert raised0["async step"] == raised1["async step"] == f"{differ} (step: 5 on rank 0, 6 on rank 1)"
    assert raised0["extra"] == raised1["extra"] == (
        f"{differ} (extra: {{'tokens': [0]}} on rank 0, {{'tokens': [1]}} on rank 1)")
    bad = "step must be an integer >= 0 and keep one >= 1 (got step=-1, keep=2)"
    assert raised1["one bad step"] == f"rank 1: {bad}"
    assert raised0["one bad step"] == f"rank 1: {bad} (so rank 0 did not save the checkpoint either)"
    assert all(names == [] for names in left.values()), left  # no checkpoint, no temporary, no latest


# --- crashes during save, and what they leave behind ---------------------------------------------

def crash_points(root, step):
    """Checkpoints of steps 3 and 5, then a save of ``step`` killed at its first, second... rename or
    deletion until one completes. After each kill: what ``latest`` leads to, and what the next save
    (step 7, by a live process) leaves."""
    old, new = trained(0)[0], trained(1)[0]
    states = {"old": old.state_dict(), "new": new.state_dict()}
    rows = []
    for n in range(1, 100):
        out = Path(root) / f"killed-at-{n}"
        checkpoint.save(out, old, step=3)
        checkpoint.save(out, old, step=5)
        if not killed_save(out, new, step, n):
            return rows
        meta = checkpoint.read_meta(out)  # verifies every file of the checkpoint latest leads to
        exported = checkpoint.export_state_dict(out)
        which = [name for name, state in states.items() if bitwise_equal(exported, state)]
        aside = Path(meta["path"]).name != f"step-{meta['step']:06d}"
        checkpoint.save(out, new, step=7)
        left = sorted(p.name for p in out.iterdir() if p.name not in ("latest", "step-000007"))
        rows.append((n, meta["step"], which, aside, left, checkpoint.read_meta(out)["step"]))
    raise AssertionError("the save never completed")


@pytest.mark.parametrize("step", [5, 6])
def test_a_save_killed_at_any_point_leaves_a_valid_checkpoint_behind_latest(worlds, tmp_path, step):
    """Killed while replacing step 5 (which latest names) or writing step 6: latest still leads to a
    complete checkpoint, old or new, and the next save removes every leftover of the killed one."""
    rows = worlds[1].run(crash_points, str(tmp_path), step)[0]
    assert len(rows) >= 6, rows  # renames in, aside and out, the pointer, deletions: each a point to die at
    for n, reached, which, _aside, left, after in rows:
        assert (reached, which) in [(5, ["old"]), (step, ["new"])], (n, reached, which)
        assert after == 7 and left in (["step-000005"], [f"step-{step:06d}"]), (n, left)  # no leftover
    if step == 5:  # killed between moving the old copy aside and the new one in: latest led to the aside copy
        assert any(aside for _, _, _, aside, _, _ in rows), rows


def stale_and_live(root):
    """A save beside what crashed saves left (temporary directories and pointer files of another
    process, an aside copy whose checkpoint exists), this process's own unfinished save, and a name
    that is not the library's."""
    out, dead = Path(root), dead_pid()
    entries = [f".tmp-{dead}-step-000001", f".tmp-{dead}-latest", ".old-step-000002",
               f".tmp-{os.getpid()}-step-000004", ".tmp-not-ours"]
    out.mkdir()
    (out / "step-000002").mkdir()  # the aside copy's checkpoint exists: the aside is stale
    for name in entries:
        if name.endswith("latest"):
            (out / name).write_text("step-000001\n")
        else:
            (out / name).mkdir()
            (out / name / "__0_0.distcp").write_bytes(b"partial")
    try:  # this process's own entry is a save it has not finished (an async_save not yet waited for)
        checkpoint.save(out, trained(0)[0], step=9, keep=3)
        refusal = ""
    except checkpoint.CheckpointError as e:
        refusal = str(e)
    (out / entries[3] / "__0_0.distcp").unlink()
    (out / entries[3]).rmdir()  # waited for, say
    checkpoint.save(out, trained(0)[0], step=9, keep=3)
    return sorted(p.name for p in out.iterdir()), refusal


def test_the_next_save_removes_what_crashed_saves_left_and_nothing_else(worlds, tmp_path):
    """Stale: another process's temporary directory and pointer file, an aside copy. Kept: a name that
    is not the library's. An unfinished save of the saving process itself is refused by name until it
    is gone. (One process saves into a directory at a time: another's temporaries count as stale.)"""
    left, refusal = worlds[1].run(stale_and_live, str(tmp_path / "run"))[0]
    assert left == [".tmp-not-ours", "latest", "step-000002", "step-000009"], left
    assert "-step-000004 is a save of this process still being written: call the wait()" in refusal, refusal


# --- dtypes ---------------------------------------------------------------------------------------

def save_mixed(out):
    """Save a bf16 model with integer buffers and its bf16 optimizer state at this world's tp."""
    model, optimizer = mixed_trained(0)
    checkpoint.save(out, model, optimizer, step=1)
    return tensorpar.full_state_dict(model)


def refusal(out, model, **options):
    try:
        checkpoint.load(out, model, **options)
    except checkpoint.CheckpointError as e:
        return str(e)
    return ""


def reload_mixed(out, again):
    """Load the checkpoint into another model at this tp and save that again; load it into models of
    other dtypes: an int64 buffer and a float32 GPT (refused, then converted with cast=True)."""
    model, optimizer = mixed_trained(1)
    checkpoint.load(out, model, optimizer)
    checkpoint.save(again, model, optimizer, step=1)
    wider, single = Mixed(1, count_dtype=torch.int64), Mixed(1, dtype=torch.float32)
    refusals = [refusal(out, wider), refusal(out, single), refusal(out, single, cast=True)]
    return model.state_dict(), single.state_dict(), refusals


def test_every_dtype_round_trips_bitwise_across_tp_and_another_is_refused_unless_cast(worlds, tmp_path):
    out, again = tmp_path / "tp2", tmp_path / "tp1"
    reference = worlds[2].run(save_mixed, str(out))[0]
    loaded, converted, (wider, single, cast) = worlds[1].run(reload_mixed, str(out), str(again))[0]
    assert bitwise_equal(loaded, reference)  # bf16 weights and int32/int64 buffers, exactly
    first, second = everything(out), everything(again)  # saved at tp=2, loaded and saved at tp=1
    assert bitwise_equal({k: v for k, v in first.items() if not k.startswith("rng.")},
                         {k: v for k, v in second.items() if not k.startswith("rng.")})
    assert {v.dtype for k, v in first.items() if k.startswith(("model.gpt.", "optim.")) and v.dim()} == {torch.bfloat16}
    assert "meta.json: model.count is stored as torch.int32 of shape (3,), the model's is torch.int64 of shape (3,)" \
        in wider, wider
    assert re.search(r"meta\.json: model\.gpt\.\S+ is stored as torch\.bfloat16 of shape \(\d+, \d+\), the model's is "
                     r"torch\.float32 of shape \(\d+, \d+\) \(load\(\.\.\., cast=True\) converts it\)", single), single
    assert cast == "" and bitwise_equal(converted, {k: v.float() if k.startswith("gpt.") else v
                                                    for k, v in reference.items()})


# --- ZeRO; our own code unpickles nothing ---------------------------------------------------------

def zero_round_trip(out):
    """Save and load a ZeroRedundancyOptimizer over dp=2; then compare the loaded optimizer with the
    saved one, each consolidated by torch."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    mesh = tensorpar.current_mesh()

    def build(seed):
        model = trained(seed)[0]
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                            process_group=mesh.dp_group, lr=seed + 1e-3, betas=(0.9, 0.95))
        model(torch.arange(8).reshape(1, 8), torch.arange(8).reshape(1, 8)).backward()
        optimizer.step()
        return model, optimizer

    (model, optimizer), (other, other_optimizer) = build(0), build(1)
    checkpoint.save(out, model, optimizer, step=1)
    checkpoint.load(out, other, other_optimizer)
    optimizer.consolidate_state_dict(to=0)
    other_optimizer.consolidate_state_dict(to=0)
    if mesh.rank:
        return None
    return (bitwise_equal(optimizer.state_dict(), other_optimizer.state_dict()),
            bitwise_equal(model.state_dict(), other.state_dict()),
            len(optimizer.state_dict()["state"]) == len(list(model.parameters())))


def test_zero_optimizer_state_travels(worlds, tmp_path):
    same_optimizer, same_model, every_parameter = worlds[2].run(zero_round_trip, str(tmp_path), tp=1, dp=2)[0]
    assert same_optimizer and same_model and every_parameter


def saves_of_unsupported_optimizer_states(root):
    """What saving refuses about an optimizer: a tensor outside the model, a state shaped unlike its parameter."""
    model, optimizer = trained(0)
    stranger = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    optimizer.state[next(model.parameters())]["factored"] = torch.zeros(3)
    said = []
    for options in ({"optimizer": stranger}, {"optimizer": optimizer}):
        try:
            checkpoint.save(Path(root) / "run", model, step=1, **options)
        except checkpoint.CheckpointError as e:
            said.append(str(e))
    return said, os.listdir(root)


def test_a_save_refuses_an_optimizer_it_cannot_store_and_writes_nothing(worlds, tmp_path):
    said, left = worlds[1].run(saves_of_unsupported_optimizer_states, str(tmp_path))[0]
    assert said[0] == "rank 0: the optimizer holds a tensor that is not a parameter of the model", said
    assert re.fullmatch(r"rank 0: optim\.state\.\S+\.factored has shape \(3,\), its parameter \(\d+(, \d+)*\): only "
                        r"states shaped like their parameter, and scalars, are checkpointed", said[1]), said
    assert left == [], left  # refused before the directory is made


def a_save_whose_write_fails_on_rank_1(root):
    """A save whose data file cannot be written on rank 1 (a full disk): what each rank raises, what is left."""
    model, optimizer = trained(0)
    write = torch.distributed.checkpoint.FileSystemWriter.write_data

    def full_disk(self, plan, planner):
        raise OSError(28, "No space left on device")

    if tensorpar.current_mesh().rank == 1:
        torch.distributed.checkpoint.FileSystemWriter.write_data = full_disk
    try:
        checkpoint.save(Path(root), model, optimizer, step=3)
        said = "saved"
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        said = f"{type(e).__name__}: {e}"
    finally:
        torch.distributed.checkpoint.FileSystemWriter.write_data = write
    torch.distributed.barrier()
    return said, sorted(os.listdir(root))


def test_a_write_that_fails_on_one_rank_fails_the_save_on_every_rank_and_publishes_nothing(worlds, tmp_path):
    for said, left in worlds[2].run(a_save_whose_write_fails_on_rank_1, str(tmp_path)):
        assert said.startswith("CheckpointException") and "No space left on device" in said, said
        assert left == [], left  # no checkpoint, no temporary directory, no latest


def test_checkpoint_code_unpickles_nothing_from_disk():
    """DCP pickles its ``.metadata`` (hashed before it is read); tensorpar's own files are JSON. The ranks'
    agreement is an ``all_gather_object`` (it unpickles only what the ranks themselves sent)."""
    code = "\n".join(p.read_text() for p in (ROOT / "tensorpar" / "checkpoint").glob("*.py"))
    found = re.findall(r"\bimport pickle|\bpickle\.\w+|\b(?:gather|broadcast|scatter|send|recv)_object"
                       r"(?:_list)?\(|torch\.load\(|\.consolidate_state_dict\(", code)
    assert not found, found


# --- states holding a NaN or an infinity ----------------------------------------------------------

def refused_nonfinite(root):
    """Finite checkpoints of steps 1 and 2, then saves (``keep=1``) of states holding a NaN (a weight's
    shard on rank 1 only) or an infinity (an AdamW moment on rank 0 only), each refused: (this rank's
    messages, whether every file on disk stayed as it was, the checkpoints after a finite save of step 4)."""
    out, mesh = Path(root) / "run", tensorpar.current_mesh()
    model, optimizer = trained(0)
    for step in (1, 2):
        checkpoint.save(out, model, optimizer, step=step, keep=2)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    weight = model.transformer.wte.weight  # tied: the lm_head's too
    moment = optimizer.state[weight]["exp_avg_sq"]
    messages = []
    for rank, tensor, value, save in ((1, weight, float("nan"), checkpoint.save),
                                      (0, moment, float("inf"), checkpoint.async_save)):
        kept = tensor.detach().clone()
        if mesh.rank == rank:
            with torch.no_grad():
                tensor.view(-1)[-1] = value
        try:
            save(out, model, optimizer, step=3, keep=1)
        except checkpoint.CheckpointError as e:
            messages.append(str(e))
        with torch.no_grad():
            tensor.copy_(kept)
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    checkpoint.save(out, model, optimizer, step=4, keep=1)
    return messages, after == before, sorted(p.name for p in out.iterdir())


def test_a_state_holding_nan_or_inf_is_never_saved_and_the_newest_finite_checkpoint_stays(worlds, tmp_path):
    """A save (or an async save) of a state with one non-finite element on one rank is refused on every
    rank, naming the tensor, and changes nothing on disk: retention (keep=1) cannot remove the newest
    finite checkpoint; the next finite save prunes as usual."""
    (mine, unchanged, kept), (theirs, unchanged_too, _) = worlds[2].run(refused_nonfinite, str(tmp_path))
    assert unchanged and unchanged_too and kept == ["latest", "step-000004"]
    said = ("the checkpoint of step 3 would hold NaN or infinite values (in {}): not saved, and the checkpoints "
            "already in the directory are left as they are")
    weight = "model.transformer.wte.weight, model.lm_head.weight"
    moment = "optim.state.transformer.wte.weight.exp_avg_sq"
    assert theirs[0] == "rank 1: " + said.format(weight)
    assert mine[0] == f"rank 1: {said.format(weight)} (so rank 0 did not save the checkpoint either)"
    assert mine[1] == "rank 0: " + said.format(moment)
    assert theirs[1] == f"rank 0: {said.format(moment)} (so rank 1 did not save the checkpoint either)"

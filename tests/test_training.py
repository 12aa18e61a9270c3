"""Training with tensor x data parallelism: the same trajectory at every layout, checkpoints that resume (at any
tp) to the same parameters, and clear errors for broken checkpoints.

The training script runs on the pool's ranks as torchrun would run it (``run_script``), and
is judged by what it writes: ``metrics.jsonl`` and its checkpoints."""

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tensorpar
from examples.train import parse_args
from layers import GPT, GPTConfig
from tensorpar import checkpoint
from tensorpar.testing import assert_all_close, run_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"

#: a small run: 5 steps, gradient accumulation over 2 micro-batches, clipping below the gradient norm
SMALL = dict(steps=5, batch_size=8, grad_accum=2, block_size=16, n_layer=2, n_head=4, n_embd=32, warmup=2,
             clip=0.5, sample_tokens=0, progress=False)


def flags(options):
    """Command-line flags of the training script for ``options``."""
    return [(f"--{k}" if v else f"--no-{k}") if isinstance(v, bool) else f"--{k}={v}"
            for k, v in ((k.replace("_", "-"), v) for k, v in options.items())]


def metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def run_training(worlds, out, tp=1, dp=1, **options):
    """Run the training script on the ranks of a pool of tp x dp (x pp, an option); the logged losses
    and gradient norms by step, and the final checkpoint's unsharded weights."""
    worlds[tp * dp * options.get("pp", 1)].run(run_script, str(SCRIPT), *flags(SMALL | options | dict(tp=tp, dp=dp,
                                                                                                      out=out)))
    rows = metrics(out)
    return {"losses": {r["step"]: r["loss"] for r in rows}, "grad_norms": {r["step"]: r["grad_norm"] for r in rows},
            "state": checkpoint.export_state_dict(out)}


def compare_states(state, reference):
    """Every tensor against the reference, each measured against the whole model's norm when larger."""
    norm = torch.cat([v.flatten() for v in reference.values()]).norm().item()
    return assert_all_close({k: (state[k], v, norm) for k, v in reference.items()}, rtol=1e-5,
                            what="parameters differ from the tp=1 dp=1 run")


@pytest.fixture(scope="module")
def reference_run(worlds, tmp_path_factory):
    """tp=1, dp=1, the whole batch of each step in one process."""
    return run_training(worlds, tmp_path_factory.mktemp("reference"))


@pytest.mark.parametrize("tp, dp, zero, sequence_parallel",
                         [(2, 2, False, False), (2, 2, True, True), (4, 1, False, False), (3, 1, False, True),
                          (1, 4, True, False)])
def test_every_layout_follows_the_same_trajectory(worlds, reference_run, tmp_path, tp, dp, zero, sequence_parallel):
    assert_same_trajectory(run_training(worlds, tmp_path, tp, dp, zero=zero, sequence_parallel=sequence_parallel),
                           reference_run)


def assert_same_trajectory(result, reference):
    """Losses and gradient norms of every step within 1e-5 of the reference run's, and the final parameters."""
    assert max(reference["grad_norms"].values()) > SMALL["clip"], "clipping was not active"
    for step, loss in reference["losses"].items():
        assert abs(result["losses"][step] - loss) <= 1e-5 * abs(loss), f"step {step}: loss differs"
        norm = reference["grad_norms"][step]
        assert abs(result["grad_norms"][step] - norm) <= 1e-5 * norm, f"step {step}: gradient norm differs"
    assert max(compare_states(result["state"], reference["state"]).values()) <= 1e-5


def test_resume_reaches_the_uninterrupted_parameters_at_any_tp(worlds, tmp_path, capsys):
    """--stop-at 4 then --resume: one log line per step 1..8, each with the uninterrupted run's losses
    (validation included), and its final parameters."""
    common = dict(steps=8, ckpt_every=3, eval_every=2, eval_iters=2)
    straight = run_training(worlds, tmp_path / "straight", 2, **common)
    out = tmp_path / "run"
    run_training(worlds, out, 2, **common, stop_at=4)  # checkpoints after steps 3 and 4
    assert checkpoint.read_meta(out)["step"] == 4
    logged = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in logged] == [1, 2, 3, 4]
    # each resumes from the step-4 checkpoint, written at tp=2 dp=1; the last with FSDP2 over dp=2 and
    # activation checkpointing (neither changes what a checkpoint holds)
    for tp, dp, extra in ((2, 1, {}), (1, 1, {}), (4, 1, {}), (2, 2, dict(fsdp=True, activation_checkpointing=True))):
        where = Path(f"{out}-{tp}x{dp}")
        shutil.copytree(out, where)
        resumed = run_training(worlds, where, tp, dp, **common, **extra, resume=True)
        rows = metrics(where)
        lines = (where / "metrics.jsonl").read_text().splitlines()
        assert lines[:4] == logged and [r["step"] for r in rows] == list(range(1, 9)), \
            f"tp={tp} dp={dp} did not resume after step 4"  # steps 1-4 kept as logged (timings included), not re-run
        same = (tp, dp, extra) == (2, 1, {})
        for r, s in zip(rows, metrics(tmp_path / "straight"), strict=True):
            for key in ("loss", "val_loss", "grad_norm"):
                assert (key in r) == (key in s) and abs(r.get(key, 0) - s.get(key, 0)) <= (
                    0.0 if same else 1e-5 * abs(s.get(key, 0))), f"tp={tp} dp={dp} step {r['step']}: {key} differs"
        errors = compare_states(resumed["state"], straight["state"])
        assert max(errors.values()) <= (0.0 if same else 1e-5), f"tp={tp} dp={dp}: {max(errors.values())}"
    # the finished run has nothing left to resume; a checkpoint of another model is refused by name
    argv = flags(SMALL | common | dict(tp=2, out=where, resume=True))
    done = f"--resume: the checkpoint in {where} is at step 8, nothing left to run up to step 8 (raise --steps to " \
           "train further)"
    other = f"--resume: the checkpoint in {where} is of another model (--n-embd: checkpoint 32, now 64)"
    for more, message in (([], done), (["--n-embd=64"], other)):
        with pytest.raises(SystemExit):
            parse_args([*argv, *more])
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: {message}")


def check_bad_checkpoints(out):
    """Corrupt or mismatched checkpoints raise CheckpointError and change nothing."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=32, bias=False)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)).backward()
    optimizer.step()
    path = checkpoint.save(out, model, optimizer, step=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    messages = {}
    for name, other in {"n_embd": dataclasses.replace(cfg, n_embd=64),
                        "vocab": dataclasses.replace(cfg, vocab_size=300)}.items():
        try:
            checkpoint.load(out, GPT(other))
        except checkpoint.CheckpointError as e:
            messages[name] = str(e)
    if tensorpar.current_mesh().rank == 0:
        data = (path / "__0_0.distcp").read_bytes()
        (path / "__0_0.distcp").write_bytes(data[: len(data) // 2])  # a crash mid-copy, say
    torch.distributed.barrier()
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in path.iterdir()}
    try:
        checkpoint.load(out, model, optimizer)
    except checkpoint.CheckpointError as e:
        messages["truncated"] = str(e)
    try:
        checkpoint.load(Path(out) / "nowhere", model)
    except checkpoint.CheckpointError as e:
        messages["missing"] = str(e)
    unchanged = all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    untouched = files == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in path.iterdir()}
    return messages, unchanged and untouched


def test_broken_checkpoints_get_clear_errors_and_change_nothing(worlds, tmp_path):
    messages, unchanged = worlds[2].run(check_bad_checkpoints, str(tmp_path))[0]
    assert unchanged
    assert messages["n_embd"].startswith("rank 0: ") and messages["n_embd"].endswith(
        "meta.json: config does not match the model's (n_embd: checkpoint 32, model 64)")
    assert messages["vocab"].startswith("rank 0: ") and messages["vocab"].endswith(
        "meta.json: config does not match the model's (vocab_size: checkpoint 256, model 300)")
    assert messages["truncated"].endswith("__0_0.distcp: size or SHA-256 does not match meta.json")
    assert messages["missing"].startswith("rank 0: no checkpoint at ")


def check_exported_checkpoint(out):
    """The exported checkpoint in the plain model, and the checkpoint loaded into a sharded GPT at this
    tp, give the same logits."""
    from reference_gpt import RefConfig, RefGPT

    cfg = dict(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=32, bias=False)
    plain = RefGPT(RefConfig(**cfg))
    plain.load_state_dict(checkpoint.export_state_dict(out))  # strict: exactly the plain model's keys
    model = GPT(GPTConfig(**cfg))
    checkpoint.load(out, model)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    return assert_all_close({"logits": (model(idx), plain(idx))})["logits"]


def test_export_loads_into_the_plain_model(worlds, tmp_path):
    run_training(worlds, tmp_path, 2, steps=3, ckpt_every=3)
    assert max(worlds[2].run(check_exported_checkpoint, str(tmp_path))) <= 1e-5
    assert {(r["dtype"], "mfu" in r, r["tokens_per_s"] > 0) for r in metrics(tmp_path)} == {("fp32", False, True)}


def test_export_only_writes_a_finished_runs_model(worlds, tmp_path):
    """A finished run (tp=2) exported afterwards by --export-only (tp=1 dp=2, the model options left at their
    defaults: the checkpoint's are used) writes the files the run itself wrote from its live model at its
    end (--export-hf), tensor for tensor; transformers' GPT-2 from them gives the plain model's logits."""
    pytest.importorskip("safetensors", reason="the hf extra is not installed")
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    from reference_gpt import RefConfig, RefGPT

    out = tmp_path / "run"
    run_training(worlds, out, 2, steps=3, ckpt_every=3, export_hf=tmp_path / "live")
    worlds[2].run(run_script, str(SCRIPT), "--tp=1", "--dp=2", f"--out={out}", "--export-only",
                  f"--export-hf={tmp_path / 'after'}", "--no-progress")
    live, after = (load_file(tmp_path / name / "model.safetensors") for name in ("live", "after"))
    assert live.keys() == after.keys() and all(torch.equal(live[k], after[k]) for k in live)
    assert (tmp_path / "live" / "config.json").read_text() == (tmp_path / "after" / "config.json").read_text()
    plain = RefGPT(RefConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=32, bias=False))
    plain.load_state_dict(checkpoint.export_state_dict(out))
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "after", local_files_only=True).eval()
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_all_close({"logits": (hf(idx).logits, plain(idx))})
    assert len(metrics(out)) == 3  # nothing trained, nothing logged


def _children(parent: int) -> list[int]:
    """Pids of the processes ``parent`` started (Linux /proc)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            pids.append(int(stat.parent.name))
    return sorted(pids)


def _ranks(launcher: int) -> list[int]:
    """Pids of the ranks ``launcher`` started: the children of its fork server (see tensorpar.launch)."""
    def cmdline(pid):
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""

    return [rank for pid in _children(launcher) if b"multiprocessing.forkserver" in cmdline(pid)
            for rank in _children(pid)]


def _logged_steps(out: Path) -> int:
    log = out / "metrics.jsonl"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_a_killed_rank_stops_the_run_and_the_last_checkpoint_resumes(worlds, tmp_path):
    """SIGKILL one rank mid-run: the launcher exits with an error naming it within seconds, the last
    complete checkpoint is intact, and resuming from it ends where an uninterrupted run does."""
    out = tmp_path / "run"
    steps = dict(steps=40, ckpt_every=4)
    command = [sys.executable, str(SCRIPT), *flags(SMALL | steps | dict(tp=2, out=out))]
    run = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while _logged_steps(out) < 10 and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    workers = _ranks(run.pid)
    assert run.poll() is None and len(workers) >= 2, "the run ended before it could be interrupted"
    os.kill(workers[-1], signal.SIGKILL)
    killed = time.monotonic()
    _, stderr = run.communicate(timeout=60)
    assert time.monotonic() - killed < 30
    assert run.returncode != 0 and "was killed by signal 9" in stderr, stderr[-2000:]
    meta = checkpoint.read_meta(out)  # verifies every file of the newest checkpoint
    assert meta["step"] >= 8 and meta["step"] % 4 == 0 and meta["step"] < 40

    resumed = run_training(worlds, out, 2, resume="must", **steps)  # on the pool's ranks, as torchrun runs it
    assert checkpoint.read_meta(out)["step"] == 40
    # the steps the killed run logged after its last checkpoint were dropped and run again
    assert [r["step"] for r in metrics(out)] == list(range(1, 41))
    straight = run_training(worlds, tmp_path / "straight", 2, **steps)["state"]
    assert max(compare_states(resumed["state"], straight).values()) <= 1e-6


def test_training_runs_under_torchrun(tmp_path):
    """torchrun starts the ranks; the script builds tp=1 x dp=2 from them (dp: the world over tp) and
    checkpoints."""
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run([str(torchrun), "--nproc-per-node=2", str(SCRIPT), "--tp=1",
                           "--steps=4", "--n-layer=1", "--n-embd=32", "--block-size=16", f"--out={tmp_path}",
                           "--no-progress", "--sample-tokens=8"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(tp=1, dp=2)" in done.stdout and "sample:" in done.stdout
    meta = checkpoint.read_meta(tmp_path)
    assert (meta["step"], meta["tp"], meta["dp"]) == (4, 1, 2)


def check_pruning(out):
    """Older checkpoints go by step number, and the one just written always stays."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, block_size=4, n_layer=1, n_head=2, n_embd=8))
    for step in (999_999, 1_000_000, 99):  # a stale run's checkpoints, then a new run's first
        checkpoint.save(out, model, step=step, keep=2)
    regrouped = torch.optim.AdamW([{"params": list(model.parameters())[:3]}, {"params": list(model.parameters())[3:]}])
    checkpoint.save(out, model, torch.optim.AdamW(model.parameters()), step=100, keep=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        checkpoint.load(out, model, regrouped)
        message = None
    except checkpoint.CheckpointError as e:
        message = str(e)
    unchanged = all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    return sorted(p.name for p in Path(out).glob("step-*")), checkpoint.read_meta(out)["step"], message, unchanged


def test_pruning_keeps_the_newest_and_a_mismatched_optimizer_changes_nothing(worlds, tmp_path):
    kept, latest, message, unchanged = worlds[1].run(check_pruning, str(tmp_path))[0]
    assert kept == ["step-000100", "step-1000000"] and latest == 100
    assert message.startswith("rank 0: ") and message.endswith(
        "step-000100/meta.json: param_groups lists 1 group, the optimizer has 2")
    assert unchanged

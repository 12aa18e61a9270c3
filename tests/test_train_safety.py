"""A training run never destroys its own work: a diverging run stops (or skips the step) at its first
NaN, with its good checkpoints kept; an output directory belongs to one run (a second job is refused by
the first's pid, a rerun must say --resume or --overwrite, which moves the earlier run aside); a
metrics log cut short by a crash still resumes; a checkpoint directory is no --out.

The script runs on the pool's ranks as torchrun would run it, and as real processes where the test is
about processes (two jobs, a killed holder)."""

import os
import runpy
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tensorpar
from examples.train import plot
from tensorpar import checkpoint
from tensorpar.checkpoint.safetensors_file import Reader
from tensorpar.testing import run_script
from test_training import ROOT, SCRIPT, SMALL, _ranks, flags, metrics

#: learning rate at which SMALL diverges within a few steps whatever the CPU's kernels: the gradient norm
#: grows about 1e7-fold a step and is infinite from step 2 to 5 on, by hardware (a smaller rate such as 30
#: swings, and may or may not overflow). The stopping run checkpoints every step, so a checkpoint precedes
#: the first non-finite step wherever it falls.
DIVERGING = dict(steps=8, ckpt_every=2, eval_every=0, lr=200)


def finite(value):
    return abs(value) < float("inf")


def script_main(monkeypatch):
    """The script's main in this process, with no rank allowed to start (for refusals before they do)."""
    def no_ranks(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(tensorpar, "spawn", no_ranks)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    return runpy.run_path(str(SCRIPT), run_name="train_gpt")["main"]


def refused(capsys, main, *argv):
    """The error line of a command line the script refuses as an argument error (exit code 2)."""
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and "Traceback" not in "\n".join(err), err
    return err[-1].split("error: ", 1)[1]


def optimizer_steps(path):
    """AdamW's step count of every parameter in the checkpoint at ``path`` (read from its files)."""
    steps = set()
    for file in Path(path).glob("shard-*.safetensors"):
        with Reader(file) as reader:
            steps |= {reader.read(k).item() for k in reader.keys()  # noqa: SIM118 - a Reader is no mapping
                       if k.startswith("optim.") and k.endswith(".step")}
    return steps


def test_a_diverging_run_stops_or_skips_at_each_non_finite_step_and_keeps_its_checkpoints(worlds, tmp_path):
    """--on-nonfinite stop (tp=2): the run ends at the first step whose loss or gradient norm is not
    finite, naming it, with the checkpoints of the steps before it, all finite. --on-nonfinite skip
    (two pipeline stages): exactly the non-finite steps are skipped, each by every rank: they change
    neither the weights nor the optimizer, and the run ends normally."""
    out = tmp_path / "stop"
    with pytest.raises(tensorpar.RankError) as error:
        worlds[2].run(run_script, str(SCRIPT), *flags(SMALL | DIVERGING | dict(tp=2, ckpt_every=1, out=out)))
    rows = metrics(out)
    bad = rows[-1]
    assert all(finite(r["loss"]) and finite(r["grad_norm"]) and "skipped" not in r for r in rows[:-1])
    assert not (finite(bad["loss"]) and finite(bad["grad_norm"])) and bad["skipped"] is True
    step, newest = bad["step"], out / f"step-{bad['step'] - 1:06d}"
    assert 1 < step <= DIVERGING["steps"], "the run did not diverge as this test needs"
    assert error.value.rank == 0 and (
        f"SystemExit: step {step}: the loss is {bad['loss']}, the gradient norm {bad['grad_norm']}: the run stopped "
        f"there (--on-nonfinite stop), with no checkpoint of it; the newest checkpoint, {newest}, is untouched"
        in str(error.value))
    assert sorted(p.name for p in out.glob("step-*"))[-1] == newest.name == checkpoint.resolve(out).name
    for path in out.glob("step-*"):
        assert all(torch.isfinite(v).all() for v in checkpoint.export_state_dict(path).values()), path

    out = tmp_path / "skip"
    worlds[2].run(run_script, str(SCRIPT), *flags(SMALL | DIVERGING | dict(tp=1, pp=2, on_nonfinite="skip",
                                                                           out=out)))
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 9))
    for r in rows:
        assert r.get("skipped", False) == (not (finite(r["loss"]) and finite(r["grad_norm"]))), r
    taken = sum("skipped" not in r for r in rows)
    assert taken > 0 and {7, 8} <= {r["step"] for r in rows if "skipped" in r}, "no step to skip here"
    assert optimizer_steps(out / "step-000008") == optimizer_steps(out / "step-000006") == {taken}
    sixth, eighth = checkpoint.export_state_dict(out / "step-000006"), checkpoint.export_state_dict(out / "step-000008")
    assert all(torch.equal(sixth[k], v) for k, v in eighth.items())  # steps 7 and 8 skipped: nothing moved


def test_a_new_run_into_an_earlier_runs_directory_needs_resume_or_overwrite(worlds, tmp_path, capsys, monkeypatch):
    """A second run into the same --out is refused before any rank starts, naming --resume and
    --overwrite; --overwrite moves the earlier run into OUT/replaced-<time>/ whole (a run that still
    resumes), and the new run starts afresh beside it."""
    out = tmp_path / "run"
    common = dict(steps=4, ckpt_every=2, eval_every=0)
    worlds[1].run(run_script, str(SCRIPT), *flags(SMALL | common | dict(tp=1, out=out)))
    before = (out / "metrics.jsonl").read_text()
    main = script_main(monkeypatch)
    argv = flags(SMALL | common | dict(tp=1, out=out))
    assert refused(capsys, main, *argv) == (
        f"--out {out} holds an earlier run (latest, loss.png, metrics.jsonl, step-000002 and 1 more): pass --resume "
        f"to continue it, or --overwrite to start afresh (its files are moved into {out}/replaced-<time>/), or "
        "another --out")
    assert refused(capsys, main, *argv, "--overwrite", "--resume") == (
        "--overwrite and --resume exclude each other: --overwrite sets the earlier run aside, --resume continues it")

    worlds[1].run(run_script, str(SCRIPT), *flags(SMALL | dict(steps=2, eval_every=0, tp=1, out=out, overwrite=True)))
    (aside,) = out.glob("replaced-*")
    assert sorted(p.name for p in aside.iterdir()) == ["latest", "loss.png", "metrics.jsonl", "step-000002",
                                                       "step-000004"]
    assert (aside / "metrics.jsonl").read_text() == before and checkpoint.read_meta(aside)["step"] == 4
    assert [r["step"] for r in metrics(out)] == [1, 2] and checkpoint.read_meta(out)["step"] == 2


def _wait_for(condition, what, limit=120.0):
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _lines(path):
    return path.read_text().splitlines() if path.exists() else []


def test_a_second_job_on_the_same_out_is_refused(tmp_path):
    """Two jobs on one --out: the second is refused (exit code 2) naming the first's pid while the first
    holds it (its launcher stopped with SIGSTOP meanwhile, once it has started its rank, so that it
    cannot end first), and the first then runs to the end with every line of its log. (A holder killed
    by a signal holds nothing after: test_faults.test_ranks_stop_when_the_training_launcher_is_killed.)"""
    out = tmp_path / "run"
    steps = 6

    def command(where):
        return [sys.executable, str(SCRIPT), *flags(SMALL | dict(tp=1, steps=steps, eval_every=0, out=where))]

    def start(where):
        return subprocess.Popen(command(where), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # its own process group: it and what it starts

    first = start(out)
    _wait_for(lambda: first.poll() is not None or _ranks(first.pid), "the first job's rank")
    os.kill(first.pid, signal.SIGSTOP)  # the launcher, which holds the lock; its rank starts meanwhile
    try:
        assert _lines(out / "run.lock") == [str(first.pid)]
        second = subprocess.run(command(out), cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    _, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr[-2000:]
    assert second.returncode == 2 and second.stderr.strip().splitlines()[-1] == (
        f"train_gpt.py: error: --out {out} is in use by another run (pid {first.pid}, which holds {out}/run.lock): "
        "wait for it to end, or pass another --out"), second.stderr[-2000:]
    assert [r["step"] for r in metrics(out)] == list(range(1, steps + 1))


def test_a_torn_last_line_resumes_and_a_checkpoint_directory_is_no_out(worlds, tmp_path, capsys, monkeypatch):
    """A crash that cut the log's last line short: the plot and --resume skip that line (the resumed run
    logs the steps after its checkpoint); an unreadable line elsewhere is refused before any rank starts,
    by file and line. --out naming a checkpoint directory, with or without --resume, is refused by the
    script before any rank starts, naming its parent."""
    out = tmp_path / "run"
    common = dict(tp=1, steps=6, ckpt_every=2, eval_every=0, out=out)
    worlds[1].run(run_script, str(SCRIPT), *flags(SMALL | common | dict(stop_at=4)))
    log = out / "metrics.jsonl"
    lines = log.read_text().splitlines()
    log.write_text("\n".join(lines[:3]) + "\n" + lines[3][:40])  # the crash: step 4's line half written
    plot(out)
    main = script_main(monkeypatch)
    for argv in ([], ["--resume"]):
        checkpoint_out = out / "step-000004"
        assert refused(capsys, main, *flags(SMALL | common | dict(out=checkpoint_out)), *argv) == (
            f"--out {checkpoint_out} is a checkpoint directory: pass the run's directory, its parent (--out {out}), "
            "with --resume to continue from its newest checkpoint")
    garbled = tmp_path / "garbled"
    garbled.mkdir()
    shutil.copy(out / "latest", garbled)
    shutil.copytree(out / "step-000004", garbled / "step-000004")
    (garbled / "metrics.jsonl").write_text("\n".join([lines[0], "{not json", *lines[2:]]) + "\n")
    assert refused(capsys, main, *flags(SMALL | common | dict(out=garbled)), "--resume").startswith(
        f"{garbled}/metrics.jsonl, line 2: not a line of a metrics log")

    worlds[1].run(run_script, str(SCRIPT), *flags(SMALL | common), "--resume")
    assert log.read_text().splitlines()[:3] == lines[:3]
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 5, 6]  # step 4's line was lost in the crash

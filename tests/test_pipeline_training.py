"""Training with pipeline x tensor x data parallelism (``train_gpt.py --pp``), and with the optimizer
state offloaded to host memory: the same trajectory as the whole model in one process, and
checkpoints written at one (pp, tp, dp) that resume at others.

As in test_training, the script runs on the pool's ranks as torchrun would run it and is judged by
what it writes. The pipeline splits each accumulation step's batch into ``--microbatches``."""

import json
import shutil
from pathlib import Path

import pytest

from tensorpar import checkpoint
from test_training import SMALL, assert_same_trajectory, compare_states, metrics, run_training

PIPELINED = dict(microbatches=2)
pytestmark = pytest.mark.slow  # runs in `make test`; `-m "not slow"` leaves these whole-script runs out


@pytest.fixture(scope="module")
def references(worlds, tmp_path_factory):
    """tp=1, dp=1, pp=1 runs, by number of blocks: the whole batch of each step in one process."""
    return {n: run_training(worlds, tmp_path_factory.mktemp(f"reference-{n}"), n_layer=n) for n in (2, 4)}


@pytest.mark.parametrize("tp, dp, pp, schedule, extra", [
    (2, 1, 2, "gpipe", {}),
    (2, 1, 2, "1f1b", {"sequence_parallel": True}),
    (1, 2, 2, "1f1b", {}),  # DDP over dp in each stage
    (1, 2, 2, "gpipe", {"fsdp": True}),  # FSDP2 over dp in each stage
    (1, 2, 2, "1f1b", {"zero": True}),
    (1, 1, 2, "interleaved", {"n_layer": 4}),  # 2 stages per rank: blocks 0 and 2 on rank 0
    # AdamW in host memory through FSDP2's CPUOffloadPolicy (the device is the CPU here): in each stage,
    (2, 1, 2, "1f1b", {"offload_optimizer": True}),
    (1, 2, 1, "1f1b", {"offload_optimizer": True, "zero": True}),  # with ZeRO's dp shards of the state (FSDP2's)
    (1, 2, 1, "1f1b", {"offload_optimizer": True, "fsdp": True}),
])
def test_pipelined_layouts_follow_the_same_trajectory(worlds, references, tmp_path, tp, dp, pp, schedule, extra):
    result = run_training(worlds, tmp_path, tp, dp, pp=pp, schedule=schedule, **PIPELINED | extra)
    assert [r["pp"] for r in metrics(tmp_path)] == [pp] * SMALL["steps"]
    assert_same_trajectory(result, references[extra.get("n_layer", SMALL["n_layer"])])


def test_a_pipelined_checkpoint_resumes_at_other_layouts(worlds, tmp_path):
    """Written at pp2 x tp2 after step 4 of 8 (model and AdamW state), resumed at pp1 x tp2, pp2 x tp1
    and tp4 (and written at tp2, resumed at pp2 x dp2): the uninterrupted pp2 x tp2 run's losses and
    final parameters."""
    common = dict(steps=8, ckpt_every=4, **PIPELINED)
    straight = run_training(worlds, tmp_path / "straight", 2, pp=2, **common)
    out = tmp_path / "run"
    run_training(worlds, out, 2, pp=2, **common, stop_at=4)
    meta = checkpoint.read_meta(out)
    assert (meta["step"], meta["tp"], meta["dp"], meta["pp"]) == (4, 2, 1, 2)
    for tp, pp in ((2, 1), (1, 2), (4, 1)):
        where = Path(f"{out}-tp{tp}-pp{pp}")
        shutil.copytree(out, where)
        resumed = run_training(worlds, where, tp, pp=pp, **common, resume=True)
        rows = [json.loads(line) for line in (where / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, 9))
        for r, s in zip(rows[4:], metrics(tmp_path / "straight")[4:], strict=True):
            assert abs(r["loss"] - s["loss"]) <= 1e-5 * s["loss"], f"tp={tp} pp={pp} step {r['step']}: loss differs"
        errors = compare_states(resumed["state"], straight["state"])
        assert max(errors.values()) <= 1e-5, f"tp={tp} pp={pp}: {max(errors.values())}"
    # and the other way: written by the whole model at tp=2, resumed as 2 stages of tp=1 x dp=2, where the
    # last stage's copy of the tied head takes the embedding's weights and AdamW state
    whole = tmp_path / "whole"
    run_training(worlds, whole, 2, **common, stop_at=4)
    resumed = run_training(worlds, whole, 1, 2, pp=2, **common, resume=True)
    assert max(compare_states(resumed["state"], straight["state"]).values()) <= 1e-5

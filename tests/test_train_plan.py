"""Plan before you launch, from the training script's command line: --dry-run prints layers.plan's plan
of the layout the options describe (with --json, its numbers), --suggest the planner's layouts that fit,
and a run whose plan exceeds each rank's memory is refused before any rank starts, naming the numbers
and the nearest layouts that fit (--force launches anyway). No test here starts a rank; every number
is compared with layers.plan's for a layout written out in the test, never with a constant."""

import dataclasses
import json
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import tensorpar
from examples.train import parse_args, planning
from layers import GPTConfig
from layers.plan import Layout, Suggestions, plan, suggest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"
#: the script's default model (--n-layer 4 --n-head 4 --n-embd 128 --block-size 64, bytes)
DEFAULT_GPT = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128, bias=False)
DEFAULT_REQUIRED = ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes", "peak_bytes")


class RanksWouldStart(Exception):
    pass


@pytest.fixture(autouse=True)
def cpu_host_not_under_torchrun(monkeypatch):
    """A host without GPUs (the run's default dtype is then fp32), not under torchrun."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def script_main(monkeypatch):
    """The script's main, as a user runs it, with starting a rank an error."""
    def no_ranks(*args, **kwargs):
        raise RanksWouldStart

    monkeypatch.setattr(tensorpar, "spawn", no_ranks)
    monkeypatch.setattr(tensorpar, "init", no_ranks)
    return runpy.run_path(str(SCRIPT), run_name="train_gpt")["main"]


def refusal(capsys, *argv):
    """The one-line error of a refused command line (argparse's exit code 2)."""
    with pytest.raises(SystemExit) as exit_:
        parse_args(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err[0].startswith("usage:") and "Traceback" not in "\n".join(err)
    return err[-1].split("error: ", 1)[1]


#: command lines and the layout each describes, written out: a rank's micro-batch is --batch-size over
#: dp and --grad-accum (and the pipeline's --microbatches at --pp > 1)
LAYOUTS = [
    ([], dict(tp=2, micro_batch=16)),
    (["--tp=2", "--dp=2", "--fsdp", "--sequence-parallel", "--dtype=bf16"],
     dict(tp=2, dp=2, dp_sharding="fsdp", sequence_parallel=True, micro_batch=8, autocast="bfloat16")),
    (["--tp=1", "--dp=4", "--zero", "--activation-checkpointing", "--grad-accum=2"],
     dict(tp=1, dp=4, dp_sharding="zero", activation_checkpointing=True, micro_batch=2, microbatches=2)),
    (["--tp=2", "--dp=2", "--offload-optimizer", "--batch-size=8"],
     dict(tp=2, dp=2, dp_sharding="fsdp", offload_optimizer=True, micro_batch=4)),
    (["--tp=1", "--pp=2", "--schedule=gpipe", "--microbatches=4", "--grad-accum=2", "--block-size=32"],
     dict(tp=1, pp=2, schedule="gpipe", micro_batch=2, microbatches=4, seq_len=32)),
    (["--tp=3", "--bitwise", "--sequence-parallel"], dict(tp=3, micro_batch=16, sequence_parallel=True, bitwise=True)),
    (["--pp=2", "--schedule=interleaved", "--stages-per-rank=2", "--microbatches=4"],
     dict(tp=2, pp=2, schedule="interleaved", stages_per_rank=2, micro_batch=4, microbatches=4)),
]


def expected_layout(fields):
    return Layout(**{"seq_len": 64, **fields})


@pytest.mark.parametrize("argv, fields", LAYOUTS, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_dry_run_json_is_the_plan_of_the_options_layout(monkeypatch, capsys, tmp_path, argv, fields):
    """--dry-run --json: one JSON object holding layers.plan's numbers of the layout the options describe
    (its largest rank), the layout itself and the memory; no rank starts and --out is not made."""
    layout = expected_layout(fields)
    config = dataclasses.replace(DEFAULT_GPT, block_size=layout.seq_len,
                                 activation_checkpointing=layout.activation_checkpointing,
                                 sequence_parallel=layout.sequence_parallel)
    script_main(monkeypatch)([*argv, "--dry-run", "--json", f"--out={tmp_path}/out"])
    captured = capsys.readouterr()
    printed = json.loads(captured.out)  # one object, nothing else on stdout
    want = json.loads(json.dumps(plan(config, layout).as_dict()))
    assert set(DEFAULT_REQUIRED) <= set(printed) and {k: printed[k] for k in want} == want
    assert printed["layout"] == dataclasses.asdict(layout) and printed["device"] is None
    assert printed["fits"] == (want["peak_bytes"] <= printed["memory_bytes"]) and printed["memory_bytes"] > 0
    assert not (tmp_path / "out").exists()


def test_the_bitwise_mode_with_dropout_is_planned_and_checked(monkeypatch, capsys, tmp_path):
    """--bitwise --dropout: the plan of that layout, dropout counted (a run's memory is checked like any other)."""
    script_main(monkeypatch)(["--tp=3", "--bitwise", "--dropout=0.1", "--dry-run", "--json", f"--out={tmp_path}/out"])
    printed = json.loads(capsys.readouterr().out)
    layout = expected_layout(dict(tp=3, micro_batch=16, bitwise=True))
    dropped = plan(dataclasses.replace(DEFAULT_GPT, dropout=0.1), layout).largest
    assert printed["activation_bytes"] == dropped.activation_bytes and printed["peak_bytes"] == dropped.peak_bytes
    assert dropped.activation_bytes != plan(DEFAULT_GPT, layout).largest.activation_bytes


def test_dry_run_prints_the_plans_table_and_leaves_out_alone(monkeypatch, capsys, tmp_path):
    """The table is the plan's; an --out holding an earlier run (which a run would refuse) is neither
    refused nor touched, and no rank starts; exit code 0 (main returns)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir())
    main = script_main(monkeypatch)
    with pytest.raises(SystemExit) as exit_:
        main([f"--out={out}"])  # a run refuses the earlier run's directory
    assert exit_.value.code == 2
    capsys.readouterr()
    assert main(["--tp=2", "--dp=2", "--zero", "--memory=40", "--dry-run", f"--out={out}"]) is None
    printed = capsys.readouterr().out
    p = plan(DEFAULT_GPT, Layout(tp=2, dp=2, dp_sharding="zero", micro_batch=8, seq_len=64))
    assert printed.startswith(p.table() + "\n")
    assert printed.rstrip().endswith(f"the largest rank peaks at {planning.size(p.largest.peak_bytes)} of the "
                                     "40.00 GiB each rank has (--memory 40 GiB): fits")
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir()) == before
    # a memory below the plan's peak: the dry run says so, and still exits 0
    below = p.largest.peak_bytes / 2 / 2**30
    main(["--tp=2", "--dp=2", "--zero", f"--memory={below}", "--dry-run"])
    assert "does not fit: a run would be refused (--force launches anyway" in capsys.readouterr().out


def test_the_device_is_this_hosts_gpu_or_the_one_named(monkeypatch, capsys):
    """On a host with a GPU for each rank: its name, its total memory and bf16 by default; --device-name
    plans for a GPU elsewhere (bf16 by default, as there), with --peak-tflops passed on as FLOP/s."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 << 30))
    main = script_main(monkeypatch)
    main(["--tp=2", "--dry-run", "--json"])
    printed = json.loads(capsys.readouterr().out)
    layout = Layout(tp=2, micro_batch=16, seq_len=64, autocast="bfloat16")
    assert (printed["device"], printed["memory_bytes"], printed["layout"]) == \
        ("NVIDIA H100 80GB HBM3", 80 << 30, dataclasses.asdict(layout))
    want = json.loads(json.dumps(plan(DEFAULT_GPT, layout, device="NVIDIA H100 80GB HBM3").as_dict()))
    assert {k: printed[k] for k in want} == want
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    main(["--tp=4", "--dp=2", "--device-name=A100", "--memory=40", "--peak-tflops=300", "--dry-run", "--json"])
    printed = json.loads(capsys.readouterr().out)
    layout = Layout(tp=4, dp=2, micro_batch=8, seq_len=64, autocast="bfloat16")
    want = json.loads(json.dumps(plan(DEFAULT_GPT, layout, device="A100", peak_flops=300e12).as_dict()))
    assert (printed["device"], printed["memory_bytes"]) == ("A100", 40 << 30) and {k: printed[k] for k in want} == want
    with pytest.raises(SystemExit) as exit_:  # an A100 elsewhere: its memory is not this host's to read
        main(["--tp=4", "--dp=2", "--device-name=A100", "--dry-run"])
    assert exit_.value.code == 2 and capsys.readouterr().err.strip().endswith(
        "error: --device-name A100 plans for GPUs this host does not run the ranks on: give their memory, --memory "
        "GIB (80 for an H100 80GB)")


def within(p, memory):
    """``p`` with every rank's peak at most ``memory`` (a layout the planner found to fit)."""
    return dataclasses.replace(p, ranks=tuple(dataclasses.replace(r, peak_bytes=min(r.peak_bytes, memory))
                                              for r in p.ranks))


def test_a_layout_over_the_memory_is_refused_naming_the_nearest_that_fit(monkeypatch, capsys):
    """A memory below the plan's peak: an argument error with the plan's numbers and the layouts that fit
    that change the fewest options (the faster first among equals), each with what to add to the command."""
    layout = Layout(tp=2, micro_batch=16, seq_len=64)
    p = plan(DEFAULT_GPT, layout)
    memory = p.largest.peak_bytes * 3 // 4
    gib = memory / 2**30
    # the planner's answer: these layouts fit (their plans with every rank's peak within the memory)
    fits = tuple(within(plan(DEFAULT_GPT, other), memory) for other in (
        Layout(tp=1, dp=2, dp_sharding="zero", micro_batch=16, seq_len=64),
        dataclasses.replace(layout, sequence_parallel=True, activation_checkpointing=True),
        dataclasses.replace(layout, activation_checkpointing=True), dataclasses.replace(layout, dp_sharding="fsdp")))
    asked = []

    def fake_suggest(config, world, memory_bytes, *, base, **kwargs):
        asked.append((config, world, memory_bytes, base))
        return Suggestions(fits, ((Layout(tp=2, seq_len=64), "too big"),))

    monkeypatch.setattr(planning, "suggest", fake_suggest)
    message = refusal(capsys, f"--memory={gib!r}")
    big = p.largest
    assert asked == [(DEFAULT_GPT, 2, int(gib * 2**30), layout)]
    size = planning.size
    assert message == (
        f"the plan's largest rank (tp rank {big.tp_rank}, stage {big.pp_stage}, dp rank {big.dp_rank}) peaks at "
        f"{size(big.peak_bytes)} (parameters {size(big.params_bytes)}, gradients {size(big.grads_bytes)}, "
        f"optimizer state {size(big.optimizer_bytes)}, activations {size(big.activation_bytes)}, largest transient "
        f"{size(big.transient_bytes)}), more than the {size(int(gib * 2**30))} each rank has (--memory {gib:g} GiB); "
        f"layouts of 2 ranks that fit: --activation-checkpointing (peak {size(fits[2].largest.peak_bytes)}); "
        f"--fsdp (peak {size(fits[3].largest.peak_bytes)}); --sequence-parallel --activation-checkpointing (peak "
        f"{size(fits[1].largest.peak_bytes)}); --force launches anyway, --dry-run shows the plan")
    # the layout one rank off: --tp 1 --dp 2 keeps the micro-batch per rank, so --batch-size doubles
    assert planning.flags(fits[0].layout, parse_args([]), changed=True) == "--tp 1 --dp 2 --batch-size 32 --zero"
    monkeypatch.setattr(planning, "suggest", lambda *args, **kwargs: Suggestions((), ()))
    assert refusal(capsys, f"--memory={gib!r}").endswith(
        "; no layout of 2 ranks fits (--suggest says why); --force launches anyway, --dry-run shows the plan")
    assert parse_args([f"--memory={gib!r}", "--force"]).force  # --force: not checked
    assert parse_args([f"--memory={2 * p.largest.peak_bytes / 2**30!r}"]).memory  # room: accepted


def test_force_launches_past_the_check_and_without_it_no_rank_starts(monkeypatch, capsys, tmp_path):
    main = script_main(monkeypatch)
    peak = plan(DEFAULT_GPT, Layout(tp=2, micro_batch=16, seq_len=64)).largest.peak_bytes
    small = [f"--memory={peak / 2 / 2**30!r}", f"--out={tmp_path}/run"]
    with pytest.raises(SystemExit) as exit_:
        main(small)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and err.startswith("train_gpt.py: error: the plan's largest rank (")
    assert f"peaks at {planning.size(peak)}" in err and not (tmp_path / "run").exists()
    with pytest.raises(RanksWouldStart):
        main([*small, "--force"])


def test_a_model_over_this_hosts_memory_is_refused_by_a_real_process(tmp_path):
    """The script as a user starts it, with the memory of this host: a 10**9-token vocabulary cannot fit."""
    config = dataclasses.replace(DEFAULT_GPT, vocab_size=10**9, n_embd=32)
    peak = plan(config, Layout(tp=2, micro_batch=16, seq_len=64)).largest.peak_bytes
    assert peak > planning.available_memory()
    done = subprocess.run([sys.executable, str(SCRIPT), "--vocab-size=1000000000", "--n-embd=32", "--n-head=4",
                           f"--out={tmp_path}/run"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr and not (tmp_path / "run").exists()
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("train_gpt.py: error: the plan's largest rank (tp rank ")
    assert f") peaks at {planning.size(peak)} (parameters " in line
    assert "each rank has (this host's " in line and "over its 2 ranks); " in line and "--force launches anyway" in line


def test_suggest_lists_the_planners_fits_fastest_first_and_every_rejection(monkeypatch, capsys):
    """--suggest prints what layers.plan.suggest answers for the world and each rank's memory, in its
    order (fastest first), then every rejected layout with its reason; no rank starts."""
    base = Layout(tp=2, dp=2, micro_batch=8, seq_len=64)
    fast, slow = sorted((plan(DEFAULT_GPT, dataclasses.replace(base, tp=tp, dp=4 // tp), peak_flops=1e12)
                         for tp in (1, 4)), key=lambda p: p.step_time_s)  # the planner's order
    rejected = ((dataclasses.replace(base, tp=1, dp=1, pp=4), "--n-layer 4 over 4 stages: no room"),
                (dataclasses.replace(base, dp_sharding="zero", sequence_parallel=True), "needs 9.0 GiB, 8.0 GiB"))
    asked = []

    def fake_suggest(config, world, memory_bytes, **kwargs):
        asked.append((world, memory_bytes, kwargs))
        return Suggestions((fast, slow), rejected)

    monkeypatch.setattr(planning, "suggest", fake_suggest)
    text = planning.suggestions(parse_args(["--tp=2", "--dp=2", "--memory=8", "--suggest", "--peak-tflops=1"]))
    assert asked == [(4, 8 << 30, {"base": base, "device": None, "peak_flops": 1e12})]
    lines = [" ".join(line.split()) for line in text.splitlines()]  # the columns' padding aside
    assert lines[1] == "fit (2, fastest first):" and lines[4] == "rejected (2):"
    # 8 sequences per rank as given: dp 4 takes --batch-size 32, dp 1 takes 8
    assert lines[2:4] == [f"--tp {p.layout.tp} --dp {p.layout.dp} --pp 1 --batch-size {8 * p.layout.dp} peak "
                          f"{planning.size(p.largest.peak_bytes)} step >= {planning.seconds(p.step_time_s)} for "
                          f"{8 * 64 * p.layout.dp:,} tokens" for p in (fast, slow)]
    assert lines[5:] == ["--tp 1 --dp 1 --pp 4 --microbatches 1 --batch-size 8 --n-layer 4 over 4 stages: no room",
                         "--tp 2 --dp 2 --pp 1 --zero --sequence-parallel needs 9.0 GiB, 8.0 GiB"]
    # the world: tp x dp x pp, --world, or torchrun's
    planning.suggestions(parse_args(["--tp=2", "--world=8", "--batch-size=16", "--memory=8", "--suggest"]))
    monkeypatch.setenv("WORLD_SIZE", "6")
    planning.suggestions(parse_args(["--tp=1", "--batch-size=12", "--memory=8", "--suggest"]))
    assert [world for world, *_ in asked] == [4, 8, 6]


def test_suggest_prints_layers_plans_suggestions(monkeypatch, capsys):
    """The script's --suggest against the planner itself: a line per layout that fits, in its order, and
    one per rejected layout ending with its reason; exit code 0 and no rank started."""
    script_main(monkeypatch)(["--tp=2", "--dp=2", "--memory=0.05", "--peak-tflops=1", "--suggest"])
    lines = capsys.readouterr().out.splitlines()
    found = suggest(DEFAULT_GPT, 4, int(0.05 * 2**30), base=Layout(tp=2, dp=2, micro_batch=8, seq_len=64),
                    peak_flops=1e12)
    assert lines[1] == f"fit ({len(found.fits)}, fastest first):" and lines[2 + len(found.fits)] == \
        f"rejected ({len(found.rejected)}):"
    # fastest first: a peak gives every layout its bound, per token (each layout keeps the micro-batch per rank)
    times = [p.step_time_s / planning.tokens(DEFAULT_GPT, p.layout) for p in found.fits]
    assert times == sorted(times)
    for line, p in zip(lines[2:2 + len(found.fits)], found.fits, strict=True):
        assert f"--tp {p.layout.tp} --dp {p.layout.dp} --pp {p.layout.pp}" in line
        assert line.endswith(f"peak {planning.size(p.largest.peak_bytes):>10}  step >= "
                             f"{planning.seconds(p.step_time_s)} for {planning.tokens(DEFAULT_GPT, p.layout):,} tokens")
    for line, (layout, reason) in zip(lines[3 + len(found.fits):], found.rejected, strict=True):
        assert line.startswith(f"  --tp {layout.tp} --dp {layout.dp} --pp {layout.pp}") and line.endswith(reason)


def test_planning_options_are_checked(capsys, monkeypatch):
    assert refusal(capsys, "--json") == "--json prints the plan of --dry-run: give --dry-run"
    assert refusal(capsys, "--dry-run", "--suggest") == \
        "--dry-run and --suggest exclude each other: --dry-run plans this layout, --suggest lists the layouts that fit"
    assert refusal(capsys, "--world=4") == "--world is for planning: give --dry-run or --suggest"
    assert refusal(capsys, "--device-name=H100") == "--device-name is for planning: give --dry-run or --suggest"
    assert refusal(capsys, "--memory=0") == "--memory must be above 0 GiB, got 0.0"
    assert refusal(capsys, "--memory=nan") == "--memory must be a finite number, got nan"
    assert refusal(capsys, "--world=0", "--suggest") == "--world must be at least 1, got 0"
    assert refusal(capsys, "--world=3", "--dry-run") == "--tp 2 does not divide the world of 3 ranks"
    assert parse_args(["--world=8", "--dry-run"]).dp == 4
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert refusal(capsys, "--world=8", "--dry-run") == "--world 8, but torchrun's world has 4 ranks"


USERS = [["--tp=2", "--dp=2", "--schedule=gpipe"],
         ["--tp=1", "--dp=4", "--offload-optimizer", "--sequence-parallel", "--schedule=gpipe"],
         ["--tp=1", "--pp=2", "--dp=2", "--microbatches=2", "--zero", "--activation-checkpointing",
          "--schedule=gpipe"],
         ["--tp=1", "--pp=2", "--dp=2", "--microbatches=2", "--schedule=interleaved"]]


@settings(max_examples=25, deadline=None)
@given(user=st.sampled_from(USERS), tp=st.sampled_from((1, 2, 4)), pp=st.sampled_from((1, 2)),
       sharding=st.sampled_from(("ddp", "zero", "fsdp", "offload")), sequence_parallel=st.booleans(),
       activation_checkpointing=st.booleans(), microbatches=st.sampled_from((1, 2)), changed=st.booleans())
def test_a_suggested_layouts_options_run_that_layout(user, tp, pp, sharding, sequence_parallel,
                                                     activation_checkpointing, microbatches, changed):
    """The options printed for a layout of the same world, added to the user's command line, describe
    exactly that layout (the micro-batch per rank kept), whether only the changed ones or all are shown."""
    assume(tp * pp <= 4)
    argv = ["--n-layer=4", "--memory=64", *user]
    cfg = parse_args(argv)
    base = planning.layout_of(cfg)
    target = dataclasses.replace(base, tp=tp, pp=pp, dp=4 // (tp * pp), dp_sharding="fsdp" if sharding == "offload"
                                 else sharding, offload_optimizer=sharding == "offload",
                                 sequence_parallel=sequence_parallel, activation_checkpointing=activation_checkpointing,
                                 microbatches=microbatches if pp > 1 else base.microbatches)
    if pp == 1 and base.schedule == "interleaved":  # no loops without a pipeline: 1f1b, as the planner's suggest
        target = dataclasses.replace(target, schedule="1f1b", **({"stages_per_rank": 1}
                                                                 if hasattr(target, "stages_per_rank") else {}))
    if target.schedule == "1f1b":
        assume(target.microbatches >= target.pp)  # fewer are refused, and suggest's reasons say so
    added = planning.options(target, cfg, changed=changed)
    assert planning.layout_of(parse_args([*argv, *" ".join(added).split()])) == target, added
    assert (added == []) == (changed and target == base)


def test_on_the_cpu_what_a_rank_offloads_counts_against_the_same_memory(monkeypatch):
    """--offload-optimizer moves state to host memory: apart from a GPU's, the same memory as a CPU rank's."""
    rank = SimpleNamespace(peak_bytes=3 << 20, host_bytes=2 << 20)  # a rank as the planner counts it
    cfg = parse_args(["--tp=1", "--dp=2", "--offload-optimizer", "--memory=1"])
    assert planning.need_bytes(cfg, rank) == 5 << 20
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert planning.need_bytes(cfg, rank) == 3 << 20

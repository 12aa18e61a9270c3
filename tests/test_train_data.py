"""Training data and what a run reports about it: per-step batches split over dp for bytes and for
nanoGPT's uint16 token files alike, token files read as numpy reads them, a token-data run on the
ranks equal to the byte-level run on the same ids, the validation loss equal to the plain model's in
eval mode without touching training, and the TensorBoard log equal to metrics.jsonl."""

import json
import runpy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorpar
from examples.train import ByteData, TokenData, default_corpus, open_splits
from reference_gpt import RefConfig, RefGPT
from tensorpar import checkpoint
from tensorpar.testing import run_script
from test_train_cli import write_tokens
from test_training import SCRIPT, SMALL, flags, metrics


@settings(max_examples=20)
@given(step=st.integers(0, 10**6), accum=st.integers(1, 3), dp=st.integers(1, 4), rows=st.integers(1, 3),
       block=st.integers(1, 32), tokens=st.booleans())
def test_each_dp_rank_gets_its_own_part_of_the_same_step_batch(step, accum, dp, rows, block, tokens):
    data = ByteData.from_text(default_corpus(5000), seed=7)
    if tokens:  # uint16 ids above any byte
        data = TokenData(data.tokens.to(torch.int32).mul(251).to(torch.uint16), seed=7, vocab_size=2**16)
    size = accum * dp * rows
    (whole, whole_y), = [data.batch(step, 0, batch_size=size, block_size=block)]
    parts = [data.batch(step, m, batch_size=size, block_size=block, accum=accum, dp=dp, dp_rank=r)
             for m in range(accum) for r in range(dp)]
    assert torch.equal(torch.cat([x for x, _ in parts]), whole) and torch.equal(torch.cat([y for _, y in parts]),
                                                                                 whole_y)
    assert torch.equal(whole[:, 1:], whole_y[:, :-1])  # targets are the next tokens
    again, _ = data.batch(step, 0, batch_size=size, block_size=block)  # a function of (seed, step) alone
    assert torch.equal(again, whole) and whole.dtype == torch.int64


@settings(max_examples=10)
@given(ids=st.lists(st.integers(0, 2**16 - 1), min_size=9, max_size=200), step=st.integers(0, 10**6),
       block=st.integers(1, 8), dp=st.integers(1, 3))
def test_token_files_are_read_as_nanogpt_writes_them(tmp_path_factory, ids, step, block, dp):
    """uint16 ids (above 2**15 too) memory-mapped from train.bin batch exactly as numpy's reading of the
    file, made into an int64 tensor, does; an id beyond the vocabulary is refused by name."""
    folder = write_tokens(tmp_path_factory.mktemp("tokens"), ids, ids)
    mapped = TokenData.from_bin(folder / "train.bin", seed=3, vocab_size=2**16)
    read = TokenData(torch.from_numpy(np.fromfile(folder / "train.bin", dtype=np.uint16).astype(np.int64)), seed=3)
    assert len(mapped) == len(ids) and mapped.tokens.tolist() == ids
    for rank in range(dp):
        got = mapped.batch(step, batch_size=2 * dp, block_size=block, dp=dp, dp_rank=rank)
        want = read.batch(step, batch_size=2 * dp, block_size=block, dp=dp, dp_rank=rank)
        assert all(torch.equal(a, b) and a.dtype == torch.int64 for a, b in zip(got, want, strict=True))
    small = TokenData.from_bin(folder / "train.bin", vocab_size=max(ids))  # the largest id is out of range
    with pytest.raises(ValueError, match=f"^train.bin holds token id {max(ids)}, not below the vocabulary size"):
        small.check_ids("train.bin")
    with pytest.raises(ValueError, match=f"^step .*: the data holds token id {max(ids)}, not below the vocabulary"):
        for s in range(200):  # sooner or later a batch holds it (each holds most of the file)
            small.batch(s, batch_size=len(ids), block_size=block)


def train_on_rank(argv):
    """The training script's ``train`` on this rank, as its ``main`` runs it under torchrun; rank 0
    returns its result (losses, validation losses, sample)."""
    script = runpy.run_path(str(SCRIPT), run_name="train_gpt")  # its functions; main() does not run
    cfg = script["parse_args"](argv)
    tensorpar.init(cfg.tp, cfg.dp)
    return script["train"](cfg)


def plain_validation_loss(path, val, options):
    """The validation loss of the checkpoint at ``path`` in the plain model, in eval mode: the mean loss
    over validation batches 0 .. eval_iters - 1, each a whole micro-batch in one process."""
    cfg = RefConfig(vocab_size=256, block_size=options["block_size"], n_layer=options["n_layer"],
                    n_head=options["n_head"], n_embd=options["n_embd"], dropout=options["dropout"], bias=False)
    plain = RefGPT(cfg)
    plain.load_state_dict(checkpoint.export_state_dict(path))
    plain.eval()
    rows = options["batch_size"] // options["grad_accum"]
    total = 0.0
    with torch.no_grad():
        for i in range(options["eval_iters"]):
            x, y = val.batch(i, batch_size=rows, block_size=cfg.block_size)
            total += plain(x, y.contiguous()).item()
    return total / options["eval_iters"]


def test_token_data_trains_as_bytes_do_and_validation_is_the_plain_models(worlds, tmp_path):
    """nanoGPT token files holding the built-in corpus's ids train exactly as the corpus does as bytes
    (at tp=2 dp=2, with dropout); measuring the validation loss every 2 steps leaves training unchanged,
    and each one is the plain model's loss in eval mode over the same held-out batches."""
    options = SMALL | dict(steps=4, dropout=0.1, ckpt_every=2, eval_iters=2, tp=2, dp=2)
    train, val = ByteData.from_text(default_corpus(), seed=1337).split(0.1)  # the byte run's own split
    tokens = write_tokens(tmp_path / "tokens", train.tokens.numpy(), val.tokens.numpy())
    as_bytes = tmp_path / "bytes"
    worlds[4].run(run_script, str(SCRIPT), *flags(options | dict(eval_every=0, out=as_bytes)))
    argv = flags(options | dict(eval_every=2, sample_tokens=5, out=tmp_path / "run", data=tokens, vocab_size=256))
    result = worlds[4].run(train_on_rank, argv)[0]
    expected = metrics(as_bytes)
    assert [r["step"] for r in expected] == list(result["losses"]) == [1, 2, 3, 4]
    for r in expected:  # the same computation on the same ids: bitwise the same
        assert (result["losses"][r["step"]], result["grad_norms"][r["step"]]) == (r["loss"], r["grad_norm"])
    assert sorted(result["val_losses"]) == [2, 4]
    val = open_splits(str(tokens), seed=1337, val_fraction=0.1, vocab_size=256)[1]
    for step, loss in result["val_losses"].items():
        plain = plain_validation_loss(tmp_path / "run" / f"step-{step:06d}", val, options)
        assert abs(loss - plain) <= 1e-5 * plain, f"step {step}: validation loss {loss}, plain model {plain}"
    assert [r.get("val_loss") for r in metrics(tmp_path / "run")] == [None, result["val_losses"][2], None,
                                                                      result["val_losses"][4]]
    sample = json.loads(result["sample"])  # token ids: "[id, id, ...]"
    assert len(sample) == 6 and sample[0] == int(val.tokens[0]) and all(0 <= t < 256 for t in sample)


def test_tensorboard_logs_what_metrics_jsonl_holds(worlds, tmp_path):
    import tensorboard  # noqa: F401  (the tensorboard extra: make test installs it, so a missing one fails)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    options = SMALL | dict(steps=3, grad_accum=1, n_layer=1, eval_every=3, eval_iters=1, logger="tensorboard")
    worlds[1].run(run_script, str(SCRIPT), *flags(options | dict(tp=1, out=tmp_path)))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    logged = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    rows = metrics(tmp_path)
    for key, tag in (("loss", "train/loss"), ("grad_norm", "train/grad_norm"), ("lr", "train/lr"),
                     ("val_loss", "val/loss"), ("peak_memory_mib", "train/peak_memory_mib")):
        want = [(r["step"], r[key]) for r in rows if key in r]
        assert [s for s, _ in logged[tag]] == [s for s, _ in want] and want, tag
        # stored as float32
        assert all(abs(v - w) <= 1e-6 * abs(w) for (_, v), (_, w) in zip(logged[tag], want, strict=True)), tag

"""Per-token training losses and generation with the head-sharded KV cache, against the plain reference
GPT in tests/reference_gpt.py at tp 1-4 (default numerics; the bitwise mode's parity is in
tests/test_logprob_parity.py)."""

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from gpt_cases import batch, gpt_configs, twins
from tensorpar.testing import TOLERANCES, assert_all_close
from tensorpar.testing.strategies import tp_sizes


def per_token_losses(cfg, b, t, seed, temperature, sequence_parallel):
    """``reduction="none"`` of the sharded GPT and ``F.cross_entropy(reduction="none")`` of the reference's
    logits / temperature (targets -1 ignored: 0 in both), float64."""
    ref, model = twins(cfg, torch.float64, seed, sequence_parallel=sequence_parallel)
    idx, targets = batch(cfg, b, t, seed)
    ours = model(idx, targets, reduction="none", temperature=temperature)
    logits = ref(idx) / temperature
    theirs = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1, reduction="none")
    summed = model(idx, targets, reduction="sum", temperature=temperature)
    return ours.detach(), theirs.view(b, t).detach(), summed.detach()


@settings(max_examples=6)
@given(tp=tp_sizes(), data=st.data())
def test_per_token_loss_is_the_references(worlds, tp, data):
    cfg = data.draw(gpt_configs(tp, max_layer=1))
    b, t = data.draw(st.integers(1, 3)), data.draw(st.integers(1, cfg["block_size"]))
    temperature = data.draw(st.sampled_from([1.0, 0.7]))
    sp = data.draw(st.booleans(), label="sequence_parallel")
    for ours, theirs, summed in worlds[tp].run(per_token_losses, cfg, b, t, 0, temperature, sp):
        assert ours.shape == (b, t)
        assert_all_close({"per-token loss": (ours, theirs), "sum": (summed, theirs.sum())},
                         rtol=TOLERANCES[torch.float64])

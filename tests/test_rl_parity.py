"""examples/rl_parity.py: rollouts sampled at one tp and trained at another agree on every log-prob bit in
the bitwise mode (largest |Δ| 0.0, importance ratios exactly 1), and not without it."""

from test_examples import run_example_on_pool


def test_rl_parity_example_has_no_log_prob_gap_in_the_bitwise_mode(worlds, monkeypatch):
    """Sampled at tp 3, trained at tp 2 (rank 2 samples only), three steps: the weights move between them."""
    out = run_example_on_pool(worlds, monkeypatch, "rl_parity.py", "--sample-tp", 3, "--train-tp", 2, "--steps", 3)
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and out.rstrip().endswith("OK"), out
    for line in steps:
        assert "max |Δ log-prob| 0," in line and "importance ratios [1.0, 1.0]" in line, out


def test_rl_parity_example_without_the_mode_shows_a_gap(worlds, monkeypatch):
    out = run_example_on_pool(worlds, monkeypatch, "rl_parity.py", "--sample-tp", 1, "--train-tp", 3, "--steps", 1,
                              "--no-bitwise")
    step = next(line for line in out.splitlines() if line.startswith("step 0"))
    assert "max |Δ log-prob| 0," not in step, out

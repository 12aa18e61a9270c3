"""Shared fixtures: one persistent worker pool per world size, and hypothesis settings."""

import os

import pytest
from hypothesis import HealthCheck, Phase, settings

from gpt_cases import EXAMPLES, WORST
from tensorpar.testing import Worlds

settings.register_profile("tensorpar", deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
LANE_EXAMPLES = 2
# .ci/torch_lanes.sh runs a subset of the tests under other torch releases: a failure there is
# reported as first found (shrinking a compiled multi-rank example can take many minutes), and
# every property test draws at most LANE_EXAMPLES examples (see pytest_collection_modifyitems).
settings.register_profile("torch-lane", settings.get_profile("tensorpar"), max_examples=LANE_EXAMPLES,
                          phases=[Phase.explicit, Phase.reuse, Phase.generate])
PROFILE = os.environ.get("TENSORPAR_HYPOTHESIS_PROFILE", "tensorpar")
settings.load_profile(PROFILE)

WORLDS = Worlds((1, 2, 3, 4))


@pytest.fixture(scope="session")
def worlds():
    """``worlds[n].run(fn, *args)`` runs ``fn`` on every rank of a reused n-process gloo group."""
    yield WORLDS
    WORLDS.close()


def pytest_collection_modifyitems(items):
    """Under the torch-lane profile, cap the examples of tests that set their own ``max_examples``
    (a profile only reaches the settings a test leaves unset)."""
    if PROFILE != "torch-lane":
        return
    for item in items:
        test = getattr(item, "obj", None)
        own = getattr(test, "_hypothesis_internal_use_settings", None)  # where @settings puts them
        if own is not None and own.max_examples > LANE_EXAMPLES:
            test._hypothesis_internal_use_settings = settings(own, max_examples=LANE_EXAMPLES)


def pytest_terminal_summary(terminalreporter):
    runs = {n: WORLDS[n].runs for n in WORLDS}
    if any(runs.values()):
        per = ", ".join(f"world {n}: {r}" for n, r in runs.items())
        terminalreporter.write_line(f"multi-process examples run: {sum(runs.values())} ({per})")
    if EXAMPLES["gpt"]:
        worst = ", ".join(f"{dtype} {err:.2g}" for dtype, err in sorted(WORST.items()))
        terminalreporter.write_line(f"GPT equivalence examples: {EXAMPLES['gpt']}; worst relative error: {worst}")

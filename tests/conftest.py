"""Shared fixtures: one persistent worker pool per world size, and hypothesis settings."""

import pytest
from gpt_cases import EXAMPLES, WORST
from hypothesis import HealthCheck, settings

from tensorpar.testing import Worlds

settings.register_profile("tensorpar", deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("tensorpar")

WORLDS = Worlds((1, 2, 3, 4))


@pytest.fixture(scope="session")
def worlds():
    """``worlds[n].run(fn, *args)`` runs ``fn`` on every rank of a reused n-process gloo group."""
    yield WORLDS
    WORLDS.close()


def pytest_terminal_summary(terminalreporter):
    runs = {n: WORLDS[n].runs for n in WORLDS}
    if any(runs.values()):
        per = ", ".join(f"world {n}: {r}" for n, r in runs.items())
        terminalreporter.write_line(f"multi-process examples run: {sum(runs.values())} ({per})")
    if EXAMPLES["gpt"]:
        worst = ", ".join(f"{dtype} {err:.2g}" for dtype, err in sorted(WORST.items()))
        terminalreporter.write_line(f"GPT equivalence examples: {EXAMPLES['gpt']}; worst relative error: {worst}")

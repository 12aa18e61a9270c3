"""The notebooks' runs for tests/test_notebooks.py, each executed by the notebooks' own runner
(``python notebooks/run.py``) into a temporary copy: the committed notebook and its outputs are
left alone.

The runs start as soon as the tests are collected (``conftest.pytest_collection_finish``), all at
once, and each notebook test waits for its own: the multi-process tests before them leave a core
idle most of the time, and the notebooks use it.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
CELL_TIMEOUT = 600  # seconds per cell; the slowest notebook (03) takes a few minutes on a busy machine


@dataclass
class NotebookRun:
    """A notebook being executed by ``notebooks/run.py`` into ``output``."""

    process: subprocess.Popen
    output: Path
    stderr: Path
    committed: bytes  # the committed notebook's bytes before the run

    def stop(self) -> None:
        """Interrupt the run if it is still going: the runner then kills its kernel's process group
        (the kernel and the ranks it started); kill the runner if it does not end in time."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class NotebookRuns:
    """Every notebook's run, by path, all started at construction, each into a folder of its own."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="tensorpar-notebooks-"))
        self.runs: dict[Path, NotebookRun] = {}
        for path in PATHS:
            out = self.directory / path.stem
            out.mkdir()
            stderr = out / "stderr.txt"
            with open(stderr, "w") as err:  # a file, not a pipe: a run that writes much never blocks on it
                process = subprocess.Popen([sys.executable, str(NOTEBOOKS / "run.py"), str(path), "--output-dir",
                                            str(out), f"--timeout={CELL_TIMEOUT}"], stdout=subprocess.DEVNULL,
                                           stderr=err)
            self.runs[path] = NotebookRun(process, out / path.name, stderr, path.read_bytes())

    def __getitem__(self, path: Path) -> NotebookRun:
        return self.runs[path]

    def close(self) -> None:
        """Stop the runs still going and remove their folders."""
        for run in self.runs.values():
            run.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


STASH_KEY = pytest.StashKey[NotebookRuns]()


def start(session: pytest.Session) -> None:
    """Start every notebook's run if a notebook run is among the selected tests."""
    if any("test_notebooks.py::test_notebook_runs" in item.nodeid for item in session.items):
        session.config.stash[STASH_KEY] = NotebookRuns()


def stop(session: pytest.Session) -> None:
    """Stop the runs still going (the session ended before their tests) and remove their folders."""
    runs = session.config.stash.get(STASH_KEY, None)
    if runs is not None:
        runs.close()

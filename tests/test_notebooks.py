"""Every notebook in notebooks/ is committed with its outputs and runs from top to bottom without
a cell error.

Each one is executed into a temporary copy (the committed notebook and its
outputs are left alone) by the notebooks' own runner, ``python notebooks/run.py``:
a fresh kernel on this interpreter, with notebooks/ as working directory and on
``PYTHONPATH``. The runs are started all at once, when the first is needed, and
each test waits for its own: while one notebook waits on its ranks, the others
use the cores.
"""

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
CELL_TIMEOUT = 600  # seconds per cell; the slowest notebook (03) takes a few minutes on a busy machine


MAX_BYTES = 300_000  # a notebook with its outputs: figures are small inline PNGs, not megabytes of them


def test_notebooks_are_found():
    assert PATHS, f"no notebooks in {NOTEBOOKS}"


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_committed_notebook_has_its_outputs(path):
    """What is committed is an executed notebook people can read without running it: every code
    cell ran, none failed, and figures are inline PNGs that keep the file small."""
    assert path.stat().st_size < MAX_BYTES, f"{path.name}: {path.stat().st_size} bytes"
    nb = nbformat.read(path, as_version=4)
    code_cells = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(cell.execution_count is not None for cell in code_cells), f"{path.name}: a cell was not run"
    outputs = [o for cell in code_cells for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"], f"{path.name}: a cell failed"
    figures = [o for o in outputs if "data" in o and any(k.startswith("image/") for k in o.data)]
    assert all("image/png" in o.data for o in figures), f"{path.name}: a figure is not an inline PNG"


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


def start_runs(directory: Path) -> dict[Path, NotebookRun]:
    """Every notebook's run, by path, all started now, each into a folder of its own in ``directory``,
    which is also the run's temporary directory (what a notebook writes there goes with the test's)."""
    runs = {}
    for path in PATHS:
        out = directory / path.stem
        out.mkdir()
        stderr = out / "stderr.txt"
        with open(stderr, "w") as err:  # a file, not a pipe: a run that writes much never blocks on it
            process = subprocess.Popen([sys.executable, str(NOTEBOOKS / "run.py"), str(path), "--output-dir",
                                        str(out), f"--timeout={CELL_TIMEOUT}"], stdout=subprocess.DEVNULL,
                                       stderr=err, env=os.environ | {"TMPDIR": str(out)})
        runs[path] = NotebookRun(process, out / path.name, stderr, path.read_bytes())
    return runs


@pytest.fixture(scope="module")
def notebook_runs(tmp_path_factory):
    """Every notebook's run, by path, all started at once; stopped at the end if still running."""
    runs = start_runs(tmp_path_factory.mktemp("notebooks"))
    yield runs
    for run in runs.values():
        run.stop()


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs(path, notebook_runs):
    run = notebook_runs[path]
    returncode = run.process.wait(timeout=3 * CELL_TIMEOUT)
    assert returncode == 0, f"{path.name} failed:\n{run.stderr.read_text()[-3000:]}"

    nb = nbformat.read(run.output, as_version=4)
    errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: {errors[0].ename}: {errors[0].evalue}"
    code_cells = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(cell.execution_count is not None for cell in code_cells), f"{path.name}: a cell did not run"
    assert path.read_bytes() == run.committed, f"{path.name} was rewritten by its own run"

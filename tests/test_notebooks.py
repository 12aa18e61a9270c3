"""Every notebook in notebooks/ is committed with its outputs and runs from top to bottom without
a cell error (each run is started when the tests are collected: see notebook_runs.py)."""

import nbformat
import pytest
from notebook_runs import CELL_TIMEOUT, NOTEBOOKS, PATHS, STASH_KEY

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


@pytest.fixture(scope="session")
def notebook_runs(request):
    """Every notebook's run, by path (started by conftest when the tests were collected)."""
    runs = request.config.stash.get(STASH_KEY, None)
    assert runs is not None, "the notebooks' runs were not started at collection"
    return runs


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

"""Every notebook in notebooks/ runs from top to bottom without a cell error.

Each one is executed into a temporary copy (the committed notebook and its
outputs are left alone) by the notebooks' own runner, ``python notebooks/run.py``:
a fresh kernel on this interpreter, with notebooks/ as working directory and on
``PYTHONPATH``.
"""

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
CELL_TIMEOUT = 600  # seconds per cell; the notebooks take well under a minute each


def test_notebooks_are_found():
    assert PATHS, f"no notebooks in {NOTEBOOKS}"


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs(path, tmp_path):
    committed = path.read_bytes()
    copy = tmp_path / path.name
    done = subprocess.run([sys.executable, str(NOTEBOOKS / "run.py"), str(path), "--output-dir", str(tmp_path),
                           f"--timeout={CELL_TIMEOUT}"], capture_output=True, text=True, timeout=3 * CELL_TIMEOUT)
    assert done.returncode == 0, f"{path.name} failed:\n{done.stderr[-3000:]}"

    nb = nbformat.read(copy, as_version=4)
    errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: {errors[0].ename}: {errors[0].evalue}"
    code_cells = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(cell.execution_count is not None for cell in code_cells), f"{path.name}: a cell did not run"
    assert path.read_bytes() == committed, f"{path.name} was rewritten by its own run"

"""Execute notebooks and save them with their outputs.

    python notebooks/run.py notebooks/*.ipynb          # in place
    python notebooks/run.py 01.ipynb --output-dir out  # to a copy

Each notebook runs in a fresh kernel started with this interpreter (so the
kernel sees the same environment as the caller, whatever kernels Jupyter has
registered), with the notebooks directory as its working directory and on
``PYTHONPATH``: worker processes started by ``tensorpar.spawn`` import their
functions from ``notebooks/nb_workers.py`` by name.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent
CELL_TIMEOUT = 600  # seconds per cell


class ThisPythonKernels(KernelSpecManager):
    """Every kernel name resolves to an IPython kernel running ``sys.executable``."""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                          display_name="Python 3 (ipykernel)", language="python", resource_dir=str(NOTEBOOKS),
                          name=kernel_name)


def execute(path: str | os.PathLike, output: str | os.PathLike | None = None, *,
            workdir: str | os.PathLike = NOTEBOOKS, timeout: int = CELL_TIMEOUT) -> nbformat.NotebookNode:
    """Run every cell of the notebook at ``path`` and write it, with outputs, to ``output``
    (default: ``path`` itself). A cell that raises stops the run with
    ``nbclient.exceptions.CellExecutionError`` and nothing is written."""
    nb = nbformat.read(path, as_version=4)
    workdir = str(Path(workdir).resolve())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [workdir, os.environ.get("PYTHONPATH")])))
    km = AsyncKernelManager(kernel_name="python3", kernel_spec_manager=ThisPythonKernels())
    client = NotebookClient(nb, km=km, timeout=timeout, resources={"metadata": {"path": workdir}},
                            record_timing=False,  # no timestamps in cell metadata: re-runs diff cleanly
                            extra_arguments=["--IPKernelApp.log_level=ERROR"])  # no start-up chatter on stderr
    client.execute(env=env)
    nbformat.write(nb, output if output is not None else path)
    return nb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--output-dir", type=Path, help="write executed copies here instead of in place")
    parser.add_argument("--timeout", type=int, default=CELL_TIMEOUT, help="seconds per cell (default %(default)s)")
    args = parser.parse_args()
    for path in args.notebooks:
        output = None
        if args.output_dir is not None:
            args.output_dir.mkdir(parents=True, exist_ok=True)
            output = args.output_dir / path.name
        start = time.perf_counter()
        execute(path, output, timeout=args.timeout)
        print(f"{path}: executed in {time.perf_counter() - start:.1f} s -> {output or path}")


if __name__ == "__main__":
    main()

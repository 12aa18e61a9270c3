"""Every Python block of README.md runs as written.

Each block is a whole file a user could paste. It is written to a temporary
folder and run the way it says it runs:

* a script ending in ``tensorpar.spawn(main, n)`` under ``if __name__ == "__main__"``
  runs ``main()`` on every rank of the n-process pool (what ``spawn`` would do,
  without starting n new processes per block: ``spawn`` itself, from scripts
  too, is tested in ``tests/test_launch.py`` and ``tests/test_examples.py``);
* a block defining ``test_*`` functions is imported as a test module and each
  test is called;
* any other block is run as a script in this process.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tensorpar.testing import World

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.S | re.M)
SPAWNED = re.compile(r'^if __name__ == "__main__":\n\s+tensorpar\.spawn\(main, (\d+)\)', flags=re.M)


def block_id(index: int) -> str:
    first = BLOCKS[index].strip().splitlines()[0] if BLOCKS[index].strip() else "empty"
    return f"{index}:{first[:40]}"


def import_block(directory: Path, name: str) -> ModuleType:
    """The block written as ``directory/name.py``, imported (``directory`` first on ``sys.path``)."""
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))
    importlib.invalidate_caches()
    return importlib.import_module(name)


def run_main(directory: str, name: str) -> None:
    """On a pool rank: import the block and call its ``main()`` in ``directory``, as a spawned rank would."""
    cwd = os.getcwd()
    os.chdir(directory)
    try:
        import_block(Path(directory), name).main()
    finally:
        os.chdir(cwd)


def test_the_readme_has_self_contained_python_blocks():
    assert len(BLOCKS) >= 5, "README.md lost its Python blocks"
    for code in BLOCKS:
        compile(code, "README.md", "exec")
        assert re.search(r"^(import|from) ", code, flags=re.M), f"a block without its imports:\n{code}"


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=block_id)
def test_readme_block_runs_as_written(worlds, index, tmp_path, monkeypatch):
    code, name = BLOCKS[index], f"readme_block_{index}"
    (tmp_path / f"{name}.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    spawned = SPAWNED.search(code)
    if spawned:
        worlds[int(spawned.group(1))].run(run_main, str(tmp_path), name, mesh=False)
        return
    module = import_block(tmp_path, name)
    tests = [f for key, f in vars(module).items() if key.startswith("test_") and callable(f)]
    try:
        for test in tests:
            test()
    finally:
        for value in vars(module).values():
            if isinstance(value, World):
                value.close()
    sys.modules.pop(name, None)


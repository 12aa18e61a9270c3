"""The shape of the code base: imports flow one way without cycles, the core never names the layer
package, no module holds mutable state outside context variables, and the core
does not depend on what it does not need (a user's own ``layers.py`` or a missing ``hypothesis``)."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("tensorpar", "layers")
MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque", "WeakKeyDictionary",
                 "WeakValueDictionary", "WeakSet", "bytearray"}


def library_modules():
    """``{dotted name: path}`` of every module of the library packages."""
    found = {}
    for package in LIBRARY:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(name, path, modules):
    """The library modules that module ``name`` imports (at any depth of its code)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        out |= {t for t in targets if t in modules and t != name}
    return out


def test_imports_have_no_cycles_and_flow_from_layers_to_tensorpar():
    modules = library_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    backwards = sorted((a, b) for a, deps in graph.items() for b in deps
                       if a.split(".")[0] == "tensorpar" and b.split(".")[0] == "layers")
    assert not backwards, f"the core imports the layer package: {backwards}"
    state, stack = {}, []

    def visit(node):  # depth-first search; a grey node met again closes a cycle
        state[node] = "grey"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "grey":
                raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(dep):], dep]))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = "black"

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_layers_choose_their_numerics_once_and_the_mesh_knows_no_numerics():
    """No layer's forward tests the bitwise mode or its segments (each layer chose its computation when it
    was built, through ``layers/numerics.py``), and the mesh imports nothing of the bitwise mode."""
    offenders = []
    for path in sorted((ROOT / "layers").glob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, ast.FunctionDef) and fn.name == "forward":
                offenders += [f"{path.name}:{node.lineno}" for node in ast.walk(fn)
                              if isinstance(node, (ast.If, ast.IfExp))
                              and re.search(r"bitwise|segments", ast.unparse(node.test))]
    assert not offenders, f"a forward branches on the numerics: {offenders}"
    modules = library_modules()
    mesh = imports_of("tensorpar.mesh", modules["tensorpar.mesh"], modules)
    assert not {m for m in mesh if m.startswith("tensorpar.bitwise")}, mesh


def test_the_mesh_stands_on_the_world_alone():
    """``tensorpar.mesh`` reaches (at any depth) only the module that joins the world and compares arguments
    across it: no random streams, numerics or collectives of ours sit beneath the mesh."""
    modules = library_modules()
    reached, todo = set(), ["tensorpar.mesh"]
    while todo:
        for dep in imports_of(todo[-1], modules[todo.pop()], modules) - reached:
            reached.add(dep)
            todo.append(dep)
    assert reached == {"tensorpar.world"}, reached


def test_the_core_and_the_packaging_never_name_the_layer_package():
    word = re.compile(r"\blayers\b")
    offenders = [str(p.relative_to(ROOT)) for p in [*(ROOT / "tensorpar").rglob("*.py"), ROOT / "pyproject.toml"]
                 if word.search(p.read_text())]
    assert not offenders, offenders


def test_no_module_level_mutable_state():
    offenders = []
    for name, path in library_modules().items():
        tree = ast.parse(path.read_text())
        offenders += [f"{name}: global statement" for node in ast.walk(tree) if isinstance(node, ast.Global)]
        for node in tree.body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
                continue  # the export list, read by import machinery only
            called = getattr(value.func, "id", getattr(value.func, "attr", "")) if isinstance(value, ast.Call) else ""
            mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
                called in MUTABLE_CALLS)
            if mutable:
                offenders.append(f"{name}:{node.lineno}")
    assert not offenders, f"module-level mutable values (use a context variable or an immutable type): {offenders}"


def _python(code, cwd, **env):
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")} | env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_layers_and_a_gpt_step_load_neither_dcp_nor_dtensor(tmp_path):
    """``import layers`` and a tp=1 GPT's forward and backward load none of torch's DCP, DTensor or FSDP2
    (the checkpoint store and FSDP2 load when used)."""
    out = _python(f"""
import json, sys, torch, tensorpar
from layers import GPT, GPTConfig
tensorpar.init()
gpt = GPT(GPTConfig(vocab_size=16, block_size=4, n_layer=1, n_head=2, n_embd=8))
idx = torch.randint(0, 16, (1, 5))
gpt(idx[:, :-1], idx[:, 1:]).backward()
print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))
""", tmp_path)
    assert json.loads(out) == [], f"the layers loaded {out}"


def test_a_layers_module_in_the_working_directory_does_not_break_tensorpar(tmp_path):
    """A user's own ``layers.py`` shadows the layer package for that user, and nothing else: the core
    (mesh, collectives, fused linear maps, checkpoints of a plain module) works beside it."""
    (tmp_path / "layers.py").write_text("raise ImportError('this is the user\\'s own layers.py')\n")
    out = _python("""
import torch, tensorpar
mesh = tensorpar.init()
w = torch.nn.Linear(4, 3)
y = tensorpar.column_parallel_linear(torch.ones(2, 4), w.weight, w.bias)
tensorpar.checkpoint.save("ckpt", w, step=1)
print(tuple(y.shape), tensorpar.reduce_from_tp(torch.ones(2)).tolist(), tensorpar.checkpoint.read_meta("ckpt")["step"])
""", tmp_path)
    assert out.split() == ["(2,", "3)", "[1.0,", "1.0]", "1"]


#: what ``import tensorpar`` leaves for first use: attribute -> the module it loads
ON_FIRST_USE = {"checkpoint": "tensorpar.checkpoint", "spawn": "tensorpar.launch", "RankError": "tensorpar.launch",
                "fully_shard_dp": "tensorpar.fsdp", "pipeline": "tensorpar.pipeline", "testing": "tensorpar.testing"}
HEAVY = ("torch.distributed.checkpoint", "torch.distributed.tensor", "torch.distributed.fsdp")


def test_the_core_loads_light_and_its_test_kit_imports_without_hypothesis(tmp_path):
    """``import tensorpar`` loads the mesh, sharding and collectives, not the checkpoint store, the
    launcher, FSDP2, pipelines, the test kit, nor torch's DCP and DTensor; each loads on
    first use and is the module's own object. The pool and comparisons of ``tensorpar.testing`` need
    neither ``hypothesis`` nor the layer package; the strategies say what they need."""
    (tmp_path / "hypothesis.py").write_text("raise ImportError('no hypothesis here')\n")
    out = _python(f"""
import importlib, json, sys
import tensorpar
first_use = {ON_FIRST_USE!r}
print(json.dumps(sorted(m for m in {{*first_use.values(), *{HEAVY!r}}} if m in sys.modules)))
modules = {{name: importlib.import_module(module) for name, module in first_use.items()}}
same = [name for name, module in modules.items()
        if getattr(tensorpar, name) in (module, getattr(module, name, None))]
print(json.dumps([sorted(same), sorted(set(first_use) - set(dir(tensorpar)))]))
import tensorpar.testing
from tensorpar.testing import World, Worlds, assert_sharded_equivalent, run_script
print("layers" in sys.modules, "hypothesis" in sys.modules)
try:
    import tensorpar.testing.strategies
except ImportError as e:
    print(e)
""", tmp_path)
    loaded, found, first, error = out.splitlines()
    assert json.loads(loaded) == [], f"import tensorpar loaded {loaded}"
    assert json.loads(found) == [sorted(ON_FIRST_USE), []]  # each the module's own, each in dir()
    assert first == "False False" and "no hypothesis here" in error and "pip install 'tensorpar[test]'" in error

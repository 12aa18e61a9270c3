"""A plain ``pip install .`` (torch, einops and numpy) runs every README example that needs no extra,
and each extra, when missing, is named by the error that its absence causes.

The examples run in a subprocess in which hypothesis, safetensors, tqdm, matplotlib and
transformers cannot be found (numpy is a dependency: torch.distributed.checkpoint needs it): a
``sitecustomize`` on ``PYTHONPATH`` replaces ``sys.meta_path``'s
path finder by one blind to them, so the ranks that ``tensorpar.spawn`` starts are blind too. On
2 ranks they run the layers (a ColumnParallelLinear backward and a RowParallelLinear forward,
one all-reduce each), ``layers.parallelize``, a GPT (loss, gradients, clipping,
full state dict, generation; the export to GPT-2 files names its extra) and a short ``examples/train_gpt.py`` run (on
the same ranks, as torchrun runs it); the launching process then asks for each extra. This file
is also that subprocess's program: ``python tests/test_plain_install.py DIR``.

A wheel built from the source tree ships the LICENSE, each package's ``py.typed`` marker and the
version that ``tensorpar.__version__`` reads from the installed metadata.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.metadata
import importlib.util
import io
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import tensorpar
from layers import GPT, Block, ColumnParallelLinear, GPTConfig, RowParallelLinear, parallelize
from layers.hf import export_gpt2
from tensorpar.testing import TOLERANCES, assert_sharded_equivalent, rel_error, run_script

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL_PACKAGES = ("hypothesis", "matplotlib", "safetensors", "tqdm", "transformers")
SITECUSTOMIZE = f'''
import importlib.machinery
import sys


class WithoutExtras:
    """The path finder, blind to the optional packages: it finds no spec for them, exactly as where
    they are not installed (``importlib.util.find_spec`` gives None, which torch relies on)."""

    blocked = {OPTIONAL_PACKAGES!r}

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in cls.blocked:
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)

    @classmethod
    def find_distributions(cls, *args, **kwargs):  # the installed metadata, less the optional packages'
        return (d for d in importlib.machinery.PathFinder.find_distributions(*args, **kwargs)
                if d.metadata["Name"].lower() not in cls.blocked)

    @classmethod
    def invalidate_caches(cls):
        importlib.machinery.PathFinder.invalidate_caches()


sys.meta_path[:] = [WithoutExtras if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
'''
TIMEOUT = 240  # seconds per subprocess; each normally takes well under 30


def without_extras(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run ``python *args`` from the repository root with the optional packages made unimportable."""
    site = tmp_path / "no_extras"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT, check=False)


# ---------------------------------------------------------------- on each of 2 ranks (no extras)

class DenseMLP(nn.Module):
    """A user's dense model: residual MLP blocks of ``nn.Linear``. ``(*, d) -> (*, d)``."""

    def __init__(self, d: int, hidden: int, n_layer: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"fc1": nn.Linear(d, hidden), "fc2": nn.Linear(hidden, d)})
                                    for _ in range(n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block["fc2"](F.gelu(block["fc1"](x)))
        return x


class AllReduces(TorchDispatchMode):
    """Counts the all-reduces dispatched inside it (torch's ``CommDebugMode`` needs numpy, an extra)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += func._overloadpacket in (torch.ops._c10d_functional.all_reduce, torch.ops.c10d.allreduce_)
        return func(*args, **(kwargs or {}))


def readme_examples(directory: str) -> dict[str, object]:
    """The README's examples that need no extra, each measured against torch's own result."""
    tensorpar.init(tp=2)
    errors, routes = {}, {}
    torch.manual_seed(0)  # the same dense model and inputs on every rank
    d, hidden = 6, 9  # 9 hidden features: 5 + 4
    dense = DenseMLP(d, hidden, 2)
    x = torch.randn(3, d)

    model = copy.deepcopy(dense)  # 1. swap nn.Linear by plan, keeping the weights
    parallelize(model, {"blocks.*.fc1": "column", "blocks.*.fc2": "row"})
    errors["parallelize"] = rel_error(model(x), dense(x))

    fc1, fc2 = dense.blocks[0]["fc1"], dense.blocks[0]["fc2"]  # ... or one layer at a time
    column = ColumnParallelLinear.from_linear(fc1)
    errors.update(assert_sharded_equivalent(column, fc1, x, output_shard=tensorpar.Shard(-1, hidden)))
    xs = x.clone().requires_grad_()
    with AllReduces() as counts:
        column(xs).sum().backward()  # f's backward: one all-reduce of the input gradient
    routes["column backward"] = counts.count
    xd = x.clone().requires_grad_()
    fc1(xd).sum().backward()
    errors["column input grad"] = rel_error(xs.grad, xd.grad)
    row = RowParallelLinear.from_linear(fc2, input_is_parallel=False)
    h = torch.randn(3, hidden)
    with AllReduces() as counts:
        y = row(h)  # g: one all-reduce of the output
    routes["row forward"] = counts.count
    errors["row forward"] = rel_error(y, fc2(h))

    block = Block(GPTConfig(n_embd=12, n_head=3))  # 2. a sharded transformer block ...
    errors["block finite"] = float(not torch.isfinite(block(torch.randn(2, 5, 12))).all())

    tensorpar.manual_seed(1337)  # ... or a whole GPT
    config = GPTConfig(vocab_size=37, n_layer=2, n_head=3, n_embd=12, block_size=8)
    gpt = GPT(config)
    idx = torch.randint(0, 37, (2, 8))
    targets = torch.roll(idx, -1, 1)
    logits = gpt(idx)  # (B, T, 37), the same on every rank
    loss = gpt(idx, targets)  # vocab-parallel cross-entropy
    errors["loss"] = rel_error(loss, F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    loss.backward()
    grads = tensorpar.full_grads(gpt)
    norm = tensorpar.clip_grad_norm_(gpt, 1.0)  # 4. the norm of the whole unsharded gradient
    errors["grad norm"] = rel_error(norm, torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads.values()])))
    twin = GPT(config)
    twin.load_full_state_dict(gpt.full_state_dict())
    errors["full state dict"] = rel_error(twin(idx), gpt(idx))
    out = gpt.generate(idx[:, :2], max_new_tokens=4, temperature=0.8, top_k=10)
    try:
        export_gpt2(gpt, directory)
        exported = "written"
    except ImportError as e:  # model.safetensors is written by the safetensors package
        exported = str(e)
    found = [name for name in OPTIONAL_PACKAGES if importlib.util.find_spec(name) is not None
             or any(d.metadata["Name"].lower() == name for d in importlib.metadata.distributions())]
    return {"errors": errors, "routes": routes, "tokens": out.tolist(), "found": found,
            "exported": exported, "version": tensorpar.__version__}


TRAIN_SMALL = ["--steps", "2", "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "8",
               "--batch-size", "2", "--sample-tokens", "4"]


def readme_examples_then_training(directory: str) -> dict[str, object]:
    """On each of 2 ranks: the README's examples, then a short ``examples/train_gpt.py`` run with its
    checkpoints (they need no extra), on these ranks as torchrun would run it."""
    results = readme_examples(directory)
    run_script(ROOT / "examples" / "train_gpt.py", *TRAIN_SMALL, "--out", directory + "-run")
    return results


def missing_extras(directory: str) -> dict[str, str]:
    """What each feature with an extra says without it (or that it works), by feature."""
    said = {}
    try:
        importlib.import_module("tensorpar.testing.strategies")
    except ImportError as e:
        said["strategies"] = str(e)
    tensorpar.init()
    try:  # a checkpoint either works without the extras or says which one it needs
        tensorpar.checkpoint.save(directory, torch.nn.Linear(3, 2), step=1)
        tensorpar.checkpoint.load(directory, torch.nn.Linear(3, 2))
        said["checkpoint"] = "works"
    except ImportError as e:
        said["checkpoint"] = str(e)
    tensorpar.shutdown()
    for script, args in (("hf_gpt2_generate.py", ["--model-dir", directory]),):  # exits before any rank starts
        saved = sys.argv[:]
        sys.argv[:] = [script, *args]
        with contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                runpy.run_path(str(ROOT / "examples" / script), run_name="__main__")
                said[script] = "ran"
            except SystemExit as e:
                said[script] = e.code if isinstance(e.code, str) else f"exit {e.code}, {err.getvalue().strip()}"
            finally:
                sys.argv[:] = saved
    return said


def main(directory: str) -> None:
    """The ranks' results and what each missing extra says, as the last line of stdout (the
    training run prints before it)."""
    ranks = tensorpar.spawn(readme_examples_then_training, 2, directory + "-gpt2")
    print(json.dumps({"ranks": ranks, "missing": missing_extras(directory + "-ckpt")}))


# ---------------------------------------------------------------- the tests (pytest process)

def test_readme_examples_run_and_each_missing_extra_is_named_without_any_extra(tmp_path):
    done = without_extras([__file__, str(tmp_path / "out")], tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    *train, last = done.stdout.splitlines()
    results = json.loads(last)

    ranks = results["ranks"]  # the README's examples and a training run
    assert ranks[0]["tokens"] == ranks[1]["tokens"]
    for rank in ranks:
        assert all(err <= TOLERANCES[torch.float32] for err in rank["errors"].values()), rank["errors"]
        assert rank["routes"] == {"column backward": 1, "row forward": 1}
        assert rank["found"] == [] and rank["exported"] == ("export_gpt2 writes model.safetensors with the "
                                                            "safetensors package: pip install 'tensorpar[hf]'")
        assert rank["version"] == importlib.metadata.version("tensorpar")
    assert "tqdm is not installed (pip install 'tensorpar[train]'): no progress bar" in train
    assert any(line.startswith("loss ") and "over steps 1-2" in line for line in train), train
    assert (tmp_path / "out-gpt2-run" / "latest").exists()  # checkpoints need no extra

    said = results["missing"]  # each extra, named where it is missing
    assert "pip install 'tensorpar[test]'" in said["strategies"] and "hypothesis" in said["strategies"]
    assert said["checkpoint"] == "works"  # checkpoints need no extra
    assert said["hf_gpt2_generate.py"] == ("exit 2, hf_gpt2_generate.py: error: this example reads the model "
                                           "with transformers: pip install 'tensorpar[hf]'")


def test_the_wheel_ships_the_license_the_type_markers_and_the_installed_version(tmp_path, monkeypatch):
    source = tmp_path / "source"  # a copy: building writes build/ and *.egg-info beside the sources
    for folder in (p.parent for p in ROOT.glob("*/__init__.py")):  # every package the build could find
        shutil.copytree(folder, source / folder.name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    build = "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", build, str(tmp_path)], cwd=source, capture_output=True,
                          text=True, timeout=TIMEOUT, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    with zipfile.ZipFile(tmp_path / done.stdout.splitlines()[-1]) as wheel:
        names = set(wheel.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA")).rpartition("/")[0]
        metadata = wheel.read(f"{info}/METADATA").decode()
        shipped_license = wheel.read(f"{info}/licenses/LICENSE").decode()
    assert {"tensorpar/py.typed", "layers/py.typed", "tensorpar/__init__.py", "layers/__init__.py"} <= names
    assert {n.partition("/")[0] for n in names} == {"tensorpar", "layers", info}  # nothing else is shipped
    assert shipped_license == (ROOT / "LICENSE").read_text() and "Apache License\n" in shipped_license
    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)[1]
    fields = [line.partition(": ") for line in metadata.splitlines()]
    assert ("Version", ": ", version) in fields and ("License-Expression", ": ", "Apache-2.0") in fields
    assert ("Classifier", ": ", "Typing :: Typed") in fields
    assert tensorpar.__version__ == importlib.metadata.version("tensorpar") == version  # as installed here

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert tensorpar._installed_version() == "0+unknown"  # a source tree that was never installed


if __name__ == "__main__":
    main(sys.argv[1])

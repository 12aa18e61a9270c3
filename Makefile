# `make test` and `make demo` work from a clean clone: they create (or reuse) a
# virtualenv in .venv, install what they need, and run. Each target has its own
# stamp: the demo installs only what it uses (torch, the progress bar, the plot);
# the tests install every extra, also after a `make demo`. torch comes through pip (which
# takes a CPU build where one is at hand); everything else through uv, which fetches and
# installs the extras' hundred-odd packages in parallel (seconds, where pip takes a minute),
# compiled to bytecode as pip would: where PYTHONDONTWRITEBYTECODE is set, a package installed
# without its .pyc files is compiled again by every process that imports it.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
UV_BIN := $(VENV)/bin/uv
UV     := $(UV_BIN) pip install --compile-bytecode --python $(PY)
TORCH  := $(VENV)/.torch
DEMO   := $(VENV)/.installed-demo
TEST   := $(VENV)/.installed-test
LINT   := $(VENV)/.installed-lint

.PHONY: test test-torch lint demo bench gpu-check clean

$(TORCH):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# A CPU-only machine gets the CPU build explicitly so no CUDA wheels are pulled.
	$(PY) -c "import torch" 2>/dev/null || { \
	  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; \
	  then $(PY) -m pip install "torch>=2.11,<2.15"; \
	  else $(PY) -m pip install torch==2.13.0; fi; }
	touch $@

# its own target, so that a virtualenv made before the extras came through uv gets it too
$(UV_BIN): $(TORCH)
	$(PY) -m pip install uv==0.13.9
	touch $@

$(DEMO): $(UV_BIN) pyproject.toml Makefile
	$(UV) -e ".[train,plot]"
	touch $@

$(TEST): $(UV_BIN) pyproject.toml Makefile
	$(UV) -e ".[test,hf,train,plot,tensorboard]"
	touch $@

$(LINT): $(TEST)
	$(UV) -e ".[lint]"
	touch $@

# The test run starts a few hundred Python processes: the project's own modules are compiled once,
# up front (Python reads .pyc files even where PYTHONDONTWRITEBYTECODE stops it writing them).
test: $(TEST)
	$(PY) -m compileall -q tensorpar layers tests examples benchmarks notebooks
	$(PY) -m pytest -q

# ruff and mypy, configured in pyproject.toml (the paths they check, the rules, the pinned versions).
# mypy checks the core, tensorpar/ (it sees the test extras too: hypothesis, numpy and safetensors carry
# their own types). The layer package is not type-checked yet: `mypy tensorpar layers` finds about 110
# errors there, half of them where torch's stubs type a submodule reached by name (a ModuleDict's item,
# an attribute) as Tensor | Module.
lint: $(LINT)
	$(PY) -m ruff check
	$(PY) -m mypy

demo: $(DEMO)
	$(PY) examples/train_gpt.py --overwrite

bench: $(TEST)
	$(UV) -e ".[bench]"
	$(UV) --no-deps megatron-core==0.16.1
	PYTHONPATH=. $(PY) benchmarks/run.py

# On a machine with a GPU and torch already installed (no virtualenv, nothing installed): the GPU
# tests, the GPU benchmarks and a GPT-2 124M training run resumed from a checkpoint, in one table.
OUT ?= out/gpu-check
gpu-check:
	PYTHONPATH=. $(PYTHON) benchmarks/gpu_check.py --out $(OUT)

clean:
	rm -rf $(VENV) *.egg-info .hypothesis

# The torch-sensitive tests under the other torch releases pyproject.toml declares, each in its
# own virtualenv cached outside the clone (see .ci/torch_lanes.sh).
test-torch:
	.ci/torch_lanes.sh

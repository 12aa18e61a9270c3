#!/usr/bin/env bash
# The torch-sensitive tests under every other torch release the package declares (the main venv
# holds the newest CPU build; see pyproject.toml's torch range).
#
# Each release gets its own virtualenv in a cache outside the clone, created once and reused:
#     ${TENSORPAR_TORCH_CACHE:-$HOME/.cache/tensorpar-torch}/venv-<version>
# It holds only the dependencies (the pinned torch, and what the test and hf extras name); the
# code under test is this checkout, put first on PYTHONPATH, so a venv never points at a clone.
#
#     .ci/torch_lanes.sh                 # every release in TENSORPAR_TORCH_VERSIONS
#     TENSORPAR_TORCH_VERSIONS=2.11.0 .ci/torch_lanes.sh -k compile    # pytest options pass through
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
cache=${TENSORPAR_TORCH_CACHE:-$HOME/.cache/tensorpar-torch}
versions=${TENSORPAR_TORCH_VERSIONS:-2.11.0 2.14.1}
python=${PYTHON:-python3}

# What changes between torch releases: torch.compile, FSDP2, distributed checkpoints, pipelining,
# the collectives and torch's views of them (CommDebugMode, the profiler), activation checkpointing,
# transformers on top of torch, and the kernels whose bits the bitwise mode relies on.
tests=(
  tests/test_compile.py tests/test_comm.py tests/test_observability.py
  tests/test_fsdp.py tests/test_dcp.py tests/test_checkpoint_files.py tests/test_offload_gpt.py
  tests/test_pipeline.py tests/test_activation_checkpointing.py
  tests/test_hf.py tests/test_hf_parallel.py tests/test_hf_parallel_api.py tests/test_hf_export.py
  tests/test_bitwise.py
)

# The dependencies of this checkout's extras, recorded by a stamp named after pyproject.toml's hash:
# an edit to the dependencies installs again, anything else reuses the venv as it is.
deps_hash=$(sha256sum pyproject.toml | cut -c1-16)

ensure_venv() {  # $1: torch version; creates or completes its venv, serialised by a lock per venv
  local version=$1 venv=$cache/venv-$1
  mkdir -p "$cache"
  (
    flock 9
    [ -e "$venv/.deps-$deps_hash" ] && exit 0
    [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
    # The project is installed to resolve its extras against the pinned torch (pip refuses a pin
    # outside the declared range), then removed: only its dependencies stay.
    "$venv/bin/python" -m pip install -q "torch==$version" "$root[test,hf]"
    "$venv/bin/python" -m pip uninstall -q -y tensorpar
    rm -f "$venv"/.deps-*
    touch "$venv/.deps-$deps_hash"
  ) 9>"$venv.lock"
}

failed=()
for version in $versions; do
  ensure_venv "$version"
  start=$SECONDS
  echo "== torch $version: ${tests[*]}"
  status=0
  # The lane's hypothesis profile draws fewer examples per test (see tests/conftest.py).
  PYTHONPATH="$root" TENSORPAR_HYPOTHESIS_PROFILE=torch-lane \
    "$cache/venv-$version/bin/python" -m pytest -q "${tests[@]}" "$@" || status=$?
  echo "== torch $version: exit $status in $((SECONDS - start)) s"
  [ "$status" = 0 ] || failed+=("$version")
done
if [ "${#failed[@]}" -gt 0 ]; then
  echo "torch lanes failed: ${failed[*]}"
  exit 1
fi

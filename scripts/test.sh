#!/usr/bin/env bash
# Installs what is missing, builds everything with -Werror, and runs the whole test suite.
# CONCERTO_SANITIZE=1 builds and runs it under ASan + UBSan instead (build-asan/).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
jobs=$(nproc)
if [ "${CONCERTO_SANITIZE:-0}" = 1 ]; then
  dir=build-asan; extra=(-DCONCERTO_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug)
else
  dir=build; extra=(-DCMAKE_BUILD_TYPE=Release)
fi
cmake -S . -B "$dir" "${extra[@]}"
cmake --build "$dir" -j "$jobs"
# The interop tests (tests/interop) read and write files with Python's safetensors, from PyPI.
if ! "$dir/pyenv/bin/python" -c "import safetensors, numpy, ml_dtypes" 2>/dev/null; then
  python3 -m venv "$dir/pyenv"
  "$dir/pyenv/bin/pip" install -q --disable-pip-version-check safetensors numpy ml_dtypes
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ctest --test-dir "$dir" --output-on-failure -j "$jobs" --timeout 900

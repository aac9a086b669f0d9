#!/usr/bin/env bash
# Installs what is missing, builds concerto, and runs the main example: every scheduling policy
# on the benchmark workloads, simulated on the GPU cluster presets.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DCONCERTO_BUILD_TESTS=OFF
cmake --build build -j "$(nproc)" --target schedule_quality concerto-plan
./build/bench/schedule_quality/schedule_quality --layers 4 --time-budget 10 "$@"

#!/usr/bin/env bash
# Installs what is missing, builds concerto's examples, and trains them with mpirun on 4 CPU ranks:
# the DSL's MLP (data x tensor parallel) and a small character-level GPT on the GPL-3 text.
# Arguments go to the GPT example (e.g. --tp 2 --sp --policy sync; see examples/gpt/main.cpp).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DCONCERTO_BUILD_TESTS=OFF -DCONCERTO_BUILD_BENCH=OFF
cmake --build build -j "$(nproc)" --target example_mlp example_gpt
NP=4 examples/mlp/run.sh
NP=4 examples/gpt/run.sh --steps 1500 --hidden 128 "$@"

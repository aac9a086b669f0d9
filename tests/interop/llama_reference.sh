#!/usr/bin/env bash
# The exported Llama in PyTorch: the example trains on token shards (2 ranks, tp 2), prints its
# validation loss (step.evaluate, the forward-only plan) and exports its parameters; the 30-line
# PyTorch model of examples/llama/reference.py loads them and must compute the same validation
# loss within 1e-5 (the issue asks 1e-4; a wrong RMSNorm eps moves it by 2e-5).
#
#   tests/interop/llama_reference.sh PYTHON example_llama example_shards reference.py WORKDIR
#
# PYTHON needs torch, safetensors and numpy (pip install torch safetensors numpy); exit 77
# (skipped) when it lacks them or mpirun is missing.
set -euo pipefail
python=$1 llama=$2 shards=$3 reference=$4 work=$5
command -v mpirun >/dev/null || { echo "no mpirun: skipped"; exit 77; }
"$python" -c "import torch, safetensors, numpy" 2>/dev/null || { echo "$python lacks torch, safetensors or numpy: skipped"; exit 77; }
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 CONCERTO_CACHE_DIR="$work/plan-cache"
rm -rf "$work/shards" "$work/metrics.jsonl"
mkdir -p "$work"
"$shards" --text /usr/share/common-licenses/GPL-3 --out "$work/shards" --val-fraction 0.1
mpirun -np 2 --oversubscribe --bind-to none "$llama" --tp 2 --data "$work/shards" --steps 40 --hidden 64 --heads 4 \
  --kv-heads 2 --seq 32 --batch 8 --val-every 40 --val-batches 4 --metrics "$work/metrics.jsonl" \
  --export "$work/model.safetensors" --policy program_order
want=$("$python" -c "import json,sys; print([json.loads(l) for l in open(sys.argv[1])][-1]['val_loss'])" "$work/metrics.jsonl")
got=$("$python" "$reference" --model "$work/model.safetensors" --data "$work/shards" --seq 32 --batch 8 --batches 4 \
  --heads 4 --kv-heads 2 | awk '{print $3}')
"$python" - "$want" "$got" <<'PY'
import sys
want, got = map(float, sys.argv[1:])
print(f"concerto val loss {want:.8f}, PyTorch {got:.8f}, difference {abs(want - got):.2e}")
sys.exit(0 if abs(want - got) <= 1e-5 else 1)
PY

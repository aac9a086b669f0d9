#!/usr/bin/env bash
# Kill and resume: the Llama example on token shards written from at least 1 MB of the machine's
# licence texts, 4 ranks (dp 2 x tp 2), clipping, a cosine schedule and validation. One run goes
# uninterrupted; a second is killed (its ranks, SIGKILL) after a checkpoint, then resumed from it;
# every training and validation loss after the checkpoint must equal the uninterrupted run's
# within 1e-6, and the training and validation losses must fall.
#
#   examples/llama/resume_check.sh build/examples/llama/example_llama build/examples/shards/example_shards [WORKDIR]
#
# Exit 0 when it holds, 1 when not, 77 (skipped) without mpirun or 1 MB of text.
set -euo pipefail
llama=${1:?the example_llama binary}
shards=${2:?the example_shards binary}
work=${3:-$(mktemp -d)}
command -v mpirun >/dev/null || { echo "no mpirun: skipped"; exit 77; }
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 CONCERTO_CACHE_DIR="$work/plan-cache"
mkdir -p "$work"
rm -rf "$work/shards" "$work"/*.jsonl "$work"/*.ckpt

# At least 1 MB of text that every Debian machine has: the licences, then the packages' copyright files.
text="$work/text.txt"
cat /usr/share/common-licenses/* /usr/share/doc/*/copyright 2>/dev/null | head -c 1500000 >"$text" || true
size=$(stat -c %s "$text")
[ "$size" -ge 1000000 ] || { echo "only $size bytes of text on this machine: skipped"; exit 77; }
"$shards" --text "$text" --out "$work/shards" --val-fraction 0.05

steps=60
# 4 ranks (dp 2 x tp 2) writing METRICS, with the run's other flags after it.
command_for() {
  local metrics=$1
  shift
  cmd=(mpirun -np 4 --oversubscribe --bind-to none "$llama" --tp 2 --data "$work/shards" --steps $steps --hidden 64 --seq 64
       --batch 16 --lr 3e-3 --lr-schedule cosine --warmup 4 --clip 1.0 --val-every 10 --val-batches 4 --log-every 10
       --policy program_order --metrics "$metrics" "$@")
}
lines() { if [ -f "$1" ]; then wc -l <"$1"; else echo 0; fi; }

command_for "$work/whole.jsonl"
"${cmd[@]}"

# Killed after its first checkpoints, mid-run.
command_for "$work/killed.jsonl" --save "$work/run.ckpt" --save-every 10
"${cmd[@]}" &
job=$!
while kill -0 $job 2>/dev/null && [ "$(lines "$work/killed.jsonl")" -lt 20 ]; do sleep 0.02; done
# The ranks (mpirun's children) die at once, as on a lost node; mpirun then ends. /proc, not
# pkill: a minimal Debian has no procps.
ranks=$(cat /proc/$job/task/*/children 2>/dev/null || true)
[ -z "$ranks" ] || kill -KILL $ranks 2>/dev/null || true
wait $job 2>/dev/null || true
[ -f "$work/run.ckpt" ] || { echo "no checkpoint was written before the kill"; exit 1; }
echo "killed after $(lines "$work/killed.jsonl") steps"

command_for "$work/resumed.jsonl" --resume "$work/run.ckpt" --save "$work/run.ckpt"
"${cmd[@]}"

python3 - "$work" <<'EOF'
import json, sys
work = sys.argv[1]
def records(name):
    with open(f"{work}/{name}") as f:
        return {r["step"]: r for r in map(json.loads, f)}
whole, resumed = records("whole.jsonl"), records("resumed.jsonl")
if not resumed:
    sys.exit("the second run ended before it was killed: nothing was resumed")
first = min(resumed)
assert first > 1 and (first - 1) % 10 == 0, f"the resumed run began at step {first}, not after a checkpoint (every 10 steps)"
worst = 0.0
for step, r in resumed.items():
    w = whole[step]
    for key in ("loss", "val_loss"):
        if key in r or key in w:
            worst = max(worst, abs(r[key] - w[key]))
print(f"resumed at step {first}: {len(resumed)} steps compared, largest difference {worst:.3g}")
losses = [whole[s]["loss"] for s in sorted(whole)]
vals = [whole[s]["val_loss"] for s in sorted(whole) if "val_loss" in whole[s]]
print(f"training loss {losses[0]:.4f} -> {losses[-1]:.4f}; validation loss {' -> '.join(f'{v:.4f}' for v in vals)}")
ok = worst <= 1e-6 and losses[-1] < losses[0] and vals[-1] < vals[0]
sys.exit(0 if ok else 1)
EOF

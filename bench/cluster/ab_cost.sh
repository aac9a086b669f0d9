#!/usr/bin/env bash
# What one example flag's two settings cost a step on the emulated cluster (as root): global-norm
# clipping (--flag clip --a 0 --b 1.0, the default), bf16 (--flag precision --a fp32 --b bf16):
#
#   sudo bench/cluster/ab_cost.sh [--flag clip --a 0 --b 1.0] [--out DIR] [--build DIR] [--hosts 4]
#                                 [--rate 1gbit] [--tp 2] [--reps 3] [--steps 30] [--models "llama gpt"]
#                                 [--policy sync,concerto] [--extra "--zero 1"]
#
# Sets the cluster up (netns-cluster.sh, one rank per host), runs the probe for this
# configuration's cpu-netns calibration, then for each model runs the example with --FLAG A and
# --FLAG B alternately (order A B, B A, A B, ...: noise of the shared machine hits both),
# everything else the same: the policies in turn on the same ranks, the plan fixed
# (CONCERTO_CHOOSE_PLAN=0: no choosing by measuring, which would mix trial plans into the steps),
# one plan cache for the run, each configuration planned once first in a short priming run that
# is not counted. --extra: flags both settings run with (bf16 against fp32 under ZeRO-1:
# --extra "--zero 1", the Llama only). Prints per model, policy and setting the median over runs of each run's median
# step, the prediction, the lower bound, the plan's tasks and collectives and the bytes those move.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
build="$root/build"
out=""
hosts=4 rate=1gbit tp=2 reps=3 steps=30 models="llama gpt" policy=sync,concerto flag=clip a=0 b=1.0 extra=""
while [[ $# -gt 0 ]]; do
  case $1 in
  --out) out=$2; shift 2 ;;
  --build) build=$2; shift 2 ;;
  --hosts) hosts=$2; shift 2 ;;
  --rate) rate=$2; shift 2 ;;
  --tp) tp=$2; shift 2 ;;
  --reps) reps=$2; shift 2 ;;
  --steps) steps=$2; shift 2 ;;
  --models) models=$2; shift 2 ;;
  --policy) policy=$2; shift 2 ;;
  --flag) flag=$2; shift 2 ;;
  --a) a=$2; shift 2 ;;
  --b) b=$2; shift 2 ;;
  --extra) extra=$2; shift 2 ;;
  -h | --help) sed -n 2,17p "$0"; exit 0 ;;
  *) echo "ab_cost.sh: unknown option '$1' (try --help)" >&2; exit 2 ;;
  esac
done
[[ $(id -u) -eq 0 ]] || { echo "ab_cost.sh: must run as root (network namespaces, veth, tc)" >&2; exit 1; }
out=${out:-"$build/cluster-results/$flag-$(date +%Y%m%d-%H%M%S)"}
mkdir -p "$out"
# The binaries as they are now: a rebuild during the run must not change them under it.
mkdir -p "$out/bin"
for m in $models; do cp "$build/examples/$m/example_$m" "$out/bin/"; done
cp "$build/bench/cluster/probe/cluster-probe" "$out/bin/"
sha256sum "$out"/bin/* >"$out/bin.sha256"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git -C "$root" rev-parse HEAD) (plus the uncommitted working tree)"
  echo "hosts $hosts, rate $rate, tp $tp, reps $reps, steps $steps, models $models, policy $policy, --$flag $a vs $b, extra: $extra"
} >"$out/meta.txt"

export out hosts rate tp reps steps models policy flag a b extra
start=$(date +%s)
"$here/netns-cluster.sh" --hosts "$hosts" --rate "$rate" -- bash -c '
  set -euo pipefail
  cfg="${hosts}x${rate}"
  "$CLUSTER_MPIRUN" -np "$hosts" "$out/bin/cluster-probe" --label "$cfg" --max-bytes 4.2e6 --budget-ms 100 --overlap-reps 3 \
    --calibration "$out/cpu-netns-$cfg.json" --report "$out/probe-$cfg.json" >"$out/probe-$cfg.txt"
  export CONCERTO_COST_FILE="$out/cpu-netns-$cfg.json" CONCERTO_CACHE_DIR="$out/plan-cache" CONCERTO_CHOOSE_PLAN=0
  mkdir -p "$CONCERTO_CACHE_DIR"
  args() { # the model'"'"'s sizes: bench/cluster/run'"'"'s
    case $1 in
    llama) echo --tp "$tp" --layers 2 --hidden 256 --heads 4 --kv-heads 2 --seq 64 --batch 16 $extra ;;
    gpt) echo --tp "$tp" --layers 2 --hidden 256 --heads 4 --seq 64 --batch 16 $extra ;;
    esac
  }
  one() { # MODEL VALUE STEPS TAG
    local file="$out/$1-$flag$2-$4"
    echo "$(date +%T) start $1 $flag $2 $4 load $(cut -d" " -f1-3 /proc/loadavg)" >>"$out/load.log"
    # shellcheck disable=SC2046
    "$CLUSTER_MPIRUN" -np "$hosts" -x CONCERTO_COST_FILE -x CONCERTO_CACHE_DIR -x CONCERTO_CHOOSE_PLAN \
      "$out/bin/example_$1" $(args "$1") --steps "$3" --policy "$policy" "--$flag" "$2" \
      --cost-preset cpu-netns --json "$file.json" >"$file.txt" 2>&1 ||
      echo "ab_cost.sh: example_$1 --$flag $2 ($4) failed; see $file.txt" >&2
    echo "$(date +%T) end   $1 $flag $2 $4 load $(cut -d" " -f1-3 /proc/loadavg)" >>"$out/load.log"
  }
  for m in $models; do
    one "$m" "$a" 3 prime
    one "$m" "$b" 3 prime
    for ((r = 1; r <= reps; ++r)); do
      if ((r % 2)); then order="$a $b"; else order="$b $a"; fi
      for v in $order; do
        echo "== $m --$flag $v run $r ($(date +%T))" >&2
        one "$m" "$v" "$steps" "run$r"
      done
    done
  done
'
echo "ab_cost.sh: measured in $(($(date +%s) - start)) s; results in $out" | tee -a "$out/meta.txt" >&2
python3 - "$out" "$models" "$flag" "$a" "$b" <<'PY'
import glob, json, os, re, statistics, sys
out, models, flag, a, b = sys.argv[1], sys.argv[2].split(), sys.argv[3], sys.argv[4], sys.argv[5]
def plan_lines(txt):
    got = {}
    for line in open(txt):
        m = re.match(r"plan (\S+): (\d+) tasks \((\d+) collectives\)", line)
        if m: got[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    return got
print(f"{'model':>6} {'policy':>9} {flag:>9} {'runs':>4}  {'median step us (per run)':<40} {'pred us':>8} {'LB us':>8} {'tasks':>6} {'coll':>5} {'coll MB':>8}")
rows = {}
for model in models:
    for v in (a, b):
        runs = sorted(glob.glob(f"{out}/{model}-{flag}{v}-run*.json"))
        per = {}
        for f in runs:
            tasks = plan_lines(f[:-5] + ".txt")
            for r in json.load(open(f)):
                p = r["policy"]
                d = per.setdefault(p, {"meds": [], "pred": r["predicted_us"], "lb": r["lower_bound_us"], "tc": tasks.get(p),
                                       "mb": r.get("collective_bytes", float("nan")) / 1e6})
                d["meds"].append(r["median_step_us"])
        for p, d in per.items():
            med = statistics.median(d["meds"])
            rows[(model, p, v)] = med
            tc = d["tc"] or ("?", "?")
            runs_txt = ", ".join(f"{x:.0f}" for x in d["meds"])
            print(f"{model:>6} {p:>9} {v:>9} {len(d['meds']):>4}  {med:>8.0f} ({runs_txt}){'':<{max(0, 29 - len(runs_txt))}} {d['pred']:>8.0f} {d['lb']:>8.0f} {tc[0]:>6} {tc[1]:>5} {d['mb']:>8.2f}")
print()
for (model, p, v), med in rows.items():
    if v == a and (model, p, b) in rows:
        other = rows[(model, p, b)]
        print(f"{model} {p}: --{flag} {b} vs {a}: {other - med:+.0f} us ({100 * (other / med - 1):+.1f} %)")
PY

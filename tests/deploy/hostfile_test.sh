#!/usr/bin/env bash
# Runs a trainer the way docs/deploy.md launches one on several hosts, on this machine alone:
# mpirun with a hostfile (localhost, 4 slots), --map-by ppr:4:node, the environment passed to
# the ranks with -x, and a plan cache directory of its own. The second run must find the plan
# the first one stored (rank 0 writes the cache, every rank gets the plan from rank 0).
#   tests/deploy/hostfile_test.sh build/examples/llama/example_llama
# Exit status: 0 passed, 77 skipped (no mpirun), anything else failed.
set -euo pipefail

binary=${1:?usage: hostfile_test.sh PATH/TO/example_llama}
if ! command -v mpirun >/dev/null 2>&1; then
  echo "hostfile_test: mpirun not found; skipped" >&2
  exit 77
fi
[[ -x $binary ]] || { echo "hostfile_test: '$binary' is not an executable" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "localhost slots=4" >"$work/hosts"

# Open MPI refuses to start as root unless told twice; only then.
if [[ $(id -u) -eq 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export GLIBC_TUNABLES=glibc.malloc.hugetlb=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
export CONCERTO_CACHE_DIR="$work/cache" CONCERTO_TIMEOUT_S=${CONCERTO_TIMEOUT_S:-120}

run() {
  # --oversubscribe: 4 ranks on a machine that may have fewer cores (real hosts: leave it out).
  # --timeout: the launcher's own backstop, for a hang before concerto's deadlines apply.
  mpirun --hostfile "$work/hosts" -np 4 --map-by ppr:4:node --bind-to none --oversubscribe --timeout 600 \
    -x GLIBC_TUNABLES -x OPENBLAS_NUM_THREADS -x OMP_NUM_THREADS -x CONCERTO_CACHE_DIR -x CONCERTO_TIMEOUT_S \
    "$binary" --tp 2 --steps 3 --layers 1 --hidden 32 --seq 16 --batch 8
}

run | tee "$work/first.txt"
grep -q "cache miss" "$work/first.txt" || { echo "hostfile_test: the first run did not plan (no 'cache miss')" >&2; exit 1; }
ls "$CONCERTO_CACHE_DIR"/*.plan >/dev/null || { echo "hostfile_test: no plan stored in $CONCERTO_CACHE_DIR" >&2; exit 1; }
run | tee "$work/second.txt"
grep -q "cache hit" "$work/second.txt" || { echo "hostfile_test: the second run did not load the stored plan" >&2; exit 1; }
echo "hostfile_test: passed"

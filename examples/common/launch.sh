#!/bin/sh
# Launches the example NAME on $NP ranks (default 4), oversubscribed, with the environment the
# MPI backend wants. BUILD names the build directory (default: build). Arguments go to the program.
#   examples/common/launch.sh NAME [options]      (examples/NAME/run.sh calls it)
set -eu
here=$(cd "$(dirname "$0")/../.." && pwd)
name=$1
shift
build=${BUILD:-$here/build}
export GLIBC_TUNABLES=glibc.malloc.hugetlb=1   # large messages ran 10x slower without huge pages
export OPENBLAS_NUM_THREADS=1                  # one core per rank
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec mpirun -np "${NP:-4}" --oversubscribe --bind-to none -x GLIBC_TUNABLES -x OPENBLAS_NUM_THREADS \
  "$build/examples/$name/example_$name" "$@"

#!/bin/sh
# Launches examples/evoformer on $NP ranks (default 4); see examples/common/launch.sh. Arguments go to the program.
#   examples/evoformer/run.sh [options]      (--help lists them)
exec "$(dirname "$0")/../common/launch.sh" evoformer "$@"

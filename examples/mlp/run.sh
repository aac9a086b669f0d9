#!/bin/sh
# Launches examples/mlp on $NP ranks (default 4); see examples/common/launch.sh. Arguments go to the program.
#   examples/mlp/run.sh [options]
exec "$(dirname "$0")/../common/launch.sh" mlp "$@"

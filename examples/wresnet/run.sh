#!/bin/sh
# Launches examples/wresnet on $NP ranks (default 4); see examples/common/launch.sh. Arguments go to the program.
#   examples/wresnet/run.sh [options]
exec "$(dirname "$0")/../common/launch.sh" wresnet "$@"

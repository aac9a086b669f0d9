#!/bin/sh
# Launches examples/vit on $NP ranks (default 4); see examples/common/launch.sh. Arguments go to the program.
#   examples/vit/run.sh [options]
exec "$(dirname "$0")/../common/launch.sh" vit "$@"

#!/bin/sh
# Launches examples/gpt on $NP ranks (default 4); see examples/common/launch.sh. Arguments go to the program.
#   examples/gpt/run.sh [options]
exec "$(dirname "$0")/../common/launch.sh" gpt "$@"

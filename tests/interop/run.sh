#!/bin/sh
# One direction of the safetensors interop test:
#   run.sh PYENV ROUNDTRIP SCRIPT FILE to-python|from-python
# PYENV is the virtual environment scripts/test.sh makes with Python's safetensors, numpy and
# ml_dtypes from PyPI; without it the test is skipped (exit 77) and says how to make it.
set -e
py="$1/bin/python" roundtrip="$2" script="$3" file="$4"
if ! "$py" -c "import safetensors, numpy, ml_dtypes" 2>/dev/null; then
  echo "skipped: no Python environment with safetensors at $1; make it with"
  echo "  python3 -m venv $1 && $1/bin/pip install safetensors numpy ml_dtypes   (or run scripts/test.sh)"
  exit 77
fi
case "$5" in
  to-python) "$roundtrip" write "$file" && "$py" "$script" check "$file" ;;
  from-python) "$py" "$script" write "$file" && "$roundtrip" check "$file" ;;
  *) echo "run.sh: direction must be to-python or from-python" >&2; exit 2 ;;
esac

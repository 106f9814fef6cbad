#!/usr/bin/env bash
# Prints the path of a Python interpreter of at least version MAJOR.MINOR that
# really runs (pyenv installs shims for versions that are not active), or
# fails. Usage: bash scripts/find_python.sh 3.12
set -euo pipefail
want=${1:?usage: bash scripts/find_python.sh MAJOR.MINOR}
candidates=(python3.14 python3.13 python3.12 python3)
if [ -d "${PYENV_ROOT:-$HOME/.pyenv}/versions" ]; then
  candidates+=("${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.*/bin/python)
fi
for candidate in "${candidates[@]}"; do
  if path=$(command -v "$candidate" 2> /dev/null) \
    && "$path" -c "import sys; sys.exit(sys.version_info[:2] < tuple(map(int, '$want'.split('.'))))" 2> /dev/null; then
    "$path" -c "import sys; print(sys.executable)"
    exit 0
  fi
done
echo "no Python >= $want found" >&2
exit 1

#!/usr/bin/env bash
# Creates .venv (Python >= 3.11) with mixprec and every optional extra installed.
# Usage: bash scripts/setup.sh [--tests]   (--tests adds pytest, hypothesis, ruff, pyright)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade "pip>=25.1"
if [ "${1:-}" = "--tests" ]; then
  .venv/bin/python -m pip install -q -e ".[all]" --group tests --group dev
else
  .venv/bin/python -m pip install -q -e ".[all]"
fi

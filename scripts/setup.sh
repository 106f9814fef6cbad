#!/usr/bin/env bash
# Creates a virtual environment (default .venv, Python >= 3.11) with mixprec and
# every optional extra installed.
# Usage: bash scripts/setup.sh [--tests]   (--tests adds pytest, hypothesis, ruff, pyright)
# Environment: PYTHON (interpreter, default python3), VENV (default .venv),
# JAX_VERSION (pin jax and jaxlib, e.g. 0.11.2; JAX >= 0.11 needs Python >= 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade "pip>=25.1"
# One resolution: the pinned JAX (if any) goes in with everything else.
PINS=()
if [ -n "${JAX_VERSION:-}" ]; then
  PINS=("jax==$JAX_VERSION" "jaxlib==$JAX_VERSION")
fi
if [ "${1:-}" = "--tests" ]; then
  "$VENV/bin/python" -m pip install -q -e ".[all]" "${PINS[@]}" --group tests --group dev
else
  "$VENV/bin/python" -m pip install -q -e ".[all]" "${PINS[@]}"
fi

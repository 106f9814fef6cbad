#!/usr/bin/env bash
# Sets up .venv and runs everything CI runs: lint, type check, tests, doctests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --tests
echo "== ruff"
.venv/bin/ruff check mixprec tests benchmarks tools examples conftest.py
.venv/bin/ruff format --check mixprec tests benchmarks tools examples conftest.py
echo "== pyright"
.venv/bin/pyright mixprec
echo "== pytest (tests and doctests)"
.venv/bin/pytest -n 2 --dist loadfile -q --durations=30 "$@"

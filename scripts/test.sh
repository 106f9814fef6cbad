#!/usr/bin/env bash
# Sets up .venv and runs everything CI runs: lint, type check, tests, doctests.
# Usage: bash scripts/test.sh [--quick] [pytest arguments]
#   --quick: lint, then only the quick tier (tests/quick_tier.txt: a few tests
#   from each area, for the edit loop); no type check, no doctests.
# Environment: MIXPREC_SETUP_DONE=1 skips the setup (.ci/run has just run it).
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=0
if [ "${1:-}" = "--quick" ]; then
  QUICK=1
  shift
fi
if [ "${MIXPREC_SETUP_DONE:-0}" != 1 ]; then
  bash scripts/setup.sh --tests
fi
echo "== ruff"
.venv/bin/ruff check mixprec tests benchmarks tools examples conftest.py
.venv/bin/ruff format --check mixprec tests benchmarks tools examples conftest.py
if [ "$QUICK" = 1 ]; then
  echo "== pytest (the quick tier: tests/quick_tier.txt)"
  mapfile -t TIER < <(grep -v '^#' tests/quick_tier.txt | grep .)
  .venv/bin/pytest -n 2 --dist loadfile -q --durations=10 "${TIER[@]}" "$@"
  exit
fi
echo "== pyright"
.venv/bin/pyright mixprec
echo "== pytest (tests and doctests)"
.venv/bin/pytest -n 2 --dist loadfile -q --durations=30 "$@"

#!/usr/bin/env bash
# Runs tests on another JAX release, in its own environment (.venv-jax<VERSION>).
# Usage: bash scripts/test_jax.sh VERSION [pytest arguments]
#   bash scripts/test_jax.sh 0.11.2                       # the whole suite
#   bash scripts/test_jax.sh 0.11.2 tests/test_platforms.py
# JAX >= 0.11 needs Python >= 3.12: PYTHON defaults to the first of
# scripts/find_python.sh's interpreters that runs.
# Environment: MIXPREC_SETUP_DONE=1 skips the setup (.ci/run has just run it);
# MIXPREC_TEST_WORKERS, pytest-xdist's workers (default 2; 0 runs in-process).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: bash scripts/test_jax.sh VERSION [pytest arguments]}
shift
if [ "${MIXPREC_SETUP_DONE:-0}" != 1 ]; then
  PYTHON=${PYTHON:-$(bash scripts/find_python.sh 3.12)}
  VENV=".venv-jax$VERSION" PYTHON="$PYTHON" JAX_VERSION="$VERSION" bash scripts/setup.sh --tests
fi
echo "== pytest on JAX $VERSION ($(".venv-jax$VERSION/bin/python" --version))"
".venv-jax$VERSION/bin/pytest" -n "${MIXPREC_TEST_WORKERS:-2}" --dist loadfile -q "$@"

#!/usr/bin/env bash
# The test command: set up .venv with the test extra (Python 3.12, jax 0.11.2, torch CPU for parity tests) and run
# the suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
export JAX_PLATFORMS=cpu
# Two workers (JSPARSE_TEST_WORKERS), each taking whole test files so module fixtures are built once, the slowest
# files first (tests/conftest.py: SLOW_FILES_FIRST; --no-loadscope-reorder keeps that order). A worker that crashes
# fails its test and the run ends with the summary (--max-worker-restart=0): with restarts, xdist's file scheduler
# stopped handing out files after a crash and the run hung until CI's limit (2026-11-28).
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 -n "${JSPARSE_TEST_WORKERS:-2}" --dist loadfile \
    --no-loadscope-reorder --max-worker-restart=0 "$@"

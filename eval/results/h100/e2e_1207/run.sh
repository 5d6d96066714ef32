#!/usr/bin/env bash
# On an H100, one call: H2O's selection tests on the GPU (gpu_tests.txt: they failed at bd1b231, before the top-k
# search loop was restored), then issue 24's acceptance parts d, a, b, c (`../e2e/run.sh` through
# `../e2e_plan/run.sh`) at the commit the JSONs name. Then, on this machine, the README's tables:
# `jsparse bench model_table eval/results/h100/e2e_1207/e2e_[abc].json --link-root . --bar 0.85` (and
# `e2e_qwen3.json`), written to table.md and table_qwen3.md.
# Usage (GPU, repository root): GIT_COMMIT=<sha> OUT=<dir> bash eval/results/h100/e2e_1207/run.sh
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 60 python3 -m pytest -q -p no:cacheprovider -x --tb=short \
  tests/test_h2o_candidates.py -k "not mass_at_end" > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests rc=$?"; tail -4 "$OUT/gpu_tests.txt"
PART="${PART:-d a b c}" bash eval/results/h100/e2e_plan/run.sh

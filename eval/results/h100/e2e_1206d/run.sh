#!/usr/bin/env bash
# On an H100, one call: `../decode_stages/` for EvoSparse at 100K, batch 4 (the gathered decode's pipelining depth, 2
# and 1 against the library's 3), then issue 24's acceptance parts a-d (`../e2e/run.sh` through `../e2e_plan/run.sh`)
# with EvoSparse's grouped selection (`../evo_group/`).
# Usage (GPU, repository root): GIT_COMMIT=<sha> OUT=<dir> bash eval/results/h100/e2e_1206d/run.sh
set -u
export PYTHONUNBUFFERED=1
if [ -z "${SKIP_STAGES:-}" ]; then
  CASES="evosparse:4" STAGES="2 1" PYTHONPATH=. timeout 120 python3 eval/results/h100/decode_stages/stages.py 2>&1 \
    | grep -E "ms$|failed"
fi
PART="${PART:-a b c d}" bash eval/results/h100/e2e_plan/run.sh

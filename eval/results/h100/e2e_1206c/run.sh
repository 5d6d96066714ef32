#!/usr/bin/env bash
# Issue 24's acceptance parts a-d on an H100 (`../e2e/run.sh` through `../e2e_plan/run.sh`), then issue 23's STS round
# at 100K, batch 3 (budget 512; the paper's default and the fast configuration) waited and queued, on the same machine.
# Usage (GPU, repository root): GIT_COMMIT=<sha> OUT=<dir> bash eval/results/h100/e2e_1206c/run.sh
set -u
export PYTHONUNBUFFERED=1
PART="a b c d" bash eval/results/h100/e2e_plan/run.sh
for q in "" 1; do
  name=sts_100000_b3_$([ -n "$q" ] && echo queued || echo waited).json
  echo "== sts $name $(date +%T)"
  PYTHONPATH=. XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 QUEUED=$q JSON=$name CELLS=100000:3 BUDGETS=512 \
    ROUND_BUDGETS=512 ROUND_VARIANTS=index,index+densemask_pool4 POOLS=4 \
    timeout 110 python3 eval/results/h100/sts_bench/bench_sts.py 2>&1 | grep -vE "^W[0-9]{4}|^I[0-9]{4}" | tail -12
done

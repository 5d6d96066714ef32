#!/bin/bash
# STS at the largest batch that fits both caches on this card (issue 23, item 7): tries each batch of BATCHES
# in its own process, largest first, and stops at the first whose cell completes (an out-of-memory cell is
# recorded in its JSON, not hidden). Usage (on the GPU machine, repo root):
#   CTX=100000 BATCHES=7,6,5 OUT=... GIT_COMMIT=... bash eval/results/h200/largest_batch/run_sts.sh
set -u
export PYTHONPATH=. XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
export BUDGETS=${BUDGETS:-512,4096} ROUND_BUDGETS=${ROUND_BUDGETS:-512} ACCEPT=${ACCEPT:-3} POOLS=${POOLS:-4}
export ROUND_VARIANTS=${ROUND_VARIANTS:-index,index+densemask_pool4}
for B in ${BATCHES//,/ }; do
  export CELLS=$CTX:$B JSON=sts_bench_${CTX}_b$B.json
  python eval/results/h100/sts_bench/bench_sts.py
  if ! grep -q '"error"' "$OUT/$JSON"; then break; fi
done

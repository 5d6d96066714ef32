#!/usr/bin/env bash
# On an H100 after e2e_1206c: the top-k GPU tests (the sampled path's 1024-score samples of rows of at most 32K are
# new at 132603f), then where the oracle's step goes at 100K, batch 1 (one of its cells under the bar).
# Usage (GPU, repository root): GIT_COMMIT=<sha> OUT=<dir> bash eval/results/h100/check_1206c/run.sh
set -u
export PYTHONUNBUFFERED=1
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 170 python3 -m pytest -q -p no:cacheprovider -rfE \
  tests/test_topk_select_gpu.py > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests rc=$? $(tail -1 "$OUT/gpu_tests.txt")"
mkdir -p /tmp/prof
timeout 110 python3 -m jsparse.cli bench profile_decode_step --method oracle --context 100000 --batch 1 --steps 4 \
  --top 60 --out /tmp/prof/profile_oracle_b1.json > /tmp/prof.log 2>&1
echo "-- oracle rc=$? $(date +%T)"; cp /tmp/prof/profile_oracle_b1.json "$OUT/" || tail -5 /tmp/prof.log

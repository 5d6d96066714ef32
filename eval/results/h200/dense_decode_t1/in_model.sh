#!/usr/bin/env bash
# The dense decode kernel's pipelining depth for plain decoding's 16-row tiles, inside the model's T = 1 step
# (profile_sts.py's dense_step: Llama-3.1-8B shapes, random bf16 weights, 100K): _STAGES_SMALL_TILE 3 (before) vs 4.
# Usage (GPU): OUT=... GIT_COMMIT=... bash eval/results/h200/dense_decode_t1/in_model.sh
set -euo pipefail
export PYTHONPATH=. XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
for B in 1 3 4; do
  for S in 3 4; do
    echo "### batch $B stages $S"
    STAGES=$S CTX=100000 B=$B K=512 STEPS=dense_step JSON=dense_step_b${B}_stages${S}.json python -c "
import os, runpy
import pallas_kernels.dense_decode.gpu as g
g._STAGES_SMALL_TILE = int(os.environ['STAGES'])
runpy.run_path('eval/results/h100/sts_bench/profile_sts.py', run_name='__main__')" 2>&1 | grep -A2 "=="
  done
done

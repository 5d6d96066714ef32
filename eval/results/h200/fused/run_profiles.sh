#!/usr/bin/env bash
# The fused q/k/v and gate/up layout against the separate one, same machine, alternating: the STS verification,
# the dense verification and the context-free step (profile_sts.py), Llama-3.1-8B shapes, 100K, batch 3, budget 512.
# Usage (GPU): OUT=... GIT_COMMIT=... bash eval/results/h200/fused/run_profiles.sh
set -euo pipefail
export PYTHONPATH=. XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
for run in 1 2; do
  for layout in separate fused; do
    echo "### $layout run $run"
    LAYOUT=$layout CTX=100000 B=3 K=512 STEPS=target_step_1k,verify_dense,verify_sts JSON=profile_${layout}_${run}.json \
      python eval/results/h100/sts_bench/profile_sts.py | grep "=="
  done
done

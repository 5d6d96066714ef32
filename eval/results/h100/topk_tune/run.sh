#!/usr/bin/env bash
# topk_tune on an H100: probe.py, then `jsparse bench model --no-check --methods dense,kascade,evosparse,oracle
# --context 100000 --batch 4` with gpu_row.REDUCE_2D off and on (alternating processes, dense first in each).
# Usage (GPU, repository root): GIT_COMMIT=<sha> OUT=<dir> bash eval/results/h100/topk_tune/run.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout 330 python3 eval/results/h100/topk_tune/probe.py 2>&1 | grep -vE "^W[0-9]{4}|^I[0-9]{4}"
for v in off on; do
  echo "== model, REDUCE_2D $v $(date +%T)"
  timeout 120 python3 -c "
import sys
import pallas_kernels.topk_select.gpu_row as g
g.REDUCE_2D = sys.argv[1] == 'on'
from jsparse.cli import main
main(['bench', 'model', '--no-check', '--methods', 'dense,kascade,evosparse,oracle', '--context', '100000',
      '--batch', '4', '--out', sys.argv[2]])" $v "$OUT/model_2d_$v.json" > /tmp/m_$v.log 2>&1
  grep -E "^\| (dense|kascade|evosparse|oracle) " /tmp/m_$v.log || grep -vE "^W[0-9]{4}|^I[0-9]{4}" /tmp/m_$v.log | tail -5
done

#!/usr/bin/env bash
# Per-kernel profiles and the ordered kernel sequence of two decode steps for each method (100K, batch 4).
# Usage (GPU): OUT=... bash eval/results/h200/layer_seq/run.sh
set -u
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
for m in ${METHODS:-streaming kascade evosparse h2o}; do
  PYTHONPATH=. python3 -m jsparse.cli bench profile_decode_step --method "$m" --context 100000 --batch 4 --steps 2 \
    --top 60 --trace-dir "/tmp/tr_$m" --out "/tmp/prof_$m.json" 2>&1 | grep -vE "^W[0-9]{4}|^I[0-9]{4}" | tail -4
  PYTHONPATH=. python3 eval/results/h200/layer_seq/seq.py "/tmp/tr_$m" "$OUT/seq_$m.json"
  cp "/tmp/prof_$m.json" "$OUT/"
done

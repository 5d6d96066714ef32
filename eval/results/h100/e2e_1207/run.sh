#!/usr/bin/env bash
# On an H100, one call: the masked-reference check of H2O and EvoSparse (they failed at bd1b231, before the top-k's
# search loops were restored) with the layer scan unrolled and rolled, at 4K, batch 1 (check_*.json), then issue 24's
# acceptance parts d, a, b, c (`../e2e/run.sh` through `../e2e_plan/run.sh`; PART chooses) at the commit the JSONs
# name. Then, on this machine, the README's tables: `jsparse bench model_table
# eval/results/h100/e2e_1207/e2e_[abc].json --link-root . --bar 0.85` (and `e2e_qwen3.json`).
# Usage (GPU, repository root): GIT_COMMIT=<sha> OUT=<dir> bash eval/results/h100/e2e_1207/run.sh
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
for scan in unroll rolled; do
  opt=(); [ $scan = rolled ] && opt=(--rolled-layers)
  timeout 120 python3 -m jsparse.cli bench model "${opt[@]}" --methods dense,h2o,evosparse --context 4096 \
    --batch 1 --out "$OUT/check_$scan.json" > /tmp/check_$scan.log 2>&1
  echo "-- check $scan rc=$? $(date +%T)"; grep -iE "check|^\| (h2o|evosparse) " /tmp/check_$scan.log | tail -6
done
PART="${PART:-d a b c}" bash eval/results/h100/e2e_plan/run.sh

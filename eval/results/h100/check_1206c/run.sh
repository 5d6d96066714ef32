#!/usr/bin/env bash
# On an H100 after e2e_1206c: where two of the steps under the bar go, the oracle at 100K, batch 1 and EvoSparse at
# 100K, batch 2 (`jsparse bench profile_decode_step`, 4 traced steps).
# Usage (GPU, repository root): GIT_COMMIT=<sha> OUT=<dir> bash eval/results/h100/check_1206c/run.sh
set -u
export PYTHONUNBUFFERED=1
mkdir -p /tmp/prof
for mb in oracle:1 evosparse:2; do
  m=${mb%:*}; b=${mb#*:}
  timeout 110 python3 -m jsparse.cli bench profile_decode_step --method $m --context 100000 --batch $b --steps 4 \
    --top 60 --out /tmp/prof/profile_${m}_b$b.json > /tmp/prof_$m.log 2>&1
  echo "-- $m rc=$? $(date +%T)"; cp /tmp/prof/profile_${m}_b$b.json "$OUT/" || tail -5 /tmp/prof_$m.log
done

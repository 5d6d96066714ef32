#!/usr/bin/env bash
# On an H100 after e2e_1206c: where the steps furthest under the bar go, H2O and EvoSparse at 100K, batch 4, and the
# oracle at 100K, batch 1, beside dense at 100K, batch 4 (`jsparse bench profile_decode_step`, 4 traced steps; the
# compiled HLO beside each JSON, to look up what a fusion computes).
# Usage (GPU, repository root): GIT_COMMIT=<sha> OUT=<dir> bash eval/results/h100/check_1206d/run.sh
set -u
export PYTHONUNBUFFERED=1
mkdir -p /tmp/prof
for mb in ${CASES:-h2o:4 evosparse:4 oracle:1 dense:4}; do
  m=${mb%:*}; b=${mb#*:}
  timeout 150 python3 -m jsparse.cli bench profile_decode_step --method $m --context 100000 --batch $b --steps 4 \
    --top 80 --out /tmp/prof/profile_${m}_b$b.json > /tmp/prof_$m.log 2>&1
  echo "-- $m rc=$? $(date +%T)"
  cp /tmp/prof/profile_${m}_b$b.json /tmp/prof/profile_${m}_b$b.hlo.txt.gz "$OUT/" || tail -5 /tmp/prof_$m.log
done

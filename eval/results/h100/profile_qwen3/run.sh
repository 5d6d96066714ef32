#!/usr/bin/env bash
# Where the Qwen3-8B cells under issue 24's 0.85 share spend their decode steps, on an H100 (e2e_1207b: EvoSparse
# at 100K, batch 3, 0.827; the oracle at 100K, batch 1, 0.843): `jsparse bench profile_decode_step --shape qwen3-8b`
# of EvoSparse and dense at batch 3 and of the oracle and dense at batch 1 (4 traced steps, the step `jsparse bench
# model` times).
# Usage (GPU): GIT_COMMIT=<sha> OUT=... bash run.sh
set -u
export PYTHONUNBUFFERED=1
mkdir -p /tmp/prof
for mb in ${RUNS:-evosparse:3 dense:3 oracle:1 dense:1}; do
  m=${mb%:*}; b=${mb#*:}
  timeout 150 python3 -m jsparse.cli bench profile_decode_step --shape qwen3-8b --method $m --context 100000 \
    --batch $b --steps 4 --top 60 --out /tmp/prof/profile_${m}_b$b.json > /tmp/prof_${m}_$b.log 2>&1
  echo "-- $m b$b rc=$? $(date +%T)"; cp /tmp/prof/profile_${m}_b$b.json "$OUT/" || tail -5 /tmp/prof_${m}_$b.log
done

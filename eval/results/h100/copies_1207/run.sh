#!/usr/bin/env bash
# Which buffers EvoSparse's decode step copies (`memcpy32_post`, 27-29 a step, e2e_1207c/NOTES.md's lead) and what
# the oracle's per-layer XLA kernels are: `jsparse bench profile_decode_step` with its compiled HLO (gzipped beside
# the JSON) for EvoSparse at 100K, batch 4 (Llama-3.1-8B shapes) and the oracle on Qwen3-8B shapes at batch 1.
# Usage (GPU): GIT_COMMIT=<sha> OUT=... bash run.sh
set -u
export PYTHONUNBUFFERED=1
mkdir -p /tmp/prof
for smb in ${RUNS:-llama3-8b:evosparse:4 qwen3-8b:oracle:1}; do
  s=${smb%%:*}; mb=${smb#*:}; m=${mb%:*}; b=${mb#*:}
  f=/tmp/prof/profile_${s}_${m}_b$b
  timeout 150 python3 -m jsparse.cli bench profile_decode_step --shape $s --method $m --context 100000 \
    --batch $b --steps 4 --top 80 --out $f.json > $f.log 2>&1
  echo "-- $s $m b$b rc=$? $(date +%T)"; cp $f.json $f.hlo.txt.gz "$OUT/" || tail -5 $f.log
done

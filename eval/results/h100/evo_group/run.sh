#!/usr/bin/env bash
# On an H100: EvoSparse's grouped selection (`group_select`, the default: the sparse layers that inherit one
# retrieval set selected in one launch where the set is computed) against one selection per layer
# (`evosparse:per_layer`), timed in one process with dense first (`jsparse bench profile_decode_step --time`), at
# 100K, batch 2 and 4 (Llama-3.1-8B shapes) and batch 3 (Qwen3-8B shapes); then `jsparse bench model` at 100K,
# batch 4, which checks the grouped step against its masked reference after timing it.
# Usage (GPU, repository root): GIT_COMMIT=<sha> OUT=<dir> bash eval/results/h100/evo_group/run.sh
set -u
export PYTHONUNBUFFERED=1
mkdir -p /tmp/prof
for sb in llama3-8b:2 llama3-8b:4 qwen3-8b:3; do
  s=${sb%:*}; b=${sb#*:}
  timeout 170 python3 -m jsparse.cli bench profile_decode_step --shape $s --method evosparse --context 100000 \
    --batch $b --steps 4 --top 40 --time dense,evosparse,evosparse:per_layer \
    --out /tmp/prof/ab_${s}_b$b.json > /tmp/ab_$s$b.log 2>&1
  echo "-- $s b$b rc=$? $(date +%T)"; cp /tmp/prof/ab_${s}_b$b.json "$OUT/" || tail -5 /tmp/ab_$s$b.log
done
PYTHONPATH=. timeout 150 python3 -m jsparse.cli bench model --methods dense,evosparse --context 100000 --batch 4 \
  --out "$OUT/check_b4.json" 2>&1 | grep -vE "^W[0-9]{4}|^I[0-9]{4}|^\{'phase'" | tail -8

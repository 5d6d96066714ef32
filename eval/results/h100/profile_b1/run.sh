#!/usr/bin/env bash
# Where a batch-1 decode step's time goes (issue 24: the cells still below the 0.85 share are mostly batch 1 and 2 at
# 100K): `jsparse bench profile_decode_step` of each step at 100K, batch 1, Llama-3.1-8B shapes, then Qwen3-8B's dense
# and Kascade. Runs past DEADLINE seconds are skipped.
# Usage (GPU): GIT_COMMIT=<sha> OUT=... bash run.sh
set -u
export PYTHONUNBUFFERED=1
run() {  # shape method
  [ $SECONDS -gt ${DEADLINE:-500} ] && { echo "-- $1 $2 skipped: past ${DEADLINE:-500} s"; return; }
  PYTHONPATH=. timeout $((580 - SECONDS)) python3 -m jsparse.cli bench profile_decode_step --shape "$1" --method "$2" \
    --context 100000 --batch 1 --steps 4 --top 150 --out "$OUT/profile_${1}_${2}_100k_b1.json" > /tmp/log_$1_$2.txt 2>&1; rc=$?
  echo "-- $1 $2 $(date +%T) rc=$rc"; tail -1 /tmp/log_$1_$2.txt; { echo "== $1 $2"; grep -vE "^[WI][0-9]{4}" /tmp/log_$1_$2.txt | tail -5; } >> "$OUT/logs.txt"
}
for m in ${METHODS:-dense evosparse h2o oracle kascade}; do run llama3-8b $m; done
for m in ${QWEN:-dense kascade}; do run qwen3-8b $m; done

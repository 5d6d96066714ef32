#!/usr/bin/env bash
# Every method's masked-reference check at batch 1 on the GPU (issue 24): `jsparse bench model` checks one prompt
# (`eval.bench.model_check.CHECK_ONE_ROW`) beside its batch of two where a run times batch 1 (cc807fe), a path that
# had run on the CPU only. One run of the eight decode methods at 32K, batch 1 on Llama-3.1-8B shapes
# (the timings beside it are one cell of part a/b's), then the same on Qwen3-8B shapes if SHAPES has it.
# Usage (GPU): GIT_COMMIT=<sha> OUT=... [SHAPES="llama3-8b qwen3-8b"] bash eval/results/h100/check_b1/run.sh
set -u
export PYTHONUNBUFFERED=1
for s in ${SHAPES:-llama3-8b}; do
  echo "== $s $(date +%T)"
  PYTHONPATH=. timeout 280 python3 -m jsparse.cli bench model --shape "$s" --out "$OUT/check_b1_$s.json" \
    --methods dense,kascade,evosparse,streaming,oracle,quest,h2o,butler --context 32768 --batch 1 2>&1 \
    | grep -E "^\| |^check|rror" | tail -24
  echo "-- rc=${PIPESTATUS[0]} $(date +%T)"
done

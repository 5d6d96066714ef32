#!/usr/bin/env bash
# Issue 24's acceptance runs on an H100, one part per device call (each well under 10 minutes on an H200), then the
# README table: `jsparse bench model` with every decode method, dense measured first in each run and every method
# checked against its masked reference after the timing (a failed check exits non-zero and is marked in the table).
#   PART=a: dense, kascade, evosparse, streaming at 32K and 100K, batch 1 and 4
#   PART=b: dense, oracle, quest, h2o, butler at 32K and 100K, batch 1 and 4
#   PART=c: the same eight methods at the largest batch that fits each context (--batch max), 32K and 100K
#   PART=d: Qwen3-8B shapes, the eight methods at 100K, batch 1 and 3 (4 does not fit beside dense's cache)
#   PART=table: `jsparse bench model_table` of the Llama-3.1-8B runs found under $OUT (bars: 0.85 share); run here
#     with OUT=eval/results/h100/e2e, where the 2026-12-02 runs are (NOTES.md)
# Usage (GPU): OUT=... PART=a bash eval/results/h100/e2e/run.sh   (pass GIT_COMMIT=<sha> so each JSON names it)
set -eu
export PYTHONUNBUFFERED=1
ALL=dense,kascade,evosparse,streaming,oracle,quest,h2o,butler
bench() {  # $1 = JSON name, then bench model options
  local name=$1; shift
  PYTHONPATH=. python3 -m jsparse.cli bench model --out "$OUT/$name.json" "$@" 2>&1 \
    | grep -vE "^W[0-9]{4}|^I[0-9]{4}|^\{'phase'" | tail -14
}
case "${PART:?PART=a|b|c|d|table}" in
  a) bench e2e_a --methods dense,kascade,evosparse,streaming --context 32768,100000 --batch 1,4 ;;
  b) bench e2e_b --methods dense,oracle,quest,h2o,butler --context 32768,100000 --batch 1,4 ;;
  c) bench e2e_c --methods "$ALL" --context 32768,100000 --batch max ;;
  d) bench e2e_qwen3 --shape qwen3-8b --methods "$ALL" --context 100000 --batch 1,3 ;;
  table) PYTHONPATH=. python3 -m jsparse.cli bench model_table "$OUT"/e2e_[abc].json --bar 0.85 \
           --out "$OUT/table.md" ;;
  *) echo "PART=$PART: expected a, b, c, d or table" >&2; exit 2 ;;
esac

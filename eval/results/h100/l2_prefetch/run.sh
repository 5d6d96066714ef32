#!/usr/bin/env bash
# Issue 24's L2 lead on an H100, one device call (about 8 minutes):
#   1. probe.py: prefetch programs beside a latency-bound and a streaming launch, then the GEMM (l2_prefetch.json);
#   2. A/B in the model's decode step, alternating on one warm machine: `jsparse bench model --methods
#      dense,evosparse,h2o --context 100000 --batch 4` without, with, without, with `--method-option
#      evosparse.prefetch_o=true --method-option h2o.prefetch_o=true` (the runs with it checked against the masked
#      reference, batch 2 and 1; the runs without it `--no-check`), then EvoSparse and H2O on Qwen3-8B shapes at
#      batch 3, without and with.
# Usage (GPU): GIT_COMMIT=<sha> OUT=... bash eval/results/h100/l2_prefetch/run.sh
set -u
export PYTHONUNBUFFERED=1
echo "== probe $(date +%T)"
PYTHONPATH=. timeout 150 python3 eval/results/h100/l2_prefetch/probe.py 2>&1 | grep -E "^\|" | tail -40
ON=(--method-option evosparse.prefetch_o=true --method-option h2o.prefetch_o=true)
bench() {  # $1 = JSON name, then bench model options
  local name=$1; shift
  PYTHONPATH=. timeout 170 python3 -m jsparse.cli bench model --out "$OUT/$name.json" "$@" 2>&1 \
    | grep -E "^\| (dense|evosparse|h2o) |^check|rror" | tail -12
  echo "-- $name done $(date +%T)"
}
i=0
for v in off on off on; do
  i=$((i + 1))
  if [ $v = on ]; then opts=("${ON[@]}"); else opts=(--no-check); fi
  bench "ab_${i}_$v" --methods dense,evosparse,h2o --context 100000 --batch 4 "${opts[@]}"
done
bench qwen3_off --shape qwen3-8b --methods dense,evosparse,h2o --context 100000 --batch 3 --no-check
bench qwen3_on --shape qwen3-8b --methods dense,evosparse,h2o --context 100000 --batch 3 --no-check "${ON[@]}"

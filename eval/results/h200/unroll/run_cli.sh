#!/usr/bin/env bash
# `jsparse bench model --methods $METHODS --context 100000 --batch 4 --no-check` with the rolled and the fully
# unrolled layer scan (--unroll-layers), at --steps 64 and 16, in alternating processes (ORDER: tag:steps:u|r).
# Usage (GPU): OUT=... bash eval/results/h200/unroll/run_cli.sh
set -u
export PYTHONUNBUFFERED=1
M=${METHODS:-dense,streaming,kascade,evosparse}
for run in ${ORDER:-r64:64:r u64:64:u r64b:64:r u64b:64:u u16:16:u}; do
  IFS=: read -r tag steps kind <<< "$run"
  U=""; [ "$kind" = u ] && U="--unroll-layers"
  echo "### $tag"
  PYTHONPATH=. python3 -m jsparse.cli bench model --methods "$M" --context 100000 --batch 4 --steps "$steps" $U \
    --no-check --out "$OUT/cli_$tag.json" 2>&1 | grep "step_ms" | \
    sed -E "s/.*'method': '([a-z]+)'.*'step_ms': ([0-9.]+).*'floor_fraction': ([0-9.]+).*/\1 \2 \3/"
done

#!/usr/bin/env bash
# The per-layer fixed cost of a decode step, before and after (same machine, alternating processes): `jsparse bench
# model` at 100K, batch 4 for dense, Kascade, EvoSparse and StreamingLLM, with the code of this tree ("new", the
# method check first) and of the commit before the change ("old", a copy of its packages under $OLD, not committed);
# then the per-kernel profile of EvoSparse's step with the new code.
# Usage (GPU): OUT=... GIT_COMMIT=... OLD=<dir holding the old packages> bash eval/results/h200/fixed_cost/run.sh
set -u
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
ROOT=$(pwd)
M=${METHODS:-dense,kascade,evosparse,streaming}
bench() {  # $1 = tag, $2 = dir, $3... extra
  local tag=$1 dir=$2; shift 2
  echo "### $tag"
  (cd "$dir" && PYTHONPATH=. python3 -m jsparse.cli bench model --methods "$M" --context 100000 --batch 4 \
     --out "$OUT/bench_model_100k_b4_$tag.json" "$@" 2>&1 | grep -vE "^W[0-9]{4}|^I[0-9]{4}" | tail -12)
}
bench new "$ROOT"
bench old "$OLD" --no-check
bench new2 "$ROOT" --no-check
bench old2 "$OLD" --no-check
if [ -n "${PROFILE:-}" ]; then
  PYTHONPATH=. python3 -m jsparse.cli bench profile_decode_step --method evosparse --context 100000 --batch 4 --top 40 \
    --out "$OUT/profile_evosparse_100k_b4.json" 2>&1 | tail -5
fi

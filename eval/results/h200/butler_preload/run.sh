#!/usr/bin/env bash
# TokenButler's step before and after the predicted-logits kernel loaded its rows' bounds before the key tile (this tree):
# `jsparse bench model --methods dense,butler` at 100K, batch 4 with this tree ("new", checked after its timing) and
# with the packages of 70d4e9f ("old", a copy under $OLD, not committed), alternating processes on one machine; then
# the per-kernel profile of the new step.
# Usage (GPU): OUT=... GIT_COMMIT=... OLD=<dir holding the old packages> bash eval/results/h200/butler_preload/run.sh
set -u
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
ROOT=$(pwd)
M=${METHODS:-dense,butler}
bench() {  # $1 = tag, $2 = dir, $3... extra
  local tag=$1 dir=$2; shift 2
  echo "### $tag"
  (cd "$dir" && PYTHONPATH=. python3 -m jsparse.cli bench model --methods "$M" --context 100000 --batch 4 \
     --out "$OUT/bench_model_100k_b4_$tag.json" "$@" 2>&1 | grep -vE "^W[0-9]{4}|^I[0-9]{4}|UserWarning|warnings.warn" | tail -6)
}
bench new "$ROOT"
bench old "$OLD" --no-check
bench new2 "$ROOT" --no-check
bench old2 "$OLD" --no-check
PYTHONPATH=. python3 -m jsparse.cli bench profile_decode_step --method butler --context 100000 --batch 4 --steps 2 \
  --top 30 --out "/tmp/profile_butler_100k_b4.json" 2>&1 | grep -vE "^W[0-9]{4}|^I[0-9]{4}" | tail -34
cp /tmp/profile_butler_100k_b4.json "$OUT/"

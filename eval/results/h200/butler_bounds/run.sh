#!/usr/bin/env bash
# TokenButler's step with this tree ("new", checked after its timing) and with the packages of the commit before a
# change ("old", a copy under $OLD, not committed): `jsparse bench model --methods dense,butler` at 100K, batch 4,
# alternating processes on one machine; then the per-kernel profile of the new step. NOTES.md names the three runs:
# the bounded logits (old 253a8c0, new b93ae31: this folder), the band pass (old b93ae31, new 70d4e9f: ../butler_band/)
# the bounds preload (old 70d4e9f, new f1f6e69: ../butler_preload/) and the whole-row compaction (old f30204f, new
# 28be99d: ../butler_rows/; PROFILE=0 skips the profile).
# Usage (GPU): OUT=... OLD=<dir holding the old packages> bash eval/results/h200/butler_bounds/run.sh
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
[ "${PROFILE:-1}" = 0 ] && exit 0
PYTHONPATH=. python3 -m jsparse.cli bench profile_decode_step --method butler --context 100000 --batch 4 --steps 2 \
  --top 30 --out "/tmp/profile_butler_100k_b4.json" 2>&1 | grep -vE "^W[0-9]{4}|^I[0-9]{4}" | tail -34
cp /tmp/profile_butler_100k_b4.json "$OUT/"

#!/usr/bin/env bash
# The top-k sample-size default (82ec11f) end to end: `jsparse bench model` at 100K, batch 4 on the methods that
# select with topk_select (Kascade's anchors, the oracle, H2O, TokenButler), alternating this tree ("new") with the
# packages of e5c43db, the code before the change ("old", carried as .old/before_sample). The first run is checked
# against each method's masked reference; the others pass --no-check. A run starts only while the call has time left.
# Usage (GPU): OUT=... GIT_COMMIT=<sha> bash eval/results/h200/topk_sample_e2e/run.sh
set -u
export PYTHONUNBUFFERED=1
ROOT=$PWD
START=$SECONDS
M=dense,kascade,oracle,h2o,butler
one() {  # $1 = tag (new|old), $2 = JSON name, then extra options
  local tag=$1 name=$2; shift 2
  local dir=$ROOT; [ "$tag" = old ] && dir=$ROOT/.old/before_sample
  local t0=$SECONDS
  (cd "$dir" && PYTHONPATH=. python3 -m jsparse.cli bench model --methods $M --context 100000 --batch 4 \
      --out "$OUT/$name.json" "$@" 2>&1 | grep -vE "^W[0-9]{4}|^I[0-9]{4}|^\{'phase'" | tail -8)
  echo "== $name: $((SECONDS - t0)) s"
  LAST=$((SECONDS - t0))
}
one new new_a
for name in old_a new_b old_b new_c old_c; do
  if [ $((SECONDS - START + LAST)) -gt 560 ]; then echo "== stop before $name: $((SECONDS - START)) s used"; break; fi
  one "${name%_*}" "$name" --no-check
done

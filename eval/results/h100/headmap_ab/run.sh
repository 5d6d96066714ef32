#!/usr/bin/env bash
# Kascade's reuse layers hand every layer's head map to the gathered decode kernel, which reads the layer's row
# itself (issue 24): before, each reuse layer sliced and clipped its row in an XLA kernel of its own (27 launches a
# step at 100K, batch 4, `../overhead_budget/profile_kascade_100k_b4.json`, loop_clamp_fusion*).
#   1. the stacked-decode GPU tests (compiled kernels against their references; the head-map cases included);
#   2. A/B in one warm machine: this tree ("new") and the old one ("old", `git archive $OLD models jsparse
#      pallas_kernels train eval ':(exclude)eval/results'`, carried as OLD_TGZ), alternating, one `jsparse bench
#      model --no-check --methods dense,kascade --context 100000 --batch 4` process each, dense first;
#   3. `jsparse bench profile_decode_step` of the new Kascade step (with its compiled HLO beside it).
# Usage (GPU): GIT_COMMIT=<new sha> OLD=<old sha> OLD_TGZ=... OUT=... [ORDER="new old new old"] bash run.sh
set -u
export PYTHONUNBUFFERED=1
here=$PWD
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE \
  tests/test_stacked_decode.py > "$OUT/gpu_tests.txt" 2>&1
tail -3 "$OUT/gpu_tests.txt"
mkdir -p /tmp/old && tar -xzf "$OLD_TGZ" -C /tmp/old
i=0
for v in ${ORDER:-new old new old}; do
  i=$((i + 1))
  if [ "$v" = new ]; then dir=$here; commit=$GIT_COMMIT; else dir=/tmp/old; commit=$OLD; fi
  (cd "$dir" && GIT_COMMIT=$commit PYTHONPATH=. timeout 150 python3 -m jsparse.cli bench model --no-check \
     --methods dense,kascade --context 100000 --batch 4 --out "$OUT/ab_${i}_$v.json" > "$OUT/ab_${i}_$v.log" 2>&1
   grep -E "^\| (dense|kascade) " "$OUT/ab_${i}_$v.log" || grep -vE "^W[0-9]{4}|^I[0-9]{4}" "$OUT/ab_${i}_$v.log" | tail -8)
  echo "-- $i $v done $(date +%T)"
done
PYTHONPATH=. timeout 150 python3 -m jsparse.cli bench profile_decode_step --method kascade --context 100000 \
  --batch 4 --steps 4 --top 120 --out "$OUT/profile_kascade_100k_b4.json" > "$OUT/profile.log" 2>&1
tail -3 "$OUT/profile.log"

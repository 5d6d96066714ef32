#!/usr/bin/env bash
# The dense decode's kernel with no XLA prep before its launch (ab5c37b, issue 24), on an H100.
#   PART=ab: the changed kernels' tests on the GPU (tests/test_stacked_decode.py, tests/test_head_probs.py: the
#     default implementation runs the compiled kernels there), then an A/B on one warm machine of this tree ("new")
#     and the one before ("old", `git archive $OLD models jsparse pallas_kernels train eval ':(exclude)eval/results'`,
#     carried as OLD_TGZ), alternating new, old, new, old: `jsparse bench model --no-check --methods dense
#     --context 100000 --batch 1,4`.
# Usage (GPU): GIT_COMMIT=<new sha> OLD=<old sha> OLD_TGZ=... OUT=... PART=ab bash run.sh
set -u
export PYTHONUNBUFFERED=1
here=$PWD
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -q -p no:cacheprovider -x -rfE \
  tests/test_stacked_decode.py tests/test_head_probs.py > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests rc=$? $(tail -1 "$OUT/gpu_tests.txt")"
mkdir -p /tmp/old && tar -xzf "$OLD_TGZ" -C /tmp/old
i=0
for v in new old new old; do
  i=$((i + 1))
  if [ "$v" = new ]; then dir=$here; commit=$GIT_COMMIT; else dir=/tmp/old; commit=$OLD; fi
  (cd "$dir" && GIT_COMMIT=$commit PYTHONPATH=. timeout 150 python3 -m jsparse.cli bench model --no-check \
     --methods dense --context 100000 --batch 1,4 --out "$OUT/ab_${i}_$v.json" > /tmp/ab_$i.log 2>&1
   grep -E "^\| dense " /tmp/ab_$i.log || grep -vE "^W[0-9]{4}|^I[0-9]{4}" /tmp/ab_$i.log | tail -8)
  echo "-- $i $v done $(date +%T)"
done

#!/usr/bin/env bash
# Is the 2-3% slower StreamingLLM / H2O / Kascade-at-32K of this run (9b6340c) against ../e2e_1205/ (32174d8) the
# code or the machine? Both trees on one warm H100, alternating new, old, new, old: one `jsparse bench model` process
# each (dense first, --no-check), 32K and 100K at batch 4. The old tree is `git archive 32174d8 models jsparse
# pallas_kernels train eval ':(exclude)eval/results'` carried as OLD_TGZ and unpacked to /tmp/old.
# Usage (GPU): [ORDER="new old new old"] OUT=... OLD_TGZ=.xfer/old_32174d8.tgz NEW=9b6340c \
#   bash eval/results/h100/e2e_noremat/ab.sh
# It writes $OUT/ab_<i>_<new|old>.json; the committed ones are renamed ab_<machine><i>_... (NOTES.md).
set -u
export PYTHONUNBUFFERED=1
unset XLA_PYTHON_CLIENT_PREALLOCATE
mkdir -p /tmp/old "$OUT" && tar -xzf "$OLD_TGZ" -C /tmp/old
here=$PWD
i=0
for v in ${ORDER:-new old new old}; do
  i=$((i + 1))
  if [ "$v" = new ]; then dir=$here; commit=$NEW; else dir=/tmp/old; commit=32174d8; fi
  (cd "$dir" && GIT_COMMIT=$commit PYTHONPATH=. python3 -m jsparse.cli bench model --no-check \
     --methods dense,streaming,h2o,kascade --context 32768,100000 --batch 4 --out "$OUT/ab_${i}_$v.json" \
     > "$OUT/ab_${i}_$v.log" 2>&1; grep -E "^\| (dense|streaming|h2o|kascade) " "$OUT/ab_${i}_$v.log" \
     || grep -vE "^W[0-9]{4}|^I[0-9]{4}" "$OUT/ab_${i}_$v.log" | tail -20)
  echo "-- $i $v done $(date +%T)"
done

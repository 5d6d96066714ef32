#!/usr/bin/env bash
# EvoSparse's selection plan made once per step (block_scores.select_from_plan) and H2O's lengths (issue 24), on an
# H100.
#   PART=ab: A/B on one warm machine, this tree ("new") and the one before ("old", `git archive $OLD models jsparse
#     pallas_kernels train eval ':(exclude)eval/results'`, carried as OLD_TGZ), alternating new, old, new, old: `jsparse
#     bench model --no-check --methods dense,evosparse,h2o --context 100000 --batch 4`, dense first;
#   PART="a b c d": `../e2e/run.sh`'s parts (the README tables' runs).
# Usage (GPU): GIT_COMMIT=<new sha> OLD=<old sha> OLD_TGZ=... OUT=... PART=... bash run.sh
set -u
export PYTHONUNBUFFERED=1
here=$PWD
if [ "${PART:?PART=ab|a|b|c|d}" != ab ]; then
  for p in $PART; do echo "== part $p $(date +%T)"; PART=$p bash eval/results/h100/e2e/run.sh; done
  exit 0
fi
mkdir -p /tmp/old && tar -xzf "$OLD_TGZ" -C /tmp/old
i=0
for v in new old new old; do
  i=$((i + 1))
  if [ "$v" = new ]; then dir=$here; commit=$GIT_COMMIT; else dir=/tmp/old; commit=$OLD; fi
  (cd "$dir" && GIT_COMMIT=$commit PYTHONPATH=. timeout 200 python3 -m jsparse.cli bench model --no-check \
     --methods dense,evosparse,h2o --context 100000 --batch 4 --out "$OUT/ab_${i}_$v.json" > /tmp/ab_$i.log 2>&1
   grep -E "^\| (dense|evosparse|h2o) " /tmp/ab_$i.log || grep -vE "^W[0-9]{4}|^I[0-9]{4}" /tmp/ab_$i.log | tail -8)
  echo "-- $i $v done $(date +%T)"
done

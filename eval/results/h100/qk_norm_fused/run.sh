#!/usr/bin/env bash
# Qwen3's q/k norm before `rope_write` as one norm over every head (`kv_write.norm_heads`), issue 24, on an H100:
# A/B on one warm machine, this tree ("new") and the one before ("old", `git archive $OLD models jsparse
# pallas_kernels train eval ':(exclude)eval/results'`, carried as OLD_TGZ), alternating new, old, new, old: `jsparse
# bench model --no-check --shape qwen3-8b --methods dense,kascade,evosparse --context 100000 --batch 3`, dense first.
# Usage (GPU): GIT_COMMIT=<new sha> OLD=<old sha> OLD_TGZ=... OUT=... bash run.sh
set -u
export PYTHONUNBUFFERED=1
here=$PWD
mkdir -p /tmp/old && tar -xzf "$OLD_TGZ" -C /tmp/old
i=0
for v in ${ORDER:-new old new old}; do
  i=$((i + 1))
  if [ "$v" = new ]; then dir=$here; commit=$GIT_COMMIT; else dir=/tmp/old; commit=$OLD; fi
  (cd "$dir" && GIT_COMMIT=$commit PYTHONPATH=. timeout 200 python3 -m jsparse.cli bench model --no-check \
     --shape qwen3-8b --methods dense,kascade,evosparse --context 100000 --batch 3 --out "$OUT/ab_${i}_$v.json" \
     > /tmp/ab_$i.log 2>&1
   grep -E "^\| (dense|kascade|evosparse) " /tmp/ab_$i.log || grep -vE "^W[0-9]{4}|^I[0-9]{4}" /tmp/ab_$i.log | tail -8)
  echo "-- $i $v done $(date +%T)"
done

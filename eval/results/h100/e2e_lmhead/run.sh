#!/usr/bin/env bash
# Two changes to every method's decode step (issue 24), on an H100: the LM head of a single row as an 8-row GEMM
# (models.llama.lm_head_row_padding; batch 1) and Qwen3's q/k norm as an XLA fusion before `rope_write`'s kernel
# (Qwen3 only; it ran the XLA rotation and cache scatters).
#   PART=ab: A/B on one warm machine, this tree ("new") and the one before the changes ("old", `git archive $OLD models
#     jsparse pallas_kernels train eval ':(exclude)eval/results'`, carried as OLD_TGZ), alternating, `jsparse bench
#     model --no-check --methods dense,kascade,evosparse --context 100000` at batch 1 on Llama-3.1-8B shapes and at
#     batch 3 on Qwen3-8B's, one process each, dense first;
#   PART=a|b|d: `../e2e/run.sh`'s parts (the README tables' runs; c, the largest batches, has no single-row cell).
# Usage (GPU): GIT_COMMIT=<new sha> OLD=<old sha> OLD_TGZ=... OUT=... PART=... bash run.sh
set -u
export PYTHONUNBUFFERED=1
here=$PWD
if [ "${PART:?PART=ab|a|b|d}" != ab ]; then
  for p in $PART; do echo "== part $p $(date +%T)"; PART=$p bash eval/results/h100/e2e/run.sh; done
  exit 0
fi
mkdir -p /tmp/old && tar -xzf "$OLD_TGZ" -C /tmp/old
i=0
for v in new old new old; do
  i=$((i + 1))
  if [ "$v" = new ]; then dir=$here; commit=$GIT_COMMIT; else dir=/tmp/old; commit=$OLD; fi
  for sb in llama3-8b:1 qwen3-8b:3; do
    (cd "$dir" && GIT_COMMIT=$commit PYTHONPATH=. timeout 200 python3 -m jsparse.cli bench model --no-check \
       --shape ${sb%:*} --methods dense,kascade,evosparse --context 100000 --batch ${sb#*:} \
       --out "$OUT/ab_${i}_${v}_${sb%%-*}.json" > /tmp/ab_$i.log 2>&1
     grep -E "^\| (dense|kascade|evosparse) " /tmp/ab_$i.log || grep -vE "^W[0-9]{4}|^I[0-9]{4}" /tmp/ab_$i.log | tail -8)
  done
  echo "-- $i $v done $(date +%T)"
done

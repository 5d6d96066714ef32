#!/usr/bin/env bash
# On an H100: EvoSparse's grouped selection (the default) against one selection per layer
# (`--method-option evosparse.group_select=false`), `jsparse bench model` (16 timed steps, dense first in each
# process, --no-check: run.sh's check_b4.json checked the grouped step), alternating grouped, per layer, grouped at
# 100K, batch 2 and 4 (Llama-3.1-8B shapes), then per layer and grouped at 100K, batch 3 (Qwen3-8B shapes).
# Usage (GPU, repository root): GIT_COMMIT=<sha> OUT=<dir> bash eval/results/h100/evo_group/run_ab.sh
set -u
export PYTHONUNBUFFERED=1
bench() {  # $1 = JSON name, then bench model options
  local name=$1; shift
  PYTHONPATH=. timeout 140 python3 -m jsparse.cli bench model --no-check --methods dense,evosparse --context 100000 \
    --out "$OUT/$name.json" "$@" 2>&1 | grep -E "^\| (dense|evosparse)"
}
bench ab1_grouped --batch 2,4
bench ab2_per_layer --batch 2,4 --method-option evosparse.group_select=false
bench ab3_grouped --batch 2,4
bench ab4_qwen3_per_layer --shape qwen3-8b --batch 3 --method-option evosparse.group_select=false
bench ab5_qwen3_grouped --shape qwen3-8b --batch 3

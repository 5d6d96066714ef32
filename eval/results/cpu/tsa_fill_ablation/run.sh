#!/bin/bash
# TSA fill ablation on the bundled SmolLM2 (CPU, f32): 4 passkey prompts at depth 0.1 and 4 ppl windows at 4K,
# tau 0.005, the paper's per-query-head selection. Run from the repository root.
set -e
OUT=eval/results/cpu/tsa_fill_ablation
COMMON="--model smollm2 --tasks passkey,ppl --lengths 4096 --samples 4 --depths 0.1 --ppl-variants continuation --artifact tsa=artifacts/smollm2/tsa --no-progress"
jsparse eval $COMMON --methods dense,tsa --out $OUT/zeros
for v in "16 4" "32 4" "64 4" "128 4" "64 0"; do
  set -- $v
  jsparse eval $COMMON --methods tsa --method-option tsa.fill=local --method-option tsa.local_window=$1 \
    --method-option tsa.local_sinks=$2 --out $OUT/local_w$1_s$2
done

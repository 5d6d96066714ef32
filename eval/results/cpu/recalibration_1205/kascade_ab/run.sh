#!/usr/bin/env bash
# Kascade with the shipped artifact against the one recalibrated in ../kascade: passkey (corpus haystack) and decode
# perplexity, 20 prompts, budget 0.1, f32, on this project's 2-core CPU at cbb58e6. The shipped run was stopped
# after the 4K passkey (its 4K perplexity is the H100's, ../../../h100/fidelity_1205/); the recalibrated one ran 2K,
# with dense beside it (added by resuming the folder with --methods dense,kascade).
set -euo pipefail
cd "$(dirname "$0")/../../../../.."
D=eval/results/cpu/recalibration_1205/kascade_ab
.venv/bin/jsparse eval --model smollm2 --dtype float32 --methods kascade --tasks passkey,ppl --ppl-variants decode \
  --lengths 2048,4096 --budget 0.1 --samples 20 --haystack corpus --artifact kascade=jsparse/shipped/smollm2/kascade \
  --out $D/shipped --no-progress --no-report
.venv/bin/jsparse eval --model smollm2 --dtype float32 --methods dense,kascade --tasks passkey,ppl --ppl-variants decode \
  --lengths 2048 --budget 0.1 --samples 20 --haystack corpus --artifact kascade=eval/results/cpu/recalibration_1205/kascade \
  --out $D/recalibrated --no-progress --no-report

#!/usr/bin/env bash
# The bundled model's calibrations redone on the corpus as tokenized since 2026-12-04 (whole text), with the options
# recorded in each shipped artifact's meta (jsparse/shipped/smollm2/*/artifact.json), on this project's 2-core CPU,
# f32, at cbb58e6; evosparse also with 8 windows (48 needle prompts) beside the shipped 2 (12 prompts). Then
# compare.py (-> compare.json) and the Kascade A/B of kascade_ab/ (its run.sh).
set -euo pipefail
cd "$(dirname "$0")/../../../.."
D=eval/results/cpu/recalibration_1205
J=.venv/bin/jsparse
$J calibrate kascade --model smollm2 --dtype float32 --out $D/kascade --samples 8 --length 2048 --target-share 0.95 \
  --reuse-scale 2.0 --budget 0.1 --tile 32
$J calibrate tsa --model smollm2 --dtype float32 --out $D/tsa --samples 4 --length 2048 --delta 0.5
for s in 2 8; do
  $J calibrate evosparse --model smollm2 --dtype float32 --out $D/evosparse_samples$s --samples $s --length 2048 \
    --depths 0.1,0.5,0.9 --needle-words 8 --min-recall 0.5
done
$J calibrate sts --model smollm2 --dtype float32 --draft smollm2:layers=0-14 --k 128,256,512,1024 \
  --corpus eval/data/alice_in_wonderland.txt --samples 8 --length 2048 --out $D/sts
.venv/bin/python $D/compare.py

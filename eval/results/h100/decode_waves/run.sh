#!/usr/bin/env bash
# On an H100 (round 1, run 2026-12-07 at 667230d; NOTES.md): the gathered decodes' split heuristic against the waves
# of programs an H100 holds at once. `../decode_stages/stages.py` with KNOBS of `DecodeConfig.target_programs`:
# EvoSparse and H2O on Qwen3-8B shapes at 100K, batch 3, then EvoSparse on Llama-3.1-8B at 100K, batch 4; dense first
# and again last in each case. Usage (GPU, repository root): GIT_COMMIT=<sha> OUT=<dir> bash eval/results/h100/decode_waves/run.sh
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=.
filter() { grep -vE "^W[0-9]{4}|^I[0-9]{4}|^\{'phase'"; }
SHAPE=qwen3-8b CASES="evosparse:3" KNOBS="target_programs=264 target_programs=768" timeout 200 \
  python3 eval/results/h100/decode_stages/stages.py 2>&1 | filter
SHAPE=qwen3-8b CASES="h2o:3" KNOBS="target_programs=264" timeout 150 \
  python3 eval/results/h100/decode_stages/stages.py 2>&1 | filter
SHAPE=llama3-8b CASES="evosparse:4" KNOBS="target_programs=264" timeout 150 \
  python3 eval/results/h100/decode_stages/stages.py 2>&1 | filter

#!/usr/bin/env bash
# Round 2 on an H100 (NOTES.md): after EvoSparse's decode took target_programs=264 (3228c3e), the other cells the
# split target reaches. `../decode_stages/stages.py`, dense first and again last in each case:
# the oracle (the stacked gathered decode, which Kascade's reuse layers and StreamingLLM share) at 100K, batch 1 on
# Llama-3.1-8B and Qwen3-8B shapes with target_programs 264 and 1024 against the library's 512; EvoSparse at 32K,
# batch 7 and 100K, batch 1 with the old 512 against the library's new 264; Kascade at 100K, batch 4 with 264.
# Usage (GPU, repository root): GIT_COMMIT=<sha> OUT=<dir> bash eval/results/h100/decode_waves/run2.sh
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=.
filter() { grep -vE "^W[0-9]{4}|^I[0-9]{4}|^\{'phase'"; }
S=eval/results/h100/decode_stages/stages.py
CASES="oracle:1" KNOBS="target_programs=264 target_programs=1024" timeout 150 python3 $S 2>&1 | filter
SHAPE=qwen3-8b CASES="oracle:1" KNOBS="target_programs=264 target_programs=1024" timeout 150 python3 $S 2>&1 | filter
CONTEXT=32768 CASES="evosparse:7" KNOBS="target_programs=512" timeout 120 python3 $S 2>&1 | filter
CASES="evosparse:1" KNOBS="target_programs=512" timeout 120 python3 $S 2>&1 | filter
CASES="kascade:4" KNOBS="target_programs=264" timeout 120 python3 $S 2>&1 | filter

#!/usr/bin/env bash
# EvoSparse's gathered decode with larger or smaller key tiles, each at the split target of one wave on an H100 (issue
# 24: EvoSparse at 100K, batch 4 0.843 and Qwen3-8B batch 3 0.836 in ../e2e_1207c/, the bar 0.85). The library's
# DecodeConfig is block_k 64 at 264 programs (two 96 KB programs an SM, ../decode_waves/); block_k 128 holds 192 KB of
# stages (one program an SM: 132), block_k 32 48 KB (four: 528). ../decode_stages/stages.py, dense first and last.
# Usage (GPU, repository root): GIT_COMMIT=<sha> OUT=<dir> bash eval/results/h100/evo_tiles/run.sh
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=.
filter() { grep -vE "^W[0-9]{4}|^I[0-9]{4}|^\{'phase'"; }
S=eval/results/h100/decode_stages/stages.py
K="block_k=128,target_programs=132 block_k=32,target_programs=528 block_k=128,target_programs=132,num_warps=8"
CASES="evosparse:4" KNOBS="$K" timeout 200 python3 $S 2>&1 | filter
SHAPE=qwen3-8b CASES="evosparse:3" KNOBS="$K" timeout 200 python3 $S 2>&1 | filter

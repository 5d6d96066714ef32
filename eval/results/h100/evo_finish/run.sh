#!/usr/bin/env bash
# On an H100: EvoSparse's one-launch finish against the two launches (probe.py): the GPU check, then step times of
# Llama-3.1-8B shapes at 100K batch 4 and 32K batch 7, and Qwen3-8B shapes at 100K batch 3.
# Usage (GPU, repository root): GIT_COMMIT=<sha> OUT=<dir> bash eval/results/h100/evo_finish/run.sh
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=.
f() { grep -v "^W0000\|^I0000\|^{'phase'\|DeprecationWarning\|return rule"; }
SHAPE=llama3-8b CASES="${LLAMA_CASES:-4:100000 7:32768}" timeout 330 python3 eval/results/h100/evo_finish/probe.py 2>&1 | f
SHAPE=qwen3-8b CHECK=0 CASES="${QWEN_CASES:-3:100000}" timeout 200 python3 eval/results/h100/evo_finish/probe.py 2>&1 | f

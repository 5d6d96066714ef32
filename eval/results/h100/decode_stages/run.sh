#!/usr/bin/env bash
# On an H100: the gathered decodes' pipelining depth (stages.py), EvoSparse and H2O at 100K, batch 4 and the oracle
# at 100K, batch 1. Usage (GPU, repository root): GIT_COMMIT=<sha> OUT=<dir> bash eval/results/h100/decode_stages/run.sh
set -u
export PYTHONUNBUFFERED=1
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 CASES="${CASES:-evosparse:4 oracle:1 h2o:4}" STAGES="${STAGES:-2 1}" PYTHONPATH=. \
  timeout 560 \
  python3 eval/results/h100/decode_stages/stages.py 2>&1 | grep -vE "^W[0-9]{4}|^I[0-9]{4}|^\{'phase'"

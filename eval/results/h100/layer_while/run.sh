#!/usr/bin/env bash
# On an H100: the decode's layer runs as while loops against the library's scans (probe.py), alternating in one process.
# Usage (GPU, repository root): GIT_COMMIT=<sha> OUT=<dir> bash eval/results/h100/layer_while/run.sh
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=.
timeout 560 python3 eval/results/h100/layer_while/probe.py 2>&1 | grep -v "^W0000\|^I0000" | tail -30

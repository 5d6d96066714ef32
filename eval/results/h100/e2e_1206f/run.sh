#!/usr/bin/env bash
# On an H100, one call: issue 24's acceptance parts a-d (`../e2e/run.sh` through `../e2e_plan/run.sh`) at 258fce4 (the
# "sample" top-k's paired and prefix-started searches and its band-taken-whole fix, ca6765d). Then, on this machine,
# the README's tables: `jsparse bench model_table eval/results/h100/e2e_1206f/e2e_[abc].json --link-root . --bar 0.85`
# (and `e2e_qwen3.json`), written to table.md and table_qwen3.md.
# Usage (GPU, repository root): GIT_COMMIT=<sha> OUT=<dir> bash eval/results/h100/e2e_1206f/run.sh
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
PART="${PART:-a b c d}" bash eval/results/h100/e2e_plan/run.sh

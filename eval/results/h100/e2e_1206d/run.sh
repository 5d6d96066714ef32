#!/usr/bin/env bash
# Issue 24's acceptance parts a-d on an H100 (`../e2e/run.sh` through `../e2e_plan/run.sh`) with EvoSparse's grouped
# selection (`../evo_group/`). Usage (GPU, repository root): GIT_COMMIT=<sha> OUT=<dir> bash eval/results/h100/e2e_1206d/run.sh
set -u
export PYTHONUNBUFFERED=1
PART="${PART:-a b c d}" bash eval/results/h100/e2e_plan/run.sh

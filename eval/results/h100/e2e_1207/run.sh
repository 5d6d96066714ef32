#!/usr/bin/env bash
# On an H100, one call: issue 24's acceptance parts a-d (`../e2e/run.sh` through `../e2e_plan/run.sh`) at the commit the
# JSONs name (the decode layer scan unrolled by default on GPUs, e3ea9eb; H2O's one launch a layer, `mass_at_end`,
# and its byte model counting the entry sums, since 150ab7f). Then, on this machine, the README's tables:
# `jsparse bench model_table eval/results/h100/e2e_1207/e2e_[abc].json --link-root . --bar 0.85` (and
# `e2e_qwen3.json`), written to table.md and table_qwen3.md.
# Usage (GPU, repository root): GIT_COMMIT=<sha> OUT=<dir> bash eval/results/h100/e2e_1207/run.sh
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
PART="${PART:-a b c d}" bash eval/results/h100/e2e_plan/run.sh

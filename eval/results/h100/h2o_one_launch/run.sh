#!/usr/bin/env bash
# H2O's gathered decode in one launch a layer plus one launch a step for every layer's mass (`H2O.mass_at_end`, issue
# 24) against the two launches a layer (`--method-option h2o.mass_at_end=false`), on an H100, one warm machine:
#   the changed kernels' and H2O's tests on the GPU (their summary in the output), then `jsparse bench model --methods dense,h2o`
#   alternating new, old, new, old at Llama-3.1-8B 100K batch 4 (the first with the masked-reference check), then
#   new, old at Llama 32K batch 7 and Qwen3-8B 100K batch 3.
# Usage (GPU): GIT_COMMIT=<sha> OUT=... bash run.sh
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -q -p no:cacheprovider -x -rfE \
  tests/test_block_scores.py tests/test_h2o_candidates.py > /tmp/gpu_tests.txt 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|Error" /tmp/gpu_tests.txt | tail -5
run() {  # name, shape, context, batch, variant, check
  local opt=(); [ "$5" = old ] && opt=(--method-option h2o.mass_at_end=false)
  local check=(--no-check); [ "$6" = check ] && check=()
  timeout 120 python3 -m jsparse.cli bench model "${check[@]}" "${opt[@]}" --shape "$2" --methods dense,h2o \
    --context "$3" --batch "$4" --out "$OUT/$1.json" > /tmp/$1.log 2>&1
  echo "-- $1 rc=$? $(date +%T)"; grep -E "^\| (dense|h2o) " /tmp/$1.log || tail -5 /tmp/$1.log
}
run l100_1_new llama3-8b 100000 4 new check
run l100_2_old llama3-8b 100000 4 old no
run l100_3_new llama3-8b 100000 4 new no
run l100_4_old llama3-8b 100000 4 old no
run l32_new llama3-8b 32768 7 new no
run l32_old llama3-8b 32768 7 old no
run q100_new qwen3-8b 100000 3 new no
run q100_old qwen3-8b 100000 3 old no

#!/usr/bin/env bash
# H2O's gathered decode in one launch a layer plus one launch a step for every layer's mass (`H2O.mass_at_end`) and the
# split plan without empty splits (`decode_split_plan`), issue 24, on an H100, one warm machine:
#   the changed kernels' and H2O's tests on the GPU, then `jsparse bench model --methods dense,h2o,evosparse` at
#   Llama-3.1-8B 100K batch 4 and Qwen3-8B 100K batch 3, this tree ("new", the first with the masked-reference
#   check) against 150ab7f ("old": `git archive 150ab7f models jsparse pallas_kernels train eval
#   ':(exclude)eval/results'`, carried as OLD_TGZ), and this tree with `--method-option h2o.mass_at_end=false`
#   ("two": the two launches a layer, the new split plan).
# Usage (GPU): GIT_COMMIT=<sha> OLD_TGZ=... OUT=... bash run.sh
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
here=$PWD
mkdir -p /tmp/old && tar -xzf "$OLD_TGZ" -C /tmp/old
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -q -p no:cacheprovider -x -rfE \
  tests/test_block_scores.py tests/test_h2o_candidates.py > /tmp/gpu_tests.txt 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|Error" /tmp/gpu_tests.txt | tail -5
run() {  # name, shape, context, batch, variant (new | old | two), check
  local dir=$here commit=$GIT_COMMIT opt=() check=(--no-check) methods=dense,h2o,evosparse
  [ "$5" = old ] && dir=/tmp/old && commit=150ab7f
  [ "$5" = two ] && opt=(--method-option h2o.mass_at_end=false) && methods=dense,h2o
  [ "$6" = check ] && check=()
  (cd "$dir" && GIT_COMMIT=$commit PYTHONPATH=. timeout 120 python3 -m jsparse.cli bench model "${check[@]}" \
     "${opt[@]}" --shape "$2" --methods $methods --context "$3" --batch "$4" --out "$OUT/$1.json" > /tmp/$1.log 2>&1)
  echo "-- $1 rc=$? $(date +%T)"; grep -E "^\| (dense|h2o|evosparse) " /tmp/$1.log || tail -5 /tmp/$1.log
}
run l100_new llama3-8b 100000 4 new check
run l100_old llama3-8b 100000 4 old no
run l100_two llama3-8b 100000 4 two no
run q100_new qwen3-8b 100000 3 new no
run q100_old qwen3-8b 100000 3 old no
run q100_two qwen3-8b 100000 3 two no
run l100_new2 llama3-8b 100000 4 new no

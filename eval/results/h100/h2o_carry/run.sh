#!/usr/bin/env bash
# H2O's gathered decode with carried candidates (b8b0e6e..45e42c4, issue 24) against the same tree ranking every
# score at every step (`--method-option h2o.carry=false`), on an H100, one warm machine:
#   the changed code's tests on the GPU (tests/test_h2o_candidates.py, tests/test_topk_select_gpu.py), then
#   `jsparse bench model --methods dense,h2o --context 100000 --batch 1,4` alternating carry, no carry, carry,
#   no carry (the first with the masked-reference check, the others --no-check), then Qwen3-8B at batch 1.
# Usage (GPU): GIT_COMMIT=<sha> OUT=... bash run.sh
set -u
export PYTHONUNBUFFERED=1
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 170 python3 -m pytest -q -p no:cacheprovider -x -rfE \
  tests/test_h2o_candidates.py tests/test_topk_select_gpu.py > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests rc=$? $(tail -1 "$OUT/gpu_tests.txt")"
i=0
for v in carry nocarry carry nocarry; do
  i=$((i + 1))
  opt=(); check=(--no-check)
  [ "$v" = nocarry ] && opt=(--method-option h2o.carry=false)
  [ $i = 1 ] && check=()
  timeout 110 python3 -m jsparse.cli bench model "${check[@]}" "${opt[@]}" --methods dense,h2o \
    --context 100000 --batch 1,4 --out "$OUT/ab_${i}_$v.json" > /tmp/ab_$i.log 2>&1
  echo "-- $i $v rc=$? $(date +%T)"; grep -E "^\| (dense|h2o) " /tmp/ab_$i.log || tail -5 /tmp/ab_$i.log
done
timeout 100 python3 -m jsparse.cli bench model --no-check --shape qwen3-8b --methods dense,h2o \
  --context 100000 --batch 1 --out "$OUT/qwen3_b1.json" > /tmp/q.log 2>&1
echo "-- qwen3 rc=$? $(date +%T)"; grep -E "^\| (dense|h2o) " /tmp/q.log || tail -5 /tmp/q.log

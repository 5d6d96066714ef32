#!/usr/bin/env bash
# Kascade's anchor pooling on a GPU (ran on an H200; no H100 was lent), issue 24: AnchorConfig.pool "xla"
# (the default: an XLA logsumexp of the scoring pass's split partials, then an XLA pooling fusion) against "triton"
# (`gpu._pool_kernel`, which merges the partials itself), at pool_block 2048 / 4 warps and 4096 / 8 warps, in the
# whole decode step at 100K, batch 4 (Kascade's 5 anchors and the oracle's 31 exact-top-k layers run this pass).
# Each variant is the tree with AnchorConfig's defaults edited (sed, in a copy under /tmp); one `jsparse bench
# model --no-check` process per variant, dense first in each, variants alternating.
#   PART=tests: the GPU kernel tests of the anchor, sparse-attention, stacked-decode and top-k kernels
#   PART=ab ORDER="xla t2048 t4096": the A/B runs, $OUT/ab_<i>_<variant>.json and .log
# Usage (GPU): GIT_COMMIT=<sha> OUT=... PART=tests|ab [START=n] bash eval/results/h200/pool_ab/run.sh
set -u
export PYTHONUNBUFFERED=1
here=$PWD
case "${PART:?PART=tests|ab}" in
  tests)
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 --dist loadfile \
      -rfE tests/test_kascade_anchor.py tests/test_anchor_attention.py tests/test_sparse_attention.py \
      tests/test_stacked_decode.py tests/test_topk_select_gpu.py > "$OUT/gpu_tests.txt" 2>&1
    tail -5 "$OUT/gpu_tests.txt" ;;
  ab)
    i=${START:-0}
    for v in ${ORDER:-xla t2048 t4096}; do
      i=$((i + 1)); dir=/tmp/pool_$v
      if [ ! -d "$dir" ]; then
        mkdir -p "$dir" && tar -C "$here" --exclude=./.git --exclude=./eval/results -cf - . | tar -C "$dir" -xf -
        f=$dir/pallas_kernels/anchor_attention/gpu.py
        case $v in
          xla) ;;
          t2048) sed -i 's/    pool: str = "xla"/    pool: str = "triton"/' "$f" ;;
          t4096) sed -i 's/    pool: str = "xla"/    pool: str = "triton"/; s/    pool_block: int = 2048/    pool_block: int = 4096/;
                        s/    pool_warps: int = 4/    pool_warps: int = 8/' "$f" ;;
        esac
        grep -nE '^    pool(_block|_warps)?: ' "$f" | tr '\n' ' '; echo
      fi
      (cd "$dir" && PYTHONPATH=. python3 -m jsparse.cli bench model --no-check --methods dense,kascade,oracle \
         --context 100000 --batch 4 --out "$OUT/ab_${i}_$v.json" > "$OUT/ab_${i}_$v.log" 2>&1
       grep -E "^\| (dense|kascade|oracle) " "$OUT/ab_${i}_$v.log" || grep -vE "^W[0-9]{4}|^I[0-9]{4}" "$OUT/ab_${i}_$v.log" | tail -20)
      echo "-- $i $v done $(date +%T)"
    done ;;
  *) echo "PART=$PART: expected tests or ab" >&2; exit 2 ;;
esac

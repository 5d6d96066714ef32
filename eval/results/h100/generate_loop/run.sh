#!/usr/bin/env bash
# Does `jsparse generate`'s decode loop run at the speed `jsparse bench model` times? The bench's fori_loop has a
# known trip count; generate's loop (models.generate.decode_loop) is a while_loop that stops on the tokens, so on a
# GPU each iteration may copy its predicate to the host and wait. On a GPU (results: NOTES.md):
#   a, b, c, d: issue 24's parts at this commit (eval/results/h100/e2e/run.sh; the masked-reference checks on)
#      -> $OUT/e2e/e2e_{a,b,c,qwen3}.json
#   loops: dense, Kascade, EvoSparse at 32K and 100K, batch 4, in the variants of ORDER (alternating processes):
#      fori (the bench's loop), generate (generate's loop), whilecb (generate's loop with while loops and
#      conditionals in XLA's CUDA graphs: --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL)
# Usage: OUT=... GIT_COMMIT=<sha> [PARTS="a loops"] [ORDER="generate fori whilecb"] [START=n] bash run.sh
set -eu
# The allocator must preallocate (JAX's default; the bench sets its fraction to 0.95): grown on demand, it leaves
# the 32K rows' regions in pieces and the 100K, batch 4 cache halves (24.4 GiB each) do not fit on an H100.
export PYTHONUNBUFFERED=1 PYTHONPATH=.
unset XLA_PYTHON_CLIENT_PREALLOCATE
mkdir -p "$OUT"
for part in ${PARTS:-a loops}; do
  [ "$part" = loops ] || { OUT=$OUT/e2e PART=$part bash eval/results/h100/e2e/run.sh; continue; }
  i=${START:-0}  # the first JSON's number - 1 (a later call continues the numbering)
  for v in ${ORDER:-generate fori whilecb}; do
    i=$((i + 1))
    loop=$v; flags=()
    [ "$v" = whilecb ] && { loop=generate; flags=("--xla-flags=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"); }
    # --xla-flags appends to the library's defaults, which `jsparse` sets first (eval.bench.model.merged_xla_flags)
    python3 -m jsparse.cli bench model --methods dense,kascade,evosparse --context 32768,100000 --batch 4 \
      --loop "$loop" --no-check "${flags[@]}" --out "$OUT/loop_${i}_$v.json" 2>&1 \
      | grep -vE "^W[0-9]{4}|^I[0-9]{4}|^\{'phase'" | tail -9
  done
done

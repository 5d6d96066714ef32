#!/usr/bin/env bash
# XLA flags of the decode step's small kernels, each in its own process: `jsparse bench model --methods $METHODS
# --no-check` at 100K, batch 4, alternating, XLA_FLAGS naming the variant (on top of the flags the library sets):
#   default: none;
#   nobl:    --xla_gpu_experimental_enable_fusion_block_level_rewriter=false (XLA's own emitters for the fusions
#            it otherwise gives to its Triton block-level emitter, such as the RMSNorms);
#   off:     --xla_gpu_enable_command_buffer= (no CUDA graphs);
#   while:   command buffers that also capture the layer scan's while loop (a list replacing XLA's default);
#   while2:  XLA's default command types plus WHILE and CONDITIONAL ("+" adds to the default list);
#   whiledsf: as while2, plus DYNAMIC_SLICE_FUSION;
#   unrollcb: as while2, with the loop of known trip count unrolled into the graph
#            (--xla_gpu_command_buffer_unroll_loops=true).
# Then (PROFILE=1, the default) the kernel sequence of StreamingLLM's step under the variants of $PROFILE_VARIANTS,
# with $PROFILE_FLAGS added (e.g. --xla_enable_command_buffers_during_profiling=true: keep the CUDA graphs while
# tracing; XLA otherwise runs them op by op under a profiler).
# Usage (GPU): OUT=... bash eval/results/h200/cmdbuf/run.sh
set -u
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
M=${METHODS:-dense,streaming}
declare -A FLAGS=(
  [default]=""
  [nobl]="--xla_gpu_experimental_enable_fusion_block_level_rewriter=false"
  [off]="--xla_gpu_enable_command_buffer="
  [while]="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL"
  [while2]="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
  [whiledsf]="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL,+DYNAMIC_SLICE_FUSION"
  [unrollcb]="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL --xla_gpu_command_buffer_unroll_loops=true"
)
for tag in ${ORDER:-default nobl off default nobl off}; do
  n=$(ls "$OUT" | grep -c "^bench_${tag}_" || true)
  echo "### $tag (${FLAGS[$tag]:-XLA default})"
  XLA_FLAGS="${FLAGS[$tag]}" PYTHONPATH=. python3 -m jsparse.cli bench model --methods "$M" --context 100000 \
    --batch 4 --no-check --out "$OUT/bench_${tag}_$n.json" 2>&1 | grep -E "step_ms|Error|error" | \
    sed -E "s/.*'method': '([a-z]+)'.*'step_ms': ([0-9.]+).*/\1 \2/" | tail -4
done
[ "${PROFILE:-1}" = 1 ] || exit 0
for v in ${PROFILE_VARIANTS:-nobl}; do
  XLA_FLAGS="${FLAGS[$v]} ${PROFILE_FLAGS:-}" PYTHONPATH=. python3 -m jsparse.cli bench profile_decode_step --method streaming \
    --context 100000 --batch 4 --steps 2 --top 30 --trace-dir "/tmp/tr_$v" --out "$OUT/prof_streaming_$v.json" 2>&1 \
    | grep -vE "^W[0-9]{4}|^I[0-9]{4}" | tail -3
  PYTHONPATH=. python3 eval/results/h200/layer_seq/seq.py "/tmp/tr_$v" "$OUT/seq_streaming_$v.json"
done

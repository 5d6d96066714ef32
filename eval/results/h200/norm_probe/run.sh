#!/usr/bin/env bash
# Two probes of the ~3 us idle at each layer boundary of the decode step (../graph_profile/), timed with
# `jsparse bench model --methods dense,streaming,kascade --no-check` at 100K, batch 4, in alternating processes:
#   probe:    this tree with norm_probe.patch applied: every layer reads layer 0's small leaves (norm weights),
#             so no per-layer slice kernel is left (wrong weights: timing only);
#   head:     the packages of the commit before the patch, under $OLD;
#   unrollcb: head's packages with the layer loop unrolled into a CUDA graph
#             (--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL --xla_gpu_command_buffer_unroll_loops=true).
# Then the kernel sequence of the probe's StreamingLLM step (CUDA graphs kept while tracing).
# Usage (GPU): OUT=... OLD=<dir> bash eval/results/h200/norm_probe/run.sh
set -u
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
ROOT=$(pwd)
UNROLL="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL --xla_gpu_command_buffer_unroll_loops=true"
bench() {  # $1 tag, $2 dir, $3 XLA_FLAGS
  echo "### $1"
  (cd "$2" && XLA_FLAGS="$3" PYTHONPATH=. python3 -m jsparse.cli bench model --methods dense,streaming,kascade \
     --context 100000 --batch 4 --no-check --out "$OUT/bench_$1.json" 2>&1 | grep "step_ms" | \
     sed -E "s/.*'method': '([a-z]+)'.*'step_ms': ([0-9.]+).*/\1 \2/")
}
bench probe "$ROOT" ""
bench head "$OLD" ""
bench unrollcb "$OLD" "$UNROLL"
bench probe2 "$ROOT" ""
bench head2 "$OLD" ""
bench unrollcb2 "$OLD" "$UNROLL"
XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true PYTHONPATH=. python3 -m jsparse.cli bench \
  profile_decode_step --method streaming --context 100000 --batch 4 --steps 2 --trace-dir /tmp/tr_probe \
  --out /tmp/prof_probe.json 2>&1 | tail -1
PYTHONPATH=. python3 eval/results/h200/layer_seq/seq.py /tmp/tr_probe "$OUT/seq_streaming_probe.json"

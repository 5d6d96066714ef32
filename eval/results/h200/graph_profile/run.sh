#!/usr/bin/env bash
# Does the profiler see the decode step that `jsparse bench model` times? XLA runs command buffers (CUDA graphs)
# op by op while a profiler is active unless --xla_enable_command_buffers_during_profiling=true, so the earlier
# traces (../layer_seq/, ../carry_row/, ../cmdbuf/) may show launch gaps the timed step does not have.
# Profiles StreamingLLM and Kascade at 100K, batch 4 in both modes ("op": XLA's default under a profiler; "graph":
# command buffers kept), times dense, StreamingLLM and Kascade in the graph run's process, and writes each trace's
# kernel sequence (../layer_seq/seq.py).  Usage (GPU): OUT=... bash eval/results/h200/graph_profile/run.sh
set -u
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
mkdir -p /tmp/gp
for v in ${MODES:-graph op}; do
  F=""; [ "$v" = graph ] && F="--xla_enable_command_buffers_during_profiling=true"
  for m in ${PROFILE_METHODS:-streaming kascade}; do
    T=""; [ "$v" = graph ] && [ "$m" = streaming ] && T="--time ${TIME_METHODS:-dense,streaming,kascade}"
    echo "### $m, $v"
    XLA_FLAGS="$F" PYTHONPATH=. python3 -m jsparse.cli bench profile_decode_step --method "$m" --context 100000 \
      --batch 4 --steps 2 --top 30 $T --trace-dir "/tmp/gp/tr_${v}_$m" --out "/tmp/gp/prof_${m}_$v.json" 2>&1 \
      | grep -vE "^W[0-9]{4}|^I[0-9]{4}" | tail -${TAIL:-6}
    cp "/tmp/gp/prof_${m}_$v.json" "$OUT/"
    PYTHONPATH=. python3 eval/results/h200/layer_seq/seq.py "/tmp/gp/tr_${v}_$m" "$OUT/seq_${m}_$v.json"
  done
done

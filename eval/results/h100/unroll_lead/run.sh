#!/usr/bin/env bash
# On an H100, one call: is the unrolled layer scan's lead-in (about 2 ms before the first layer of every call,
# ../../h200/unroll/NOTES.md) the CUDA graph's update, and do XLA's command-buffer flags remove it? EvoSparse and
# dense at 100K, batch 4, 16 steps a call (the README's bench), rolled and unrolled, each in its own process with
# XLA_FLAGS adding: nothing, VA remapping (xla_gpu_enable_command_buffer_va_remapping), the exclusive lock
# (xla_gpu_require_exclusive_lock), both.
# Usage (GPU, repository root): GIT_COMMIT=<sha> OUT=<dir> bash eval/results/h100/unroll_lead/run.sh
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
VA=--xla_gpu_enable_command_buffer_va_remapping=true
LOCK=--xla_gpu_require_exclusive_lock=true
run() {  # name, unroll flag ("" or --unroll-layers), XLA_FLAGS
  XLA_FLAGS="$3" timeout 300 python3 -m jsparse bench model --methods dense,evosparse --context 100000 --batch 4 \
    --no-check $2 ${EXTRA:-} --out "$OUT/$1.json" > "$OUT/$1.log" 2>&1
  echo "$1 rc=$? $(python3 -c "import json,sys; d=json.load(open('$OUT/$1.json')); print(' '.join(f\"{r['method']} {r['step_ms']:.3f} ({r.get('floor_fraction', 1):.3f})\" for r in d['rows'] if 'step_ms' in r))" 2>/dev/null)"
}
for v in ${VARIANTS:-u_va u u_lock r u_va_lock r_va_lock}; do
  case $v in
    r) run r "" "" ;; u) run u --unroll-layers "" ;; u_va) run u_va --unroll-layers "$VA" ;;
    u_lock) run u_lock --unroll-layers "$LOCK" ;; u_va_lock) run u_va_lock --unroll-layers "$VA $LOCK" ;;
    r_va_lock) run r_va_lock "" "$VA $LOCK" ;;
  esac
done

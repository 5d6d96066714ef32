#!/usr/bin/env bash
# On an H100, one call: does XLA's programmatic dependent launch (a kernel's start overlapping the previous kernel's
# tail; openxla/xla#38544) shorten the gathered decodes' steps, whose gap to the bytes floor is a fixed cost a launch
# (../gather_tune/NOTES.md)? The CPU venv's jaxlib 0.11.2 knows two DebugOptions fields, xla_gpu_enable_pdl and
# xla_gpu_enable_pdl_launch (`strings libjax_common.so`); their defaults are not exposed to Python, so each run sets
# both: unset, both false, both true, unset again. Dense, EvoSparse and H2O at 100K, batch 4 (Llama-3.1-8B shapes,
# the README's bench, 16 steps a call, layer scan unrolled), each in its own process.
# Usage (GPU, repository root): GIT_COMMIT=<sha> OUT=<dir> bash eval/results/h100/pdl/run.sh
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
run() {  # name, XLA_FLAGS
  XLA_FLAGS="$2" timeout 200 python3 -m jsparse bench model --methods ${METHODS:-dense,evosparse,h2o} --context 100000 \
    --batch 4 --no-check --out "$OUT/$1.json" > "$OUT/$1.log" 2>&1
  echo "$1 rc=$? $(date +%T) $(python3 -c "import json,sys; d=json.load(open('$OUT/$1.json')); print(' '.join(f\"{r['method']} {r['step_ms']:.3f} ({r.get('floor_fraction', 1):.3f})\" for r in d['rows'] if 'step_ms' in r))" 2>/dev/null)"
  grep -E "^F[0-9]{4}|Error" "$OUT/$1.log" | head -3
}
for v in ${VARIANTS:-base off on base2}; do
  case $v in
    base|base2) run $v "" ;;
    off) run $v "--xla_gpu_enable_pdl=false --xla_gpu_enable_pdl_launch=false" ;;
    on) run $v "--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true" ;;
  esac
done

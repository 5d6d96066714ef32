#!/usr/bin/env bash
# Programmatic dependent launch (PDL) in this jaxlib's XLA: which flags it has, and, for each boolean flag named
# *pdl*, `jsparse bench model` at 100K, batch 4 with it on and off (alternating processes, one machine).
# Usage (GPU): OUT=... GIT_COMMIT=... bash eval/results/h200/pdl/run.sh
set -u
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
M=${METHODS:-dense,kascade,streaming}
SP=$(python3 -c "import jaxlib, os; print(os.path.dirname(os.path.dirname(jaxlib.__file__)))")
strings $(find "$SP/jax_plugins" "$SP/jaxlib" -name "*.so") | grep -E "^xla_gpu_[a-z0-9_]+$" | sort -u > "$OUT/xla_gpu_flags.txt"
echo "flags: $(wc -l < "$OUT/xla_gpu_flags.txt")"; grep -iE "pdl|programmatic|command_buffer|graph" "$OUT/xla_gpu_flags.txt"
for flag in $(grep -i pdl "$OUT/xla_gpu_flags.txt" | head -2); do
  for v in true false true false; do
    echo "### $flag=$v"
    XLA_FLAGS="--$flag=$v" PYTHONPATH=. python3 -m jsparse.cli bench model --methods "$M" --context 100000 --batch 4 \
      --no-check --out "$OUT/bench_model_100k_b4_${flag}_${v}_$RANDOM.json" 2>&1 | grep -E "^\| (dense|kascade|streaming|evosparse|h2o)"
  done
done

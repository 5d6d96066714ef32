#!/usr/bin/env bash
# Garbage cache rows (past `lengths`, maybe NaN) are never read (tests/test_garbage_rows.py): the kernels changed for
# it checked compiled on the GPU (their test files), then issue 24's part a to see that no decode step got slower
# (Kascade's dense layer 0 now loads V masked). Usage (GPU): OUT=... GIT_COMMIT=<sha> bash eval/results/h200/garbage_rows/run.sh
set -uo pipefail
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/env.txt"
timeout "${LIMIT:-330}" python3 -m pytest -p no:cacheprovider -rfE -q -n 8 --dist loadfile \
  tests/test_garbage_rows.py tests/test_sparse_attention.py tests/test_anchor_attention.py tests/test_stacked_decode.py \
  > "$OUT/kernel_tests.txt" 2>&1
echo "kernel tests rc=$?"; tail -4 "$OUT/kernel_tests.txt"
mkdir -p "$OUT/e2e"
OUT=$OUT/e2e PART=a bash eval/results/h100/e2e/run.sh

#!/usr/bin/env bash
# 9f3df24 on a GPU: the in-kernel entry checks of the Triton gathers (an index entry past 2^31 / block_size is no
# block). 1. The sparse-attention test files, whose new tests also call the default implementation (the compiled
# kernels on a GPU host). 2. Does the gather's extra check cost time? The new and old (770879c, `git archive ...
# models jsparse pallas_kernels train eval ':(exclude)eval/results'`, carried as OLD_TGZ) trees alternate as
# `jsparse bench model --no-check` processes of dense and EvoSparse (blocks of 16 tokens: the branch that changed)
# at 100K, batch 4.
# Usage (GPU): OUT=... OLD_TGZ=.xfer/old_770879c.tgz NEW=9f3df24 bash eval/results/h100/int32_entries/run.sh
set -u
export PYTHONUNBUFFERED=1
unset XLA_PYTHON_CLIENT_PREALLOCATE
mkdir -p /tmp/old "$OUT" && tar -xzf "$OLD_TGZ" -C /tmp/old
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" >> "$OUT/env.txt" 2>&1
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_sparse_attention.py tests/test_stacked_decode.py \
  --junitxml="$OUT/gpu_tests.xml" > "$OUT/gpu_tests.txt" 2>&1
tail -3 "$OUT/gpu_tests.txt"
here=$PWD
i=0
for v in ${ORDER:-new old new old}; do
  i=$((i + 1))
  if [ "$v" = new ]; then dir=$here; commit=$NEW; else dir=/tmp/old; commit=770879c; fi
  (cd "$dir" && GIT_COMMIT=$commit PYTHONPATH=. python3 -m jsparse.cli bench model --no-check \
     --methods dense,evosparse --context 100000 --batch 4 --out "$OUT/ab_${i}_$v.json" \
     > "$OUT/ab_${i}_$v.log" 2>&1; grep -E "^\| (dense|evosparse) " "$OUT/ab_${i}_$v.log" \
     || grep -vE "^W[0-9]{4}|^I[0-9]{4}" "$OUT/ab_${i}_$v.log" | tail -20)
  echo "-- $i $v done $(date +%T)"
done

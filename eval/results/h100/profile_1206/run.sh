#!/usr/bin/env bash
# Where each sparse method's decode step spends its time at 100K, batch 4 (issue 24's weakest cells), on an H100:
# `jsparse bench profile_decode_step` for H2O, Kascade, EvoSparse and the oracle (4 traced steps, the step
# `jsparse bench model` times), and the last H2O GPU test that ../h2o_carry/'s call ran out of time for.
# Usage (GPU): GIT_COMMIT=<sha> OUT=... bash run.sh
set -u
export PYTHONUNBUFFERED=1
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python3 -m pytest -q -p no:cacheprovider -x -rfE \
  "tests/test_h2o_candidates.py::test_carry_false_ranks_every_score_as_before" > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests rc=$? $(tail -1 "$OUT/gpu_tests.txt")"
for m in h2o kascade evosparse oracle; do
  timeout 120 python3 -m jsparse.cli bench profile_decode_step --method $m --context 100000 --batch 4 --steps 4 \
    --top 60 --out /tmp/prof/profile_$m.json > /tmp/prof_$m.log 2>&1
  echo "-- $m rc=$? $(date +%T)"; cp /tmp/prof/profile_$m.json "$OUT/" || tail -5 /tmp/prof_$m.log
done
# Second call (PART=hlo): the H2O and Kascade profiles again with their compiled HLO (gzipped), to look fusions up.

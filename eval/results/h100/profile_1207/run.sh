#!/usr/bin/env bash
# Where EvoSparse's and H2O's decode steps spend their time at 100K, batch 4 on an H100 now (../profile_1206/ was
# before EvoSparse's one-launch finish, the unrolled layer scan and the one-wave split target): `jsparse bench
# profile_decode_step` for EvoSparse, H2O and dense (4 traced steps, the step `jsparse bench model` times).
# Usage (GPU): GIT_COMMIT=<sha> OUT=... bash run.sh
set -u
export PYTHONUNBUFFERED=1
for m in ${METHODS:-evosparse h2o dense}; do
  timeout 150 python3 -m jsparse.cli bench profile_decode_step --method $m --context 100000 --batch 4 --steps 4 \
    --top 60 --out /tmp/prof/profile_$m.json > /tmp/prof_$m.log 2>&1
  echo "-- $m rc=$? $(date +%T)"; cp /tmp/prof/profile_$m.json "$OUT/" || tail -5 /tmp/prof_$m.log
done

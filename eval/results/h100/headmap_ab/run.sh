#!/usr/bin/env bash
# Small XLA kernels out of the decode step (issue 24; `../overhead_budget/profile_kascade_100k_b4.json` at 100K,
# batch 4 for the counts): Kascade's reuse layers hand every layer's head map to the gathered decode kernel, which
# reads the layer's row itself (each reuse layer sliced and clipped its row in a kernel of its own: 27 launches a
# step, loop_clamp_fusion*); rope_write wraps and clamps the layer index in-kernel (a scalar kernel in every layer of
# every method); the sampled top-k's first launch writes the band count's zeros (an XLA fill and copy per top-k: per
# anchor, per oracle layer); the anchor scoring pass gathers its queries and finds its positions and layer itself
# (three small kernels per anchor / oracle layer).
#   PART=ab: A/B in one warm machine: this tree ("new") and the old one ("old", `git archive $OLD models jsparse
#      pallas_kernels train eval ':(exclude)eval/results'`, carried as OLD_TGZ), alternating, one `jsparse bench
#      model --no-check --methods dense,kascade,evosparse,oracle --context 100000 --batch 4` process each, dense first,
#      then the new tree once more with the checks (each method's step against its masked reference on a small shape,
#      on the GPU: the changed kernels in the model's own step); runs past DEADLINE seconds are skipped;
#   PART=profile: the GPU tests of the changed kernels (compiled kernels against their references), then
#   `jsparse bench profile_decode_step` of the new Kascade and EvoSparse steps (each with its compiled
#   HLO beside it), to find the next per-layer kernels.
# Usage (GPU): GIT_COMMIT=<new sha> OLD=<old sha> OLD_TGZ=... OUT=... PART=ab|profile [ORDER=...] bash run.sh
set -u
export PYTHONUNBUFFERED=1
here=$PWD
if [ "${PART:?PART=ab|profile}" = profile ]; then
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE \
    tests/test_stacked_decode.py tests/test_kv_write.py tests/test_topk_select_gpu.py tests/test_anchor_attention.py \
    > "$OUT/gpu_tests.txt" 2>&1
  tail -3 "$OUT/gpu_tests.txt"
  for m in kascade evosparse; do
    PYTHONPATH=. timeout 200 python3 -m jsparse.cli bench profile_decode_step --method $m --context 100000 \
      --batch 4 --steps 4 --top 150 --out "$OUT/profile_${m}_100k_b4.json" > "$OUT/profile_$m.log" 2>&1
    tail -2 "$OUT/profile_$m.log"
  done
  exit 0
fi
mkdir -p /tmp/old && tar -xzf "$OLD_TGZ" -C /tmp/old
i=0
for v in ${ORDER:-new old new old newcheck}; do
  i=$((i + 1))
  check=--no-check
  if [ "$v" = newcheck ]; then check=; v=new; fi  # the masked-reference checks of every method, after its timing
  if [ "$v" = new ]; then dir=$here; commit=$GIT_COMMIT; else dir=/tmp/old; commit=$OLD; fi
  [ $SECONDS -gt ${DEADLINE:-480} ] && { echo "-- $i $v skipped: past ${DEADLINE:-480} s"; continue; }
  (cd "$dir" && GIT_COMMIT=$commit PYTHONPATH=. timeout 200 python3 -m jsparse.cli bench model $check \
     --methods dense,kascade,evosparse,oracle --context 100000 --batch 4 --out "$OUT/ab_${i}_$v.json" > "$OUT/ab_${i}_$v.log" 2>&1
   grep -E "^\| (dense|kascade|evosparse|oracle) " "$OUT/ab_${i}_$v.log" || grep -vE "^W[0-9]{4}|^I[0-9]{4}" "$OUT/ab_${i}_$v.log" | tail -8)
  echo "-- $i $v done $(date +%T)"
done
if [ $SECONDS -lt ${PROFILE_BY:-440} ]; then  # time left in the call: where the new Kascade step goes now
  PYTHONPATH=. timeout $((570 - SECONDS)) python3 -m jsparse.cli bench profile_decode_step --method kascade \
    --context 100000 --batch 4 --steps 4 --top 150 --out "$OUT/profile_kascade_100k_b4.json" > "$OUT/profile.log" 2>&1
  tail -2 "$OUT/profile.log"
fi

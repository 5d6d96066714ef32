"""XLA options of the model's compiled entry points (`model_jit`).

On GPU, GEMMs go to cuBLAS instead of XLA's Triton GEMM fusions, with dynamic-slice fusion on and XLA's dot merger
off (the flags `jsparse.xla_flags.GPU_XLA_FLAGS` sets for the `jsparse` command, here attached to the compiled
functions themselves, so a Python user needs no environment variable). The layer scan reads each layer's weights out
of the stacked params with a dynamic slice: cuBLAS reads that slice in place, while the Triton fusion first copies
the layer's weights, so every weight byte was read twice and written once more per forward; the dot merger would
concatenate each layer's q/k/v weight slices into a new array (`jsparse/xla_flags.py` has its measurement). Measured on the H100
(Llama-3.1-8B shapes, random bf16 weights, context 1K, batch 2; `eval/results/h100/sts_bench/weights_copy*.json`): one decode step
16.5 ms -> 8.9 ms (copies 9.7 ms -> 0.14 ms), the same in a jitted loop of 8 steps (16.0 -> 8.3 ms per step).
Other backends ignore the option. A user who jits `models.llama.prefill` / `decode` in their own function gets the
same effect with `model_jit` in place of `jax.jit`.
"""

from __future__ import annotations

import functools

import jax

MODEL_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_dynamic_slice_fusion": True,
                          "xla_gpu_dot_merger_threshold_mb": 0}

model_jit = functools.partial(jax.jit, compiler_options=MODEL_COMPILER_OPTIONS)

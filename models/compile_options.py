"""XLA options of the model's compiled entry points (`model_jit`).

On GPU, GEMMs go to cuBLAS instead of XLA's Triton GEMM fusions, with dynamic-slice fusion on, XLA's dot merger off
and its rematerialization pass off (the flags `jsparse.xla_flags.GPU_XLA_FLAGS` sets for the `jsparse` command, here
attached to the compiled functions themselves, so a Python user needs no environment variable). The layer scan reads
each layer's weights out of the stacked params with a dynamic slice: cuBLAS reads that slice in place, while the
Triton fusion first copies the layer's weights, so every weight byte was read twice and written once more per
forward; the dot merger would concatenate each layer's q/k/v weight slices into a new array (`jsparse/xla_flags.py`
has its measurement). Measured on the H100 (Llama-3.1-8B shapes, random bf16 weights, context 1K, batch 2;
`eval/results/h100/sts_bench/weights_copy*.json`): one decode step 16.5 ms -> 8.9 ms (copies 9.7 ms -> 0.14 ms), the
same in a jitted loop of 8 steps (16.0 -> 8.3 ms per step).

XLA's HLO rematerialization pass is off too. With the cache and weights filling the device it estimates the decode
loop's peak at twice what it holds (146.6 GiB against a 59.7 GiB limit on an 80 GB H100 at 100K, batch 4: the
donated cache counted more than once), cannot reach its limit ("Can't reduce memory use below ..."), and still
clones instructions into the layer loops: 17 extra q/k/v GEMMs in every Kascade step. Off, Kascade's step took 10.67
-> 10.22 ms and EvoSparse's 9.13 -> 8.82 ms, dense's unchanged at 23.34 ms (`eval/results/h100/remat/`); a program
that fits only through rematerialization would now run out of memory instead (none measured).

Other backends ignore the `xla_gpu_*` options; `xla_disable_hlo_passes` names a pass, so a TPU compile that runs a
pass of that name skips it too (not measured on a TPU). A user who jits `models.llama.prefill` / `decode` in their
own function gets the same effect with `model_jit` in place of `jax.jit`.
"""

from __future__ import annotations

import functools

import jax

MODEL_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_dynamic_slice_fusion": True,
                          "xla_gpu_dot_merger_threshold_mb": 0, "xla_disable_hlo_passes": "rematerialization"}

model_jit = functools.partial(jax.jit, compiler_options=MODEL_COMPILER_OPTIONS)

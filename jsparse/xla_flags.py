"""The XLA flags the `jsparse` command sets on GPUs, in one place that the command, the benchmarks and library
users can all import.

On GPUs, XLA's own Triton GEMM fusions decode 1.6x slower than cuBLAS, and only dynamic-slice fusion lets cuBLAS
read a layer's weights straight out of the stacked params inside the layer scan (measured on the H100:
Llama-3.1-8B decode at 32K, batch 1, 17.1 -> 9.5 ms/step; eval/results/h100/bench_decode_step.json). XLA's dot
merger would concatenate each layer's q/k/v weight slices into a new array at every layer of every step (1.0 ms
of a 100K batch-4 decode step; off: dense 26.5 -> 25.7 ms, EvoSparse 12.2 -> 11.2 ms, eval/results/h100/profile/
and bench_evosparse_flags.json), so it is off. XLA reads XLA_FLAGS when its backend starts: call
`set_xla_flags()` before the first JAX computation. The model's own compiled entry points (`models.generate`,
`models.speculative`, the eval's) carry the same options through `models.compile_options.model_jit`, whatever
XLA_FLAGS holds; the flags still matter for everything else compiled in the process.
"""

from __future__ import annotations

import os

from models.compile_options import MODEL_COMPILER_OPTIONS

GPU_XLA_FLAGS = tuple(f"--{k}={str(v).lower()}" for k, v in MODEL_COMPILER_OPTIONS.items())


def set_xla_flags() -> None:
    """Adds each of GPU_XLA_FLAGS to $XLA_FLAGS unless the variable already sets that flag (the user's value wins)."""
    flags = os.environ.get("XLA_FLAGS", "")
    extra = [f for f in GPU_XLA_FLAGS if f.split("=")[0] not in flags]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()

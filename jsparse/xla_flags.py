"""The XLA flags the `jsparse` command sets on GPUs, in one place that the command, the benchmarks and library
users can all import.

On GPUs, XLA's own Triton GEMM fusions decode 1.6x slower than cuBLAS, and only dynamic-slice fusion lets cuBLAS
read a layer's weights straight out of the stacked params inside the layer scan (measured on the H100:
Llama-3.1-8B decode at 32K, batch 1, 17.1 -> 9.5 ms/step; eval/results/h100/bench_decode_step.json). XLA's dot
merger would concatenate each layer's q/k/v weight slices into a new array at every layer of every step (1.0 ms
of a 100K batch-4 decode step; off: dense 26.5 -> 25.7 ms, EvoSparse 12.2 -> 11.2 ms, eval/results/h100/profile/
and bench_evosparse_flags.json), so it is off. XLA reads XLA_FLAGS when its backend starts: call
`set_xla_flags()` before the first JAX computation.
"""

from __future__ import annotations

import os

GPU_XLA_FLAGS = ("--xla_gpu_enable_triton_gemm=false", "--xla_gpu_enable_dynamic_slice_fusion=true",
                 "--xla_gpu_dot_merger_threshold_mb=0")


def set_xla_flags() -> None:
    """Adds each of GPU_XLA_FLAGS to $XLA_FLAGS unless the variable already sets that flag (the user's value wins)."""
    flags = os.environ.get("XLA_FLAGS", "")
    extra = [f for f in GPU_XLA_FLAGS if f.split("=")[0] not in flags]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()

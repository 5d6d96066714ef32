"""TokenButler's predicted logits: every predicted query against every predicted key of its head, in f32.

  predicted_logits(q: f32[..., Hk, G, T, d], k: f32 or bf16 [..., Hk, N, d]) -> f32[..., Hk, G, T, N]
      q . k^T / sqrt(d) per element: the product of each query row with each key row summed over d, then scaled
      (no masking: the caller masks what a query may not see).

One layer or a stack of layers alike (the leading axes are any); the keys are read once. On a GPU a Pallas Triton
kernel (gpu.py) computes it; elsewhere XLA does (reference.py). The kernel exists because XLA turns the product and
sum into a dot, whose autotuner allocates a copy of every operand at compile time: for TokenButler's keys of all
layers at 100K tokens, batch 4 (51 GB in f32) that copy did not fit beside them on an H200. Each output element is
computed by the same code whatever the leading shape, so one layer's logits equal its row of a stack's.
"""

from __future__ import annotations

import jax

from pallas_kernels.dispatch import GPU_OR_REFERENCE as IMPLEMENTATIONS, gpu_or_reference
from pallas_kernels.predicted_logits import reference

Array = jax.Array


def predicted_logits(q: Array, k: Array, *, implementation: str | None = None) -> Array:
    """q . k^T / sqrt(d) of every query row with every key row of its key head (module docstring).

    Args:
      q: f32[..., Hk, G, T, d] queries (G per key head, T tokens); k: f32 or bf16 [..., Hk, N, d] keys (leading
        axes as q's; upcast to f32 as they are read).
      implementation: None (on a GPU with d a power of two: "pallas_gpu"; else "reference"), or one of
        IMPLEMENTATIONS (never falls back).
    Returns:
      f32[..., Hk, G, T, N].
    """
    reference.check_args(q, k)
    from pallas_kernels.predicted_logits import gpu
    if gpu_or_reference(implementation, lambda: gpu.unsupported_reason(q)) == "pallas_gpu":
        return gpu.predicted_logits_gpu(q, k)
    return reference.predicted_logits_reference(q, k)


__all__ = ["IMPLEMENTATIONS", "predicted_logits"]

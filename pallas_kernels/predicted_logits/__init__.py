"""TokenButler's predicted logits: every predicted query against every predicted key of its head, in f32.

  predicted_logits(q: f32[..., Hk, G, T, d], k: f32 or bf16 [..., Hk, N, d], *, last=None, keep_first=0,
                   keep_from=None) -> f32[..., Hk, G, T, N]
      q . k^T / sqrt(d) per element: the product of each query row with each key row summed over d, then scaled;
      with `last`, -inf on the keys a row does not see and +inf on the visible keys it always keeps (its first
      keep_first keys and those from keep_from on), applied as the logits are written: TokenButler's top-k
      scores in one pass, where a mask after the op read and wrote every layer's logits once more.

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


def predicted_logits(q: Array, k: Array, *, last=None, keep_first: int = 0, keep_from=None,
                     implementation: str | None = None) -> Array:
    """q . k^T / sqrt(d) of every query row with every key row of its key head (module docstring).

    Args:
      q: f32[..., Hk, G, T, d] queries (G per key head, T tokens); k: f32 or bf16 [..., Hk, N, d] keys (leading
        axes as q's; upcast to f32 as they are read).
      last: None, or i32 broadcastable to q.shape[:-1] ([..., Hk, G, T]): each query row's last visible key;
        the logits of keys past it are -inf (a caller's visibility mask, applied as the logits are written).
      keep_first: keys n < keep_first that a row sees score +inf (attention sinks a top-k always keeps).
      keep_from: None, or i32 broadcastable as `last`: keys keep_from <= n <= last score +inf (a local window
        a top-k always keeps). keep_first and keep_from need `last`.
      implementation: None (on a GPU with d a power of two: "pallas_gpu"; else "reference"), or one of
        IMPLEMENTATIONS (never falls back).
    Returns:
      f32[..., Hk, G, T, N] (bounded as `reference.bound_logits` when `last` is given).
    """
    reference.check_args(q, k)
    from pallas_kernels.predicted_logits import gpu
    kw = dict(last=last, keep_first=keep_first, keep_from=keep_from)
    if gpu_or_reference(implementation, lambda: gpu.unsupported_reason(q)) == "pallas_gpu":
        return gpu.predicted_logits_gpu(q, k, **kw)
    return reference.predicted_logits_reference(q, k, **kw)


__all__ = ["IMPLEMENTATIONS", "predicted_logits"]

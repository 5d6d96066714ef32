"""A decode step's rotary embedding and cache write in one launch.

  rope_write(qkv, positions, inv_freq, cache_k, cache_v, layer, num_q_heads, num_kv_heads, q_norm=None,
             k_norm=None, eps=1e-6) -> (q [B, T, Hq, D], cache_k, cache_v)

qkv holds the token rows of a forward's fused q/k/v projection (the first B * T rows of [R, Hq + 2 Hkv, D]); each
token's q and k heads get the optional per-head RMSNorm and the rotation at its position, q is returned, and k and
v are written into layer `layer` of the stacked caches at the token's position (a position >= N is dropped), as
`models.llama`'s decode does with four XLA kernels per layer (reference.py). On a GPU a Pallas Triton kernel
(gpu.py) does it in place in one launch, without a q/k norm; elsewhere, with a q/k norm and under a mesh, the
reference runs.
"""

from __future__ import annotations

import jax

from pallas_kernels.dispatch import GPU_OR_REFERENCE as IMPLEMENTATIONS, gpu_or_reference
from pallas_kernels.kv_write import reference
from pallas_kernels.layers import check_layer
from pallas_kernels.sharding import active_mesh

Array = jax.Array


def rope_write(qkv: Array, positions: Array, inv_freq: Array, cache_k: Array, cache_v: Array, layer,
               num_q_heads: int, num_kv_heads: int, q_norm: Array | None = None, k_norm: Array | None = None,
               eps: float = 1e-6, *, implementation: str | None = None):
    """The module docstring's rope_write. implementation: None (on a GPU, without a mesh, when the kernel takes
    the shapes: "pallas_gpu"; else "reference") or one of IMPLEMENTATIONS (never falls back)."""
    args = (qkv, positions, inv_freq, cache_k, cache_v, layer, num_q_heads, num_kv_heads)
    reference.check_args(*args[:5], num_q_heads, num_kv_heads, q_norm, k_norm)
    check_layer(layer, cache_k.shape[0])
    from pallas_kernels.kv_write import gpu

    def unsupported():
        if active_mesh() is not None:
            return "under a mesh"
        if q_norm is not None:
            return "a q/k norm: the kernel takes none"
        return gpu.unsupported_reason(qkv, num_q_heads, num_kv_heads)
    if gpu_or_reference(implementation, unsupported) == "pallas_gpu":
        return gpu.rope_write_gpu(*args)
    return reference.rope_write_reference(*args, q_norm, k_norm, eps)


__all__ = ["IMPLEMENTATIONS", "rope_write"]

"""A decode step's rotary embedding and cache write in one launch.

  rope_write(qkv, positions, inv_freq, cache_k, cache_v, layer, num_q_heads, num_kv_heads, q_norm=None,
             k_norm=None, eps=1e-6) -> (q [B, T, Hq, D], cache_k, cache_v)

qkv holds the token rows of a forward's fused q/k/v projection (the first B * T rows of [R, Hq + 2 Hkv, D]); each
token's q and k heads get the optional per-head RMSNorm and the rotation at its position, q is returned, and k and
v are written into layer `layer` of the stacked caches at the token's position (a position >= N is dropped), as
`models.llama`'s decode does with four XLA kernels per layer (reference.py). On a GPU a Pallas Triton kernel
(gpu.py) does it in place in one launch; elsewhere and under a mesh the reference runs.

With a q/k norm (Qwen3's) on a GPU, an XLA fusion norms the q and k heads first (`norm_heads`: the reference's
`rms_norm`, rounded to qkv's dtype, as transformers' Qwen3 RMSNorm returns its input dtype) and the kernel rotates
and writes them: two launches instead of about nine XLA kernels a layer. XLA's compiled reference may instead keep
the normed heads in f32 into the rotation (its excess precision): the two then differ by the one rounding, about an
ulp of bf16 (eval/results/h200/fixed_cost/ found that difference when the kernel normed in-kernel).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
        return gpu.unsupported_reason(qkv, num_q_heads, num_kv_heads)
    if gpu_or_reference(implementation, unsupported) == "pallas_gpu":
        if q_norm is not None:  # normed in XLA, rotated and written by the kernel (module docstring)
            qkv = norm_heads(qkv, num_q_heads, num_kv_heads, q_norm, k_norm, eps)
        return gpu.rope_write_gpu(qkv, *args[1:])
    return reference.rope_write_reference(*args, q_norm, k_norm, eps)


def norm_heads(qkv: Array, num_q_heads: int, num_kv_heads: int, q_norm: Array, k_norm: Array, eps: float) -> Array:
    """qkv [R, Hq + 2 Hkv, D] with its q heads normed by q_norm and its k heads by k_norm (`reference.rms_norm` per
    head, in qkv's dtype: the same products in the same order); the v heads as they are.

    Written as one norm over every head (one row of weights per head, then the v heads put back), the pattern XLA's
    GPU compiler fuses into a single kernel, where two norms of slices and a concatenation were several. The rows of
    weights are chosen per head by a select, not built by a concatenation: XLA ran that concatenation as a kernel of
    its own in every layer (eval/results/h100/evo_finish/NOTES.md)."""
    hq, hkv = num_q_heads, num_kv_heads
    head = jnp.arange(qkv.shape[1])[:, None]
    w = jnp.where(head < hq, q_norm.astype(jnp.float32)[None, :],
                  jnp.where(head < hq + hkv, k_norm.astype(jnp.float32)[None, :], jnp.float32(1.0)))
    is_v = head >= hq + hkv
    return jnp.where(is_v, qkv, reference.rms_norm(qkv, w, eps))


__all__ = ["IMPLEMENTATIONS", "norm_heads", "rope_write"]

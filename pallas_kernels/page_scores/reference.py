"""The plain-jnp specification of `page_scores` (XLA compiles it; the CPU's and TPU's implementation)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.layers import layer_index

Array = jax.Array


def check_args(q: Array, kmin: Array, kmax: Array) -> None:
    """q: [B, Hkv, R, D]; kmin, kmax: [L, B, Hkv, P, D] alike."""
    if (q.ndim != 4 or kmin.ndim != 5 or kmin.shape != kmax.shape or kmin.shape[1:3] != q.shape[:2]
            or kmin.shape[-1] != q.shape[-1]):
        raise ValueError(f"q of shape {tuple(q.shape)}, kmin {tuple(kmin.shape)}, kmax {tuple(kmax.shape)}: expected "
                         "q [B, Hkv, R, D] and bounds [L, B, Hkv, P, D] with the same B, Hkv and D")


def page_scores_reference(q: Array, kmin: Array, kmax: Array, layer) -> Array:
    """f32[B, Hkv, R, P]: sum over d of max(q * kmax, q * kmin) in f32 over layer `layer` of the bounds."""
    check_args(q, kmin, kmax)
    L = kmin.shape[0]
    i = layer_index(layer, L)
    lo, hi = (jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False).astype(jnp.float32) for a in (kmin, kmax))
    qe = q.astype(jnp.float32)[:, :, :, None, :]  # [B, Hkv, R, 1, D]
    return jnp.sum(jnp.maximum(qe * hi[:, :, None], qe * lo[:, :, None]), axis=-1)

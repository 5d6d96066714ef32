"""The plain-jnp specification of `predicted_logits` (XLA compiles it; the CPU's and TPU's implementation)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

Array = jax.Array


def check_args(q: Array, k: Array) -> None:
    """q: [..., Hk, G, T, d] and k: [..., Hk, N, d] with the same leading axes, Hk and d."""
    if q.ndim < 4 or k.ndim != q.ndim - 1 or q.shape[:-3] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q of shape {tuple(q.shape)} and k of shape {tuple(k.shape)}: expected q [..., Hk, G, T, "
                         "d] and k [..., Hk, N, d] with the same leading axes, Hk and d")


def predicted_logits_reference(q: Array, k: Array) -> Array:
    """f32[..., Hk, G, T, N]: sum over d of q * k in f32, then / sqrt(d) (one fused reduction)."""
    check_args(q, k)
    d = q.shape[-1]
    prod = q.astype(jnp.float32)[..., :, None, :] * k.astype(jnp.float32)[..., :, None, None, :, :]
    return jnp.sum(prod, axis=-1) / math.sqrt(d)

"""The jnp reference of `rope_write` (and the rotary embedding and the RMSNorm the model computes, which it shares).

rope_write(qkv, positions, inv_freq, cache_k, cache_v, layer, num_q_heads, num_kv_heads, q_norm, k_norm, eps):
  qkv: [R, Hq + 2 Hkv, D] the rows of a decode forward's fused q/k/v projection (bias added), of which the first
  B * T are its tokens (row b * T + t; the rest padding); positions: i32[B, T]; inv_freq: f32[D / 2];
  cache_k / cache_v: [L, B, Hkv, N, D]; layer: i32[]; q_norm / k_norm: [D] or None (Qwen3's per-head RMSNorm,
  before the rotation). Returns (q [B, T, Hq, D] rotated, in qkv's dtype; cache_k and cache_v with each token's
  rotated k and its v written at [layer, b, :, positions[b, t]], a position outside [0, N) dropped).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.layers import layer_index

Array = jax.Array
F32 = jnp.float32


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    """RMSNorm computed in f32, returned in x's dtype."""
    xf = x.astype(F32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * weight.astype(F32)).astype(x.dtype)


def apply_rope(x: Array, positions: Array, inv_freq: Array) -> Array:
    """Rotary embedding, rotate-half convention (as transformers). x: [B, T, H, D]; positions: i32[B, T]."""
    freqs = positions.astype(F32)[..., None] * inv_freq  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    xf = x.astype(F32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def write_decode(cache: Array, layer, positions: Array, x: Array) -> Array:
    """Scatters x: [B, T, Hkv, D] into cache[layer, b, :, positions[b, t]] (cache: [L, B, Hkv, N, D]; a position
    outside [0, N) is dropped: a negative one would otherwise wrap to the end of the cache)."""
    b = jnp.arange(x.shape[0])[:, None]
    positions = jnp.where(positions < 0, cache.shape[3], positions)
    return cache.at[layer_index(layer, cache.shape[0]), b, :, positions].set(x.astype(cache.dtype), mode="drop")


def check_args(qkv: Array, positions: Array, inv_freq: Array, cache_k: Array, cache_v: Array, num_q_heads: int,
               num_kv_heads: int, q_norm: Array | None = None, k_norm: Array | None = None) -> None:
    if getattr(positions, "ndim", None) != 2 or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"positions {getattr(positions, 'shape', None)} {getattr(positions, 'dtype', type(positions))}: "
                         "expected an integer array [B, T]")
    if not jnp.issubdtype(qkv.dtype, jnp.floating):
        raise ValueError(f"qkv of dtype {qkv.dtype}: expected a floating dtype (the rotation is not an integer map)")
    B, T = positions.shape
    if qkv.ndim != 3 or qkv.shape[1] != num_q_heads + 2 * num_kv_heads or qkv.shape[0] < B * T:
        raise ValueError(f"qkv {qkv.shape}: expected [R >= B * T = {B * T}, Hq + 2 Hkv = "
                         f"{num_q_heads + 2 * num_kv_heads}, D]")
    D = qkv.shape[2]
    if cache_k.shape != cache_v.shape or cache_k.ndim != 5 or cache_k.shape[1:3] != (B, num_kv_heads) or \
            cache_k.shape[4] != D:
        raise ValueError(f"cache_k {cache_k.shape}, cache_v {cache_v.shape}: expected equal [L, B={B}, "
                         f"Hkv={num_kv_heads}, N, D={D}]")
    if inv_freq.shape != (D // 2,) or D % 2:
        raise ValueError(f"inv_freq {inv_freq.shape}: expected [D / 2] = [{D // 2}] for an even head_dim D={D}")
    for name, norm in (("q_norm", q_norm), ("k_norm", k_norm)):
        if norm is not None and norm.shape != (D,):
            raise ValueError(f"{name} {norm.shape}: expected [D] = [{D}], one weight per channel")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm: expected both (Qwen3's q/k norms) or neither")


def rope_write_reference(qkv: Array, positions: Array, inv_freq: Array, cache_k: Array, cache_v: Array, layer,
                         num_q_heads: int, num_kv_heads: int, q_norm: Array | None = None,
                         k_norm: Array | None = None, eps: float = 1e-6):
    """The module docstring's rope_write in jnp: what the model's decode computes without the kernel."""
    check_args(qkv, positions, inv_freq, cache_k, cache_v, num_q_heads, num_kv_heads, q_norm, k_norm)
    B, T = positions.shape
    x = qkv[:B * T].reshape(B, T, *qkv.shape[1:])
    hq, hkv = num_q_heads, num_kv_heads
    q, k, v = x[:, :, :hq], x[:, :, hq:hq + hkv], x[:, :, hq + hkv:]
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    return q, write_decode(cache_k, layer, positions, k), write_decode(cache_v, layer, positions, v)

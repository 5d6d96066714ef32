"""Dense attention through `jax.nn.dot_product_attention` (cuDNN on GPU, XLA elsewhere).

Two entry points, one per phase, both with the library's layouts:

  dense_prefill(q: [B, T, Hq, D], k, v: [B, T, Hkv, D]) -> [B, T, Hq, D]      causal, GQA
  dense_decode(q: [B, T, Hq, D], k, v: [B, Hkv, N, D], lengths: i32[B]) -> [B, T, Hq, D]

Decode reads the head-major cache without a transpose: a GQA group's G query heads (times the T new
tokens) become the query sequence of a single-head attention whose batch is B * Hkv, so the cache is only
reshaped ([B, Hkv, N, D] -> [B * Hkv, N, 1, D]), never copied, and each KV head is read once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _implementation(q: Array) -> str | None:
    # cuDNN's fused kernels need bf16/f16 on a GPU; everything else takes the XLA path.
    if jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    return "xla"


def dense_prefill(q: Array, k: Array, v: Array, *, implementation: str | None = None) -> Array:
    """Causal attention over a right-padded prompt (padding rows produce values nobody reads)."""
    impl = implementation or _implementation(q)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)


def dense_decode(q: Array, k: Array, v: Array, lengths: Array, *, implementation: str | None = None) -> Array:
    """Attention of the T newest tokens over a head-major cache.

    Args:
      q: [B, T, Hq, D] queries of the tokens at positions lengths - T .. lengths - 1.
      k, v: [B, Hkv, N, D] cache (the new tokens already written).
      lengths: i32[B] valid tokens per row.
    """
    B, T, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    # [B, T, Hkv, G, D] -> [B * Hkv, T * G, 1, D]: query index = t * G + g.
    qg = q.reshape(B, T, Hkv, G, D).transpose(0, 2, 1, 3, 4).reshape(B * Hkv, T * G, 1, D)
    kg = k.reshape(B * Hkv, N, 1, D)
    vg = v.reshape(B * Hkv, N, 1, D)
    kv_len = jnp.repeat(lengths.astype(jnp.int32), Hkv)
    if T == 1:
        impl = implementation or _implementation(q)
        out = jax.nn.dot_product_attention(qg, kg, vg, key_value_seq_lengths=kv_len, implementation=impl)
    else:
        # Query t sees keys < lengths - T + t + 1 (causal among the new tokens).
        t = jnp.arange(T * G) // G
        limit = kv_len[:, None] - T + t[None] + 1  # [B*Hkv, T*G]
        mask = jnp.arange(N)[None, None, :] < limit[:, :, None]
        out = jax.nn.dot_product_attention(qg, kg, vg, mask=mask[:, None], implementation="xla")
    return out.reshape(B, Hkv, T, G, D).transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, D)

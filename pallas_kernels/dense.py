"""Dense attention through `jax.nn.dot_product_attention` (cuDNN on GPU, XLA elsewhere).

Two entry points, one per phase, both with the library's layouts:

  dense_prefill(q: [B, T, Hq, D], k, v: [B, T, Hkv, D]) -> [B, T, Hq, D]      causal, GQA
  dense_decode(q: [B, T, Hq, D], k, v: [B, Hkv, N, D], lengths: i32[B]) -> [B, T, Hq, D]

and a sliding-window prefill with attention sinks (`local_prefill`, O(T * window) work: TSA's fill for the rows a
head dropped).

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


def local_prefill(q: Array, k: Array, v: Array, *, window: int, sinks: int = 0) -> Array:
    """Causal sliding-window attention with sinks: query i attends keys j <= i with i - j < window or j < sinks.

    Args:
      q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] (GQA: Hq a multiple of Hkv).
      window: the trailing keys each query sees, itself included (>= 1).
      sinks: the first keys every query sees as well (>= 0).
    Returns:
      [B, T, Hq, D] in q's dtype. The queries are cut into blocks of `window`; block c attends its own keys,
      block c - 1's and the sinks (window * (2 * window + sinks) scores per block instead of T per query), with
      f32 scores and softmax.
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window={window!r}: expected a positive integer number of keys")
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"sinks={sinks!r}: expected a non-negative integer number of keys")
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"q has {Hq} heads and k {Hkv}: expected a multiple")
    G, w = Hq // Hkv, window
    s = min(sinks, T)
    N = -(-T // w)
    Tp = N * w
    qb = jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, 0))).reshape(B, N, w, Hkv, G, D)

    def blocks(x):  # [B, T, Hkv, D] -> [B, N, s + 2w, Hkv, D]: sinks, the previous block, this block
        xp = jnp.pad(x, ((0, 0), (w, Tp - T), (0, 0), (0, 0)))
        prev = xp[:, :Tp].reshape(B, N, w, Hkv, D)
        cur = xp[:, w:].reshape(B, N, w, Hkv, D)
        sink = jnp.broadcast_to(x[:, None, :s], (B, N, s, Hkv, D))
        return jnp.concatenate([sink, prev, cur], axis=2)

    kb, vb = blocks(k), blocks(v)
    qpos = (jnp.arange(N) * w)[:, None] + jnp.arange(w)[None, :]  # [N, w]
    kpos = jnp.concatenate([jnp.broadcast_to(jnp.arange(s), (N, s)),
                            (jnp.arange(N) * w - w)[:, None] + jnp.arange(2 * w)[None, :]], axis=1)  # [N, s+2w]
    in_window = (kpos[:, None, :] >= s) & (qpos[:, :, None] - kpos[:, None, :] < w)
    is_sink = jnp.arange(s + 2 * w) < s
    visible = (kpos[:, None, :] <= qpos[:, :, None]) & (in_window | is_sink[None, None, :])  # [N, w, s+2w]
    scores = jnp.einsum("bnqhgd,bnkhd->bnhgqk", qb, kb, preferred_element_type=jnp.float32) / jnp.sqrt(
        jnp.float32(D))
    scores = jnp.where(visible[None, :, None, None], scores, -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bnhgqk,bnkhd->bnqhgd", p.astype(v.dtype), vb, preferred_element_type=jnp.float32)
    return out.reshape(B, Tp, Hq, D)[:, :T].astype(q.dtype)

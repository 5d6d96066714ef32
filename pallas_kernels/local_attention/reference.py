"""jnp implementations of causal sliding-window attention with attention sinks.

Query i attends key j iff j <= i and (i - j < window or j < sinks): the last `window` keys (itself included) and
the first `sinks` tokens. GQA: query head h reads KV head h // (Hq // Hkv).

  local_attention_reference  blocked, O(T * window) work: the XLA path (CPU, TPU) and the kernels' reference
  banded_mask                the bool[T, T] mask of the rule above (for a dense masked reference in tests)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def banded_mask(T: int, window: int, sinks: int) -> np.ndarray:
    """bool[T, T]: query i sees key j iff j <= i and (i - j < window or j < sinks)."""
    i = np.arange(T)
    return (i[None] <= i[:, None]) & ((i[:, None] - i[None] < window) | (i[None] < sinks))


def local_attention_reference(q: Array, k: Array, v: Array, *, window: int, sinks: int = 0,
                              scale: float | None = None) -> Array:
    """Sliding-window attention with sinks, in blocks of `window` queries.

    Block c attends its own keys, block c - 1's and the sinks (w * (2 * w + sinks) f32 scores per block of
    w = min(window, T) queries, rather than T per query). f32 inputs use HIGHEST matmul precision.

    Args:
      q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]; window >= 1; sinks >= 0; scale: default 1 / sqrt(D).
    Returns:
      [B, T, Hq, D] in q's dtype.
    """
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G, w = Hq // Hkv, min(window, T)  # a window of T or more sees every earlier key: blocks of T do
    s = min(sinks, T)
    scale = D ** -0.5 if scale is None else scale
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
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    scores = jnp.einsum("bnqhgd,bnkhd->bnhgqk", qb, kb, preferred_element_type=jnp.float32,
                        precision=precision) * scale
    scores = jnp.where(visible[None, :, None, None], scores, -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bnhgqk,bnkhd->bnqhgd", p.astype(v.dtype), vb, preferred_element_type=jnp.float32,
                     precision=precision)
    return out.reshape(B, Tp, Hq, D)[:, :T].astype(q.dtype)

"""Token Sparse Attention key scoring in plain jnp: the specification the kernels are tested against.

  scores[b, h, j] = avg_pool_j( (1 / W_eff) * sum_{i valid} softmax_j'(s[b, h, i, j'])[j] )

with `s[b, h, i, j] = scale * q[b, p_i, h] . k[b, j, h // G]` over keys `j <= p_i` (causal inside the
window, every earlier key outside it), `p_i = len - W + i` the window's query positions (see common.py),
`W_eff = min(W, len)` and the pooling of `common.avg_pool_keys`. This materialises the [B, Hq, W, T]
probabilities in f32, which is what the kernels exist to avoid; it is meant for tests and short CPU runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.tsa_scoring import common

Array = jax.Array


def tsa_mean_probs_reference(
    q: Array, k: Array, *, window: int = 128, lengths: Array | None = None, scale: float | None = None
) -> Array:
    """Mean softmax probability of every key over the window's queries, before pooling.

    Args:
      q: [B, T, Hq, D] queries after RoPE.
      k: [B, T, Hkv, D] keys after RoPE (query head h reads KV head h // (Hq // Hkv)).
      window: W, the number of trailing queries that score the keys.
      lengths: i32[B] valid tokens per (right-padded) row, or None for all T.
      scale: softmax scale (default 1 / sqrt(D)).

    Returns:
      f32[B, Hq, T]: mean probability per (query head, key); 0 for keys >= lengths.
    """
    B, T, _, _, D = common.check_inputs(q, k, lengths)
    window = common.check_window(window)
    scale = common.default_scale(D, scale)
    return _mean_probs(q, k, common.full_lengths(B, T, lengths), window=window, scale=scale)


@functools.partial(jax.jit, static_argnames=("window", "scale"))
def _mean_probs(q, k, lens, *, window, scale):
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    pos = common.window_positions(lens, window)  # [B, W]
    qw = common.gather_window_queries(q, lens, window)  # [B, W, Hq, D]
    qw = qw.reshape(B, window, Hkv, G, D).astype(jnp.float32)
    logits = jnp.einsum(
        "bwkgd,btkd->bkgwt", qw, k.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    ) * scale  # [B, Hkv, G, W, T]
    mask = jnp.arange(T, dtype=jnp.int32)[None, None, :] <= pos[:, :, None]  # [B, W, T]; invalid slots empty
    mask = mask[:, None, None]
    logits = jnp.where(mask, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    e = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    probs = e / jnp.where(denom > 0, denom, 1.0)
    w_eff = jnp.maximum(jnp.minimum(lens, window), 1).astype(jnp.float32)  # [B]
    mean = jnp.sum(probs, axis=3) / w_eff[:, None, None, None]  # [B, Hkv, G, T]
    return mean.reshape(B, Hq, T)


def tsa_scores_reference(
    q: Array,
    k: Array,
    *,
    window: int = 128,
    pool_kernel: int = 7,
    lengths: Array | None = None,
    scale: float | None = None,
) -> Array:
    """Pooled TSA key scores (the spec of `tsa_scores`).

    Args:
      q: [B, T, Hq, D] queries after RoPE.
      k: [B, T, Hkv, D] keys after RoPE.
      window: W (default 128).
      pool_kernel: odd average-pooling kernel over keys (default 7).
      lengths: i32[B] or None.
      scale: softmax scale (default 1 / sqrt(D)).

    Returns:
      f32[B, Hq, T] pooled scores; 0 for keys >= lengths.
    """
    pool_kernel = common.check_pool_kernel(pool_kernel)
    mean = tsa_mean_probs_reference(q, k, window=window, lengths=lengths, scale=scale)
    return common.avg_pool_keys(mean, pool_kernel, lengths)

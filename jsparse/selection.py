"""Shared selection machinery: budgets, exact pooled scores, top-k to the index contract.

Index contract (DESIGN.md): `int32[B, Hkv, T, K]`, ascending, padded with -1 at the end; T = 1 (or the number
of new tokens) in decode, one row per query tile in prefill.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

Array = jax.Array
NEG_INF = -jnp.inf


def check_budget(budget: float) -> float:
    """Budget as a fraction of the context: must lie in (0, 1]."""
    if not isinstance(budget, (int, float)) or not 0.0 < float(budget) <= 1.0:
        raise ValueError(f"budget={budget!r}: expected a fraction of the context in (0, 1]")
    return float(budget)


def check_positive_int(name: str, value, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r}: expected an integer >= {minimum}")
    return value


def budget_tokens(budget: float, n, min_tokens: int = 128):
    """k = min(max(ceil(budget * n), min_tokens), n) (Kascade's budget rule); works on ints and int arrays."""
    if isinstance(n, int):
        return min(max(math.ceil(budget * n), min_tokens), n)
    k = jnp.ceil(budget * n.astype(jnp.float32)).astype(jnp.int32)
    return jnp.minimum(jnp.maximum(k, min_tokens), n)


def decode_positions(lengths: Array, T: int) -> Array:
    """i32[B, T]: position of each of the T newest tokens (query t of row b sits at lengths[b] - T + t)."""
    return lengths[:, None] - T + jnp.arange(T, dtype=jnp.int32)[None]


def pooled_probs(q: Array, k_cache: Array, positions: Array) -> Array:
    """Exact post-softmax attention weights summed over each GQA group.

    Args:
      q: [B, T, Hq, D]; k_cache: [B, Hkv, N, D]; positions: i32[B, T] (query t sees keys <= positions[b, t]).
    Returns:
      f32[B, Hkv, T, N] (each row sums to G over the visible keys, 0 elsewhere).
    """
    B, T, Hq, D = q.shape
    Hkv, N = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    qg = q.reshape(B, T, Hkv, G, D)
    logits = jnp.einsum("btkgd,bknd->bkgtn", qg, k_cache, preferred_element_type=jnp.float32) / math.sqrt(D)
    visible = jnp.arange(N)[None, None, :] <= positions[:, :, None]  # [B, T, N]
    logits = jnp.where(visible[:, None, None], logits, NEG_INF)
    return jax.nn.softmax(logits, axis=-1).sum(axis=2)


def prefill_tile_probs(q: Array, k: Array, tile: int) -> Array:
    """Causal post-softmax weights pooled over the GQA group and over each query tile.

    Args:
      q: [B, T, Hq, D]; k: [B, T, Hkv, D]; tile: query rows per tile (T is padded up to a multiple).
    Returns:
      f32[B, Hkv, ceil(T / tile), T].
    """
    B, T, Hq, D = q.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    probs = pooled_probs(q, jnp.swapaxes(k, 1, 2), positions)  # [B, Hkv, T, T]
    n_tiles = -(-T // tile)
    probs = jnp.pad(probs, ((0, 0), (0, 0), (0, n_tiles * tile - T), (0, 0)))
    return probs.reshape(B, probs.shape[1], n_tiles, tile, T).sum(axis=3)


def topk_indices(scores: Array, k_dyn: Array, K: int) -> Array:
    """Top-k key positions per row, in the index contract.

    Args:
      scores: f32[..., N] (keys that may not be chosen must be -inf).
      k_dyn: i32[...] how many to keep per row (<= K); K: static width.
    Returns:
      int32[..., K]: the chosen positions ascending, then -1 padding (also for -inf picks).
    """
    K = min(K, scores.shape[-1])
    vals, idx = jax.lax.top_k(scores, K)
    rank = jnp.arange(K, dtype=jnp.int32)
    keep = (rank < k_dyn[..., None]) & (vals > NEG_INF)
    big = jnp.iinfo(jnp.int32).max
    idx = jnp.sort(jnp.where(keep, idx, big), axis=-1)
    return jnp.where(idx == big, -1, idx).astype(jnp.int32)


def tile_starts(T: int, tile: int) -> Array:
    """i32[ceil(T / tile)]: first query position of every tile."""
    return jnp.arange(-(-T // tile), dtype=jnp.int32) * tile


def before_tile_scores(scores: Array, tile: int) -> Array:
    """Masks f32[B, H, nT, N] scores to the keys strictly before each tile (the kernel adds the diagonal tile)."""
    n_tiles, N = scores.shape[2], scores.shape[3]
    before = jnp.arange(N)[None, :] < (jnp.arange(n_tiles) * tile)[:, None]
    return jnp.where(before, scores, NEG_INF)


def topk_sparsity(budget: float, positions, min_tokens: int = 128) -> float:
    """Mean fraction of visible keys a top-k rule skips over query positions (0-based)."""
    import numpy as np

    n = np.asarray(positions, np.int64) + 1
    k = np.minimum(np.maximum(np.ceil(budget * n), min_tokens), n)
    return float(np.mean(1.0 - k / n))


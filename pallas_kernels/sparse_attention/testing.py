"""Random inputs that follow the index contract, for tests and benchmarks of the sparse-attention ops."""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp

Array = jax.Array


def random_decode_indices(rng: np.random.Generator, lengths, num_heads: int, T: int, K: int, *,
                          block_size: int = 1, fill: float = 0.8, out_of_range: bool = True) -> np.ndarray:
    """Random unique ascending block indices for decode, -1 padded at the end.

    Args:
      rng: numpy Generator.
      lengths: int[B] valid tokens per row.
      num_heads: Hkv.
      T: new tokens per row.
      K: index entries per row.
      block_size: tokens per entry.
      fill: fraction of the K entries that are real (the rest is -1 padding).
      out_of_range: also allow blocks after the query position (they must be ignored by the op).

    Returns:
      int32[B, Hkv, T, K].
    """
    lengths = np.asarray(lengths)
    B = lengths.shape[0]
    out = np.full((B, num_heads, T, K), -1, np.int32)
    for b in range(B):
        for t in range(T):
            pos = int(lengths[b]) - T + t
            hi = pos // block_size + 1 + (2 if out_of_range else 0)
            for h in range(num_heads):
                n = min(hi, max(1, int(round(K * fill))))
                out[b, h, t, :n] = np.sort(rng.choice(hi, size=n, replace=False))
    return out


def random_prefill_indices(rng: np.random.Generator, T: int, num_heads: int, B: int, K: int, *, tile: int,
                           block_size: int = 1, fill: float = 0.8) -> np.ndarray:
    """Random unique ascending block indices per query tile, -1 padded; some entries lie at or after the tile
    start (the op must ignore them).

    Returns:
      int32[B, Hkv, ceil(T/tile), K].
    """
    nt = -(-T // tile)
    nblocks = -(-T // block_size)
    out = np.full((B, num_heads, nt, K), -1, np.int32)
    for b in range(B):
        for h in range(num_heads):
            for i in range(nt):
                hi = min(nblocks, (i * tile) // block_size + 2)
                n = min(hi, max(1, int(round(K * fill))))
                out[b, h, i, :n] = np.sort(rng.choice(hi, size=n, replace=False))
    return out


def strided_indices(key: Array, limit: Array, count: int, K: int) -> Array:
    """Fast unique ascending random indices on device: jittered stratified samples of [0, limit).

    Entry j is floor(j * s) + r_j with s = limit / count and 0 <= r_j < floor(s), so entries are strictly
    ascending and below `limit` when s >= 1. Entries j >= count are -1.

    Args:
      key: PRNG key.
      limit: int32[...] exclusive upper bound per row (blocks available).
      count: int32[...] or int, real entries per row (<= limit).
      K: entries per row.

    Returns:
      int32[..., K].
    """
    limit = jnp.asarray(limit, jnp.int32)
    count = jnp.broadcast_to(jnp.asarray(count, jnp.int32), limit.shape)
    count = jnp.minimum(count, limit)
    s = limit.astype(jnp.float32) / jnp.maximum(count, 1).astype(jnp.float32)
    j = jnp.arange(K, dtype=jnp.float32)
    base = jnp.floor(j * s[..., None]).astype(jnp.int32)
    width = jnp.maximum(jnp.floor(s), 1.0)[..., None]
    r = jnp.floor(jax.random.uniform(key, (*limit.shape, K)) * width).astype(jnp.int32)
    idx = jnp.minimum(base + r, limit[..., None] - 1)
    return jnp.where(jnp.arange(K) < count[..., None], idx, -1).astype(jnp.int32)

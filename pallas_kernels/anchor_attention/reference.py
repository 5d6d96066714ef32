"""Plain-jnp reference of the anchor decode layer: the specification every implementation matches.

  anchor_decode_reference(q: [B, T, Hq, D], k, v: [B, Hkv, N, D], lengths: i32[B], *, budget, min_tokens, K,
                          dense_output) -> (out: [B, T, Hq, D], indices: int32[B, Hkv, T, K])
  anchor_prefill_reference(q: [B, T, Hq, D], k, v: [B, T, Hkv, D], lengths: i32[B], *, tile, budget,
                           min_tokens, K, dense_output) -> (out: [B, T, Hq, D], indices: int32[B, Hkv, nT, K])

Exactly Kascade's anchor (jsparse.methods.kascade / oracle.select_decode): dense post-softmax scores over the
visible keys (n <= position), pooled over the GQA group; the top kk = min(max(ceil(budget * (pos + 1)),
min_tokens), pos + 1) per (row, KV head, token) by `topk_select_reference` (lax.top_k order, ties to the lower
position), with `diagonal_tile` the query's own diagonal tile forced first (`common.diagonal_scores`: the most
recent first, as select_decode's `tile`); attention over exactly the selected keys (`sparse_decode_reference`),
or with `dense_output` over every visible key.

Prefill (oracle.select_prefill): causal post-softmax weights pooled over the GQA group and over each query tile
of `tile` rows (jsparse.selection.prefill_tile_probs: the rows t < lengths[b] count; a row's right padding adds
nothing, so its tokens cannot change the keys the prompt's last tile keeps),
restricted to the keys strictly before the tile's start (before_tile_scores); tile i keeps
kk_i = min(max(ceil(budget * i * tile), min_tokens), i * tile) keys; attention by `sparse_prefill_reference`
(which adds the diagonal tile), or dense causal attention with `dense_output`. With `block_size` > 1 the scores
are summed per key block and tile i keeps ceil(kk_i / block_size) blocks (`common.pool_blocks`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.anchor_attention.common import (block_counts, pool_blocks, block_width, budget_count,
                                                    check_args, check_block_size, check_diagonal_tile,
                                                    check_prefill_args, force_diagonal, layer_of, positions,
                                                    unstack)
from pallas_kernels.sparse_attention.reference import sparse_decode_reference, sparse_prefill_reference
from pallas_kernels.topk_select.reference import topk_select_reference

Array = jax.Array


def _scores_and_probs(q: Array, k: Array, pos: Array, scale: float | None) -> tuple[Array, Array]:
    """(pooled scores f32[B, Hkv, T, N] (-inf where not visible), per-head softmax f32[B, Hkv, G, T, N])."""
    B, T, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    qg = q.reshape(B, T, Hkv, Hq // Hkv, D)
    logits = jnp.einsum("btkgd,bknd->bkgtn", qg, k, preferred_element_type=jnp.float32)
    logits = logits / math.sqrt(D) if scale is None else logits * scale
    visible = jnp.arange(N)[None, None, :] <= pos[:, :, None]  # [B, T, N]
    logits = jnp.where(visible[:, None, None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.where(visible[:, None], probs.sum(axis=2), -jnp.inf), probs


@functools.partial(jax.jit, static_argnames=("scale", "diagonal_tile"))
def decode_scores_reference(q: Array, k: Array, lengths: Array, *, scale: float | None = None,
                            diagonal_tile: int = 0) -> Array:
    """Exact pooled post-softmax scores of every key (jsparse.selection.pooled_probs, -inf where not visible).

    Args:
      q: [B, T, Hq, D]; k: [B, Hkv, N, D]; lengths: int32[B]; diagonal_tile: 0 or a tile size (each query's
        diagonal tile first, `common.force_diagonal`).

    Returns:
      f32[B, Hkv, T, N].
    """
    pos = positions(lengths, q.shape[1])
    return force_diagonal(_scores_and_probs(q, k, pos, scale)[0], pos, diagonal_tile)


@functools.partial(jax.jit, static_argnames=("budget", "min_tokens", "K", "scale", "dense_output", "diagonal_tile",
                                             "with_output"))
def anchor_decode_reference(q: Array, k: Array, v: Array, lengths: Array, *, budget: float, min_tokens: int = 128,
                            K: int | None = None, layer: Array | None = None, scale: float | None = None,
                            dense_output: bool = False, diagonal_tile: int = 0,
                            with_output: bool = True) -> tuple[Array | None, Array]:
    """Anchor decode by dense scores, `lax.top_k` selection and the reference gathered attention.

    Args:
      q: [B, T, Hq, D] queries of the T newest tokens; k, v: [B, Hkv, N, D] head-major cache (new tokens
        written); lengths: int32[B].
      budget: kept fraction in (0, 1]; min_tokens: the floor of Kascade's rule; K: static index width (None:
        the rule at N).
      scale: softmax scale (None: divide by sqrt(D), as jsparse.selection.pooled_probs does).
      dense_output: attend to every visible key (a dense anchor) instead of the selected ones.
      layer: i32[] (traced): k and v are the stacked cache [L, B, Hkv, N, D] and this layer is read (as
        `k[layer]`); None: k and v are one layer's cache.
      diagonal_tile: 0, or a tile size: each query's diagonal tile is chosen first (`common.force_diagonal`).
      with_output: False: no attention for a sparse anchor (out is None).

    Returns:
      (out [B, T, Hq, D] in q.dtype or None, indices int32[B, Hkv, T, K]).
    """
    K = check_args(q, *unstack(k, v, layer), lengths, budget, min_tokens, K)
    check_diagonal_tile(diagonal_tile)
    if layer is not None:
        lay = layer_of(layer, k.shape[0])[0]
        k, v = k[lay], v[lay]
    B, T, Hq, D = q.shape
    pos = positions(lengths, T)
    scores, probs = _scores_and_probs(q, k, pos, scale)
    scores = force_diagonal(scores, pos, diagonal_tile)
    kk = budget_count(float(budget), pos + 1, min_tokens)[:, None, :]
    indices = topk_select_reference(scores, kk, K)
    if not dense_output and not with_output:
        return None, indices
    if dense_output:
        probs = jnp.where(jnp.isnan(probs), 0.0, probs)  # a row with no visible key
        seen = jnp.arange(v.shape[2])[None, :] <= jnp.max(pos, axis=1)[:, None]  # [B, N]: keys some row sees
        vf = jnp.where(seen[:, None, :, None], v.astype(jnp.float32), 0.0)  # the rest garbage (maybe NaN): zeroed
        out = jnp.einsum("bkgtn,bknd->btkgd", probs, vf).reshape(B, T, Hq, D)
    else:
        out = sparse_decode_reference(q, k, v, indices, lengths, scale=scale)
    return out.astype(q.dtype), indices


@functools.partial(jax.jit, static_argnames=("tile", "scale"))
def tile_scores_reference(q: Array, k: Array, *, tile: int, scale: float | None = None,
                          lengths: Array | None = None) -> Array:
    """Causal post-softmax weights pooled over the GQA group and each query tile, keys before the tile only.

    Args:
      q: [B, T, Hq, D]; k: [B, T, Hkv, D]; tile: query rows per tile; scale: None divides by sqrt(D).
      lengths: i32[B] or None (every row): the rows t >= lengths[b] add nothing.

    Returns:
      f32[B, Hkv, ceil(T / tile), T]: -inf at and after each tile's first position.
    """
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    probs = _scores_and_probs(q, k.transpose(0, 2, 1, 3), pos, scale)[0]  # [B, Hkv, T, T], -inf above diag
    probs = jnp.where(jnp.isfinite(probs), probs, 0.0)
    if lengths is not None:
        probs = jnp.where((jnp.arange(T) < lengths[:, None])[:, None, :, None], probs, 0.0)
    nt = -(-T // tile)
    probs = jnp.pad(probs, ((0, 0), (0, 0), (0, nt * tile - T), (0, 0)))
    pooled = probs.reshape(B, Hkv, nt, tile, T).sum(axis=3)
    before = jnp.arange(T)[None, :] < (jnp.arange(nt) * tile)[:, None]
    return jnp.where(before, pooled, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("tile", "budget", "min_tokens", "K", "scale", "dense_output",
                                             "block_size"))
def anchor_prefill_reference(q: Array, k: Array, v: Array, lengths: Array, *, tile: int, budget: float,
                             min_tokens: int = 128, K: int | None = None, scale: float | None = None,
                             dense_output: bool = False, block_size: int = 1) -> tuple[Array, Array]:
    """Anchor prefill layer by dense tile-pooled scores, `lax.top_k` selection and the reference attention.

    Args:
      q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]; lengths: int32[B] valid tokens per row.
      tile: query rows per index row; budget, min_tokens: Kascade's rule; K: static index width (None: the
        rule at T).
      scale: softmax scale (None: 1/sqrt(D)); dense_output: dense causal attention instead of the sparse one.
      block_size: 1 selects keys; a power of two dividing the tile selects key blocks of that many tokens
        (`common.pool_blocks`: each block scores the sum of its keys' tile-pooled scores; tile i keeps
        ceil(kk_i / block_size) blocks, `common.block_counts`).

    Returns:
      (out [B, T, Hq, D] in q.dtype, indices int32[B, Hkv, ceil(T / tile), ceil(K / block_size)], in blocks
      when block_size > 1).
    """
    K = check_prefill_args(q, k, v, lengths, tile, budget, min_tokens, K)
    check_block_size(block_size, tile)
    T = q.shape[1]
    scores = pool_blocks(tile_scores_reference(q, k, tile=tile, scale=scale, lengths=lengths), block_size)
    indices = topk_select_reference(scores, block_counts(budget, T, tile, min_tokens, block_size)[None, None, :],
                                    block_width(K, block_size))
    if dense_output:
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=scale, implementation="xla")
    else:
        out = sparse_prefill_reference(q, k, v, indices, lengths, tile=tile, block_size=block_size, scale=scale)
    return out.astype(q.dtype), indices

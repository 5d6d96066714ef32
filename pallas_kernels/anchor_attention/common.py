"""Argument checks, Kascade's budget rule and the steps every anchor implementation shares.

An anchor decode layer, for the T newest tokens of each row (query t at position pos = lengths - T + t):
  1. logits of every visible key (n <= pos) for each query head, and each query head's logsumexp;
  2. pooled scores: the post-softmax weights summed over the GQA group, -inf for keys not visible
     (f32[B, Hkv, T, N]);
  3. selection: the top kk = min(max(ceil(budget * (pos + 1)), min_tokens), pos + 1) keys per (row, KV head,
     token), ascending, -1 padded to a static width K (`topk_select`);
  4. attention over the selected keys (`sparse_decode`), or dense attention over all visible keys when the
     anchor is also a dense layer (Kascade's layer 0).
Step 1 is the kernel (it reads every key once, and every value only for a dense anchor); 2-4 are shared.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.sparse_attention.common import check_decode_cache, default_scale  # noqa: F401  (re-exported)
from pallas_kernels.sparse_attention.stacked import layer_index

Array = jax.Array


def budget_count(budget: float, n, min_tokens: int):
    """Kascade's rule k = min(max(ceil(budget * n), min_tokens), n), on a Python int or an int array: budget * n
    an f32 product in both, so a width from an int n holds a traced row's k (jsparse.selection.budget_tokens)."""
    if isinstance(n, (int, np.integer)):
        return min(max(math.ceil(np.float32(budget) * np.float32(n)), min_tokens), int(n))
    k = jnp.ceil(jnp.float32(budget) * n.astype(jnp.float32)).astype(jnp.int32)
    return jnp.minimum(jnp.maximum(k, min_tokens), n)


def unstack(k: Array, v: Array, layer) -> tuple[Array, Array]:
    """Shape stand-ins of one layer's cache when `layer` is given (k, v: [L, B, Hkv, N, D]); else k, v."""
    if layer is None:
        return k, v
    if k.ndim != 5 or v.shape != k.shape:
        raise ValueError(f"k has shape {tuple(k.shape)} and v {tuple(v.shape)}: with layer= expected the "
                         f"stacked cache [L, B, Hkv, N, D] for both")
    layer = jnp.asarray(layer)
    if layer.ndim != 0 or not jnp.issubdtype(layer.dtype, jnp.integer):
        raise ValueError(f"layer has shape {tuple(layer.shape)} and dtype {layer.dtype}: expected an integer "
                         f"scalar in [0, L={k.shape[0]})")
    one = jax.ShapeDtypeStruct(k.shape[1:], k.dtype)
    return one, one


def layer_of(layer, num_layers: int) -> Array:
    """i32[1]: the layer index as jnp indexing reads a traced index (negative from the end, then clamped)."""
    return layer_index(layer, num_layers).reshape(1)


def check_args(q: Array, k: Array, v: Array, lengths: Array, budget: float, min_tokens: int,
               K: int | None) -> int:
    """Validates an `anchor_decode` call (k, v: one layer's cache [B, Hkv, N, D]); returns the static K."""
    B, T, Hq, D, Hkv, N = check_decode_cache(q, k, v)
    if T < 1 or T > N:
        raise ValueError(f"T={T} new tokens: expected 1 <= T <= N={N}")
    if tuple(lengths.shape) != (B,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths has shape {tuple(lengths.shape)} and dtype {lengths.dtype}: expected int32[{B}]")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0.0 < float(budget) <= 1.0:
        raise ValueError(f"budget={budget!r}: expected a fraction of the context in (0, 1]")
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise ValueError(f"min_tokens={min_tokens!r}: expected an int >= 0")
    if K is None:
        return budget_count(float(budget), N, min_tokens)
    if isinstance(K, bool) or not isinstance(K, int) or not 1 <= K <= N:
        raise ValueError(f"K={K!r}: expected an int in [1, N={N}] (the index width)")
    return K


def positions(lengths: Array, T: int) -> Array:
    """i32[B, T]: position of each of the T newest tokens."""
    return lengths.astype(jnp.int32)[:, None] - T + jnp.arange(T, dtype=jnp.int32)[None]


def combine_lse(m: Array, l: Array) -> Array:
    """Logsumexp from split partials m, l: f32[S, ...] (running max and sum of exp(s - m)); -inf if empty."""
    m_all = jnp.max(m, axis=0)
    l_all = jnp.sum(jnp.exp(m - m_all[None]) * l, axis=0)
    return jnp.where(l_all > 0, m_all + jnp.log(jnp.where(l_all > 0, l_all, 1.0)), -jnp.inf)


def pool_scores(logits: Array, lse: Array, pos: Array) -> Array:
    """Post-softmax weights summed over the GQA group.

    Args:
      logits: f32[B, Hkv, T, G, N] scaled q.k (anything where not visible).
      lse: f32[B, Hkv, T, G] logsumexp over the visible keys.
      pos: i32[B, T] last visible key of each query.

    Returns:
      f32[B, Hkv, T, N]: sum_g exp(logits - lse) over visible keys, -inf elsewhere.
    """
    N = logits.shape[-1]
    visible = jnp.arange(N, dtype=jnp.int32)[None, None, :] <= pos[:, :, None]  # [B, T, N]
    visible = visible[:, None, :, None, :]
    p = jnp.where(visible, jnp.exp(logits - lse[..., None]), 0.0)
    return jnp.where(visible[:, :, :, 0], jnp.sum(p, axis=3), -jnp.inf)


def check_diagonal_tile(diagonal_tile) -> int:
    """`diagonal_tile` of anchor_decode: 0 (off) or the tile size (an int >= 1)."""
    if isinstance(diagonal_tile, bool) or not isinstance(diagonal_tile, int) or diagonal_tile < 0:
        raise ValueError(f"diagonal_tile={diagonal_tile!r}: expected 0 (off) or a tile size >= 1")
    return diagonal_tile


# The score of a key of the query's own diagonal tile: above any pooled softmax weight (at most G), rising with the
# key's position, so that a budget smaller than the tile keeps the most recent keys, the query's own first (f32
# holds DIAGONAL_SCORE + position exactly for positions below 2**24 - 2**20).
DIAGONAL_SCORE = 2.0 ** 20


def diagonal_scores(key: Array) -> Array:
    """f32 scores of diagonal-tile keys at positions `key` (`DIAGONAL_SCORE` + position)."""
    return DIAGONAL_SCORE + key.astype(jnp.float32)


def force_diagonal(scores: Array, pos: Array, diagonal_tile: int) -> Array:
    """Marks each query's own causal diagonal tile as chosen first: keys floor(pos / tile) * tile .. pos score
    `diagonal_scores` (above every other key, the most recent highest).

    Kascade's decode keeps, inside its budget, the keys the prefill kernel adds to every query tile
    (jsparse.methods.oracle.select_decode). When the budget is smaller than the tile, the most recent keys of the
    tile are kept, the query's own position first.

    Args:
      scores: f32[B, Hkv, T, N] pooled scores (-inf where not visible); pos: i32[B, T]; diagonal_tile: 0 (off)
        or the tile size.

    Returns:
      f32[B, Hkv, T, N].
    """
    if not diagonal_tile:
        return scores
    key = jnp.arange(scores.shape[-1], dtype=jnp.int32)[None, None, :]
    p = pos[:, :, None]
    diagonal = (key <= p) & (key >= (p // diagonal_tile) * diagonal_tile)  # [B, T, N]
    return jnp.where(diagonal[:, None], diagonal_scores(key)[:, None], scores)


def select(scores: Array, pos: Array, budget: float, min_tokens: int, K: int, implementation: str | None) -> Array:
    """int32[B, Hkv, T, K]: the top kk(pos + 1) keys of scores f32[B, Hkv, T, N] (index contract)."""
    from pallas_kernels.topk_select import topk_select

    kk = budget_count(float(budget), pos + 1, min_tokens)[:, None, :]  # [B, 1, T]
    return topk_select(scores, kk, K, implementation=implementation)


def check_prefill_args(q: Array, k: Array, v: Array, lengths: Array, tile: int, budget: float, min_tokens: int,
                       K: int | None) -> int:
    """Validates an `anchor_prefill` call; returns the static index width K (default: the rule at T)."""
    if q.ndim != 4:
        raise ValueError(f"q has shape {tuple(q.shape)}: expected [B, T, Hq, D]")
    B, T, Hq, D = q.shape
    if k.ndim != 4 or k.shape[0] != B or k.shape[1] != T or k.shape[3] != D:
        raise ValueError(f"k has shape {tuple(k.shape)}: expected [B={B}, T={T}, Hkv, D={D}]")
    if v.shape != k.shape:
        raise ValueError(f"v has shape {tuple(v.shape)}: expected the shape of k, {tuple(k.shape)}")
    if Hq % k.shape[2]:
        raise ValueError(f"Hq={Hq} query heads is not a multiple of Hkv={k.shape[2]} KV heads")
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tile={tile!r}: expected an int >= 1 (query rows per index row)")
    sds = jax.ShapeDtypeStruct  # shape stand-ins: the decode checks of budget, min_tokens, K and lengths
    cache = sds((B, k.shape[2], T, D), k.dtype)
    return check_args(sds((B, 1, Hq, D), q.dtype), cache, cache, lengths, budget, min_tokens, K)


def tile_counts(budget: float, T: int, tile: int, min_tokens: int) -> Array:
    """i32[ceil(T / tile)]: keys chosen for each query tile among those before its start (rolling budget)."""
    starts = jnp.arange(-(-T // tile), dtype=jnp.int32) * tile
    return budget_count(float(budget), starts, min_tokens)


# ------------------------------------------------------------------------------------------------ block selections
# With block_size bs > 1 an anchor selects key blocks (entry j covers tokens j*bs .. j*bs + bs - 1, the index
# contract's block units) instead of tokens: a block's score is the sum of its keys' tile-pooled scores (the
# attention mass the tile puts on the block), and tile i keeps ceil(kk_i / bs) blocks, kk_i the token rule of
# `tile_counts`. The budget is counted in keys and rounded up to whole blocks: a tile keeps at most bs - 1 keys
# more than the token rule, never fewer, and never more than the keys before it (bs divides the tile, so the
# i * tile keys before tile i are i * tile / bs whole blocks).


def mask_rows_lse(lse: Array, lengths: Array | None) -> Array:
    """Every query row's logsumexp lse f32[B, H, T] with the rows t >= lengths[b] set to +inf (lengths None: as
    given): the tile-pooling kernels add exp(s - lse) per row, so such a row (a batch row's right padding) adds 0."""
    if lengths is None:
        return lse
    T = lse.shape[-1]
    return jnp.where(jnp.arange(T)[None, None, :] < lengths[:, None, None], lse.astype(jnp.float32), jnp.inf)


def check_block_size(block_size, tile: int, name: str = "block_size") -> int:
    """`block_size` of anchor_prefill (`name` in messages): a power of two >= 1 dividing `tile` (a query tile
    holds whole blocks)."""
    if isinstance(block_size, (bool, np.bool_)) or not isinstance(block_size, (int, np.integer)) or \
            block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"{name}={block_size!r}: expected a power of two >= 1 dividing tile={tile} (tokens per "
                         f"selected block; 1: token-level selection)")
    if tile % block_size:
        raise ValueError(f"{name}={block_size} does not divide tile={tile}: a query tile must hold whole blocks "
                         f"(expected a power of two <= {tile})")
    return int(block_size)


def pool_blocks(scores: Array, block_size: int) -> Array:
    """Tile-pooled key scores summed per key block.

    Args:
      scores: f32[B, Hkv, nT, T] tile-pooled scores (-inf at and after each tile's first position).
      block_size: keys per block (dividing the tile, so each tile start is a block start).

    Returns:
      f32[B, Hkv, nT, ceil(T / block_size)]: the sum of each block's scores; -inf for a block not wholly before
      the tile's first position (a trailing partial block, T % block_size != 0, never is).
    """
    if block_size == 1:
        return scores
    T = scores.shape[-1]
    nb = -(-T // block_size)
    padded = jnp.pad(scores, [(0, 0)] * (scores.ndim - 1) + [(0, nb * block_size - T)], constant_values=-jnp.inf)
    return padded.reshape(*scores.shape[:-1], nb, block_size).sum(axis=-1)  # any -inf key makes the block -inf


def block_counts(budget: float, T: int, tile: int, min_tokens: int, block_size: int) -> Array:
    """i32[ceil(T / tile)]: blocks chosen for each query tile, ceil(kk_i / block_size) for the token rule kk_i of
    `tile_counts` (block_size 1: kk_i itself)."""
    kk = tile_counts(budget, T, tile, min_tokens)
    return kk if block_size == 1 else -(-kk // block_size)


def block_width(K: int, block_size: int) -> int:
    """The static index width in entries for a width of K keys: ceil(K / block_size)."""
    return -(-K // block_size)

"""The anchor layers in plain XLA (any backend; the CPU choice).

Decode: einsum logits, a per-head logsumexp, pooling, then the shared selection and gathered attention (each
through its entry point, so on a GPU or TPU they are the Pallas ones). Prefill: the tile-pooled scores of
`reference.tile_scores_reference` computed in chunks of whole query tiles against the keys up to each chunk's
end (`tile_scores_xla`: the [T, T] upper triangle is skipped chunk by chunk; 3x less CPU time at 2K), then the
selection and tile-gathered attention entry points, or dense causal attention for a dense anchor.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.anchor_attention.common import (block_counts, pool_blocks, block_width, check_args,
                                                    check_block_size, check_diagonal_tile, check_prefill_args,
                                                    default_scale, force_diagonal, layer_of, pool_scores, positions,
                                                    select, unstack)

Array = jax.Array


@functools.partial(jax.jit, static_argnames=("scale", "dense_output", "diagonal_tile"))
def decode_scores_xla(q: Array, k: Array, v: Array, lengths: Array, *, scale: float | None = None,
                      dense_output: bool = False, diagonal_tile: int = 0) -> tuple[Array, Array | None]:
    """Pooled scores f32[B, Hkv, T, N] (and the dense attention with dense_output); see gpu.decode_scores_gpu."""
    B, T, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = default_scale(D, scale)
    pos = positions(lengths, T)
    qg = q.reshape(B, T, Hkv, G, D)
    logits = jnp.einsum("btkgd,bknd->bktgn", qg, k, preferred_element_type=jnp.float32) * scale
    visible = (jnp.arange(N)[None, None, :] <= pos[:, :, None])[:, None, :, None, :]
    logits = jnp.where(visible, logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B, Hkv, T, G]
    scores = force_diagonal(pool_scores(logits, lse, pos), pos, diagonal_tile)
    out = None
    if dense_output:
        p = jnp.where(visible, jnp.exp(logits - lse[..., None]), 0.0)
        seen = jnp.arange(N)[None, :] <= jnp.max(pos, axis=1)[:, None]  # [B, N]: keys some row sees
        v = jnp.where(seen[:, None, :, None], v, jnp.zeros((), v.dtype))  # the rest garbage (maybe NaN): zeroed
        # The dot's batch axes lead its output (then a transpose): with "->btkgd" the CPU's bf16 dot failed
        # (UNIMPLEMENTED: DotThunk BF16 x BF16 = F32), so a bf16 Kascade's dense layer 0 could not run on a CPU.
        o = jnp.einsum("bktgn,bknd->bktgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        out = o.transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, D).astype(q.dtype)
    return scores, out


@functools.partial(jax.jit, static_argnames=("budget", "min_tokens", "K", "scale", "dense_output", "diagonal_tile",
                                             "with_output"))
def anchor_decode_xla(q: Array, k: Array, v: Array, lengths: Array, *, budget: float, min_tokens: int = 128,
                      K: int | None = None, layer: Array | None = None, scale: float | None = None,
                      dense_output: bool = False, diagonal_tile: int = 0,
                      with_output: bool = True) -> tuple[Array | None, Array]:
    """Anchor decode layer with XLA scores; args and returns as `reference.anchor_decode_reference` (with
    `layer`, k and v are the stacked cache; XLA slices the layer)."""
    from pallas_kernels.sparse_attention import sparse_decode

    K = check_args(q, *unstack(k, v, layer), lengths, budget, min_tokens, K)
    check_diagonal_tile(diagonal_tile)
    if layer is not None:
        lay = layer_of(layer, k.shape[0])[0]
        k, v = k[lay], v[lay]
    scores, out = decode_scores_xla(q, k, v, lengths, scale=scale, dense_output=dense_output,
                                    diagonal_tile=diagonal_tile)
    indices = select(scores, positions(lengths, q.shape[1]), budget, min_tokens, K, None)
    if out is None and with_output:
        out = sparse_decode(q, k, v, indices, lengths, scale=scale)
    return out, indices


SCORE_CHUNK_ROWS = 256  # query rows (rounded to whole tiles) per chunk of `tile_scores_xla`


@functools.partial(jax.jit, static_argnames=("tile", "scale"))
def tile_scores_xla(q: Array, k: Array, *, tile: int, scale: float | None = None,
                    lengths: Array | None = None) -> Array:
    """`reference.tile_scores_reference` (the same values up to f32 rounding) in chunks of query tiles: rows s..e-1
    (whole tiles, about SCORE_CHUNK_ROWS) score only the keys 0..e-1, which are all they can see.

    Args:
      q: [B, T, Hq, D]; k: [B, T, Hkv, D]; tile: query rows per tile; scale: None divides by sqrt(D).
      lengths: i32[B] or None (every row): the rows t >= lengths[b] add nothing.
    Returns:
      f32[B, Hkv, ceil(T / tile), T]: -inf at and after each tile's first position.
    """
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    kh = k.transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
    rows = max(1, SCORE_CHUNK_ROWS // tile) * tile
    pooled = []
    for s in range(0, T, rows):
        e = min(s + rows, T)
        qg = q[:, s:e].reshape(B, e - s, Hkv, G, D)
        logits = jnp.einsum("btkgd,bknd->bkgtn", qg, kh[:, :, :e], preferred_element_type=jnp.float32)
        logits = logits / math.sqrt(D) if scale is None else logits * scale
        visible = jnp.arange(e)[None, :] <= jnp.arange(s, e)[:, None]  # [e - s, e]
        probs = jax.nn.softmax(jnp.where(visible, logits, -jnp.inf), axis=-1).sum(axis=2)  # [B, Hkv, e - s, e]
        if lengths is not None:
            probs = jnp.where((jnp.arange(s, e) < lengths[:, None])[:, None, :, None], probs, 0.0)
        n = -(-(e - s) // tile)
        probs = jnp.pad(probs, ((0, 0), (0, 0), (0, n * tile - (e - s)), (0, T - e)))
        pooled.append(probs.reshape(B, Hkv, n, tile, T).sum(axis=3))
    pooled = jnp.concatenate(pooled, axis=2)
    before = jnp.arange(T)[None, :] < (jnp.arange(pooled.shape[2]) * tile)[:, None]
    return jnp.where(before, pooled, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("tile", "budget", "min_tokens", "K", "scale", "dense_output",
                                             "block_size"))
def anchor_prefill_xla(q: Array, k: Array, v: Array, lengths: Array, *, tile: int, budget: float,
                       min_tokens: int = 128, K: int | None = None, scale: float | None = None,
                       dense_output: bool = False, block_size: int = 1) -> tuple[Array, Array]:
    """Anchor prefill layer: the tile-pooled scores (`tile_scores_xla`), then `topk_select` and `sparse_prefill`
    (or `pallas_kernels.dense.dense_prefill` for a dense anchor) through their entry points.
    Args and returns as `reference.anchor_prefill_reference`."""
    from pallas_kernels.dense import dense_prefill
    from pallas_kernels.sparse_attention import sparse_prefill
    from pallas_kernels.topk_select import topk_select

    K = check_prefill_args(q, k, v, lengths, tile, budget, min_tokens, K)
    check_block_size(block_size, tile)
    T = q.shape[1]
    scores = pool_blocks(tile_scores_xla(q, k, tile=tile, scale=scale, lengths=lengths), block_size)
    indices = topk_select(scores, block_counts(budget, T, tile, min_tokens, block_size)[None, None, :],
                          block_width(K, block_size))
    if dense_output:
        if scale is None:
            out = dense_prefill(q, k, v)
        else:
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=scale, implementation="xla")
    else:
        out = sparse_prefill(q, k, v, indices, lengths, tile=tile, block_size=block_size, scale=scale)
    return out.astype(q.dtype), indices

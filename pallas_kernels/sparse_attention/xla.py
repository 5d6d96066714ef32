"""XLA implementations of the gathered sparse-attention ops (any backend; the CPU default and the fallback).

Both gather whole blocks of `block_size` rows per index entry with `take_along_axis` on a block view of the
head-major K/V ([B, Hkv, N/bs, bs, D]), then run two einsums in the input dtype with f32 accumulation and a
masked f32 softmax. Prefill never builds a [T, T] mask: it maps over chunks of query tiles, each gathering its
own selected blocks and its diagonal tile, so memory is bounded by `max_chunk_bytes`.

Semantics: exactly `reference.sparse_decode_reference` / `reference.sparse_prefill_reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.sparse_attention.common import (block_token_positions, check_decode_args,
                                                    check_prefill_args, default_scale)

Array = jax.Array


def _gather_blocks(kb: Array, idx: Array) -> Array:
    """Gathers blocks of a block view.

    Args:
      kb: [B, Hkv, nb, bs, D] keys or values viewed as blocks.
      idx: int32[B, Hkv, M] block numbers (already clipped to [0, nb)).

    Returns:
      [B, Hkv, M * bs, D] rows of the gathered blocks, in entry order.
    """
    B, Hkv, _, bs, D = kb.shape
    g = jnp.take_along_axis(kb, idx[..., None, None], axis=2, mode="clip")  # [B, Hkv, M, bs, D]
    return g.reshape(B, Hkv, idx.shape[-1] * bs, D)


def _masked_softmax_parts(logits: Array, valid: Array) -> tuple[Array, Array, Array]:
    """Masked softmax pieces: (p unnormalised f32, l row sums, m row max); empty rows give p = 0, l = 0."""
    logits = jnp.where(valid, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m_safe[..., None])
    return p, jnp.sum(p, axis=-1), m_safe


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "return_lse"))
def sparse_decode_xla(q: Array, k: Array, v: Array, indices: Array, lengths: Array, *, block_size: int = 1,
                      scale: float | None = None, return_lse: bool = False) -> Array | tuple[Array, Array]:
    """Gathered decode attention in XLA. Args and returns as `reference.sparse_decode_reference`.

    Args:
      q: [B, T, Hq, D]; k, v: [B, Hkv, N, D]; indices: int32[B, Hkv, T, K]; lengths: int32[B].

    Returns:
      out: [B, T, Hq, D] in q.dtype (and lse: f32[B, T, Hq] with return_lse).
    """
    check_decode_args(q, k, v, indices, lengths, block_size)
    B, T, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G, K, nb = Hq // Hkv, indices.shape[3], N // block_size
    scale = default_scale(D, scale)
    lengths = lengths.astype(jnp.int32)
    indices = indices.astype(jnp.int32)

    flat = jnp.clip(indices, 0, nb - 1).reshape(B, Hkv, T * K)
    kg = _gather_blocks(k.reshape(B, Hkv, nb, block_size, D), flat).reshape(B, Hkv, T, K * block_size, D)
    vg = _gather_blocks(v.reshape(B, Hkv, nb, block_size, D), flat).reshape(B, Hkv, T, K * block_size, D)

    tok = block_token_positions(indices, block_size)  # [B, Hkv, T, S]
    pos = lengths[:, None] - T + jnp.arange(T, dtype=jnp.int32)  # [B, T]
    valid = (tok >= 0) & (tok <= pos[:, None, :, None]) & (tok < lengths[:, None, None, None]) & (tok < N)

    qg = q.reshape(B, T, Hkv, G, D)
    logits = jnp.einsum("bthgd,bhtsd->bhgts", qg, kg.astype(q.dtype),
                        preferred_element_type=jnp.float32) * scale
    p, l, m = _masked_softmax_parts(logits, valid[:, :, None])
    vg = jnp.where(valid[..., None], vg, jnp.zeros((), vg.dtype))  # garbage rows (maybe NaN) add nothing
    o = jnp.einsum("bhgts,bhtsd->bthgd", p, vg, preferred_element_type=jnp.float32)  # [B, T, Hkv, G, D]
    l_t = l.transpose(0, 3, 1, 2)  # [B, T, Hkv, G]
    out = jnp.where(l_t[..., None] > 0, o / jnp.where(l_t > 0, l_t, 1.0)[..., None], 0.0)
    out = out.reshape(B, T, Hq, D).astype(q.dtype)
    if return_lse:
        lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)  # [B, Hkv, G, T]
        return out, lse.transpose(0, 3, 1, 2).reshape(B, T, Hq)
    return out


@functools.partial(jax.jit, static_argnames=("tile", "block_size", "scale", "max_chunk_bytes"))
def sparse_prefill_xla(q: Array, k: Array, v: Array, indices: Array, lengths: Array, *, tile: int = 32,
                       block_size: int = 1, scale: float | None = None,
                       max_chunk_bytes: int = 1 << 30) -> Array:
    """Tile-gathered prefill attention in XLA. Args and returns as `reference.sparse_prefill_reference`.

    Args:
      q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]; indices: int32[B, Hkv, ceil(T/tile), K]; lengths: int32[B].
      max_chunk_bytes: bound on the f32 logits of one chunk of query tiles (tiles are processed in chunks
        with `lax.map`).

    Returns:
      [B, T, Hq, D] in q.dtype, zeros on rows at or beyond lengths.
    """
    check_prefill_args(q, k, v, indices, lengths, tile, block_size)
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G, nt, K = Hq // Hkv, indices.shape[2], indices.shape[3]
    Tp = nt * tile
    S = K * block_size
    nb = Tp // block_size
    scale = default_scale(D, scale)
    lengths = jnp.minimum(lengths.astype(jnp.int32), T)

    pad = [(0, 0), (0, Tp - T), (0, 0), (0, 0)]
    kh = jnp.pad(k, pad).transpose(0, 2, 1, 3)  # [B, Hkv, Tp, D]
    vh = jnp.pad(v, pad).transpose(0, 2, 1, 3)
    kb = kh.reshape(B, Hkv, nb, block_size, D)
    vb = vh.reshape(B, Hkv, nb, block_size, D)
    # Per-tile operands with the tile axis leading, for lax.map.
    q_t = jnp.pad(q, pad).reshape(B, nt, tile, Hkv, G, D).transpose(1, 0, 2, 3, 4, 5)  # [nt, B, tile, Hkv, G, D]
    kd_t = kh.reshape(B, Hkv, nt, tile, D).transpose(2, 0, 1, 3, 4)  # [nt, B, Hkv, tile, D]
    vd_t = vh.reshape(B, Hkv, nt, tile, D).transpose(2, 0, 1, 3, 4)
    idx_t = indices.astype(jnp.int32).transpose(2, 0, 1, 3)  # [nt, B, Hkv, K]
    starts = jnp.arange(nt, dtype=jnp.int32) * tile

    def one_tile(xs):
        qi, kd, vd, idx, start = xs
        tok = block_token_positions(idx, block_size)  # [B, Hkv, S]
        sel_ok = (tok >= 0) & (tok < start)
        ks = _gather_blocks(kb, jnp.clip(idx, 0, nb - 1))  # [B, Hkv, S, D]
        vs = _gather_blocks(vb, jnp.clip(idx, 0, nb - 1))
        keys = jnp.concatenate([ks, kd], axis=2)  # [B, Hkv, S + tile, D]
        vals = jnp.concatenate([vs, vd], axis=2)
        qpos = start + jnp.arange(tile, dtype=jnp.int32)  # [tile]
        kpos = jnp.concatenate([jnp.broadcast_to(jnp.zeros((), jnp.int32), (B, Hkv, S)),
                                jnp.broadcast_to(qpos, (B, Hkv, tile))], axis=2)  # selected keys: causal ok
        cand = jnp.concatenate([sel_ok, jnp.ones((B, Hkv, tile), bool)], axis=2)
        valid = (cand[:, :, None, :] & (kpos[:, :, None, :] <= qpos[None, None, :, None])
                 & (qpos[None, None, :, None] < lengths[:, None, None, None]))  # [B, Hkv, tile, S + tile]
        logits = jnp.einsum("brhgd,bhsd->bhgrs", qi, keys, preferred_element_type=jnp.float32) * scale
        p, l, _ = _masked_softmax_parts(logits, valid[:, :, None])
        vals = jnp.where(jnp.any(valid, axis=2)[..., None], vals, jnp.zeros((), vals.dtype))  # garbage rows: zeroed
        o = jnp.einsum("bhgrs,bhsd->brhgd", p, vals, preferred_element_type=jnp.float32)
        l = l.transpose(0, 3, 1, 2)  # [B, tile, Hkv, G]
        o = jnp.where(l[..., None] > 0, o / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
        return o.astype(q.dtype)

    per_tile = B * Hq * tile * (S + tile) * 4
    chunk = max(1, min(nt, max_chunk_bytes // max(per_tile, 1)))
    out = jax.lax.map(one_tile, (q_t, kd_t, vd_t, idx_t, starts), batch_size=chunk)  # [nt, B, tile, Hkv, G, D]
    return out.transpose(1, 0, 2, 3, 4, 5).reshape(B, Tp, Hq, D)[:, :T]

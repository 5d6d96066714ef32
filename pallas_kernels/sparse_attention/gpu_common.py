"""Triton building blocks shared by the sparse-attention GPU kernels (`gpu`: decode and per-head prefill;
`gpu_prefill_gqa`: the GQA-packed prefill): what the kernels can take (`unsupported_reason`), the prefill argument
checks and operands, the gather of selected key/value rows, one online-softmax step and a query tile's attention.
`gpu` dispatches to `gpu_prefill_gqa`, and both import this module (imports run one way).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.sparse_attention.common import blocks_at_or_before, check_prefill_args

Array = jax.Array

_MASK = -1e30  # finite "minus infinity" for the running max (exp(_MASK - x) underflows to 0)
_MIN_ROWS = 16  # Triton's tensor-core dot needs M >= 16


def _pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def unsupported_reason(dtype, head_dim: int, block_size: int, tile: int | None, *,
                       interpret: bool = False) -> str | None:
    """Why the Triton kernels cannot take these arguments (None when they can).

    Args:
      dtype: the q/k/v dtype.
      head_dim: D.
      block_size: tokens per index entry.
      tile: query rows per prefill program (None for decode).
      interpret: the Pallas interpreter (CPU tests) has no tensor-core minimum, so it also takes tiles < 16.
    """
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        return f"dtype {jnp.dtype(dtype)} (expected bfloat16, float16 or float32)"
    if not _pow2(head_dim) or head_dim < 16:
        return f"head_dim D={head_dim} (Triton needs a power of two >= 16)"
    if not _pow2(block_size):
        return f"block_size={block_size} (expected a power of two)"
    min_tile = 1 if interpret else _MIN_ROWS
    if tile is not None and (not _pow2(tile) or tile < min_tile):
        return f"tile={tile} (the prefill kernel needs a power of two >= {min_tile})"
    return None


def _check_supported(q: Array, block_size: int, tile: int | None, interpret: bool) -> None:
    reason = unsupported_reason(q.dtype, q.shape[-1], block_size, tile, interpret=interpret)
    if reason is not None:
        raise ValueError(f"the Pallas GPU sparse-attention kernel cannot take {reason}")


def _check_prefill(q: Array, k: Array, v: Array, indices: Array, lengths: Array, tile: int, block_size: int,
                   interpret: bool) -> tuple[int, ...]:
    """The argument checks of both prefill kernels (gpu's per-head one and gpu_prefill_gqa's): (B, T, Hq, D, Hkv, G, number
    of query tiles)."""
    check_prefill_args(q, k, v, indices, lengths, tile, block_size)
    _check_supported(q, block_size, tile, interpret)
    B, T, Hq, D = q.shape
    return B, T, Hq, D, k.shape[2], Hq // k.shape[2], indices.shape[2]


def _gather_rows(ent_ref, k_ref, v_ref, first_entry, limit, block_size: int, block_k: int):
    """Gathers `block_k` key/value rows for entries first_entry .. first_entry + block_k // block_size - 1.

    Args:
      ent_ref: int32[E] ref of index entries (block numbers, -1 padded).
      k_ref, v_ref: [N, D] refs of one KV head.
      first_entry: i32 scalar, a multiple of block_k // block_size.
      limit: i32 scalar, the last token that may be used (inclusive; < N).

    Returns:
      (ok: bool[block_k] rows that are real tokens <= limit; k: [block_k, D]; v: [block_k, D]). Other rows
      read row 0 (never out of bounds, whatever the entry holds) and must be masked by the caller.
    """
    lane = jnp.arange(block_k, dtype=jnp.int32)
    if block_size == 1:
        ent = ent_ref[pl.ds(first_entry, block_k)]
    else:
        ent = ent_ref[first_entry + lane // block_size]  # each entry repeated block_size times
    ok, safe = entry_rows(ent, lane, limit, block_size)
    return ok, k_ref[safe, :], v_ref[safe, :]


def entry_rows(ent, lane, limit, block_size: int):
    """In-kernel: the cache rows of a gather's lanes. ent i32[block_k]: lane i's index entry (block_size lanes per
    entry, in order); lane i32[block_k] the lane numbers; limit: the last usable token (inclusive).

    Returns (ok: bool[block_k] lanes whose row is a real token <= limit; safe: i32[block_k] that row, 0 where not
    ok). An entry's block is checked before its tokens are multiplied out: past 2^31 / block_size they would wrap
    around int32 to a real token (`common.blocks_at_or_before`)."""
    if block_size == 1:
        tok = ent
        ok = (tok >= 0) & (tok <= limit)
    else:
        tok = ent * block_size + lane % block_size
        ok = blocks_at_or_before(ent, limit, block_size) & (tok <= limit)
    return ok, jnp.where(ok, tok, 0)


def group_query_rows(q_ref, row, rows: int, G: int, T: int, head):
    """In-kernel: query rows `row` (i32[M]) of KV head `head`'s GQA group over the T new tokens, row = t * G + g,
    from q_ref [T * Hq, D] (every token's query heads, token-major); rows at or past `rows` repeat the last real one
    (their outputs are dropped). Returns (q [M, D], t i32[M] each row's token)."""
    rc = jnp.minimum(row, rows - 1)
    t = rc // G
    return q_ref[t * (q_ref.shape[0] // T) + head * G + rc % G, :], t


def _online_softmax_step(q, k, v, ok, carry, scale):
    """One flash step: q [M, D], k/v [n, D], ok bool[M, n] (or [1, n]); carry (o f32[M, D], m f32[M], l f32[M])."""
    o, m, l = carry
    s = plgpu.dot(q, k, trans_b=True) * scale  # [M, n] f32
    s = jnp.where(ok, s, _MASK)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    corr = jnp.exp(m - m_new)
    p = jnp.where(ok, jnp.exp(s - m_new[:, None]), 0.0)
    l = corr * l + jnp.sum(p, axis=1)
    o = corr[:, None] * o + plgpu.dot(p.astype(v.dtype), v)
    return o, m_new, l


def _useful_end(indices: Array, limit: Array, block_size: int) -> Array:
    """1 + the last entry position j whose block starts at or before `limit` (0 if none).

    Args:
      indices: int32[..., K]; limit: int32[...] (last usable token, inclusive).
    """
    K = indices.shape[-1]
    ok = blocks_at_or_before(indices, limit[..., None], block_size)
    return jnp.max(jnp.where(ok, jnp.arange(1, K + 1, dtype=jnp.int32), 0), axis=-1).astype(jnp.int32)


def prefill_operands(q, k, v, indices, lengths, tile: int, block_size: int, block_k: int):
    """The tile-gathered prefill kernels' operands: q, k, v padded to whole tiles; lens i32[B, 1] (row lengths);
    end i32[B, Hkv, nt, 1] (1 + the last entry before each tile's start); ent i32[B, Hkv, nt, Kp] (the indices, -1
    padded to whole iterations of block_k / block_size entries)."""
    B, T = q.shape[:2]
    Hkv, nt, K = k.shape[2], indices.shape[2], indices.shape[3]
    Tp = nt * tile
    per_iter = block_k // block_size
    Kp = pl.cdiv(K, per_iter) * per_iter
    if Tp != T:
        pad = [(0, 0), (0, Tp - T), (0, 0), (0, 0)]
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
    ent = jnp.pad(indices.astype(jnp.int32), ((0, 0), (0, 0), (0, 0), (0, Kp - K)), constant_values=-1)
    starts = jnp.arange(nt, dtype=jnp.int32) * tile
    end = _useful_end(ent, jnp.broadcast_to(starts - 1, (B, Hkv, nt)), block_size)[..., None]
    lens = jnp.minimum(lengths.astype(jnp.int32), T)[:, None]
    return q, k, v, lens, end, ent


def _tile_attention(q, qpos, length, end_ref, ent_ref, k_ref, v_ref, start, diag_keys, *, scale: float,
                    block_size: int, block_k: int, tile: int):
    """Attention of one program's query rows in the query tile that starts at `start`: the tile's selected keys
    before it, then its own keys causally (shared by gpu's per-head kernel and gpu_prefill_gqa's).

    Args: q [M, D] and qpos i32[M] (the rows and their positions); length: the row's length; end_ref, ent_ref,
    k_ref, v_ref: as in `gpu._prefill_kernel`; diag_keys: how many of the tile's own keys the rows can see (a static
    int, or traced).
    Returns: f32[M, D], zeros on rows at or beyond `length`.
    """
    M, d = q.shape
    per_iter = block_k // block_size
    carry = (jnp.zeros((M, d), jnp.float32), jnp.full((M,), _MASK, jnp.float32), jnp.zeros((M,), jnp.float32))

    def selected(it, carry):
        # Entries at or after the tile start are ignored (the diagonal loop covers the tile itself).
        ok, k, v = _gather_rows(ent_ref, k_ref, v_ref, it * per_iter, start - 1, block_size, block_k)
        return _online_softmax_step(q, k, v, ok[None, :], carry, scale)

    carry = lax.fori_loop(jnp.int32(0), pl.cdiv(end_ref[0], jnp.int32(per_iter)), selected, carry)

    diag_k = min(block_k, tile)

    def diagonal(c, carry):
        kpos = start + c * diag_k + jnp.arange(diag_k, dtype=jnp.int32)
        keys = pl.ds(start + c * diag_k, diag_k)
        ok = kpos[None, :] <= qpos[:, None]
        # The tile's keys past `length` are padding or garbage (maybe NaN): zeroed, not multiplied by a 0 weight.
        v = jnp.where((kpos < length)[:, None], v_ref[keys, :], jnp.zeros((), v_ref.dtype))
        return _online_softmax_step(q, k_ref[keys, :], v, ok, carry, scale)

    if isinstance(diag_keys, int):  # a static trip count
        o, m, l = lax.fori_loop(0, pl.cdiv(diag_keys, diag_k), diagonal, carry)
    else:
        n_diag = pl.cdiv(diag_keys, jnp.int32(diag_k)).astype(jnp.int32)
        o, m, l = lax.fori_loop(jnp.int32(0), n_diag, diagonal, carry)
    row_ok = (qpos < length) & (l > 0)
    return jnp.where(row_ok[:, None], o / jnp.where(row_ok, l, 1.0)[:, None], 0.0)


"""Shared pieces of every top-k selection implementation: argument checks, order-preserving integer keys, the
radix (bisection) search for the threshold, and the per-split bookkeeping of the compaction.

The algorithm (exact, no sort):
  1. Every score x maps to a signed int32 *key* that orders like `lax.top_k` orders floats (IEEE total order:
     -NaN < -inf < ... < -0.0 < +0.0 < ... < +inf < +NaN): `key = bits ^ ((bits >> 31) & 0x7fffffff)`.
  2. Radix search, `bits` bits per pass (32 / bits passes): the row's threshold t is the kk-th largest key,
     i.e. the largest t with count(key >= t) >= kk. A pass counts, for the 2**bits candidates
     c_j = lo + j * 2**shift (j = 0 .. 2**bits - 1), how many keys are >= c_j, and keeps the largest c_j
     whose count is still >= kk. A row is done early when count(key >= lo) == kk: then every key >= lo is
     chosen and nothing ties (later passes skip it).
  3. Compaction: the chosen positions, ascending, are the keys > t plus the first kk - count(key > t) keys
     equal to t (ties by position, as `lax.top_k` is stable). Like `jsparse.selection.topk_indices`, picks
     that are not > -inf (-inf and NaN scores) are dropped after ranking, and the rest is -1 padding.

Each backend supplies the counting (`count_fn`) and the compaction; the passes' bookkeeping is here.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array

INT_MIN = np.int32(-2 ** 31)
INT_MAX = np.int32(2 ** 31 - 1)
SIGN = np.uint32(0x80000000)


def float_keys(x: Array) -> Array:
    """int32 keys of f32 scores, ordered as the floats' IEEE total order (signed int comparison)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return bits ^ (lax.shift_right_arithmetic(bits, jnp.int32(31)) & jnp.int32(0x7FFFFFFF))


def _key_of(value: float) -> int:
    bits = int(np.array(value, np.float32).view(np.int32))
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


KEY_NEG_INF = _key_of(-np.inf)  # keys <= this are -inf or -NaN (never output)
KEY_POS_INF = _key_of(np.inf)  # keys > this are +NaN (never output)


def _span_bounds(span, lead: tuple[int, ...]) -> tuple[Array, Array]:
    """(lo, hi) i32[lead] of a `span` (a pair of int arrays broadcastable to lead)."""
    if not (isinstance(span, (tuple, list)) and len(span) == 2):
        got = f"an array of shape {tuple(span.shape)}" if hasattr(span, "shape") else repr(span)
        raise ValueError(f"span: got {got}; expected a pair (lo, hi) of int arrays broadcastable to {lead}")
    lo, hi = (jnp.broadcast_to(jnp.asarray(a, jnp.int32), lead) for a in span)
    return lo, hi


def span_rows(span, lead: tuple[int, ...]) -> Array:
    """i32[prod(lead), 2]: the (lo, hi) of each row of a `span` (a pair of int arrays broadcastable to lead)."""
    return jnp.stack(_span_bounds(span, lead), axis=-1).reshape(-1, 2)


def mask_span(scores: Array, span) -> Array:
    """scores with every position outside its row's [lo, hi) set to -inf (what `span` means everywhere)."""
    if span is None:
        return scores
    lo, hi = _span_bounds(span, tuple(scores.shape[:-1]))
    pos = jnp.arange(scores.shape[-1], dtype=jnp.int32)
    return jnp.where((pos >= lo[..., None]) & (pos < hi[..., None]), scores, -jnp.inf)


def ref_span(sp_ref):
    """In a kernel: the (lo, hi) scalars of a row's span ref i32[2], or None without one."""
    return None if sp_ref is None else (sp_ref[0], sp_ref[1])


def in_span(x: Array, pos: Array, span) -> Array:
    """In a kernel: scores x at positions pos, -inf outside span = (lo, hi) (scalars), unchanged for None."""
    if span is None:
        return x
    return jnp.where((pos >= span[0]) & (pos < span[1]), x, -jnp.inf)


def check_args(scores: Array, k, K: int) -> tuple[tuple[int, ...], int, int]:
    """Validates a `topk_select` call.

    Args:
      scores: f32[..., N].
      k: int or integer array broadcastable to scores.shape[:-1].
      K: static output width (>= 1).

    Returns:
      (leading shape, N, K' = min(K, N)).
    """
    if scores.ndim < 1:
        raise ValueError(f"scores has shape {tuple(scores.shape)}: expected [..., N] with N >= 1")
    if scores.dtype != jnp.float32:
        raise ValueError(f"scores has dtype {scores.dtype}: expected float32")
    N = scores.shape[-1]
    if N < 1:
        raise ValueError(f"scores has N={N} keys per row: expected N >= 1")
    if not isinstance(K, (int, np.integer)) or isinstance(K, bool) or K < 1:
        raise ValueError(f"K={K!r}: expected a static int >= 1 (the output width)")
    lead = tuple(scores.shape[:-1])
    k_arr = jnp.asarray(k)
    if not jnp.issubdtype(k_arr.dtype, jnp.integer):
        raise ValueError(f"k has dtype {k_arr.dtype}: expected an int or an integer array")
    try:
        np.broadcast_shapes(k_arr.shape, lead)
    except ValueError:
        raise ValueError(f"k has shape {k_arr.shape}: expected a shape broadcastable to the rows "
                         f"{lead}") from None
    if np.broadcast_shapes(k_arr.shape, lead) != lead:
        raise ValueError(f"k has shape {k_arr.shape}: broadcasting it with the rows {lead} would add rows")
    return lead, N, min(int(K), N)


def distinct_counts(k, lead: tuple[int, ...]) -> Array:
    """i32[R']: k (an int or int array broadcastable to lead) at the rows' R' = R / rep distinct leading entries,
    rep the product of lead's trailing dims over which k does not vary: row r of the R = prod(lead) rows takes entry
    r // rep (`count_spec`). A decode's k of [B, 1, 1] over rows [B, Hkv, 1] stays [B] instead of a broadcast to
    every row, which was a kernel of its own in every layer of a scan (XLA does not hoist broadcasts)."""
    k = jnp.asarray(k, jnp.int32)
    shape = (1,) * (len(lead) - k.ndim) + tuple(k.shape)
    p = len(lead)
    while p and shape[p - 1] == 1:
        p -= 1
    return jnp.broadcast_to(k.reshape(shape[:p]), lead[:p]).reshape(-1)


def count_spec(k2: Array, R: int):
    """The BlockSpec of k2 i32[R', 1] (`distinct_counts`, R' dividing R) for a grid whose first axis is the R rows:
    row r reads entry r // (R / R')."""
    from jax.experimental import pallas as pl

    if R % k2.shape[0]:
        raise ValueError(f"{k2.shape[0]} counts for {R} rows: expected a divisor of the row count")
    rep = R // k2.shape[0]
    return pl.BlockSpec((None, 1), lambda r, *_: (r // rep, 0))


def row_counts(k, lead: tuple[int, ...], K: int) -> Array:
    """i32[R]: kk = clip(k, 0, K) per row (R = prod(lead)), k broadcast to the rows."""
    k_arr = jnp.broadcast_to(jnp.asarray(k, jnp.int32), lead).reshape(-1)
    return jnp.clip(k_arr, 0, K)


def check_bits(bits: int) -> int:
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits_per_pass={bits!r}: expected 1, 2, 4 or 8 (32 must be a multiple)")
    return bits


def splits_for(rows: int, n_chunks: int, target_programs: int) -> tuple[int, int]:
    """(splits S, chunks per split) so that rows * S is about `target_programs` and no split is empty."""
    want = max(1, min(n_chunks, math.ceil(target_programs / max(rows, 1))))
    per = math.ceil(n_chunks / want)
    return math.ceil(n_chunks / per), per


def radix_threshold(count_fn: Callable[[Array, Array], Array], kk: Array, N: int, bits: int):
    """Radix search of each row's threshold key.

    Args:
      count_fn: (cand: i32[R, M], active: bool[R], lo: i32[R], shift: int) -> i32[R, M], the number of keys
        >= cand[r, j] in row r for j >= 1 (column 0, c = lo, and rows with active False may hold anything);
        cand[r, j] = lo[r] + j * 2**shift (wrapping int32 arithmetic), M = 2**bits.
      kk: i32[R] keys to choose per row (0 <= kk <= N).
      N: keys per row.
      bits: bits resolved per pass.

    Returns:
      (lo: i32[R] key, done: bool[R]). For a done row (kk == 0 or count(key >= lo) == kk) the choice is
      exactly the keys >= lo (none when kk == 0); otherwise lo is the kk-th largest key t, with
      count(key > t) < kk < count(key >= t).
    """
    R = kk.shape[0]
    M = 1 << bits
    lo_u = jnp.zeros((R,), jnp.uint32)  # unsigned key (signed key ^ 0x80000000): 0 is the smallest key
    cnt_lo = jnp.full((R,), N, jnp.int32)  # count(key >= smallest key) = N
    done = (kk <= 0) | (cnt_lo == kk)
    j = jnp.arange(M, dtype=jnp.uint32)
    for p in range(32 // bits):
        shift = 32 - bits * (p + 1)
        cand_u = lo_u[:, None] + (j[None, :] << jnp.uint32(shift))
        cand = lax.bitcast_convert_type(cand_u ^ SIGN, jnp.int32)
        cnt = count_fn(cand, ~done, lax.bitcast_convert_type(lo_u ^ SIGN, jnp.int32), shift)
        # Counts fall with j and count(key >= lo) >= kk, so the last candidate still >= kk is j* =
        # (number of such, column 0 included) - 1.
        ok = (cnt >= kk[:, None]) | (j[None, :] == 0)  # column 0 may hold anything
        jstar = jnp.clip(jnp.sum(ok.astype(jnp.int32), axis=1) - 1, 0, M - 1)
        new_lo = lo_u + (jstar.astype(jnp.uint32) << jnp.uint32(shift))
        # Candidate 0 is lo itself, whose count is known (kernels may count padding there).
        new_cnt = jnp.where(jstar == 0, cnt_lo, jnp.take_along_axis(cnt, jstar[:, None], axis=1)[:, 0])
        lo_u = jnp.where(done, lo_u, new_lo)
        cnt_lo = jnp.where(done, cnt_lo, new_cnt)
        done = done | (cnt_lo == kk)
    return lax.bitcast_convert_type(lo_u ^ SIGN, jnp.int32), done


def selection_rule(lo: Array, done: Array, kk: Array) -> tuple[Array, Array, Array]:
    """Per-row rule of the compaction from the radix search's result.

    Returns:
      (a: i32[R], t: i32[R], bulk_on: i32[R]): a position is chosen if (bulk_on and key >= a) or it is
      among the first `quota` positions with key == t (quota from `split_plan`); outputs keep only scores
      > -inf. Done rows: a = lo, no ties. Other rows: a = t + 1 (bulk_on = 0 when t is the largest key,
      nothing lies above it).
    """
    t = lo
    a = jnp.where(done, lo, jnp.where(t == INT_MAX, INT_MAX, t + 1))
    bulk_on = jnp.where(done, kk > 0, t != INT_MAX).astype(jnp.int32)
    return a, t, bulk_on


def split_plan(kk: Array, done: Array, t: Array, n_ge_a: Array, n_bulk_out: Array, n_tie: Array):
    """Per-split offsets of the compaction.

    Args:
      kk: i32[R]; done: bool[R]; t: i32[R] threshold key.
      n_ge_a: i32[R, S] keys >= a per split (bulk, -inf/NaN included; 0 when bulk is off).
      n_bulk_out: i32[R, S] bulk keys that are output (score > -inf).
      n_tie: i32[R, S] keys == t per split.

    Returns:
      (quota: i32[R, S] ties split s takes (by position), base: i32[R, S] its first output slot,
       total: i32[R] positions output per row).
    """
    quota = jnp.where(done, 0, kk - jnp.sum(n_ge_a, axis=1))  # ties the row takes, ranked by position
    tie_before = jnp.cumsum(n_tie, axis=1) - n_tie
    quota_s = jnp.clip(quota[:, None] - tie_before, 0, n_tie)
    tie_out = ((t > KEY_NEG_INF) & (t <= KEY_POS_INF))[:, None]  # ties at -inf / NaN are ranked, not output
    out_s = n_bulk_out + jnp.where(tie_out, quota_s, 0)
    base = jnp.cumsum(out_s, axis=1) - out_s
    return quota_s.astype(jnp.int32), base.astype(jnp.int32), jnp.sum(out_s, axis=1).astype(jnp.int32)


def pad_output(out: Array, total: Array) -> Array:
    """Writes -1 at and after `total` in each row of out: i32[R, K]."""
    return jnp.where(jnp.arange(out.shape[1], dtype=jnp.int32)[None, :] < total[:, None], out, -1)

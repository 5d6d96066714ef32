"""Single-launch Pallas GPU (Triton) top-k selection for rows that fit in one program (N <= 32768).

One program per row (grid (R,)): it loads the whole row once (P = next power of two >= N scores, the padding
masked out), turns it into int32 keys held in registers, runs the complete radix threshold search in-kernel
(a `lax.while_loop` over passes of `bits` bits: 2**bits - 1 candidate counts per pass, two per reduction over
the row, packed in 16-bit halves; the loop stops as soon as count(key >= lo) == kk, usually well before 32 / bits
passes on continuous scores), and then compacts: one packed exclusive cumulative sum (bulk picks in the low 16
bits, threshold ties in the high 16) ranks every pick, and the positions are scattered to their output slots,
ascending; the slots after the row's last pick get -1. The whole `topk_select` is this one launch (k is clipped
in-kernel).

Cost: (2**bits - 1) * 32 / bits compare-and-adds per score at worst, plus one reduction latency per two
candidates and pass; meant for the launch-bound regime (rows of a few thousand scores: one launch instead of ~20).

Semantics: exactly `reference.topk_select_reference` (ties by position, -0.0 < +0.0, -inf and NaN ranked by
the IEEE total order and never output).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.topk_select.common import (INT_MIN, KEY_NEG_INF, KEY_POS_INF, count_spec, float_keys, in_span,
                                               ref_span, selection_rule)

Array = jax.Array

ROW_LIMIT = 1 << 15  # the packed cumulative sum holds each count in 16 bits


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _packed_counts(ind: list[Array]) -> list[Array]:
    """Sums of the 0/1 i32 vectors `ind` (each sum < 2**16), two per reduction (low and high 16 bits)."""
    out = []
    for i in range(0, len(ind), 2):
        if i + 1 < len(ind):
            both = jnp.sum(ind[i] + lax.shift_left(ind[i + 1], jnp.int32(16)))
            out += [both & 0xFFFF, lax.shift_right_logical(both, jnp.int32(16))]
        else:
            out.append(jnp.sum(ind[i]))
    return out


def _pick_candidate(counts: list[Array], kk: Array, lo: Array, cnt: Array, shift: Array):
    """(lo, cnt) after a pass: the last candidate lo + j * 2**shift whose count (falling with j) is still >= kk."""
    jstar = jnp.int32(0)
    for cj in counts:
        ge = cj >= kk
        jstar = jstar + ge.astype(jnp.int32)
        cnt = jnp.where(ge, cj, cnt)
    return lo + lax.shift_left(jstar, shift), cnt


def common_prefix_start(lower: Array, upper: Array, bits: int) -> tuple[Array, Array]:
    """Where `row_threshold` can start for keys known to lie in [lower, upper] (signed keys, lower <= upper):
    (lo0, p0), p0 the passes of `bits` bits in which every such key has the same digit (their common prefix) and
    lo0 that prefix, the rest zero bits, as the search holds it. The search's first p0 passes would pick exactly
    these digits (all the keys are at or above a candidate of the prefix's digit, none above the next), so
    starting there gives the same result in p0 fewer passes."""
    passes = 32 // bits
    diff = lower ^ upper  # the signed and unsigned views differ in the top bit of both: the same differing bits
    p0 = jnp.int32(0)
    for p in range(1, passes + 1):
        same = (diff == 0) if p * bits == 32 else (lax.shift_right_logical(diff, jnp.int32(32 - p * bits)) == 0)
        p0 = p0 + same.astype(jnp.int32)  # monotone: equal top p * bits bits imply equal top (p - 1) * bits
    keep = jnp.int32(32) - jnp.int32(bits) * p0
    mask = jnp.where(p0 == 0, jnp.int32(0), lax.shift_left(jnp.int32(-1), jnp.minimum(keep, 31)))
    mask = jnp.where(keep == 0, jnp.int32(-1), mask)
    return ((lower ^ INT_MIN) & mask) ^ INT_MIN, p0


def row_threshold(key: Array, kk: Array, n, bits: int, max_passes: int | None = None,
                  start: tuple[Array, Array] | None = None):
    """In-kernel radix search of a row's threshold key (keys held as one vector).

    Args:
      key: i32[P] keys (P < 2**16); positions that are not scores hold INT_MIN (every candidate counted is
        above INT_MIN, so they are never counted).
      kk: i32 scalar, keys to choose (0 <= kk <= n).
      n: i32 scalar or int, the row's real length (count(key >= INT_MIN) over the real keys).
      bits: bits per pass (1, 2, 4 or 8).
      max_passes: static bound of passes (default 32 / bits).
      start: None, or (lo0, p0) of `common_prefix_start` for bounds every real key lies within: the search
        starts at pass p0 from lo0 (the same result, p0 passes sooner).

    Returns:
      (lo: i32, cnt: i32 = count(key >= lo), done: bool). Done (kk == 0 or cnt == kk): the choice is the keys
      >= lo. Otherwise lo = t, the kk-th largest key, with count(key > t) < kk < count(key >= t).
    """
    passes = 32 // bits if max_passes is None else max_passes
    (lo, cnt), = _searches(key, (kk,), n, bits, passes, None if start is None else (start,))
    return lo, cnt, (kk <= 0) | (cnt == kk)


def row_threshold_pair(key: Array, kk1: Array, kk2: Array, n, bits: int):
    """`row_threshold` of one row for two targets at once, as (lo1, lo2): one loop whose passes count both
    targets' candidates in shared packed reductions ((2**bits - 1) * 2 counts, two a reduction), instead of two
    loops one after the other."""
    (lo1, _), (lo2, _) = _searches(key, (kk1, kk2), n, bits, 32 // bits, None)
    return lo1, lo2


def _searches(key: Array, kks: tuple, n, bits: int, passes: int, starts: tuple | None) -> list[tuple[Array, Array]]:
    """The radix searches of `row_threshold` for each target kk in kks over the same keys, in one loop: each pass
    counts every live target's candidates in shared packed reductions. A target is live until its own search would
    stop (after `passes` passes, or count == kk, or kk <= 0) and stays where it stopped. starts: None, or one
    (lo0, p0) a target. Returns [(lo, count(key >= lo))] a target."""
    M = 1 << bits
    n = jnp.asarray(n, jnp.int32)
    starts = starts or ((jnp.int32(INT_MIN), jnp.int32(0)),) * len(kks)

    def live(st, kk):
        p, _, cnt = st
        return (p < passes) & (cnt != kk) & (kk > 0)

    def cond(c):
        return functools.reduce(jnp.logical_or, [live(st, kk) for st, kk in zip(c, kks)])

    def body(c):
        # Candidate j is lo + j * 2**shift (wrapping: the keys' unsigned order is their signed order + 2**31).
        shifts = [jnp.int32(32 - bits) - jnp.int32(bits) * p for p, _, _ in c]
        counts = _packed_counts([(key >= lo + lax.shift_left(jnp.int32(j), sh)).astype(jnp.int32)
                                 for (_, lo, _), sh in zip(c, shifts) for j in range(1, M)])
        out = []
        for i, ((p, lo, cnt), kk, sh) in enumerate(zip(c, kks, shifts)):
            new_lo, new_cnt = _pick_candidate(counts[i * (M - 1):(i + 1) * (M - 1)], kk, lo, cnt, sh)
            on = live((p, lo, cnt), kk)
            out.append((p + on.astype(jnp.int32), jnp.where(on, new_lo, lo), jnp.where(on, new_cnt, cnt)))
        return tuple(out)

    final = lax.while_loop(cond, body, tuple((p0, lo0, n) for lo0, p0 in starts))
    return [(lo, cnt) for _, lo, cnt in final]


def row_pick_mask(key: Array, cand: Array, kk: Array, n, bits: int) -> Array:
    """In-kernel exact top-kk of a row held in registers, as a mask: bool[P] over the candidates `cand`.

    key: i32[P] keys (`float_keys`) with INT_MIN at every position that is not a candidate; kk: i32 scalar,
    0 <= kk <= n; n: the number of candidates. Ties at the threshold are taken by position (lowest first), as
    `reference.topk_select_reference`. The keys must be finite scores (no -inf / NaN candidates)."""
    lo, _, done = row_threshold(key, kk, n, bits)
    a, _, on = selection_rule(lo, done, kk)
    bulk = (key >= a) & (on > 0) & cand
    tie = ((key == lo) & cand & jnp.logical_not(done)).astype(jnp.int32)
    quota = jnp.where(done, 0, kk - jnp.sum(bulk.astype(jnp.int32)))
    tie_before = jnp.cumsum(tie) - tie
    return bulk | ((tie > 0) & (tie_before < quota))


def row_picks(key: Array, valid: Array, kk: Array, n, bits: int, width: int):
    """In-kernel exact top-kk of keys held in registers, ranked for an ascending output.

    key: i32[P] keys (`float_keys`), INT_MIN where not valid; valid: bool[P] the candidates, in output order;
    kk: i32 scalar, 0 <= kk <= n; n: the number of candidates; width: the output width.
    Returns (sel bool[P]: the picks that are written (-inf / NaN picks ranked, not written), dst i32[P]: each
    pick's output slot, total: i32 picks written). The selection rule is `common.selection_rule`; the picks are
    ranked by one packed exclusive scan (bulk picks in the low 16 bits, threshold ties in the high 16)."""
    lo, _, done = row_threshold(key, kk, n, bits)
    a, t, on = selection_rule(lo, done, kk)
    bulk = (key >= a) & (on > 0) & valid
    tie = (key == t) & valid & jnp.logical_not(done)
    quota = jnp.where(done, 0, kk - jnp.sum(bulk.astype(jnp.int32)))  # ties taken, by position
    fin = valid & (key > KEY_NEG_INF) & (key <= KEY_POS_INF)  # scores > -inf (no NaN): x is not kept live
    tie_out = (t > KEY_NEG_INF) & (t <= KEY_POS_INF)  # ties at -inf / NaN are ranked, not output
    bulk_out = bulk & fin
    packed = bulk_out.astype(jnp.int32) + lax.shift_left(tie.astype(jnp.int32), jnp.int32(16))
    before = jnp.cumsum(packed) - packed  # exclusive: (#bulk_out before) + (#tie before) << 16
    bulk_before = before & 0xFFFF
    tie_before = lax.shift_right_logical(before, jnp.int32(16))
    take = tie & tie_out & (tie_before < quota)
    sel = bulk_out | take
    dst = bulk_before + jnp.where(tie_out, jnp.minimum(tie_before, quota), 0)
    sel = sel & (dst < width)  # always true (total <= kk <= width)
    n_tie = jnp.sum(tie.astype(jnp.int32))
    total = jnp.sum(bulk_out.astype(jnp.int32)) + jnp.where(tie_out, jnp.minimum(n_tie, quota), 0)
    return sel, dst, total


def _row_kernel(k_ref, x_ref, *refs, n: int, P: int, bits: int, width: int, wpad: int, spanned: bool = False):
    """One row. Refs: k i32[1] (the row's k, unclipped); x f32[N] the row; (spanned: sp i32[2] the row's span
    (lo, hi), -inf outside); o i32[width] the row's output."""
    sp_ref, o_ref = refs if spanned else (None, *refs)
    kk = jnp.clip(k_ref[0], 0, width)
    pos = jnp.arange(P, dtype=jnp.int32)
    ok = pos < n
    x = in_span(plgpu.load(x_ref.at[pl.ds(0, P)], mask=ok, other=0.0), pos, ref_span(sp_ref))
    key = jnp.where(ok, float_keys(x), INT_MIN)  # padding: below every candidate above INT_MIN
    sel, dst, total = row_picks(key, ok, kk, n, bits, width)
    # Masked lanes point past the row (never written; the interpreter drops them as out of bounds).
    plgpu.store(o_ref.at[jnp.where(sel, dst, width)], pos, mask=sel)
    slot = jnp.arange(wpad, dtype=jnp.int32)
    plgpu.store(o_ref.at[pl.ds(0, wpad)], jnp.full((wpad,), -1, jnp.int32),
                mask=(slot >= total) & (slot < width))


def row_warps(P: int) -> int:
    """Default warps of a row program: about 32 keys per thread, 4 to 16 warps."""
    return max(4, min(16, P // 1024))


def topk_select_rows(x: Array, k_rows: Array, K: int, *, bits: int = 2, num_warps: int | None = None,
                     span: Array | None = None, interpret: bool = False) -> Array:
    """Single-launch selection of every row.

    Args:
      x: f32[R, N] scores, N <= ROW_LIMIT.
      k_rows: i32[R'] keys to keep (row r's at r // (R / R'), `common.distinct_counts`; clipped to [0, K]
        in-kernel).
      K: output width (<= N).
      bits: radix bits per in-kernel pass (1, 2, 4 or 8).
      num_warps: warps per program (None: `row_warps`).
      span: i32[R, 2] (lo, hi) or None: the scores outside a row's [lo, hi) count as -inf (`common.mask_span`).
      interpret: Pallas interpreter (CPU tests).

    Returns:
      int32[R, K]: the chosen positions ascending, then -1.
    """
    R, N = x.shape
    if N > ROW_LIMIT:
        raise ValueError(f"N={N} scores per row: the single-launch kernel takes N <= {ROW_LIMIT}")
    if not 1 <= K <= N:
        raise ValueError(f"K={K}: expected 1 <= K <= N={N}")
    P = max(32, next_pow2(N))
    k2 = k_rows.reshape(-1, 1).astype(jnp.int32)
    warps = row_warps(P) if num_warps is None else num_warps
    spanned = span is not None
    return pl.pallas_call(
        functools.partial(_row_kernel, n=N, P=P, bits=bits, width=K, wpad=max(32, next_pow2(K)), spanned=spanned),
        grid=(R,),
        in_specs=[count_spec(k2, R), pl.BlockSpec((None, N), lambda r: (r, 0))]
        + ([pl.BlockSpec((None, 2), lambda r: (r, 0))] if spanned else []),
        out_specs=pl.BlockSpec((None, K), lambda r: (r, 0)),
        out_shape=jax.ShapeDtypeStruct((R, K), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret, name="topk_select_row",
    )(k2, x, *([span] if spanned else []))

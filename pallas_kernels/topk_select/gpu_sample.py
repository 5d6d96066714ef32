"""Pallas GPU (Triton) top-k selection for long rows by sampling: a bracket of the threshold from a sample of
the row, one pass that keeps the scores inside the bracket, and the exact threshold among those.

Five launches, three of which read the row (each with a few comparisons per score), instead of the fused
path's 32 / bits counting passes of 2**bits comparisons each:
  1. `_sample_kernel` (one program per row): the keys of `sample` scores, one at a hashed offset inside each of
     `sample` equal strata of the row (`sample_positions`: the whole row is covered, and a periodic row, such as
     a cache of tiled keys, is not aliased by a fixed stride), held in registers; the exact in-register radix
     search finds two sample keys A >= B around the sample rank that corresponds to kk (kk * sample / N, +-
     `sigmas` binomial standard deviations + 8), both in one loop (`gpu_row.row_threshold_pair`).
  2. `_band_kernel` (row x split): counts per split the keys > A, == A and == B (B < A), and appends every key
     strictly between B and A to the row's band buffer (capacity `cap`; slots reserved with one atomic add per
     chunk, so the band's order is arbitrary, which does not matter for a threshold).
  3. `_resolve_kernel` (one program per row): with G = #(key > A), E_A = #(key == A), Bn the band's count and
     E_B = #(key == B), the kk-th largest key t is A when G < kk <= G + E_A, the (kk - G - E_A)-th largest of
     the band when the band fits and G + E_A < kk <= G + E_A + Bn (the in-register radix search over the band
     gives it exactly; it starts after the common prefix of the band's bounds B + 1 and A - 1,
     `gpu_row.common_prefix_start`: on continuous scores most of its passes; a band taken whole is the keys > B),
     and B when the next E_B ranks hold kk. So ties at either end of the bracket, however
     many, never fill the band. Otherwise (a bracket the sample missed, a band over `cap`: rare, even for rows
     of a few distinct values) the program runs the streaming radix search over its whole row
     (`gpu_fused.count_digits`, 4 bits a pass): slow (one program reads its row 8 times) but exact, so no input
     is wrong. It writes the row's rule (a, t, bulk_on, done).
  4. `gpu_fused.rule_counts` per split and 5. `gpu_fused._compact_kernel`: the fused path's compaction. With one
     split per row (rows x chunks past `target_programs`, as TokenButler's 3840 rows of 100K) the band kernel counts
     its row's band in a register, the resolve kernel also gives each row its tie quota (kk - #key > t, from the
     counts it has), and one program compacts each whole row (`gpu_fused.compact_rows`): 4 launches.

Semantics: exactly `reference.topk_select_reference` (every path ends in the same threshold rule).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.topk_select import gpu_fused
from pallas_kernels.topk_select.common import (INT_MAX, INT_MIN, count_spec, float_keys, in_span, ref_span,
                                               selection_rule)
from pallas_kernels.topk_select.gpu_row import common_prefix_start, row_threshold, row_threshold_pair

Array = jax.Array


BAND_MARGIN = 1.25  # band capacity over the expected band (`band_capacity`)


def rank_halfwidth(r: float, sample: int, sigmas: float) -> float:
    """The bracket's half-width in sample ranks around sample rank r: `sigmas` binomial standard deviations plus
    8, as `_sample_kernel` computes it in-kernel (here in Python, to size buffers)."""
    return sigmas * math.sqrt(max(r * (1.0 - r / sample), 0.0)) + 8.0


def band_capacity(K: int, N: int, sample: int, sigmas: float) -> int:
    """The band capacity for rows of N scores and k <= K: a power of two >= BAND_MARGIN times the keys expected
    strictly inside the bracket, at least 1024 and at most 32768.

    The bracket's two sample keys lie about 2 m sample ranks apart (m = sigmas sd of the sample rank, plus 8, as
    `_sample_kernel` draws them; here the largest m of any k <= K), and each sample rank stands for N / sample
    keys of the row (one sample per stratum), so about 2 m N / sample keys fall strictly between them, whatever
    the scores' distribution (ties at either end are counted apart, never stored). A band over the capacity is
    still exact: that row takes the streaming fallback. The resolve kernel searches all `cap` slots, so a tight
    capacity is what makes it fast (Kascade's anchors at 100K, k 10%: 8192 slots for about 6,100 keys at the
    default sample of 2048, 4096 slots for about 2,850 keys at 8192, against the 16384 that were the fixed
    default)."""
    m = rank_halfwidth(min(min(K, N) * sample / N, sample / 2), sample, sigmas)  # the widest of any k <= K
    want = BAND_MARGIN * 2.0 * m * N / sample
    return min(32768, max(1024, 1 << max(0, math.ceil(math.log2(max(want, 1.0))))))


def sample_positions(n: int, ns: int) -> Array:
    """i32[ns]: one position in each of ns strata [floor(i * n / ns), floor((i + 1) * n / ns)) of a row of n
    (n >= ns), at an offset given by an integer hash of i: the sample covers the whole row, and no fixed stride
    aliases with a periodic row. Exact int32 arithmetic (ns <= 32768), the same in a kernel and in jnp."""
    q, rem = divmod(n, ns)
    i = jnp.arange(ns, dtype=jnp.int32)
    start = i * q + (i * rem) // ns  # floor(i * n / ns) without overflow: i * rem < ns**2 <= 2**30
    width = q + ((i + 1) * rem) // ns - (i * rem) // ns  # q or q + 1 (>= 1)
    h = i * jnp.int32(-1640531535)  # 0x9E3779B1 (wrapping int32 products: a murmur-style mix)
    h = h ^ lax.shift_right_logical(h, jnp.int32(16))
    h = h * jnp.int32(-2048144789)  # 0x85EBCA6B
    h = h ^ lax.shift_right_logical(h, jnp.int32(13))
    return start + lax.rem(lax.shift_right_logical(h, jnp.int32(1)), width)


def _sample_kernel(k_ref, x_ref, *refs, n: int, width: int, ns: int, bits: int, sigmas: float,
                   upper: bool = True, spanned: bool = False, zero_count: bool = False):
    """Row r. Refs: k i32[1]; x f32[N]; (spanned: sp i32[2] the row's span (lo, hi), -inf outside); o i32[4] =
    (A, B, above_on, 0); (zero_count: z i32[1], set to 0: the band kernel's count, which its splits add to
    atomically, so it needs no zeros of XLA's, a fill and a copy of their own). upper=False: no A (above_on 0; the
    bracket is every key above B, `gpu_ordered`)."""
    if zero_count:
        *refs, z_ref = refs
        z_ref[...] = jnp.zeros((1,), jnp.int32)
    sp_ref, o_ref = refs if spanned else (None, *refs)
    kk = jnp.clip(k_ref[0], 0, width)
    at = sample_positions(n, ns)
    key = float_keys(in_span(plgpu.load(x_ref.at[at]), at, ref_span(sp_ref)))
    r = kk.astype(jnp.float32) * (ns / n)
    m = sigmas * jnp.sqrt(jnp.maximum(r * (1.0 - r / ns), 0.0)) + 8.0
    r_hi = jnp.clip(jnp.floor(r - m), 0, ns).astype(jnp.int32) if upper else jnp.int32(0)
    r_lo = jnp.clip(jnp.ceil(r + m), 0, ns).astype(jnp.int32)
    if upper:  # count(sample key >= A) ~ r_hi; r_lo = ns: B = INT_MIN (every key)
        a_key, b_key = row_threshold_pair(key, r_hi, r_lo, ns, bits)
    else:
        a_key, (b_key, _, _) = jnp.int32(0), row_threshold(key, r_lo, ns, bits)
    lane = jnp.arange(4, dtype=jnp.int32)
    o_ref[...] = jnp.where(lane == 0, a_key, jnp.where(lane == 1, b_key, jnp.where(lane == 2, r_hi > 0, 0)))


def _band_kernel(br_ref, x_ref, *refs, n: int, block_n: int, per_split: int, cap: int, whole_row: bool = False,
                 spanned: bool = False):
    """(row, split). Refs: br i32[4] the bracket; x f32[N]; (spanned: sp i32[2] the row's span (lo, hi), -inf
    outside); cnt i32[1] the row's band count (zero in, aliased out, atomically added); band i32[cap] the row's band
    keys (B < key < A; key > B when A is off); o i32[4] this split's counts (#key > A, #key == A, #key == B below
    A, 0) (the A counts 0 when A is off).

    whole_row (one split per row: many rows, as TokenButler's every layer and head at once): the program owns its
    row's band, so it counts the slots in a register and stores the count once, where the splits of a row reserve
    theirs with an atomic add per chunk (a round trip to memory before each chunk's stores); the same slots."""
    sp_ref, _, cnt_ref, band_ref, o_ref = refs if spanned else (None, *refs)  # the count's input is aliased
    span = ref_span(sp_ref)
    a_key, b_key, on = br_ref[0], br_ref[1], br_ref[2] > 0
    first, count = gpu_fused._split_chunks(n, block_n, per_split)

    def body(i, acc):
        _, ok, x = gpu_fused._chunk(x_ref, first + i, block_n, n, span)
        key = float_keys(x)
        at_a = ok & on & (key >= a_key)
        below = ok & jnp.logical_not(at_a)
        band = below & (key > b_key)
        b32 = band.astype(jnp.int32)
        nb = jnp.sum(b32)
        gt, eq_a, eq_b, used = acc
        base = used if whole_row else plgpu.atomic_add(cnt_ref, (jnp.int32(0),), nb)
        dst = base + jnp.cumsum(b32) - b32
        keep = band & (dst < cap)
        plgpu.store(band_ref.at[jnp.where(keep, dst, cap)], key, mask=keep)
        return (gt + (at_a & (key > a_key)).astype(jnp.int32), eq_a + (at_a & (key == a_key)).astype(jnp.int32),
                eq_b + (below & (key == b_key)).astype(jnp.int32), used + nb)

    zero = jnp.zeros((block_n,), jnp.int32)
    gt, eq_a, eq_b, used = lax.fori_loop(jnp.int32(0), count, body, (zero, zero, zero, jnp.int32(0)))
    if whole_row:
        cnt_ref[...] = jnp.full((1,), used, jnp.int32)
    lane = jnp.arange(4, dtype=jnp.int32)
    o_ref[...] = jnp.where(lane == 0, jnp.sum(gt), jnp.where(lane == 1, jnp.sum(eq_a),
                                                             jnp.where(lane == 2, jnp.sum(eq_b), 0)))


def _resolve_kernel(k_ref, c_ref, cnt_ref, band_ref, br_ref, x_ref, *refs, n: int, width: int, cap: int,
                    bits: int, block_n: int, with_quota: bool = False, spanned: bool = False):
    """Row r. Refs: k i32[1]; c i32[S, 4] the splits' counts (#key > A, #key == A, #key == B below A, 0); cnt
    i32[1] the band count; band i32[cap]; br i32[4] the bracket (A, B, above_on, 0); x f32[N] (read by the
    fallback); (spanned: sp i32[2] the row's span); out r i32[4] = (a, t, bulk_on, done), or with_quota i32[8] =
    (a, t, bulk_on, done, quota, 0, 0, 0):
    the ties == t the row takes, kk - #(key > t), from the counts this kernel has (#key > A, #key > B, the band
    above t; a row of the fallback counts its keys > t in one more pass), for `gpu_fused.compact_rows`."""
    sp_ref, r_out = refs if spanned else (None, *refs)
    span = ref_span(sp_ref)
    kk = jnp.clip(k_ref[0], 0, width)
    c = jnp.sum(c_ref[...], axis=0)
    lane = jnp.arange(4, dtype=jnp.int32)
    gt_a = jnp.sum(jnp.where(lane == 0, c, 0))
    ge_a = gt_a + jnp.sum(jnp.where(lane == 1, c, 0))
    n_band = cnt_ref[0]
    gt_b = ge_a + n_band  # #key > B (B < A, or A off)
    ge_b = gt_b + jnp.sum(jnp.where(lane == 2, c, 0))
    a_key, b_key = br_ref[0], br_ref[1]
    at_a = (gt_a < kk) & (kk <= ge_a)  # t = A (never when A is off: then ge_a = 0)
    in_band = (ge_a < kk) & (kk <= gt_b) & (n_band <= cap)
    at_b = (gt_b < kk) & (kk <= ge_b)  # t = B
    ok = (kk <= 0) | at_a | in_band | at_b
    need = kk - ge_a
    slot = jnp.arange(cap, dtype=jnp.int32)
    band = plgpu.load(band_ref.at[pl.ds(0, cap)], mask=slot < n_band, other=INT_MIN)
    band = jnp.where(slot < n_band, band, INT_MIN)
    # Every band key lies in [B + 1, A - 1]: the search starts after the passes of their common prefix.
    lo0, p0 = common_prefix_start(jnp.where(b_key == INT_MAX, INT_MAX, b_key + 1),
                                  jnp.where(br_ref[2] > 0, a_key - 1, INT_MAX), bits)
    start = (jnp.where(in_band, lo0, INT_MIN), jnp.where(in_band, p0, 0))
    lo, _, done = row_threshold(band, jnp.where(in_band, need, 0), jnp.where(in_band, n_band, 0), bits, start=start)
    # A band search done at or below B + 1 (every band key taken, need = n_band: the search may stop at its start,
    # below B) means the keys >= B + 1 of the whole row, not the keys at or below B as well.
    lo = jnp.where(in_band & done, jnp.maximum(lo, b_key + 1), lo)
    lo = jnp.where(at_a, a_key, jnp.where(at_b, b_key, lo))
    done = jnp.where(at_a, kk == ge_a, jnp.where(at_b, kk == ge_b, done))

    # Fallback: the streaming radix search over the whole row, in this one program.
    lo_f, cnt_f = gpu_fused.stream_threshold(x_ref, kk, jnp.logical_not(ok), n=n, block_n=block_n, span=span)
    lo = jnp.where(ok, lo, lo_f)
    done = jnp.where(ok, done | (kk <= 0), (kk <= 0) | (cnt_f == kk))
    a, t, on = selection_rule(lo, done, kk)
    if not with_quota:
        r_out[...] = jnp.where(lane == 0, a, jnp.where(lane == 1, t, jnp.where(lane == 2, on, done)))
        return
    # #(key > t) of a row that is not done (t = lo; a = t + 1 with the bulk on, none above t otherwise).
    band_gt = jnp.sum(((band > lo) & (slot < n_band)).astype(jnp.int32))
    recount = jnp.logical_not(ok) & jnp.logical_not(done)
    gt_f, _, _ = gpu_fused.rule_totals(x_ref, jnp.int32(0), jnp.where(recount, jnp.int32(pl.cdiv(n, block_n)),
                                                                      jnp.int32(0)), a, t, on, done, n=n,
                                       block_n=block_n, span=span)
    n_gt = jnp.where(at_a, gt_a, jnp.where(in_band, ge_a + band_gt, jnp.where(at_b, gt_b, gt_f)))
    quota = jnp.where(done, 0, kk - n_gt)
    lane8 = jnp.arange(8, dtype=jnp.int32)
    r_out[...] = jnp.where(lane8 == 0, a, jnp.where(lane8 == 1, t, jnp.where(lane8 == 2, on, jnp.where(
        lane8 == 3, done, jnp.where(lane8 == 4, quota, 0)))))


def topk_select_sample(x: Array, k_rows: Array, K: int, *, sample: int = 4096, sigmas: float = 4.0,
                       cap: int | None = None, bits: int = 2, block_n: int = 1024, target_programs: int = 1024,
                       num_warps: int = 4, span: Array | None = None, interpret: bool = False) -> Array:
    """Selection of every row by sampling (module docstring).

    Args:
      x: f32[R, N] scores (N >= sample); k_rows: i32[R'] keys to keep (row r's at r // (R / R'),
        `common.distinct_counts`; clipped to [0, K] in-kernel); K: width <= N.
      sample: sampled scores per row (`sample_positions`; a power of two, <= 32768); sigmas: bracket
        half-width in standard deviations of the sample rank; cap: band capacity per row (a power of two,
        <= 32768); bits: radix bits of the in-register searches; block_n: scores per inner iteration of the
        streaming kernels (a power of two); target_programs: about rows x splits per streaming launch;
        num_warps: warps per program; span: i32[R, 2] (lo, hi) or None: the scores outside a row's [lo, hi) count
        as -inf (`common.mask_span`), read in place by every launch (a masked copy of the rows was an XLA pass
        over them: 63 us for H2O's 256 rows of 100K at batch 1 on an H100, eval/results/h100/profile_b1/).
      interpret: Pallas interpreter (CPU tests).

    Returns:
      int32[R, K]: the chosen positions ascending, then -1.
    """
    R, N = x.shape
    cap = band_capacity(K, N, sample, sigmas) if cap is None else cap
    for name, v in (("sample", sample), ("cap", cap), ("block_n", block_n)):
        if v < 32 or v & (v - 1) or (name != "block_n" and v > 32768):
            raise ValueError(f"{name}={v}: expected a power of two in [32, 32768]")
    if N < sample:
        raise ValueError(f"N={N} scores per row: the sampling path needs N >= sample={sample}")
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=2)
    k2 = k_rows.reshape(-1, 1).astype(jnp.int32)
    bracket, counts, n_band, band = sample_band(x, k2, K, sample=sample, sigmas=sigmas, cap=cap, bits=bits,
                                                block_n=block_n, target_programs=target_programs, params=params,
                                                span=span, interpret=interpret)
    S = counts.shape[1]
    whole_rows = S == 1  # one program per row (many rows): the compaction ranks whole rows from the rule alone
    w = 8 if whole_rows else 4
    row1 = lambda w: pl.BlockSpec((None, w), lambda r: (r, 0))  # noqa: E731
    spanned = span is not None
    rule = pl.pallas_call(
        functools.partial(_resolve_kernel, n=N, width=K, cap=cap, bits=bits, block_n=block_n, with_quota=whole_rows,
                          spanned=spanned),
        grid=(R,), in_specs=[count_spec(k2, R), pl.BlockSpec((None, S, 4), lambda r: (r, 0, 0)), row1(1), row1(cap),
                             row1(4), row1(N)] + ([row1(2)] if spanned else []),
        out_specs=row1(w), out_shape=jax.ShapeDtypeStruct((R, w), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=max(4, min(16, cap // 1024)), num_stages=1),
        interpret=interpret, name="topk_select_resolve")(k2, counts, n_band, band, bracket, x,
                                                          *([span] if spanned else []))
    if whole_rows:
        return gpu_fused.compact_rows(x, rule, K, block_n=block_n, params=params, span=span, interpret=interpret)
    return gpu_fused.compact_with_rule(x, k2, rule, K, block_n=block_n, target_programs=target_programs,
                                       params=params, span=span, interpret=interpret)


def sample_bracket(x: Array, k2: Array, K: int, *, sample: int, sigmas: float, bits: int, upper: bool = True,
                   span: Array | None = None, zero_count: bool = False, interpret: bool = False):
    """Launch 1 (`_sample_kernel`): i32[R, 4] = (A, B, above_on, 0) per row of x f32[R, N]; k2 i32[R', 1] (row r's
    k at r // (R / R')); span i32[R, 2] (lo, hi) or None (the scores outside a row's [lo, hi) count as -inf).
    zero_count: also i32[R, 1] zeros (the band kernel's count), as (bracket, zeros)."""
    R, N = x.shape
    row1 = lambda w: pl.BlockSpec((None, w), lambda r: (r, 0))  # noqa: E731
    spanned = span is not None
    out = pl.pallas_call(
        functools.partial(_sample_kernel, n=N, width=K, ns=sample, bits=bits, sigmas=sigmas, upper=upper,
                          spanned=spanned, zero_count=zero_count),
        grid=(R,), in_specs=[count_spec(k2, R), row1(N)] + ([row1(2)] if spanned else []),
        out_specs=[row1(4)] + ([row1(1)] if zero_count else []),
        out_shape=[jax.ShapeDtypeStruct((R, 4), jnp.int32)] + ([jax.ShapeDtypeStruct((R, 1), jnp.int32)]
                                                                if zero_count else []),
        compiler_params=plgpu.CompilerParams(num_warps=max(4, min(16, sample // 1024)), num_stages=1),
        interpret=interpret, name="topk_select_sample")(k2, x, *([span] if spanned else []))
    return tuple(out) if zero_count else out[0]


def sample_band(x: Array, k2: Array, K: int, *, sample: int, sigmas: float, cap: int, bits: int, block_n: int,
                target_programs: int, params, span: Array | None = None, interpret: bool = False):
    """Launches 1 and 2: (bracket i32[R, 4] = (A, B, above_on, 0), counts i32[R, S, 4] the splits' (#key > A,
    #key == A, #key == B below A, 0), n_band i32[R, 1] the keys strictly between B and A, band i32[R, cap] their
    keys). With G, E_A, E_B the counts summed over the splits and Bn = n_band[r], row r resolves without the
    fallback when G < kk <= G + E_A + Bn + E_B and, if G + E_A < kk <= G + E_A + Bn, Bn <= cap. span: i32[R, 2] or
    None, as `topk_select_sample`'s."""
    R, N = x.shape
    row2 = lambda w: pl.BlockSpec((None, w), lambda r, s: (r, 0))  # noqa: E731
    bracket, zeros = sample_bracket(x, k2, K, sample=sample, sigmas=sigmas, bits=bits, zero_count=True, span=span,
                                    interpret=interpret)
    S, per = gpu_fused.pow2_splits(R, pl.cdiv(N, block_n), target_programs)
    spanned = span is not None
    n_band, band, counts = pl.pallas_call(
        functools.partial(_band_kernel, n=N, block_n=block_n, per_split=per, cap=cap, whole_row=S == 1,
                          spanned=spanned),
        grid=(R, S), in_specs=[row2(4), row2(N)] + ([row2(2)] if spanned else []) + [row2(1)],
        out_specs=(row2(1), row2(cap), pl.BlockSpec((None, None, 4), lambda r, s: (r, s, 0))),
        out_shape=(jax.ShapeDtypeStruct((R, 1), jnp.int32), jax.ShapeDtypeStruct((R, cap), jnp.int32),
                   jax.ShapeDtypeStruct((R, S, 4), jnp.int32)),
        input_output_aliases={3 if spanned else 2: 0},
        compiler_params=params, interpret=interpret, name="topk_select_band",
    )(bracket, x, *([span] if spanned else []), zeros)
    return bracket, counts, n_band, band

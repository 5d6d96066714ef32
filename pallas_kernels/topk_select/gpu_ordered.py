"""Pallas GPU (Triton) top-k selection for long rows and small k: a sampled lower bound, ONE pass over the row that
keeps every score above it in position order, and the selection made from those alone.

Three launches, one of which reads the row:
  1. `gpu_sample._sample_kernel` with no upper end (one program per row): B, a sample key below the threshold
     (the sample rank kk * sample / N + `sigmas` binomial standard deviations + 8).
  2. `_band_kernel` (one program per row, its chunks in order): appends the position of every score with key > B
     to the row's band (capacity `cap`) at a running offset, so the band is in ascending position order without
     atomics, and counts the keys == B. Positions only: storing each key beside its position doubled the
     scattered stores, which were most of this pass (H200: H2O's 1024 rows x 100K 718 -> 639 us for the whole
     selection, eval/results/h200/h2o_1202/).
  3. `_select_kernel` (one program per row): gathers the band's scores by position. With Bn keys in the band,
     when kk <= Bn <= cap the band holds every
     key >= the kk-th largest, so `gpu_row.row_picks` over the band (what `gpu_row`'s kernel does over a whole row:
     the in-register radix search gives the threshold t, one packed cumulative sum ranks the picks, keys > t then
     the first ties == t by position) selects them, written ascending. Otherwise (t == B, a
     bound the sample put too high, a band over `cap`: rare on continuous scores) the program streams over its
     row: t from the streaming radix search (`gpu_fused.stream_threshold`; B itself when it holds rank kk), one
     counting pass and the compaction (`gpu_fused.compact_chunks`): slow but exact, so no input is wrong.

Against "sample" (5 launches: the bracket, the band, its resolution, a counting pass and the compaction, the last
two reading the row again on a grid of row splits) this reads each row once after the sample; it needs one program
per row to keep the band ordered, so it is meant for many rows (every layer's rows of a step at once, as the STS
draft's record after its layer scan) or for rows whose programs stream fast enough alone. The band must hold
about kk + 2 (sigmas sd + 8) N / sample keys: `band_capacity` sizes it from K.

Semantics: exactly `reference.topk_select_reference` (ties by position, -0.0 < +0.0, -inf and NaN ranked by the
IEEE total order and never output).
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
from pallas_kernels.topk_select.common import (INT_MIN, KEY_NEG_INF, KEY_POS_INF, count_spec, float_keys, in_span,
                                               ref_span, selection_rule)
from pallas_kernels.topk_select.gpu_row import ROW_LIMIT, next_pow2, row_picks
from pallas_kernels.topk_select.gpu_sample import rank_halfwidth, sample_bracket

Array = jax.Array


def band_capacity(K: int, N: int, sample: int, sigmas: float) -> int:
    """The band capacity for rows of N scores and k <= K: a power of two >= K + 2 (sigmas sd + 8) N / sample (the
    keys above a lower bound drawn `sigmas` standard deviations of the sample rank below k, plus the same again
    for the spread of the count), at least 1024 and at most ROW_LIMIT (a row whose band overflows it takes the
    exact streaming fallback)."""
    m = rank_halfwidth(K * sample / N, sample, sigmas)
    return min(ROW_LIMIT, max(1024, next_pow2(int(math.ceil(K + 2.0 * m * N / sample)))))


def _band_kernel(br_ref, x_ref, *refs, n: int, block_n: int, cap: int, skip_empty: bool, spanned: bool = False):
    """Row r. Refs: br i32[4] = (A, B, above_on, 0) (only B read); x f32[N]; (spanned: sp i32[2] the row's span,
    -inf outside); outputs nb i32[1] the keys > B (all counted, at most cap stored), eq i32[1] the keys == B,
    pos i32[cap] the band's positions in ascending order (not their keys: the scattered stores were most of this
    pass, and the select kernel gathers the band's scores by position, eval/results/h200/h2o_1202/). skip_empty:
    rank and store only in chunks that hold a band key."""
    sp_ref, nb_ref, eq_ref, pos_ref = refs if spanned else (None, *refs)
    span = ref_span(sp_ref)
    b_key = br_ref[1]

    def append(run, pos, band):
        b32 = band.astype(jnp.int32)
        dst = run + jnp.cumsum(b32) - b32
        keep = band & (dst < cap)
        slot = jnp.where(keep, dst, cap)  # masked lanes point past the band (never written)
        plgpu.store(pos_ref.at[slot], pos, mask=keep)

    def body(c, carry):
        run, eq = carry
        pos, ok, x = gpu_fused._chunk(x_ref, c, block_n, n, span)
        key = float_keys(x)
        band = ok & (key > b_key)
        nb = jnp.sum(band.astype(jnp.int32))
        if skip_empty:
            lax.cond(nb > 0, lambda: append(run, pos, band), lambda: None)
        else:
            append(run, pos, band)
        return run + nb, eq + jnp.sum((ok & (key == b_key)).astype(jnp.int32))

    run, eq = lax.fori_loop(jnp.int32(0), jnp.int32(pl.cdiv(n, block_n)), body, (jnp.int32(0), jnp.int32(0)))
    nb_ref[...] = jnp.reshape(run, (1,))
    eq_ref[...] = jnp.reshape(eq, (1,))


def _select_kernel(k_ref, br_ref, nb_ref, eq_ref, pos_ref, x_ref, *refs, n: int, width: int, cap: int, bits: int,
                   block_n: int, wpad: int, spanned: bool = False):
    """Row r. Refs: k i32[1]; br i32[4] the bound (B at 1); nb, eq i32[1]; pos i32[cap] the band's positions; x
    f32[N] (the band's scores gathered from it by position; the whole row read only when the band cannot decide);
    (spanned: sp i32[2] the row's span); out o i32[width]."""
    sp_ref, o_ref = refs if spanned else (None, *refs)
    span = ref_span(sp_ref)
    kk = jnp.clip(k_ref[0], 0, width)
    b_key, n_band, eq_b = br_ref[1], nb_ref[0], eq_ref[0]
    in_band = (kk <= n_band) & (n_band <= cap)  # the band holds every key >= the kk-th largest

    slot = jnp.arange(cap, dtype=jnp.int32)
    n_in = jnp.where(in_band, n_band, 0)
    valid = slot < n_in
    pos = plgpu.load(pos_ref.at[pl.ds(0, cap)], mask=valid, other=0)
    # The band's scores gathered by position, masked to the span again: a bound B at or below the key of -inf (k near
    # N, where the sample rank reaches the sample's end, or -NaN scores) lets positions outside the span enter.
    x = in_span(plgpu.load(x_ref.at[pos], mask=valid, other=0.0), pos, span)
    key = jnp.where(valid, float_keys(x), INT_MIN)
    sel, dst, total = row_picks(key, valid, jnp.where(in_band, kk, 0), n_in, bits, width)
    plgpu.store(o_ref.at[jnp.where(sel, dst, width)], pos, mask=sel)

    # The band cannot decide (kk > 0 only): stream over the row.
    stream = (kk > 0) & jnp.logical_not(in_band)
    at_b = (n_band < kk) & (kk <= n_band + eq_b)  # t = B: known without a search
    lo_s, cnt_s = gpu_fused.stream_threshold(x_ref, kk, stream & jnp.logical_not(at_b), n=n, block_n=block_n,
                                             span=span)
    lo_s = jnp.where(at_b, b_key, lo_s)
    done_s = jnp.where(at_b, kk == n_band + eq_b, cnt_s == kk)
    a_s, t_s, on_s = selection_rule(lo_s, done_s, kk)
    count = jnp.where(stream, jnp.int32(pl.cdiv(n, block_n)), jnp.int32(0))
    ge_s, out_s, tie_s = gpu_fused.rule_totals(x_ref, jnp.int32(0), count, a_s, t_s, on_s > 0, done_s, n=n,
                                               block_n=block_n, span=span)  # ties 0 for a done row
    quota_s = jnp.where(done_s, 0, kk - ge_s)
    gpu_fused.compact_chunks(x_ref, o_ref, jnp.int32(0), count, a_s, t_s, on_s > 0, jnp.logical_not(done_s),
                             quota_s, jnp.int32(0), n=n, block_n=block_n, width=width, span=span)
    tie_out_s = (t_s > KEY_NEG_INF) & (t_s <= KEY_POS_INF)
    total_s = out_s + jnp.where(tie_out_s, jnp.minimum(tie_s, quota_s), 0)
    total = jnp.where(stream, total_s, total)
    gpu_fused.pad_output(o_ref, total, jnp.bool_(True), width=width, wblock=wpad)


def topk_select_ordered(x: Array, k_rows: Array, K: int, *, sample: int = 8192, sigmas: float = 4.0,
                        cap: int | None = None, bits: int = 2, block_n: int = 1024, num_warps: int = 4,
                        num_stages: int = 2, skip_empty: bool = False, span: Array | None = None,
                        interpret: bool = False) -> Array:
    """Selection of every row from an ordered band above a sampled bound (module docstring).

    Args:
      x: f32[R, N] scores (N >= sample); k_rows: i32[R'] keys to keep (row r's at r // (R / R'),
        `common.distinct_counts`; clipped to [0, K] in-kernel); K: width <= N.
      sample: sampled scores per row (a power of two, <= 32768); sigmas: the bound's distance below the sample
        rank in standard deviations; cap: band capacity per row (a power of two <= 32768; None: `band_capacity`);
        bits: radix bits of the in-register searches; block_n: scores per iteration of the streaming loops (a
        power of two); num_warps / num_stages: of the band kernel; skip_empty: the band kernel ranks and stores
        only in chunks holding a band key; span: i32[R, 2] (lo, hi) or None: the scores outside a row's [lo, hi)
        count as -inf (`common.mask_span`), read in place.
      interpret: Pallas interpreter (CPU tests).

    Returns:
      int32[R, K]: the chosen positions ascending, then -1.
    """
    R, N = x.shape
    cap = band_capacity(K, N, sample, sigmas) if cap is None else cap
    for name, v in (("sample", sample), ("cap", cap), ("block_n", block_n)):
        if v < 32 or v & (v - 1) or (name != "block_n" and v > ROW_LIMIT):
            raise ValueError(f"{name}={v}: expected a power of two in [32, {ROW_LIMIT}]")
    if N < sample:
        raise ValueError(f"N={N} scores per row: the ordered path needs N >= sample={sample}")
    k2 = k_rows.reshape(-1, 1).astype(jnp.int32)
    bound = sample_bracket(x, k2, K, sample=sample, sigmas=sigmas, bits=bits, upper=False, span=span,
                           interpret=interpret)
    row = lambda w: pl.BlockSpec((None, w), lambda r: (r, 0))  # noqa: E731
    spanned = span is not None
    sp_spec, sp_arg = ([row(2)], [span]) if spanned else ([], [])
    count = jax.ShapeDtypeStruct((R, 1), jnp.int32)
    n_band, eq_b, pos = pl.pallas_call(
        functools.partial(_band_kernel, n=N, block_n=block_n, cap=cap, skip_empty=skip_empty, spanned=spanned),
        grid=(R,), in_specs=[row(4), row(N)] + sp_spec, out_specs=(row(1), row(1), row(cap)),
        out_shape=(count, count, jax.ShapeDtypeStruct((R, cap), jnp.int32)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="topk_select_ordered_band")(bound, x, *sp_arg)
    return pl.pallas_call(
        functools.partial(_select_kernel, n=N, width=K, cap=cap, bits=bits, block_n=block_n,
                          wpad=min(1024, max(32, next_pow2(K))), spanned=spanned),
        grid=(R,), in_specs=[count_spec(k2, R), row(4), row(1), row(1), row(cap), row(N)] + sp_spec,
        out_specs=row(K),
        out_shape=jax.ShapeDtypeStruct((R, K), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=max(4, min(16, cap // 1024)), num_stages=1),
        interpret=interpret, name="topk_select_ordered_select")(k2, bound, n_band, eq_b, pos, x, *sp_arg)

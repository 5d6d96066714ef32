"""The sampled top-k path ("sample") as it was before issue 24 (main at 73e4b69), kept only so that `jsparse bench
topk_select` can time the old path against `pallas_kernels.topk_select.gpu_sample` on the same rows. Not used by
the library; delete it once the comparison is no longer wanted.

What changed since: the sample was taken at the fixed stride N // sample from position 0 (a row whose period
divides the stride, like `jsparse bench model`'s tiled cache, is seen through a few of its values; the last
N - sample * stride scores are never sampled), and a tie group at either end of the bracket went into the band
(or missed the bracket), so such rows took the single-program streaming fallback (8 reads of the row by one
program). The original module docstring follows.

Pallas GPU (Triton) top-k selection for long rows by sampling: a bracket of the threshold from a strided
sample, one pass that keeps the scores inside the bracket, and the exact threshold among those.

Five launches, three of which read the row (each with one or two comparisons per score), instead of the fused
path's 32 / bits counting passes of 2**bits comparisons each:
  1. `_sample_kernel` (one program per row): the keys of `sample` scores at a fixed stride, held in registers;
     the exact in-register radix search (`gpu_row.row_threshold`) finds two sample keys A >= B around the
     sample rank that corresponds to kk (kk * sample / N, +- `sigmas` binomial standard deviations + 8).
  2. `_band_kernel` (row x split): counts the keys >= A per split and appends every key in [B, A) to the row's
     band buffer (capacity `cap`; slots reserved with one atomic add per chunk, so the band's order is
     arbitrary, which does not matter for a threshold).
  3. `_resolve_kernel` (one program per row): with U keys >= A and the band's count Bn, when U < kk <= U + Bn
     and the band fits, the kk-th largest key is the (kk - U)-th largest of the band: the in-register radix
     search over the band gives it exactly. Otherwise (a bracket the sample missed, a band over `cap`: rare for
     continuous scores, common for rows of a few distinct values) the program runs the streaming radix search
     over its whole row (`gpu_fused.count_digits`, 4 bits a pass): slow but exact, so no input is wrong.
     It writes the row's rule (a, t, bulk_on, done).
  4. `gpu_fused.rule_counts` per split and 5. `gpu_fused._compact_kernel`: the fused path's compaction.

Semantics: exactly `reference.topk_select_reference` (every path ends in the same threshold rule).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.topk_select import gpu_fused
from pallas_kernels.topk_select.common import INT_MIN, float_keys, selection_rule
from pallas_kernels.topk_select.gpu_row import row_threshold

Array = jax.Array


def _sample_kernel(k_ref, x_ref, o_ref, *, n: int, width: int, ns: int, stride: int, bits: int, sigmas: float):
    """Row r. Refs: k i32[1]; x f32[N]; o i32[4] = (A, B, above_on, 0)."""
    kk = jnp.clip(k_ref[0], 0, width)
    key = float_keys(plgpu.load(x_ref.at[jnp.arange(ns, dtype=jnp.int32) * stride]))
    r = kk.astype(jnp.float32) * (ns / n)
    m = sigmas * jnp.sqrt(jnp.maximum(r * (1.0 - r / ns), 0.0)) + 8.0
    r_hi = jnp.clip(jnp.floor(r - m), 0, ns).astype(jnp.int32)
    r_lo = jnp.clip(jnp.ceil(r + m), 0, ns).astype(jnp.int32)
    a_key, _, _ = row_threshold(key, r_hi, ns, bits)  # count(sample key >= A) ~ r_hi
    b_key, _, _ = row_threshold(key, r_lo, ns, bits)  # r_lo = ns: B = INT_MIN (every key)
    lane = jnp.arange(4, dtype=jnp.int32)
    o_ref[...] = jnp.where(lane == 0, a_key, jnp.where(lane == 1, b_key, jnp.where(lane == 2, r_hi > 0, 0)))


def _band_kernel(br_ref, x_ref, cnt_in, cnt_ref, band_ref, o_ref, *, n: int, block_n: int, per_split: int,
                 cap: int):
    """(row, split). Refs: br i32[4] the bracket; x f32[N]; cnt i32[1] the row's band count (zero in, aliased
    out, atomically added); band i32[cap] the row's band keys; o i32[1] this split's count of keys >= A."""
    del cnt_in
    a_key, b_key, on = br_ref[0], br_ref[1], br_ref[2] > 0
    first, count = gpu_fused._split_chunks(n, block_n, per_split)

    def body(i, acc):
        _, ok, x = gpu_fused._chunk(x_ref, first + i, block_n, n)
        key = float_keys(x)
        above = ok & on & (key >= a_key)
        band = ok & (key >= b_key) & jnp.logical_not(above)
        b32 = band.astype(jnp.int32)
        nb = jnp.sum(b32)
        base = plgpu.atomic_add(cnt_ref, (jnp.int32(0),), nb)
        dst = base + jnp.cumsum(b32) - b32
        keep = band & (dst < cap)
        plgpu.store(band_ref.at[jnp.where(keep, dst, cap)], key, mask=keep)
        return acc + above.astype(jnp.int32)

    acc = lax.fori_loop(jnp.int32(0), count, body, jnp.zeros((block_n,), jnp.int32))
    o_ref[0] = jnp.sum(acc)


def _resolve_kernel(k_ref, c_ref, cnt_ref, band_ref, x_ref, r_out, *, n: int, width: int, cap: int, bits: int,
                    block_n: int):
    """Row r. Refs: k i32[1]; c i32[S] the splits' counts of keys >= A; cnt i32[1] the band count; band
    i32[cap]; x f32[N] (read only by the fallback); out r i32[4] = (a, t, bulk_on, done)."""
    kk = jnp.clip(k_ref[0], 0, width)
    above = jnp.sum(c_ref[...])
    n_band = cnt_ref[0]
    need = kk - above
    ok = (kk <= 0) | ((need > 0) & (need <= n_band) & (n_band <= cap))
    slot = jnp.arange(cap, dtype=jnp.int32)
    band = plgpu.load(band_ref.at[pl.ds(0, cap)], mask=slot < n_band, other=INT_MIN)
    band = jnp.where(slot < n_band, band, INT_MIN)
    lo, _, done = row_threshold(band, jnp.where(ok, need, 0), jnp.where(ok, n_band, 0), bits)

    # Fallback: the streaming radix search over the whole row (4 bits a pass), in this one program.
    fb_bits = 4
    n_chunks = pl.cdiv(n, block_n)

    def pass_body(p, st):
        lo_f, cnt_f = st
        shift = jnp.int32(32 - fb_bits) - jnp.int32(fb_bits) * p
        cnts = gpu_fused.count_digits(x_ref, jnp.int32(0), jnp.where(cnt_f == kk, jnp.int32(0), jnp.int32(n_chunks)), lo_f, shift,
                                      n=n, block_n=block_n, bits=fb_bits)
        return gpu_fused.pick_bin(cnts, kk, lo_f, cnt_f, shift, cnt_f == kk)

    passes = jnp.where(ok, jnp.int32(0), jnp.int32(32 // fb_bits))
    lo_f, cnt_f = lax.fori_loop(jnp.int32(0), passes, pass_body, (jnp.int32(INT_MIN), jnp.int32(n)))
    lo = jnp.where(ok, lo, lo_f)
    done = jnp.where(ok, done | (kk <= 0), (kk <= 0) | (cnt_f == kk))
    a, t, on = selection_rule(lo, done, kk)
    lane = jnp.arange(4, dtype=jnp.int32)
    r_out[...] = jnp.where(lane == 0, a, jnp.where(lane == 1, t, jnp.where(lane == 2, on, done)))


def topk_select_sample(x: Array, k_rows: Array, K: int, *, sample: int = 4096, sigmas: float = 4.0,
                       cap: int = 16384, bits: int = 2, block_n: int = 1024, target_programs: int = 1024,
                       num_warps: int = 4, interpret: bool = False) -> Array:
    """Selection of every row by sampling (module docstring).

    Args:
      x: f32[R, N] scores (N >= sample); k_rows: i32[R] keys to keep (clipped to [0, K] in-kernel); K: width <= N.
      sample: strided sample per row (a power of two, <= 32768); sigmas: bracket half-width in standard
        deviations of the sample rank; cap: band capacity per row (a power of two, <= 32768); bits: radix bits
        of the in-register searches; block_n: scores per inner iteration of the streaming kernels (a power of
        two); target_programs: about rows x splits per streaming launch; num_warps: warps per program.
      interpret: Pallas interpreter (CPU tests).

    Returns:
      int32[R, K]: the chosen positions ascending, then -1.
    """
    R, N = x.shape
    for name, v in (("sample", sample), ("cap", cap), ("block_n", block_n)):
        if v < 32 or v & (v - 1) or (name != "block_n" and v > 32768):
            raise ValueError(f"{name}={v}: expected a power of two in [32, 32768]")
    if N < sample:
        raise ValueError(f"N={N} scores per row: the sampling path needs N >= sample={sample}")
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=2)
    k2 = k_rows.reshape(R, 1).astype(jnp.int32)
    above, n_band, band = sample_band(x, k2, K, sample=sample, sigmas=sigmas, cap=cap, bits=bits, block_n=block_n,
                                      target_programs=target_programs, params=params, interpret=interpret)
    S = above.shape[1]
    row1 = lambda w: pl.BlockSpec((None, w), lambda r: (r, 0))  # noqa: E731
    rule = pl.pallas_call(
        functools.partial(_resolve_kernel, n=N, width=K, cap=cap, bits=bits, block_n=block_n),
        grid=(R,), in_specs=[row1(1), pl.BlockSpec((None, S), lambda r: (r, 0)), row1(1), row1(cap), row1(N)],
        out_specs=row1(4), out_shape=jax.ShapeDtypeStruct((R, 4), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=max(4, min(16, cap // 1024)), num_stages=1),
        interpret=interpret, name="topk_select_resolve")(k2, above, n_band, band, x)

    return gpu_fused.compact_with_rule(x, k2, rule, K, block_n=block_n, target_programs=target_programs,
                                       params=params, interpret=interpret)


def sample_band(x: Array, k2: Array, K: int, *, sample: int, sigmas: float, cap: int, bits: int, block_n: int,
                target_programs: int, params, interpret: bool = False):
    """Launches 1 and 2: (above i32[R, S] the splits' counts of keys >= A, n_band i32[R, 1], band i32[R, cap]).
    The fast path holds for row r when above[r].sum() < kk <= above[r].sum() + n_band[r] <= cap."""
    R, N = x.shape
    row1 = lambda w: pl.BlockSpec((None, w), lambda r: (r, 0))  # noqa: E731
    row2 = lambda w: pl.BlockSpec((None, w), lambda r, s: (r, 0))  # noqa: E731
    bracket = pl.pallas_call(
        functools.partial(_sample_kernel, n=N, width=K, ns=sample, stride=N // sample, bits=bits, sigmas=sigmas),
        grid=(R,), in_specs=[row1(1), row1(N)], out_specs=row1(4),
        out_shape=jax.ShapeDtypeStruct((R, 4), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=max(4, min(16, sample // 1024)), num_stages=1),
        interpret=interpret, name="topk_select_sample")(k2, x)
    S, per = gpu_fused.pow2_splits(R, pl.cdiv(N, block_n), target_programs)
    n_band, band, above = pl.pallas_call(
        functools.partial(_band_kernel, n=N, block_n=block_n, per_split=per, cap=cap),
        grid=(R, S), in_specs=[row2(4), row2(N), row2(1)],
        out_specs=(row2(1), row2(cap), pl.BlockSpec((None, None, 1), lambda r, s: (r, s, 0))),
        out_shape=(jax.ShapeDtypeStruct((R, 1), jnp.int32), jax.ShapeDtypeStruct((R, cap), jnp.int32),
                   jax.ShapeDtypeStruct((R, S, 1), jnp.int32)),
        input_output_aliases={2: 0},
        compiler_params=params, interpret=interpret, name="topk_select_band",
    )(bracket, x, jnp.zeros((R, 1), jnp.int32))
    return above.reshape(R, S), n_band, band

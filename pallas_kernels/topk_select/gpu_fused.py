"""Pallas GPU (Triton) top-k selection for long rows with no XLA work between the kernels.

The passes of `gpu.py`'s "passes" path, with the glue moved into the kernels: 32 / bits counting launches,
one final count and one compaction, each on a grid (R, S) of row splits (S a power of two), and nothing else
(no XLA fusion between them: 10 launches at 4 bits instead of ~20).
  * `_pass_kernel` p: every program first finishes pass p - 1 for its row itself: it sums that pass's
    [S, 2**bits] split counts, picks the next bin and updates the row's state (lo, count(key >= lo), shift),
    which split 0 writes out for pass p + 1 (passes 1 .. 32 / bits - 1 are one compiled kernel); then it
    counts its split's keys >= each candidate of the new bin (the radix-digit counting of
    `gpu._count_kernel`). Resolved rows skip the reading.
  * `_final_kernel`: finishes the last pass (the threshold t), counts per split the bulk keys, those output and
    the ties, and split 0 writes the row's rule (a, t, bulk_on, done).
  * `_compact_kernel`: every program computes its split's tie quota and first output slot from all the row's
    split counts (`common.split_plan`, in-kernel), writes its picks ascending (running count + in-chunk
    cumulative sum, scattered stores) and split 0 writes the -1 padding after the row's last pick.

Semantics: exactly `reference.topk_select_reference`.
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


def pow2_splits(rows: int, n_chunks: int, target_programs: int) -> tuple[int, int]:
    """(S, chunks per split): S a power of two <= n_chunks with rows * S about `target_programs`."""
    want = max(1, min(n_chunks, -(-target_programs // max(rows, 1))))
    S = 1 << (want.bit_length() - 1)  # round down to a power of two
    return S, -(-n_chunks // S)


def _chunk(x_ref, c, block_n: int, n: int, span=None):
    """Scores of chunk c: (pos i32[block_n], ok bool[block_n] pos < n, x f32[block_n] (0 where not ok; -inf
    outside span = (lo, hi), `common.in_span`))."""
    start = c * block_n
    pos = start + jnp.arange(block_n, dtype=jnp.int32)
    ok = pos < n
    x = plgpu.load(x_ref.at[pl.ds(start, block_n)], mask=ok, other=0.0)
    return pos, ok, in_span(x, pos, span)


def _split_chunks(n: int, block_n: int, per_split: int):
    """(first chunk, chunk count) of this program's split (shared with gpu.py's counting kernels)."""
    first = pl.program_id(1) * per_split
    return first, jnp.clip(pl.cdiv(n, block_n) - first, 0, per_split)


def _kk(k_ref, width: int):
    return jnp.clip(k_ref[0], 0, width)


def _advance(kk, st_ref, c_ref, *, first: bool, bits: int, n: int):
    """The row's state at the start of this pass: (lo, count(key >= lo), done, shift of this pass).

    Refs (not the first pass): st i32[4] = (lo, count, shift, -) at the start of the previous pass; c i32[S, M]
    the previous pass's split counts. The pass number is data (the shift), not a static argument, so that
    every pass after the first runs the same compiled kernel.
    """
    if first:
        return jnp.int32(INT_MIN), jnp.int32(n), (kk <= 0) | (n == kk), jnp.int32(32 - bits)
    lo0, cnt0, shift0 = st_ref[0], st_ref[1], st_ref[2]
    done0 = (kk <= 0) | (cnt0 == kk)
    lo, cnt = pick_bin(jnp.sum(c_ref[...], axis=0), kk, lo0, cnt0, shift0, done0)
    return lo, cnt, (kk <= 0) | (cnt == kk), shift0 - bits


def pick_bin(cnts, kk, lo0, cnt0, shift0, done0):
    """The next (lo, count(key >= lo)) of a radix pass from cnts i32[M] = count(key >= lo0 + j * 2**shift0)
    for j >= 1 (column 0 is not counted: count(key >= lo0) = cnt0 is known); done rows keep theirs."""
    j = jnp.arange(cnts.shape[0], dtype=jnp.int32)
    jstar = jnp.sum(((cnts >= kk) | (j == 0)).astype(jnp.int32)) - 1
    picked = jnp.sum(jnp.where(j == jstar, cnts, 0))
    new_cnt = jnp.where(jstar == 0, cnt0, picked)
    lo = jnp.where(done0, lo0, lo0 + lax.shift_left(jstar, shift0))
    return lo, jnp.where(done0, cnt0, new_cnt)


def count_digits(x_ref, first, count, lo, shift, *, n: int, block_n: int, bits: int, span=None):
    """i32[M]: over `count` chunks of block_n scores from chunk `first`, how many keys are >= lo + j * 2**shift
    (column 0: the keys >= lo), by digit comparisons (2**bits per score)."""
    M = 1 << bits
    levels = jnp.arange(M, dtype=jnp.int32).astype(jnp.float32)

    def body(i, acc):
        _, ok, x = _chunk(x_ref, first + i, block_n, n, span)
        key = float_keys(x)
        d = lax.shift_right_logical(key - lo, shift)  # offset in the bin (wrapping subtraction)
        above = lax.shift_right_logical(d, jnp.int32(bits)) != 0
        digit = jnp.where((key >= lo) & ok, jnp.where(above, M, d), -1).astype(jnp.float32)
        return acc + (digit[None, :] >= levels[:, None]).astype(jnp.float32)

    # Bounds of one dtype (Triton's scf.for needs it).
    acc = lax.fori_loop(jnp.int32(0), jnp.asarray(count, jnp.int32), body, jnp.zeros((M, block_n), jnp.float32))
    return jnp.sum(acc, axis=1).astype(jnp.int32)


def stream_threshold(x_ref, kk, active, *, n: int, block_n: int, bits: int = 4, span=None):
    """The radix search of a row's threshold streaming over the whole row x f32[n] in one program (32 / bits
    passes of `count_digits`; slow, for the rows a faster path could not resolve): (lo, count(key >= lo)) as
    `common.radix_threshold`'s; an inactive row reads nothing and returns (INT_MIN, n)."""
    n_chunks = pl.cdiv(n, block_n)

    def pass_body(p, st):
        lo, cnt = st
        shift = jnp.int32(32 - bits) - jnp.int32(bits) * p
        cnts = count_digits(x_ref, jnp.int32(0), jnp.where(cnt == kk, jnp.int32(0), jnp.int32(n_chunks)), lo, shift,
                            n=n, block_n=block_n, bits=bits, span=span)
        return pick_bin(cnts, kk, lo, cnt, shift, cnt == kk)

    passes = jnp.where(active, jnp.int32(32 // bits), jnp.int32(0))
    return lax.fori_loop(jnp.int32(0), passes, pass_body, (jnp.int32(INT_MIN), jnp.int32(n)))


def _store_row_state(ref, vals: list):
    """Split 0 writes the row's state vals (scalars) to ref i32[len(vals)] (a power of two)."""
    L = len(vals)
    lane = jnp.arange(L, dtype=jnp.int32)
    v = jnp.zeros((L,), jnp.int32)
    for i, s in enumerate(vals):
        v = jnp.where(lane == i, s.astype(jnp.int32), v)
    plgpu.store(ref.at[pl.ds(0, L)], v, mask=(lane < L) & (pl.program_id(1) == 0))


def _pass_kernel(*refs, first_pass: bool, n: int, width: int, block_n: int, per_split: int, bits: int):
    """One pass for one (row, split). Refs: k i32[1]; (after the first pass: st i32[4], c i32[S, M]); x f32[N];
    outputs st i32[4] (the state at the start of this pass: lo, count, shift, 0) and o i32[M] (the split's
    count of keys >= lo + j * 2**shift)."""
    if first_pass:
        k_ref, x_ref, st_out, o_ref = refs
        st_ref = c_ref = None
    else:
        k_ref, st_ref, c_ref, x_ref, st_out, o_ref = refs
    kk = _kk(k_ref, width)
    lo, cnt, done, shift = _advance(kk, st_ref, c_ref, first=first_pass, bits=bits, n=n)
    _store_row_state(st_out, [lo, cnt, shift, jnp.int32(0)])
    first, count = _split_chunks(n, block_n, per_split)
    o_ref[...] = count_digits(x_ref, first, jnp.where(done, 0, count), lo, shift, n=n, block_n=block_n, bits=bits)


def _final_kernel(k_ref, st_ref, c_ref, x_ref, r_out, o_ref, *, n: int, width: int, block_n: int,
                  per_split: int, bits: int):
    """Finishes the search and counts per split. Refs: k i32[1]; st i32[4]; c i32[S, M] (last pass); x f32[N];
    outputs r i32[4] = (a, t, bulk_on, done) (split 0), o i32[4] = (#key >= a, #(key >= a and x > -inf),
    #key == t, 0) over the split (bulk counts 0 when bulk is off, ties 0 for a done row)."""
    kk = _kk(k_ref, width)
    lo, _, done, _ = _advance(kk, st_ref, c_ref, first=False, bits=bits, n=n)
    a, t, on = selection_rule(lo, done, kk)
    _store_row_state(r_out, [a, t, on, done])
    rule_counts(o_ref, x_ref, a, t, on > 0, done, n=n, block_n=block_n, per_split=per_split)


def rule_counts(o_ref, x_ref, a, t, on, done, *, n: int, block_n: int, per_split: int, span=None):
    """Writes o i32[4] = (#key >= a, #(key >= a and x > -inf), #key == t, 0) over this program's split (bulk
    counts 0 when bulk is off, ties 0 for a done row): the per-split counts `_compact_kernel` plans with."""
    first, count = _split_chunks(n, block_n, per_split)
    count = jnp.where(done & jnp.logical_not(on), 0, count)
    ge, out, tie = rule_totals(x_ref, first, count, a, t, on, done, n=n, block_n=block_n, span=span)
    lane = jnp.arange(4, dtype=jnp.int32)
    o_ref[...] = jnp.where(lane == 0, ge, jnp.where(lane == 1, out, jnp.where(lane == 2, tie, 0)))


def rule_totals(x_ref, first, count, a, t, on, done, *, n: int, block_n: int, span=None):
    """(#key >= a, #(key >= a and x > -inf), #key == t) over `count` chunks of block_n scores from chunk `first`
    (bulk counts 0 when `on` is false, ties 0 for a done row)."""
    def body(i, acc):
        _, ok, x = _chunk(x_ref, first + i, block_n, n, span)
        key = float_keys(x)
        bulk = (key >= a) & ok & on
        ge, out, tie = acc
        return (ge + bulk.astype(jnp.int32), out + (bulk & (x > -jnp.inf)).astype(jnp.int32),
                tie + ((key == t) & ok & jnp.logical_not(done)).astype(jnp.int32))

    zero = jnp.zeros((block_n,), jnp.int32)
    ge, out, tie = lax.fori_loop(0, count, body, (zero, zero, zero))
    return jnp.sum(ge), jnp.sum(out), jnp.sum(tie)


def compact_chunks(x_ref, o_ref, first, count, a, t, on, ties, quota, base, *, n: int, block_n: int, width: int,
                   span=None):
    """Writes a split's picks to their output slots, ascending from slot `base`: over `count` chunks from chunk
    `first`, the keys >= a (when on) and, when ties, the first `quota` keys == t (by position); picks whose
    score is -inf or NaN are ranked, never written. A running count + in-chunk cumulative sum ranks the picks.
    Returns the picks written (i32)."""

    def body(i, carry):
        run, tie_run = carry
        pos, ok, x = _chunk(x_ref, first + i, block_n, n, span)
        key = float_keys(x)
        fin = x > -jnp.inf
        tie = (key == t) & ok & ties
        tie_i = tie.astype(jnp.int32)
        take = tie & (tie_run + jnp.cumsum(tie_i) - tie_i < quota)
        sel = (((key >= a) & on) | take) & ok & fin
        sel_i = sel.astype(jnp.int32)
        dst = base + run + jnp.cumsum(sel_i) - sel_i
        sel = sel & (dst < width)
        plgpu.store(o_ref.at[jnp.where(sel, dst, width)], pos, mask=sel)
        return run + jnp.sum(sel_i), tie_run + jnp.sum(tie_i)

    return lax.fori_loop(0, count, body, (jnp.int32(0), jnp.int32(0)))[0]


def pad_output(o_ref, total, active, *, width: int, wblock: int):
    """Writes -1 into the output slots total .. width - 1 of o i32[width] when `active` (a bool: whether this
    program pads its row)."""
    def pad(i, c):
        slot = i * wblock + jnp.arange(wblock, dtype=jnp.int32)
        plgpu.store(o_ref.at[pl.ds(i * wblock, wblock)], jnp.full((wblock,), -1, jnp.int32),
                    mask=(slot >= total) & (slot < width))
        return c

    lax.fori_loop(jnp.int32(0), jnp.where(active, jnp.int32(pl.cdiv(width, wblock)), jnp.int32(0)), pad,
                  jnp.int32(0))  # bounds of one dtype (Triton's scf.for needs it)


def _compact_kernel(k_ref, r_ref, f_ref, x_ref, *refs, n: int, width: int, wblock: int, block_n: int,
                    per_split: int, S: int, spanned: bool = False):
    """One (row, split): its picks to their output slots. Refs: k i32[1]; r i32[4] = (a, t, bulk_on, done);
    f i32[S, 4] every split's final counts; x f32[N]; (spanned: sp i32[2] the row's span (lo, hi), -inf outside);
    o i32[width] the row's output."""
    sp_ref, o_ref = refs if spanned else (None, *refs)
    kk = _kk(k_ref, width)
    a, t, on, done = r_ref[0], r_ref[1], r_ref[2] > 0, r_ref[3] > 0
    f = f_ref[...]
    lane = jnp.arange(4, dtype=jnp.int32)[None, :]
    col = lambda c: jnp.sum(jnp.where(lane == c, f, 0), axis=1)  # [S]
    n_ge, n_out, n_tie = col(0), col(1), col(2)
    # common.split_plan for this row, in-kernel.
    quota = jnp.where(done, 0, kk - jnp.sum(n_ge))
    tie_before = jnp.cumsum(n_tie) - n_tie
    quota_s = jnp.clip(quota - tie_before, 0, n_tie)
    tie_out = (t > KEY_NEG_INF) & (t <= KEY_POS_INF)
    out_s = n_out + jnp.where(tie_out, quota_s, 0)
    me = pl.program_id(1)
    sv = jnp.arange(S, dtype=jnp.int32)
    base = jnp.sum(jnp.where(sv < me, out_s, 0))
    my_quota = jnp.sum(jnp.where(sv == me, quota_s, 0))
    total = jnp.sum(out_s)
    first, count = _split_chunks(n, block_n, per_split)
    compact_chunks(x_ref, o_ref, first, count, a, t, on, jnp.logical_not(done), my_quota, base, n=n,
                   block_n=block_n, width=width, span=ref_span(sp_ref))
    pad_output(o_ref, total, me == 0, width=width, wblock=wblock)


def _compact_row_kernel(r_ref, x_ref, *refs, n: int, width: int, block_n: int, spanned: bool = False):
    """One whole row: its picks to their output slots, then -1 after them. Refs: r i32[8] = (a, t, bulk_on, done,
    quota, 0, 0, 0), quota the ties == t the row takes (kk - #key > t for a row that is not done, else 0); x f32[N];
    (spanned: sp i32[2] the row's span); o i32[width]. The row's rule counts (`rule_counts`) are not needed: one
    program ranks the whole row."""
    sp_ref, o_ref = refs if spanned else (None, *refs)
    a, t, on, done, quota = r_ref[0], r_ref[1], r_ref[2] > 0, r_ref[3] > 0, r_ref[4]
    total = compact_chunks(x_ref, o_ref, jnp.int32(0), jnp.int32(pl.cdiv(n, block_n)), a, t, on,
                           jnp.logical_not(done), quota, jnp.int32(0), n=n, block_n=block_n, width=width,
                           span=ref_span(sp_ref))
    pad_output(o_ref, total, jnp.bool_(True), width=width, wblock=block_n)


def compact_rows(x: Array, rule: Array, K: int, *, block_n: int, params, span: Array | None = None,
                 interpret: bool = False) -> Array:
    """The chosen positions of each row from its rule i32[R, 8] = (a, t, bulk_on, done, quota, 0, 0, 0): one
    program per row (`_compact_row_kernel`), for launches of so many rows that each takes one split anyway. span:
    i32[R, 2] (lo, hi) or None: the scores outside a row's [lo, hi) count as -inf, read in place."""
    R, N = x.shape
    spanned = span is not None
    return pl.pallas_call(
        functools.partial(_compact_row_kernel, n=N, width=K, block_n=block_n, spanned=spanned),
        grid=(R,), in_specs=[pl.BlockSpec((None, 8), lambda r: (r, 0)), pl.BlockSpec((None, N), lambda r: (r, 0))]
        + ([pl.BlockSpec((None, 2), lambda r: (r, 0))] if spanned else []),
        out_specs=pl.BlockSpec((None, K), lambda r: (r, 0)), out_shape=jax.ShapeDtypeStruct((R, K), jnp.int32),
        compiler_params=params, interpret=interpret, name="topk_select_fused_compact")(
            rule, x, *([span] if spanned else []))


def topk_select_fused(x: Array, k_rows: Array, K: int, *, bits: int, block_n: int, compact_block_n: int,
                      target_programs: int, num_warps: int, interpret: bool = False) -> Array:
    """Selection of every row by 32 / bits + 2 launches and no XLA work between them.

    Args:
      x: f32[R, N] scores; k_rows: i32[R'] keys to keep (row r's at r // (R / R'), `common.distinct_counts`;
        clipped to [0, K] in-kernel); K: width <= N.
      bits: radix bits per counting pass (1, 2, 4 or 8); block_n, compact_block_n: scores per inner
        iteration of the counting / final-count and compaction kernels (powers of two); target_programs:
        about rows x splits per launch; num_warps: warps per program.
      interpret: Pallas interpreter (CPU tests).

    Returns:
      int32[R, K]: the chosen positions ascending, then -1.
    """
    R, N = x.shape
    M = 1 << bits
    passes = 32 // bits
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=2)
    k2 = k_rows.reshape(-1, 1).astype(jnp.int32)
    k_spec = count_spec(k2, R)
    row_spec = pl.BlockSpec((None, N), lambda r, s: (r, 0))
    st_spec = pl.BlockSpec((None, 4), lambda r, s: (r, 0))
    S, per = pow2_splits(R, pl.cdiv(N, block_n), target_programs)
    c_in_spec = pl.BlockSpec((None, S, M), lambda r, s: (r, 0, 0))
    c_out_spec = pl.BlockSpec((None, None, M), lambda r, s: (r, s, 0))
    out_shapes = (jax.ShapeDtypeStruct((R, 4), jnp.int32), jax.ShapeDtypeStruct((R, S, M), jnp.int32))
    st = cnt = None
    for p in range(passes):
        kern = functools.partial(_pass_kernel, first_pass=p == 0, n=N, width=K, block_n=block_n, per_split=per,
                                 bits=bits)
        in_specs = [k_spec, row_spec] if p == 0 else [k_spec, st_spec, c_in_spec, row_spec]
        args = (k2, x) if p == 0 else (k2, st, cnt, x)
        st, cnt = pl.pallas_call(
            kern, grid=(R, S), in_specs=in_specs, out_specs=(st_spec, c_out_spec), out_shape=out_shapes,
            compiler_params=params, interpret=interpret, name="topk_select_fused_pass")(*args)

    cb = compact_block_n
    Sc, per_c = pow2_splits(R, pl.cdiv(N, cb), target_programs)
    rule, fin = pl.pallas_call(
        functools.partial(_final_kernel, n=N, width=K, block_n=cb, per_split=per_c, bits=bits),
        grid=(R, Sc),
        in_specs=[k_spec, st_spec, c_in_spec, row_spec],
        out_specs=(pl.BlockSpec((None, 4), lambda r, s: (r, 0)), pl.BlockSpec((None, None, 4), lambda r, s: (r, s, 0))),
        out_shape=(jax.ShapeDtypeStruct((R, 4), jnp.int32), jax.ShapeDtypeStruct((R, Sc, 4), jnp.int32)),
        compiler_params=params, interpret=interpret, name="topk_select_fused_final")(k2, st, cnt, x)

    return _compact_call(x, k2, rule, fin, K, block_n=cb, per_split=per_c, params=params, interpret=interpret)


def _compact_call(x, k2, rule, fin, K: int, *, block_n: int, per_split: int, params, interpret: bool,
                  span: Array | None = None):
    """The compaction launch: rule i32[R, 4] = (a, t, bulk_on, done), fin i32[R, S, 4] the splits' counts; span
    i32[R, 2] or None (read in place, as `compact_rows`')."""
    R, N = x.shape
    Sc = fin.shape[1]
    spanned = span is not None
    return pl.pallas_call(
        functools.partial(_compact_kernel, n=N, width=K, wblock=block_n, block_n=block_n, per_split=per_split,
                          S=Sc, spanned=spanned),
        grid=(R, Sc),
        in_specs=[count_spec(k2, R), pl.BlockSpec((None, 4), lambda r, s: (r, 0)),
                  pl.BlockSpec((None, Sc, 4), lambda r, s: (r, 0, 0)), pl.BlockSpec((None, N), lambda r, s: (r, 0))]
        + ([pl.BlockSpec((None, 2), lambda r, s: (r, 0))] if spanned else []),
        out_specs=pl.BlockSpec((None, K), lambda r, s: (r, 0)),
        out_shape=jax.ShapeDtypeStruct((R, K), jnp.int32),
        compiler_params=params, interpret=interpret, name="topk_select_fused_compact")(
            k2, rule, fin, x, *([span] if spanned else []))


def _rule_count_kernel(r_ref, x_ref, *refs, n: int, block_n: int, per_split: int, spanned: bool = False):
    sp_ref, o_ref = refs if spanned else (None, *refs)
    a, t, on, done = r_ref[0], r_ref[1], r_ref[2] > 0, r_ref[3] > 0
    rule_counts(o_ref, x_ref, a, t, on, done, n=n, block_n=block_n, per_split=per_split, span=ref_span(sp_ref))


def compact_with_rule(x: Array, k2: Array, rule: Array, K: int, *, block_n: int, target_programs: int, params,
                      span: Array | None = None, interpret: bool = False) -> Array:
    """The chosen positions from each row's rule i32[R, 4] = (a, t, bulk_on, done): one launch counting per
    split (`rule_counts`), one compacting (`_compact_kernel`). k2: i32[R', 1] the rows' k (`topk_select_fused`'s
    k_rows; clipped in-kernel); span: i32[R, 2] (lo, hi) or None: the scores outside a row's [lo, hi) count as
    -inf, read in place."""
    R, N = x.shape
    Sc, per_c = pow2_splits(R, pl.cdiv(N, block_n), target_programs)
    spanned = span is not None
    fin = pl.pallas_call(
        functools.partial(_rule_count_kernel, n=N, block_n=block_n, per_split=per_c, spanned=spanned),
        grid=(R, Sc),
        in_specs=[pl.BlockSpec((None, 4), lambda r, s: (r, 0)), pl.BlockSpec((None, N), lambda r, s: (r, 0))]
        + ([pl.BlockSpec((None, 2), lambda r, s: (r, 0))] if spanned else []),
        out_specs=pl.BlockSpec((None, None, 4), lambda r, s: (r, s, 0)),
        out_shape=jax.ShapeDtypeStruct((R, Sc, 4), jnp.int32),
        compiler_params=params, interpret=interpret, name="topk_select_rule_count")(
            rule, x, *([span] if spanned else []))
    return _compact_call(x, k2, rule, fin, K, block_n=block_n, per_split=per_c, params=params, interpret=interpret,
                         span=span)

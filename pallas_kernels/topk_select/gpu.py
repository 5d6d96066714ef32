"""Pallas GPU (Triton) kernels of exact top-k selection: radix threshold search, then an ascending compaction.

`topk_select_gpu` picks one of five paths (`SelectConfig.path`; "auto": "row" when N <= row_max, else "ordered"
for many rows of a small K, else "sample" (rows shorter than the sample: "fused")):
  * "row" (`gpu_row.py`): ONE launch, one program per row holding the row in registers; the whole radix search
    and the compaction run in-kernel. For the launch-bound regime (rows of up to ~16K scores).
  * "fused" (`gpu_fused.py`): the counting passes below with their XLA glue moved into the kernels:
    32 / bits + 2 launches and nothing between them.
  * "sample" (`gpu_sample.py`): a threshold bracket from a sample (one score per stratum of the row, at a
    hashed offset), one pass keeping the scores inside it, the exact threshold among those (or at a bracket
    end; a streaming fallback when the bracket misses), then the fused compaction: 5 launches, three reading
    the row (4 and two when each row is one program's).
  * "ordered" (`gpu_ordered.py`): a sampled lower bound, one pass keeping every score above it in position
    order, the selection from those alone: 3 launches, one reading the row; one program per row.
  * "passes" (this file, the original path): the kernels below with `common.radix_threshold` /
    `common.split_plan` in XLA between them (~20 launches at 4 bits).

The "passes" path: three kernels, each on a grid (R, S): one program per row and split of the row (S splits
of whole chunks of `block_n` scores, so that R * S is about `target_programs` and every SM has work even with a
few rows):
  * `_count_kernel` (32 / bits_per_pass launches): for the 2**bits candidate keys lo + j * 2**shift of its
    row, how many of its scores have a key >= each (by the keys' radix digits, see the kernel); the split
    counts are summed and the next bin chosen in XLA (`common.radix_threshold`). Rows already resolved skip
    the reading.
  * `_final_count_kernel` (one launch): per split, the keys the bulk rule takes (>= a), those of them that
    are output (> -inf) and the ties (== t); `common.split_plan` turns them into per-split output offsets and
    tie quotas.
  * `_compact_kernel` (one launch): each split walks its chunks in order, ranks its picks with a running
    count + in-block cumulative sum and scatters their positions to the output row (masked stores), so the
    row comes out ascending without any sort.
A row of 128K f32 scores is 512 KiB; all passes over the B * Hkv rows of a decode step (32 MiB at B = 8,
Hkv = 8) are served mostly from L2.

Semantics: exactly `reference.topk_select_reference` (including ties, -0.0, -inf and NaN scores).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.topk_select import gpu_fused, gpu_ordered, gpu_row, gpu_sample
from pallas_kernels.topk_select.gpu_fused import _chunk, _split_chunks
from pallas_kernels.topk_select.common import (check_args, check_bits, distinct_counts, float_keys, mask_span,
                                               pad_output, radix_threshold, row_counts, selection_rule, span_rows,
                                               split_plan, splits_for)

Array = jax.Array

PATHS = ("auto", "row", "fused", "sample", "ordered", "passes")


DEFAULT_SAMPLE = {"sample": 2048, "ordered": 4096}  # SelectConfig.sample_size None: per path (its docstring)
SHORT_SAMPLE = 1024  # the "sample" path's default sample for rows of at most SHORT_ROW scores
SHORT_ROW = 32768


@dataclasses.dataclass(frozen=True)
class SelectConfig:
    """Tuning of the GPU selection kernels.

    Attributes:
      bits_per_pass: radix bits resolved per counting pass (1, 2, 4 or 8): 32 / bits passes of 2**bits
        candidates each.
      block_n: scores per inner iteration of the counting kernels (a power of two); None: 8192 / 2**bits
        clipped to [64, 2048] (keeps the [2**bits, block_n] counters in registers).
      compact_block_n: scores per inner iteration of the compaction (a power of two).
      target_programs: about how many programs each launch should have (rows x splits).
      num_warps: warps per program.
      path: "auto" ("row" when N <= row_max, except "ordered" for at least ordered_min_rows rows of more than
        ordered_row_above scores (and at least its sample) whose band fits ordered_max_cap; above row_max "ordered"
        for at least ordered_min_rows rows whose band fits ordered_max_cap, "sample" otherwise), "row", "fused",
        "sample", "ordered" or "passes" (module docstring);
        "sample" and "ordered" take "fused" for rows shorter than their sample.
        bits_per_pass, block_n, compact_block_n, target_programs and num_warps tune "fused" and "passes".
      row_max: the longest row "auto" sends to the single-launch "row" kernel (<= gpu_row.ROW_LIMIT).
      row_bits: radix bits per in-kernel pass of the "row" kernel (1, 2, 4 or 8).
      row_warps: warps per "row" program (None: `gpu_row.row_warps`, about 32 scores per thread).
      sample_size, sample_sigmas, band_cap: the "sample" path's sampled scores per row, bracket half-width in
        standard deviations, and band capacity per row (`gpu_sample.topk_select_sample`; band_cap None:
        `gpu_sample.band_capacity` of K, 8192 for 10% of 100K); rows shorter than the sample take the "fused"
        path. The "ordered" path uses the same sigmas and, with sample_size set, the same sample. sample_size
        None: `DEFAULT_SAMPLE` of the path, 2048 scores for "sample" and 4096 for "ordered" (`sample_for`;
        measured on an H200, eval/results/h200/topk_sample/: of 2048, 4096, 8192 and 16384, 2048 was the fastest
        "sample" at every shape tried, 8 to 3840 rows of 32K to 128K, e.g. Kascade's anchor rows at 100K, batch
        4 66.3 -> 58.3 us; H2O's 1024 "ordered" rows were fastest at 4096, 662 -> 638 us), except SHORT_SAMPLE =
        1024 for "sample" rows of at most SHORT_ROW scores (H100, eval/results/h100/topk_tune/: the anchors' rows of
        32K, 8 and 56 of them, 30.0 -> 28.1 and 45.3 -> 43.4 us; 32 rows of 100K were 1 us slower at 1024).
      ordered_cap: the "ordered" path's band capacity (None: `gpu_ordered.band_capacity` of K).
      ordered_min_rows, ordered_max_cap: "auto" takes "ordered" instead of "sample" for at least this many rows
        whose band fits this capacity (measured on an H200, eval/results/h200/topk_ordered/: 1536 rows of 100K
        scores, K = 520 / 2080: 0.89 / 0.97 ms against 1.89 / 1.90 ms; at 96 rows the two are within the
        dispatch's noise, and at K = 10K on 32 rows of heavy ties "sample" is faster, 0.15 against 0.19+ ms).
      ordered_row_above: rows longer than this take "ordered" over "row" when there are ordered_min_rows of them
        and the band fits (H100, eval/results/h100/sts_shared/topk_paths.json, the one shape measured: 1536 rows,
        K = 520, the STS draft record's two selections: 8,320 scores 119 us "ordered" against 163 us "row"; 6,290
        scores 109 against 85 us).
    """

    bits_per_pass: int = 4
    block_n: int | None = None
    compact_block_n: int = 1024
    target_programs: int = 1024
    num_warps: int = 4
    path: str = "auto"
    row_max: int = 16384
    row_bits: int = 2
    row_warps: int | None = None
    sample_size: int | None = None
    sample_sigmas: float = 4.0
    band_cap: int | None = None
    ordered_cap: int | None = None
    ordered_min_rows: int = 512
    ordered_max_cap: int = 8192
    ordered_row_above: int = 8192

    def sample_for(self, path: str, N: int | None = None) -> int:
        """The sampled scores per row of the "sample" or "ordered" path for rows of N scores (None: long rows):
        sample_size, or the path's default (SHORT_SAMPLE for "sample" rows of at most SHORT_ROW scores)."""
        if self.sample_size is not None:
            return self.sample_size
        if path == "sample" and N is not None and N <= SHORT_ROW:
            return SHORT_SAMPLE
        return DEFAULT_SAMPLE[path]

    def pick_path(self, N: int, rows: int = 0, K: int | None = None) -> str:
        """The path for `rows` rows of N scores and width K (rows / K unknown: "sample" above row_max)."""
        if self.path == "auto":
            path = "row" if N <= self.row_max else "sample"
            longer = N > max(self.ordered_row_above, self.sample_for("ordered") - 1)
            if (path == "sample" or longer) and K is not None and rows >= self.ordered_min_rows \
                    and gpu_ordered.band_capacity(K, N, self.sample_for("ordered"), self.sample_sigmas) \
                    <= self.ordered_max_cap:
                path = "ordered"
        else:
            path = self.path
        return "fused" if path in ("sample", "ordered") and N < self.sample_for(path, N) else path

    def count_block(self) -> int:
        if self.block_n is not None:
            return self.block_n
        return max(64, min(2048, 8192 >> self.bits_per_pass))


def _pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def _check_config(config: SelectConfig) -> None:
    check_bits(config.bits_per_pass)
    for name in ("compact_block_n", "target_programs", "num_warps"):
        if getattr(config, name) < 1:
            raise ValueError(f"SelectConfig.{name}={getattr(config, name)}: expected >= 1")
    for name, val in (("block_n", config.count_block()), ("compact_block_n", config.compact_block_n)):
        if not _pow2(val):
            raise ValueError(f"SelectConfig.{name}={val}: expected a power of two")
    if config.path not in PATHS:
        raise ValueError(f"SelectConfig.path={config.path!r}: expected one of {PATHS}")
    if not 1 <= config.row_max <= gpu_row.ROW_LIMIT:
        raise ValueError(f"SelectConfig.row_max={config.row_max}: expected 1 .. {gpu_row.ROW_LIMIT}")
    if config.row_bits not in (1, 2, 4, 8):
        raise ValueError(f"SelectConfig.row_bits={config.row_bits}: expected 1, 2, 4 or 8")
    if config.row_warps is not None and not (_pow2(config.row_warps) and config.row_warps <= 32):
        raise ValueError(f"SelectConfig.row_warps={config.row_warps}: expected a power of two <= 32 or None")
    for name in ("sample_size", "band_cap"):
        v = getattr(config, name)
        if v is None:
            continue
        if not (_pow2(v) and 32 <= v <= gpu_row.ROW_LIMIT):
            raise ValueError(f"SelectConfig.{name}={v}: expected a power of two in [32, {gpu_row.ROW_LIMIT}]")
    if not config.sample_sigmas > 0:
        raise ValueError(f"SelectConfig.sample_sigmas={config.sample_sigmas}: expected > 0")


def _count_kernel(p_ref, x_ref, o_ref, *, n: int, block_n: int, per_split: int, bits: int):
    """One (row, split) program: o[j] = #(key >= lo + j * 2**shift) over the split, for j = 1 .. M - 1.

    Each key becomes one small float, its radix digit relative to the row's bin [lo, lo + M * 2**shift):
    -1 below the bin, M above it, else (key - lo) >> shift; the counts are then M float compares against
    constants (the FP32 pipe, twice the integer rate), exact for any key. Refs: p i32[4] = (lo, active,
    shift, -): a row with active 0 is resolved and skips the reading; x f32[N] the row; o i32[M].
    """
    lo, act, shift = p_ref[0], p_ref[1], p_ref[2]
    M = 1 << bits
    first, count = _split_chunks(n, block_n, per_split)
    count = jnp.where(act > 0, count, 0)
    levels = jnp.arange(M, dtype=jnp.int32).astype(jnp.float32)

    def body(i, acc):
        _, ok, x = _chunk(x_ref, first + i, block_n, n)
        key = float_keys(x)
        d = lax.shift_right_logical(key - lo, shift)  # unsigned offset in the bin (wrapping subtraction)
        above = lax.shift_right_logical(d, jnp.int32(bits)) != 0
        digit = jnp.where((key >= lo) & ok, jnp.where(above, M, d), -1).astype(jnp.float32)
        return acc + (digit[None, :] >= levels[:, None]).astype(jnp.float32)

    acc = lax.fori_loop(0, count, body, jnp.zeros((M, block_n), jnp.float32))
    o_ref[...] = jnp.sum(acc, axis=1).astype(jnp.int32)


def _final_count_kernel(p_ref, x_ref, o_ref, *, n: int, block_n: int, per_split: int):
    """One (row, split) program. Refs: p i32[4] = (a, t, bulk_on, -); x f32[N]; o i32[4] =
    (#key >= a, #(key >= a and x > -inf), #key == t, 0) over the split (bulk counts 0 when bulk_on is 0)."""
    a, t, on = p_ref[0], p_ref[1], p_ref[2]
    first, count = _split_chunks(n, block_n, per_split)

    def body(i, acc):
        _, ok, x = _chunk(x_ref, first + i, block_n, n)
        key = float_keys(x)
        bulk = (key >= a) & ok & (on > 0)
        ge, out, tie = acc
        return (ge + bulk.astype(jnp.int32), out + (bulk & (x > -jnp.inf)).astype(jnp.int32),
                tie + ((key == t) & ok).astype(jnp.int32))

    zero = jnp.zeros((block_n,), jnp.int32)
    ge, out, tie = lax.fori_loop(0, count, body, (zero, zero, zero))
    lane = jnp.arange(4, dtype=jnp.int32)
    o_ref[...] = jnp.where(lane == 0, jnp.sum(ge), jnp.where(lane == 1, jnp.sum(out),
                                                             jnp.where(lane == 2, jnp.sum(tie), 0)))


def _compact_kernel(p_ref, x_ref, o_ref, *, n: int, block_n: int, per_split: int, width: int):
    """One (row, split) program: writes the split's chosen positions to their output slots.

    Refs: p i32[8] = (a, t, bulk_on, quota: ties this split takes, base: its first output slot, -, -, -);
    x f32[N]; o i32[width] the row's output (only the chosen slots are written).
    """
    a, t, on, quota, base = p_ref[0], p_ref[1], p_ref[2], p_ref[3], p_ref[4]
    first, count = _split_chunks(n, block_n, per_split)
    # Done rows have quota 0 (common.split_plan), so ties can stay on.
    gpu_fused.compact_chunks(x_ref, o_ref, first, count, a, t, on > 0, jnp.bool_(True), quota, base, n=n,
                             block_n=block_n, width=width)


@functools.partial(jax.jit, static_argnames=("K", "config", "interpret"))
def topk_select_gpu(scores: Array, k, K: int, *, span=None, config: SelectConfig = SelectConfig(),
                    interpret: bool = False) -> Array:
    """Exact top-k positions per row, Pallas Triton kernels (semantics of `reference.topk_select_reference`).

    Args:
      scores: f32[..., N]; k: int or int array broadcastable to scores.shape[:-1]; K: static width.
      span: None or (lo, hi), int arrays broadcastable to scores.shape[:-1]: the scores outside a row's [lo, hi)
        count as -inf (`common.mask_span`). The "row", "ordered" and "sample" paths read them in place; the others
        mask a copy first.
      config: `SelectConfig`.
      interpret: run the kernels in the Pallas interpreter (CPU tests).

    Returns:
      int32[..., min(K, N)]: chosen positions ascending, then -1.
    """
    lead, N, Kp = check_args(scores, k, K)
    _check_config(config)
    R = math.prod(lead)
    path = config.pick_path(N, R, Kp)
    sp = None
    if span is not None:
        if path in ("row", "ordered", "sample"):
            sp = span_rows(span, lead)
        else:
            scores = mask_span(scores, span)
    x = scores.reshape(-1, N)
    if path in ("row", "fused", "sample", "ordered"):
        k_rows = distinct_counts(k, lead)  # row r's k at r // (R / k_rows.size); clipped in-kernel
        if path == "row":
            out = gpu_row.topk_select_rows(x, k_rows, Kp, bits=config.row_bits, num_warps=config.row_warps,
                                           span=sp, interpret=interpret)
        elif path == "ordered":
            out = gpu_ordered.topk_select_ordered(
                x, k_rows, Kp, sample=config.sample_for("ordered"), sigmas=config.sample_sigmas, cap=config.ordered_cap,
                bits=config.row_bits, block_n=config.compact_block_n, num_warps=config.num_warps, span=sp,
                interpret=interpret)
        elif path == "sample":
            out = gpu_sample.topk_select_sample(
                x, k_rows, Kp, sample=config.sample_for("sample", N), sigmas=config.sample_sigmas, cap=config.band_cap,
                bits=config.row_bits, block_n=config.compact_block_n, target_programs=config.target_programs,
                num_warps=config.num_warps, span=sp, interpret=interpret)
        else:
            out = gpu_fused.topk_select_fused(
                x, k_rows, Kp, bits=config.bits_per_pass, block_n=config.count_block(),
                compact_block_n=config.compact_block_n, target_programs=config.target_programs,
                num_warps=config.num_warps, interpret=interpret)
        return out.reshape(*lead, Kp)
    kk = row_counts(k, lead, Kp)
    bits = config.bits_per_pass
    M = 1 << bits
    params = plgpu.CompilerParams(num_warps=config.num_warps, num_stages=2)
    row_spec = pl.BlockSpec((None, N), lambda r, s: (r, 0))

    bn = config.count_block()
    S, per = splits_for(R, pl.cdiv(N, bn), config.target_programs)
    count_call = pl.pallas_call(
        functools.partial(_count_kernel, n=N, block_n=bn, per_split=per, bits=bits),
        grid=(R, S),
        in_specs=[pl.BlockSpec((None, 4), lambda r, s: (r, 0)),  # (lo, active, shift, -)
                  row_spec],
        out_specs=pl.BlockSpec((None, None, M), lambda r, s: (s, r, 0)),
        out_shape=jax.ShapeDtypeStruct((S, R, M), jnp.int32),
        compiler_params=params, interpret=interpret, name="topk_select_count")

    def count_fn(cand, active, lo, shift):
        del cand
        p = jnp.stack([lo, active.astype(jnp.int32), jnp.full_like(lo, shift), jnp.zeros_like(lo)], axis=1)
        return jnp.sum(count_call(p, x), axis=0)

    lo, done = radix_threshold(count_fn, kk, N, bits)
    a, t, on = selection_rule(lo, done, kk)

    # Per-split counts with the compaction's chunking (its splits must see the same positions).
    cb = config.compact_block_n
    Sc, per_c = splits_for(R, pl.cdiv(N, cb), config.target_programs)
    fin = pl.pallas_call(
        functools.partial(_final_count_kernel, n=N, block_n=cb, per_split=per_c),
        grid=(R, Sc),
        in_specs=[pl.BlockSpec((None, 4), lambda r, s: (r, 0)), row_spec],
        out_specs=pl.BlockSpec((None, None, 4), lambda r, s: (s, r, 0)),
        out_shape=jax.ShapeDtypeStruct((Sc, R, 4), jnp.int32),
        compiler_params=params, interpret=interpret, name="topk_select_final_count",
    )(jnp.stack([a, t, on, jnp.zeros_like(a)], axis=1), x).transpose(1, 0, 2)  # [R, Sc, 4]
    quota, base, total = split_plan(kk, done, t, fin[..., 0], fin[..., 1], fin[..., 2])

    zeros = jnp.zeros_like(quota)
    p = jnp.stack([jnp.broadcast_to(a[:, None], quota.shape), jnp.broadcast_to(t[:, None], quota.shape),
                   jnp.broadcast_to(on[:, None], quota.shape), quota, base, zeros, zeros, zeros], axis=2)
    out = pl.pallas_call(
        functools.partial(_compact_kernel, n=N, block_n=cb, per_split=per_c, width=Kp),
        grid=(R, Sc),
        in_specs=[pl.BlockSpec((None, None, 8), lambda r, s: (r, s, 0)), row_spec],
        out_specs=pl.BlockSpec((None, Kp), lambda r, s: (r, 0)),
        out_shape=jax.ShapeDtypeStruct((R, Kp), jnp.int32),
        compiler_params=params, interpret=interpret, name="topk_select_compact",
    )(p, x)
    return pad_output(out, total).reshape(*lead, Kp)

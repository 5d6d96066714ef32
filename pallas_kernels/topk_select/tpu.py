"""Pallas TPU kernel of exact top-k selection: the radix threshold search's counting passes.

`_count_kernel` runs on a grid (row blocks of 8, chunks of `chunk` scores): each step turns an [8, chunk]
tile of scores into keys and adds, for each of the 2**bits candidate keys of its rows, how many keys are
>= it to an [8, 2**bits] accumulator (the output block, revisited along the chunk axis). The bookkeeping
between passes is `common.radix_threshold`; the compaction is XLA's (`xla.compact_xla`: a cumulative sum
and a scatter), since a Mosaic kernel has no vector scatter to write positions to data-dependent slots.

Counts are accumulated in f32 (exact below 2**24 keys per row). Semantics: exactly
`reference.topk_select_reference`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.topk_select.common import (INT_MIN, check_args, check_bits, float_keys, radix_threshold,
                                               row_counts)
from pallas_kernels.topk_select.xla import compact_xla

Array = jax.Array

_ROWS = 8  # rows per block: one f32 sublane tile
_MAX_N = 1 << 24  # f32 counters are exact below this


@dataclasses.dataclass(frozen=True)
class TpuSelectConfig:
    """Tuning of the TPU selection kernel.

    Attributes:
      bits_per_pass: radix bits per counting pass (1, 2, 4 or 8).
      chunk: scores per grid step along a row (a multiple of 128).
    """

    bits_per_pass: int = 4
    chunk: int = 2048


def _count_kernel(cand_ref, x_ref, o_ref, *, n: int, chunk: int, num_cand: int):
    """One (row block, chunk) step. Refs: cand i32[8, M]; x f32[8, chunk]; o f32[8, M] (accumulated)."""
    c = pl.program_id(1)

    @pl.when(c == 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, jnp.float32)

    x = x_ref[...]
    pos = c * chunk + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
    key = jnp.where(pos < n, float_keys(x), INT_MIN)  # padding: below every candidate j >= 1
    cand = cand_ref[...]
    lane = jax.lax.broadcasted_iota(jnp.int32, cand.shape, 1)
    res = jnp.zeros(cand.shape, jnp.float32)
    for j in range(1, num_cand):  # column 0 (the known lower bound) is not needed
        cnt = jnp.sum((key >= cand[:, j:j + 1]).astype(jnp.float32), axis=1, keepdims=True)
        res = jnp.where(lane == j, cnt, res)
    o_ref[...] += res


@functools.partial(jax.jit, static_argnames=("K", "config", "interpret"))
def topk_select_tpu(scores: Array, k, K: int, *, config: TpuSelectConfig = TpuSelectConfig(),
                    interpret: bool = False) -> Array:
    """Exact top-k positions per row: Pallas TPU counting passes + XLA compaction.

    Args:
      scores: f32[..., N] (N < 2**24); k: int or int array broadcastable to scores.shape[:-1]; K: static width.
      config: `TpuSelectConfig`.
      interpret: run the kernel in the Pallas interpreter (CPU tests).

    Returns:
      int32[..., min(K, N)]: chosen positions ascending, then -1.
    """
    lead, N, Kp = check_args(scores, k, K)
    check_bits(config.bits_per_pass)
    if config.chunk < 128 or config.chunk % 128:
        raise ValueError(f"TpuSelectConfig.chunk={config.chunk}: expected a multiple of 128")
    if N >= _MAX_N:
        raise ValueError(f"N={N} keys per row: the TPU kernel's f32 counters need N < {_MAX_N}")
    x = scores.reshape(-1, N)
    R = x.shape[0]
    kk = row_counts(k, lead, Kp)
    M = 1 << config.bits_per_pass
    chunk = N if N <= config.chunk else config.chunk  # a block dim equal to the array's is always legal
    call = pl.pallas_call(
        functools.partial(_count_kernel, n=N, chunk=chunk, num_cand=M),
        grid=(pl.cdiv(R, _ROWS), pl.cdiv(N, chunk)),
        in_specs=[pl.BlockSpec((_ROWS, M), lambda r, c: (r, 0)),
                  pl.BlockSpec((_ROWS, chunk), lambda r, c: (r, c))],
        out_specs=pl.BlockSpec((_ROWS, M), lambda r, c: (r, 0)),
        out_shape=jax.ShapeDtypeStruct((R, M), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret, name="topk_select_count_tpu")

    def count_fn(cand, active, lo, shift):
        del active, lo, shift
        return call(cand, x).astype(jnp.int32)

    lo, done = radix_threshold(count_fn, kk, N, config.bits_per_pass)
    return compact_xla(x, float_keys(x), kk, lo, done, Kp).reshape(*lead, Kp)

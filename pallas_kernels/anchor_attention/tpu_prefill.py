"""Pallas TPU kernels of the anchor prefill layer's tile-pooled scores (see gpu_prefill.py for the algorithm).

  * `_lse_kernel`, grid (B, Hq, nq, nk): flash attention without values over [bm, D] query blocks and
    [bn, D] key blocks (blocks above the diagonal skipped: their index map repeats the last needed block, so
    nothing is fetched), the online max / sum in VMEM scratch, the rows' logsumexp written at the last step.
  * `_pool_kernel`, grid (B, Hkv, nt, nc): one query tile of a KV head against one chunk of keys; for each of
    the G heads, exp(s - lse_row) summed over the tile's rows, then over the heads, written as a [1, chunk]
    block of f32[B, Hkv, nt, 1, W]; chunks at or after the tile start are -inf (and not fetched).
Inputs are transposed head-major ([B, H, T, D]) so every block's last two dims are (rows, D).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.anchor_attention.common import (block_counts, pool_blocks, block_width, check_block_size,
                                                    check_prefill_args, default_scale, mask_rows_lse)

Array = jax.Array

_MASK = -1e30


@dataclasses.dataclass(frozen=True)
class TpuPrefillScoresConfig:
    """Tuning of the TPU prefill scoring kernels.

    Attributes:
      block_m: query rows per lse block (a multiple of 8).
      block_n: keys per lse step (a multiple of 128, or >= T).
      chunk: keys per pooling step (a multiple of 128, or >= T).
    """

    block_m: int = 128
    block_n: int = 512
    chunk: int = 512


def _mm_t(a: Array, b: Array) -> Array:
    """a [M, D] . b [N, D]^T in f32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _lse_kernel(q_ref, k_ref, lse_ref, m_sc, l_sc, *, scale: float, bm: int, bn: int):
    """One (b, head, query block, key block) step. q [bm, D]; k [bn, D]; lse f32[bm, 1]; scratch m, l [bm, 1]."""
    i, c = pl.program_id(2), pl.program_id(3)

    @pl.when(c == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, _MASK, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)

    @pl.when(c * bn <= i * bm + bm - 1)
    def _():
        s = _mm_t(q_ref[...], k_ref[...]) * scale
        qpos = i * bm + lax.broadcasted_iota(jnp.int32, s.shape, 0)
        kpos = c * bn + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(kpos <= qpos, s, _MASK)
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        l_sc[...] = jnp.exp(m_prev - m_new) * l_sc[...] + jnp.sum(jnp.exp(s - m_new), axis=1, keepdims=True)
        m_sc[...] = m_new

    @pl.when(c == pl.num_programs(3) - 1)
    def _():
        lse_ref[...] = m_sc[...] + jnp.log(l_sc[...])


def _pad_rows(x: Array, rows: int) -> Array:
    return jnp.pad(x, ((0, 0), (0, rows - x.shape[1]), (0, 0), (0, 0))) if rows != x.shape[1] else x


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def prefill_lse_tpu(q: Array, k: Array, *, scale: float | None = None,
                    config: TpuPrefillScoresConfig = TpuPrefillScoresConfig(), interpret: bool = False) -> Array:
    """Causal logsumexp of every query row: f32[B, Hq, T] (see gpu_prefill.prefill_lse_gpu)."""
    B, T, Hq, D = q.shape
    Hkv, G = k.shape[2], Hq // k.shape[2]
    if config.block_m % 8 or config.block_n % 128:
        raise ValueError(f"TpuPrefillScoresConfig(block_m={config.block_m}, block_n={config.block_n}): expected "
                         f"multiples of 8 and 128")
    bm = min(config.block_m, -(-T // 8) * 8)
    nq = pl.cdiv(T, bm)
    bn = min(config.block_n, nq * bm)
    Tp = pl.cdiv(nq * bm, bn) * bn
    qh = _pad_rows(q, Tp).transpose(0, 2, 1, 3)  # [B, Hq, Tp, D]
    kh = _pad_rows(k, Tp).transpose(0, 2, 1, 3)  # [B, Hkv, Tp, D]

    def k_map(b, h, i, c):
        return b, h // G, jnp.minimum(c, (i * bm + bm - 1) // bn), 0  # above the diagonal: no new fetch

    lse = pl.pallas_call(
        functools.partial(_lse_kernel, scale=default_scale(D, scale), bm=bm, bn=bn),
        grid=(B, Hq, nq, Tp // bn),
        in_specs=[pl.BlockSpec((None, None, bm, D), lambda b, h, i, c: (b, h, i, 0)),
                  pl.BlockSpec((None, None, bn, D), k_map)],
        out_specs=pl.BlockSpec((None, None, bm, 1), lambda b, h, i, c: (b, h, i, 0)),
        out_shape=jax.ShapeDtypeStruct((B, Hq, nq * bm, 1), jnp.float32),
        scratch_shapes=[pltpu.VMEM((bm, 1), jnp.float32), pltpu.VMEM((bm, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret, name="anchor_prefill_lse_tpu",
    )(qh, kh)
    return lse[:, :, :T, 0]


def _pool_kernel(lse_ref, q_ref, k_ref, o_ref, *, scale: float, tile: int, chunk: int, G: int):
    """One (b, KV head, tile, chunk) step. lse f32[G, tile, 1] (+inf on rows past T); q [G, tile, D];
    k [chunk, D]; o f32[1, chunk]."""
    i, c = pl.program_id(2), pl.program_id(3)
    start = i * tile

    @pl.when(c * chunk < start)
    def _():
        k = k_ref[...]
        acc = jnp.zeros((1, chunk), jnp.float32)
        for g in range(G):
            s = _mm_t(q_ref[g], k) * scale  # [tile, chunk]
            acc = acc + jnp.sum(jnp.exp(s - lse_ref[g]), axis=0, keepdims=True)
        kpos = c * chunk + lax.broadcasted_iota(jnp.int32, acc.shape, 1)
        o_ref[...] = jnp.where(kpos < start, acc, -jnp.inf)

    @pl.when(c * chunk >= start)
    def _():
        o_ref[...] = jnp.full(o_ref.shape, -jnp.inf, jnp.float32)


@functools.partial(jax.jit, static_argnames=("tile", "scale", "config", "interpret"))
def tile_scores_tpu(q: Array, k: Array, *, tile: int, scale: float | None = None, lse: Array | None = None,
                    config: TpuPrefillScoresConfig = TpuPrefillScoresConfig(), interpret: bool = False,
                    lengths: Array | None = None) -> Array:
    """Tile-pooled causal scores f32[B, Hkv, ceil(T / tile), T] (semantics of
    `reference.tile_scores_reference`); tile a multiple of 8; lse f32[B, Hq, T] if already known; lengths i32[B]
    or None: the rows past a row's length add nothing (`common.mask_rows_lse`)."""
    B, T, Hq, D = q.shape
    Hkv, G = k.shape[2], Hq // k.shape[2]
    if tile % 8:
        raise ValueError(f"tile={tile}: the TPU prefill scoring kernel needs a multiple of 8")
    if config.chunk % 128:
        raise ValueError(f"TpuPrefillScoresConfig.chunk={config.chunk}: expected a multiple of 128")
    if lse is None:
        lse = prefill_lse_tpu(q, k, scale=scale, config=config, interpret=interpret)
    lse = mask_rows_lse(lse, lengths)
    nt = pl.cdiv(T, tile)
    Tp = nt * tile
    chunk = min(config.chunk, pl.cdiv(T, 128) * 128)
    W = pl.cdiv(T, chunk) * chunk
    rows = max(Tp, W)
    qh = _pad_rows(q, rows).transpose(0, 2, 1, 3)  # [B, Hq, rows, D]
    kh = _pad_rows(k, rows).transpose(0, 2, 1, 3)  # [B, Hkv, rows, D]
    lse = jnp.pad(lse.astype(jnp.float32), ((0, 0), (0, 0), (0, Tp - T)), constant_values=jnp.inf)
    lse = lse.reshape(B, Hkv, G, nt, tile).transpose(0, 1, 3, 2, 4)[..., None]  # [B, Hkv, nt, G, tile, 1]

    def k_map(b, h, i, c):
        return b, h, jnp.minimum(c, jnp.maximum(pl.cdiv(i * tile, chunk) - 1, 0)), 0  # no fetch past the start

    out = pl.pallas_call(
        functools.partial(_pool_kernel, scale=default_scale(D, scale), tile=tile, chunk=chunk, G=G),
        grid=(B, Hkv, nt, W // chunk),
        in_specs=[pl.BlockSpec((None, None, None, G, tile, 1), lambda b, h, i, c: (b, h, i, 0, 0, 0)),
                  pl.BlockSpec((None, G, tile, D), lambda b, h, i, c: (b, h, i, 0)),
                  pl.BlockSpec((None, None, chunk, D), k_map)],
        out_specs=pl.BlockSpec((None, None, None, 1, chunk), lambda b, h, i, c: (b, h, i, 0, c)),
        out_shape=jax.ShapeDtypeStruct((B, Hkv, nt, 1, W), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret, name="anchor_prefill_pool_tpu",
    )(lse, qh, kh)
    return out[:, :, :, 0, :T]


@functools.partial(jax.jit, static_argnames=("tile", "budget", "min_tokens", "K", "scale", "dense_output",
                                             "block_size", "config", "interpret"))
def anchor_prefill_tpu(q: Array, k: Array, v: Array, lengths: Array, *, tile: int, budget: float,
                       min_tokens: int = 128, K: int | None = None, scale: float | None = None,
                       dense_output: bool = False, block_size: int = 1,
                       config: TpuPrefillScoresConfig = TpuPrefillScoresConfig(),
                       interpret: bool = False) -> tuple[Array, Array]:
    """Anchor prefill layer on the TPU: Pallas scores, TPU top-k counting, then `sparse_prefill` (or dense
    attention). Args and returns as `reference.anchor_prefill_reference`."""
    from pallas_kernels.sparse_attention import sparse_prefill
    from pallas_kernels.topk_select import tpu as select_tpu

    K = check_prefill_args(q, k, v, lengths, tile, budget, min_tokens, K)
    check_block_size(block_size, tile)
    T = q.shape[1]
    scores = pool_blocks(tile_scores_tpu(q, k, tile=tile, scale=scale, config=config, interpret=interpret,
                                          lengths=lengths), block_size)
    indices = select_tpu.topk_select_tpu(scores, block_counts(budget, T, tile, min_tokens, block_size)[None, None, :],
                                         block_width(K, block_size), interpret=interpret)
    if dense_output:
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=scale, implementation="xla")
    else:  # the TPU kernel where it takes the blocks; XLA otherwise and when interpreted (on any host, a GPU too)
        from pallas_kernels.sparse_attention.api import supported
        impl = "pallas_tpu" if not interpret and supported("pallas_tpu", q, block_size=block_size, tile=tile) \
            else "xla"
        out = sparse_prefill(q, k, v, indices, lengths, tile=tile, block_size=block_size, scale=scale,
                             implementation=impl)
    return out, indices

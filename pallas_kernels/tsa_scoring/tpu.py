"""Token Sparse Attention key scoring as two Pallas TPU (Mosaic) kernels.

Never materialises the [W, T] probabilities: only the log-sum-exp of the window queries (lane-replicated,
f32[B, Hkv, G, Wq, 128]) and the [B, Hq, T] result reach HBM.

  pass 1 `_lse_kernel`, grid (B, Hkv, key blocks), the key axis sequential ("arbitrary"): all G query heads
    of a KV head share each K block; the row max / row sum of exp of the G x W window queries live in VMEM
    scratch across key blocks (flash-style online softmax) and the log-sum-exp is written at the last block.
  pass 2 `_mean_prob_kernel`, grid (B, Hkv, key blocks), all parallel: recomputes q.k for one key block,
    turns it into probabilities with pass 1's log-sum-exp and sums them over the window queries.

The row lengths are scalar-prefetched (SMEM). Key blocks at or past a row's length are not computed, and in
pass 1 their index map repeats the last valid block so no DMA is issued for them. Keys are read from
[B, T, Hkv * D] (a free reshape of the caller's [B, T, Hkv, D]) when D is a multiple of 128, otherwise from a
head-major copy [B, Hkv, T, D] (TPU blocks need their last two dims to be multiples of (8, 128) or full).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tsa_scoring import common

Array = jax.Array

_NEG = -1e30  # finite "minus infinity" (no NaN from _NEG - _NEG)
_LANES = 128
_NT = (((1,), (1,)), ((), ()))  # q [Wq, D] . k [bk, D] -> [Wq, bk]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes.

    Attributes:
      block_k: keys per grid step of pass 1 and per output tile of pass 2 (a multiple of 128).
    """

    block_k: int = 512

    def __post_init__(self):
        if not isinstance(self.block_k, int) or self.block_k < 128 or self.block_k % 128:
            raise ValueError(f"BlockSizes.block_k must be a positive multiple of 128, got {self.block_k!r}")


def _mask(length, j, *, window, wq, block_k):
    """Window slot i sees key c iff c <= p_i = length - window + i, and i < window (rows past W pad)."""
    rows = lax.broadcasted_iota(jnp.int32, (wq, block_k), 0)
    cols = j * block_k + lax.broadcasted_iota(jnp.int32, (wq, block_k), 1)
    return (cols <= length - window + rows) & (rows < window)


def _lse_kernel(len_ref, q_ref, k_ref, lse_ref, m_sc, l_sc, *, scale, window, groups, wq, block_k,
                num_k_blocks, precision):
    """Refs: len_ref i32[B] (SMEM); q_ref [G, Wq, D]; k_ref [block_k, D]; lse_ref, m_sc, l_sc f32[G, Wq, 128]."""
    b, j = pl.program_id(0), pl.program_id(2)
    length = len_ref[b]

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, _NEG, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)

    @pl.when(j * block_k < length)
    def _():
        k = k_ref[...]
        mask = _mask(length, j, window=window, wq=wq, block_k=block_k)
        for g in range(groups):
            s = lax.dot_general(q_ref[g], k, _NT, precision=precision, preferred_element_type=jnp.float32)
            s = jnp.where(mask, s * scale, _NEG)
            m_prev = m_sc[g]  # [Wq, 128], lane-replicated
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p = jnp.where(mask, jnp.exp(s - jnp.tile(m_next, (1, block_k // _LANES))), 0.0)
            l_sc[g] = jnp.exp(m_prev - m_next) * l_sc[g] + jnp.sum(p, axis=1, keepdims=True)
            m_sc[g] = m_next

    @pl.when(j == num_k_blocks - 1)
    def _():
        l = l_sc[...]
        lse_ref[...] = jnp.where(l > 0, m_sc[...] + jnp.log(jnp.where(l > 0, l, 1.0)), 0.0)


def _mean_prob_kernel(len_ref, q_ref, lse_ref, k_ref, o_ref, *, scale, window, groups, wq, block_k,
                      precision):
    """Refs: len_ref i32[B] (SMEM); q_ref [G, Wq, D]; lse_ref f32[G, Wq, 128]; k_ref [block_k, D];
    o_ref f32[G, block_k] (sums over the window queries)."""
    b, j = pl.program_id(0), pl.program_id(2)
    length = len_ref[b]

    @pl.when(j * block_k >= length)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, jnp.float32)

    @pl.when(j * block_k < length)
    def _():
        k = k_ref[...]
        mask = _mask(length, j, window=window, wq=wq, block_k=block_k)
        for g in range(groups):
            s = lax.dot_general(q_ref[g], k, _NT, precision=precision, preferred_element_type=jnp.float32)
            lse = jnp.tile(lse_ref[g], (1, block_k // _LANES))
            p = jnp.where(mask, jnp.exp(s * scale - lse), 0.0)
            o_ref[pl.ds(g, 1), :] = jnp.sum(p, axis=0, keepdims=True)


@functools.partial(jax.jit, static_argnames=("window", "scale", "block_sizes", "interpret"))
def _mean_probs(q, k, lengths, *, window, scale, block_sizes, interpret):
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    bk = block_sizes.block_k
    nkb = pl.cdiv(T, bk)
    Wq = pl.cdiv(window, 8) * 8
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    qw = common.gather_window_queries(q, lengths, window)  # [B, W, Hq, D]
    qw = qw.reshape(B, window, Hkv, G, D).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, W, D]
    qw = jnp.pad(qw, ((0, 0), (0, 0), (0, 0), (0, Wq - window), (0, 0)))

    def last_block(lens, b):
        return jnp.maximum(lax.div(lens[b] + bk - 1, bk) - 1, 0)

    if D % _LANES == 0:
        k_in = k.reshape(B, T, Hkv * D)  # free; head h's columns are block h of width D
        k_spec_1 = pl.BlockSpec((None, bk, D), lambda b, h, j, lens: (b, jnp.minimum(j, last_block(lens, b)), h))
        k_spec_2 = pl.BlockSpec((None, bk, D), lambda b, h, j, lens: (b, j, h))
    else:
        k_in = k.transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
        k_spec_1 = pl.BlockSpec(
            (None, None, bk, D), lambda b, h, j, lens: (b, h, jnp.minimum(j, last_block(lens, b)), 0))
        k_spec_2 = pl.BlockSpec((None, None, bk, D), lambda b, h, j, lens: (b, h, j, 0))
    q_spec = pl.BlockSpec((None, None, G, Wq, D), lambda b, h, j, lens: (b, h, 0, 0, 0))
    lse_spec = pl.BlockSpec((None, None, G, Wq, _LANES), lambda b, h, j, lens: (b, h, 0, 0, 0))
    statics = dict(scale=scale, window=window, groups=G, wq=Wq, block_k=bk, precision=precision)

    lse = pl.pallas_call(
        functools.partial(_lse_kernel, num_k_blocks=nkb, **statics),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, Hkv, nkb),
            in_specs=[q_spec, k_spec_1],
            out_specs=lse_spec,
            scratch_shapes=[pltpu.VMEM((G, Wq, _LANES), jnp.float32)] * 2,
        ),
        out_shape=jax.ShapeDtypeStruct((B, Hkv, G, Wq, _LANES), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="tsa_scoring_lse",
    )(lengths, qw, k_in)

    sums = pl.pallas_call(
        functools.partial(_mean_prob_kernel, **statics),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, Hkv, nkb),
            in_specs=[q_spec, lse_spec, k_spec_2],
            out_specs=pl.BlockSpec((None, None, G, bk), lambda b, h, j, lens: (b, h, 0, j)),
        ),
        out_shape=jax.ShapeDtypeStruct((B, Hkv, G, T), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=interpret,
        name="tsa_scoring_mean_probs",
    )(lengths, qw, lse, k_in)
    w_eff = jnp.maximum(jnp.minimum(lengths, window), 1).astype(jnp.float32)
    return sums.reshape(B, Hq, T) / w_eff[:, None, None]


def tsa_mean_probs_tpu(
    q: Array,
    k: Array,
    *,
    window: int = 128,
    lengths: Array | None = None,
    scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> Array:
    """Mean softmax probability per (query head, key) over the last W queries; see reference.py.

    Args:
      q: [B, T, Hq, D] queries after RoPE (bf16 or f32).
      k: [B, T, Hkv, D] keys after RoPE, same dtype.
      window: W.
      lengths: i32[B] valid tokens per row, or None (all T).
      scale: softmax scale (default 1 / sqrt(D)).
      block_sizes: tiles (default BlockSizes()).
      interpret: run the kernels in Pallas interpret mode (CPU).

    Returns:
      f32[B, Hq, T], 0 for keys >= lengths.
    """
    B, T, _, _, D = common.check_inputs(q, k, lengths)
    window = common.check_window(window)
    scale = common.default_scale(D, scale)
    lens = common.full_lengths(B, T, lengths)
    return _mean_probs(q, k, lens, window=window, scale=scale, block_sizes=block_sizes or BlockSizes(),
                       interpret=interpret)


def tsa_scores_tpu(
    q: Array,
    k: Array,
    *,
    window: int = 128,
    pool_kernel: int = 7,
    lengths: Array | None = None,
    scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> Array:
    """Pooled TSA key scores with the TPU kernels: f32[B, Hq, T] (see `tsa_mean_probs_tpu`)."""
    pool_kernel = common.check_pool_kernel(pool_kernel)
    mean = tsa_mean_probs_tpu(q, k, window=window, lengths=lengths, scale=scale, block_sizes=block_sizes,
                              interpret=interpret)
    return common.avg_pool_keys(mean, pool_kernel, lengths)

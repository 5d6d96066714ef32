"""Pallas TPU kernels of the gathered sparse-attention ops, at block granularity.

Sparsity enters as scalar-prefetched data (`pltpu.PrefetchScalarGridSpec`): the block tables sit in SMEM and
the K/V BlockSpec index maps read them, so the Pallas pipeline DMAs exactly the selected [block_size, D]
blocks from HBM (as jax/experimental/pallas/ops/tpu/paged_attention does with page tables). `blocks_per_step`
K/V BlockSpecs over the same array let one grid step consume several selected blocks. Padding entries point at
the previous real block, so the pipeline does not fetch anything new for them, and their compute is skipped
with `pl.when`.

Decode (`sparse_decode_tpu`): grid (B, Hkv, T, steps); one program holds the whole GQA group's queries
  ([G, D]) and runs an online softmax in VMEM scratch over the selected blocks of its row.
Prefill (`sparse_prefill_tpu`): grid (B, Hq, nt, steps); a program's block table is the tile's selected blocks
  (those before the tile start) followed by the diagonal tile's blocks.

block_size must be a multiple of 8 (a sublane tile; bf16 packs 16 rows per tile, so 16 is the natural size
there), and D a multiple of 128 or the whole head dim. Semantics: exactly `reference.py`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.sparse_attention.common import (blocks_at_or_before, blocks_before, check_decode_args,
                                                   check_prefill_args, default_scale)

Array = jax.Array

_MASK = -1e30


@dataclasses.dataclass(frozen=True)
class TpuConfig:
    """Tuning of the TPU kernels.

    Attributes:
      blocks_per_step: selected blocks consumed per grid step (K/V BlockSpecs per array).
    """

    blocks_per_step: int = 4


def unsupported_reason(dtype, head_dim: int, block_size: int, tile: int | None) -> str | None:
    """Why the TPU kernels cannot take these arguments (None when they can)."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"dtype {jnp.dtype(dtype)} (expected bfloat16 or float32)"
    if block_size % 8:
        return f"block_size={block_size} (the TPU kernels gather blocks of a multiple of 8 rows)"
    if tile is not None and tile % 8:
        return f"tile={tile} (expected a multiple of 8)"
    return None


def _check_supported(q: Array, block_size: int, tile: int | None, config: TpuConfig) -> None:
    reason = unsupported_reason(q.dtype, q.shape[-1], block_size, tile)
    if reason is not None:
        raise ValueError(f"the Pallas TPU sparse-attention kernel cannot take {reason}")
    if config.blocks_per_step < 1:
        raise ValueError(f"TpuConfig.blocks_per_step={config.blocks_per_step}: expected >= 1")


def _forward_fill(ent: Array) -> Array:
    """Block ids the pipeline fetches: each -1 entry repeats the last real block before it (0 if none).

    Args:
      ent: int32[R, M] entries, -1 where unused.

    Returns:
      int32[R, M] valid block ids.
    """
    pos = jnp.arange(ent.shape[-1], dtype=jnp.int32)
    last = lax.cummax(jnp.where(ent >= 0, pos, -1), axis=ent.ndim - 1)
    filled = jnp.take_along_axis(ent, jnp.maximum(last, 0), axis=-1)
    return jnp.where(last >= 0, filled, 0).astype(jnp.int32)


def _flash_block(q, k, v, ok, m_sc, l_sc, acc_sc, scale):
    """Online-softmax update with one block: q [M, D], k/v [bs, D], ok bool[M, bs]; scratch m/l f32[M, 1],
    acc f32[M, D]."""
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
    s = jnp.where(ok, s, _MASK)
    m_prev = m_sc[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    corr = jnp.exp(m_prev - m_new)
    p = jnp.where(ok, jnp.exp(s - m_new), 0.0)
    l_sc[...] = corr * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
    v = jnp.where(jnp.any(ok, axis=0)[:, None], v, jnp.zeros((), v.dtype))  # rows no query sees (maybe NaN): zeroed
    acc_sc[...] = corr * acc_sc[...] + lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                                       preferred_element_type=jnp.float32)
    m_sc[...] = m_new


def _init_scratch(m_sc, l_sc, acc_sc):
    m_sc[...] = jnp.full(m_sc.shape, _MASK, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)


# ---------------------------------------------------------------------------------------------------------
# Decode.


def _decode_kernel(lim_ref, blk_ref, ent_ref, q_ref, *refs, n: int, block_size: int, scale: float,
                   num_heads: int, T: int, M: int):
    """One (b, h, t, step) program. Scalar refs: lim i32[B*T] last visible token; blk, ent i32[B*Hkv*T*M]
    fetched block ids and real entries (-1 unused). q_ref: [G, D]; refs: n K blocks [bs, D], n V blocks,
    outputs o [G, D] and lse f32[G, 1], scratch m, l f32[G, 1] and acc f32[G, D]."""
    k_refs, v_refs = refs[:n], refs[n:2 * n]
    o_ref, lse_ref, m_sc, l_sc, acc_sc = refs[2 * n:]
    b, h, t, j = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _():
        _init_scratch(m_sc, l_sc, acc_sc)

    lim = lim_ref[b * T + t]
    row = ((b * num_heads + h) * T + t) * M + j * n
    q = q_ref[...]
    g = q.shape[0]
    for r in range(n):
        e = ent_ref[row + r]

        @pl.when(e >= 0)
        def _(r=r, e=e):
            tok = e * block_size + lax.broadcasted_iota(jnp.int32, (g, block_size), 1)
            _flash_block(q, k_refs[r][...], v_refs[r][...], tok <= lim, m_sc, l_sc, acc_sc, scale)

    @pl.when(j == pl.num_programs(3) - 1)
    def _():
        l = l_sc[...]
        nonempty = l > 0
        l_safe = jnp.where(nonempty, l, 1.0)
        o_ref[...] = jnp.where(nonempty, acc_sc[...] / l_safe, 0.0).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(nonempty, m_sc[...] + jnp.log(l_safe), -jnp.inf)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "return_lse", "config", "interpret"))
def sparse_decode_tpu(q: Array, k: Array, v: Array, indices: Array, lengths: Array, *, block_size: int = 16,
                      scale: float | None = None, return_lse: bool = False, config: TpuConfig = TpuConfig(),
                      interpret: bool = False) -> Array | tuple[Array, Array]:
    """Gathered decode attention, Pallas TPU kernel. Args and returns as `reference.sparse_decode_reference`.

    Args:
      q: [B, T, Hq, D]; k, v: [B, Hkv, N, D]; indices: int32[B, Hkv, T, K] (block_size % 8 == 0);
        lengths: int32[B].
      config: `TpuConfig`.
      interpret: run in the Pallas interpreter (CPU tests).

    Returns:
      [B, T, Hq, D] in q.dtype (and lse: f32[B, T, Hq] with return_lse).
    """
    check_decode_args(q, k, v, indices, lengths, block_size)
    _check_supported(q, block_size, None, config)
    B, T, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G, K = Hq // Hkv, indices.shape[3]
    n = min(config.blocks_per_step, K)
    steps = pl.cdiv(K, n)
    M = steps * n
    scale = default_scale(D, scale)

    lengths = lengths.astype(jnp.int32)
    lim = jnp.minimum(lengths[:, None] - T + jnp.arange(T, dtype=jnp.int32), N - 1)  # [B, T]
    ent = jnp.pad(indices.astype(jnp.int32), ((0, 0), (0, 0), (0, 0), (0, M - K)), constant_values=-1)
    ent = jnp.where(blocks_at_or_before(ent, lim[:, None, :, None], block_size), ent, -1)  # drop useless ones
    blk = _forward_fill(ent.reshape(-1, M))
    qg = q.reshape(B, T, Hkv, G, D).transpose(0, 2, 1, 3, 4)  # [B, Hkv, T, G, D]

    def kv_spec(r):
        # Block r of step j: entry j * n + r of row (b, h, t), read from the prefetched table.
        return pl.BlockSpec((None, None, block_size, D),
                            lambda b, h, t, j, lim, blk, ent: (b, h, blk[((b * Hkv + h) * T + t) * M + j * n + r], 0))

    kernel = functools.partial(_decode_kernel, n=n, block_size=block_size, scale=scale, num_heads=Hkv, T=T, M=M)
    o, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(B, Hkv, T, steps),
            in_specs=[pl.BlockSpec((None, None, None, G, D), lambda b, h, t, j, *_: (b, h, t, 0, 0))]
            + [kv_spec(r) for r in range(n)] + [kv_spec(r) for r in range(n)],
            out_specs=[pl.BlockSpec((None, None, None, G, D), lambda b, h, t, j, *_: (b, h, t, 0, 0)),
                       pl.BlockSpec((None, None, None, G, 1), lambda b, h, t, j, *_: (b, h, t, 0, 0))],
            scratch_shapes=[pltpu.VMEM((G, 1), jnp.float32), pltpu.VMEM((G, 1), jnp.float32),
                            pltpu.VMEM((G, D), jnp.float32)],
        ),
        out_shape=[jax.ShapeDtypeStruct((B, Hkv, T, G, D), q.dtype),
                   jax.ShapeDtypeStruct((B, Hkv, T, G, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="sparse_decode_gathered_tpu",
    )(lim.reshape(-1), blk.reshape(-1), ent.reshape(-1), qg, *([k] * n), *([v] * n))

    out = o.transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, D)
    if return_lse:
        return out, lse[..., 0].transpose(0, 2, 1, 3).reshape(B, T, Hq)
    return out


# ---------------------------------------------------------------------------------------------------------
# Prefill.


def _prefill_kernel(len_ref, blk_ref, ent_ref, q_ref, *refs, n: int, block_size: int, scale: float, tile: int,
                    group: int, num_heads: int, nt: int, M: int):
    """One (b, query head, query tile, step) program. Scalar refs: len i32[B]; blk, ent i32[B*Hkv*nt*M]
    (selected blocks before the tile start, then the diagonal blocks; -1 unused). q_ref: [tile, D]; refs: n
    K blocks, n V blocks [bs, D], output [tile, D], scratch m, l f32[tile, 1], acc f32[tile, D]."""
    k_refs, v_refs = refs[:n], refs[n:2 * n]
    o_ref, m_sc, l_sc, acc_sc = refs[2 * n:]
    b, hq, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _():
        _init_scratch(m_sc, l_sc, acc_sc)

    length = len_ref[b]
    row = ((b * num_heads + hq // group) * nt + i) * M + j * n
    qpos = i * tile + lax.broadcasted_iota(jnp.int32, (tile, block_size), 0)
    q = q_ref[...]
    for r in range(n):
        e = ent_ref[row + r]

        @pl.when(e >= 0)
        def _(r=r, e=e):
            tok = e * block_size + lax.broadcasted_iota(jnp.int32, (tile, block_size), 1)
            ok = (tok <= qpos) & (qpos < length)
            _flash_block(q, k_refs[r][...], v_refs[r][...], ok, m_sc, l_sc, acc_sc, scale)

    @pl.when(j == pl.num_programs(3) - 1)
    def _():
        l = l_sc[...]
        nonempty = l > 0
        o_ref[...] = jnp.where(nonempty, acc_sc[...] / jnp.where(nonempty, l, 1.0), 0.0).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("tile", "block_size", "scale", "config", "interpret"))
def sparse_prefill_tpu(q: Array, k: Array, v: Array, indices: Array, lengths: Array, *, tile: int = 128,
                       block_size: int = 16, scale: float | None = None, config: TpuConfig = TpuConfig(),
                       interpret: bool = False) -> Array:
    """Tile-gathered prefill attention, Pallas TPU kernel. Args and returns as
    `reference.sparse_prefill_reference`.

    Args:
      q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]; indices: int32[B, Hkv, ceil(T/tile), K] (block_size % 8 == 0,
        tile % block_size == 0); lengths: int32[B].
      config: `TpuConfig`.
      interpret: run in the Pallas interpreter (CPU tests).

    Returns:
      [B, T, Hq, D] in q.dtype; rows at or beyond lengths are zeros.
    """
    check_prefill_args(q, k, v, indices, lengths, tile, block_size)
    _check_supported(q, block_size, tile, config)
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G, nt, K = Hq // Hkv, indices.shape[2], indices.shape[3]
    Tp = nt * tile
    nd = tile // block_size  # diagonal blocks per tile
    n = min(config.blocks_per_step, K + nd)
    steps = pl.cdiv(K + nd, n)
    M = steps * n
    scale = default_scale(D, scale)

    starts = jnp.arange(nt, dtype=jnp.int32) * tile
    sel = indices.astype(jnp.int32)
    sel = jnp.where(blocks_before(sel, starts[:, None], block_size), sel, -1)  # before the tile start only
    diag = jnp.broadcast_to(starts[:, None] // block_size + jnp.arange(nd, dtype=jnp.int32), (B, Hkv, nt, nd))
    ent = jnp.concatenate([sel, diag, jnp.full((B, Hkv, nt, M - K - nd), -1, jnp.int32)], axis=-1)
    blk = _forward_fill(ent.reshape(-1, M))

    pad = [(0, 0), (0, Tp - T), (0, 0), (0, 0)]
    qh = jnp.pad(q, pad).transpose(0, 2, 1, 3)  # [B, Hq, Tp, D]
    kh = jnp.pad(k, pad).transpose(0, 2, 1, 3)  # [B, Hkv, Tp, D]
    vh = jnp.pad(v, pad).transpose(0, 2, 1, 3)
    lens = jnp.minimum(lengths.astype(jnp.int32), T)

    def kv_spec(r):
        return pl.BlockSpec((None, None, block_size, D),
                            lambda b, h, i, j, ln, blk, ent: (b, h // G, blk[((b * Hkv + h // G) * nt + i) * M + j * n + r], 0))

    kernel = functools.partial(_prefill_kernel, n=n, block_size=block_size, scale=scale, tile=tile, group=G,
                               num_heads=Hkv, nt=nt, M=M)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(B, Hq, nt, steps),
            in_specs=[pl.BlockSpec((None, None, tile, D), lambda b, h, i, j, *_: (b, h, i, 0))]
            + [kv_spec(r) for r in range(n)] + [kv_spec(r) for r in range(n)],
            out_specs=pl.BlockSpec((None, None, tile, D), lambda b, h, i, j, *_: (b, h, i, 0)),
            scratch_shapes=[pltpu.VMEM((tile, 1), jnp.float32), pltpu.VMEM((tile, 1), jnp.float32),
                            pltpu.VMEM((tile, D), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((B, Hq, Tp, D), q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="sparse_prefill_gathered_tpu",
    )(lens, blk.reshape(-1), ent.reshape(-1), qh, *([kh] * n), *([vh] * n))
    return out.transpose(0, 2, 1, 3)[:, :T]

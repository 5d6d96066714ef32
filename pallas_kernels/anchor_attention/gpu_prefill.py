"""Pallas GPU (Triton) kernels of the anchor prefill layer: tile-pooled scores without materialising [T, T].

Kascade's prefill anchor needs, for every query tile i and KV head, the causal post-softmax weights of each key
before the tile, summed over the tile's rows and the GQA group's heads: f32[B, Hkv, nT, T]. The [T, T]
probabilities are never stored; two passes over the keys, each one Q.K^T of the causal half (the FLOPs of a
dense causal attention in total, and as many exps):
  * `_lse_kernel`, grid (B, Hq, nT_lse): flash attention without values: each program runs a block of `bm`
    query rows of one head over the keys up to its diagonal, with an online max and sum of exp, and writes the
    rows' logsumexp f32[B, Hq, Tp]. A dense anchor (Kascade's layer 0) can take the lse from its dense
    attention instead (`lse=`).
  * `_pool_kernel`, grid (B, Hkv, nT): one program per KV head and query tile; for each of the G heads in turn
    (its [tile, D] queries held in registers) it streams the keys before the tile start, `pool_block_n` at a
    time, computes the transposed logits [keys, rows] (so the sum over the tile's rows is a row reduction
    inside each warp, like flash attention's row sums) and adds sum_rows exp(s - lse_row) to the output row
    (the first head writes, the others read-add-write the same addresses: deterministic); keys at and after
    the tile start are written as -inf.
Both schedule the costliest (last) query blocks first. On a Hopper GPU (bf16/f16, head_dim 64 or 128, tile 32,
64 or 128) the same two passes run as warp-specialised Mosaic GPU kernels instead (`mgpu_prefill`, chosen by
`PrefillScoresConfig.mosaic`; about 1.6x faster at 128K). Then `topk_select` (Triton) and `sparse_prefill`
(Triton; with block selections on Hopper the Mosaic GPU kernel) or the dense cuDNN attention finish the layer
(`anchor_prefill_gpu`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.anchor_attention import mgpu_prefill
from pallas_kernels.anchor_attention.common import (block_counts, pool_blocks, block_width, budget_count,
                                                    check_block_size, check_prefill_args, default_scale,
                                                    mask_rows_lse)

Array = jax.Array

_MASK = -1e30


@dataclasses.dataclass(frozen=True)
class PrefillScoresConfig:
    """Tuning of the prefill scoring kernels.

    Attributes:
      lse_block_m: query rows per program of the lse pass (a power of two >= 16).
      block_n: keys per inner iteration of the lse pass (a power of two dividing lse_block_m).
      pool_block_n: keys per inner iteration of the pooling pass (a power of two >= 16 dividing the tile).
      num_warps: warps per program (of the lse pass; of the pooling pass too unless pool_num_warps is set).
      num_stages: software pipelining depth (likewise).
      pool_num_warps, pool_num_stages: the pooling pass's own (None: num_warps, num_stages). The H100 sweep in
        eval/results/h100/bench_attention_llama3-8b.json (128K) ran the lse pass best at block_n 128, 8 warps
        (211 ms vs 220) and the pooling pass at pool_block_n 64, 4 warps, 3 stages (251 ms vs 310);
        `TUNED_H100` combines the two and is now the default (see the note below the class).
      mosaic: on a Hopper GPU, with bf16/f16 operands, head_dim 64 or 128 and tile 32, 64 or 128, run the
        Mosaic GPU kernels of `mgpu_prefill` instead (the fields above then play no part): at 128K on the H100
        the lse pass takes 140 ms instead of 207 and the pooling pass 127 ms instead of 240 at tile 128, 150
        instead of 487 at tile 32 (eval/results/h100/anchor_mgpu/).
    """

    lse_block_m: int = 128
    block_n: int = 128
    pool_block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    pool_num_warps: int | None = 4
    pool_num_stages: int | None = 3
    mosaic: bool = True


# The defaults since eval/results/h100/anchor_variants.json (32K, B 1, tile 128): anchor prefill 33.1 ms with these
# settings against 37.9 ms with the earlier ones (block_n 64, pool_block_n 128, 8 warps, 2 stages for both passes).
TUNED_H100 = PrefillScoresConfig()


def _pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def _use_mosaic(q: Array, k: Array, tile: int | None, config: PrefillScoresConfig, interpret: bool) -> bool:
    """Whether the Mosaic GPU kernels (`mgpu_prefill`) take this call: compiled, asked for, and supported."""
    return not interpret and config.mosaic and mgpu_prefill.mgpu_supported(q, k, tile)


def _check(q: Array, tile: int | None, config: PrefillScoresConfig, interpret: bool) -> None:
    D = q.shape[-1]
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        raise ValueError(f"the Pallas GPU prefill scoring kernels cannot take dtype {q.dtype}")
    if not _pow2(D) or D < 16:
        raise ValueError(f"head_dim D={D}: the Triton kernels need a power of two >= 16")
    min_rows = 1 if interpret else 16
    if tile is not None and (not _pow2(tile) or tile < min_rows):
        raise ValueError(f"tile={tile}: the prefill scoring kernel needs a power of two >= {min_rows}")
    bm, bn, pn = config.lse_block_m, config.block_n, config.pool_block_n
    if (not _pow2(bm) or bm < min_rows or not _pow2(bn) or bn < min(16, min_rows) or bm % bn or not _pow2(pn)
            or pn < min_rows):
        raise ValueError(f"PrefillScoresConfig(lse_block_m={bm}, block_n={bn}, pool_block_n={pn}): expected "
                         f"powers of two (>= {min_rows}), block_n dividing lse_block_m")


def _lse_kernel(q_ref, k_ref, lse_ref, *, scale: float, bm: int, bn: int, nq: int):
    """One (b, query head, query block) program; grid step i runs block nq - 1 - i. Refs: q [bm, D];
    k [Tp, D] (the head's KV head); lse f32[bm]."""
    i = nq - 1 - pl.program_id(2)
    start = i * bm
    q = q_ref[...]
    qpos = start + jnp.arange(bm, dtype=jnp.int32)

    def step(c, carry, masked: bool):
        m, l = carry
        k = k_ref[pl.ds(c * bn, bn), :]
        s = plgpu.dot(q, k, trans_b=True) * scale
        if masked:
            kpos = c * bn + jnp.arange(bn, dtype=jnp.int32)
            s = jnp.where(kpos[None, :] <= qpos[:, None], s, _MASK)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        l = jnp.exp(m - m_new) * l + jnp.sum(jnp.exp(s - m_new[:, None]), axis=1)
        return m_new, l

    carry = (jnp.full((bm,), _MASK, jnp.float32), jnp.zeros((bm,), jnp.float32))
    full = start // bn  # key blocks wholly before the query block: no mask
    carry = lax.fori_loop(0, full, functools.partial(step, masked=False), carry)
    carry = lax.fori_loop(full, (start + bm) // bn, functools.partial(step, masked=True), carry)
    m, l = carry
    lse_ref[...] = m + jnp.log(l)


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def prefill_lse_gpu(q: Array, k: Array, *, scale: float | None = None,
                    config: PrefillScoresConfig = PrefillScoresConfig(), interpret: bool = False) -> Array:
    """Causal logsumexp of every query row (all T rows, lengths play no part).

    Args:
      q: [B, T, Hq, D]; k: [B, T, Hkv, D].

    Returns:
      f32[B, Hq, T].
    """
    if _use_mosaic(q, k, None, config, interpret):
        return mgpu_prefill.prefill_lse_mgpu(q, k, scale=scale)
    _check(q, None, config, interpret)
    B, T, Hq, D = q.shape
    Hkv, G = k.shape[2], Hq // k.shape[2]
    bm, bn = config.lse_block_m, config.block_n
    nq = pl.cdiv(T, bm)
    Tp = nq * bm
    if Tp != T:
        pad = [(0, 0), (0, Tp - T), (0, 0), (0, 0)]
        q, k = jnp.pad(q, pad), jnp.pad(k, pad)
    last = nq - 1
    lse = pl.pallas_call(
        functools.partial(_lse_kernel, scale=default_scale(D, scale), bm=bm, bn=bn, nq=nq),
        grid=(B, Hq, nq),
        in_specs=[pl.BlockSpec((None, bm, None, D), lambda b, h, i: (b, last - i, h, 0)),
                  pl.BlockSpec((None, Tp, None, D), lambda b, h, i: (b, 0, h // G, 0))],
        out_specs=pl.BlockSpec((None, None, bm), lambda b, h, i: (b, h, last - i)),
        out_shape=jax.ShapeDtypeStruct((B, Hq, Tp), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret, name="anchor_prefill_lse",
    )(q, k)
    return lse[:, :, :T]


def _pool_kernel(lse_ref, q_ref, k_ref, o_ref, *, scale: float, tile: int, bn: int, G: int, T: int, nt: int,
                 width: int, barrier: bool):
    """One (b, KV head, query tile) program; grid step i runs tile nt - 1 - i. Refs: lse f32[G, tile];
    q [tile, G, D]; k [Tp, D]; o f32[width] the tile's row of pooled scores."""
    i = nt - 1 - pl.program_id(2)
    start = i * tile
    rows_ok = start + jnp.arange(tile, dtype=jnp.int32) < T
    nb = start // bn  # key blocks before the tile (tile % bn == 0)
    for g in range(G):
        q = q_ref[:, g, :]
        lse = jnp.where(rows_ok, lse_ref[g, :], jnp.inf)  # rows past T add nothing

        def body(c, carry, g=g, q=q, lse=lse):
            cols = pl.ds(c * bn, bn)
            s_t = plgpu.dot(k_ref[cols, :], q, trans_b=True) * scale  # [bn keys, tile rows]
            col = jnp.sum(jnp.exp(s_t - lse[None, :]), axis=1)
            if g:
                col = col + o_ref[cols]
            o_ref[cols] = col
            return carry

        lax.fori_loop(0, nb, body, 0)
        if barrier and G > 1:
            plgpu.debug_barrier()  # the next head reads the sums this one wrote

    def fill(c, carry):
        o_ref[pl.ds(c * bn, bn)] = jnp.full((bn,), -jnp.inf, jnp.float32)
        return carry

    lax.fori_loop(nb, width // bn, fill, 0)


@functools.partial(jax.jit, static_argnames=("tile", "scale", "config", "interpret"))
def tile_scores_gpu(q: Array, k: Array, *, tile: int, scale: float | None = None, lse: Array | None = None,
                    config: PrefillScoresConfig = PrefillScoresConfig(), interpret: bool = False,
                    lengths: Array | None = None) -> Array:
    """Tile-pooled causal scores (semantics of `reference.tile_scores_reference`), two Triton passes.

    Args:
      q: [B, T, Hq, D]; k: [B, T, Hkv, D]; tile: query rows per tile (a power of two >= 16, a multiple of
        block_n).
      lse: f32[B, Hq, T] causal logsumexp of every row if already known (e.g. from a dense attention); None:
        computed by `prefill_lse_gpu`.
      config: `PrefillScoresConfig`; interpret: the Pallas interpreter (CPU tests).
      lengths: i32[B] or None (every row): the rows t >= lengths[b] add nothing (`common.mask_rows_lse`: their
        logsumexp is read as +inf, so both pooling kernels add exp(s - inf) = 0 for them).

    Returns:
      f32[B, Hkv, ceil(T / tile), T].
    """
    if _use_mosaic(q, k, tile, config, interpret):
        if lse is None:
            lse = mgpu_prefill.prefill_lse_mgpu(q, k, scale=scale)
        return mgpu_prefill.tile_scores_mgpu(q, k, mask_rows_lse(lse, lengths), tile=tile, scale=scale)
    _check(q, tile, config, interpret)
    B, T, Hq, D = q.shape
    Hkv, G = k.shape[2], Hq // k.shape[2]
    bn = min(config.pool_block_n, tile)
    if tile % bn:
        raise ValueError(f"tile={tile} is not a multiple of PrefillScoresConfig.pool_block_n={bn}")
    if lse is None:
        lse = prefill_lse_gpu(q, k, scale=scale, config=config, interpret=interpret)
    lse = mask_rows_lse(lse, lengths)
    nt = pl.cdiv(T, tile)
    Tp = nt * tile
    width = pl.cdiv(T, bn) * bn
    if Tp != T:
        pad = [(0, 0), (0, Tp - T), (0, 0), (0, 0)]
        q, k = jnp.pad(q, pad), jnp.pad(k, pad)
        lse = jnp.pad(lse, ((0, 0), (0, 0), (0, Tp - T)))
    last = nt - 1
    out = pl.pallas_call(
        functools.partial(_pool_kernel, scale=default_scale(D, scale), tile=tile, bn=bn, G=G, T=T, nt=nt,
                          width=width, barrier=not interpret),
        grid=(B, Hkv, nt),
        in_specs=[pl.BlockSpec((None, G, tile), lambda b, h, i: (b, h, last - i)),  # the group's rows' lse
                  pl.BlockSpec((None, tile, G, D), lambda b, h, i: (b, last - i, h, 0)),  # the group's queries
                  pl.BlockSpec((None, Tp, None, D), lambda b, h, i: (b, 0, h, 0))],  # the KV head's keys
        out_specs=pl.BlockSpec((None, None, None, width), lambda b, h, i: (b, h, last - i, 0)),
        out_shape=jax.ShapeDtypeStruct((B, Hkv, nt, width), jnp.float32),
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps if config.pool_num_warps is None else config.pool_num_warps,
            num_stages=config.num_stages if config.pool_num_stages is None else config.pool_num_stages),
        interpret=interpret, name="anchor_prefill_pool",
    )(lse.astype(jnp.float32), q, k)
    return out[..., :T]


def dense_prefill_with_lse(q: Array, k: Array, v: Array) -> tuple[Array, Array]:
    """cuDNN causal flash attention that also returns each row's logsumexp (a JAX-internal entry point).

    Returns:
      (out [B, T, Hq, D], lse f32[B, Hq, T]).
    """
    from jax._src.cudnn import fused_attention_stablehlo as fa

    B, T, Hq, D = q.shape
    out, lse = fa.dot_product_attention(q, k, v, scale=1.0 / D ** 0.5, mask_type=fa.MaskType.CAUSAL,
                                        qkv_layout="BTNH", return_residual=True)
    if lse.shape == (B, T, Hq) and (B, T, Hq) != (B, Hq, T):
        lse = lse.transpose(0, 2, 1)
    return out, lse.astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("tile", "budget", "min_tokens", "K", "scale", "dense_output",
                                             "dense_lse", "block_size", "config", "interpret"))
def anchor_prefill_gpu(q: Array, k: Array, v: Array, lengths: Array, *, tile: int, budget: float,
                       min_tokens: int = 128, K: int | None = None, scale: float | None = None,
                       dense_output: bool = False, dense_lse: bool = False, block_size: int = 1,
                       config: PrefillScoresConfig = PrefillScoresConfig(),
                       interpret: bool = False) -> tuple[Array, Array]:
    """Anchor prefill layer on the GPU: tile-pooled scores (Mosaic GPU on Hopper, else Triton), Triton top-k,
    tile-gathered attention (or dense causal attention with `dense_output`). Args and returns as
    `reference.anchor_prefill_reference`.

    Args:
      dense_lse: with dense_output, take the rows' logsumexp from cuDNN's dense attention
        (`dense_prefill_with_lse`, scale 1/sqrt(D) only) instead of the lse pass.
      block_size: 1 (token selection) or a power of two dividing the tile (block selection: the scores summed
        per block, `common.pool_blocks`). Compiled on a Hopper GPU, block selections the Mosaic GPU kernel
        takes (block_size >= 8, tile 32/64/128, bf16/f16, D 64/128) run on it; the rest (and interpreted runs)
        on the Triton kernel.
    """
    from pallas_kernels.sparse_attention import gpu as sparse_gpu
    from pallas_kernels.sparse_attention import sparse_prefill, supported
    from pallas_kernels.topk_select import gpu as select_gpu

    K = check_prefill_args(q, k, v, lengths, tile, budget, min_tokens, K)
    check_block_size(block_size, tile)
    T = q.shape[1]
    lse = out = None
    if dense_output and dense_lse:
        if scale is not None:
            raise ValueError(f"dense_lse=True takes the default scale only (got scale={scale})")
        out, lse = dense_prefill_with_lse(q, k, v)
    scores = pool_blocks(tile_scores_gpu(q, k, tile=tile, scale=scale, lse=lse, config=config,
                                          interpret=interpret, lengths=lengths), block_size)
    kk = block_counts(budget, T, tile, min_tokens, block_size)[None, None, :]
    indices = select_gpu.topk_select_gpu(scores, kk, block_width(K, block_size), interpret=interpret)
    if out is None:
        if dense_output:
            cudnn = not interpret and q.dtype in (jnp.bfloat16, jnp.float16)
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                               implementation="cudnn" if cudnn else "xla")
        elif interpret:
            out = sparse_gpu.sparse_prefill_gpu(q, k, v, indices, lengths, tile=tile, block_size=block_size,
                                                scale=scale, interpret=True)
        else:  # block selections the Mosaic GPU kernel takes on Hopper go to it, the rest to Triton
            mosaic = block_size > 1 and supported("mosaic_gpu", q, block_size=block_size, tile=tile,
                                                  group=q.shape[2] // k.shape[2])
            out = sparse_prefill(q, k, v, indices, lengths, tile=tile, block_size=block_size, scale=scale,
                                 implementation="mosaic_gpu" if mosaic else "pallas_gpu")
    return out, indices


__all__ = ["PrefillScoresConfig", "TUNED_H100", "anchor_prefill_gpu", "budget_count", "dense_prefill_with_lse",
           "prefill_lse_gpu", "tile_scores_gpu"]

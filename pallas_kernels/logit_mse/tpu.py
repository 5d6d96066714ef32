"""Blockwise logit-MSE kernels for TPUs: Pallas with the Mosaic TPU backend.

The same two passes as gpu.py, written the TPU way: the tile loop is the last grid axis
("arbitrary", sequential on a core) and BlockSpecs DMA one ``[block, d]`` tile of each operand per
step into VMEM, while the first three axes (batch, query head, tile) are "parallel".

  * ``_fwd_kernel``, grid ``(B, Hq, nq, nk)``: f32 ``[block_q, block_k]`` scratch accumulates
    ``e^2`` elementwise (``e = p - s``) over the key tiles of query tile ``i``; at the last key tile it
    is reduced over rows into a lane-dense ``(1, block_k)`` output (the host sums it). When the caller
    needs gradients the same pass accumulates ``sum_j e_ij k'_j`` into the resident f32 ``dq'`` block.
  * ``_dkp_kernel``, grid ``(B, Hq, nk, nq)``: recomputes the transposed tile ``e^T`` and accumulates
    ``sum_i e_ij q'_i`` into the resident f32 ``dk'`` block.

Causal masking: tiles wholly above the diagonal are skipped with ``pl.when`` and their index maps
are clamped to the last tile that is needed, so the pipeline issues no DMA for them either.
Sequences are zero-padded to a multiple of the blocks; padded queries/keys have ``s = p = 0`` against
everything and add exactly zero.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.logit_mse.reference import check_shapes

Array = jax.Array

_NT = (((1,), (1,)), ((), ()))  # contract the last dims: a @ b.T


def _check_block(name: str, block: int) -> None:
    if block < 8 or block % 8:
        raise ValueError(f"{name}={block} must be a positive multiple of 8 for the TPU kernel (sublane tiling)")


def _prepare(q, k, qp, kp, block_q, block_k):
    B, Hq, Hkv, Hkp, L, d, dp = check_shapes(q, k, qp, kp)
    _check_block("block_q", block_q)
    _check_block("block_k", block_k)
    lcm = block_q * block_k // math.gcd(block_q, block_k)
    Lp = pl.cdiv(L, lcm) * lcm
    if Lp != L:
        pad = ((0, 0), (0, 0), (0, Lp - L), (0, 0))
        q, k, qp, kp = (jnp.pad(x, pad) for x in (q, k, qp, kp))
    dims = dict(B=B, Hq=Hq, G=Hq // Hkv, Gp=Hq // Hkp, L=L, Lp=Lp, d=d, dp=dp)
    return (q, k, qp, kp), dims


def _fwd_kernel(q_ref, k_ref, qp_ref, kp_ref, sq_ref, *rest, causal, block_q, block_k, scale, scale_p):
    """Query tile i, key tile j. Refs: q [bq, d], k [bk, d], qp [bq, dp], kp [bk, dp]; sq f32[1, bk];
    optional dqp f32[bq, dp] (resident over j); scratch acc f32[bq, bk]."""
    *dqp_refs, acc_ref = rest
    i, j = pl.program_id(2), pl.program_id(3)
    nk = pl.num_programs(3)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        for r in dqp_refs:
            r[...] = jnp.zeros_like(r)

    def _tile():
        kp = kp_ref[...]
        s = lax.dot_general(q_ref[...], k_ref[...], _NT, preferred_element_type=jnp.float32) * scale
        p = lax.dot_general(qp_ref[...], kp, _NT, preferred_element_type=jnp.float32) * scale_p
        e = p - s  # f32[bq, bk]
        if causal:
            rows = i * block_q + lax.broadcasted_iota(jnp.int32, e.shape, 0)
            cols = j * block_k + lax.broadcasted_iota(jnp.int32, e.shape, 1)
            e = jnp.where(rows >= cols, e, 0.0)
        acc_ref[...] += e * e
        for r in dqp_refs:
            r[...] += jnp.dot(e.astype(kp.dtype), kp, preferred_element_type=jnp.float32)

    if causal:
        pl.when(j * block_k <= i * block_q + block_q - 1)(_tile)  # the tile has a pair j <= i
    else:
        _tile()

    @pl.when(j == nk - 1)
    def _finish():
        sq_ref[...] = jnp.sum(acc_ref[...], axis=0, keepdims=True)


def _dkp_kernel(q_ref, k_ref, qp_ref, kp_ref, dkp_ref, *, causal, block_q, block_k, scale, scale_p):
    """Key tile j, query tile i. Refs: q [bq, d], k [bk, d], qp [bq, dp], kp [bk, dp];
    dkp f32[bk, dp] (resident over i)."""
    j, i = pl.program_id(2), pl.program_id(3)

    @pl.when(i == 0)
    def _init():
        dkp_ref[...] = jnp.zeros_like(dkp_ref)

    def _tile():
        qp = qp_ref[...]
        s_t = lax.dot_general(k_ref[...], q_ref[...], _NT, preferred_element_type=jnp.float32) * scale
        p_t = lax.dot_general(kp_ref[...], qp, _NT, preferred_element_type=jnp.float32) * scale_p
        e_t = p_t - s_t  # f32[bk, bq] = e^T
        if causal:
            cols = j * block_k + lax.broadcasted_iota(jnp.int32, e_t.shape, 0)  # key index
            rows = i * block_q + lax.broadcasted_iota(jnp.int32, e_t.shape, 1)  # query index
            e_t = jnp.where(rows >= cols, e_t, 0.0)
        dkp_ref[...] += jnp.dot(e_t.astype(qp.dtype), qp, preferred_element_type=jnp.float32)

    if causal:
        pl.when(i * block_q + block_q - 1 >= j * block_k)(_tile)
    else:
        _tile()


@functools.partial(jax.jit, static_argnames=("causal", "block_q", "block_k", "with_dqp", "interpret"))
def logit_mse_fwd_tpu(
    q: Array,
    k: Array,
    qp: Array,
    kp: Array,
    *,
    causal: bool,
    block_q: int = 128,
    block_k: int = 128,
    with_dqp: bool = False,
    interpret: bool = False,
) -> tuple[Array, Array | None]:
    """Sum of squared logit errors per head and, optionally, the unscaled query gradient.

    Args:
      q: [B, Hq, L, d] model queries; k: [B, Hkv, L, d] model keys (head h uses h // (Hq // Hkv)).
      qp: [B, Hq, L, dp] predictor queries; kp: [B, Hkp, L, dp] predictor keys (head h uses h // (Hq // Hkp)).
      causal: count only pairs j <= i.
      block_q, block_k: tile sizes, multiples of 8 (128 or more on real TPUs); L is zero-padded to a
        multiple of both.
      with_dqp: also return the unscaled gradient accumulator of qp.
      interpret: run in the Pallas interpreter (CPU).

    Returns:
      (sq_err f32[B, Hq], dqp_raw f32[B, Hq, L, dp] or None): ``sq_err = sum over counted pairs of
      (p - s)^2`` and ``dqp_raw_i = sum_j (p_ij - s_ij) kp_j`` over counted pairs j.
    """
    (q, k, qp, kp), dm = _prepare(q, k, qp, kp, block_q, block_k)
    B, Hq, G, Gp, Lp, d, dp = (dm[x] for x in ("B", "Hq", "G", "Gp", "Lp", "d", "dp"))
    nq, nk = Lp // block_q, Lp // block_k

    def k_index(b, h, i, j, group):
        if causal:  # past the diagonal, keep pointing at the last needed tile: no new DMA
            j = jnp.minimum(j, (i * block_q + block_q - 1) // block_k)
        return (b, h // group, j, 0)

    in_specs = [
        pl.BlockSpec((None, None, block_q, d), lambda b, h, i, j: (b, h, i, 0)),
        pl.BlockSpec((None, None, block_k, d), functools.partial(k_index, group=G)),
        pl.BlockSpec((None, None, block_q, dp), lambda b, h, i, j: (b, h, i, 0)),
        pl.BlockSpec((None, None, block_k, dp), functools.partial(k_index, group=Gp)),
    ]
    out_shape = [jax.ShapeDtypeStruct((B, Hq, nq, 1, block_k), jnp.float32)]
    out_specs = [pl.BlockSpec((None, None, None, 1, block_k), lambda b, h, i, j: (b, h, i, 0, 0))]
    if with_dqp:
        out_shape.append(jax.ShapeDtypeStruct((B, Hq, Lp, dp), jnp.float32))
        out_specs.append(pl.BlockSpec((None, None, block_q, dp), lambda b, h, i, j: (b, h, i, 0)))
    kernel = functools.partial(
        _fwd_kernel,
        causal=causal,
        block_q=block_q,
        block_k=block_k,
        scale=1.0 / math.sqrt(d),
        scale_p=1.0 / math.sqrt(dp),
    )
    outs = pl.pallas_call(
        kernel,
        grid=(B, Hq, nq, nk),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((block_q, block_k), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="logit_mse_fwd",
    )(q, k, qp, kp)
    sq_err = jnp.sum(outs[0], axis=(2, 3, 4))
    dqp = outs[1][:, :, : dm["L"]] if with_dqp else None
    return sq_err, dqp


@functools.partial(jax.jit, static_argnames=("causal", "block_q", "block_k", "interpret"))
def logit_mse_dkp_tpu(
    q: Array,
    k: Array,
    qp: Array,
    kp: Array,
    *,
    causal: bool,
    block_q: int = 128,
    block_k: int = 128,
    interpret: bool = False,
) -> Array:
    """Unscaled gradient accumulator of the predictor's keys, per query head.

    Args: as ``logit_mse_fwd_tpu``.

    Returns:
      dkp_raw f32[B, Hq, L, dp]: ``sum_i (p_ij - s_ij) qp_i`` over counted pairs i, one row per *query*
      head (the caller sums groups of ``Hq // Hkp`` heads when kp has fewer heads).
    """
    (q, k, qp, kp), dm = _prepare(q, k, qp, kp, block_q, block_k)
    B, Hq, G, Gp, Lp, d, dp = (dm[x] for x in ("B", "Hq", "G", "Gp", "Lp", "d", "dp"))
    nq, nk = Lp // block_q, Lp // block_k

    def q_index(b, h, j, i):
        if causal:  # before the diagonal, point at the first needed tile: no DMA for skipped ones
            i = jnp.maximum(i, (j * block_k) // block_q)
        return (b, h, i, 0)

    in_specs = [
        pl.BlockSpec((None, None, block_q, d), q_index),
        pl.BlockSpec((None, None, block_k, d), lambda b, h, j, i: (b, h // G, j, 0)),
        pl.BlockSpec((None, None, block_q, dp), q_index),
        pl.BlockSpec((None, None, block_k, dp), lambda b, h, j, i: (b, h // Gp, j, 0)),
    ]
    kernel = functools.partial(
        _dkp_kernel,
        causal=causal,
        block_q=block_q,
        block_k=block_k,
        scale=1.0 / math.sqrt(d),
        scale_p=1.0 / math.sqrt(dp),
    )
    dkp = pl.pallas_call(
        kernel,
        grid=(B, Hq, nk, nq),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, block_k, dp), lambda b, h, j, i: (b, h, j, 0)),
        out_shape=jax.ShapeDtypeStruct((B, Hq, Lp, dp), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="logit_mse_dkp",
    )(q, k, qp, kp)
    return dkp[:, :, : dm["L"]]

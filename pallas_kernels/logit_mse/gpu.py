"""Blockwise logit-MSE kernels for GPUs: Pallas with the Triton backend.

Two kernels, each with grid ``(tiles, B, Hq)`` and one program per (tile, batch, query head):

  * ``_fwd_kernel`` (grid over query tiles): loops over the key tiles of its row of tiles (up to the
    diagonal when causal), recomputes ``s = q k^T / sqrt(d)`` and ``p = q' k'^T / sqrt(d')`` for the
    ``[block_q, block_k]`` tile in registers / shared memory, and accumulates per query row
    ``sum_j e_ij^2`` with ``e = p - s``; when the caller needs gradients it also accumulates
    ``sum_j e_ij k'_j`` (the unscaled gradient of the predictor's queries), so the backward pass does
    not recompute the tiles a second time for ``dq'``.
  * ``_dkp_kernel`` (grid over key tiles): loops over the query tiles of its column (from the diagonal
    down when causal), recomputes the transposed tile ``e^T`` and accumulates ``sum_i e_ij q'_i``.

Both work in f32 (dot products of bf16 inputs accumulate in f32; ``e`` is cast back to the inputs'
dtype only as the left operand of the gradient matmul, as flash attention does with ``ds``). No
``L x L`` array is ever written to memory. Scaling by ``2 / (num_pairs * sqrt(d'))`` and by the
upstream cotangent happens in ``api.py``.

Sequences are padded with zeros to a multiple of the blocks and head dims to a power of two >= 16
(``tl.dot``'s minimum): a zero-padded query or key has ``s = p = 0`` against everything, so padded
pairs add exactly zero to every sum and no extra mask is needed beyond the causal one.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.logit_mse.reference import check_shapes

Array = jax.Array


def _pow2_at_least_16(n: int) -> int:
    return max(16, pl.next_power_of_2(n))


def _check_block(name: str, block: int) -> None:
    if block < 16 or block & (block - 1):
        raise ValueError(f"{name}={block} must be a power of two >= 16 for the Triton kernel (tl.dot/tl.arange)")


def _pad_to(x: Array, length: int, dim: int) -> Array:
    """Zero-pads axis 2 (sequence) to ``length`` and axis 3 (features) to ``dim``."""
    pad_l, pad_d = length - x.shape[2], dim - x.shape[3]
    if pad_l == 0 and pad_d == 0:
        return x
    return jnp.pad(x, ((0, 0), (0, 0), (0, pad_l), (0, pad_d)))


def _fwd_kernel(q_ref, k_ref, qp_ref, kp_ref, rowsum_ref, *dqp_refs, causal, block_q, block_k, scale, scale_p):
    """One query tile: rowsum_i = sum_j e_ij^2 and (optionally) dqp_i = sum_j e_ij kp_j, e = p - s.

    Refs (per program): q [block_q, d], k [Lp, d], qp [block_q, dp], kp [Lp, dp];
    rowsum f32[block_q]; dqp f32[block_q, dp].
    """
    i = pl.program_id(0)
    seq_len = k_ref.shape[0]
    q = q_ref[...]
    qp = qp_ref[...]
    rows = i * block_q + jnp.arange(block_q)
    with_dqp = bool(dqp_refs)

    def body(j, carry):
        acc, dqp = carry
        sl = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
        k = k_ref[sl, :]
        kp = kp_ref[sl, :]
        s = plgpu.dot(q, k, trans_b=True) * scale  # f32[block_q, block_k]
        p = plgpu.dot(qp, kp, trans_b=True) * scale_p
        e = p - s
        if causal:
            cols = j * block_k + jnp.arange(block_k)
            e = jnp.where(rows[:, None] >= cols[None, :], e, 0.0)
        acc = acc + jnp.sum(e * e, axis=1)
        if with_dqp:
            dqp = dqp + plgpu.dot(e.astype(kp.dtype), kp)
        return acc, dqp

    acc = jnp.zeros((block_q,), jnp.float32)
    dqp = jnp.zeros((block_q, qp_ref.shape[-1]), jnp.float32) if with_dqp else jnp.zeros((), jnp.float32)
    if causal:
        # Key tiles holding a column <= the tile's last row: ceil((i + 1) * block_q / block_k).
        upper = lax.div(block_q * (i + 1) + block_k - 1, block_k)
    else:
        upper = seq_len // block_k
    acc, dqp = lax.fori_loop(0, upper, body, (acc, dqp))
    rowsum_ref[...] = acc
    if with_dqp:
        dqp_refs[0][...] = dqp


def _dkp_kernel(q_ref, k_ref, qp_ref, kp_ref, dkp_ref, *, causal, block_q, block_k, scale, scale_p):
    """One key tile: dkp_j = sum_i e_ij qp_i over the counted pairs, e = p - s.

    Refs (per program): q [Lp, d], k [block_k, d], qp [Lp, dp], kp [block_k, dp]; dkp f32[block_k, dp].
    """
    j = pl.program_id(0)
    seq_len = q_ref.shape[0]
    k = k_ref[...]
    kp = kp_ref[...]
    cols = j * block_k + jnp.arange(block_k)

    def body(i, dkp):
        sl = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
        q = q_ref[sl, :]
        qp = qp_ref[sl, :]
        s_t = plgpu.dot(k, q, trans_b=True) * scale  # f32[block_k, block_q] = s^T
        p_t = plgpu.dot(kp, qp, trans_b=True) * scale_p
        e_t = p_t - s_t
        if causal:
            rows = i * block_q + jnp.arange(block_q)
            e_t = jnp.where(rows[None, :] >= cols[:, None], e_t, 0.0)
        return dkp + plgpu.dot(e_t.astype(qp.dtype), qp)

    lower = lax.div(j * block_k, block_q) if causal else 0  # first query tile with a row >= the tile's first key
    dkp = lax.fori_loop(lower, seq_len // block_q, body, jnp.zeros((block_k, qp_ref.shape[-1]), jnp.float32))
    dkp_ref[...] = dkp


def _prepare(q, k, qp, kp, block_q, block_k):
    B, Hq, Hkv, Hkp, L, d, dp = check_shapes(q, k, qp, kp)
    _check_block("block_q", block_q)
    _check_block("block_k", block_k)
    Lp = pl.cdiv(L, max(block_q, block_k)) * max(block_q, block_k)  # both powers of two: lcm = max
    dpad, dppad = _pow2_at_least_16(d), _pow2_at_least_16(dp)
    q, k = _pad_to(q, Lp, dpad), _pad_to(k, Lp, dpad)
    qp, kp = _pad_to(qp, Lp, dppad), _pad_to(kp, Lp, dppad)
    dims = dict(B=B, Hq=Hq, G=Hq // Hkv, Gp=Hq // Hkp, L=L, Lp=Lp, d=d, dp=dp, dpad=dpad, dppad=dppad)
    return (q, k, qp, kp), dims


def _num_warps(block_q: int, block_k: int, num_warps: int | None) -> int:
    if num_warps is not None:
        return num_warps
    return 8 if block_q * block_k >= 128 * 128 else 4


@functools.partial(
    jax.jit, static_argnames=("causal", "block_q", "block_k", "with_dqp", "num_warps", "num_stages", "interpret")
)
def logit_mse_fwd_gpu(
    q: Array,
    k: Array,
    qp: Array,
    kp: Array,
    *,
    causal: bool,
    block_q: int = 64,
    block_k: int = 64,
    with_dqp: bool = False,
    num_warps: int | None = None,
    num_stages: int = 2,
    interpret: bool = False,
) -> tuple[Array, Array | None]:
    """Sum of squared logit errors per head and, optionally, the unscaled query gradient.

    Args:
      q: [B, Hq, L, d] model queries; k: [B, Hkv, L, d] model keys (head h uses h // (Hq // Hkv)).
      qp: [B, Hq, L, dp] predictor queries; kp: [B, Hkp, L, dp] predictor keys (head h uses h // (Hq // Hkp)).
      causal: count only pairs j <= i.
      block_q, block_k: tile sizes, powers of two >= 16; L is zero-padded to a multiple of both.
      with_dqp: also return the unscaled gradient accumulator of qp.
      num_warps, num_stages: Triton launch parameters (num_warps defaults by tile area).
      interpret: run in the Pallas interpreter (CPU).

    Returns:
      (sq_err f32[B, Hq], dqp_raw f32[B, Hq, L, dp] or None) where ``sq_err = sum over counted pairs of
      (p - s)^2`` and ``dqp_raw_i = sum_j (p_ij - s_ij) kp_j`` over counted pairs j.
    """
    (q, k, qp, kp), dm = _prepare(q, k, qp, kp, block_q, block_k)
    B, Hq, G, Gp, Lp = dm["B"], dm["Hq"], dm["G"], dm["Gp"], dm["Lp"]
    dpad, dppad = dm["dpad"], dm["dppad"]
    kernel = functools.partial(
        _fwd_kernel,
        causal=causal,
        block_q=block_q,
        block_k=block_k,
        scale=1.0 / math.sqrt(dm["d"]),
        scale_p=1.0 / math.sqrt(dm["dp"]),
    )
    in_specs = [
        pl.BlockSpec((None, None, block_q, dpad), lambda i, b, h: (b, h, i, 0)),  # q tile
        pl.BlockSpec((None, None, Lp, dpad), lambda i, b, h: (b, h // G, 0, 0)),  # all of k (GQA)
        pl.BlockSpec((None, None, block_q, dppad), lambda i, b, h: (b, h, i, 0)),  # qp tile
        pl.BlockSpec((None, None, Lp, dppad), lambda i, b, h: (b, h // Gp, 0, 0)),  # all of kp
    ]
    out_shape = [jax.ShapeDtypeStruct((B, Hq, Lp), jnp.float32)]
    out_specs = [pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))]
    if with_dqp:
        out_shape.append(jax.ShapeDtypeStruct((B, Hq, Lp, dppad), jnp.float32))
        out_specs.append(pl.BlockSpec((None, None, block_q, dppad), lambda i, b, h: (b, h, i, 0)))
    outs = pl.pallas_call(
        kernel,
        grid=(Lp // block_q, B, Hq),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(
            num_warps=_num_warps(block_q, block_k, num_warps), num_stages=num_stages
        ),
        interpret=interpret,
        name="logit_mse_fwd",
    )(q, k, qp, kp)
    sq_err = jnp.sum(outs[0], axis=-1)
    dqp = outs[1][:, :, : dm["L"], : dm["dp"]] if with_dqp else None
    return sq_err, dqp


@functools.partial(jax.jit, static_argnames=("causal", "block_q", "block_k", "num_warps", "num_stages", "interpret"))
def logit_mse_dkp_gpu(
    q: Array,
    k: Array,
    qp: Array,
    kp: Array,
    *,
    causal: bool,
    block_q: int = 64,
    block_k: int = 64,
    num_warps: int | None = None,
    num_stages: int = 2,
    interpret: bool = False,
) -> Array:
    """Unscaled gradient accumulator of the predictor's keys, per query head.

    Args: as ``logit_mse_fwd_gpu``.

    Returns:
      dkp_raw f32[B, Hq, L, dp]: ``sum_i (p_ij - s_ij) qp_i`` over counted pairs i, one row per *query*
      head (the caller sums groups of ``Hq // Hkp`` heads when kp has fewer heads).
    """
    (q, k, qp, kp), dm = _prepare(q, k, qp, kp, block_q, block_k)
    B, Hq, G, Gp, Lp = dm["B"], dm["Hq"], dm["G"], dm["Gp"], dm["Lp"]
    dpad, dppad = dm["dpad"], dm["dppad"]
    kernel = functools.partial(
        _dkp_kernel,
        causal=causal,
        block_q=block_q,
        block_k=block_k,
        scale=1.0 / math.sqrt(dm["d"]),
        scale_p=1.0 / math.sqrt(dm["dp"]),
    )
    in_specs = [
        pl.BlockSpec((None, None, Lp, dpad), lambda j, b, h: (b, h, 0, 0)),  # all of q
        pl.BlockSpec((None, None, block_k, dpad), lambda j, b, h: (b, h // G, j, 0)),  # k tile
        pl.BlockSpec((None, None, Lp, dppad), lambda j, b, h: (b, h, 0, 0)),  # all of qp
        pl.BlockSpec((None, None, block_k, dppad), lambda j, b, h: (b, h // Gp, j, 0)),  # kp tile
    ]
    dkp = pl.pallas_call(
        kernel,
        grid=(Lp // block_k, B, Hq),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, block_k, dppad), lambda j, b, h: (b, h, j, 0)),
        out_shape=jax.ShapeDtypeStruct((B, Hq, Lp, dppad), jnp.float32),
        compiler_params=plgpu.CompilerParams(
            num_warps=_num_warps(block_q, block_k, num_warps), num_stages=num_stages
        ),
        interpret=interpret,
        name="logit_mse_dkp",
    )(q, k, qp, kp)
    return dkp[:, :, : dm["L"], : dm["dp"]]

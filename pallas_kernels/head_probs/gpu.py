"""Pallas GPU (Triton) kernel of the decode queries' post-softmax weights, read in place from the stacked cache.

grid (B, Hkv, S): one program per batch row, KV head and split of the cache (the layout of
`pallas_kernels.dense_decode.gpu`, whose log-sum-exp it takes).
  * Queries: the T new tokens times the GQA group's G heads form T * G rows per KV head (row = t * G + g); a
    program holds them as [Mb, D] tiles (padded to >= 16 rows for the tensor-core dot): one tile when T * G
    fits in `block_q` rows (decode: T = 1 .. gamma + 1), else ceil(T * G / block_q) tiles looped over for each
    key block, so that every K row is read once whatever T.
  * Keys: split s covers cache rows [s * chunk, (s + 1) * chunk); the program streams them `block_k` rows at a
    time straight from `k_all[layer, b, h]` (the K BlockSpec spans the L axis; the loads index it with the
    traced layer: the pointer is offset in place, nothing is copied). For each block: logits [block_k, Mb] by
    one dot (K . q^T), p = exp(logits * scale - lse) where the row sees the key, else 0, and the sum over the T
    rows of each group member g (a masked sum along the rows per g, exact f32): G rows of the output
    [G, block_k].
  * The sum over T is done here, not in XLA: the output is f32[B, Hkv, G, N] = [B, Hq, N] (a free reshape),
    written once; no [.., T, N] array reaches HBM.
  * Blocks past the last key any row of the row sees (lengths masking) are not read: the program writes
    zeros there (every output element is written exactly once). Loads past that key are masked (never out of
    bounds, whatever the cache holds there).
Bytes: K of the visible keys once, the output B * Hq * N * 4 once.

Runs in interpret mode on CPU (`interpret=True`). Semantics: `reference.head_probs_stacked_reference`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.dense_decode import gpu as dense_gpu
from pallas_kernels.dense_decode.reference import layer_index
from pallas_kernels.head_probs.reference import check_args
from pallas_kernels.sparse_attention.common import default_scale

Array = jax.Array

_MIN_ROWS = 16  # Triton's tensor-core dot needs M >= 16
_pow2 = dense_gpu._pow2


@dataclasses.dataclass(frozen=True)
class HeadProbsConfig:
    """Tuning of the kernel.

    Attributes:
      block_k: cache rows per inner iteration (a power of two >= 16).
      block_q: most query rows per tile (a power of two >= 16); T * G rows are padded to the next power of two
        >= 16 when they fit, else looped over in ceil(T * G / block_q) tiles of block_q rows.
      num_splits: splits of the cache per (row, KV head); None picks enough for about `target_programs`
        programs in total.
      target_programs: grid size the split heuristic aims for (a few waves of 132 SMs on an H100).
      num_warps: warps per program.
      num_stages: software pipelining depth of the inner loop.
    """

    block_k: int = 64
    block_q: int = 64
    num_splits: int | None = None
    target_programs: int = 512
    num_warps: int = 4
    num_stages: int = 3


def unsupported_reason(dtype, head_dim: int) -> str | None:
    """Why the Triton kernel cannot take these arguments (None when it can): the dense decode kernel's rules."""
    return dense_gpu.unsupported_reason(dtype, head_dim)


def _check_config(config: HeadProbsConfig) -> None:
    for name in ("block_k", "block_q"):
        value = getattr(config, name)
        if not _pow2(value) or value < _MIN_ROWS:
            raise ValueError(f"HeadProbsConfig.{name}={value}: expected a power of two >= {_MIN_ROWS}")
    if config.num_splits is not None and config.num_splits < 1:
        raise ValueError(f"HeadProbsConfig.num_splits={config.num_splits}: expected >= 1 or None")
    if config.target_programs < 1:
        raise ValueError(f"HeadProbsConfig.target_programs={config.target_programs}: expected >= 1")


def plan(B: int, T: int, Hq: int, Hkv: int, N: int, config: HeadProbsConfig) -> dict:
    """The static launch plan: rows per KV head, rows per tile Mb, tiles R, splits S, chunk."""
    rows = T * (Hq // Hkv)
    Mb = max(_MIN_ROWS, pl.next_power_of_2(rows)) if rows <= config.block_q else config.block_q
    R = pl.cdiv(rows, Mb)
    splits = config.num_splits or pl.cdiv(config.target_programs, B * Hkv)
    splits = max(1, min(splits, pl.cdiv(N, config.block_k)))
    chunk = pl.cdiv(pl.cdiv(N, splits), config.block_k) * config.block_k
    return dict(rows=rows, Mb=Mb, R=R, splits=pl.cdiv(N, chunk), chunk=chunk)


def _probs_kernel(layer_ref, hi_ref, lim_ref, lse_ref, q_ref, k_ref, o_ref, *, scale: float, block_k: int,
                  chunk: int, Mb: int, R: int, G: int, N: int):
    """One (b, h, split) program.

    Refs: layer_ref i32[1]; hi_ref i32[1] the last key any query row of b sees (-1: none); lim_ref i32[R * Mb]
    the last key each query row sees (-1: none, padding rows too); lse_ref f32[R * Mb]; q_ref [R * Mb, D] the
    query rows of KV head h (row = t * G + g); k_ref [L, N, D] every layer of KV head h; o_ref f32[G, N] the
    group's weights (this program writes keys [s * chunk, (s + 1) * chunk)).
    """
    layer = layer_ref[0]
    hi = hi_ref[0]
    start = pl.program_id(2) * chunk
    n_live = pl.cdiv(jnp.clip(hi + 1 - start, 0, chunk), block_k)
    n_all = pl.cdiv(jnp.clip(N - start, 0, chunk), block_k)

    def tile(r):
        """Query tile r: (q [Mb, D], lim [Mb], lse [Mb], group member of each row [Mb])."""
        rows = pl.ds(r * Mb, Mb)
        member = (r * Mb + jnp.arange(Mb, dtype=jnp.int32)) % G
        return q_ref[rows, :], lim_ref[rows], lse_ref[rows], member

    def weights(acc, tile_args, k, kpos):
        """acc (G x f32[block_k]) + the tile's weights on the block, summed over its rows per group member."""
        q, lim, lse, member = tile_args
        s = plgpu.dot(k, q, trans_b=True) * scale  # [block_k, Mb] f32: keys down, query rows across
        ok = kpos[:, None] <= lim[None, :]
        p = jnp.where(ok, jnp.exp(s - lse[None, :]), 0.0)
        return tuple(a + jnp.sum(jnp.where((member == g)[None, :], p, 0.0), axis=1) for g, a in enumerate(acc))

    def store(k0, kpos, acc):  # row g of the output: keys k0 .. k0 + block_k - 1 (those below N)
        for g in range(G):
            plgpu.store(o_ref.at[jnp.int32(g), pl.ds(k0, block_k)], acc[g], mask=kpos < N)

    first = tile(0) if R == 1 else None  # one tile: loaded once, outside the key loop

    def body(i, carry):
        k0 = start + i * block_k
        kpos = k0 + jnp.arange(block_k, dtype=jnp.int32)
        k = plgpu.load(k_ref.at[layer, pl.ds(k0, block_k), :], mask=(kpos <= hi)[:, None], other=0.0)
        acc = tuple(jnp.zeros((block_k,), jnp.float32) for _ in range(G))
        if R == 1:
            acc = weights(acc, first, k, kpos)
        else:
            acc = lax.fori_loop(0, R, lambda r, acc: weights(acc, tile(r), k, kpos), acc)
        store(k0, kpos, acc)
        return carry

    def zeros(i, carry):  # blocks no query row sees
        k0 = start + i * block_k
        store(k0, kpos=k0 + jnp.arange(block_k, dtype=jnp.int32), acc=(jnp.zeros((block_k,), jnp.float32),) * G)
        return carry

    lax.fori_loop(0, n_live, body, 0)
    lax.fori_loop(n_live, n_all, zeros, 0)


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def head_probs_stacked_gpu(q: Array, k_all: Array, layer: Array, lengths: Array, lse: Array, *,
                           scale: float | None = None, config: HeadProbsConfig = HeadProbsConfig(),
                           interpret: bool = False) -> Array:
    """The T newest queries' post-softmax weights over layer `layer` of a stacked cache, summed over T, read in
    place (Pallas Triton kernel; see the module docstring).

    Args:
      q: [B, T, Hq, D] (bf16/f16/f32) queries of the tokens at positions lengths - T .. lengths - 1.
      k_all: [L, B, Hkv, N, D] stacked head-major key cache.
      layer: i32[] (traced) layer to read, as `k_all[layer]`.
      lengths: i32[B] valid tokens per row.
      lse: f32[B, T, Hq] log-sum-exp of each query row over its visible keys
        (`dense_decode_stacked(..., return_lse=True)`).
      scale: softmax scale (None: 1/sqrt(D)).
      config: `HeadProbsConfig`.
      interpret: run the kernel in the Pallas interpreter (CPU tests).

    Returns:
      f32[B, Hq, N], as `reference.head_probs_stacked_reference`.
    """
    check_args(q, k_all, layer, lengths, lse)
    reason = unsupported_reason(q.dtype, q.shape[-1])
    if reason is not None:
        raise ValueError(f"the Pallas GPU head_probs kernel cannot take {reason}")
    _check_config(config)
    B, T, Hq, D = q.shape
    L, _, Hkv, N, _ = k_all.shape
    G = Hq // Hkv
    scale = default_scale(D, scale)
    p = plan(B, T, Hq, Hkv, N, config)
    Mb, R, splits, chunk = p["Mb"], p["R"], p["splits"], p["chunk"]
    Rp = R * Mb

    qg = dense_gpu.rows_by_kv_head(q, Hkv, Rp)
    lse_g = dense_gpu.rows_by_kv_head(lse.astype(jnp.float32), Hkv, Rp)
    lim = dense_gpu.row_limits(lengths, T, G, N, Rp)  # [B, Rp] last visible key per query row
    hi = jnp.max(lim, axis=1, keepdims=True)  # [B, 1]
    lay = layer_index(layer, L).reshape(1)

    kernel = functools.partial(_probs_kernel, scale=scale, block_k=config.block_k, chunk=chunk, Mb=Mb, R=R, G=G,
                               N=N)
    out = pl.pallas_call(
        kernel,
        grid=(B, Hkv, splits),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h, s: (0,)),  # the layer index
            pl.BlockSpec((None, 1), lambda b, h, s: (b, 0)),  # last key row b sees
            pl.BlockSpec((None, Rp), lambda b, h, s: (b, 0)),  # last visible key per query row
            pl.BlockSpec((None, None, Rp), lambda b, h, s: (b, h, 0)),  # log-sum-exp per query row
            pl.BlockSpec((None, None, Rp, D), lambda b, h, s: (b, h, 0, 0)),  # query rows of KV head h
            pl.BlockSpec((L, None, None, N, D), lambda b, h, s: (0, b, h, 0, 0)),  # every layer of the KV head
        ],
        out_specs=pl.BlockSpec((None, None, G, N), lambda b, h, s: (b, h, 0, 0)),  # each split writes its keys
        out_shape=jax.ShapeDtypeStruct((B, Hkv, G, N), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="head_probs_stacked",
    )(lay, hi, lim, lse_g, qg, k_all)
    return out.reshape(B, Hq, N)

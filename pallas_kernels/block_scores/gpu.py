"""Pallas GPU (Triton) kernels of the block_scores ops; both read the stacked cache [L, B, Hkv, N, D] in place.

Retrieval block max (`block_max_scores_gpu`): grid (B, T, S), S = ceil(nb / cb). Program (b, t, s) owns blocks
  [s * cb, (s + 1) * cb). Its K BlockSpec spans the L, Hkv and N axes of batch row b and the loads index
  `k_ref[layer, kv_head, rows, :]` (one indexer: the pointer is offset in place, nothing is sliced or copied).
  For each retrieval KV head r (a static loop over R; a head with no masked query head, or a program whose
  blocks are all outside [lo, hi), runs no iteration and reads nothing), iteration j < block_size gathers
  token j of each of the cb blocks (cb rows of K, stride block_size), computes the GQA group's logits
  [Gp, cb] = q_group . K^T with one tensor-core dot, masks the non-retrieval query heads and invisible
  tokens, and keeps a running max: after block_size iterations it holds the block max, written as f32[cb].
  Bytes: K of the R heads' visible middle blocks once; out B * T * nb * 4. No [.., N] logits reach HBM.

Gathered decode with entry mass (`sparse_decode_mass_gpu`): the split-K gathered decode of
  `pallas_kernels.sparse_attention.stacked` with its `return_mass` option (grid (B, Hkv, T, S), online softmax in
  f32): the kernel also writes, for
  every index entry and query row, the sum of exp(s - m) over the entry's tokens (m: the running max of the
  iteration that processed it) and that m. With the final logsumexp, mass = sum * exp(m - lse), computed in
  the jnp epilogue with the split combine. Extra bytes: 2 * Gp * K * 4 per (b, KV head, t); no second K read.

Both run in interpret mode on CPU (`interpret=True`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.block_scores.reference import check_block_max_args
from pallas_kernels.sparse_attention import gpu as sgpu
from pallas_kernels.sparse_attention.common import default_scale
from pallas_kernels.sparse_attention.stacked import layer_index, sparse_decode_stacked_gpu

Array = jax.Array

_MASK = -1e30  # finite "minus infinity" (as the other Triton kernels)
_MIN_ROWS = 16  # Triton's tensor-core dot needs M, N, K >= 16


_pow2 = sgpu._pow2


def unsupported_reason(dtype, head_dim: int, block_size: int) -> str | None:
    """Why the Triton kernels cannot take these arguments (None when they can): the gathered-decode kernel's
    rules (`sparse_attention.gpu.unsupported_reason`)."""
    return sgpu.unsupported_reason(dtype, head_dim, block_size, None)


def _check_supported(q: Array, block_size: int) -> None:
    reason = unsupported_reason(q.dtype, q.shape[-1], block_size)
    if reason is not None:
        raise ValueError(f"the Pallas GPU block_scores kernel cannot take {reason}")


# ---------------------------------------------------------------------------------------------------------
# Retrieval block max.


@dataclasses.dataclass(frozen=True)
class BlockMaxConfig:
    """Tuning of the block-max kernel.

    Attributes:
      blocks_per_program: cb, blocks per program (a power of two >= 16); None picks the largest of 64, 32, 16
        that still gives about `target_programs` programs.
      target_programs: grid size the heuristic aims for (a few waves of 132 SMs on an H100).
      num_warps, num_stages: Triton launch parameters.
    """

    blocks_per_program: int | None = None
    target_programs: int = 264
    num_warps: int = 4
    num_stages: int = 3


def _blocks_per_program(B: int, T: int, nb: int, config: BlockMaxConfig) -> int:
    if config.blocks_per_program is not None:
        cb = config.blocks_per_program
        if not _pow2(cb) or cb < _MIN_ROWS:
            raise ValueError(f"BlockMaxConfig.blocks_per_program={cb}: expected a power of two >= {_MIN_ROWS}")
        return cb
    for cb in (64, 32):
        if B * T * pl.cdiv(nb, cb) >= config.target_programs:
            return cb
    return _MIN_ROWS


def _block_max_kernel(lay_ref, kvh_ref, hm_ref, meta_ref, q_ref, k_ref, o_ref, *, scale: float, block_size: int,
                      cb: int, G: int, Gp: int, R: int):
    """One (b, t, s) program.

    Refs: lay_ref i32[1]; kvh_ref i32[R]; hm_ref f32[R, Gp] (1: query head g of KV head r counts); meta_ref
    i32[4] (last visible token, lo, hi, unused); q_ref [Hq, D] the row's queries; k_ref [L, Hkv, N, D] every
    layer and KV head of batch row b; o_ref f32[cb].
    """
    layer = lay_ref[0]
    s = pl.program_id(2)
    lim, lo, hi = meta_ref[0], meta_ref[1], meta_ref[2]
    blk = s * cb + jnp.arange(cb, dtype=jnp.int32)
    blk_ok = (blk >= lo) & (blk < hi)
    live = (jnp.minimum(hi, s * cb + cb) > jnp.maximum(lo, s * cb)) & (lo < hi)
    lane = jnp.arange(Gp, dtype=jnp.int32)
    acc = jnp.full((cb,), -jnp.inf, jnp.float32)
    for r in range(R):
        kvh = kvh_ref[r]
        hm = hm_ref[r, :]  # [Gp]
        q = q_ref[kvh * G + jnp.minimum(lane, G - 1), :]  # [Gp, D] the GQA group (padding rows repeat row G-1)
        heads = (hm > 0)[:, None]

        def body(j, acc, kvh=kvh, q=q, heads=heads):
            tok = blk * block_size + j
            ok = blk_ok & (tok <= lim)
            k = k_ref[layer, kvh, jnp.where(ok, tok, 0), :]  # [cb, D]: token j of each block
            logits = plgpu.dot(q, k, trans_b=True)  # [Gp, cb] f32
            t = jnp.max(jnp.where(heads, logits, -jnp.inf), axis=0)
            return jnp.maximum(acc, jnp.where(ok, t, -jnp.inf))

        n = jnp.where(live & (jnp.max(hm) > 0), jnp.int32(block_size), jnp.int32(0))
        acc = lax.fori_loop(jnp.int32(0), n, body, acc)  # bounds of one dtype (Triton's scf.for needs it)
    o_ref[...] = acc * scale


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "config", "interpret"))
def block_max_scores_gpu(q: Array, k_all: Array, layer: Array, kv_heads: Array, head_mask: Array, positions: Array,
                         lo: Array, hi: Array, *, block_size: int, scale: float | None = None,
                         config: BlockMaxConfig = BlockMaxConfig(), interpret: bool = False) -> Array:
    """`reference.block_max_scores_reference` by the Pallas Triton kernel (see the module docstring)."""
    check_block_max_args(q, k_all, layer, kv_heads, head_mask, positions, lo, hi, block_size)
    _check_supported(q, block_size)
    B, T, Hq, D = q.shape
    L, _, Hkv, N, _ = k_all.shape
    G, nb, R = Hq // Hkv, N // block_size, kv_heads.shape[0]
    Gp = max(_MIN_ROWS, pl.next_power_of_2(G))
    scale = default_scale(D, scale)
    cb = _blocks_per_program(B, T, nb, config)
    S = pl.cdiv(nb, cb)
    lay = layer_index(layer, L).reshape(1)
    kvh = jnp.clip(kv_heads.astype(jnp.int32), 0, Hkv - 1)
    hm = jnp.pad(head_mask.astype(jnp.float32), ((0, 0), (0, Gp - G)))
    lim = jnp.minimum(positions.astype(jnp.int32), N - 1)
    meta = jnp.stack([lim, lo.astype(jnp.int32), hi.astype(jnp.int32), jnp.zeros_like(lim)], axis=-1)  # [B, T, 4]
    kernel = functools.partial(_block_max_kernel, scale=scale, block_size=block_size, cb=cb, G=G, Gp=Gp, R=R)
    out = pl.pallas_call(
        kernel,
        grid=(B, T, S),
        in_specs=[
            pl.BlockSpec((1,), lambda b, t, s: (0,)),  # the layer index
            pl.BlockSpec((R,), lambda b, t, s: (0,)),  # retrieval KV heads
            pl.BlockSpec((R, Gp), lambda b, t, s: (0, 0)),  # their query-head masks
            pl.BlockSpec((None, None, 4), lambda b, t, s: (b, t, 0)),  # last visible token, lo, hi
            pl.BlockSpec((None, None, Hq, D), lambda b, t, s: (b, t, 0, 0)),  # the row's queries
            pl.BlockSpec((L, None, Hkv, N, D), lambda b, t, s: (0, b, 0, 0, 0)),  # every layer and KV head of row b
        ],
        out_specs=pl.BlockSpec((None, None, cb), lambda b, t, s: (b, t, s)),
        out_shape=jax.ShapeDtypeStruct((B, T, S * cb), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="evosparse_block_max",
    )(lay, kvh, hm, meta, q, k_all)
    return out[:, :, :nb]


# ---------------------------------------------------------------------------------------------------------
# Gathered decode with per-entry mass.


def sparse_decode_mass_gpu(q: Array, k_all: Array, v_all: Array, layer: Array, indices: Array, lengths: Array, *,
                           block_size: int = 1, scale: float | None = None,
                           config: sgpu.DecodeConfig = sgpu.DecodeConfig(), interpret: bool = False):
    """`reference.sparse_decode_mass_reference` by the stacked gathered-decode Triton kernel with its mass output
    (`sparse_attention.stacked.sparse_decode_stacked_gpu(..., return_mass=True)`).

    Args:
      q: [B, T, Hq, D]; k_all, v_all: [L, B, Hkv, N, D]; layer: i32[]; indices: int32[B, Hkv, T, K];
      lengths: int32[B]; block_size: a power of two; config: `sparse_attention.gpu.DecodeConfig`.

    Returns:
      (out [B, T, Hq, D] in q.dtype, mass f32[B, Hkv, T, K]).
    """
    _check_supported(q, block_size)
    return sparse_decode_stacked_gpu(q, k_all, v_all, layer, indices, lengths, block_size=block_size, scale=scale,
                                     return_mass=True, config=config, interpret=interpret)

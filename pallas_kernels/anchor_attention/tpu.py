"""Pallas TPU kernel of the anchor decode layer's scoring pass, and the TPU anchor layer.

`_logits_kernel`, grid (B, Hkv, T, chunks): the GQA group's queries ([G, D]) against `chunk` keys per step
([chunk, D] blocks of the head-major cache, pipelined by BlockSpecs); it writes the scaled logits
(f32[G, chunk] blocks of f32[B, Hkv, T, G, N]) and keeps the online max and sum of exp per query head in VMEM
scratch, writing the logsumexp at the last step; with `dense_output` it also reads V and accumulates the dense
attention. Pooling, selection (`topk_select`, TPU counting kernel) and the attention over the selected keys
(`sparse_decode`: the TPU kernel at block granularity, else XLA's gather) follow (common.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.anchor_attention.common import (check_args, check_diagonal_tile, default_scale, force_diagonal,
                                                    layer_of, pool_scores, positions, select, unstack)

Array = jax.Array

_MASK = -1e30


@dataclasses.dataclass(frozen=True)
class TpuAnchorConfig:
    """Tuning of the TPU scoring kernel.

    Attributes:
      chunk: keys per grid step (a multiple of 128, or >= N for one step).
    """

    chunk: int = 512


def _logits_kernel(lim_ref, layer_ref, q_ref, k_ref, *refs, scale: float, chunk: int, n: int, T: int, dense: bool):
    """One (b, h, t, chunk) step. Scalar refs: lim i32[B*T] last visible key, layer i32[1] (used by the index
    maps). q [G, D]; k [chunk, D] (and v);
    outputs logits f32[G, chunk], lse f32[G, 1] (and o [G, D]); scratch m, l f32[G, 1] (and acc f32[G, D])."""
    if dense:
        v_ref, lg_ref, lse_ref, o_ref, m_sc, l_sc, acc_sc = refs
    else:
        lg_ref, lse_ref, m_sc, l_sc = refs
    b, t, c = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(c == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, _MASK, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        if dense:
            acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    lim = lim_ref[b * T + t]
    q = q_ref[...]
    s = lax.dot_general(q, k_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
    kpos = c * chunk + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    ok = (kpos <= lim) & (kpos < n)
    s = jnp.where(ok, s, _MASK)
    lg_ref[...] = s
    m_prev = m_sc[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    corr = jnp.exp(m_prev - m_new)
    p = jnp.where(ok, jnp.exp(s - m_new), 0.0)
    l_sc[...] = corr * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
    m_sc[...] = m_new
    if dense:
        v = v_ref[...]
        vpos = c * chunk + lax.broadcasted_iota(jnp.int32, v.shape, 0)
        # rows past the cache end, or past the visible keys (garbage, maybe NaN), may hold anything
        v = jnp.where((vpos < n) & (vpos <= lim), v, jnp.zeros_like(v))
        acc_sc[...] = corr * acc_sc[...] + lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                                           preferred_element_type=jnp.float32)

    @pl.when(c == pl.num_programs(3) - 1)
    def _():
        l = l_sc[...]
        nonempty = l > 0
        l_safe = jnp.where(nonempty, l, 1.0)
        lse_ref[...] = jnp.where(nonempty, m_sc[...] + jnp.log(l_safe), -jnp.inf)
        if dense:
            o_ref[...] = jnp.where(nonempty, acc_sc[...] / l_safe, 0.0).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "dense_output", "diagonal_tile", "config", "interpret"))
def decode_scores_tpu(q: Array, k: Array, v: Array, lengths: Array, *, layer: Array | None = None,
                      scale: float | None = None, dense_output: bool = False, diagonal_tile: int = 0,
                      config: TpuAnchorConfig = TpuAnchorConfig(), interpret: bool = False) -> tuple[Array, Array | None]:
    """Pooled post-softmax scores f32[B, Hkv, T, N] (and the dense attention with `dense_output`); see
    `gpu.decode_scores_gpu` (with `layer`, k and v are the stacked cache [L, B, Hkv, N, D], read in place)."""
    if config.chunk < 128 or config.chunk % 128:
        raise ValueError(f"TpuAnchorConfig.chunk={config.chunk}: expected a multiple of 128")
    if layer is None:
        k, v, layer = k[None], v[None], 0
    L, B, Hkv, N, D = k.shape
    T, Hq = q.shape[1], q.shape[2]
    G = Hq // Hkv
    scale = default_scale(D, scale)
    chunk = N if N <= config.chunk else config.chunk
    pos = positions(lengths, T)
    lim = jnp.minimum(pos, N - 1).reshape(-1)
    qg = q.reshape(B, T, Hkv, G, D).transpose(0, 2, 1, 3, 4)  # [B, Hkv, T, G, D]

    kv_spec = pl.BlockSpec((None, None, None, chunk, D), lambda b, h, t, c, lim, lay: (lay[0], b, h, c, 0))
    row = lambda b, h, t, c, lim, lay: (b, h, t, 0, 0)
    in_specs = [pl.BlockSpec((None, None, None, G, D), row), kv_spec]
    out_specs = [pl.BlockSpec((None, None, None, G, chunk), lambda b, h, t, c, lim, lay: (b, h, t, 0, c)),
                 pl.BlockSpec((None, None, None, G, 1), row)]
    out_shape = [jax.ShapeDtypeStruct((B, Hkv, T, G, N), jnp.float32),
                 jax.ShapeDtypeStruct((B, Hkv, T, G, 1), jnp.float32)]
    scratch = [pltpu.VMEM((G, 1), jnp.float32), pltpu.VMEM((G, 1), jnp.float32)]
    args = [lim, layer_of(layer, L), qg, k]
    if dense_output:
        in_specs.append(kv_spec)
        out_specs.append(pl.BlockSpec((None, None, None, G, D), row))
        out_shape.append(jax.ShapeDtypeStruct((B, Hkv, T, G, D), q.dtype))
        scratch.append(pltpu.VMEM((G, D), jnp.float32))
        args.append(v)
    res = pl.pallas_call(
        functools.partial(_logits_kernel, scale=scale, chunk=chunk, n=N, T=T, dense=dense_output),
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2, grid=(B, Hkv, T, pl.cdiv(N, chunk)),
                                               in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="anchor_decode_logits_tpu",
    )(*args)
    scores = force_diagonal(pool_scores(res[0], res[1][..., 0], pos), pos, diagonal_tile)
    out = None
    if dense_output:
        out = res[2].transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, D)
    return scores, out


@functools.partial(jax.jit, static_argnames=("budget", "min_tokens", "K", "scale", "dense_output", "diagonal_tile",
                                             "with_output", "config", "interpret"))
def anchor_decode_tpu(q: Array, k: Array, v: Array, lengths: Array, *, budget: float, min_tokens: int = 128,
                      K: int | None = None, layer: Array | None = None, scale: float | None = None,
                      dense_output: bool = False, diagonal_tile: int = 0, with_output: bool = True,
                      config: TpuAnchorConfig = TpuAnchorConfig(), interpret: bool = False) -> tuple[Array, Array]:
    """Anchor decode layer on the TPU. Args and returns as `reference.anchor_decode_reference` (with `layer`,
    k and v are the stacked cache read in place); interpret: the scoring and selection kernels in the Pallas
    interpreter (CPU tests)."""
    from pallas_kernels.sparse_attention import sparse_decode
    from pallas_kernels.topk_select import tpu as select_tpu

    K = check_args(q, *unstack(k, v, layer), lengths, budget, min_tokens, K)
    check_diagonal_tile(diagonal_tile)
    scores, out = decode_scores_tpu(q, k, v, lengths, layer=layer, scale=scale, dense_output=dense_output,
                                    diagonal_tile=diagonal_tile, config=config, interpret=interpret)
    pos = positions(lengths, q.shape[1])
    if interpret:
        from pallas_kernels.anchor_attention.common import budget_count
        kk = budget_count(float(budget), pos + 1, min_tokens)[:, None, :]
        indices = select_tpu.topk_select_tpu(scores, kk, K, interpret=True)
    else:
        indices = select(scores, pos, budget, min_tokens, K, "pallas_tpu")
    if out is None and with_output:
        # Token indices (block_size 1): the TPU sparse kernel gathers blocks of >= 8 rows, so this is XLA's gather
        # (named: the default would pick the host's kernel, a GPU's when the TPU kernels run interpreted there).
        out = sparse_decode(q, k, v, indices, lengths, scale=scale, layer=layer, implementation="xla")
    return out, indices

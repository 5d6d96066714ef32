"""Causal sliding-window attention with attention sinks as one Pallas TPU (Mosaic) kernel.

Grid (B, Hq, query blocks), all parallel. A program takes `block` (128) queries of one head and three key/value
blocks of its KV head, each one DMA'd by its BlockSpec: the sink block (keys 0 .. 127, masked to keys < sinks), the
previous block and the query block's own (masked to keys >= sinks, inside the window). So the kernel serves
window <= block + 1 and sinks <= block; `local_attention` sends other sizes to the blocked jnp version. Blocks are
read from [B, T, H * D] (a free reshape of the caller's [B, T, H, D]) when D is a multiple of 128, otherwise from
head-major copies [B, H, T, D] (TPU blocks need their last two dims to be multiples of (8, 128) or full).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

Array = jax.Array

BLOCK = 128
_NEG = -1e30  # finite "minus infinity" (no NaN from _NEG - _NEG)
_LANES = 128
_NT = (((1,), (1,)), ((), ()))  # q [bq, D] . k [bk, D] -> [bq, bk]


def supported(window: int, sinks: int) -> bool:
    """Whether the kernel serves these sizes: the window within the previous and own key block, the sinks in one."""
    return window <= BLOCK + 1 and sinks <= BLOCK


def _kernel(q_ref, ks_ref, vs_ref, kp_ref, vp_ref, kc_ref, vc_ref, o_ref, *, scale, window, sinks, precision):
    """Refs: q_ref, o_ref [bq, D]; k*/v* [bk, D]: the sink block (s), the previous block (p), the own block (c)."""
    i = pl.program_id(2)
    rows = i * BLOCK + lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 0)
    offs = lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1)
    q = q_ref[...]

    def scores(k_ref):
        return lax.dot_general(q, k_ref[...], _NT, precision=precision, preferred_element_type=jnp.float32) * scale

    def in_window(cols):
        return (cols >= sinks) & (cols <= rows) & (rows - cols < window)

    parts = [(scores(kp_ref), in_window((i - 1) * BLOCK + offs) & (i > 0), vp_ref),  # block 0 has no previous
             (scores(kc_ref), in_window(i * BLOCK + offs), vc_ref)]
    if sinks:
        parts.append((scores(ks_ref), (offs < sinks) & (offs <= rows), vs_ref))
    m = functools.reduce(jnp.maximum, [jnp.max(jnp.where(ok, s, _NEG), axis=1, keepdims=True) for s, ok, _ in parts])
    l = jnp.zeros((BLOCK, 1), jnp.float32)
    acc = jnp.zeros(o_ref.shape, jnp.float32)
    for s, ok, v_ref in parts:
        p = jnp.where(ok, jnp.exp(s - m), 0.0)
        l = l + jnp.sum(p, axis=1, keepdims=True)
        v = v_ref[...]
        acc = acc + lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                                    preferred_element_type=jnp.float32)
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("window", "sinks", "scale", "interpret"))
def local_attention_tpu(q: Array, k: Array, v: Array, *, window: int, sinks: int = 0, scale: float | None = None,
                        interpret: bool = False) -> Array:
    """Sliding-window attention with sinks (see reference.py): q [B, T, Hq, D], k, v [B, T, Hkv, D] ->
    [B, T, Hq, D] in q's dtype, for window <= 129 and sinks <= 128 (`supported`). `interpret` runs the kernel in
    Pallas interpret mode (CPU)."""
    if not supported(window, sinks):
        raise ValueError(f"window={window}, sinks={sinks}: the TPU kernel serves window <= {BLOCK + 1} and sinks <= "
                         f"{BLOCK}; use local_attention(), which sends other sizes to the jnp version")
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    nq = pl.cdiv(T, BLOCK)
    Tp = nq * BLOCK
    pad = lambda x: jnp.pad(x, ((0, 0), (0, Tp - T), (0, 0), (0, 0))) if Tp != T else x  # noqa: E731
    q, k, v = pad(q), pad(k), pad(v)
    if D % _LANES == 0:  # free reshapes; head h's columns are block h of width D
        q, k, v = q.reshape(B, Tp, Hq * D), k.reshape(B, Tp, Hkv * D), v.reshape(B, Tp, Hkv * D)
        spec = lambda head, blk: pl.BlockSpec((None, BLOCK, D), lambda b, h, i: (b, blk(i), head(h)))  # noqa: E731
        out_shape = (B, Tp, Hq * D)
    else:
        q, k, v = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        spec = lambda head, blk: pl.BlockSpec((None, None, BLOCK, D),  # noqa: E731
                                              lambda b, h, i: (b, head(h), blk(i), 0))
        out_shape = (B, Hq, Tp, D)
    own, kv_head = (lambda h: h), (lambda h: h // G)
    sink_blk, prev_blk, cur_blk = (lambda i: 0), (lambda i: jnp.maximum(i - 1, 0)), (lambda i: i)
    out = pl.pallas_call(
        functools.partial(_kernel, scale=scale, window=window, sinks=min(sinks, T),
                          precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None),
        grid=(B, Hq, nq),
        in_specs=[spec(own, cur_blk)] + [spec(kv_head, blk) for blk in (sink_blk, prev_blk, cur_blk) for _ in "kv"],
        out_specs=spec(own, cur_blk),
        out_shape=jax.ShapeDtypeStruct(out_shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=interpret,
        name="local_attention_tpu",
    )(q, k, v, k, v, k, v)
    out = out.reshape(B, Tp, Hq, D) if D % _LANES == 0 else out.transpose(0, 2, 1, 3)
    return out[:, :T]

"""Causal sliding-window attention with attention sinks as one Pallas GPU (Triton) kernel.

Grid (Hq, query blocks, B): a program takes `block_q` queries of one head, starts the online softmax with the
sink keys (the key blocks below min(sinks, last query + 1), masked to keys < sinks) and then walks the key blocks
of its window, [first query - window + 1, last query], masked to keys >= sinks, `block_k` keys at a time, so no
key is counted twice. Keys and values are read from the caller's [B, T, Hkv, D]
layout; grid dimension 0 is CUDA's fastest-moving launch index, so the G query heads of one KV head run side by
side and share its K/V blocks in L2. Work O(T * (window + block_q)) per head, the dense kernel's O(T^2 / 2) aside.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

Array = jax.Array

_NEG = -1e30  # finite "minus infinity": exp2(_NEG - m) == 0 and no NaN from _NEG - _NEG
_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """block_q queries per program, block_k keys per step (powers of two >= 16); Triton launch parameters.
    The defaults were the fastest of a sweep at 128K, window 64, 4 sinks, Llama-3.1-8B heads on an H100
    (1.74 ms, 1.7x the HBM floor; cuDNN's sliding window without sinks takes 2.02 ms; made by
    eval/bench/local_attention.py, eval/results/h100/local_attention.json)."""

    block_q: int = 64
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"BlockSizes.{name} must be a power of two >= 16, got {v!r}")


def _load_rows(ref, start, rows: int, seq_len: int, head_dim: int):
    """ref rows [start, start + rows) -> [rows, Dp], zeros outside [0, T) and past D."""
    Dp = ref.shape[-1]
    idx = start + jnp.arange(rows, dtype=jnp.int32)
    mask = ((idx >= 0) & (idx < seq_len))[:, None]
    mask = mask & (jnp.arange(Dp) < head_dim)[None, :] if Dp != head_dim else jnp.broadcast_to(mask, (rows, Dp))
    return plgpu.load(ref.at[pl.ds(start, rows), :], mask=mask, other=0.0)


def _kernel(q_ref, k_ref, v_ref, o_ref, *, qk_scale, window, sinks, block_q, block_k, seq_len, head_dim,
            precision):
    """Refs: q_ref [block_q, Dp] (one head); k_ref, v_ref [Tk, Dp] (its KV head); o_ref [block_q, Dp]."""
    i = pl.program_id(1)
    q0 = i * block_q
    rows = q0 + jnp.arange(block_q, dtype=jnp.int32)
    q = q_ref[...]
    Dp = q.shape[-1]

    def step(carry, k0, visible_fn):
        m_prev, l_prev, acc = carry
        k = _load_rows(k_ref, k0, block_k, seq_len, head_dim)
        v = _load_rows(v_ref, k0, block_k, seq_len, head_dim)
        cols = k0 + jnp.arange(block_k, dtype=jnp.int32)
        logits = plgpu.dot(q, k, trans_b=True, precision=precision) * qk_scale
        visible = visible_fn(cols)
        logits = jnp.where(visible, logits, _NEG)
        m_next = jnp.maximum(m_prev, jnp.max(logits, axis=1))
        p = jnp.where(visible, jnp.exp2(logits - m_next[:, None]), 0.0)
        alpha = jnp.exp2(m_prev - m_next)
        l_next = l_prev * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision)
        return m_next, l_next, acc

    carry = (jnp.full((block_q,), _NEG, jnp.float32), jnp.zeros((block_q,), jnp.float32),
             jnp.zeros((block_q, Dp), jnp.float32))
    if sinks:
        def sink_visible(cols):
            return (cols[None, :] < sinks) & (cols[None, :] <= rows[:, None])

        n_sink = lax.div(jnp.minimum(sinks, q0 + block_q) + block_k - 1, block_k)  # blocks below the sinks' end
        carry = lax.fori_loop(0, n_sink, lambda j, c: step(c, j * block_k, sink_visible), carry)

    def window_visible(cols):
        return ((cols[None, :] >= sinks) & (cols[None, :] <= rows[:, None])
                & (rows[:, None] - cols[None, :] < window))

    lo = lax.div(jnp.maximum(q0 - window + 1, sinks), block_k)  # first key block with a visible key
    hi = lax.div(q0 + block_q - 1, block_k) + 1  # past the block of the last query
    carry = lax.fori_loop(lo, hi, lambda j, c: step(c, j * block_k, window_visible), carry)
    m, l, acc = carry
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("window", "sinks", "scale", "block_sizes", "interpret"))
def local_attention_gpu(q: Array, k: Array, v: Array, *, window: int, sinks: int = 0, scale: float | None = None,
                        block_sizes: BlockSizes | None = None, interpret: bool = False) -> Array:
    """Sliding-window attention with sinks (see reference.py): q [B, T, Hq, D], k, v [B, T, Hkv, D] ->
    [B, T, Hq, D] in q's dtype. `interpret` runs the kernel in Pallas interpret mode (CPU)."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    bs = block_sizes or BlockSizes()
    scale = D ** -0.5 if scale is None else scale
    Dp = max(16, pl.next_power_of_2(D))
    nq = pl.cdiv(T, bs.block_q)
    Tq = nq * bs.block_q
    s = min(sinks, T)
    Tk = pl.cdiv(Tq, bs.block_k) * bs.block_k  # every key block read lies inside [0, Tk)
    pad = lambda x, t: jnp.pad(x, ((0, 0), (0, t - T), (0, 0), (0, Dp - D))) if (t, Dp) != (T, D) else x  # noqa
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    out = pl.pallas_call(
        functools.partial(_kernel, qk_scale=scale * _LOG2E, window=window, sinks=s, block_q=bs.block_q,
                          block_k=bs.block_k, seq_len=T, head_dim=D, precision=precision),
        grid=(Hq, nq, B),
        in_specs=[
            pl.BlockSpec((None, bs.block_q, None, Dp), lambda h, i, b: (b, i, h, 0)),
            pl.BlockSpec((None, Tk, None, Dp), lambda h, i, b: (b, 0, h // G, 0)),
            pl.BlockSpec((None, Tk, None, Dp), lambda h, i, b: (b, 0, h // G, 0)),
        ],
        out_specs=pl.BlockSpec((None, bs.block_q, None, Dp), lambda h, i, b: (b, i, h, 0)),
        out_shape=jax.ShapeDtypeStruct((B, Tq, Hq, Dp), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="local_attention",
    )(pad(q, Tq), pad(k, Tk), pad(v, Tk))
    return out[:, :T, :, :D] if (Tq, Dp) != (T, D) else out

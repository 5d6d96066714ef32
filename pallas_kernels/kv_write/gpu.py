"""Pallas GPU (Triton) kernel of `rope_write`.

grid (B * T,): program r takes token row r of the fused q/k/v projection ([Hq + 2 Hkv, D], read as its two halves
along D), applies the rotary embedding at positions[r] in f32, stores the rotated q heads, and stores the rotated k
and the v heads straight into the stacked caches at [layer, r // T, :, positions[r]] (both caches aliased: in
place; nothing stored for a position outside [0, N)). One launch replaces the model's four per layer (the q rotation,
an index clamp and the two cache scatters); the layer index is wrapped and clamped in-kernel too, where an XLA scalar
op before the launch was one more kernel every layer. No q/k norm in the kernel: `rope_write` norms Qwen3's heads in
XLA first (see its module docstring).
Runs in interpret mode on CPU (`interpret=True`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kv_write.reference import check_args
from pallas_kernels.layers import layer_index

Array = jax.Array
F32 = jnp.float32


def unsupported_reason(qkv: Array, num_q_heads: int, num_kv_heads: int) -> str | None:
    D = qkv.shape[-1]
    if D < 32 or D & (D - 1):
        return f"head_dim={D}: the kernel takes a power of two >= 32"
    for name, h in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads)):
        if h & (h - 1):
            return f"{name}={h}: the kernel takes a power of two"
    return None


def _rows(ref, start: int, n: int, half: int):
    """The two halves along D of rows start .. start + n of a [H, D] block, in f32."""
    return (ref[pl.ds(start, n), pl.ds(0, half)].astype(F32), ref[pl.ds(start, n), pl.ds(half, half)].astype(F32))


def _kernel(lay_ref, pos_ref, qkv_ref, freq_ref, _ck, _cv, q_out, k_out, v_out, *, hq: int, hkv: int, L: int,
            N: int):
    r = pl.program_id(0)
    layer = layer_index(lay_ref[0], L)  # wrapped and clamped here: in XLA it was a kernel of its own every layer
    p = pos_ref[r]
    D = qkv_ref.shape[-1]
    half = D // 2
    freqs = p.astype(F32) * freq_ref[...]  # [D/2]
    cos, sin = jnp.cos(freqs)[None, :], jnp.sin(freqs)[None, :]

    def rotate(a, b):  # rotate-half: (a, b) -> (a cos - b sin, b cos + a sin)
        return a * cos + (-b) * sin, b * cos + a * sin

    q1, q2 = rotate(*_rows(qkv_ref, 0, hq, half))
    q_out[:, pl.ds(0, half)] = q1.astype(q_out.dtype)
    q_out[:, pl.ds(half, half)] = q2.astype(q_out.dtype)
    k1, k2 = rotate(*_rows(qkv_ref, hq, hkv, half))
    v1, v2 = _rows(qkv_ref, hq + hkv, hkv, half)
    keep = jnp.full((hkv, half), (p >= 0) & (p < N))  # a position outside the cache is dropped
    at = jnp.clip(p, 0, N - 1)
    heads = jnp.arange(hkv, dtype=jnp.int32)[:, None]
    lo, hi = jnp.arange(half, dtype=jnp.int32)[None, :], jnp.arange(half, D, dtype=jnp.int32)[None, :]
    for out, a, b in ((k_out, k1, k2), (v_out, v1, v2)):
        plgpu.store(out.at[layer, heads, at, lo], a.astype(out.dtype), mask=keep)
        plgpu.store(out.at[layer, heads, at, hi], b.astype(out.dtype), mask=keep)


def rope_write_gpu(qkv: Array, positions: Array, inv_freq: Array, cache_k: Array, cache_v: Array, layer,
                   num_q_heads: int, num_kv_heads: int, *, interpret: bool = False):
    """`reference.rope_write_reference` without a q/k norm, by the kernel (module docstring)."""
    check_args(qkv, positions, inv_freq, cache_k, cache_v, num_q_heads, num_kv_heads)
    reason = unsupported_reason(qkv, num_q_heads, num_kv_heads)
    if reason is not None:
        raise ValueError(reason)
    B, T = positions.shape
    H, D = qkv.shape[1:]
    L, N = cache_k.shape[0], cache_k.shape[3]
    hq, hkv = num_q_heads, num_kv_heads
    cache = pl.BlockSpec((L, None, hkv, N, D), lambda r: (0, r // T, 0, 0, 0))
    q, ck, cv = pl.pallas_call(
        functools.partial(_kernel, hq=hq, hkv=hkv, L=L, N=N),
        grid=(B * T,),
        in_specs=[pl.BlockSpec((1,), lambda r: (0,)), pl.BlockSpec((B * T,), lambda r: (0,)),
                  pl.BlockSpec((None, H, D), lambda r: (r, 0, 0)), pl.BlockSpec((D // 2,), lambda r: (0,)),
                  cache, cache],
        out_specs=[pl.BlockSpec((None, hq, D), lambda r: (r, 0, 0)), cache, cache],
        out_shape=[jax.ShapeDtypeStruct((B * T, hq, D), qkv.dtype), jax.ShapeDtypeStruct(cache_k.shape, cache_k.dtype),
                   jax.ShapeDtypeStruct(cache_v.shape, cache_v.dtype)],
        input_output_aliases={4: 1, 5: 2},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="rope_write",
    )(jnp.asarray(layer).astype(jnp.int32).reshape(1), positions.reshape(B * T).astype(jnp.int32), qkv,
      inv_freq.astype(F32), cache_k, cache_v)
    return q.reshape(B, T, hq, D), ck, cv

"""Pallas GPU (Triton) split-K matmul of a few rows against one layer of stacked weights, read in place.

grid (N / block_n, S): program (n, s) multiplies the M rows (padded to 16 for the tensor-core dot) by columns
[n * block_n, (n + 1) * block_n) of rows [s * K / S, (s + 1) * K / S) of `w_all[layer]`, `block_k` rows at a
time; the weights' BlockSpec spans the L axis and the loads index it with the traced layer, so the layer's
weights are read where they lie (a layer slice passed to a custom call would be copied first). Each program
writes an f32 partial [16, block_n]; one XLA reduction adds the S partials and rounds to x.dtype. With M <= 16
rows the matmul reads every weight byte once and does little else: S is chosen so that the grid has a few
programs per SM (`target_programs`), which cuBLAS's tiles do not give for N = 4096 outputs.

Runs in interpret mode on CPU (`interpret=True`). Semantics: `stacked_matmul_reference`. An experiment of
`bench_fixed.py` (part E), not part of the library: on the H100 it reads the weights no faster than cuBLAS
(NOTES.md).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


Array = jax.Array

def check_args(x: Array, w_all: Array, layer: Array) -> None:
    """Raises ValueError naming the argument when the shapes do not describe x @ w_all[layer]."""
    if x.ndim != 2:
        raise ValueError(f"x: expected [M, K], got shape {x.shape}")
    if w_all.ndim != 3:
        raise ValueError(f"w_all: expected stacked weights [L, K, N], got shape {w_all.shape}")
    if x.shape[1] != w_all.shape[1]:
        raise ValueError(f"x has K = {x.shape[1]} columns but w_all's layers have K = {w_all.shape[1]} rows")
    if jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.asarray(layer).dtype, jnp.integer):
        raise ValueError(f"layer: expected an integer scalar, got {jnp.asarray(layer).dtype}{jnp.shape(layer)}")


def stacked_matmul_reference(x: Array, w_all: Array, layer: Array) -> Array:
    check_args(x, w_all, layer)
    w = jax.lax.dynamic_index_in_dim(w_all, layer, keepdims=False)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


ROWS = 16  # rows of the program's tile: Triton's tensor-core dot needs M >= 16


@dataclasses.dataclass(frozen=True)
class StackedMatmulConfig:
    """Tuning of the kernel: block_n output columns and block_k weight rows per step (powers of two >= 16),
    num_splits of K (None: the most splits, up to max_splits, for which the grid stays under about
    target_programs and each split a whole number of block_k steps), num_warps, num_stages."""

    block_n: int = 128
    block_k: int = 128
    num_splits: int | None = None
    target_programs: int = 264
    max_splits: int = 16
    num_warps: int = 4
    num_stages: int = 4


def splits_for(K: int, N: int, config: StackedMatmulConfig) -> int:
    if config.num_splits is not None:
        return config.num_splits
    cols = N // config.block_n
    best = 1
    for s in range(1, config.max_splits + 1):
        if K % (s * config.block_k) == 0 and cols * s <= config.target_programs:
            best = s
    return best


def unsupported_reason(x: Array, w_all: Array, config: StackedMatmulConfig = StackedMatmulConfig()) -> str | None:
    M, K = x.shape
    N = w_all.shape[-1]
    if M > ROWS:
        return f"{M} rows (the kernel takes at most {ROWS})"
    if N % config.block_n:
        return f"N = {N} outputs (a multiple of block_n = {config.block_n} expected)"
    if K % config.block_k:
        return f"K = {K} (a multiple of block_k = {config.block_k} expected)"
    if x.dtype != w_all.dtype or x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return f"dtypes x {x.dtype}, w_all {w_all.dtype} (one of bf16, f16, f32 for both expected)"
    return None


def _kernel(layer_ref, x_ref, w_ref, o_ref, *, block_k: int, steps: int):
    """layer_ref: i32[1]; x_ref: [16, K / S] (this split's columns of x); w_ref: [L, K / S, block_n] (this split's
    rows and program's columns of every layer); o_ref: f32[16, block_n]."""
    layer = layer_ref[0]

    def body(i, acc):
        ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        x = plgpu.load(x_ref.at[:, ks])
        w = plgpu.load(w_ref.at[layer, ks, :])
        return acc + plgpu.dot(x, w)

    o_ref[...] = lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape, jnp.float32))


def stacked_matmul_gpu(x: Array, w_all: Array, layer: Array, *,
                       config: StackedMatmulConfig = StackedMatmulConfig(), interpret: bool = False) -> Array:
    """x: [M, K] (M <= 16), w_all: [L, K, N], layer: i32[] (traced) -> [M, N] = x @ w_all[layer] in x.dtype."""
    check_args(x, w_all, layer)
    reason = unsupported_reason(x, w_all, config)
    if reason is not None:
        raise ValueError(f"the Pallas GPU stacked matmul kernel cannot take {reason}")
    M, K = x.shape
    L, _, N = w_all.shape
    S = splits_for(K, N, config)
    if K % (S * config.block_k):
        raise ValueError(f"num_splits = {S}: K = {K} is not a multiple of num_splits * block_k")
    ks = K // S
    xp = jnp.pad(x, ((0, ROWS - M), (0, 0)))
    lay = jnp.clip(jnp.asarray(layer, jnp.int32), 0, L - 1).reshape(1)
    part = pl.pallas_call(
        functools.partial(_kernel, block_k=config.block_k, steps=ks // config.block_k),
        grid=(N // config.block_n, S),
        in_specs=[
            pl.BlockSpec((1,), lambda n, s: (0,)),
            pl.BlockSpec((ROWS, ks), lambda n, s: (0, s)),
            pl.BlockSpec((L, ks, config.block_n), lambda n, s: (0, s, n)),
        ],
        out_specs=pl.BlockSpec((None, ROWS, config.block_n), lambda n, s: (s, 0, n)),
        out_shape=jax.ShapeDtypeStruct((S, ROWS, N), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="stacked_matmul",
    )(lay, xp, w_all)
    return part[:, :M].sum(0).astype(x.dtype)

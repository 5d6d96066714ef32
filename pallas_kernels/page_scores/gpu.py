"""Pallas GPU (Triton) kernel of `page_scores`.

grid (B, Hkv, ceil(P / block_p)): program (b, h, j) loads pages j * block_p .. of layer `layer` of the stacked
bounds once (in place: the BlockSpec spans the L axis and the loads index it with the traced layer), as f32
[block_p, D] tiles of kmin and kmax, and for each of the KV head's R query rows (a static loop) writes the sum over
d of max(q * kmax, q * kmin) (a masked store past P; the rows are padded to a power of two, the padding's scores
dropped). Bytes: the layer's bounds once, the scores once. Runs in
interpret mode on CPU (`interpret=True`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.layers import layer_index
from pallas_kernels.page_scores.reference import check_args

Array = jax.Array

# Pages per program (read at each call): 32 since 2026-11-29, Quest at 100K, batch 4 on an H200 13.88 -> 13.65 ms
# (64; 128: 15.48; eval/results/h200/tuning/decode_knobs_round4.json).
BLOCK_P = 32
NUM_WARPS = 4  # warps per program (read at each call)
MAX_ROWS = 64  # query rows per KV head the static loop takes


def unsupported_reason(q: Array) -> str | None:
    D, R = q.shape[-1], q.shape[-2]
    if D < 16 or D & (D - 1):
        return f"head_dim={D}: the kernel takes a power of two >= 16"
    if R > MAX_ROWS:
        return f"{R} query rows per KV head: the kernel takes at most {MAX_ROWS}"
    return None


def _kernel(lay_ref, q_ref, lo_ref, hi_ref, o_ref, *, n: int, rows: int, block_p: int, L: int):
    layer = jnp.clip(lay_ref[0], 0, L - 1)
    j = pl.program_id(2)
    pages = j * block_p + jnp.arange(block_p, dtype=jnp.int32)
    ok = pages < n
    safe = jnp.where(ok, pages, 0)  # pages past P read page 0; their scores are not stored
    # One indexer (layer, rows, :): Triton lowering supports a single indexer per load.
    lo = lo_ref[layer, safe, :].astype(jnp.float32)  # [block_p, D]
    hi = hi_ref[layer, safe, :].astype(jnp.float32)
    for r in range(rows):
        q = q_ref[jnp.int32(r), :].astype(jnp.float32)[None, :]  # [1, D]
        s = jnp.sum(jnp.maximum(q * hi, q * lo), axis=1)  # [block_p]
        plgpu.store(o_ref.at[jnp.int32(r), pl.ds(j * block_p, block_p)], s, mask=ok)


def page_scores_gpu(q: Array, kmin: Array, kmax: Array, layer, *, block_p: int | None = None,
                    interpret: bool = False) -> Array:
    """`reference.page_scores_reference` by the kernel (module docstring); block_p None: BLOCK_P."""
    block_p = BLOCK_P if block_p is None else block_p
    check_args(q, kmin, kmax)
    reason = unsupported_reason(q)
    if reason is not None:
        raise ValueError(reason)
    B, Hkv, R, D = q.shape
    L, P = kmin.shape[0], kmin.shape[3]
    Rp = pl.next_power_of_2(R)  # block shapes of powers of two; the padding rows' scores are dropped
    q = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, 0), (0, Rp - R), (0, 0)))
    bounds = pl.BlockSpec((L, None, None, P, D), lambda b, h, j: (0, b, h, 0, 0))
    return pl.pallas_call(
        functools.partial(_kernel, n=P, rows=Rp, block_p=block_p, L=L),
        grid=(B, Hkv, pl.cdiv(P, block_p)),
        in_specs=[pl.BlockSpec((1,), lambda b, h, j: (0,)),
                  pl.BlockSpec((None, None, Rp, D), lambda b, h, j: (b, h, 0, 0)), bounds, bounds],
        out_specs=pl.BlockSpec((None, None, Rp, P), lambda b, h, j: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, Hkv, Rp, P), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret, name="quest_page_scores",
    )(layer_index(layer, kmin.shape[0]).reshape(1), q, kmin, kmax)[:, :, :R]

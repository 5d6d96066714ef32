"""Pallas GPU (Triton) kernel of `predicted_logits`.

The leading axes and the key heads flatten to R rows of keys [N, d] with their G * T query rows [GT, d]. grid (R,
ceil(N / block_n)): program (r, j) loads keys j * block_n .. of row r once as an f32 [block_n, d] tile and, for
each of its GT query rows (a static loop: T = 1 decoding has GT = G, 1 for TokenButler's per-query-head keys),
writes sum over d of q * k (a masked store past N), scaled by 1 / sqrt(d) after the sum as the reference does (the
rows are padded to a power of two, the padding's logits dropped). With `last` (and the kept keys), each query row's
bounds are two i32 per row, and the tile is bounded in registers (`reference.bound_logits`) before its store: no
second pass over the logits.
Bytes: the keys once, the output once. Runs in interpret mode on CPU (`interpret=True`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.predicted_logits.reference import bound_logits, check_args, check_bounds

Array = jax.Array

BLOCK_N = 256  # keys per program
MAX_ROWS = 64  # query rows per key row the static loop takes


def unsupported_reason(q: Array) -> str | None:
    d, rows = q.shape[-1], q.shape[-3] * q.shape[-2]
    if d < 16 or d & (d - 1):
        return f"head_dim={d}: the kernel takes a power of two >= 16"
    if rows > MAX_ROWS:
        return f"{rows} query rows per key head: the kernel takes at most {MAX_ROWS}"
    return None


def _kernel(q_ref, k_ref, *refs, n: int, rows: int, block_n: int, scale: float, bounded: bool, keep_first: int):
    """Refs: q_ref [GTp, d], k_ref [N, d], (with bounded: last_ref, from_ref i32[GTp]), o_ref f32[GTp, N]."""
    *bounds, o_ref = refs
    j = pl.program_id(1)
    cols = j * block_n + jnp.arange(block_n, dtype=jnp.int32)
    ok = cols < n
    k = plgpu.load(k_ref.at[pl.ds(j * block_n, block_n), :], mask=ok[:, None], other=0.0).astype(jnp.float32)
    for r in range(rows):
        q = q_ref[jnp.int32(r), :].astype(jnp.float32)  # [d]
        s = jnp.sum(k * q[None, :], axis=1) / scale  # [block_n]
        if bounded:
            s = bound_logits(s, cols, bounds[0][jnp.int32(r)], keep_first, bounds[1][jnp.int32(r)])
        plgpu.store(o_ref.at[jnp.int32(r), pl.ds(j * block_n, block_n)], s, mask=ok)


def predicted_logits_gpu(q: Array, k: Array, *, last=None, keep_first: int = 0, keep_from=None,
                         block_n: int = BLOCK_N, interpret: bool = False) -> Array:
    """`reference.predicted_logits_reference` by the kernel (module docstring)."""
    check_args(q, k)
    check_bounds(q, last, keep_first, keep_from)
    reason = unsupported_reason(q)
    if reason is not None:
        raise ValueError(reason)
    *lead, Hk, G, T, d = q.shape
    N = k.shape[-2]
    R, GT = math.prod(lead) * Hk, G * T
    GTp = pl.next_power_of_2(GT)  # block shapes of powers of two; the padding rows' logits are dropped
    qr = jnp.pad(q.reshape(R, GT, d), ((0, 0), (0, GTp - GT), (0, 0)))
    kr = k.reshape(R, N, d)
    args = [qr, kr]
    row_spec = pl.BlockSpec((None, GTp), lambda r, j: (r, 0))
    bounded = last is not None
    if bounded:  # per query row: its last visible key and the first key of its kept window (N: none)
        for a in (last, N if keep_from is None else keep_from):
            a = jnp.broadcast_to(jnp.asarray(a, jnp.int32), q.shape[:-1]).reshape(R, GT)
            args.append(jnp.pad(a, ((0, 0), (0, GTp - GT))))
    out = pl.pallas_call(
        functools.partial(_kernel, n=N, rows=GTp, block_n=block_n, scale=math.sqrt(d), bounded=bounded,
                          keep_first=keep_first),
        grid=(R, pl.cdiv(N, block_n)),
        in_specs=[pl.BlockSpec((None, GTp, d), lambda r, j: (r, 0, 0)),
                  pl.BlockSpec((None, N, d), lambda r, j: (r, 0, 0))] + [row_spec] * (len(args) - 2),
        out_specs=pl.BlockSpec((None, GTp, N), lambda r, j: (r, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((R, GTp, N), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="butler_predicted_logits",
    )(*args)
    return out[:, :GT].reshape(*lead, Hk, G, T, N)

"""Pallas GPU (Triton) kernel of `predicted_logits`.

The leading axes and the key heads flatten to R rows of keys [N, d] with their G * T query rows [GT, d]. grid (R,
ceil(N / block_n)): program (r, j) loads keys j * block_n .. of row r once as an f32 [block_n, d] tile and, for
each of its GT query rows (a static loop: T = 1 decoding has GT = G, 1 for TokenButler's per-query-head keys),
writes sum over d of q * k (a masked store past N), scaled by 1 / sqrt(d) after the sum as the reference does (the
rows are padded to a power of two, the padding's logits dropped).
Bytes: the keys once, the output once. Runs in interpret mode on CPU (`interpret=True`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.predicted_logits.reference import check_args

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


def _kernel(q_ref, k_ref, o_ref, *, n: int, rows: int, block_n: int, scale: float):
    j = pl.program_id(1)
    cols = j * block_n + jnp.arange(block_n, dtype=jnp.int32)
    ok = cols < n
    k = plgpu.load(k_ref.at[pl.ds(j * block_n, block_n), :], mask=ok[:, None], other=0.0).astype(jnp.float32)
    for r in range(rows):
        q = q_ref[jnp.int32(r), :].astype(jnp.float32)  # [d]
        s = jnp.sum(k * q[None, :], axis=1)  # [block_n]
        plgpu.store(o_ref.at[jnp.int32(r), pl.ds(j * block_n, block_n)], s / scale, mask=ok)


def predicted_logits_gpu(q: Array, k: Array, *, block_n: int = BLOCK_N, interpret: bool = False) -> Array:
    """`reference.predicted_logits_reference` by the kernel (module docstring)."""
    check_args(q, k)
    reason = unsupported_reason(q)
    if reason is not None:
        raise ValueError(reason)
    *lead, Hk, G, T, d = q.shape
    N = k.shape[-2]
    R, GT = math.prod(lead) * Hk, G * T
    GTp = pl.next_power_of_2(GT)  # block shapes of powers of two; the padding rows' logits are dropped
    qr = jnp.pad(q.reshape(R, GT, d), ((0, 0), (0, GTp - GT), (0, 0)))
    kr = k.reshape(R, N, d)
    out = pl.pallas_call(
        functools.partial(_kernel, n=N, rows=GTp, block_n=block_n, scale=math.sqrt(d)),
        grid=(R, pl.cdiv(N, block_n)),
        in_specs=[pl.BlockSpec((None, GTp, d), lambda r, j: (r, 0, 0)),
                  pl.BlockSpec((None, N, d), lambda r, j: (r, 0, 0))],
        out_specs=pl.BlockSpec((None, GTp, N), lambda r, j: (r, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((R, GTp, N), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="butler_predicted_logits",
    )(qr, kr)
    return out[:, :GT].reshape(*lead, Hk, G, T, N)

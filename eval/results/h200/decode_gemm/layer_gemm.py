"""An experiment, not a library kernel (NOTES.md here: it did not beat cuBLAS with XLA's fusions).

Pallas GPU (Triton) kernel of `layer_gemm`: a decode forward's few rows times one layer of stacked weights, read
in place, with the RMSNorm before and the residual add or SwiGLU after in the same launch.

grid (N_out / block_n, split_k): program (j, s) streams the [K / split_k, block_n] column strip j of w[layer] (for
"swiglu" the strips j of the gate half and of the up half) through `num_stages` pipelined loads of
[block_k, block_n], against the activation rows, which are few (M <= 64) and padded to at least 16 in registers for
the tensor cores by the caller (M a multiple of 16: `models.llama` pads a decode forward's rows once). With a norm,
the program multiplies each [M, block_k] tile by the norm's weight (f32, rounded to x's dtype) before the dot, sums
the rows' squares on the way and scales the f32 result by each row's 1 / rms at the end: rms_norm(x) @ w =
rstd * ((x * g) @ w), the same up to where the bf16 rounding falls (a pre-pass for the rstd, to round x * rstd * g
as `rms_norm` does, cost 6.5 us a layer on the H200; the in-loop scaling cost more). A norm needs split_k = 1.
With split_k > 1 the programs write f32 partials [split_k, M, N] that the wrapper sums (epilogue "none" or
"residual" only).

The layer is a runtime index (i32[1]): inside the model's layer scan the kernel reads the whole stack at the
loop counter, where an XLA slice of the stack would be a copy of the layer's weights.
Runs in interpret mode on CPU (`interpret=True`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from layer_gemm_reference import check_args

Array = jax.Array
F32 = jnp.float32
MAX_ROWS = 64


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tiles of one launch: block_n output columns per program (per half for "swiglu"), block_k rows of w per
    pipelined load, split_k programs along K per column strip; Triton's num_warps and num_stages."""
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


def unsupported_reason(x: Array, w: Array, epilogue: str, config: GemmConfig, has_norm: bool = False) -> str | None:
    M, K = x.shape
    N = w.shape[2] // (2 if epilogue == "swiglu" else 1)
    c = config
    if M % 16 or M > MAX_ROWS:
        return f"{M} rows: the kernel takes a multiple of 16, at most {MAX_ROWS} (pad the rows)"
    if jnp.dtype(x.dtype) != jnp.dtype(w.dtype) or jnp.dtype(x.dtype) not in map(jnp.dtype, (jnp.bfloat16,
                                                                                              jnp.float16, F32)):
        return f"x {x.dtype}, w {w.dtype}: the kernel takes one of bf16, f16, f32 for both"
    for name, v in (("block_n", c.block_n), ("block_k", c.block_k), ("split_k", c.split_k)):
        if v < 1 or v & (v - 1):
            return f"{name}={v}: expected a power of two"
    if c.block_n < 16 or c.block_k < 16:
        return f"block_n={c.block_n}, block_k={c.block_k}: expected >= 16 each"
    if N % c.block_n:
        return f"N={N} output columns: expected a multiple of block_n={c.block_n}"
    if K % (c.block_k * c.split_k):
        return f"K={K}: expected a multiple of block_k * split_k = {c.block_k * c.split_k}"
    if c.split_k > 1 and epilogue == "swiglu":
        return "split_k > 1 with the SwiGLU epilogue (it is not linear in the partials)"
    if c.split_k > 1 and has_norm:
        return "split_k > 1 with a norm (each program needs its rows' squares over all of K)"
    return None


def _kernel(lay_ref, x_ref, *refs, M: int, K: int, BK: int, steps: int, L: int, has_norm: bool,
            epilogue: str, eps: float, partial: bool):
    refs = list(refs)
    w_refs = [refs.pop(0)] + ([refs.pop(0)] if epilogue == "swiglu" else [])
    norm_ref = refs.pop(0) if has_norm else None
    res_ref = refs.pop(0) if epilogue == "residual" and not partial else None
    (o_ref,) = refs
    s = pl.program_id(1)
    layer = jnp.clip(lay_ref[0], 0, L - 1)
    BN = w_refs[0].shape[-1]

    def body(t, carry):
        accs, sq = carry
        k0 = pl.multiple_of((s * steps + t) * BK, BK)
        h = x_ref[:, pl.ds(k0, BK)]
        if has_norm:  # rms_norm(x) @ w = rstd * ((x * g) @ w): the squares kept per lane, summed after the loop
            xf = h.astype(F32)
            sq = sq + xf * xf
            h = (xf * norm_ref[pl.ds(k0, BK)].astype(F32)[None, :]).astype(x_ref.dtype)
        return tuple(a + jnp.dot(h, w[layer, pl.ds(k0, BK), :], preferred_element_type=F32)
                     for a, w in zip(accs, w_refs)), sq

    init = (tuple(jnp.zeros((M, BN), F32) for _ in w_refs), jnp.zeros((M, BK) if has_norm else (M, 1), F32))
    accs, sq = jax.lax.fori_loop(0, steps, body, init)
    if has_norm:
        rstd = jax.lax.rsqrt(jnp.sum(sq, axis=1) / K + eps)[:, None]
        accs = tuple(a * rstd for a in accs)
    if partial:
        out = accs[0]
    elif epilogue == "swiglu":
        gate, up = (a.astype(x_ref.dtype).astype(F32) for a in accs)
        out = gate * jax.nn.sigmoid(gate) * up
    else:
        out = accs[0].astype(x_ref.dtype)
        if epilogue == "residual":
            out = res_ref[...].astype(F32) + out.astype(F32)
    o_ref[...] = out.astype(o_ref.dtype)


def layer_gemm_gpu(x: Array, w: Array, layer, *, norm: Array | None = None, eps: float = 1e-6,
                   epilogue: str = "none", residual: Array | None = None, config: GemmConfig | None = None,
                   interpret: bool = False) -> Array:
    """`reference.layer_gemm_reference` by the kernel (module docstring)."""
    check_args(x, w, norm, epilogue, residual)
    c = config or GemmConfig()
    reason = unsupported_reason(x, w, epilogue, c, norm is not None)
    if reason is not None:
        raise ValueError(reason)
    M, K = x.shape
    L, _, Nw = w.shape
    N = Nw // 2 if epilogue == "swiglu" else Nw
    BN, S = c.block_n, c.split_k
    partial = S > 1
    nb = N // BN
    w_spec = lambda off: pl.BlockSpec((L, K, BN), lambda j, s: (0, 0, j + off))  # noqa: E731
    in_specs = [pl.BlockSpec((1,), lambda j, s: (0,)), pl.BlockSpec((M, K), lambda j, s: (0, 0)), w_spec(0)]
    args = [jnp.asarray(layer, jnp.int32).reshape(1), x, w]
    if epilogue == "swiglu":
        in_specs.append(w_spec(nb))
        args.append(w)
    if norm is not None:
        in_specs.append(pl.BlockSpec((K,), lambda j, s: (0,)))
        args.append(norm)
    if epilogue == "residual" and not partial:
        in_specs.append(pl.BlockSpec((M, BN), lambda j, s: (0, j)))
        args.append(residual)
    if partial:
        out_spec = pl.BlockSpec((None, M, BN), lambda j, s: (s, 0, j))
        out_shape = jax.ShapeDtypeStruct((S, M, N), F32)
    else:
        out_spec = pl.BlockSpec((M, BN), lambda j, s: (0, j))
        out_shape = jax.ShapeDtypeStruct((M, N), residual.dtype if residual is not None else x.dtype)
    out = pl.pallas_call(
        functools.partial(_kernel, M=M, K=K, BK=c.block_k, steps=K // (c.block_k * S), L=L,
                          has_norm=norm is not None, epilogue=epilogue, eps=eps, partial=partial),
        grid=(nb, S), in_specs=in_specs, out_specs=out_spec, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=c.num_warps, num_stages=c.num_stages),
        interpret=interpret, name=f"layer_gemm_{epilogue}",
    )(*args)
    if not partial:
        return out
    y = jnp.sum(out, axis=0).astype(x.dtype)
    return y if residual is None else residual + y.astype(residual.dtype)

"""The jnp reference of the experiment's `layer_gemm` (layer_gemm.py beside it): one layer's weight GEMM of a decode forward, with the RMSNorm before it and
the residual add or the SwiGLU after it that `models.llama` computes as XLA ops around a cuBLAS GEMM.

layer_gemm(x, w, layer, *, norm=None, eps=1e-6, epilogue="none", residual=None):
  x: [M, K] activation rows; w: [L, K, N] the stacked weights of every layer (read at `layer`, i32[]);
  norm: [K] an RMSNorm weight, or None: the GEMM's input is rms_norm(x, norm, eps) (f32, rounded to x's dtype);
  epilogue: "none" -> y [M, N] = input @ w[layer] in x's dtype (f32 accumulation);
            "residual" -> residual + y (residual [M, N], in its dtype);
            "swiglu" -> silu(gate) * up [M, N / 2], gate and up the two halves of y, each rounded to x's dtype
            first (the fused gate/up weight of `models.params.fuse_projections`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_write.reference import rms_norm

Array = jax.Array
F32 = jnp.float32
EPILOGUES = ("none", "residual", "swiglu")


def check_args(x: Array, w: Array, norm: Array | None, epilogue: str, residual: Array | None) -> None:
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {x.shape}, w {w.shape}: expected x [M, K] and stacked weights w [L, K, N]")
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue={epilogue!r}: expected one of {EPILOGUES}")
    M, N = x.shape[0], w.shape[2]
    if norm is not None and norm.shape != (x.shape[1],):
        raise ValueError(f"norm {norm.shape}: expected [{x.shape[1]}], one weight per input feature")
    if (epilogue == "residual") != (residual is not None):
        raise ValueError("residual: expected an array exactly when epilogue='residual'")
    if residual is not None and residual.shape != (M, N):
        raise ValueError(f"residual {residual.shape}: expected [{M}, {N}], the GEMM's output shape")
    if epilogue == "swiglu" and N % 2:
        raise ValueError(f"epilogue='swiglu' needs an even N (gate then up), got w {w.shape}")


def swiglu(gate: Array, up: Array, dtype) -> Array:
    return (jax.nn.silu(gate.astype(F32)) * up.astype(F32)).astype(dtype)


def layer_gemm_reference(x: Array, w: Array, layer, *, norm: Array | None = None, eps: float = 1e-6,
                         epilogue: str = "none", residual: Array | None = None) -> Array:
    check_args(x, w, norm, epilogue, residual)
    h = x if norm is None else rms_norm(x, norm, eps)
    wl = jax.lax.dynamic_index_in_dim(w, jnp.asarray(layer, jnp.int32), keepdims=False)
    y = jnp.dot(h, wl, preferred_element_type=x.dtype)
    if epilogue == "residual":
        return residual + y.astype(residual.dtype)
    if epilogue == "swiglu":
        gate, up = jnp.split(y, 2, axis=-1)
        return swiglu(gate, up, x.dtype)
    return y

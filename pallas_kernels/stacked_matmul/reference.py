"""Plain-jnp specification of a skinny matmul against one layer of stacked weights.

  stacked_matmul_reference(x: [M, K], w_all: [L, K, N], layer: i32[]) -> [M, N] in x.dtype

equals `x @ w_all[layer]` with f32 accumulation, rounded once to x.dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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

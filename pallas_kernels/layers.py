"""The `layer` argument of the ops that read (or write) one layer of a stacked [L, ...] array in place.

Every such op takes `layer` as an integer scalar in [-L, L), a negative one counting from the end as jnp indexing
does: one whose value is known at the call (a Python int or a concrete array) is checked (`check_layer`); a traced
one cannot be, and reads the layer `layer_index` gives, in every op and every implementation alike (a negative
value wraps once, then the value is clamped).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def check_layer(layer, num_layers: int) -> None:
    """Raises ValueError unless `layer` is an integer scalar, with a value in [-num_layers, num_layers) when it is
    known."""
    arr = jnp.asarray(layer) if not isinstance(layer, jax.core.Tracer) else layer
    if arr.ndim != 0 or not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(f"layer has shape {tuple(arr.shape)} and dtype {arr.dtype}: expected an integer scalar in "
                         f"[-L, L), L={num_layers}")
    if not isinstance(layer, jax.core.Tracer):
        value = int(np.asarray(layer))
        if not -num_layers <= value < num_layers:
            raise ValueError(f"layer={value}: expected a layer in [-L, L) of the L={num_layers} stacked layers")


def layer_index(layer: Array, num_layers: int) -> Array:
    """i32[]: the layer `x_all[layer]` reads (jnp semantics for a traced index: wrap negatives, then clamp)."""
    layer = jnp.asarray(layer).astype(jnp.int32)
    layer = jnp.where(layer < 0, layer + num_layers, layer)
    return jnp.clip(layer, 0, num_layers - 1)


def select_layer(x_all: Array, layer: Array) -> Array:
    """x_all[layer] for x_all: [L, ...] (a dynamic slice: XLA copies it when a custom call consumes it, which the
    in-place kernels avoid)."""
    return jax.lax.dynamic_index_in_dim(x_all, layer_index(layer, x_all.shape[0]), 0, keepdims=False)

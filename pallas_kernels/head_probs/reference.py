"""Plain-jnp specification of the decode queries' post-softmax weights over one layer of the stacked KV cache.

  head_probs_stacked_reference(q: [B, T, Hq, D], k_all: [L, B, Hkv, N, D], layer: i32[], lengths: i32[B],
                               lse: f32[B, T, Hq]) -> f32[B, Hq, N]

p[b, h, n] = sum over the T queries t of exp(q[b, t, h] . k_all[layer, b, h // G, n] * scale - lse[b, t, h]) for
the keys n the query sees (n <= lengths[b] - T + t: causal among the T new tokens, as the decode), 0 for every
other key (n >= lengths[b] included). With lse the log-sum-exp of each query row over its visible keys
(`pallas_kernels.dense_decode.dense_decode_stacked(..., return_lse=True)` returns it next to the attention
output), each query's weights are its softmax row, and p is the softmax rows summed over the T queries: STS's
draft record (`jsparse.methods.sts.StsDraft.decode`). `layer` follows jnp indexing of a traced index (negatives
count from the end, then clamp), as `pallas_kernels.dense_decode`. The formula is
`pallas_kernels.dense_decode.reference.decode_probs_reference` (shared with the dense decode's `return_probs`);
this module adds the argument checks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.dense_decode.reference import check_args as check_decode_args
from pallas_kernels.dense_decode.reference import decode_probs_reference

Array = jax.Array


def check_args(q: Array, k_all: Array, layer: Array, lengths: Array, lse: Array) -> None:
    """Validates shapes and dtypes (at trace time); raises ValueError naming the bad value."""
    check_decode_args(q, k_all, k_all, layer, lengths)  # q, the stacked cache, layer and lengths as the decode's
    B, T, Hq, _ = q.shape
    if tuple(lse.shape) != (B, T, Hq) or not jnp.issubdtype(lse.dtype, jnp.floating):
        raise ValueError(f"lse has shape {tuple(lse.shape)} and dtype {lse.dtype}: expected f32[B={B}, T={T}, "
                         f"Hq={Hq}] (the decode's log-sum-exp per query row)")


@functools.partial(jax.jit, static_argnames=("scale",))
def head_probs_stacked_reference(q: Array, k_all: Array, layer: Array, lengths: Array, lse: Array, *,
                                 scale: float | None = None) -> Array:
    """Post-softmax weights of the T newest queries over layer `layer` of a stacked cache, summed over T.

    Args:
      q: [B, T, Hq, D] (bf16/f16/f32) queries at positions lengths - T .. lengths - 1.
      k_all: [L, B, Hkv, N, D] stacked head-major key cache.
      layer: i32[] layer to read.
      lengths: i32[B] valid tokens per row.
      lse: f32[B, T, Hq] log-sum-exp of each query row's scaled visible logits.
      scale: softmax scale (None: 1/sqrt(D)).

    Returns:
      f32[B, Hq, N] (query head h reads KV head h // G).
    """
    check_args(q, k_all, layer, lengths, lse)
    return decode_probs_reference(q, k_all, layer, lengths, lse, scale=scale)

"""Plain-jnp reference of top-k selection: the specification every implementation matches.

  topk_select_reference(scores: f32[..., N], k: i32[...] or int, K) -> int32[..., min(K, N)]

Semantics (those of `jsparse.selection.topk_indices`, the index contract's producer):
  * Row by row, rank the scores by value, largest first, in `lax.top_k`'s order (IEEE total order:
    +NaN > +inf > ... > +0.0 > -0.0 > ... > -inf > -NaN), ties broken by the lower position.
  * Keep the first kk = clip(k, 0, min(K, N)) of that ranking, drop those whose score is not > -inf
    (-inf and NaN picks), and write the kept positions ascending, then -1 padding up to width min(K, N).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.topk_select.common import check_args

Array = jax.Array


@functools.partial(jax.jit, static_argnames=("K",))
def topk_select_reference(scores: Array, k, K: int) -> Array:
    """Top-k positions per row by `lax.top_k` and a sort.

    Args:
      scores: f32[..., N] (positions that may not be chosen hold -inf).
      k: int or int array broadcastable to scores.shape[:-1]: positions to keep per row.
      K: static output width.

    Returns:
      int32[..., min(K, N)]: kept positions ascending, then -1.
    """
    lead, N, Kp = check_args(scores, k, K)
    kk = jnp.clip(jnp.broadcast_to(jnp.asarray(k, jnp.int32), lead), 0, Kp)
    vals, idx = jax.lax.top_k(scores, Kp)
    rank = jnp.arange(Kp, dtype=jnp.int32)
    keep = (rank < kk[..., None]) & (vals > -jnp.inf)
    big = jnp.iinfo(jnp.int32).max
    idx = jnp.sort(jnp.where(keep, idx, big), axis=-1)
    return jnp.where(idx == big, -1, idx).astype(jnp.int32)

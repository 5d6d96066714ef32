"""StreamingLLM: attention sinks plus a recent window, the same budget as the top-k methods."""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from jsparse import selection as sel
from jsparse.methods.base import register
from jsparse.methods.common import TokenBudget, attend_selected, kwargs_for, sparse_prefill


@register("streaming")
@struct.dataclass
class Streaming(TokenBudget):
    """Keeps the first `sink` tokens and the most recent k - sink tokens (k from the budget rule).

    All layers are sparse (dense_layers=0). In prefill the window is the k - sink keys before each query tile
    (the kernel adds the diagonal tile)."""

    sink: int = struct.field(pytree_node=False, default=4)
    dense_layers: int = struct.field(pytree_node=False, default=0)

    def __post_init__(self):
        super().__post_init__()
        sel.check_positive_int("sink", self.sink, 0)
        if self.sink >= max(self.min_tokens, 1):
            raise ValueError(f"sink={self.sink}: expected fewer sink tokens than min_tokens={self.min_tokens}")

    @classmethod
    def build(cls, **options):
        return cls(**kwargs_for(cls, options))

    def sparse_decode(self, ctx, q, cache, state):
        T, N = q.shape[1], cache.k.shape[2]
        pos = sel.decode_positions(ctx.lengths, T)  # [B, T]
        k_dyn = sel.budget_tokens(self.budget, pos + 1, self.min_tokens)
        idx = sink_window(pos + 1, k_dyn, self.sink, self.k_static(N))  # [B, T, K]
        idx = jnp.broadcast_to(idx[:, None], (q.shape[0], cache.k.shape[1]) + idx.shape[1:])
        return attend_selected(q, cache, idx, ctx.lengths), state

    def sparse_prefill(self, ctx, q, k, v, state):
        B, T = q.shape[:2]
        starts = sel.tile_starts(T, self.tile)
        idx = sink_window(starts, self.tile_budget(T), self.sink, self.k_static(T))  # [nT, K]
        idx = jnp.broadcast_to(idx, (B, k.shape[2]) + idx.shape)
        return sparse_prefill(q, k, v, idx, ctx.lengths, tile=self.tile), state


def sink_window(n_visible, k_dyn, sink: int, K: int):
    """Sink + recent-window positions among keys 0..n_visible-1: int32[..., K] ascending, -1 padded."""
    j = jnp.arange(K, dtype=jnp.int32)
    n = n_visible[..., None]
    k = k_dyn[..., None]
    start = n - (k - sink)  # first window position
    window = start + (j - sink)
    idx = jnp.where(j < sink, j, window)
    idx = jnp.where(start <= sink, j, idx)  # window reaches the sinks: the first k keys
    return jnp.where((j < k) & (idx < n), idx, -1).astype(jnp.int32)

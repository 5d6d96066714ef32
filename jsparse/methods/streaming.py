"""StreamingLLM: attention sinks plus a recent window, the same budget as the top-k methods."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from jsparse import selection as sel
from jsparse.methods.base import register
from jsparse.methods.common import TokenBudget, attend_selected, kwargs_for, sparse_prefill


@struct.dataclass
class StreamingState:
    """One decode forward's selection, the same in every layer: i32[B, Hkv, T, K] (`Streaming.start_rows`)."""

    indices: Optional[jax.Array] = None


@register("streaming")
@struct.dataclass
class Streaming(TokenBudget):
    """Keeps the first `sink` tokens and the most recent k - sink tokens (k from the budget rule).

    All layers are sparse (dense_layers=0). In prefill the window is the k - sink keys before each query tile
    (the kernel adds the diagonal tile). In decode the keys depend only on the positions, so `start_rows` builds
    them once per forward (XLA built them again in every layer of the scan: one launch each) and `finish` drops
    them; the state between forwards stays None."""

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

    def decode_indices(self, lengths, T: int, Hkv: int, N: int):
        """i32[B, Hkv, T, K]: every KV head's keys for the T new tokens (lengths: i32[B] after the write)."""
        pos = sel.decode_positions(lengths, T)  # [B, T]
        k_dyn = sel.budget_tokens(self.budget, pos + 1, self.min_tokens)
        idx = sink_window(pos + 1, k_dyn, self.sink, self.k_static(N))  # [B, T, K]
        return jnp.broadcast_to(idx[:, None], (idx.shape[0], Hkv) + idx.shape[1:])

    def start_rows(self, cfg, state, phase, lengths, q_len, kv_len):
        if phase != "decode" or self.dense_layers >= cfg.num_layers:
            return state
        return StreamingState(indices=self.decode_indices(lengths, q_len, cfg.num_kv_heads, kv_len))

    def finish(self, state, phase):
        return None if isinstance(state, StreamingState) else state

    def sparse_decode(self, ctx, q, cache, state):
        T, N = q.shape[1], cache.k.shape[2]
        if isinstance(state, StreamingState):
            idx = state.indices
        else:  # called outside the model's scan (no start_rows)
            idx = self.decode_indices(ctx.lengths, T, cache.k.shape[1], N)
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

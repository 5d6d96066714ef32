"""Oracle top-k: exact post-softmax scores pooled over the GQA group; the accuracy ceiling at a budget."""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from jsparse import selection as sel
from jsparse.methods.base import register
from jsparse.methods.common import TokenBudget, kwargs_for, sparse_prefill, topk_decode
from pallas_kernels.anchor_attention.common import force_diagonal


@register("oracle")
@struct.dataclass
class Oracle(TokenBudget):
    """Every sparse layer keeps, per KV head, the k keys with the largest exact attention mass (summed over the
    GQA group; in prefill also over the query tile). Layer 0 is dense, as in Kascade, so the two compare fairly.
    In both phases the query's causal diagonal tile is kept (prefill: added by the kernel; decode: forced into
    the k chosen keys, its most recent keys first when k is smaller than the tile). Decode scans the dense and
    the sparse layers apart (`TokenBudget.segments`)."""

    @classmethod
    def build(cls, **options):
        return cls(**kwargs_for(cls, options))

    def sparse_decode(self, ctx, q, cache, state):
        """The keys of `select_decode` and the attention over them in one fused op (`common.topk_decode`, as
        Kascade's anchors): on a GPU the exact scores are computed from the stacked cache in place, never as an
        f32 [B, Hq, T, N] array."""
        out, _ = topk_decode(q, cache, ctx.lengths, budget=self.budget, min_tokens=self.min_tokens,
                             K=self.k_static(cache.k.shape[2]), tile=self.tile)
        return out, state

    def sparse_prefill(self, ctx, q, k, v, state):
        idx = select_prefill(q, k, self.tile, self.tile_budget(q.shape[1]), self.k_static(q.shape[1]), ctx.lengths)
        return sparse_prefill(q, k, v, idx, ctx.lengths, tile=self.tile), state


def select_decode(q, k_cache, positions, budget, min_tokens, K, tile: int = 0):
    """Top-k per row by exact pooled scores: int32[B, Hkv, T, K] (rows at positions: i32[B, T]).

    With `tile` > 0 the query's own (causal) diagonal tile, keys floor(pos / tile) * tile .. pos, is kept first,
    inside the budget: decode keeps what the prefill kernel adds to every query tile (a budget smaller than the
    tile keeps its most recent keys, the query's own first: `force_diagonal`).
    """
    probs = sel.pooled_probs(q, k_cache, positions)
    key = jnp.arange(k_cache.shape[2])[None, None, :]
    visible = key <= positions[:, :, None]
    scores = jnp.where(visible[:, None], probs, sel.NEG_INF)
    if tile:
        scores = force_diagonal(scores, positions, tile)
    k_dyn = sel.budget_tokens(budget, positions + 1, min_tokens)[:, None]  # [B, 1, T]
    return sel.topk_indices(scores, k_dyn, K, per_shard=True)


def select_prefill(q, k, tile, tile_budget, K, lengths=None):
    """Exact top-k per query tile among the keys before it: int32[B, Hkv, nT, K].

    The scores (`selection.prefill_tile_probs`; with lengths i32[B], the rows past a row's length add nothing) come
    a chunk of query rows at a time inside scans (`selection.causal_prob_fold`): the memory is the f32[B, Hkv, nT,
    T] tile scores and one chunk's weights, never the [T, T] map."""
    scores = sel.before_tile_scores(sel.prefill_tile_probs(q, k, tile, lengths), tile)
    return sel.topk_indices(scores, tile_budget[None, None, :], K, per_shard=True)

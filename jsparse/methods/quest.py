"""Quest: query-aware page selection from per-page key min/max (Tang et al., 2024).

Keys are grouped in pages of `page_size` (16). A page's score for query head h is the upper bound
`sum_d max(q_d * kmax_d, q_d * kmin_d)` (= sum_d |q_d| * max over the page of sign(q_d) k_d); each query head
keeps ceil(k / page_size) pages of the token budget's k keys, the page holding the query itself always among
them (as the paper counts pages, and EvoSparse its blocks: that page is partly filled, so a row attends between
k - page_size + 1 and k + page_size - 1 keys; `achieved_sparsity` counts them). Layers 0-1 are dense, as in
the paper. Quest selects per *query* head, so it attends through a per-head mask rather than the KV-head index
contract; prefill is dense (Quest is a decode method).

Sliding-window models: on a windowed layer (window W) only the pages that overlap the query's window
(positions p - W < j <= p) compete, the budget counts the min(p + 1, W) keys the query may see (from the start of
the window's first page), and the chosen pages are cut to the window, so the selection is a subset of the window
and the whole budget is the whole window; prefill and the dense layers attend
within the window too.
One decode token without a window (`gathered`, the default on a GPU) takes each query head's pages as an index
row (`page_indices`, top-k by `topk_select`) and attends through the gathered decode kernel in pages of
`page_size`, one launch over the query heads (`sparse_decode_query_heads`: each query head's program reads its
pages in place from its KV head's stacked cache); the same pages and the same softmax as the
mask (`page_mask`), which T > 1 tokens, windowed layers and the CPU by default use. With the method's state
(`init_state`: `QuestState`, as the paper keeps them) it scores the pages from the state's bounds, which prefill
writes and every decode forward recomputes from the cache for the pages its new tokens fall in; called with no
state (None) it computes them from the whole cache. The mask path always computes them from the cache.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jsparse import selection as sel
from jsparse.budget_split import attended_fraction
from jsparse.methods.base import register
from jsparse.methods.common import (TokenBudget, attend_per_query_head, kwargs_for, masked_attention_reference,
                                    prefill_dense, refuse_unused)
from pallas_kernels.page_scores import page_scores as page_scores_op
from pallas_kernels.sharding import dims, per_shard
from pallas_kernels.topk_select import topk_select


@struct.dataclass
class QuestState:
    """Page bounds of every layer's cache, f32[L, B, Hkv, P, D] each (P = max_len / page_size): the elementwise
    min and max of each page's keys below the row's length (0 for a page holding none). Prefill writes a layer's
    pages; each decode forward recomputes, from the cache, the pages its new tokens fall in (so a page a
    rejected speculative round wrote is recomputed by the next forward that writes into it, before anything reads
    it). Only the gathered decode reads them; the mask path computes the bounds from the cache."""

    kmin: jax.Array
    kmax: jax.Array


@register("quest")
@struct.dataclass
class Quest(TokenBudget):
    supports_window = True  # honours ctx.window (models.attention)
    dense_prefill = True  # a decode method: its prefill attends to every key (the eval's sparsity says so)

    page_size: int = struct.field(pytree_node=False, default=16)
    dense_layers: int = struct.field(pytree_node=False, default=2)
    # One decode token without a window through the gathered kernel (module docstring); None: on a GPU.
    gathered: Optional[bool] = struct.field(pytree_node=False, default=None)

    def __post_init__(self):
        super().__post_init__()
        sel.check_positive_int("page_size", self.page_size)

    @classmethod
    def build(cls, **options):
        refuse_unused("quest", options, ("tile",), "its prefill is dense, with no query tiles")
        return cls(**kwargs_for(cls, options))

    def achieved_sparsity(self, cfg, positions) -> float:
        """Fraction of visible keys skipped, averaged over layers and the given query positions: the keys of the
        pages a row attends (whole pages, its own partial; the token rule's k differs by up to a page)."""
        sparse_layers = max(cfg.num_layers - self.dense_layers, 0)
        attended = attended_fraction(positions, self.budget, self.min_tokens, self.page_size)
        return float(sparse_layers / cfg.num_layers * np.mean(1.0 - attended))

    def init_state(self, cfg, batch, max_len):
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, -(-max_len // self.page_size), cfg.head_dim)
        # Two buffers, not one array twice: a jitted step donates its state (one buffer cannot be donated twice).
        return QuestState(kmin=jnp.zeros(shape, jnp.float32), kmax=jnp.zeros(shape, jnp.float32))

    def prefill(self, ctx, q, k, v, state):
        """Dense (Quest is a decode method), and the layer's page bounds written into the state."""
        out = prefill_dense(ctx, q, k, v)
        if isinstance(state, QuestState):
            stored = k if ctx.kv_dtype is None else stored_as(k, ctx.kv_dtype)  # the keys as the cache holds them
            kmin, kmax = finite_bounds(*page_bounds(jnp.swapaxes(stored, 1, 2), ctx.lengths, self.page_size))
            P = state.kmin.shape[3]
            if kmin.shape[2] > P:
                raise ValueError(f"a prefill of {k.shape[1]} tokens fills {kmin.shape[2]} pages of {self.page_size}; "
                                 f"the Quest state holds {P}: init_state(max_len) must be the cache capacity")
            state = QuestState(*(jax.lax.dynamic_update_slice(a, b[None].astype(a.dtype), (ctx.layer, 0, 0, 0, 0))
                                 for a, b in ((state.kmin, kmin), (state.kmax, kmax))))
        return out, state

    def is_gathered(self, N: int) -> bool:
        """Whether a one-token decode over a cache of N keys runs gathered (`gathered`; None: on a GPU, when
        page_size divides N)."""
        if self.gathered is None:
            return jax.default_backend() == "gpu" and N % self.page_size == 0
        if self.gathered and N % self.page_size:
            raise ValueError(f"quest gathered=True: the cache capacity N={N} is not a multiple of page_size="
                             f"{self.page_size} (the gathered kernel reads whole pages)")
        return bool(self.gathered)

    def sparse_decode(self, ctx, q, cache, state):
        T, N = q.shape[1], cache.k.shape[2]
        pos = sel.decode_positions(ctx.lengths, T)
        window = None if getattr(ctx, "window_size", None) is None else ctx.window
        has_state = isinstance(state, QuestState)
        if has_state:
            if state.kmin.shape[3] != -(-N // self.page_size):
                raise ValueError(f"Quest state of {state.kmin.shape[3]} pages for a cache of {N} keys in pages of "
                                 f"{self.page_size}: init_state(max_len) must be the cache capacity")
            state = update_bounds(state, ctx.layer, cache.k, ctx.lengths, T, self.page_size)
        if T == 1 and window is None and self.is_gathered(N):
            bounds = (state.kmin, state.kmax, ctx.layer) if has_state else None  # read in place
            return self._gathered_decode(q, cache, pos, ctx.lengths, bounds), state
        mask = page_mask(q, cache.k, pos, self.budget, self.min_tokens, self.page_size, window=window)
        return masked_attention_reference(q, cache.k, cache.v, mask), state

    def _gathered_decode(self, q, cache, pos, lengths, bounds=None):
        """q: [B, 1, Hq, D] -> [B, 1, Hq, D]: each query head over its pages (`page_indices`), one gathered launch;
        bounds: (kmin, kmax, layer), the state's stacked bounds and this layer, or None (from the cache)."""
        N = cache.k.shape[2]
        pages = page_indices(q, cache.k, pos, self.budget, self.min_tokens, self.page_size, self.k_static(N),
                             bounds=bounds)  # [B, Hq, 1, Kp]
        return attend_per_query_head(q, cache, pages, lengths, block_size=self.page_size)


def page_bounds(k_cache, lengths_max, page_size: int):
    """Per-page elementwise min and max of the keys: f32[B, Hkv, P, D] each (keys >= length excluded)."""
    B, Hkv, N, D = k_cache.shape
    P = -(-N // page_size)
    kf = jnp.pad(k_cache.astype(jnp.float32), ((0, 0), (0, 0), (0, P * page_size - N), (0, 0)))
    valid = (jnp.arange(P * page_size) < lengths_max[:, None]).reshape(B, 1, P, page_size, 1)
    return masked_minmax(kf.reshape(B, Hkv, P, page_size, D), valid)


def masked_minmax(keys, valid):
    """keys f32[..., pages, page_size, D], valid bool (broadcastable) -> (min, max) over each page's valid keys,
    f32[..., pages, D] (+inf / -inf for a page with none)."""
    return jnp.where(valid, keys, jnp.inf).min(axis=-2), jnp.where(valid, keys, -jnp.inf).max(axis=-2)


def stored_as(x, dtype):
    """x rounded to `dtype`'s precision, as f32: what a cache of that dtype holds, also where XLA would keep a
    bf16 value at f32 precision (`reduce_precision` is not elided)."""
    f = jnp.finfo(dtype)
    return jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=f.nexp, mantissa_bits=f.nmant)


def finite_bounds(kmin, kmax):
    """Bounds of pages holding no key (+-inf) as 0, as the scores take them."""
    return (jnp.where(jnp.isfinite(kmin), kmin, 0.0), jnp.where(jnp.isfinite(kmax), kmax, 0.0))


def update_bounds(state: QuestState, layer, k_cache, lengths, T: int, page_size: int) -> QuestState:
    """The bounds of the pages holding positions lengths - T .. lengths - 1 (this forward's new tokens, already in
    the cache), recomputed from the cache's keys below `lengths`: k_cache [B, Hkv, N, D] the layer's; layer: i32[]."""
    B, Hkv, N, D = k_cache.shape
    P = state.kmin.shape[3]
    n = (T + page_size - 2) // page_size + 1  # pages T consecutive positions can touch
    pages = jnp.minimum((lengths - T)[:, None] // page_size + jnp.arange(n, dtype=jnp.int32), P - 1)  # [B, n]
    keys = pages[:, :, None] * page_size + jnp.arange(page_size, dtype=jnp.int32)  # [B, n, ps]
    valid = keys < jnp.minimum(lengths, N)[:, None, None]
    rows = jnp.take_along_axis(k_cache, jnp.minimum(keys, N - 1).reshape(B, 1, -1, 1), axis=2)
    rows = rows.astype(jnp.float32).reshape(B, Hkv, n, page_size, D)
    kmin, kmax = finite_bounds(*masked_minmax(rows, valid[:, None, :, :, None]))
    b = jnp.arange(B)[:, None]
    # x[layer, b, :, page] is [B, n, Hkv, D] (the advanced indices first); a clipped page repeats the same value.
    return QuestState(kmin=state.kmin.at[layer, b, :, pages].set(jnp.swapaxes(kmin, 1, 2)),
                      kmax=state.kmax.at[layer, b, :, pages].set(jnp.swapaxes(kmax, 1, 2)))


def page_scores(q, k_cache, positions, budget, min_tokens, page_size, window=None, bounds=None):
    """Each query head's page scores and page count: (score f32[B, Hkv, G, T, P] (the upper bound; +inf on the
    query's own page, -inf on pages it may not see), n_pages i32[B, T], first i32[B, T] the first key it may see).

    Args: as `page_mask`; bounds: (kmin, kmax, layer): the stacked bounds f32[L, B, Hkv, P, D] of every layer's
    pages, finite (`QuestState`'s), and the layer to read (i32[]), or None (computed from k_cache).
    """
    B, T, Hq, D = q.shape
    Hkv, N = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    P = -(-N // page_size)
    if bounds is None:
        kmin, kmax = finite_bounds(*page_bounds(k_cache, positions.max(axis=1) + 1, page_size))
        bounds = (kmin[None], kmax[None], 0)  # a stack of one layer
    kmin, kmax, layer = bounds
    qr = jnp.transpose(q.astype(jnp.float32).reshape(B, T, Hkv, G, D), (0, 2, 3, 1, 4)).reshape(B, Hkv, G * T, D)
    # sum_d max(q_d kmax_d, q_d kmin_d) in f32 (`pallas_kernels.page_scores`: on a GPU a kernel reading each page's
    # bounds once, in place; the same arithmetic for a stack of layers or one).
    score = page_scores_op(qr, kmin, kmax, layer).reshape(B, Hkv, G, T, P)  # [B, Hkv, G, T, P]
    page = jnp.arange(P)[None, None, :]
    own = positions[:, :, None] // page_size  # [B, T, 1]
    n_visible = positions + 1  # [B, T] keys the query may see
    first = jnp.zeros_like(positions)  # [B, T] first key it may see
    if window is not None:
        window = jnp.asarray(window, jnp.int32)
        first = jnp.where(window > 0, jnp.maximum(positions - window + 1, 0), 0)
        n_visible = positions + 1 - first
    visible_page = (page <= own) & (page >= (first // page_size)[:, :, None])
    score = jnp.where(visible_page[:, None, None], score, -jnp.inf)
    score = jnp.where((page == own)[:, None, None], jnp.inf, score)  # the query's own page always
    k_tok = sel.budget_tokens(budget, n_visible, min_tokens)
    # Pages for k_tok keys counted from the first visible page's start (a window's first page is partly before
    # it): the whole budget then covers the whole window.
    n_pages = -(-(k_tok + first % page_size) // page_size)  # [B, T]
    return score, n_pages, first


def page_mask(q, k_cache, positions, budget, min_tokens, page_size, window=None):
    """bool[B, Hq, T, N]: the keys of each query head's chosen pages that are visible to it.

    Args:
      q: [B, T, Hq, D]; k_cache: [B, Hkv, N, D]; positions: i32[B, T] the queries' positions.
      window: None or i32[] sliding window (0 = full attention): a query at p sees keys p - window < j <= p only;
        pages wholly before its window do not compete and the budget counts min(p + 1, window) keys.
    """
    B, T, Hq, _ = q.shape
    N = k_cache.shape[2]
    score, n_pages, first = page_scores(q, k_cache, positions, budget, min_tokens, page_size, window)
    order = jnp.argsort(-score, axis=-1)
    rank = jnp.argsort(order, axis=-1)
    chosen = (rank < n_pages[:, None, None, :, None]) & jnp.isfinite(score) | (score == jnp.inf)
    tok_mask = jnp.repeat(chosen, page_size, axis=-1)[..., :N]  # [B, Hkv, G, T, N]
    keys = jnp.arange(N)[None, None, :]
    visible = (keys <= positions[:, :, None]) & (keys >= first[:, :, None])
    tok_mask = tok_mask & visible[:, None, None]
    return tok_mask.reshape(B, Hq, T, N)


def page_indices(q, k_cache, positions, budget, min_tokens, page_size, k_max: int, bounds=None):
    """The pages of `page_mask` without a window, as index rows: i32[B, Hq, T, Kp] ascending, -1 padded, Kp =
    ceil(k_max / page_size) (k_max: the budget's keys at the cache length), by `topk_select` (ties to the lower
    page, as the mask's stable sort). A query's keys past its position in its own page are not attended: the
    gathered kernel masks keys past each query's position, as the mask does. bounds: as `page_scores`."""
    B, T, Hq, _ = q.shape
    score, n_pages, _ = page_scores(q, k_cache, positions, budget, min_tokens, page_size, bounds=bounds)
    P = score.shape[-1]
    score = score.reshape(B, Hq, T, P)
    k_rows = jnp.broadcast_to(n_pages[:, None, :], score.shape[:-1])
    Kp = min(-(-k_max // page_size), P)
    # Per shard under a mesh (rows over data, query heads over model: each device ranks its own heads' pages).
    return per_shard(lambda s, k: topk_select(s, k, Kp), [score, k_rows], [dims(4, 0, 1), dims(3, 0, 1)],
                     dims(4, 0, 1))

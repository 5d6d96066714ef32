"""Pieces shared by the sparse methods: budget fields, the dense-layer switch, attending selected keys."""

from __future__ import annotations

import numpy as np
from flax import struct

import jax
import jax.numpy as jnp
from jsparse import selection as sel
from models import llama
from models.cache import init_cache
from pallas_kernels.anchor_attention import anchor_decode
from pallas_kernels.dense import dense_decode, dense_prefill
from pallas_kernels.dense_decode import dense_decode_stacked
from pallas_kernels.dense_decode import supported as dense_decode_supported
from pallas_kernels.sparse_attention import head_map_row, sparse_decode, sparse_decode_query_heads, sparse_prefill
from pallas_kernels.sharding import active_mesh
from pallas_kernels.sparse_attention.reference import decode_indices_to_mask, masked_attention_reference

# Query rows per index row in prefill must divide the prefill kernel's query block.
KERNEL_QUERY_BLOCK = 128


def check_tile(tile: int) -> int:
    sel.check_positive_int("tile", tile)
    if KERNEL_QUERY_BLOCK % tile:
        raise ValueError(f"tile={tile} does not divide the prefill kernel's query block of {KERNEL_QUERY_BLOCK} "
                         f"rows; expected one of {[t for t in range(1, KERNEL_QUERY_BLOCK + 1)
                                                   if KERNEL_QUERY_BLOCK % t == 0]}")
    return tile


def check_tile_flag(tile) -> int:
    """`check_tile` of a command's --tile flag: its error begins with the flag and the value."""
    try:
        return check_tile(tile)
    except ValueError as e:
        raise ValueError(f"--tile {tile}: {e}") from None


def attend_selected(q, cache, indices, lengths, head_map=None):
    """Attention of q: [B, T, Hq, D] over exactly the selected keys int32[B, Hkv, T, K] of a head-major cache.

    T = 1 (generation) runs the gathered-attention op; T > 1 (several new tokens, or perplexity with decode
    simulated for every row) scatters the indices into a mask, which is cheaper than gathering T * K rows.
    Inside the model's layer scan the cache view carries the stacked cache and the layer index; the gathered
    op then reads the selected rows of that layer in place (no copy of the layer's cache per step).
    head_map: i32[Hkv] or None: KV head h uses the index row of head head_map[h] (read in place on the GPU); with
    the stacked cache view also every layer's map i32[L, Hkv], of which the view's layer's row is used (on the
    GPU the gathered kernel reads it: no XLA op on the map in the layer).
    """
    stacked = getattr(cache, "layer", None) is not None
    if head_map is not None and jnp.ndim(head_map) == 2 and not (stacked and q.shape[1] == 1):
        if not stacked:
            raise ValueError(f"head_map has shape {tuple(jnp.shape(head_map))}: every layer's map needs the stacked "
                             "cache view (a layer index); expected one layer's map [Hkv]")
        head_map = head_map_row(head_map, cache.layer)
    if q.shape[1] == 1:
        if stacked:
            return sparse_decode(q, cache.k_all, cache.v_all, indices, lengths, layer=cache.layer,
                                 head_map=head_map)
        return sparse_decode(q, cache.k, cache.v, indices, lengths, head_map=head_map)
    if head_map is not None:
        indices = jnp.take(indices, head_map, axis=1)
    mask = decode_indices_to_mask(indices, lengths, cache.k.shape[2])
    return masked_attention_reference(q, cache.k, cache.v, mask)


def attend_per_query_head(q, cache, indices, lengths, block_size: int = 1):
    """One decode token's gathered attention where every query head has its own index row (Quest's pages,
    TokenButler's keys): q [B, 1, Hq, D], indices int32[B, Hq, 1, K] (units of block_size tokens, ascending, -1
    padded) -> [B, 1, Hq, D]. `sparse_decode_query_heads` over the stacked cache, read in place: on a GPU one
    launch over the query heads (it was one gathered call per position in the GQA group)."""
    k_all, v_all, layer = stacked_cache(cache)
    return sparse_decode_query_heads(q, k_all, v_all, indices, lengths, layer=layer, block_size=block_size)


def topk_decode(q, cache, lengths, *, budget: float, min_tokens: int, K: int, tile: int, dense: bool = False,
                attend: bool = True):
    """Exact top-k decode: each (row, KV head, token) keeps the K-wide budget's keys of largest post-softmax
    weight pooled over the GQA group, its own diagonal tile of `tile` keys forced first (the keys of
    `jsparse.methods.oracle.select_decode`), and attends to them; dense=True attends to every visible key and
    still returns the selection (Kascade's layer 0); attend=False returns (None, indices).

    One fused op, `pallas_kernels.anchor_attention.anchor_decode`: on a GPU it scores the stacked cache in place
    (the view's `k_all`, `layer`) with no f32 [B, Hq, T, N] weights in memory, selects and gathers. T > 1 sparse
    rows take only its indices and attend through a mask (`attend_selected`), cheaper than gathering T * K rows.
    The oracle's sparse layers and Kascade's anchors.

    q: [B, T, Hq, D]; cache: a head-major layer view; lengths: i32[B] -> (out [B, T, Hq, D],
    indices int32[B, Hkv, T, K] ascending, -1 padded).
    """
    T = q.shape[1]
    if getattr(cache, "layer", None) is not None:
        k, v, layer = cache.k_all, cache.v_all, cache.layer
    else:
        k, v, layer = cache.k, cache.v, None
    gathered = attend and (dense or T == 1)
    out, idx = anchor_decode(q, k, v, lengths, budget=budget, min_tokens=min_tokens, K=K, layer=layer,
                             dense_output=dense, diagonal_tile=tile, with_output=gathered)
    if attend and not gathered:
        out = attend_selected(q, cache, idx, lengths)
    return (out if attend else None), idx


def stacked_cache(cache):
    """(k_all, v_all: [L, B, Hkv, N, D], layer: i32[]) of a cache view. Inside the model's scan the view carries
    the stacked cache: reading it with the layer index (in-place kernels, gathers) never copies the layer's
    whole cache, which handing `cache.k` to a kernel would. A bare view is a stack of one layer."""
    if getattr(cache, "layer", None) is not None:
        return cache.k_all, cache.v_all, cache.layer
    return cache.k[None], cache.v[None], jnp.int32(0)


def attend_dense(q, cache, lengths):
    """Dense decode attention of q: [B, T, Hq, D] over a head-major cache view (`models.attention.LayerKV`).

    On a GPU with 16-bit activations, inside the model's layer scan (the view carries the stacked cache and
    the layer index), a Pallas split-K kernel reads the layer in place: handing cuDNN the slice `cache.k`
    makes XLA copy the layer's whole cache every step. Elsewhere (and for f32) it is `dense_decode` on the
    slice, as before.
    """
    if (getattr(cache, "layer", None) is not None and jax.default_backend() == "gpu"
            and q.dtype in (jnp.bfloat16, jnp.float16) and dense_decode_supported("pallas_gpu", q)):
        return dense_decode_stacked(q, cache.k_all, cache.v_all, cache.layer, lengths, implementation="pallas_gpu")
    return dense_decode(q, cache.k, cache.v, lengths)


def prefill_dense(ctx, q, k, v):
    """Dense causal prefill honouring the layer's sliding window (`ctx.window`, `ctx.window_size`).

    q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] -> [B, T, Hq, D]. Without a binding window this is `dense_prefill`; with
    one on every layer, `local_attention` over the last W keys; with windowed and full layers mixed, the layer's
    window chooses between the two (`lax.cond` on the traced `ctx.window`).
    """
    W = getattr(ctx, "window_size", None)
    if W is None:
        return dense_prefill(q, k, v)
    if ctx.every_layer_windowed:
        return dense_prefill(q, k, v, window=W)
    return jax.lax.cond(ctx.window > 0, lambda: dense_prefill(q, k, v, window=W), lambda: dense_prefill(q, k, v))


def decode_dense(ctx, q, cache):
    """Dense decode over a head-major cache view honouring the layer's sliding window: q: [B, T, Hq, D] ->
    [B, T, Hq, D]. Without a binding window this is `attend_dense`; with one, `dense_decode` masks the positions
    outside each query's window (XLA; the layer's window is data, 0 on full-attention layers)."""
    if getattr(ctx, "window_size", None) is None:
        return attend_dense(q, cache, ctx.lengths)
    return dense_decode(q, cache.k, cache.v, ctx.lengths, window=ctx.window)


@struct.dataclass
class TokenBudget:
    """Fields and the dense-layer switch shared by the top-k style methods.

    budget: kept fraction of the visible keys, in (0, 1]; k = min(max(ceil(budget * n), min_tokens), n).
    dense_layers: the first layers attend densely. tile: query rows per index row in prefill.
    """

    budget: float = struct.field(pytree_node=False, default=0.1)
    min_tokens: int = struct.field(pytree_node=False, default=128)
    dense_layers: int = struct.field(pytree_node=False, default=1)
    tile: int = struct.field(pytree_node=False, default=32)

    def __post_init__(self):
        sel.check_budget(self.budget)
        sel.check_positive_int("min_tokens", self.min_tokens, 0)
        sel.check_positive_int("dense_layers", self.dense_layers, 0)
        check_tile(self.tile)

    def init_state(self, cfg, batch, max_len):
        return None

    def layer_info(self, cfg):
        return None

    def prefill(self, ctx, q, k, v, state):
        return jax.lax.cond(ctx.layer < self.dense_layers,
                            lambda: (prefill_dense(ctx, q, k, v), state),
                            lambda: self.sparse_prefill(ctx, q, k, v, state))

    def segments(self, cfg, phase: str):
        """Decode scans the dense first layers and the sparse ones as separate runs (tags "dense", "sparse";
        `models.attention.segments`), so no layer waits on a `lax.cond`, whose predicate a GPU reads back to the
        host in every layer; prefill is one run."""
        if phase != "decode":
            return None
        L, d = cfg.num_layers, min(self.dense_layers, cfg.num_layers)
        return tuple(run for run in ((0, d, "dense"), (d, L, "sparse")) if run[1] > run[0])

    def decode(self, ctx, q, cache, state):
        segment = getattr(ctx, "segment", None)
        if segment == "dense":
            return decode_dense(ctx, q, cache), state
        if segment == "sparse":
            return self.sparse_decode(ctx, q, cache, state)
        return jax.lax.cond(ctx.layer < self.dense_layers,
                            lambda: (decode_dense(ctx, q, cache), state),
                            lambda: self.sparse_decode(ctx, q, cache, state))

    def k_static(self, n: int) -> int:
        return sel.budget_tokens(self.budget, n, self.min_tokens)

    def achieved_sparsity(self, cfg, positions) -> float:
        """Fraction of visible keys skipped, averaged over layers and the given query positions (decode rule)."""
        sparse_layers = max(cfg.num_layers - self.dense_layers, 0)
        return sparse_layers / cfg.num_layers * sel.topk_sparsity(self.budget, positions, self.min_tokens)

    def tile_budget(self, T: int):
        """i32[nT]: keys chosen for each query tile among those before it (rolling budget)."""
        return sel.budget_tokens(self.budget, sel.tile_starts(T, self.tile), self.min_tokens)


def prefill_state(params, cfg, method, tokens, lengths):
    """The method's state after one jitted prefill of tokens: int[B, T] (lengths: int[B]) from an empty cache."""
    tokens = jnp.asarray(tokens, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    B, T = tokens.shape

    @jax.jit
    def run(params, tokens, lengths):
        cache = init_cache(cfg, B, T, params.embed.dtype)
        return llama.prefill(params, cfg, method, tokens, lengths, cache, method.init_state(cfg, B, T))[2]

    return run(params, tokens, lengths)


def scratch(shape, dtype) -> jax.Array:
    """An array the caller writes whole before any read (a per-forward buffer of a method's state): uninitialised
    (`lax.empty`: no fill kernel on a GPU / TPU) without a mesh, zeros under one (sharding propagation does not see
    through the allocation, a fill does)."""
    return jax.lax.empty(shape, dtype) if active_mesh() is None else jnp.zeros(shape, dtype)


def kwargs_for(cls, options: dict) -> dict:
    """The options a method's constructor takes (builders ignore the rest: cfg, artifact, ...)."""
    names = set(cls.__dataclass_fields__)
    return {k: v for k, v in options.items() if k in names and v is not None}


def refuse_derived(method: str, options: dict, derived: dict) -> dict:
    """Removes from `options` the fields a builder sets itself, raising ValueError for one the user gave with
    another value: derived maps field -> (the value the builder sets, or None for any value, and where it comes
    from). A field accepted and then dropped would leave the user believing it applied."""
    for key, (allowed, source) in derived.items():
        value = options.pop(key, None)
        if value is not None and (allowed is None or value != allowed):
            raise ValueError(f"{method} option {key}={value!r}: {key} is set by {source}, not by an option")
    return options


def refuse_unused(method: str, options: dict, keys, why: str) -> None:
    """Raises ValueError for any of `keys` given in `options` (not None), which has no effect because `why`: an
    option accepted and then ignored would leave the user believing it applied."""
    for key in keys:
        if options.get(key) is not None:
            raise ValueError(f"{method} option {key}={options[key]!r} has no effect: {why} (leave it out)")


def np_int(x) -> np.ndarray:
    return np.asarray(x, np.int32)


__all__ = ["TokenBudget", "attend_dense", "attend_per_query_head", "attend_selected", "check_tile", "decode_dense",
           "dense_decode", "dense_prefill", "masked_attention_reference", "prefill_dense", "sparse_prefill",
           "scratch", "stacked_cache", "topk_decode"]

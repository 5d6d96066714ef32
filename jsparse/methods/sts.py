"""STS: inside speculative decoding, the draft model's attention chooses the keys the target attends to.

A round of speculative decoding (`models.speculative`) runs the draft first. Its method here (`StsDraft`)
attends densely and records, per draft layer and query head, the top-W keys of its attention rows:

  * decode (STS-D): the post-softmax weights of the draft's newest queries, pooled over that step's queries
    and, with `carry` c (default 0.5; the paper's is 0, the last step alone), plus c times the record of the
    steps before it, so that all of a round's draft queries choose the keys (the record is not cleared between
    rounds: a round's first step adds c times the last round's, whose later steps may be of tokens that round
    rejected; the decay makes their share small after a few steps). A forward of T >= 2 queries (a round's
    first step, [prev, tok], or an appended message after them) records only the keys before the target's
    block (`record_limit`), so a message longer than the round cannot crowd the keys before it out of the record;
  * prefill (STS-P): weights pooled over each query tile and restricted to the keys before the tile (as
    Kascade's prefill does), computed tile by tile (never a [T, T] array).

With `first_step_mask` (not in the paper; default off) only the round's first draft step (the call with
T >= 2 queries: [prev, tok], or an appended message) attends densely and takes a top-P over the cache, the pool
(P = `mask_pool` * W); the later steps (one query each) attend, per query head, through the pool plus the last
gamma keys (the round's new tokens) and update the pool's weights (same `carry` rule, the softmax taken over
that set) instead of a top-W over the cache. The target takes each row's top W of the pooled weights
(`pool_record`), so keys the later queries weigh most can enter the record as long as the first step ranked
them among its top P; with `mask_pool` 1 the record holds exactly the first step's keys, all before the round
(`record_limit`), so the target has K + gamma keys to choose its K from. With
`mask_attention=False` the later steps attend over the whole cache (the draft's own attention stays exact) and
only the record is limited to the pool, each pool key re-weighted with its weight in that full softmax: no top-W
over the cache in the later steps, the dense decode's cost otherwise.

A row's record holds its own budget's keys: a decode row its k plus slack (`record_keys`; `mask_pool` times that in
the pool, and the target takes its k plus slack from it), a prefill tile the tile's k, and the prefill pools only the
query rows below a row's length. The static width W (the capacity's k plus slack, the padded prompt's k) only bounds
the arrays, so a row's tokens do not depend on the rows it is batched with or on the cache capacity (tested).

The target's method (`STS`) adopts that record and, at target layer l, takes for each query head h the row of
draft (layer, head) = head_map[l, h] (the calibrated STS head map, `sts_calibration`), sums the rows of the
query heads of each KV group (GQA) and keeps the top k keys per KV head: the index contract
int32[B, Hkv, T, K], ascending, -1 padded, attended by the existing gathered-attention kernels. The union is
done at index level (`merge_rows`: the group's G * W entries sorted by key and summed, at most G * W + sink +
local candidates, never an array as wide as the cache) while those candidates are a small share of the keys, and on
the N-wide path (`merge_rows_reference`, which selects the same keys) otherwise (`row_merge="auto"`, the default;
"index" or "scatter" force one). In decode the T = gamma + 1 verification queries share
one row of selected keys before the round plus the round's own new tokens (causal among themselves); in prefill
the kernel adds each tile's diagonal block. The record belongs to
one round: the next round's draft steps overwrite it.

Budgets: `budget` <= 1 is a fraction of the visible keys (k = min(max(ceil(budget * n), min_tokens), n), the
rule of the other methods); `budget` > 1 is a number of tokens (k = min(budget, n)). A token budget at or above
the cache capacity keeps every visible key, as a token budget of the other methods does (`--budget-tokens N`: k =
min(N, its visible keys)); the index width is then the capacity. A token budget above the model's context is refused
(no row ever sees that many keys).

Selection: the draft's decode record and the target's top-k use the exact threshold top-k of
`pallas_kernels.topk_select` (a Pallas Triton kernel on GPU, `lax.top_k` on CPU; `selection` picks another
implementation), which chooses exactly the keys `lax.top_k` would (ties to the lower position) without sorting
the cache-wide row. The prefill record (`tile_head_topk`) stays in rank order (`lax.top_k`): the head-map
calibration reads its first k entries. On a GPU the draft's decode weights come from the dense decode kernel,
which reads the layer in place from the stacked cache and writes its logits (`attend_and_probs`); elsewhere from
XLA (`head_probs`), with the same record up to float rounding. A recording step (`record_after_scan`, the default)
writes every layer's weight rows into one buffer f32[B, Hq_d, L_d, N] and selects them all at once after the layer
scan (16 x B x 32 rows for a 1B draft: the `topk_select` path for many rows, one pass over the rows after a sample),
instead of a selection per layer; the buffer costs 4 bytes per (row, draft query head, draft layer, cache slot)
while the step runs (`record_after_scan=False`: per layer, no buffer). In a one-query recording step
(`record_selection="auto"`, budget 512 at 32K-100K) the buffer holds the scaled logits, which the dense decode kernel
writes into it in place with their maxima per block of RECORD_BLOCK keys (`dense_decode_record`), and the top W is
taken from those maxima and the W best blocks' keys alone (`select_by_blocks`: the same keys and weights as the
whole-row selection), so no pass over the whole rows follows the kernel.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jsparse import selection as sel
from jsparse.artifacts import ArtifactError, load_artifact, meta_number
from jsparse.methods.base import register
from jsparse.methods.common import (attend_dense, attend_selected, check_tile, refuse_derived, refuse_unused,
                                    scratch, stacked_cache)
from models.sharding import constrain
from pallas_kernels.anchor_attention.common import diagonal_scores
from pallas_kernels.dense import dense_prefill
from pallas_kernels.dense_decode import dense_decode_record, dense_decode_stacked
from pallas_kernels.dense_decode import supported as dense_decode_supported
from pallas_kernels.dense_decode.reference import block_max, decode_lse
from pallas_kernels.sparse_attention import sparse_decode, sparse_prefill
from pallas_kernels.topk_select import topk_select
from pallas_kernels.topk_select.api import IMPLEMENTATIONS

Array = jax.Array
NEG_INF = -jnp.inf
# Verification blocks up to this many queries use the gathered decode op; longer appended messages a mask.
GATHER_MAX_QUERIES = 32
ROW_MERGES = ("auto", "index", "scatter")
DEFAULT_TILE = 32  # query rows pooled per tile, as `jsparse calibrate sts --tile` defaults
# row_merge="auto": the index merge while a group's candidates (G * W + sink + local) are at most 1 / AUTO_INDEX_SHARE
# of the keys, else the N-wide scatter. Measured (H200 and H100, Llama-3.1-8B shapes): at budget 512 (candidates 2-6%
# of 32K-100K keys) the index merge is faster (100K B1 5.26 vs 5.74 ms, 32K B8 6.40 vs 7.07 ms); at budget 4096
# (16-50%) the scatter is (100K B1 6.14 vs 6.75 ms, 32K B8 12.96 vs 18.89 ms; eval/results/h200/fused/
# sts_bench_cells_stages4.json, eval/results/h100/sts_bench/).
AUTO_INDEX_SHARE = 8
RECORD_SELECTIONS = ("auto", "blocks", "rows")
# The draft's recording step by blocks (`select_by_blocks`): keys per block of the recorded block maxima, and the
# most candidates (W blocks x RECORD_BLOCK keys) per row "auto" takes that path for (the one-launch row path of
# `topk_select`), at most half of the cache.
RECORD_BLOCK = 16
RECORD_MAX_CANDIDATES = 16384


def check_budget(budget) -> float:
    """A fraction in (0, 1] or a whole number of tokens > 1."""
    if not sel.is_real(budget) or not 0 < budget < float("inf"):  # NaN fails the comparison too
        raise ValueError(f"budget={budget!r}: expected a fraction of the context in (0, 1] or a number of tokens > 1")
    if budget > 1 and float(budget) != int(budget):
        raise ValueError(f"budget={budget!r}: a budget above 1 counts tokens and must be a whole number")
    return float(budget)


def budget_k(budget: float, n, min_tokens: int):
    """Keys to keep among n visible ones (int or i32 array): a fraction <= 1, or a token count above 1."""
    return sel.keys_to_keep(n, budget, min_tokens, int(budget) if budget > 1 else None)


def static_k(budget: float, capacity: int, min_tokens: int) -> int:
    """The static index width for a cache of `capacity` rows: `budget_k` of the capacity (a token budget above it:
    the capacity, every key a query can see)."""
    return budget_k(budget, capacity, min_tokens)


def head_probs(q: Array, k_cache: Array, positions: Array) -> Array:
    """Causal post-softmax weights per query head.

    Args:
      q: [B, T, Hq, D]; k_cache: [B, Hkv, N, D]; positions: i32[B, T] (query t sees keys <= positions[b, t]).
    Returns:
      f32[B, Hq, T, N].
    """
    B, T, Hq, _ = q.shape
    return sel.group_probs(q, k_cache, positions).reshape(B, Hq, T, k_cache.shape[2])


def in_place_probs(q: Array, cache) -> bool:
    """Whether `attend_and_probs` takes the in-place Pallas path: on a GPU, with 16-bit queries, inside the
    model's layer scan (the cache view carries the stacked cache and the layer index), kernels permitting."""
    return (getattr(cache, "layer", None) is not None and jax.default_backend() == "gpu"
            and q.dtype in (jnp.bfloat16, jnp.float16) and dense_decode_supported("pallas_gpu", q))


def attend_and_probs(q: Array, cache, lengths: Array, in_place: bool | None = None,
                     rows: Array | None = None) -> tuple[Array, Array]:
    """Dense decode attention and the draft's record row: each query head's post-softmax weights over the cache,
    summed over the T new queries (with `rows`, i32[B], over row b's first rows[b] queries alone: the others are a
    padded message's padding; this takes the XLA path).

    In place (`in_place_probs`; None: by that rule): the split-K dense decode kernel reads the layer's K and V
    from the stacked cache (no copy of the layer) and writes the logits it computes, from which one XLA pass
    takes the weights with the row's log-sum-exp (`dense_decode_stacked(..., return_probs=True)`: K is read
    once, where `pallas_kernels.head_probs` would read it again). Otherwise `attend_dense` and `head_probs`
    (XLA) on the layer view; the two agree up to float rounding.

    Args:
      q: [B, T, Hq, D]; cache: a layer view (`models.attention.LayerKV`); lengths: i32[B] (after the write).
    Returns:
      (out [B, T, Hq, D] in q's dtype, probs f32[B, Hq, N]; 0 at keys >= lengths).
    """
    if in_place is None:
        in_place = rows is None and in_place_probs(q, cache)
    if in_place:
        k_all, v_all, layer = stacked_cache(cache)
        return dense_decode_stacked(q, k_all, v_all, layer, lengths, return_probs=True, implementation="pallas_gpu")
    T = q.shape[1]
    probs = head_probs(q, cache.k, sel.decode_positions(lengths, T))  # [B, Hq, T, N]
    if rows is not None:
        probs = jnp.where(jnp.arange(T)[None, None, :, None] < rows[:, None, None, None], probs, 0.0)
    return attend_dense(q, cache, lengths), probs.sum(axis=2)


def record_limit(lengths: Array, T: int) -> Array:
    """The keys a recording draft forward of T queries may record: those below lengths - (T - 1), i32[B].

    The draft's multi-query forwards decode [prev, tok, message...] from position n - 1 (a round's first step:
    [prev, tok]; an appended message: the whole message after them), and the target verifies or appends from n =
    lengths - (T - 1), taking the draft's keys below n and the forward's new tokens itself. So the record holds
    keys below n alone: a message longer than the round (M > gamma new keys, more than the record's `slack`) would
    otherwise fill it with its own tokens, which the target drops, and leave fewer than k keys before it. A
    one-query step (T = 1) records every visible key, as the paper's draft does."""
    return lengths - (T - 1)


def _topk_rows(scores: Array, W: int) -> tuple[Array, Array]:
    """scores f32[..., N] (-inf: not choosable) -> (val f32[..., W], idx i32[..., W]) in rank order, -1 for -inf."""
    val, idx = jax.lax.top_k(scores, W)
    return val, jnp.where(val > NEG_INF, idx, -1).astype(jnp.int32)


def _topk_set(scores: Array, W: int, implementation: str | None = None, k=None) -> tuple[Array, Array]:
    """The keys of `_topk_rows`, positions ascending, by `topk_select` (no sort of the N-wide row).

    scores f32[..., N] (-inf: not choosable), W <= N -> (val f32[..., W], idx i32[..., W]): the kept positions
    ascending with their scores, then idx -1 / val -inf padding (where fewer than W keys are choosable). k: keys
    to keep per row (int or i32 broadcastable to scores.shape[:-1]; None: W).
    """
    idx = topk_select(scores, W if k is None else k, W, implementation=implementation)
    val = jnp.take_along_axis(scores, jnp.maximum(idx, 0), axis=-1)
    return jnp.where(idx >= 0, val, NEG_INF), idx


def add_recorded(probs: Array, idx: Array, val: Array, lengths: Array, scale: float) -> Array:
    """probs + scale * (the recorded weights) at the recorded keys below lengths: idx, val [B, H, W] (-1 padded)
    added into probs f32[B, H, N] in place (a scatter-add of W entries per row, not an N-wide pass); the same
    values as adding `scale` times `_scores`' row with -inf read as 0."""
    B, H, _ = idx.shape
    ok = (idx >= 0) & (idx < lengths[:, None, None])
    b = jnp.arange(B)[:, None, None]
    h = jnp.arange(H)[None, :, None]
    return probs.at[b, h, jnp.where(ok, idx, probs.shape[-1])].add(jnp.where(ok, scale * val, 0.0), mode="drop")


def _topk_visible(probs: Array, lengths: Array, W: int, implementation: str | None = None,
                  k: Array | None = None) -> tuple[Array, Array]:
    """`_topk_set` of probs with the keys at or past lengths not choosable, for weights that are >= 0 below
    lengths and 0 past it (`attend_and_probs`): at most min(W, lengths) keys are kept, and a zero-weight key
    below lengths ties with the keys past it and wins (ties go to the lower position), so no N-wide -inf mask
    is written. probs f32[B, H, N], lengths i32[B] -> (val, idx) [B, H, W] as `_topk_set`'s. k: i32[B], keys per
    row (<= min(lengths, W)); None: min(lengths, W)."""
    return _topk_set(probs, W, implementation, k=(jnp.minimum(lengths, W) if k is None else k)[:, None])


def select_by_blocks(rows: Array, bmax: Array, rec_idx: Array, rec_val: Array, lengths: Array, carry: float,
                     lse: Array | None = None, implementation: str | None = None, block: int = RECORD_BLOCK,
                     config=None, k: Array | None = None) -> tuple[Array, Array]:
    """`StsDraft._select` (the top W of each row's weights plus `carry` times its earlier record) read through
    the rows' block maxima: the same keys and weights, from the keys of the W best blocks alone.

    Each row's score is s = p + carry * (the earlier record's weight at the key), p the key's weight. A key of the
    row's top W lies in a block whose largest score is among the W largest block scores (ties to the lower
    block; of those blocks at most W hold a key above the W-th score, and the ties of that score in the lowest
    blocks), so one top-W over the block scores (the blocks' maxima of p, raised to the recorded keys' scores)
    and one over the W * block keys of those blocks, position ascending, choose exactly `_topk_visible`'s keys.
    Neither reads more than W * block of a row's N entries.

    Args:
      rows: f32[B, R, N] the weights p (lse None), or the scaled logits x with p = exp(x - lse) (the dense decode
        kernel's record, `dense_decode_record`); read only below lengths.
      bmax: f32[B, R, ceil(N / block)] the rows' maxima over blocks of `block` keys below lengths, -inf for a
        block without such a key (`block_max`).
      rec_idx, rec_val: [B, R, W] the earlier record (-1 padded), added `carry` times.
      lengths: i32[B]; lse: f32[B, R] or None (see rows); implementation, config: `topk_select`'s.
      k: i32[B], keys per row (<= min(lengths, W): the W best blocks hold a row's top k too); None: min(lengths, W).

    Returns:
      (val, idx) [B, R, W] as `_topk_visible`'s (positions ascending, then -inf / -1).
    """
    B, R, N = rows.shape
    W, nb = rec_idx.shape[-1], bmax.shape[-1]
    b, r = jnp.arange(B)[:, None, None], jnp.arange(R)[None, :, None]
    lim = lengths[:, None, None]

    def weight(x):  # entries of rows -> weights p
        return x if lse is None else jnp.exp(x - lse[..., None])

    scores = bmax if lse is None else jnp.where(bmax > NEG_INF, jnp.exp(bmax - lse[..., None]), NEG_INF)
    recorded = (rec_idx >= 0) & (rec_idx < lim)
    rec_pos = jnp.where(recorded, rec_idx, 0)
    if carry:  # a recorded key's score raises its block's
        rec_s = weight(jnp.take_along_axis(rows, rec_pos, axis=-1)) + carry * rec_val
        scores = scores.at[b, r, jnp.where(recorded, rec_pos // block, nb)].max(rec_s, mode="drop")
    blocks = topk_select(scores, W, W, implementation=implementation, config=config)  # [B, R, Wb] ascending
    Wb = blocks.shape[-1]
    pos = (blocks[..., None] * block + jnp.arange(block, dtype=jnp.int32)).reshape(B, R, Wb * block)
    valid = (jnp.repeat(blocks, block, axis=-1) >= 0) & (pos < lim)
    cand = weight(jnp.take_along_axis(rows, jnp.where(valid, pos, 0), axis=-1))
    if carry:  # the recorded keys among the candidates: slot j * block + key % block of their block's slot j
        key_blk = rec_pos // block
        j = jax.vmap(jnp.searchsorted)(jnp.where(blocks >= 0, blocks, nb).reshape(B * R, Wb),
                                       key_blk.reshape(B * R, W)).reshape(B, R, W)
        hit = recorded & (jnp.take_along_axis(blocks, jnp.minimum(j, Wb - 1), axis=-1) == key_blk)
        slot = jnp.where(hit, j * block + rec_pos % block, Wb * block)
        cand = cand.at[b, r, slot].add(jnp.where(hit, carry * rec_val, 0.0), mode="drop")
    cand = jnp.where(valid, cand, NEG_INF)
    keys = jnp.minimum(lengths, W) if k is None else k
    pick = topk_select(cand, keys[:, None], W, implementation=implementation, config=config)
    ok = pick >= 0
    safe = jnp.maximum(pick, 0)
    idx = jnp.where(ok, jnp.take_along_axis(pos, safe, axis=-1), -1)
    val = jnp.where(ok, jnp.take_along_axis(cand, safe, axis=-1), NEG_INF)
    if idx.shape[-1] < W:  # fewer candidates than W (a cache of fewer than W blocks' keys)
        pad = ((0, 0), (0, 0), (0, W - idx.shape[-1]))
        idx, val = jnp.pad(idx, pad, constant_values=-1), jnp.pad(val, pad, constant_values=NEG_INF)
    return val, idx.astype(jnp.int32)


def tile_head_topk(q: Array, k: Array, tile: int, W: int, lengths: Array | None = None,
                   keep: Array | None = None) -> tuple[Array, Array]:
    """Per query head and query tile, the top-W keys before the tile by causal weight pooled over the tile.

    Computed one query tile at a time ([B, Hq, tile, T] at most, never [T, T]).

    Args:
      q: [B, T, Hq, D]; k: [B, T, Hkv, D] (after RoPE); tile: query rows per tile; W <= T.
      lengths: i32[B] or None (every row): the query rows at or past a row's length (its right padding) add
        nothing to the pooled weights.
      keep: i32[nT] or None: tile i keeps its top keep[i] keys (<= W), the rest -1 / -inf.
    Returns:
      (val f32[B, Hq, nT, W], idx i32[B, Hq, nT, W]) in rank order (best first), -1 where fewer keys exist.
    """
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    nT = -(-T // tile)
    qp = jnp.pad(q, ((0, 0), (0, nT * tile - T), (0, 0), (0, 0))).reshape(B, nT, tile, Hkv, G, D)
    qp = jnp.moveaxis(qp, 1, 0)  # [nT, B, tile, Hkv, G, D]
    key = jnp.arange(T)

    def one_tile(args):
        qt, i = args
        start = i * tile
        logits = jnp.einsum("btkgd,bnkd->bkgtn", qt, k, preferred_element_type=jnp.float32) / math.sqrt(D)
        pos = start + jnp.arange(tile)
        logits = jnp.where((key[None, :] <= pos[:, None]), logits, NEG_INF)
        probs = jax.nn.softmax(logits, axis=-1)
        real = (pos[None, :] < limit[:, None])[:, None, None, :, None]  # [B, 1, 1, tile, 1]: rows below lengths
        probs = jnp.where(real, probs, 0.0).sum(axis=3).reshape(B, Hq, T)  # pooled over the tile
        val, idx = _topk_rows(jnp.where(key < start, probs, NEG_INF), W)
        if keep is not None:
            kept = jnp.arange(W) < keep[i]
            val, idx = jnp.where(kept, val, NEG_INF), jnp.where(kept, idx, -1)
        return val, idx

    limit = sel.row_limits(lengths, B, T)
    val, idx = jax.lax.map(one_tile, (qp, jnp.arange(nT)))  # [nT, B, Hq, W]
    return jnp.moveaxis(val, 0, 2), jnp.moveaxis(idx, 0, 2)


@struct.dataclass
class DraftRecord:
    """The draft's attention rows of the current forward: per draft layer and query head, its top-W keys.

    idx: i32[L_d, B, Hq_d, R, W] (-1 padded); val: f32[...] their pooled weights. R = 1 in decode (positions
    ascending), one row per query tile in prefill (rank order). Readers treat a row as a set.

    With `first_step_mask` the draft's decode state also holds the pool: pool_idx i32[L_d, B, Hq_d, P] (P >= W
    keys per head, ascending, -1 padded: the round's first step's top P) and pool_val f32[...] their weights
    pooled over the round's steps; the draft leaves idx / val alone and the target's `STS.adopt_draft` takes the
    row's top W from the pool (`pool_record`). None otherwise (the target's own state never holds a pool).
    """

    idx: Array
    val: Array
    pool_idx: Array | None = None
    pool_val: Array | None = None
    # With the pool: i32[B], the keys per row the target takes from it (`pool_record`): the row's own budget plus
    # slack when the round's first step wrote the pool (`StsDraft.record_keys`).
    pool_keys: Array | None = None
    # Inside one recording decode forward of the draft with `record_after_scan` (`StsDraft.start_rows` adds them,
    # `StsDraft.finish` selects and drops them): every layer's weight rows f32[B, Hq_d, L_d, N] and the rows'
    # lengths i32[B].
    weights: Array | None = None
    lengths: Array | None = None
    # With the record by blocks (`StsDraft.record_by_blocks`): every layer's maxima of its rows over blocks of
    # RECORD_BLOCK keys f32[B, Hq_d, L_d, ceil(N / RECORD_BLOCK)], and in a one-query forward (where `weights`
    # holds the scaled logits the dense decode kernel writes in place, not weights) their log-sum-exps
    # f32[B, Hq_d, L_d].
    bmax: Array | None = None
    lse: Array | None = None
    # The target's keys of every sparse target layer inside one decode forward (`STS.start_rows`, dropped by
    # `STS.finish`): i32[L_t - dense_layers, B, Hkv_t, K + T], ascending, -1 padded.
    chosen: Array | None = None
    # Inside the draft's forward of an appended message right-padded to its bucket (`StsDraft.message_rows`, set
    # and cleared around that forward by `models.speculative.spec_append`): i32[B], the forward's real query rows
    # ([prev, tok] and the message); the rows past them are padding, whose weights are not recorded.
    rows: Array | None = None


def empty_record(layers: int, batch: int, heads: int, rows: int, width: int, pool: int = 0) -> DraftRecord:
    """An empty record ([L, B, H, rows, width]; with `pool` > 0 also an empty pool of that width)."""
    shape = (layers, batch, heads, rows, width)
    rec = DraftRecord(idx=jnp.full(shape, -1, jnp.int32), val=jnp.zeros(shape, jnp.float32))
    if pool:
        rec = rec.replace(pool_idx=jnp.full(shape[:3] + (pool,), -1, jnp.int32),
                          pool_val=jnp.zeros(shape[:3] + (pool,), jnp.float32),
                          pool_keys=jnp.full((batch,), width, jnp.int32))
    return rec


def pool_record(rec: DraftRecord, implementation: str | None = None) -> DraftRecord:
    """The record the target reads from a draft state with a pool: per draft layer and head the top pool_keys[b]
    (the row's own budget plus slack, at most the record's width W) of the pool's keys by pooled weight (ties to the
    lower position), ascending, -1 padded; a state without a pool is returned as it is."""
    if rec.pool_idx is None:
        return rec
    W = rec.idx.shape[-1]
    scores = jnp.where(rec.pool_idx >= 0, rec.pool_val, NEG_INF)  # positions ascending along the pool
    keys = W if rec.pool_keys is None else rec.pool_keys[None, :, None]  # the row's own width (`record_keys`)
    slot = topk_select(scores, keys, W, implementation=implementation)  # slots of the pool, ascending
    ok = slot >= 0
    safe = jnp.maximum(slot, 0)
    idx = jnp.where(ok, jnp.take_along_axis(rec.pool_idx, safe, axis=-1), -1)
    val = jnp.where(ok, jnp.take_along_axis(rec.pool_val, safe, axis=-1), 0.0)
    return DraftRecord(idx=idx[:, :, :, None].astype(jnp.int32), val=val[:, :, :, None])


@struct.dataclass
class _Budget:
    budget: float = struct.field(pytree_node=False, default=0.1)
    min_tokens: int = struct.field(pytree_node=False, default=128)
    tile: int = struct.field(pytree_node=False, default=DEFAULT_TILE)
    slack: int = struct.field(pytree_node=False, default=8)
    # `topk_select` implementation of the decode record and the target's top-k (None: by backend).
    selection: str | None = struct.field(pytree_node=False, default=None)
    # Decode record across the draft's steps (not in the paper, whose value is 0: the last step alone): each step
    # adds `carry` times the recorded weights of the steps before it, so a round's rows pool its queries. 0.5 by
    # default: STS-D perplexity on SmolLM2 +1.1% / +2.0% at 2K / 4K against +4.1% / +7.9% with 0
    # (eval/results/h100/sts_smollm2/NOTES.md).
    carry: float = struct.field(pytree_node=False, default=0.5)
    # The draft's steps 2..gamma of a round (its one-query decode calls) attend through the keys its first step
    # recorded plus the last `slack` keys (which hold the round's new tokens) instead of the whole cache, and
    # update the weights of the recorded keys instead of a top-W over the cache (`StsDraft.decode`). False: the
    # paper's dense draft steps.
    first_step_mask: bool = struct.field(pytree_node=False, default=False)
    # With `first_step_mask`: the first step keeps its top `mask_pool` * W keys (W = `decode_width`) as the pool
    # the later steps attend through and re-weight; the target takes the top W of the pooled weights. 1: the
    # record is the first step's top W (later steps cannot change which keys it holds).
    mask_pool: int = struct.field(pytree_node=False, default=1)
    # With `first_step_mask`: whether the later steps' own attention goes through the pool (True: the fast path,
    # the draft's later queries see the pool and the round's new keys only) or over the whole cache (False: the
    # draft's attention stays exact, only the record is limited to the pool, re-weighted with each pool key's
    # weight in the full softmax; no top-W over the cache).
    mask_attention: bool = struct.field(pytree_node=False, default=True)
    # How the target unites a GQA group's draft rows: "index" (`merge_rows`: sort and sum the <= G * W + sink +
    # local entries), "scatter" (`merge_rows_reference`: an N-wide score array, the specification) or "auto" (index
    # while those entries are at most 1 / AUTO_INDEX_SHARE of the N keys, else scatter). Same keys either way.
    row_merge: str = struct.field(pytree_node=False, default="auto")
    # A recording draft step (every decode step; with `first_step_mask` the round's first) takes its top-W once
    # after the layer scan, over every layer's weight rows together (`StsDraft.start_rows` adds a buffer
    # f32[B, Hq_d, L_d, N], `StsDraft.finish` selects), instead of one selection per layer inside the scan: the
    # same keys, with the selection's few launches per step instead of per layer and all layers' rows filling the
    # GPU at once. False: per layer (no buffer; also what a layer called on its own does).
    record_after_scan: bool = struct.field(pytree_node=False, default=True)
    # How a recording step after the layer scan takes each row's top W: "blocks" (`select_by_blocks`: from the
    # maxima of its rows over blocks of RECORD_BLOCK keys, the W best blocks' keys alone; in a one-query step the
    # dense decode kernel writes the logits and block maxima in place, so no pass turns the logits into weights),
    # "rows" (`topk_select` over every key of the rows), or "auto" (blocks in one-query steps while W *
    # RECORD_BLOCK is at most RECORD_MAX_CANDIDATES and half the cache: budget 512 at 32K-100K; rows for larger
    # budgets and in the round's first step, T = 2, whose weights sum two queries' and need an XLA pass anyway:
    # there blocks took 11.24 ms against 10.67 ms by rows at 100K, batch 7 on an H200, and the one-query step 8.81
    # against 10.03 ms, eval/results/h200/record_blocks/). The same keys and weights either way (tested).
    record_selection: str = struct.field(pytree_node=False, default="auto")

    def record_by_blocks(self, width: int, N: int, q_len: int = 1) -> bool:
        """Whether a recording step of q_len queries and `width` keys per row over N cache slots selects by blocks."""
        if self.record_selection != "auto":
            return self.record_selection == "blocks"
        return q_len == 1 and width * RECORD_BLOCK <= min(RECORD_MAX_CANDIDATES, N // 2)

    def decode_width(self, capacity: int) -> int:
        """Draft keys recorded per decode row: the budget plus `slack` (the round's own new keys, which the
        target takes anyway and drops from the draft's choice)."""
        return min(static_k(self.budget, capacity, self.min_tokens) + self.slack, capacity)

    def prefill_width(self, T: int) -> int:
        return budget_k(self.budget, T, self.min_tokens)

    def record_keys(self, limit: Array, width: int, pool: bool = False) -> Array:
        """i32[B]: the keys a recording decode step keeps per row: the row's own budget at the `limit` keys it may
        record plus `slack` (`mask_pool` times that in the pool), at most `width` (the record's static width) and
        `limit`. So what a row records depends on the row alone, not on the cache's capacity (which sets the static
        width): a wider record would enter the target's per-group sum and change the keys it keeps."""
        k = budget_k(self.budget, limit, self.min_tokens) + self.slack
        if pool:
            k = self.mask_pool * k
        return jnp.minimum(jnp.minimum(k, width), limit).astype(jnp.int32)

    def pool_width(self, capacity: int) -> int:
        """Keys in the draft's pool (`first_step_mask`; 0 without it)."""
        return min(self.mask_pool * self.decode_width(capacity), capacity) if self.first_step_mask else 0


@struct.dataclass
class StsDraft(_Budget):
    """The draft's method in STS: dense attention that records its attention rows (`DraftRecord`)."""

    def init_state(self, cfg, batch, max_len):
        return empty_record(cfg.num_layers, batch, cfg.num_heads, 1, self.decode_width(max_len),
                            self.pool_width(max_len))

    def end_prefill(self, cfg, state, batch, max_len):
        return self.init_state(cfg, batch, max_len)

    def layer_info(self, cfg):
        return None

    def records(self, q_len: int) -> bool:
        """Whether a decode forward of q_len queries takes a top-W over the cache (every step, or with
        `first_step_mask` the round's first: T >= 2)."""
        return not (self.first_step_mask and q_len == 1)

    def message_rows(self, state, rows):
        """The state for (rows: i32[B]) or after (None) a decode forward of an appended message right-padded to its
        bucket, whose first rows[b] query rows are real: the padding rows' weights stay out of the record (the
        target would otherwise select keys by them)."""
        return state.replace(rows=rows)

    def start_rows(self, cfg, state, phase, lengths, q_len, kv_len):
        """A recording decode forward with `record_after_scan`: the buffer of every layer's weight rows."""
        if phase != "decode" or not self.record_after_scan or not self.records(q_len):
            return state
        B = lengths.shape[0]
        lengths = record_limit(lengths, q_len)  # `finish` selects among the keys below it
        # Every layer writes its row (probs [B, Hq, N], N = kv_len = the cache's capacity; by blocks in a one-query
        # step the logits of the keys below lengths, all that `select_by_blocks` reads, and the whole row of block
        # maxima) before `finish` reads any: no fill (`scratch`; a zero fill cost 0.42 ms per recording step at
        # 100K, batch 7 on an H200, eval/results/h200/largest_batch/).
        rows = ("batch", "heads", None, None)
        weights = scratch((B, cfg.num_heads, cfg.num_layers, kv_len), jnp.float32)
        state = state.replace(weights=constrain(weights, rows), lengths=lengths)
        if self.record_by_blocks(self._recorded(state)[0].shape[-1], kv_len, q_len):  # each layer writes its row
            nb = -(-kv_len // RECORD_BLOCK)
            state = state.replace(bmax=constrain(scratch((B, cfg.num_heads, cfg.num_layers, nb), jnp.float32), rows))
            if q_len == 1:
                lse = scratch((B, cfg.num_heads, cfg.num_layers), jnp.float32)
                state = state.replace(lse=constrain(lse, ("batch", "heads", None)))
        return state

    def finish(self, state, phase):
        """After a recording forward's layer scan: every layer's top-W at once (`select_by_blocks` when the forward
        recorded block maxima, else `_select` over the whole rows)."""
        if state.weights is None:
            return state
        probs, lengths, bmax, lse = state.weights, state.lengths, state.bmax, state.lse  # [B, Hq, L, N], [B]
        B, Hq, L, N = probs.shape
        state = state.replace(weights=None, lengths=None, bmax=None, lse=None)
        rec_idx, rec_val = self._recorded(state)  # [L, B, Hq, W]
        flat = lambda x: x.reshape(B, Hq * L, x.shape[-1])  # noqa: E731  [B, Hq, L, ...] -> [B, Hq * L, ...]
        rec_idx, rec_val = (flat(jnp.moveaxis(x, 0, 2)) for x in (rec_idx, rec_val))
        if bmax is not None:
            val, idx = select_by_blocks(flat(probs), flat(bmax), rec_idx, rec_val, lengths, self.carry,
                                        None if lse is None else lse.reshape(B, Hq * L), self.selection,
                                        k=self.record_keys(lengths, rec_idx.shape[-1], self.first_step_mask))
        else:
            val, idx = self._select(flat(probs), rec_idx, rec_val, lengths)
        def unflat(x):  # [B, Hq * L, W] -> [L, B, Hq, W], split as the record (rows by batch, heads by model)
            return constrain(jnp.moveaxis(x.reshape(B, Hq, L, x.shape[-1]), 2, 0), (None, "batch", "heads", None))
        return self._store(state, unflat(val), unflat(idx), lengths=lengths)

    def _recorded(self, state):
        """The record a step adds to (and replaces): the pool with `first_step_mask`, else the decode record, as
        (idx, val) [L, B, Hq, W]."""
        if self.first_step_mask:
            return state.pool_idx, state.pool_val
        return state.idx[:, :, :, 0], state.val[:, :, :, 0]

    def _select(self, probs, rec_idx, rec_val, lengths):
        """The new record of weight rows probs f32[B, R, N] (0 at keys >= lengths) whose earlier record is
        rec_idx, rec_val [B, R, W]: the top W of probs + carry * (earlier record) -> (val, idx) [B, R, W]."""
        if self.carry:  # the earlier steps' recorded weights, decayed: h = carry * h + s over the steps
            probs = add_recorded(probs, rec_idx, rec_val, lengths, self.carry)
        W = rec_idx.shape[-1]
        return _topk_visible(probs, lengths, W, self.selection, k=self.record_keys(lengths, W, self.first_step_mask))

    def _store(self, state, val, idx, layer=None, lengths=None):
        """Writes the new record (val, idx [B, Hq, W] of layer `layer`, or [L, B, Hq, W] of every layer); with the
        pool also the keys per row the target will take from it (`record_keys` at `lengths`, the step's limit)."""
        def put(x, new):
            return x.at[layer].set(new) if layer is not None else new
        if self.first_step_mask:
            keys = self.record_keys(lengths, state.idx.shape[-1])
            return state.replace(pool_idx=put(state.pool_idx, idx), pool_val=put(state.pool_val, val),
                                 pool_keys=keys)
        return state.replace(idx=put(state.idx, idx[..., None, :]), val=put(state.val, val[..., None, :]))

    def start(self, cfg, state, phase, batch, q_len, kv_len):
        if phase == "prefill":
            return empty_record(cfg.num_layers, batch, cfg.num_heads, -(-q_len // self.tile), self.prefill_width(q_len))
        return state

    def prefill(self, ctx, q, k, v, state):
        # Tile i records its own budget's keys (what the target keeps there), whatever the batch's longest row
        # (which sets the static width), and pools only the rows below each row's length.
        keep = budget_k(self.budget, sel.tile_starts(q.shape[1], self.tile), self.min_tokens)
        val, idx = tile_head_topk(q, k, self.tile, state.idx.shape[-1], ctx.lengths, keep)
        state = DraftRecord(idx=state.idx.at[ctx.layer].set(idx), val=state.val.at[ctx.layer].set(val))
        return dense_prefill(q, k, v), state

    def decode(self, ctx, q, cache, state):
        T = q.shape[1]
        masked = self.first_step_mask
        if masked and state.pool_idx is None:
            raise ValueError("StsDraft(first_step_mask=True) needs a state with a pool: build it with "
                             "`init_state` (empty_record(..., pool=pool_width(capacity)))")
        if masked and T == 1:
            return self._later_step(ctx, q, cache, state)

        def at_layer(buf, x):  # x [B, Hq, ...] into the buffer [B, Hq, L, ...] at this layer
            return jax.lax.dynamic_update_slice_in_dim(buf, x[:, :, None], ctx.layer, axis=2)

        if state.lse is not None:  # by blocks, one query: the kernel writes the logits into the buffer in place
            k_all, v_all, layer = stacked_cache(cache)
            out, lse, weights, bmax = dense_decode_record(q, k_all, v_all, layer, ctx.lengths, state.weights,
                                                          state.bmax, ctx.layer, block=RECORD_BLOCK)
            return out, state.replace(weights=weights, lse=at_layer(state.lse, lse), bmax=bmax)
        # probs f32[B, Hq, N], 0 at keys >= lengths; in a padded message's forward its real rows' alone
        out, probs = attend_and_probs(q, cache, ctx.lengths, rows=state.rows)
        limit = record_limit(ctx.lengths, T)
        if T > 1:  # the forward's own new keys past `prev` are not recorded (`record_limit`)
            probs = jnp.where(jnp.arange(probs.shape[-1], dtype=jnp.int32) < limit[:, None, None], probs, 0.0)
        if state.weights is not None:  # selected after the layer scan, every layer at once (`finish`)
            state = state.replace(weights=at_layer(state.weights, probs))
            if state.bmax is not None:
                state = state.replace(bmax=at_layer(state.bmax, block_max(probs, limit, RECORD_BLOCK)))
            return out, state
        rec_idx, rec_val = self._recorded(state)
        val, idx = self._select(probs, rec_idx[ctx.layer], rec_val[ctx.layer], limit)
        return out, self._store(state, val, idx, ctx.layer, limit)  # with first_step_mask: the round's pool

    def _later_step(self, ctx, q, cache, state):
        """A round's later draft step with `first_step_mask`: per query head h, attention over the keys S_h of
        its pool (written by the round's first step, a call with T >= 2 queries) plus the last `slack` keys
        (the round's new tokens; a key in both is attended once), softmax over that set; the pool keeps the
        keys S_h and updates their weights, h = carry * h + p. q: [B, 1, Hq, D] -> ([B, 1, Hq, D], state)."""
        idx = state.pool_idx[ctx.layer]  # [B, Hq, P]: S_h ascending, -1 padded
        old = state.pool_val[ctx.layer]
        if self.mask_attention:
            out, p_rec = later_step_attention(q, cache, ctx.lengths, idx, self.slack)
        else:
            out, p_rec = dense_step_pool_weights(q, cache, ctx.lengths, idx)
        val = jnp.where(idx >= 0, p_rec + self.carry * jnp.where(jnp.isfinite(old), old, 0.0), old)
        return out, state.replace(pool_val=state.pool_val.at[ctx.layer].set(val))


def _gather_rows(x_all: Array, layer, idx: Array, G: int) -> Array:
    """Rows idx i32[B, Hq, M] (-1 read as row 0) of layer `layer` of a stacked cache [L, B, Hkv, N, D], query head
    h reading KV head h // G -> [B, Hq, M, D]."""
    B, Hq, _ = idx.shape
    b = jnp.arange(B)[:, None, None]
    kv = (jnp.arange(Hq) // G)[None, :, None]
    return x_all[layer, b, kv, jnp.maximum(idx, 0)]


def dense_step_pool_weights(q: Array, cache, lengths: Array, idx: Array) -> tuple[Array, Array]:
    """One query per row attending densely over the cache, and the weight each key of `idx` has in that softmax,
    exp(q . k * scale - lse): the later draft step of `first_step_mask` with `mask_attention=False`.

    On a GPU inside the layer scan the dense decode kernel gives the output and the log-sum-exp in place
    (`dense_decode_stacked(..., return_lse=True)`); elsewhere `attend_dense` and `decode_lse`.

    Args:
      q: [B, 1, Hq, D]; cache: a layer view; lengths: i32[B]; idx: i32[B, Hq, P] (-1 padded).
    Returns:
      (out [B, 1, Hq, D] in q's dtype, p f32[B, Hq, P]: each key's weight, 0 at padding and at keys >= lengths).
    """
    _, _, Hq, D = q.shape
    k_all, v_all, layer = stacked_cache(cache)
    if in_place_probs(q, cache):
        out, lse = dense_decode_stacked(q, k_all, v_all, layer, lengths, return_lse=True, implementation="pallas_gpu")
    else:
        out, lse = attend_dense(q, cache, lengths), decode_lse(q, cache.k, lengths)
    k_sel = _gather_rows(k_all, layer, idx, Hq // k_all.shape[2])  # [B, Hq, P, D]
    logits = jnp.einsum("bhd,bhmd->bhm", q[:, 0], k_sel, preferred_element_type=jnp.float32) / math.sqrt(D)
    ok = (idx >= 0) & (idx < lengths[:, None, None])
    return out, jnp.where(ok, jnp.exp(logits - lse[:, 0, :, None]), 0.0)


def later_step_attention(q: Array, cache, lengths: Array, idx: Array, window: int) -> tuple[Array, Array]:
    """One query per row attending, per query head, to its own key set: the recorded keys `idx` plus the last
    `window` keys below `lengths` (a key in both counted once).

    Args:
      q: [B, 1, Hq, D]; cache: a layer view (`models.attention.LayerKV`; inside the layer scan it is read in
        place through the stacked cache); lengths: i32[B] (keys < lengths are visible); idx: i32[B, Hq, W]
        (-1 padded); window: static, >= 1.
    Returns:
      (out [B, 1, Hq, D] in q's dtype, p f32[B, Hq, W]: the softmax weight of each recorded key, 0 at padding).
    """
    B, _, Hq, D = q.shape
    k_all, v_all, layer = stacked_cache(cache)
    G = Hq // k_all.shape[2]
    W = idx.shape[-1]
    start = (lengths - window)[:, None, None]  # [B, 1, 1]: first key of the window
    win = jnp.broadcast_to(start + jnp.arange(window, dtype=jnp.int32)[None, None, :], (B, Hq, window))
    lim = lengths[:, None, None]
    keys = jnp.concatenate([jnp.where((idx >= 0) & (idx < start) & (idx < lim), idx, -1),
                            jnp.where(win >= 0, win, -1)], axis=-1)  # [B, Hq, W + window], distinct
    k_sel, v_sel = (_gather_rows(x, layer, keys, G) for x in (k_all, v_all))  # [B, Hq, W + window, D]
    logits = jnp.einsum("bhd,bhmd->bhm", q[:, 0], k_sel, preferred_element_type=jnp.float32) / math.sqrt(D)
    p = jax.nn.softmax(jnp.where(keys >= 0, logits, NEG_INF), axis=-1)
    out = jnp.einsum("bhm,bhmd->bhd", p, v_sel.astype(jnp.float32))[:, None].astype(q.dtype)
    in_win = (idx >= start) & (idx < lim)
    p_win = jnp.take_along_axis(p[..., W:], jnp.clip(idx - start, 0, window - 1), axis=-1)
    p_rec = jnp.where(idx >= 0, jnp.where(in_win, p_win, p[..., :W]), 0.0)
    return out, p_rec


def _scores(idx: Array, val: Array, N: int, limit: Array, sink: int = 0, local: int = 0) -> Array:
    """Summed weights of the recorded keys: idx, val [B, H, C] -> f32[B, H, N], -inf where no key was recorded
    or the key is not below limit: i32[B] (or []); +inf (always kept) for the first `sink` keys and
    `diagonal_scores` (kept next, the most recent first) for the `local` keys just below limit, so a budget smaller
    than sink + local keeps the sinks and the newest keys of the window."""
    B, H, _ = idx.shape
    ok = (idx >= 0) & (idx < jnp.reshape(limit, (-1, 1, 1)))
    safe = jnp.where(ok, idx, N)
    b = jnp.arange(B)[:, None, None]
    h = jnp.arange(H)[None, :, None]
    total = jnp.zeros((B, H, N), jnp.float32).at[b, h, safe].add(val, mode="drop")
    hit = jnp.zeros((B, H, N), bool).at[b, h, safe].set(True, mode="drop")
    scores = jnp.where(hit, total, NEG_INF)
    if sink or local:
        key = jnp.arange(N)[None, None, :]
        lim = jnp.reshape(limit, (-1, 1, 1))
        scores = jnp.where((key >= lim - local) & (key < lim), diagonal_scores(key), scores)
        scores = jnp.where((key < sink) & (key < lim), jnp.inf, scores)
    return scores


def merge_rows_reference(idx: Array, val: Array, N: int, limit: Array, k, K: int, sink: int = 0, local: int = 0,
                         implementation: str | None = None) -> Array:
    """The target's selection through an N-wide score array (the specification of `merge_rows`): the draft
    entries summed per key by `_scores` (sink keys +inf, local keys `diagonal_scores`), then `topk_select` over the N
    keys.

    idx, val: [B, H, C]; limit: i32[B] or []; k: int or i32 broadcastable to [B, H]; K: static width
    -> i32[B, H, min(K, N)], ascending, -1 padded."""
    return topk_select(_scores(idx, val, N, limit, sink, local), k, K, implementation=implementation)


def merge_rows(idx: Array, val: Array, limit: Array, k, K: int, sink: int = 0, local: int = 0,
               implementation: str | None = None, bound: int | None = None) -> Array:
    """The target's selection from the draft's rows at index level: the keys of `merge_rows_reference`, with no
    array as wide as the cache.

    The C entries of a row (a GQA group's draft rows side by side; a key may appear in several) and the forced
    keys (the first `sink` keys, the `local` keys just below the limit) are sorted by position (stably, so equal
    keys keep their row order); the weights of equal keys are summed (a scatter-add into C + sink + local slots,
    in the order `_scores` adds them: the same sums, bit for bit where XLA applies a scatter's updates in order,
    as on the CPU), a sink key scores +inf and a local key `diagonal_scores` (as in `_scores`), and `topk_select`
    keeps the top k of these at most C + sink + local distinct keys. Same rule as the reference: largest sum
    first, ties to the lower position, keys whose score is -inf dropped.

    With `bound` (static, every limit at most it: the cache's capacity; a key at or past it could not count) and
    (bound + 1) times the row's entries below 2^31, the sort runs on one int32 key per entry, position * entries +
    entry: the same order as the stable sort by position (ties by entry), so the same keys and sums, with the
    weights then gathered in that order (a one-operand sort: on an H100 at a 100K verification's rows one 91 us
    kernel against 178 us for the three-operand sort, eval/results/h100/sts_shared/).

    Args:
      idx: i32[B, H, C] recorded keys (-1 padded); val: f32[B, H, C] their weights.
      limit: i32[B] or i32[]: only keys below it count (the cache before the verified block; the tile's start).
      k: int or i32 broadcastable to [B, H]: keys to keep per row; K: static output width.
      bound: None, or a static int >= every limit (the packed sort above; not checked, the limit being traced: a
        limit past it would drop the keys in [bound, limit)).
    Returns:
      i32[B, H, K]: the kept keys ascending, -1 padded (the index contract's row).
    """
    B, H, C = idx.shape
    big = jnp.iinfo(jnp.int32).max
    lim = jnp.broadcast_to(jnp.reshape(jnp.asarray(limit, jnp.int32), (-1, 1, 1)), (B, 1, 1))
    ok = (idx >= 0) & (idx < lim)
    pos, w = [jnp.where(ok, idx, big)], [jnp.where(ok, val.astype(jnp.float32), 0.0)]
    forced = [jnp.zeros((B, H, C), jnp.int32)]  # 2: a sink key, 1: a local key, 0: a recorded one
    for extra, kind in (((jnp.arange(sink, dtype=jnp.int32)[None, None, :], 2),) if sink else ()) + \
            (((lim - local + jnp.arange(local, dtype=jnp.int32)[None, None, :], 1),) if local else ()):
        extra = jnp.broadcast_to(extra, (B, H, extra.shape[-1]))
        pos.append(jnp.where((extra >= 0) & (extra < lim), extra, big))
        w.append(jnp.zeros(extra.shape, jnp.float32))
        forced.append(jnp.full(extra.shape, kind, jnp.int32))
    pos, w, forced = (jnp.concatenate(x, axis=-1) for x in (pos, w, forced))
    M = pos.shape[-1]
    if bound is not None and (bound + 1) * M < 2 ** 31:  # one packed key: (position, entry), unique
        packed = jnp.sort(jnp.where(pos < big, pos, bound) * M + jnp.arange(M, dtype=jnp.int32), axis=-1)
        order, at = packed % M, packed // M
        pos = jnp.where(at < bound, at, big)
        w = jnp.take_along_axis(w, order, axis=-1)
        forced = jnp.take_along_axis(forced, order, axis=-1) if sink or local else forced
    else:
        pos, w, forced = jax.lax.sort((pos, w, forced), dimension=-1, is_stable=True, num_keys=1)
    first = jnp.concatenate([jnp.ones((B, H, 1), bool), pos[..., 1:] != pos[..., :-1]], axis=-1)
    seg = jnp.cumsum(first, axis=-1, dtype=jnp.int32) - 1  # [B, H, M]: the distinct key each entry belongs to
    b = jnp.arange(B)[:, None, None]
    h = jnp.arange(H)[None, :, None]
    total = jnp.zeros((B, H, M), jnp.float32).at[b, h, seg].add(w)
    is_forced = jnp.zeros((B, H, M), jnp.int32).at[b, h, seg].max(forced) if sink or local else forced
    key = jnp.full((B, H, M), big, jnp.int32).at[b, h, seg].min(pos)  # ascending; `big` past the last key
    forced_score = jnp.where(is_forced == 2, jnp.inf, diagonal_scores(key))
    scores = jnp.where(key < big, jnp.where(is_forced > 0, forced_score, total), NEG_INF)
    slot = topk_select(scores, k, K, implementation=implementation)  # [B, H, min(K, M)], ascending
    chosen = jnp.where(slot >= 0, jnp.take_along_axis(key, jnp.maximum(slot, 0), axis=-1), -1)
    if chosen.shape[-1] < K:
        chosen = jnp.pad(chosen, ((0, 0), (0, 0), (0, K - chosen.shape[-1])), constant_values=-1)
    return chosen.astype(jnp.int32)


@register("sts")
@struct.dataclass
class STS(_Budget):
    """The target's method in STS (see the module docstring).

    head_map: i32[L_t, Hq_t, 2]: (draft layer, draft query head) for every target layer and query head.
    draft_layers, draft_heads: the draft's L and Hq (the record's shape).
    """

    head_map: Array = None
    draft_layers: int = struct.field(pytree_node=False, default=1)
    draft_heads: int = struct.field(pytree_node=False, default=1)
    # The fingerprint of the draft an artifact's head map was calibrated with (None: a head map given as is);
    # speculative decoding with another draft is refused (`jsparse.api.speculative_methods`).
    draft_fingerprint: str | None = struct.field(pytree_node=False, default=None)
    # Fidelity options (not in the paper, whose default is 0 for all three): the first `dense_layers` target
    # layers attend densely; every selection keeps the first `sink` keys and the `local` keys just before the
    # query (its tile in prefill), inside the budget.
    dense_layers: int = struct.field(pytree_node=False, default=0)
    sink: int = struct.field(pytree_node=False, default=0)
    local: int = struct.field(pytree_node=False, default=0)

    needs_draft = True  # not a field: STS runs only inside speculative decoding

    def __post_init__(self):
        check_budget(self.budget)
        sel.check_positive_int("min_tokens", self.min_tokens, 0)
        check_tile(self.tile)
        for name in ("dense_layers", "sink", "local"):
            sel.check_positive_int(name, getattr(self, name), 0)
        if not sel.is_real(self.carry) or not 0.0 <= self.carry <= 1.0:
            raise ValueError(f"carry={self.carry!r}: expected a decay in [0, 1] (0: the draft's last step alone)")
        object.__setattr__(self, "carry", float(self.carry))
        for name in ("first_step_mask", "mask_attention", "record_after_scan"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name}={getattr(self, name)!r}: expected true or false")
        sel.check_positive_int("mask_pool", self.mask_pool, 1)
        if self.row_merge not in ROW_MERGES:
            raise ValueError(f"row_merge={self.row_merge!r}: expected one of {ROW_MERGES}")
        if self.record_selection not in RECORD_SELECTIONS:
            raise ValueError(f"record_selection={self.record_selection!r}: expected one of {RECORD_SELECTIONS}")
        if self.selection is not None and self.selection not in IMPLEMENTATIONS:
            raise ValueError(f"selection={self.selection!r}: expected one of {IMPLEMENTATIONS} (the topk_select "
                             f"implementation) or None (by backend)")
        if isinstance(self.head_map, (np.ndarray, jax.Array, list, tuple)) and \
                not isinstance(self.head_map, jax.core.Tracer):  # not a tracer, nor a pytree's stand-in leaf
            # A head map given as is (`STS(head_map=...)`, not `build`): its entries index the draft's record.
            check_head_map_range(self.head_map, self.draft_layers, self.draft_heads)

    @classmethod
    def build(cls, cfg=None, draft=None, artifact=None, fingerprint=None, head_map=None, budget=0.1,
              min_tokens=128, tile=None, selection=None, dense_layers=0, sink=0, local=0, carry=0.5,
              first_step_mask=False, mask_pool=None, mask_attention=None, row_merge="auto", record_after_scan=True,
              record_selection=None, **unused):
        """Builds STS for target `cfg` and `draft` (a LoadedModel) from an `artifact` folder (`jsparse calibrate
        sts`, checked against both models' fingerprints) or an explicit `head_map` i32[L_t, Hq_t, 2]. tile None:
        the query tile the artifact's overlaps were pooled with (its meta "tile"), else 32. mask_pool (default 1)
        and mask_attention (default True) act with first_step_mask only, record_selection (default "auto") with
        record_after_scan only: given without it they are refused."""
        if cfg is None or draft is None:
            raise ValueError("method 'sts' needs the target model and a draft model (--draft; jsparse.generate(..., "
                             "draft=...))")
        if not hasattr(draft, "cfg"):
            raise ValueError(f"draft={draft!r}: expected a loaded model (jsparse.load)")
        check_budget(budget)
        if budget > 1 and budget > cfg.max_position_embeddings:  # no row ever sees that many keys
            raise ValueError(f"budget={budget:g} tokens: more than the model's context of {cfg.max_position_embeddings}"
                             f" tokens; expected at most {cfg.max_position_embeddings} (budget=1.0 keeps every key)")
        if isinstance(first_step_mask, (bool, np.bool_)) and not first_step_mask:
            refuse_unused("sts", {"mask_pool": mask_pool, "mask_attention": mask_attention},
                          ("mask_pool", "mask_attention"), "they shape the pool of first_step_mask, which is off")
        if isinstance(record_after_scan, (bool, np.bool_)) and not record_after_scan:
            refuse_unused("sts", {"record_selection": record_selection}, ("record_selection",),
                          "it picks the buffer of record_after_scan, which is off")
        mask_pool = 1 if mask_pool is None else mask_pool
        mask_attention = True if mask_attention is None else mask_attention
        record_selection = "auto" if record_selection is None else record_selection
        if head_map is not None and artifact:
            raise ValueError(f"sts: artifact={artifact!r} and a head_map given: expected one of them (the artifact "
                             "holds a head map)")
        draft_fingerprint = None
        if head_map is None:
            if not artifact:
                raise ValueError("method 'sts' needs a head map: --artifact DIR from `jsparse calibrate sts --model T "
                                 "--draft D --out DIR`")
            from jsparse.artifacts import fingerprint as model_fp
            draft_fingerprint = model_fp(draft)
            art = load_artifact(artifact, "sts", fingerprint)
            head_map = head_map_of(art, artifact, draft_fingerprint, budget)
            if tile is None:
                tile = meta_number(art, artifact, "tile", DEFAULT_TILE, integer=True)
        tile = DEFAULT_TILE if tile is None else tile
        head_map = np.asarray(head_map)
        check_head_map(head_map, cfg, draft.cfg)  # (its dtype too: a float map is refused, not truncated)
        head_map = head_map.astype(np.int32)
        if not 0 <= sel.check_positive_int("dense_layers", dense_layers, 0) <= cfg.num_layers:
            raise ValueError(f"dense_layers={dense_layers!r}: expected 0..{cfg.num_layers} (the target's layers)")
        refuse_derived("sts", unused, {"slack": (None, "the round's gamma (`for_round`)"),
                                       "draft_layers": (None, "the draft model"),
                                       "draft_heads": (None, "the draft model"),
                                       "draft_fingerprint": (None, "the draft model")})
        return cls(head_map=jnp.asarray(head_map), budget=float(budget), min_tokens=min_tokens, tile=tile,
                   selection=selection, draft_layers=draft.cfg.num_layers, draft_heads=draft.cfg.num_heads,
                   draft_fingerprint=draft_fingerprint,
                   dense_layers=dense_layers, sink=sink, local=local, carry=carry,
                   first_step_mask=first_step_mask, mask_pool=mask_pool, mask_attention=mask_attention,
                   row_merge=row_merge, record_after_scan=record_after_scan, record_selection=record_selection)

    # -- speculative decoding hooks (models.speculative)

    def for_round(self, draft_cfg, gamma: int):
        """(target method, draft method) for rounds of gamma draft tokens."""
        if (draft_cfg.num_layers, draft_cfg.num_heads) != (self.draft_layers, self.draft_heads):
            raise ValueError(f"STS head map made for a draft of {self.draft_layers} layers x {self.draft_heads} heads, "
                             f"got a draft of {draft_cfg.num_layers} x {draft_cfg.num_heads}")
        m = self.replace(slack=max(gamma, 1))
        return m, StsDraft(budget=m.budget, min_tokens=m.min_tokens, tile=m.tile, slack=m.slack,
                           selection=m.selection, carry=m.carry, first_step_mask=m.first_step_mask,
                           mask_pool=m.mask_pool, mask_attention=m.mask_attention,
                           record_after_scan=m.record_after_scan, record_selection=m.record_selection)

    def adopt_draft(self, state, draft_state):
        return pool_record(draft_state, self.selection)

    def init_state(self, cfg, batch, max_len):
        return empty_record(self.draft_layers, batch, self.draft_heads, 1, self.decode_width(max_len))

    def end_prefill(self, cfg, state, batch, max_len):
        return self.init_state(cfg, batch, max_len)

    def layer_info(self, cfg):
        return self.head_map

    def check_model(self, cfg):
        """Refuses a head map made for another target's query heads (its layers: `models.attention.check_model`)."""
        check_head_map_shape(self.head_map.shape, cfg)

    def _rows(self, state, info, Hkv):
        """The draft rows of the target layer(s) whose head-map rows are `info` [..., Hq_t, 2] (one layer's, or
        several layers' stacked): (idx, val) [..., B, Hkv, R, G * W] (a GQA group's query heads side by side)."""
        def pick(x):  # [L_d, B, Hq_d, R, W] -> [..., B, Hq_t, R, W]
            return jnp.moveaxis(x[info[..., 0], :, info[..., 1]], -4, -3)
        idx, val = pick(state.idx), pick(state.val)
        *lead, Hq, R, W = idx.shape
        G = Hq // Hkv

        def group(x):
            return jnp.moveaxis(x.reshape(*lead, Hkv, G, R, W), -3, -2).reshape(*lead, Hkv, R, G * W)
        return group(idx), group(val)

    def decode_keys(self, state, info, lengths, T: int, Hkv: int, N: int) -> Array:
        """The keys the verification queries of target layer(s) `info` [..., Hq_t, 2] attend to: per KV head the
        top k of its group's draft rows below the round (`_merge`) plus the T new tokens; lengths: i32[B] after
        this forward's writes; N: the cache capacity -> i32[..., B, Hkv, K + T], ascending, -1 padded.

        Several layers are one batch of rows: `start_rows` takes every sparse layer's keys at once, before the
        layer scan (the record and the head map are known before the target runs)."""
        B = lengths.shape[0]
        n = lengths - T  # keys before this forward's new tokens
        idx, val = self._rows(state, info, Hkv)  # [..., B, Hkv, 1, C]
        idx, val = idx[..., 0, :], val[..., 0, :]  # a decode record has one row per head
        lead = idx.shape[:-3]
        reps = int(np.prod(lead, dtype=np.int64))
        C = idx.shape[-1]
        K = static_k(self.budget, N, self.min_tokens)
        flat = lambda x: x.reshape(reps * B, Hkv, C)  # noqa: E731  (layer-major rows: row r is batch row r % B)
        n_rows = jnp.tile(n, reps)
        chosen = self._merge(flat(idx), flat(val), N, n_rows,
                             budget_k(self.budget, n_rows, self.min_tokens)[:, None], K)  # [reps * B, Hkv, K]
        # The kept keys (ascending, all below n, then -1) followed by the T new ones n .. n + T - 1: ascending as is
        # once the new keys follow the last kept one (no sort).
        kept = jnp.sum(chosen >= 0, axis=-1, keepdims=True, dtype=jnp.int32)  # [reps * B, Hkv, 1]
        j = jnp.arange(K + T, dtype=jnp.int32)
        new = n_rows[:, None, None] + j - kept
        both = jnp.pad(chosen, ((0, 0), (0, 0), (0, T)), constant_values=-1)
        both = jnp.where(j < kept, both, jnp.where(j < kept + T, new, -1))
        return both.reshape(*lead, B, Hkv, K + T)

    def start_rows(self, cfg, state, phase, lengths, q_len, kv_len):
        """Decode: every sparse target layer's keys at once (`decode_keys`), read by each layer's attention."""
        if phase != "decode" or self.dense_layers >= cfg.num_layers:
            return state
        info = self.head_map[self.dense_layers:]
        return state.replace(chosen=self.decode_keys(state, info, lengths, q_len, cfg.num_kv_heads, kv_len))

    def finish(self, state, phase):
        return state.replace(chosen=None)

    def prefill(self, ctx, q, k, v, state):
        if not self.dense_layers:
            return self._sparse_prefill(ctx, q, k, v, state)
        return jax.lax.cond(ctx.layer < self.dense_layers, lambda: (dense_prefill(q, k, v), state),
                            lambda: self._sparse_prefill(ctx, q, k, v, state))

    def decode(self, ctx, q, cache, state):
        if not self.dense_layers:
            return self._sparse_decode(ctx, q, cache, state)
        return jax.lax.cond(ctx.layer < self.dense_layers, lambda: (attend_dense(q, cache, ctx.lengths), state),
                            lambda: self._sparse_decode(ctx, q, cache, state))

    def merge_kind(self, candidates: int, N: int) -> str:
        """The merge `row_merge` uses for a group's `candidates` draft entries over N keys: "index" or "scatter"."""
        if self.row_merge != "auto":
            return self.row_merge
        return "index" if (candidates + self.sink + self.local) * AUTO_INDEX_SHARE <= N else "scatter"

    def _merge(self, idx, val, N, limit, k, K):
        """Top-k keys of a group's draft rows idx, val [B, Hkv, C] below limit -> i32[B, Hkv, K] (`row_merge`)."""
        if self.merge_kind(idx.shape[-1], N) == "index":
            return merge_rows(idx, val, limit, k, K, self.sink, self.local, self.selection, bound=N)
        return merge_rows_reference(idx, val, N, limit, k, K, self.sink, self.local, self.selection)

    def _sparse_prefill(self, ctx, q, k, v, state):
        B, T, Hkv = q.shape[0], q.shape[1], k.shape[2]
        idx, val = self._rows(state, ctx.info, Hkv)  # [B, Hkv, nT, C]
        K = self.prefill_width(T)
        starts = sel.tile_starts(T, self.tile)

        def one_tile(args):
            i, v_, s = args
            return self._merge(i, v_, T, s, budget_k(self.budget, s, self.min_tokens)[None, None], K)

        chosen = jax.lax.map(one_tile, (jnp.moveaxis(idx, 2, 0), jnp.moveaxis(val, 2, 0), starts))  # [nT, B, H, K]
        return sparse_prefill(q, k, v, jnp.moveaxis(chosen, 0, 2), ctx.lengths, tile=self.tile), state

    def _sparse_decode(self, ctx, q, cache, state):
        B, T = q.shape[0], q.shape[1]
        Hkv, N = cache.k.shape[1], cache.k.shape[2]
        if state.chosen is not None:  # taken for every layer by `start_rows`
            both = state.chosen[ctx.layer - self.dense_layers]
        else:  # a layer called on its own (no start_rows): the same keys, this layer alone
            both = self.decode_keys(state, ctx.info, ctx.lengths, T, Hkv, N)
        if T <= GATHER_MAX_QUERIES:  # one row for the T queries (the stacked GPU kernel reads each key once for all)
            rows = both[:, :, None]
            if getattr(cache, "layer", None) is not None:
                out = sparse_decode(q, cache.k_all, cache.v_all, rows, ctx.lengths, layer=cache.layer)
            else:
                out = sparse_decode(q, cache.k, cache.v, rows, ctx.lengths)
            return out, state
        indices = jnp.broadcast_to(both[:, :, None], (B, Hkv, T, both.shape[-1]))
        return attend_selected(q, cache, indices, ctx.lengths), state


def check_head_map_shape(shape, cfg) -> None:
    """Raises ValueError unless an STS head map's shape is [L_t, Hq_t, 2] of the target of `cfg`."""
    want = (cfg.num_layers, cfg.num_heads, 2)
    if tuple(shape) != want:
        raise ValueError(f"STS head map has shape {tuple(shape)}: expected [L_t, Hq_t, 2] = {want} for the target (a "
                         "map made for another model?)")


def check_head_map(head_map: np.ndarray, cfg, draft_cfg) -> None:
    """head_map: i32[L_t, Hq_t, 2] with draft layers in [0, L_d) and draft heads in [0, Hq_d)."""
    check_head_map_shape(head_map.shape, cfg)
    check_head_map_range(head_map, draft_cfg.num_layers, draft_cfg.num_heads)


def check_head_map_range(head_map, draft_layers: int, draft_heads: int) -> None:
    """Raises ValueError unless head_map [..., 2] names draft layers in [0, draft_layers) and heads in
    [0, draft_heads) (an entry outside would read another layer's record rows, or clipped ones, silently)."""
    head_map = sel.integer_array("STS head map", head_map)
    if head_map.ndim < 1 or head_map.shape[-1] != 2:
        raise ValueError(f"STS head map has shape {head_map.shape}: expected [L_t, Hq_t, 2]")
    if head_map.size and (head_map[..., 0].min() < 0 or head_map[..., 0].max() >= draft_layers or
                          head_map[..., 1].min() < 0 or head_map[..., 1].max() >= draft_heads):
        raise ValueError(f"STS head map names draft layers {head_map[..., 0].min()}..{head_map[..., 0].max()} and heads "
                         f"{head_map[..., 1].min()}..{head_map[..., 1].max()}: expected layers in [0, "
                         f"{draft_layers}) and heads in [0, {draft_heads}) of the draft")


def load_head_map(path: str, fingerprint: str | None, draft_fingerprint: str, budget: float) -> np.ndarray:
    """The head map i32[L_t, Hq_t, 2] of an STS artifact made for this target and draft: the one calibrated at
    the k nearest (in ratio) to the budget (a token count; a fraction is taken of the calibration length)."""
    return head_map_of(load_artifact(path, "sts", fingerprint), path, draft_fingerprint, budget)


def head_map_of(art, path: str, draft_fingerprint: str, budget: float) -> np.ndarray:
    """`load_head_map` of the loaded STS artifact `art` (read from folder `path`)."""
    got = art.meta.get("draft_fingerprint")
    if got != draft_fingerprint:
        raise ArtifactError(f"STS artifact at {path!r} was calibrated with draft fingerprint {got!r} "
                            f"({art.meta.get('draft', '?')}), but the draft's fingerprint is {draft_fingerprint!r}")
    ks, maps = np.asarray(art.arrays["ks"]), np.asarray(art.arrays["head_maps"])
    if ks.ndim != 1 or not ks.size or not np.issubdtype(ks.dtype, np.integer) or ks.min() < 1 or \
            maps.ndim != 4 or maps.shape[0] != ks.size:
        raise ArtifactError(f"STS artifact at {path!r} is corrupt: ks {ks.tolist()} (dtype {ks.dtype}) and head_maps "
                            f"of shape {maps.shape}: expected positive integer ks, one [L_t, Hq_t, 2] head map each")
    length = art.meta.get("length", int(ks[-1]))
    if isinstance(length, bool) or not isinstance(length, (int, float)) or length <= 0:
        raise ArtifactError(f"STS artifact at {path!r} is corrupt: meta length={length!r}, expected a positive "
                            "number of tokens (the calibration windows' length)")
    tokens = budget if budget > 1 else budget * float(length)
    best = int(np.argmin(np.abs(np.log(ks / max(tokens, 1.0)))))
    return sel.integer_array(f"the STS head map of {path!r}", maps[best])

"""H2O-style heavy hitters: keep the keys with the largest accumulated attention, plus a recent window.

Heavy-Hitter Oracle (Zhang et al., 2023) scores every cached key by the attention it has received so far, summed
over past queries, and keeps the top scorers plus the most recent tokens. Here:

  * state `score`: f32[L, B, Hkv, N], per layer and KV head the accumulated post-softmax attention each key has
    received (the mean over the GQA group, as EvoSparse's heat; a uniform scale, so the ranking is the group sum's),
    carried across decode steps;
  * prefill is dense and initialises `score` with the column sums of the prompt's causal attention (valid query
    rows only, mean over the group), computed a chunk of query rows at a time in a loop
    (`selection.causal_prob_fold`: one chunk's weights are live at a time, never the [T, T] map);
  * a decode row at position p keeps k = min(max(ceil(budget * (p + 1)), min_tokens), p + 1) keys: the
    r = ceil(recent * k) most recent ones (itself included) and the k - r older keys with the largest `score`;
    it attends over exactly those, and adds its attention weights to their `score`. Rows of a multi-token decode
    (T > 1, e.g. perplexity) run one after the other, each seeing the scores its predecessors accumulated.

One decode token (`gathered`, the default on a GPU) runs as EvoSparse's heat step at the granularity of one token:
at the start of the forward every layer's heavy keys are chosen at once (`block_scores.heat_candidates`: one
`topk_select` over the stacked score, a layer's score does not change before the layer runs), each layer appends
its recent window to its row (`kept_indices`, ascending) and attends through EvoSparse's gathered decode with
the heat update (`block_scores.sparse_decode_heat`, blocks of one token: it reads the stacked cache and every
layer's rows in place, and its second launch adds each key's mass into the layer's score in place). With
`mass_at_end` (off by default; where the Pallas GPU kernels run outside a mesh) each layer runs one launch instead: it
keeps its keys' entry sums in its slot of buffers made for the forward and merges its own output
(`block_scores.sparse_decode_pending`), and `finish` adds every layer's mass into the scores in one launch
(`add_pending_mass`); a layer's score is read only when the next forward chooses its keys, so the scores are the
same. The same keys and the same softmax as the mask path, which T > 1 tokens and the CPU by default take.

Unlike H2O's fixed-size cache, a key is never deleted: it is re-ranked at every step, but since an unselected
key's score stops growing while the kept ones' keep growing, it rarely comes back.

The gathered decode also keeps, per layer and KV head, the W = `kept_width` highest-scoring keys older than the
window (`H2OState.cand`, exact: ties to the lower position). Between two gathered steps a score changes only where
it grows (the kept keys gain their mass), and at most one key leaves the window, so the next step's heavy hitters lie
among those W keys and the one that left: the step ranks W + 1 scores per row instead of every score (one top-k over
rows of W, `heavy_from_candidates`), and the W candidates are carried on by dropping the lowest. A prefill, a
multi-token decode (the mask path) or a position that moved by more than one key invalidates them
(`cand_end` -1): that step ranks every score once (`kept_indices`' top-k, at width W) and carries on from there.

Selection is per KV head (GQA groups pooled), in the index contract's granularity. All layers are sparse
(dense_layers=0), as in the paper.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jsparse import selection as sel
from jsparse.heat import begin_rows, keep_rows, scan_rows
from jsparse.methods.base import register
from jsparse.methods.common import TokenBudget, dense_prefill, kwargs_for, refuse_unused, scratch, stacked_cache
from pallas_kernels.block_scores import (add_pending_mass, heat_candidates, pending_available, pending_shapes,
                                         sparse_decode_heat, sparse_decode_pending)
from pallas_kernels.sharding import dims, per_shard
from pallas_kernels.sparse_attention.gpu import DecodeConfig
from pallas_kernels.sparse_attention.reference import decode_indices_to_mask
from pallas_kernels.topk_select import topk_select
from pallas_kernels.topk_select.common import float_keys

_HIGHEST = jax.lax.Precision.HIGHEST


# The gathered decode's DecodeConfig on the GPU (read when traced): key rows of 32 per iteration, 7.65 -> 7.43 ms per
# step at 100K, batch 4 on an H200 (64, the kernel's default; 16: 8.13; eval/results/h200/tuning/). Its split target
# stays 512 programs: with 32-row tiles four programs fit an SM (48 KB of stages), so 512 is about one wave of an
# H100's 132 SMs, where the kernel's default of 264 is one wave of its 96 KB programs. At 264 the full run on an H100
# was slower (100K, batch 4 8.533 -> 8.658 ms, Qwen3-8B shapes at batch 3 8.193 -> 8.653, against the run before on
# another H100), though a same-machine A/B on Qwen3 at batch 3 saw no difference (eval/results/h100/e2e_1207b/NOTES.md);
# back at 512 on a third H100, 8.539 and 8.209 ms (eval/results/h100/e2e_1207c/NOTES.md).
DECODE_CONFIG = DecodeConfig(block_k=32, target_programs=512)


@struct.dataclass
class H2OState:
    score: jax.Array  # f32[L, B, Hkv, N] accumulated attention per key (mean over the GQA group)
    kept: Optional[jax.Array] = None  # i32[L, B, Hkv, K] every layer's keys inside one gathered decode forward
    rows: Optional[jax.Array] = None  # f32[L, B, Hkv, T + 1, N] inside a speculative verification (`begin_verify`)
    # The gathered decode's carried candidates (module docstring; None when the decode is not gathered): i32[L, B,
    # Hkv, W] the W highest-scoring keys below cand_end (ascending, -1 padded), and cand_end i32[B] the window start
    # they were ranked at, -1 when they are stale (after a prefill or a mask-path forward).
    cand: Optional[jax.Array] = None
    cand_end: Optional[jax.Array] = None
    # Inside one gathered decode forward with `mass_at_end` (`start_rows` .. `finish`): every layer's partials and
    # entry sums (`block_scores.pending_shapes`), whose mass `finish` adds into the scores, and the rows' counters
    # i32[B, Hkv, 1] (zeros) of the launches' last programs.
    pending: Optional[tuple] = None
    tickets: Optional[jax.Array] = None
    group: int = struct.field(pytree_node=False, default=0)  # the GQA group size beside them (0 outside)


@register("h2o")
@struct.dataclass
class H2O(TokenBudget):
    """recent: fraction of the kept keys that form the recent window (H2O's even split: 0.5). carry: the gathered
    decode carries its candidates from step to step (module docstring; the same keys); False ranks every score at
    every step, as before 2026-12-06. mass_at_end: on a GPU (Pallas kernels, no mesh), a gathered decode layer runs one
    launch that keeps its entry sums and merges its own output (`block_scores.gpu.sparse_decode_pending_gpu`), and
    `finish` adds every layer's mass into the scores in one launch (`add_pending_mass_gpu`), where each layer ran a
    second launch for it; the same scores, since a layer's score is read only when the next forward starts. False
    (the default): the two launches a layer (on an H100 mass_at_end was 0.3% faster at Llama-3.1-8B 100K, batch 4
    and no faster at Qwen3-8B 100K, batch 3: `eval/results/h100/h2o_one_launch/`)."""

    dense_prefill = True  # a decode method: its prefill attends to every key (and accumulates the scores)

    recent: float = struct.field(pytree_node=False, default=0.5)
    dense_layers: int = struct.field(pytree_node=False, default=0)
    # One decode token through the gathered kernel (module docstring); None: on a GPU.
    gathered: Optional[bool] = struct.field(pytree_node=False, default=None)
    carry: bool = struct.field(pytree_node=False, default=True)
    mass_at_end: bool = struct.field(pytree_node=False, default=False)

    def __post_init__(self):
        super().__post_init__()
        if not sel.is_real(self.recent) or not 0.0 < float(self.recent) <= 1.0:
            raise ValueError(f"recent={self.recent!r}: expected the recent window's share of the budget in (0, 1]")
        object.__setattr__(self, "recent", float(self.recent))
        for name in ("carry", "mass_at_end"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name}={getattr(self, name)!r}: expected true or false")

    @classmethod
    def build(cls, **options):
        refuse_unused("h2o", options, ("tile",), "its prefill is dense, with no query tiles")
        return cls(**kwargs_for(cls, options))

    def init_state(self, cfg, batch, max_len):
        score = jnp.zeros((cfg.num_layers, batch, cfg.num_kv_heads, max_len), jnp.float32)
        if not (self.is_gathered() and self.carry):
            return H2OState(score=score)
        W = self.kept_width(self.k_static(max_len))
        return H2OState(score=score, cand=jnp.full(score.shape[:-1] + (W,), -1, jnp.int32),
                        cand_end=jnp.full((batch,), -1, jnp.int32))

    def kept_width(self, K: int) -> int:
        """The most heavy keys a row keeps (the static width of the heavy top-k and of the carried candidates) when
        it keeps at most K keys: k - r never decreases with k, so K - r(K) (`row_budget`'s f32 rounding)."""
        r_max = max(int(np.ceil(np.float32(self.recent) * np.float32(K))), 1)
        return max(K - r_max, 1)

    def _stale(self, state):
        """The state with its carried candidates marked stale (a forward that ranked no candidates)."""
        if state.cand_end is None:
            return state
        return state.replace(cand_end=jnp.full_like(state.cand_end, -1))

    def is_gathered(self) -> bool:
        """Whether a one-token decode runs gathered (`gathered`; None: on a GPU)."""
        return jax.default_backend() == "gpu" if self.gathered is None else bool(self.gathered)

    def begin_verify(self, state, rows: int):
        """Before a speculative verification of `rows` tokens: keep the score after each of them (`heat.begin_rows`),
        so that `end_verify` keeps the rows the round accepts."""
        return state.replace(rows=begin_rows(state.score, rows))

    def end_verify(self, state, count):
        """After the verification: the score after each batch row's first count[b] rows (i32[B]; the rejected
        rows' attention is not counted, nor kept on the positions they wrote)."""
        return state.replace(score=keep_rows(state.rows, count), rows=None)

    def start_rows(self, cfg, state, phase, lengths, q_len, kv_len):
        """A gathered one-token decode: every layer's kept keys at once, before any layer runs (`kept_from_candidates`:
        the keys of `kept_indices`, from the carried candidates)."""
        if phase != "decode" or q_len != 1 or not isinstance(state, H2OState) or not self.is_gathered():
            return state
        pos = lengths.astype(jnp.int32) - 1
        K = self.k_static(kv_len)
        if state.cand is None or state.cand.shape[-1] != self.kept_width(K):
            # A state made without the candidates (by a method that does not decode gathered), or for another cache
            # size: every score ranked, as before the candidates.
            return self._with_pending(cfg, state.replace(kept=self.kept_indices(state.score, pos, K)), pos.shape[0], K)
        kept, cand, end = self.kept_from_candidates(state.score, state.cand, state.cand_end, pos, K)
        return self._with_pending(cfg, state.replace(kept=kept, cand=cand, cand_end=end), pos.shape[0], K)

    def _with_pending(self, cfg, state, batch: int, K: int):
        """The state with the buffers of `mass_at_end` (where it applies: the Pallas GPU kernels, no mesh)."""
        if not self.mass_at_end or not pending_available(cfg.head_dim):
            return state
        q_shape = (batch, 1, cfg.num_heads, cfg.head_dim)
        shapes = pending_shapes(q_shape, K, cfg.num_layers, cfg.num_kv_heads, config=DECODE_CONFIG)
        # The written counts zeroed (a few KB): a layer that runs no gathered launch this forward adds no mass at
        # `finish` (its other buffers are read only below its counts).
        pending = tuple(scratch(x.shape, x.dtype) for x in shapes[:-1]) + (jnp.zeros(shapes[-1].shape, jnp.int32),)
        return state.replace(pending=pending,
                             tickets=jnp.zeros((batch, cfg.num_kv_heads, 1), jnp.int32),
                             group=cfg.num_heads // cfg.num_kv_heads)

    def finish(self, state, phase):
        if not isinstance(state, H2OState):
            return state
        if state.pending is not None:  # every gathered layer's mass, at once (`mass_at_end`)
            score = add_pending_mass(state.kept[:, :, :, None], state.pending, state.score, group=state.group,
                                     first=min(self.dense_layers, state.score.shape[0]))
            state = state.replace(score=score)
        return state.replace(kept=None, pending=None, tickets=None, group=0)

    def prefill(self, ctx, q, k, v, state):
        B, T = q.shape[:2]
        G = q.shape[2] // k.shape[2]

        def add(colsum, s, probs):  # probs: [B, Hkv, R, W] summed over the group, rows s..s+R-1 over keys 0..W-1
            R, W = probs.shape[2:]
            valid_rows = s + jnp.arange(R)[None, :] < ctx.lengths[:, None]  # [B, R] (padding rows past T too)
            part = jnp.sum(jnp.where(valid_rows[:, None, :, None], probs, 0.0), axis=2)  # [B, Hkv, W]
            return colsum + jnp.pad(part, ((0, 0), (0, 0), (0, T - W)))

        # [B, Hkv, T]: the weight each key got from the prompt, a chunk of query rows at a time (sel.causal_prob_fold)
        colsum = sel.causal_prob_fold(q, k, add, jnp.zeros((B, k.shape[2], T), jnp.float32)) / G
        N = state.score.shape[-1]
        row = jnp.pad(colsum, ((0, 0), (0, 0), (0, N - T)))
        score = jax.lax.dynamic_update_index_in_dim(state.score, row, ctx.layer, 0)
        return dense_prefill(q, k, v), self._stale(state.replace(score=score))

    def row_budget(self, p):
        """(k, r) i32[...] of decode rows at positions p: the k keys they keep, of which the r most recent."""
        k_t = sel.budget_tokens(self.budget, p + 1, self.min_tokens)
        r = jnp.maximum(jnp.ceil(self.recent * k_t.astype(jnp.float32)).astype(jnp.int32), 1)
        return k_t, r

    def kept_keys(self, score, p, K: int):
        """bool[B, Hkv, N]: the keys a decode row at positions p: i32[B] attends, given its layer's accumulated
        score f32[B, Hkv, N]: the r = ceil(recent * k) most recent visible keys and the k - r older ones with the
        largest score (K: the static top-k width, >= k)."""
        B, Hkv, N = score.shape
        n = jnp.arange(N)
        k_t, r = self.row_budget(p)  # [B]
        visible = n[None, :] <= p[:, None]  # [B, N]
        window = visible & (n[None, :] > (p - r)[:, None])
        heavy = jnp.where((visible & ~window)[:, None], score, sel.NEG_INF)  # [B, Hkv, N]
        idx = sel.topk_indices(heavy, jnp.broadcast_to((k_t - r)[:, None], (B, Hkv)), K, per_shard=True)
        # The mask per shard too (XLA's scatter would all-gather the indices): every step stays per KV head.
        keep = per_shard(lambda i, n_: decode_indices_to_mask(i[:, :, None], n_, N)[:, :, 0], [idx, p + 1],
                         [dims(3, 0, 1), dims(1, 0)], dims(3, 0, 1))  # [B, Hkv, N]
        return keep | window[:, None]

    def kept_indices(self, score, p, K: int):
        """The keys of `kept_keys` as index rows, for every layer at once: score f32[L, B, Hkv, N], p: i32[B] ->
        i32[L, B, Hkv, K] ascending, -1 padded: the heavy keys older than the window (`heat_candidates`: one
        top-k over all the rows, ties to the lower position as the mask's), then the window p - r + 1 .. p."""
        k_t, r = self.row_budget(p)
        start = p + 1 - r  # [B] the window's first key (>= 0: r <= k <= p + 1)
        # Rows keep at most kept_width(K) heavy keys: the top-k's width (a narrower band lets `topk_select` take its
        # one-pass "ordered" path).
        width = self.kept_width(K)
        heavy = heat_candidates(score, jnp.zeros_like(p), start, k_t - r, width)  # [L, B, Hkv, width]
        return self._with_window(heavy, start, r, K)

    def _with_window(self, heavy, start, r, K: int):
        """i32[L, B, Hkv, K]: the heavy keys (ascending, -1 padded) then the window start .. start + r - 1."""
        heavy = jnp.pad(heavy, [(0, 0)] * 3 + [(0, K - heavy.shape[-1])], constant_values=-1)
        n_heavy = jnp.sum(heavy >= 0, axis=-1, keepdims=True)
        j = jnp.arange(K, dtype=jnp.int32) - n_heavy  # slot in the window
        window = jnp.where(j < r[:, None, None], start[:, None, None] + j, -1)
        return jnp.where(j < 0, heavy, window)

    def kept_from_candidates(self, score, cand, cand_end, p, K: int):
        """`kept_indices` from the carried candidates (module docstring): (kept i32[L, B, Hkv, K], the next
        candidates i32[L, B, Hkv, W], their cand_end i32[B]) for score f32[L, B, Hkv, N] before this step's update,
        cand / cand_end as carried, p: i32[B] this step's positions. The same keys as `kept_indices`: when every row
        moved by at most one key since its candidates were ranked (one `lax.cond` a step), the W + 1 candidates are
        ranked, else every score is (the candidates ranked afresh, W of them)."""
        W = cand.shape[-1]
        k_t, r = self.row_budget(p)
        start = p + 1 - r  # [B] this step's window start: the heavy keys lie below it
        fresh = jnp.all((cand_end >= 0) & (start >= cand_end) & (start - cand_end <= 1))

        def carried():  # the candidates plus the key that left the window, the lowest of them dropped
            return carry_candidates(score, cand, jnp.where(start > cand_end, cand_end, -1))

        def ranked():  # every key below the window start
            ranked = heat_candidates(score, jnp.zeros_like(p), start, jnp.full_like(p, W), W)
            return ranked, candidate_scores(score, ranked)
        cand, x = jax.lax.cond(fresh, carried, ranked)
        heavy = heavy_from_candidates(x, cand, k_t - r)
        return self._with_window(heavy, start, r, K), cand, start

    def sparse_decode(self, ctx, q, cache, state):
        B, T, Hq, D = q.shape
        Hkv, N = cache.k.shape[1], cache.k.shape[2]
        positions = sel.decode_positions(ctx.lengths, T)  # [B, T]
        if T == 1 and state.kept is not None:  # gathered (`start_rows` chose every layer's keys)
            k_all, v_all, layer = stacked_cache(cache)
            # Every layer's rows, the layer's read in place by the GPU kernel (a slice of them was a copy per layer)
            # and each key's mass added into the layer's score row in place (EvoSparse's heat step, one key a block)
            # ctx.lengths is positions + 1 (a kernel of its own a layer when derived again here)
            if state.pending is not None:  # `mass_at_end`: one launch; `finish` adds the mass
                out, pending, tickets = sparse_decode_pending(q, k_all, v_all, layer, state.kept[:, :, :, None],
                                                              ctx.lengths, state.pending, state.tickets,
                                                              config=DECODE_CONFIG, rows_out=ctx.rows_out)
                return out, state.replace(pending=pending, tickets=tickets)
            out, score = sparse_decode_heat(q, k_all, v_all, layer, state.kept[:, :, :, None], ctx.lengths,
                                            state.score, ctx.layer, config=DECODE_CONFIG)
            return out, state.replace(score=score)
        G = Hq // Hkv
        K = self.k_static(N)
        qg = q.astype(jnp.float32).reshape(B, T, Hkv, G, D)
        kf, vf = cache.k.astype(jnp.float32), cache.v.astype(jnp.float32)

        def row(score, xs):
            q_t, p = xs  # [B, Hkv, G, D], i32[B]
            keep = self.kept_keys(score, p, K)  # [B, Hkv, N]
            logits = jnp.einsum("bhgd,bhnd->bhgn", q_t, kf, precision=_HIGHEST) / math.sqrt(D)
            logits = jnp.where(keep[:, :, None], logits, -jnp.inf)
            probs = jax.nn.softmax(logits, axis=-1)  # the row always keeps itself
            out = jnp.einsum("bhgn,bhnd->bhgd", probs, vf, precision=_HIGHEST)
            return score + probs.mean(axis=2), out

        # Rows in order, as T = 1 decoding; inside a speculative verification the score after each is kept too.
        out, score, rows = scan_rows(state.score, ctx.layer, row, (qg, positions), rows=state.rows)
        return out.reshape(B, T, Hq, D).astype(q.dtype), self._stale(state.replace(score=score, rows=rows))


def candidate_scores(score, cand):
    """f32[L, B, Hkv, W]: the scores of the candidates cand i32[L, B, Hkv, W] (-inf at the -1 padding), gathered from
    score f32[L, B, Hkv, N]; per shard under a mesh."""
    row = dims(4, 1, 2)
    return per_shard(_scores_at, [score, cand], [row, row], row)


def _scores_at(score, keys):
    """score f32[..., N] at keys i32[..., W] along the last axis, -inf where a key is -1 (one shard's)."""
    return jnp.where(keys >= 0, jnp.take_along_axis(score, jnp.maximum(keys, 0), axis=-1), -jnp.inf)


def carry_candidates(score, cand, extra):
    """`_carry_candidates` per shard under a mesh (rows over data, KV heads over model, as the scores are laid out)."""
    row = dims(4, 1, 2)
    return per_shard(_carry_candidates, [score, cand, extra], [row, row, dims(1, 0)], (row, row))


def _carry_candidates(score, cand, extra):
    """The W highest-scoring of each row's candidates and one extra key: score f32[L, B, Hkv, N]; cand i32[L, B,
    Hkv, W] ascending, -1 padded; extra i32[B] a key above every candidate of the batch row, or -1 for none ->
    (i32[L, B, Hkv, W] ascending, -1 padded, their scores f32[L, B, Hkv, W], -inf at the padding: gathered once for
    the drop and the heavy keys' top-k). With W + 1 keys the lowest by (score, then the higher position) is dropped,
    the rule of a top-k with ties to the lower position; with fewer every key stays."""
    W = cand.shape[-1]
    n = jnp.sum(cand >= 0, axis=-1, keepdims=True)  # valid candidates (a prefix)
    i = jnp.arange(W + 1, dtype=jnp.int32)
    padded = jnp.pad(cand, [(0, 0)] * 3 + [(0, 1)], constant_values=-1)
    keys = jnp.where(i < n, padded, jnp.where((i == n) & (extra[:, None, None] >= 0), extra[:, None, None], -1))
    valid = keys >= 0
    x = _scores_at(score, keys)
    fk = float_keys(x)
    lowest = jnp.min(jnp.where(valid, fk, jnp.iinfo(jnp.int32).max), axis=-1, keepdims=True)
    drop = jnp.max(jnp.where(valid & (fk == lowest), i, -1), axis=-1, keepdims=True)  # the last of the lowest
    drop = jnp.where(jnp.sum(valid, axis=-1, keepdims=True) > W, drop, W + 1)  # W + 1 keys: drop one

    def shift(a, fill):  # the entries after the dropped one moved down a slot, the last W + 1th slot cut
        return jnp.where(i < drop, a, jnp.pad(a[..., 1:], [(0, 0)] * 3 + [(0, 1)], constant_values=fill))[..., :W]
    return shift(keys, -1), shift(x, -jnp.inf)


def heavy_from_candidates(x, cand, k):
    """The k highest-scoring of each row's candidates (ties to the lower position), ascending, -1 padded: x f32[L, B,
    Hkv, W] their scores (`candidate_scores`, -inf at the padding), cand i32[L, B, Hkv, W] ascending, -1 padded, k
    i32[B] -> i32[L, B, Hkv, W]. One top-k over rows of W scores (`topk_select`; per shard under a mesh)."""
    def local(x, cand, k):
        idx = topk_select(x, jnp.broadcast_to(k[:, None], cand.shape[:-1]), cand.shape[-1])
        return jnp.where(idx >= 0, jnp.take_along_axis(cand, jnp.maximum(idx, 0), axis=-1), -1)
    row = dims(4, 1, 2)
    return per_shard(local, [x, cand, k], [row, row, dims(1, 0)], row)

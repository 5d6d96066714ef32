"""Kascade: exact top-k in a few anchor layers, reused by the other layers through head maps.

Roles per layer (`layer_info`, scanned as `xs`):
  0  layer 0: dense attention, and an anchor (its top-k feeds the next layers);
  1  anchor: exact post-softmax weights over all visible keys, pooled over the GQA group (and in prefill over
     the query tile), top-k (k = min(max(ceil(budget * n), 128), n)), attention over the selected keys;
  2  reuse: attention over the latest anchor's indices, KV head h taking the anchor's head `head_map[l, h]`.
In prefill each layer picks its role's branch with a `lax.switch` on `role`; decode scans each run of layers of one
role apart (`segments`, from the static `anchor_layers`), so no decode layer waits on a conditional.

Per-layer budgets (`reuse_scale` r >= 1): an anchor attends its own top-k but hands its top-(r * k) keys
(k_r = min(max(ceil(r * budget * n), min_tokens), n)) to the reuse layers, which attend to those. r = 1 is the
paper's rule. r scales the fraction, not min_tokens; a token budget (`--budget-tokens N`: min_tokens = N beneath a
fraction that binds only at the longest lengths) also sets r = 1 (`eval.harness.token_budget_options`), so the
reuse layers keep N keys as the anchors do (with r = 2 they kept up to 2N at the longest lengths). On
SmolLM2-135M a reuse layer's set from even the adjacent layer misses what that layer's own top-k keeps and the
passkey is lost (eval/results/kascade_diagnosis/REPORT.md); the calibrated artifact of the bundled model carries
r = 2 and anchors chosen for a target share of the oracle's mass, and `build` takes them from the artifact unless
given (r, and the query tile and min_tokens the calibration pooled its scores with). The kept fraction over the
sparse layers is reported by `achieved_sparsity` (anchors at `budget`, reuse layers at r * budget).

Anchors (roles 0 and 1) run the fused anchor ops of `pallas_kernels.anchor_attention`: `anchor_decode` reads
the stacked cache in place at the traced layer (`LayerKV.k_all`, `v_all`, `layer`; no copy of the layer's
cache per step) and keeps each query's diagonal tile inside the budget (`diagonal_tile=tile`, as
`oracle.select_decode`); `anchor_prefill` scores the keys tile-pooled without a [T, T] array on the GPU and
TPU. Both compute exactly `oracle.select_decode` / `oracle.select_prefill` (tests/test_kascade_anchor.py).
With T > 1 new tokens (perplexity with decode simulated per row) a sparse anchor takes only the indices from
`anchor_decode` and attends through a mask (`attend_selected`), cheaper than gathering T * K rows.

Block mode (`prefill_block_size` bs > 1; prefill only): the anchors select key blocks of bs tokens instead of
tokens (the index contract's block units: entry j covers tokens j*bs .. j*bs + bs - 1). A block scores the sum
of its keys' tile-pooled scores (the attention mass the tile puts on it, from the same pooled scores, never a
[T, T] array on the GPU and TPU), and query tile i keeps ceil(k_i / bs) blocks, k_i the token rule above at the
tile's start (min_tokens counted in tokens, before the rounding): the budget is counted in keys and rounded up to
whole blocks (at most bs - 1 keys more per tile, never more than the keys before the tile; nothing is clamped).
Reuse layers read the anchor's blocks through the head maps, and every sparse prefill passes `block_size=bs`, so
on a Hopper GPU the tile-gathered attention runs on the Mosaic GPU kernel (bs >= 8; `sparse_prefill`'s pick),
on the Triton kernel elsewhere. bs must be a power of two dividing the tile; bs = 1 (the default) is the token
selection. Decode stays token-level. `tsa+kascade` takes token mode only (its compressed coordinates move single
tokens). `achieved_sparsity` reports the token rule (the decode rule), which the block mode's prefill exceeds by
at most bs - 1 keys per tile.

State: the latest anchor's indices `int32[B, Hkv, T, K]` (T = new tokens in decode, query tiles in prefill),
carried through the layer scan; added by `start` and dropped by `finish` so nothing crosses decode steps.
Anchors and head maps come from `jsparse calibrate kascade` (kascade_calibration.py), an artifact keyed to the
model.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jsparse import selection as sel
from jsparse.artifacts import load_artifact, meta_number
from jsparse.methods.base import register
from jsparse.methods.common import (TokenBudget, attend_selected, kwargs_for, refuse_derived, sparse_prefill,
                                    topk_decode)
from models.attention import runs_of
from pallas_kernels.anchor_attention import anchor_prefill
from pallas_kernels.anchor_attention.common import block_width, check_block_size

ARTIFACT_KIND = "kascade"
ROLE_DENSE_ANCHOR, ROLE_ANCHOR, ROLE_REUSE = 0, 1, 2
ROLE_TAGS = ("dense_anchor", "anchor", "reuse")  # decode's segment tag of a run of layers of each role


@struct.dataclass
class KascadeState:
    indices: Optional[jax.Array] = None  # int32[B, Hkv, T, K] of the latest anchor, inside one forward


@struct.dataclass
class LayerRole:
    role: jax.Array  # i32[L]
    head_map: jax.Array  # i32[L, Hkv]


def check_head_map_shape(shape, cfg) -> None:
    """Raises ValueError unless a Kascade head map's shape is (L, Hkv) of the model of `cfg`."""
    if tuple(shape) != (cfg.num_layers, cfg.num_kv_heads):
        raise ValueError(f"kascade's head map has shape {tuple(shape)}: expected (L, Hkv) = "
                         f"{(cfg.num_layers, cfg.num_kv_heads)} of this model (a map made for another model?)")


def roles_from_anchors(num_layers: int, anchors) -> np.ndarray:
    anchors = list(sel.check_layers("anchors", anchors, num_layers))  # integers, before any int() truncates one
    if not anchors or anchors[0] != 0:
        raise ValueError(f"anchors={anchors}: layer 0 must be an anchor")
    roles = np.full((num_layers,), ROLE_REUSE, np.int32)
    roles[anchors] = ROLE_ANCHOR
    roles[0] = ROLE_DENSE_ANCHOR
    return roles


@register("kascade")
@struct.dataclass
class Kascade(TokenBudget):
    roles: jax.Array = None  # i32[L]
    head_map: jax.Array = None  # i32[L, Hkv]: for each layer and KV head, the anchor's KV head it reuses
    reuse_scale: float = struct.field(pytree_node=False, default=1.0)  # r: reuse layers keep r * k keys
    # bs: prefill selects key blocks of bs tokens (1: tokens); a power of two dividing the tile. Decode: tokens.
    prefill_block_size: int = struct.field(pytree_node=False, default=1)
    # The anchors as static ints (`from_anchors` sets them beside `roles`): decode scans each run of layers of
    # one role apart (`segments`); None: the roles alone decide, a `lax.switch` in every layer.
    anchor_layers: Optional[tuple[int, ...]] = struct.field(pytree_node=False, default=None)

    def __post_init__(self):
        super().__post_init__()
        check_block_size(self.prefill_block_size, self.tile, "prefill_block_size")
        r = self.reuse_scale
        if not sel.is_real(r) or not math.isfinite(r) or r < 1.0:
            raise ValueError(f"reuse_scale={r!r}: expected a finite number >= 1 (1: reuse layers keep the anchor's k "
                             "keys)")
        object.__setattr__(self, "reuse_scale", float(r))

    @classmethod
    def build(cls, cfg=None, artifact: str | None = None, fingerprint: str | None = None, **options):
        if not artifact:
            raise ValueError("kascade needs a calibration artifact: run `jsparse calibrate kascade --model M "
                             "--out DIR` and pass DIR (`jsparse generate --artifact DIR`, `jsparse eval --artifact "
                             "kascade=DIR`, artifact=DIR in Python)")
        if cfg is None:
            raise ValueError("kascade needs the model its artifact was calibrated for: pass the model, "
                             "`build_method('kascade', model, artifact=DIR)` (or cfg= to make_method)")
        refuse_derived("kascade", options, {key: (None, "its artifact") for key in ("roles", "head_map")})
        art = load_artifact(artifact, ARTIFACT_KIND, fingerprint)
        if options.get("reuse_scale") is None:
            options["reuse_scale"] = meta_number(art, artifact, "reuse_scale", 1.0)
        # The query tile and min_tokens the anchors and head map were chosen with (the tile pools the scores they
        # compare), unless given: they were read from the method's defaults, whatever the calibration used.
        for name in ("tile", "min_tokens"):
            if options.get(name) is None and name in art.meta:
                options[name] = meta_number(art, artifact, name, integer=True)
        head_map = sel.integer_array(f"the head_map of the artifact at {artifact!r}", art.arrays["head_map"])
        return cls.from_anchors(cfg, art.arrays["anchors"], head_map, **options)

    @classmethod
    def from_anchors(cls, cfg, anchors, head_map=None, **options):
        """Kascade with explicit anchors (layer 0 included) and head map i32[L, Hkv] (identity if None)."""
        roles = roles_from_anchors(cfg.num_layers, anchors)
        if head_map is None:
            head_map = np.tile(np.arange(cfg.num_kv_heads, dtype=np.int32), (cfg.num_layers, 1))
        head_map = sel.integer_array("head_map", head_map)
        check_head_map_shape(head_map.shape, cfg)
        if head_map.min() < 0 or head_map.max() >= cfg.num_kv_heads:
            raise ValueError(f"head_map values span [{head_map.min()}, {head_map.max()}]: expected [0, "
                             f"{cfg.num_kv_heads})")
        options = refuse_derived("kascade", kwargs_for(cls, options), {
            "dense_layers": (1, "Kascade itself (layer 0 is its one dense layer)"),
            "anchor_layers": (None, "the anchors of its artifact (from_anchors' `anchors`)")})
        return cls(roles=jnp.asarray(roles), head_map=jnp.asarray(head_map, jnp.int32), dense_layers=1,
                   anchor_layers=tuple(int(a) for a in np.flatnonzero(roles != ROLE_REUSE)), **options)

    @property
    def reuse_budget(self) -> float:
        """The kept fraction of the reuse layers (and of the sets anchors hand them): r * budget, at most 1."""
        return min(self.budget * self.reuse_scale, 1.0)

    def k_reuse(self, n: int) -> int:
        return sel.budget_tokens(self.reuse_budget, n, self.min_tokens)

    def achieved_sparsity(self, cfg, positions) -> float:
        """Fraction of visible keys skipped, averaged over layers (layer 0 dense, anchors at `budget`, reuse layers
        at `reuse_budget`) and the given query positions (decode rule)."""
        roles = np.asarray(self.roles)
        anchors = int(np.sum(roles == ROLE_ANCHOR))
        reuse = int(np.sum(roles == ROLE_REUSE))
        return (anchors * sel.topk_sparsity(self.budget, positions, self.min_tokens)
                + reuse * sel.topk_sparsity(self.reuse_budget, positions, self.min_tokens)) / cfg.num_layers

    def layer_budgets(self) -> list:
        """Each layer's kept fraction: None for the dense anchor (layer 0), `budget` for an anchor, `reuse_budget`
        for a reuse layer."""
        return [None if r == ROLE_DENSE_ANCHOR else self.budget if r == ROLE_ANCHOR else self.reuse_budget
                for r in np.asarray(self.roles).tolist()]

    def init_state(self, cfg, batch, max_len):
        return KascadeState()

    def segments(self, cfg, phase: str):
        """Decode scans each run of consecutive layers of one role apart (`models.attention.segments`; tags
        `ROLE_TAGS`): each layer runs its role's kernels directly, with no `lax.switch`, which on a GPU reads its
        branch index back to the host and waits for it in every layer. Prefill is one run (a conditional per
        layer is nothing beside a prefill's layer); so is a Kascade without static `anchor_layers`."""
        if phase != "decode" or self.anchor_layers is None:
            return None
        return runs_of(ROLE_TAGS[role] for role in roles_from_anchors(cfg.num_layers, self.anchor_layers))

    def layer_info(self, cfg):
        return LayerRole(role=self.roles, head_map=self.head_map)

    def check_model(self, cfg):
        """Refuses a head map of another model's KV heads (`models.attention.check_model` checks the layers)."""
        if self.head_map is not None:
            check_head_map_shape(self.head_map.shape, cfg)

    def prefill_rows(self, q_len: int, kv_len: int) -> tuple[int, int]:
        """(rows, width) of the prefill state's indices: one row per query tile, k_reuse(kv_len) keys in blocks of
        prefill_block_size."""
        return -(-q_len // self.tile), block_width(self.k_reuse(kv_len), self.prefill_block_size)

    def start(self, cfg, state, phase, batch, q_len, kv_len):
        if phase == "prefill":
            rows, width = self.prefill_rows(q_len, kv_len)
        else:
            rows, width = q_len, self.k_reuse(kv_len)
        return KascadeState(indices=jnp.full((batch, cfg.num_kv_heads, rows, width), -1, jnp.int32))

    def finish(self, state, phase):
        return KascadeState()

    def prefill(self, ctx, q, k, v, state):
        """q: [B, T, Hq, D], k, v: [B, T, Hkv, D] -> (out [B, T, Hq, D], state with the latest anchor's indices
        int32[B, Hkv, ceil(T / tile), ceil(k_reuse(T) / prefill_block_size)], in blocks when the block size > 1)."""
        T = q.shape[1]
        K = self.k_static(T)  # index widths in keys; anchor_prefill returns ceil(K / bs) block entries
        Kr = self.k_reuse(T)
        bs = self.prefill_block_size

        def anchor(dense: bool):
            def fn():
                out, idx = anchor_prefill(q, k, v, ctx.lengths, tile=self.tile, budget=self.budget,
                                          min_tokens=self.min_tokens, K=K, dense_output=dense, block_size=bs)
                if self.reuse_scale == 1.0:
                    return out, idx
                # The wider set for the reuse layers (its attention output is unused and dropped by XLA).
                _, wide = anchor_prefill(q, k, v, ctx.lengths, tile=self.tile, budget=self.reuse_budget,
                                         min_tokens=self.min_tokens, K=Kr, dense_output=dense, block_size=bs)
                return out, wide
            return fn

        def reuse():
            idx = jnp.take(state.indices, ctx.info.head_map, axis=1)
            return sparse_prefill(q, k, v, idx, ctx.lengths, tile=self.tile, block_size=bs), state.indices

        out, idx = jax.lax.switch(ctx.info.role, [anchor(True), anchor(False), reuse])
        return out, KascadeState(indices=idx)

    def decode(self, ctx, q, cache, state):
        T, N = q.shape[1], cache.k.shape[2]
        K, Kr = self.k_static(N), self.k_reuse(N)
        indices = state.indices

        def anchor(dense: bool):
            def fn():
                out, idx = topk_decode(q, cache, ctx.lengths, budget=self.budget, min_tokens=self.min_tokens, K=K,
                                       tile=self.tile, dense=dense)
                if self.reuse_scale != 1.0:  # the wider set for the reuse layers
                    _, idx = topk_decode(q, cache, ctx.lengths, budget=self.reuse_budget, min_tokens=self.min_tokens,
                                         K=Kr, tile=self.tile, dense=dense, attend=False)
                return out, idx
            return fn

        def reuse():
            # In the layer scan (the stacked cache view) every layer's map goes to the gathered kernel, which reads
            # this layer's row itself: the per-layer slice of the map was an XLA kernel in every reuse layer.
            head_map = self.head_map if getattr(cache, "layer", None) is not None else ctx.info.head_map
            return attend_selected(q, cache, indices, ctx.lengths, head_map=head_map), indices

        branches = [anchor(True), anchor(False), reuse]
        tag = getattr(ctx, "segment", None)
        if tag in ROLE_TAGS:  # a run of layers of one role (`segments`): that role's kernels, no conditional
            out, idx = branches[ROLE_TAGS.index(tag)]()
        else:
            out, idx = jax.lax.switch(ctx.info.role, branches)
        return out, KascadeState(indices=idx)


# ----------------------------------------------------------------------------------------------- compressed coordinates
# Inside TSA (`tsa+kascade`) each layer attends over its own compressed sequence, so an anchor's selected keys
# (positions in the anchor layer's compressed sequence) mean other tokens in a reuse layer's. Before a reuse layer
# the anchor's keys go to original positions, then into this layer's compressed positions (keys this layer dropped
# are dropped), each compressed query tile taking the anchor row of the tile that holds its first query. That
# anchor tile attended its own earlier slots densely (its diagonal tile), and a compressed tile of this layer may
# start in the middle of it: those slots, the tokens just before the tile, are added to the row (at most `tile`
# keys), or every tile starting mid-way would lose its most recent context. With identical coordinates (both
# layers dense) the added slots all lie in the tile itself, so `tsa+kascade` with tau = 0 is Kascade.


def anchors_read_by(roles: Array, layers: Array) -> Array:
    """The anchors that the given layers reuse: roles i32[L] (ROLE_*), layers bool/int[L] (nonzero: a layer of
    interest) -> i32[L], 1 for each anchor that some reuse layer of interest reads (its latest anchor at or before
    it). Works on traced arrays (jnp)."""
    L = roles.shape[0]
    pos = jnp.arange(L, dtype=jnp.int32)
    anchor_of = jax.lax.cummax(jnp.where(roles == ROLE_REUSE, 0, pos))  # the latest anchor at or before each layer
    reading = (roles == ROLE_REUSE) & (jnp.asarray(layers) != 0)
    return jnp.zeros((L,), jnp.int32).at[anchor_of].max(reading.astype(jnp.int32))


def translate_anchor_indices(anchor_idx: Array, anchor_map: Array, head_map: Array, cur_map: Array,
                             cur_slot: Array, tile: int) -> Array:
    """Kascade anchor indices from the anchor layer's compressed coordinates to this layer's.

    Args:
      anchor_idx: i32[B, Hkv, nT, K] the anchor's selection (its compressed positions, -1 padded), one row per
        compressed query tile of the anchor layer.
      anchor_map: i32[B, Hkv, T] original position of each anchor slot (T for empty slots).
      head_map: i32[Hkv] the anchor KV head each of this layer's KV heads reuses.
      cur_map: i32[B, Hkv, T] original position of each of this layer's slots (T for empty slots).
      cur_slot: i32[B, Hkv, T] this layer's slot of each original position (-1 if not kept).
      tile: Kascade's query tile.

    Returns:
      i32[B, Hkv, nT, K + tile] in this layer's compressed positions, ascending, -1 padded, already head-mapped
      (use them with an identity head map): for each of this layer's query tiles, with p0 the original position
      of its first query and t the anchor tile holding the anchor's last slot at or before p0, the keys of anchor
      row t and the anchor's slots of tile t before p0, those this layer kept. Every key lies strictly before its
      tile's first query.
    """
    B, Hkv, nT, K = anchor_idx.shape
    T = anchor_map.shape[-1]
    a_idx = jnp.take(anchor_idx, head_map, axis=1)
    a_map = jnp.take(anchor_map, head_map, axis=1)
    first = jnp.minimum(jnp.arange(nT, dtype=jnp.int32) * tile, T - 1)
    p0 = cur_map[:, :, first]  # [B, Hkv, nT] original position of each tile's first query
    search = jax.vmap(jax.vmap(lambda a, v: jnp.searchsorted(a, v, side="right")))
    a_pos = jnp.clip(search(a_map, p0) - 1, 0, T - 1)  # the anchor slot at or before p0
    rows = jnp.take_along_axis(a_idx, (a_pos // tile)[..., None], axis=2)  # [B, Hkv, nT, K]
    # The anchor tile's own slots up to a_pos (its dense diagonal part), as anchor slots.
    diag = (a_pos // tile * tile)[..., None] + jnp.arange(tile, dtype=jnp.int32)  # [B, Hkv, nT, tile]
    slots = jnp.concatenate([rows, jnp.where(diag <= a_pos[..., None], diag, -1)], axis=-1)
    valid = (slots >= 0) & (slots < T)
    orig = jnp.take_along_axis(a_map, jnp.where(valid, slots, 0).reshape(B, Hkv, -1), axis=2)
    valid = valid & (orig.reshape(slots.shape) < T)
    cur = jnp.take_along_axis(cur_slot, jnp.minimum(orig, T - 1), axis=2).reshape(slots.shape)
    valid = valid & (cur >= 0) & (cur < first[:, None])  # kept here, strictly before this tile
    big = jnp.iinfo(jnp.int32).max
    cur = jnp.sort(jnp.where(valid, cur, big), axis=-1)
    return jnp.where(cur == big, -1, cur).astype(jnp.int32)


def prefill_in_coordinates(inner: Kascade, ctx, q: Array, k: Array, v: Array, state: KascadeState,
                    anchor_map: Array, cur_map: Array, cur_slot: Array):
    """Kascade's prefill of one layer in (possibly compressed) coordinates (TSA around Kascade, `tsa_kascade`).

    Args:
      inner: the Kascade method; ctx: the layer context with Kascade's layer info (`ctx.info`: LayerRole slice);
      q, k, v: the layer's (compressed) sequence, [B, C, Hq, D] and [B, C, Hkv, D], C <= T (TSA's capacity);
      state: Kascade's state, shaped for the T-query prefill (the latest anchor's indices in the anchor layer's
      coordinates, -1 padded; an anchor at C slots selects at most k_reuse(C) keys for ceil(C / tile) rows);
      anchor_map: i32[B, Hkv, T] original position of each slot of the latest anchor layer; cur_map, cur_slot:
      i32[B, Hkv, T] original position of each of this layer's slots (T: empty, and every slot past C) and slot of
      each original position (-1: not kept).
    Returns:
      (out: [B, C, Hq, D], Kascade's new state, the new anchor_map).
    """
    if inner.prefill_block_size != 1:
        raise ValueError(f"tsa+kascade with prefill_block_size={inner.prefill_block_size}: TSA's compressed "
                         f"coordinates move single tokens, so Kascade inside TSA selects tokens only (expected "
                         f"prefill_block_size=1)")
    info = ctx.info
    reuse = info.role == ROLE_REUSE
    full = state.indices  # shaped for the T-query prefill (`start`); C <= T compressed slots run here
    rows, width = inner.prefill_rows(q.shape[1], q.shape[1])

    def reuse_layer():  # the anchor's keys, translated (`translate_anchor_indices`); the anchor state stays
        idx = translate_anchor_indices(full, anchor_map, info.head_map, cur_map, cur_slot, inner.tile)
        return sparse_prefill(q, k, v, idx[:, :, :rows], ctx.lengths, tile=inner.tile), full

    def anchor_layer():  # Kascade's own prefill at C slots; its indices padded back to the T-shaped state
        at_c = full[:, :, :rows, :width]
        out, new = inner.prefill(ctx, q, k, v, KascadeState(indices=at_c))
        pad = [(0, 0), (0, 0), (0, full.shape[2] - new.indices.shape[2]), (0, full.shape[3] - new.indices.shape[3])]
        return out, jnp.pad(new.indices, pad, constant_values=-1)

    out, indices = jax.lax.cond(reuse, reuse_layer, anchor_layer)
    return out, KascadeState(indices=indices), jnp.where(reuse, anchor_map, cur_map)

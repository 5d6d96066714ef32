"""XLA fallback of the block_scores ops (any backend). Slicing the layer out of the stacked cache copies it
inside a layer scan; that is acceptable off the GPU, where these run (CPU tests and evaluation)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.block_scores.reference import check_block_max_args
from pallas_kernels.sharding import dims, per_shard
from pallas_kernels.sparse_attention import sparse_decode
from pallas_kernels.sparse_attention.common import default_scale
from pallas_kernels.sparse_attention.stacked import check_stacked_args, layer_index
from pallas_kernels.topk_select import topk_select

Array = jax.Array


@functools.partial(jax.jit, static_argnames=("block_size", "scale"))
def block_max_scores_xla(q: Array, k_all: Array, layer: Array, kv_heads: Array, head_mask: Array, positions: Array,
                         lo: Array, hi: Array, *, block_size: int, scale: float | None = None) -> Array:
    """`reference.block_max_scores_reference` with one gather of the R KV heads and the input precision."""
    check_block_max_args(q, k_all, layer, kv_heads, head_mask, positions, lo, hi, block_size)
    B, T, Hq, D = q.shape
    L, _, Hkv, N, _ = k_all.shape
    G, nb = Hq // Hkv, N // block_size
    scale = default_scale(D, scale)
    kvh = jnp.clip(kv_heads.astype(jnp.int32), 0, Hkv - 1)
    k = k_all[layer_index(layer, L), :, kvh]  # [R, B, N, D]
    qr = jnp.take(q.reshape(B, T, Hkv, G, D), kvh, axis=2)  # [B, T, R, G, D]
    s = jnp.einsum("btrgd,rbnd->btrgn", qr, k.astype(q.dtype), preferred_element_type=jnp.float32) * scale
    s = jnp.where(head_mask[None, None, :, :, None], s, -jnp.inf).max(axis=(2, 3))  # [B, T, N]
    s = jnp.where(jnp.arange(N)[None, None] <= positions[..., None], s, -jnp.inf)
    s = s.reshape(B, T, nb, block_size).max(axis=-1)
    j = jnp.arange(nb)[None, None]
    return jnp.where((j >= lo[..., None]) & (j < hi[..., None]), s, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("block_size", "scale"))
def sparse_decode_mass_xla(q: Array, k_all: Array, v_all: Array, layer: Array, indices: Array, lengths: Array, *,
                           block_size: int = 1, scale: float | None = None):
    """Gathered decode (`sparse_decode(implementation="xla")`) and the entry mass recomputed from its lse (one
    more gather of the selected K rows)."""
    check_stacked_args(q, k_all, v_all, layer, indices, lengths, block_size)
    B, T, Hq, D = q.shape
    L, _, Hkv, N, _ = k_all.shape
    G, K, bs, nb = Hq // Hkv, indices.shape[-1], block_size, N // block_size
    sc = default_scale(D, scale)
    out, lse = sparse_decode(q, k_all, v_all, indices, lengths, layer=layer, block_size=bs, scale=scale,
                             return_lse=True, implementation="xla")
    kb = k_all.reshape(L, B, Hkv, nb, bs, D)
    bi, hi = jnp.arange(B)[:, None, None, None], jnp.arange(Hkv)[None, :, None, None]
    kg = kb[layer_index(layer, L), bi, hi, jnp.clip(indices, 0, nb - 1)]  # [B, Hkv, T, K, bs, D]
    qg = q.reshape(B, T, Hkv, G, D)
    s = jnp.einsum("bthgd,bhtksd->bhtgks", qg, kg.astype(q.dtype), preferred_element_type=jnp.float32) * sc
    pos = lengths.astype(jnp.int32)[:, None] - T + jnp.arange(T)  # [B, T]
    tok = indices[..., None] * bs + jnp.arange(bs)  # [B, Hkv, T, K, bs]
    valid = (indices[..., None] >= 0) & (tok <= pos[:, None, :, None, None]) & (tok < N)  # as sparse_decode
    lse_g = lse.reshape(B, T, Hkv, G).transpose(0, 2, 1, 3)[..., None, None]  # [B, Hkv, T, G, 1, 1]
    p = jnp.where(valid[:, :, :, None] & jnp.isfinite(lse_g), jnp.exp(s - lse_g), 0.0)
    return out, p.sum(-1).mean(axis=3)


def heat_add(heat: Array, layer: Array, idx: Array, values: Array) -> Array:
    """heat[layer] + values summed into their blocks, in place in the stacked heat f32[L, B, Hkv, nb]: idx
    i32[B, Hkv, K] (valid entries unique and ascending, then -1), values f32[B, Hkv, K]. One scatter-add of
    B * Hkv * K entries (the -1 padding is mapped to distinct out-of-range blocks and dropped, so the indices are
    sorted and unique, as XLA is told)."""
    B, Hkv, K = idx.shape
    nb = heat.shape[-1]
    safe = jnp.where(idx >= 0, idx, nb + jnp.arange(K, dtype=idx.dtype))
    at = (jnp.broadcast_to(layer_index(layer, heat.shape[0]), idx.shape),
          jnp.broadcast_to(jnp.arange(B)[:, None, None], idx.shape),
          jnp.broadcast_to(jnp.arange(Hkv)[None, :, None], idx.shape), safe)
    return heat.at[at].add(values.astype(heat.dtype), mode="drop", indices_are_sorted=True, unique_indices=True)


@functools.partial(jax.jit, static_argnames=("block_size", "scale"))
def sparse_decode_heat_xla(q: Array, k_all: Array, v_all: Array, layer: Array, indices: Array, lengths: Array,
                           heat: Array, heat_layer: Array | None = None, *, block_size: int = 1,
                           scale: float | None = None):
    """`sparse_decode_mass_xla` of one decode token, its entry mass added into heat[heat_layer] (`heat_add`)."""
    out, mass = sparse_decode_mass_xla(q, k_all, v_all, layer, indices, lengths, block_size=block_size,
                                       scale=scale)
    return out, heat_add(heat, layer if heat_layer is None else heat_layer, indices[:, :, 0], mass[:, :, 0])


def merge_disjoint(cand: Array, width: int) -> Array:
    """The entries of cand: i32[..., W] (distinct non-negative values and -1 padding), ascending then -1 padded,
    as i32[..., width] (width >= the count of valid entries). Ranks by comparison and a one-hot reduce (no sort,
    no scatter): entry x goes to slot #(valid entries < x)."""
    valid = cand >= 0
    big = jnp.iinfo(jnp.int32).max
    key = jnp.where(valid, cand, big)
    rank = jnp.sum((key[..., None, :] < key[..., :, None]).astype(jnp.int32), axis=-1)  # [..., W]
    rank = jnp.where(valid, rank, width)  # padding: no slot
    slot = jnp.arange(width, dtype=jnp.int32)[:, None]
    hit = rank[..., None, :] == slot  # [..., width, W]
    return jnp.sum(jnp.where(hit, cand[..., None, :] + 1, 0), axis=-1).astype(jnp.int32) - 1


def select_blocks_xla(heat: Array | None, ret: Array | None, n_s: Array, hi: Array, nbv: Array, count: Array,
                      full: Array, *, num_kv_heads: int, nb: int, width: int, heat_width: int,
                      layer: Array | None = None) -> Array:
    """EvoSparse's attended blocks of one decode row (the specification of `select_blocks`).

    Sink [0, n_s) and local [hi, nbv) are ranges; the retrieval blocks ret and the heat blocks lie between them
    and are disjoint (heat picks among the middle blocks [n_s, hi) that are not in ret: the `count` hottest,
    at most heat_width, ties by position), so the union is sink, then the two middle lists merged by rank
    (`merge_disjoint`: comparisons, no sort), then local. Rows with full=True take every visible block.

    Args:
      heat: f32[B, Hkv, nb] the layer's heat, or None (no heat blocks); ret: i32[B, Wr] the retrieval set
        (valid entries unique and ascending, then -1; entries outside the middle count as none), or None.
      n_s, hi, nbv, count: i32[B]; full: bool[B].
      width: blocks per output row (Kb); heat_width: most heat picks.
      layer: i32[] or None; given, heat is the stacked heat f32[L, B, Hkv, nb] and its row `layer` is used.

    Returns:
      i32[B, Hkv, width]: the blocks ascending, then -1 (entries past `width` are dropped).
    """
    B, Hkv, Kb = n_s.shape[0], num_kv_heads, width
    if heat is not None and layer is not None:
        heat = heat[layer_index(layer, heat.shape[0])]
    mids = []
    if ret is not None:  # entries outside the middle are none of its blocks (sink / local already, or unseen)
        ret = jnp.where((ret >= n_s[:, None]) & (ret < hi[:, None]), ret, -1)
        mids.append(jnp.broadcast_to(ret[:, None], (B, Hkv, ret.shape[-1])))
    if heat is not None:
        blk = jnp.arange(nb, dtype=jnp.int32)[None]
        middle = (blk >= n_s[:, None]) & (blk < hi[:, None])  # [B, nb]
        if ret is not None:
            middle = middle & ~jnp.any(ret[:, :, None] == blk[:, None, :], axis=1)
        scores = jnp.where(middle[:, None], heat, -jnp.inf)
        mids.append(topk_select(scores, jnp.broadcast_to(count[:, None], (B, Hkv)), heat_width))
    return _assemble(mids, n_s, hi, nbv, full, B, Hkv, Kb)


def _assemble(mids: list, n_s: Array, hi: Array, nbv: Array, full: Array, B: int, Hkv: int, Kb: int) -> Array:
    """Sink [0, n_s), the middle lists `mids` (disjoint entries, -1 padded) merged ascending, local [hi, nbv),
    then -1; every visible block on full rows: i32[B, Hkv, Kb]."""
    j = jnp.arange(Kb, dtype=jnp.int32)[None, None]
    n_s3, hi3, nbv3 = n_s[:, None, None], hi[:, None, None], nbv[:, None, None]
    if mids:
        cand = jnp.concatenate(mids, axis=-1)
        n_mid = jnp.sum(cand >= 0, axis=-1, keepdims=True)  # [B, Hkv, 1]
        mid = merge_disjoint(cand, Kb)
        mid_j = jnp.take_along_axis(mid, jnp.clip(j - n_s3, 0, Kb - 1), axis=-1)
    else:
        n_mid, mid_j = jnp.zeros_like(n_s3), jnp.zeros_like(j)
    after = j - n_s3 - n_mid  # position inside the local range
    idx = jnp.where(j < n_s3, j, jnp.where(after < 0, mid_j, jnp.where(after < nbv3 - hi3, hi3 + after, -1)))
    every = jnp.where(j < nbv3, j, -1)
    return jnp.broadcast_to(jnp.where(full[:, None, None], every, idx), (B, Hkv, Kb)).astype(jnp.int32)


def heat_candidates(heat: Array, n_s: Array, hi: Array, k: Array, width: int) -> Array:
    """The `k` hottest middle blocks [n_s, hi) of every heat row, ascending (ties to the lower block), -1
    padded: heat f32[..., B, Hkv, nb], n_s, hi, k i32[B] -> i32[..., B, Hkv, width]. With k = n_h + n_r they
    hold every block `select_blocks` can pick by heat, whatever the retrieval set (see
    `select_from_candidates`).

    Under a mesh (`pallas_kernels.sharding`) it runs per shard, rows over data and KV heads over model, as the heat
    is laid out (XLA's partitioner would all-gather the whole heat for the top-k)."""
    nd = heat.ndim
    return per_shard(lambda heat, n_s, hi, k: _heat_candidates(heat, n_s, hi, k, width), [heat, n_s, hi, k],
                     [dims(nd, nd - 3, nd - 2)] + [dims(1, 0)] * 3, dims(nd, nd - 3, nd - 2))


def _heat_candidates(heat: Array, n_s: Array, hi: Array, k: Array, width: int) -> Array:
    # The middle [n_s, hi) as the top-k's span: on a GPU its kernels read the heat in place (a masked copy of it
    # was 410 MB and 0.19 ms a step for H2O's token scores at 100K, batch 4: eval/results/h200/profile_100k_b4/).
    lead = heat.shape[:-1]
    return topk_select(heat, jnp.broadcast_to(k[:, None], lead), width,
                       span=(jnp.broadcast_to(n_s[:, None], lead), jnp.broadcast_to(hi[:, None], lead)))


def select_from_candidates_xla(heat: Array, cand: Array, ret: Array | None, n_s: Array, hi: Array, nbv: Array,
                               count: Array, full: Array, *, num_kv_heads: int, width: int, heat_width: int,
                               layer: Array | None = None, count_less_ret: bool = False) -> Array:
    """`select_blocks_xla` given each row's heat candidates (`heat_candidates` with k >= count + the retrieval
    blocks in the middle): the `count` hottest candidates outside the retrieval set (ties to the lower block)
    by pairwise ranks over the few candidates, instead of a top-k over every block.

    Args: as `select_blocks_xla`, plus cand i32[B, Hkv, Wc] (or [L, B, Hkv, Wc] with `layer`, like heat);
    count_less_ret: `count` is before the retrieval set, whose valid entries (ret >= 0, wherever they lie) are
    subtracted here (EvoSparse's heat also fills the retrieval slots the set left empty).
    """
    B, Hkv = n_s.shape[0], num_kv_heads
    if count_less_ret and ret is not None:
        count = count - jnp.sum(ret >= 0, axis=-1)
    if layer is not None:
        heat = heat[layer_index(layer, heat.shape[0])]
        cand = cand[layer_index(layer, cand.shape[0])]
    valid = (cand >= n_s[:, None, None]) & (cand < hi[:, None, None])
    mids = []
    if ret is not None:
        ret = jnp.where((ret >= n_s[:, None]) & (ret < hi[:, None]), ret, -1)
        mids.append(jnp.broadcast_to(ret[:, None], (B, Hkv, ret.shape[-1])))
        valid = valid & ~jnp.any((cand[..., None] == ret[:, None, None, :]) & (ret >= 0)[:, None, None, :], -1)
    hv = jnp.take_along_axis(heat, jnp.clip(cand, 0, heat.shape[-1] - 1), axis=-1)
    hj, hi_, cj, ci = hv[..., None, :], hv[..., :, None], cand[..., None, :], cand[..., :, None]
    better = valid[..., None, :] & ((hj > hi_) | ((hj == hi_) & (cj < ci)))  # [B, Hkv, i, j]
    rank = jnp.sum(better, axis=-1)
    chosen = valid & (rank < jnp.clip(count, 0, heat_width)[:, None, None])
    mids.append(jnp.where(chosen, cand, -1))
    return _assemble(mids, n_s, hi, nbv, full, B, Hkv, width)

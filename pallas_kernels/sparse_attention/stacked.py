"""Gathered sparse decode that reads one layer of the stacked KV cache in place.

Inside the model's decode scan the cache is one stacked array per K and V, [L, B, Hkv, N, D], and the layer
index is traced. Handing a kernel the slice `k_all[layer]` makes XLA materialise it (a copy of the layer's
whole cache, every layer, every step) because a custom call cannot fuse a dynamic slice. These variants take
the stacked cache and the layer index instead and read only the selected rows of that layer:

  sparse_decode_stacked_gpu(q, k_all, v_all, layer, indices, lengths)   Pallas Triton: `layer` enters as an
      i32[1] input; the K/V BlockSpec spans the whole L axis of the program's (b, kv head), and the gather
      indexes `k_ref[layer, rows, :]` (one indexer, so the pointer is offset by layer * B * Hkv * N * D,
      64-bit when the array is over 4 GiB). No XLA work precedes the launch (the layer is wrapped and clamped,
      the positions come from the lengths, each split finds its useful length from its own entries of the
      unpadded index row, the GQA group's query rows are gathered in-kernel); only the split combine follows.
      With head_map (i32[Hkv]) KV head h reads the index row of head head_map[h] (Kascade's reuse layers);
      with every layer's map i32[L, Hkv] the kernel reads the layer's row itself (no XLA op on the map either).
  sparse_decode_stacked_tpu(q, k_all, v_all, layer, indices, lengths)   Pallas TPU: `layer` is one more
      scalar-prefetch argument and the K/V index maps return (layer, b, h, block, 0), so the pipeline DMAs
      the selected [block_size, D] blocks of that layer only.
  sparse_decode_stacked_reference(...)                                    slices, then the reference.

Semantics: exactly `sparse_decode_reference(q, k_all[layer], v_all[layer], indices, lengths)`; `layer`
follows jnp indexing of a traced index (negative counts from the end, then clamped to [0, L - 1], as XLA's
dynamic slice does), so no value of it reads out of bounds. The kernels' inner loops are those of gpu.py /
tpu.py; only the addressing of K/V differs.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.layers import check_layer, layer_index, select_layer  # noqa: F401  (re-exported)
from pallas_kernels.sparse_attention import gpu, reference, tpu
from pallas_kernels.sparse_attention.common import blocks_at_or_before, check_decode_args, default_scale, query_rows
from pallas_kernels.sparse_attention.gpu_common import entry_rows, group_query_rows

Array = jax.Array


# ---------------------------------------------------------------------------------------------------------
# Arguments.


def check_stacked_args(q: Array, k_all: Array, v_all: Array, layer: Array, indices: Array, lengths: Array,
                       block_size: int, stacked_indices: bool = False, shared_rows: bool = False) -> None:
    """Validates a stacked-cache decode call: k_all, v_all [L, B, Hkv, N, D], layer an integer scalar, and the
    per-layer arguments as `check_decode_args` (with stacked_indices, indices [L, B, Hkv, T, K]: every layer's
    rows, of which the call reads layer `layer`'s; with shared_rows also one row for all T queries)."""
    if k_all.ndim != 5:
        raise ValueError(f"k_all has shape {tuple(k_all.shape)}: expected a stacked head-major cache "
                         f"[L, B, Hkv, N, D]")
    if v_all.shape != k_all.shape:
        raise ValueError(f"v_all has shape {tuple(v_all.shape)}: expected the shape of k_all, {tuple(k_all.shape)}")
    check_layer(layer, k_all.shape[0])
    one = jax.ShapeDtypeStruct(k_all.shape[1:], k_all.dtype)
    if stacked_indices:
        if indices.ndim != 5 or indices.shape[0] != k_all.shape[0]:
            raise ValueError(f"indices has shape {tuple(indices.shape)}: expected every layer's index rows "
                             f"[L={k_all.shape[0]}, B, Hkv, T, K]")
        indices = jax.ShapeDtypeStruct(indices.shape[1:], indices.dtype)
    check_decode_args(q, one, one, indices, lengths, block_size, shared_rows=shared_rows)


def check_head_map(head_map, num_kv_heads: int, num_layers: int | None = None) -> None:
    """head_map: i32[Hkv] with values in [0, Hkv), or with num_layers (a stacked cache's layers) also every
    layer's map i32[L, Hkv]: checked when its values are known (not traced); a traced map's values outside are
    clipped, by the kernel and by the XLA paths alike."""
    hm = jnp.asarray(head_map)
    shapes = [(num_kv_heads,)] + ([] if num_layers is None else [(num_layers, num_kv_heads)])
    if hm.shape not in shapes or not jnp.issubdtype(hm.dtype, jnp.integer):
        want = f"[Hkv={num_kv_heads}]" + ("" if num_layers is None else f" or [L={num_layers}, Hkv={num_kv_heads}]")
        raise ValueError(f"head_map has shape {tuple(hm.shape)} and dtype {hm.dtype}: expected an integer {want} "
                         "array")
    if not isinstance(head_map, jax.core.Tracer):
        values = np.asarray(head_map)
        if values.size and (values.min() < 0 or values.max() >= num_kv_heads):
            raise ValueError(f"head_map={values.tolist()}: expected values in [0, Hkv={num_kv_heads})")


def sparse_decode_stacked_reference(q: Array, k_all: Array, v_all: Array, layer: Array, indices: Array,
                                    lengths: Array, *, block_size: int = 1, scale: float | None = None,
                                    return_lse: bool = False) -> Array | tuple[Array, Array]:
    """The specification: slice the layer, then `reference.sparse_decode_reference`."""
    check_stacked_args(q, k_all, v_all, layer, indices, lengths, block_size)
    return reference.sparse_decode_reference(q, select_layer(k_all, layer), select_layer(v_all, layer), indices,
                                             lengths, block_size=block_size, scale=scale, return_lse=return_lse)


# ---------------------------------------------------------------------------------------------------------
# Pallas GPU (Triton).


def row_entries(ent_ref, head, idx, valid):
    """Index entries at positions idx (a pl.ds or an i32 vector) of the row, -1 where not valid; ent_ref is the
    row [K], or a table of rows [R, K] (every KV head's, or every layer's) with head the row (i32 scalar). One
    indexer per load (Triton's lowering)."""
    ref = ent_ref.at[idx] if head is None else ent_ref.at[head, idx]
    return plgpu.load(ref, mask=valid, other=-1)


def _gather_rows_stacked(ent_ref, k_ref, v_ref, layer, first_entry, n_valid, limit, block_size: int, block_k: int,
                         head=None):
    """`gpu._gather_rows` on a stacked ref: k_ref, v_ref [L, N, D]; rows of layer `layer` (an i32 scalar); the
    entries first_entry .. first_entry + block_k / block_size of the row (those at or past n_valid read as -1).

    Returns:
      (ok: bool[block_k], tok: i32[block_k] the lanes' tokens (0 where not ok), k: [block_k, D], v: [block_k, D]);
      rows not ok read row 0 of the layer.
    """
    lane = jnp.arange(block_k, dtype=jnp.int32)
    if block_size == 1:
        ent = row_entries(ent_ref, head, pl.ds(first_entry, block_k), first_entry + lane < n_valid)
    else:
        e = first_entry + lane // block_size
        ent = row_entries(ent_ref, head, e, e < n_valid)
    ok, safe = entry_rows(ent, lane, limit, block_size)
    # One indexer (layer, rows, :): Triton lowering supports a single indexer per load.
    return ok, safe, k_ref[layer, safe, :], v_ref[layer, safe, :]


def _decode_kernel_stacked(*refs, scale: float, block_size: int, block_k: int, entries_per_split: int, K: int,
                           T: int, N: int, L: int, G: int, Hkv: int = 1, mapped: bool = False,
                           stacked_map: bool = False, mass: bool = False, stacked_indices: bool = False,
                           shared: bool = False, finish=None, finish_inputs: int = 0, layer_partials: bool = False):
    """One (b, h, t, split) program; as `gpu._decode_kernel` with k_ref, v_ref: [L, N, D] and layer_ref: i32[1].
    Shared (one index row for all T queries): one (b, h, 0, split) program attends the T x G query rows
    r = t * G + g (q_ref [T * Hq, D]) over the gathered keys, each row masked at its own position, so the keys
    are read once for the T queries instead of once per query.

    Refs: ([hm_ref,] layer_ref, len_ref, ent_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref[, el_ref, em_ref,
    nw_ref]). Everything XLA used to prepare is done here: the layer index is wrapped and clamped (jnp
    semantics), the query's last visible token comes from the row's length, the split's entries are read from
    the unpadded row [K] (or, mapped, the row of head hm_ref[h] of [Hkv, K], hm_ref i32[Hkv] or with stacked_map
    every layer's map i32[L, Hkv] read at the layer, its value clipped to [0, Hkv); with stacked_indices, the row of
    the layer of [L, K], every layer's rows read in place) and the split's useful length is
    found from them (no padded copy of the indices, no reduction over them in XLA), and the GQA group's queries
    are gathered from q [Hq, D] (rows past G repeat row G - 1; their outputs are dropped).
    With mass, el_ref f32[Gp, E]: per index entry of the split, the sum of exp(s - m) over the entry's tokens, and
    em_ref f32[Gp, E // per_iter]: that m per iteration (the running max after the iteration, shared by its
    per_iter = block_k // block_size entries: one column an iteration, not one an entry), written for the entries
    before nw_ref i32[1] (what this program wrote; the rest of the block is garbage).
    With finish (a callable; mass only): `finish_inputs` more input refs after v_ref and more output refs after
    nw_ref; the partials' and mass blocks hold every split of the (b, h, t) row ([S, ...], this program's at its
    split), and after storing them the program calls finish(ins, outs, partials, entries): ins and outs those
    extra refs, partials (o, m, l, el, em, nw refs), entries(idx, valid) the row's index entries at idx (-1 where
    not valid) (`block_scores.gpu`'s one-launch heat update). With layer_partials (finish only): the partials' and
    mass refs hold every layer's [L, S, ...] (written in place at this layer: `decode_partials_stacked`'s partials),
    after as many aliased input refs, which the program skips.
    """
    head = None
    if mapped:
        hm_ref, *refs = refs
    layer_ref, len_ref, ent_ref, q_ref, k_ref, v_ref, *refs = refs
    ins, refs = refs[:finish_inputs], refs[finish_inputs:]
    if layer_partials:  # the aliased inputs of every layer's partials: written through their outputs
        refs = refs[_PARTIALS:]
    o_ref, m_ref, l_ref, *mass_refs = refs
    mass_refs, outs = mass_refs[:3], mass_refs[3:]
    layer = layer_index(layer_ref[0], L)
    if mapped:  # the map's row of this layer (every layer's map, read in place) or the one layer's map
        head = jnp.clip(hm_ref[layer, pl.program_id(1)] if stacked_map else hm_ref[pl.program_id(1)], 0, Hkv - 1)
    if stacked_indices:
        head = layer  # the row of ent_ref [L, K] (`_entries`)
    split = pl.program_id(3)
    # Where this program's partials go in their blocks: its own block, its split of the row's, or its layer's split.
    at = () if finish is None else (layer, split) if layer_partials else (split,)
    pos = len_ref[0] - (1 if shared else T - pl.program_id(2))  # shared: the last query's (the rows mask their own)
    limit = jnp.minimum(pos, N - 1)
    per_iter = block_k // block_size
    E = entries_per_split
    base = split * E
    n_valid = jnp.minimum(K, base + E)  # entries of this split: [base, n_valid)
    # The split's useful length: 1 + its last entry whose block starts at or before the query.
    Ep = max(16, pl.next_power_of_2(E))
    j = jnp.arange(Ep, dtype=jnp.int32)
    e = row_entries(ent_ref, head, pl.ds(base, Ep), base + j < n_valid)
    useful = blocks_at_or_before(e, limit, block_size)
    n_entries = jnp.max(jnp.where(useful, j + 1, 0))
    rows = T * G if shared else G  # shared: q_ref [T * Hq, D], row t * G + g; else the token's q_ref [Hq, D]
    lane = jnp.arange(max(gpu._MIN_ROWS, pl.next_power_of_2(rows)), dtype=jnp.int32)
    q, t_r = group_query_rows(q_ref, lane, rows, G, T if shared else 1, pl.program_id(1))  # [Mp, D]
    row_limit = jnp.minimum(len_ref[0] - T + t_r, N - 1) if shared else None  # each row's last visible token
    gp, d = q.shape

    def body(it, carry):
        ok, tok, k, v = _gather_rows_stacked(ent_ref, k_ref, v_ref, layer, base + it * per_iter, n_valid, limit,
                                             block_size, block_k, head)
        if not mass:
            seen = ok[None, :] & (tok[None, :] <= row_limit[:, None]) if shared else ok[None, :]
            return gpu._online_softmax_step(q, k, v, seen, carry, scale)
        o, m, l = carry
        s = plgpu.dot(q, k, trans_b=True) * scale  # [Gp, block_k] f32
        s = jnp.where(ok[None, :], s, gpu._MASK)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.where(ok[None, :], jnp.exp(s - m_new[:, None]), 0.0)
        l = corr * l + jnp.sum(p, axis=1)
        o = corr[:, None] * o + plgpu.dot(p.astype(v.dtype), v)
        pe = p if block_size == 1 else jnp.sum(p.reshape(gp, per_iter, block_size), axis=2)  # [Gp, per_iter]
        el_ref, em_ref, _ = mass_refs
        cols = pl.ds(it * per_iter, per_iter)
        real = jnp.broadcast_to((lane < G)[:, None], (gp, per_iter))  # padding rows are never read
        plgpu.store(el_ref.at[at + (slice(None), cols)], pe, mask=real)
        plgpu.store(em_ref.at[at + (slice(None), pl.ds(it, 1))], m_new[:, None], mask=(lane < G)[:, None])
        return o, m_new, l

    init = (jnp.zeros((gp, d), jnp.float32), jnp.full((gp,), gpu._MASK, jnp.float32),
            jnp.zeros((gp,), jnp.float32))
    iters = pl.cdiv(n_entries, per_iter)
    o, m, l = jax.lax.fori_loop(jnp.int32(0), iters, body, init)
    gpu.store_partials(o_ref, m_ref, l_ref, o, m, l, rows, at)
    if mass:
        plgpu.store(mass_refs[2].at[at + (pl.ds(0, 1),)], jnp.full((1,), iters * per_iter, jnp.int32))
    if finish is not None:
        finish(ins, outs, (o_ref, m_ref, l_ref, *mass_refs), lambda idx, valid: row_entries(ent_ref, head, idx, valid))


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "return_lse", "return_mass", "config",
                                             "query_heads", "interpret"))
def sparse_decode_stacked_gpu(q: Array, k_all: Array, v_all: Array, layer: Array, indices: Array, lengths: Array,
                              *, block_size: int = 1, scale: float | None = None, return_lse: bool = False,
                              return_mass: bool = False, config: gpu.DecodeConfig = gpu.DecodeConfig(),
                              head_map: Array | None = None, query_heads: bool = False,
                              interpret: bool = False) -> Array | tuple[Array, Array]:
    """Gathered decode attention over layer `layer` of a stacked cache, Pallas Triton kernel.

    Args:
      q: [B, T, Hq, D] queries of the T newest tokens (positions lengths - T + t).
      k_all: [L, B, Hkv, N, D] stacked head-major key cache (new tokens written).
      v_all: [L, B, Hkv, N, D] stacked value cache.
      layer: i32[] (traced) layer to read, as `k_all[layer]`.
      indices: int32[B, Hkv, T, K] selected blocks, -1 padded (contract of `reference.py`); or every layer's
        rows int32[L, B, Hkv, T, K], of which layer `layer`'s are read in place (no slice of them in XLA); or
        one row for all T queries, int32[B, Hkv, 1, K] (`shared_rows`): one program per (row, KV head, split)
        attends all T x G query rows, each masked at its own position, so every selected key is read once
        (with head_map, query_heads or more than `SHARED_MAX_ROWS` query rows per KV head the row is broadcast
        to the T queries first; return_mass takes a row per query only).
      lengths: int32[B] valid tokens per row.
      block_size: tokens per index entry (a power of two).
      scale: softmax scale (None: 1/sqrt(D)).
      return_lse: also return f32[B, T, Hq] logsumexp.
      return_mass: also return f32[B, Hkv, T, K], the post-softmax mass of each index entry's tokens, mean over
        the GQA group (0 for padding and invisible entries), from partial sums the kernel keeps while attending
        (no second read of K; EvoSparse's heat).
      config: `gpu.DecodeConfig` (the kernel's tuning, shared with `gpu.sparse_decode_gpu`).
      head_map: i32[Hkv] or None: KV head h attends over the index row of KV head head_map[h] (Kascade's reuse
        layers), read in place: the same as `jnp.take(indices, head_map, axis=1)` without that copy; or every
        layer's map i32[L, Hkv], of which the kernel reads row `layer` (as `layer` indexes the cache): the same as
        head_map[layer] without an XLA slice per layer. Values outside [0, Hkv) are clipped in-kernel. Not with
        return_mass, nor with every layer's rows.
      query_heads: indices int32[B, Hq, T, K] hold one row per query head (Quest's pages, TokenButler's keys):
        one program per query head (grid (B, Hq, T, S)), each reading its KV head's cache in place, in one launch.
        Not with return_mass, head_map or every layer's rows.
      interpret: run in the Pallas interpreter (CPU tests).

    Returns:
      [B, T, Hq, D] in q.dtype, followed by lse: f32[B, T, Hq] with return_lse and by the mass with return_mass.
    """
    B, T, Hq, D = q.shape
    G = 1 if query_heads else Hq // k_all.shape[2]  # query heads: a "group" of one query per program
    # A program per query where one program cannot take the shared row's T x G query rows; the entry mass takes a
    # row per query only (`sparse_decode_mass_reference`'s contract), refused by the launch's check.
    if shared_rows(indices, T) and not return_mass and (head_map is not None or query_heads or too_wide(T, G)):
        indices = query_rows(indices, T)
    res = decode_partials_stacked(q, k_all, v_all, layer, indices, lengths, block_size=block_size, scale=scale,
                                  return_mass=return_mass, config=config, head_map=head_map, query_heads=query_heads,
                                  interpret=interpret)
    Hkv, K = k_all.shape[2], indices.shape[-1]
    o, m, l = res[:3]
    if shared_rows(indices, T):  # one program's rows r = t * G + g: as T programs of G rows each
        S = o.shape[0]
        o = o[:, :, :, 0, :T * G].reshape(S, B, Hkv, T, G, D)
        m, l = (x[:, :, :, 0, :T * G].reshape(S, B, Hkv, T, G) for x in (m, l))
    out, lse = gpu.finish_splits(o, m, l, G, q.dtype)
    extra = []
    if return_lse:
        extra.append(lse.transpose(0, 2, 1, 3).reshape(B, T, Hq))
    if return_mass:
        el, em, nw = res[3:]
        splits, E = el.shape[0], el.shape[-1]
        em = jnp.repeat(em, E // em.shape[-1], axis=-1)  # an iteration's max, for each of its entries
        # Entry j = s * E + e; entries a split did not write are garbage: select, never multiply.
        el = jnp.moveaxis(el[..., :G, :], 0, -2).reshape(B, Hkv, T, G, splits * E)[..., :K]
        em = jnp.moveaxis(em[..., :G, :], 0, -2).reshape(B, Hkv, T, G, splits * E)[..., :K]
        written = jnp.arange(E, dtype=jnp.int32) < nw  # [S, B, Hkv, T, E]: entry e of split s was written
        written = jnp.moveaxis(written, 0, -2).reshape(B, Hkv, T, splits * E)[..., None, :K]  # [B, Hkv, T, 1, K]
        ok = written & jnp.isfinite(lse)[..., None]
        mass = jnp.where(ok, el * jnp.exp(jnp.where(ok, em - lse[..., None], 0.0)), 0.0)
        extra.append(jnp.mean(mass, axis=3))
    return (out, *extra) if extra else out


# Most query rows (T x G, padded to a power of two) one shared-row program takes: its f32 accumulator is
# rows x D on 4 warps, as `gpu.PrefillConfig.gqa_rows`; wider calls get one program per query.
SHARED_MAX_ROWS = 128


def shared_rows(indices: Array, T: int) -> bool:
    """Whether decode index rows [B, Hkv, 1, K] serve T > 1 queries (one row for all of them)."""
    return indices.ndim == 4 and indices.shape[2] == 1 and T > 1


def too_wide(T: int, G: int) -> bool:
    """Whether T x G query rows (padded to a power of two) are more than one shared-row program takes."""
    return pl.next_power_of_2(T * G) > SHARED_MAX_ROWS


# The partial outputs of a mass launch: o, m, l, el, em, nw (`decode_partials_stacked`).
_PARTIALS = 6


class Finish(NamedTuple):
    """An epilogue of the mass launch (`decode_partials_stacked`'s finish): fn(splits, entries_per_split) -> the
    kernel's finish callable (`_decode_kernel_stacked`); in_specs, args: its extra inputs; out_specs,
    out_shape: its extra outputs; aliases: {extra input: extra output} (indices among the extras)."""

    fn: Any
    in_specs: tuple
    args: tuple
    out_specs: tuple
    out_shape: tuple
    aliases: dict


def partial_shapes(q_shape: tuple, K: int, L: int, Hkv: int, *, block_size: int,
                   config: gpu.DecodeConfig) -> tuple:
    """The shapes of every layer's partials of a one-token mass launch over K index entries a row
    (`decode_partials_stacked`'s partials): o f32[L, S, B, Hkv, 1, Gp, D], m, l f32[L, S, B, Hkv, 1, Gp], el f32[L,
    S, B, Hkv, 1, Gp, E], em f32[L, S, B, Hkv, 1, Gp, E // per_iter], nw i32[L, S, B, Hkv, 1, 1], for queries of
    shape q_shape [B, 1, Hq, D] (the split plan of `gpu.decode_split_plan`)."""
    B, T, Hq, D = q_shape
    if T != 1:
        raise ValueError(f"q of shape {tuple(q_shape)}: expected one token [B, 1, Hq, D]")
    block_k, S, E, Gp = gpu.decode_split_plan(config, K, block_size, B * Hkv, Hq // Hkv)
    row = (L, S, B, Hkv, 1)
    f32 = jnp.float32
    return (jax.ShapeDtypeStruct(row + (Gp, D), f32), jax.ShapeDtypeStruct(row + (Gp,), f32),
            jax.ShapeDtypeStruct(row + (Gp,), f32), jax.ShapeDtypeStruct(row + (Gp, E), f32),
            jax.ShapeDtypeStruct(row + (Gp, E // (block_k // block_size)), f32),
            jax.ShapeDtypeStruct(row + (1,), jnp.int32))


def decode_partials_stacked(q: Array, k_all: Array, v_all: Array, layer: Array, indices: Array, lengths: Array,
                            *, block_size: int, scale: float | None, return_mass: bool, config: gpu.DecodeConfig,
                            head_map: Array | None, query_heads: bool = False, interpret: bool,
                            finish: Finish | None = None, partials: tuple | None = None) -> tuple:
    """The launch of `sparse_decode_stacked_gpu` (arguments as there), without its epilogue: the split partials
    (o f32[S, B, H, T, Gp, D], m, l f32[S, B, H, T, Gp], H = Hkv, or Hq with query_heads; rows past G (1 with
    query_heads) are never written) and with return_mass the entry sums el f32[S, B, Hkv, T, Gp, E], their maxima
    em f32[S, B, Hkv, T, Gp, E // per_iter] (one per iteration of per_iter = block_k // block_size entries) and the
    written counts nw i32[S, B, Hkv, T, 1]. With one index row for the T queries ([B, Hkv, 1, K], `shared_rows`;
    not with return_mass, head_map, query_heads or `too_wide` rows) the partials are o f32[S, B, Hkv, 1, Mp, D], m, l
    f32[S, B, Hkv, 1, Mp]: row r = t * G + g of the one program per (b, h, split), rows past T * G never written.
    finish (with return_mass, one layer's rows or every layer's, no head map): the launch also runs that epilogue
    (`Finish`; the partials' blocks then hold every split of a row) and returns its extra outputs after the mass.
    partials (with finish, T = 1): every layer's partials (o, m, l, el, em, nw with a leading L axis, shaped as
    `partial_shapes` gives), written at layer `layer` in place (aliased; the other layers' are kept) and returned
    as the first six outputs, so that a later launch may read a layer's partials after the model's other layers ran
    (`block_scores.gpu.add_pending_mass_gpu`)."""
    stacked = indices.ndim == 5  # every layer's index rows, the layer's read in place
    B, T = q.shape[:2]
    shared = shared_rows(indices, T)
    if query_heads:
        Hq, Hkv = q.shape[2], k_all.shape[2]
        for bad, what in ((return_mass, "return_mass"), (head_map is not None, "head_map"),
                          (stacked, "every layer's index rows")):
            if bad:
                raise ValueError(f"query_heads with {what}: expected one layer's rows [B, Hq, T, K] alone")
        if indices.ndim != 4 or indices.shape[1] != Hq:
            raise ValueError(f"indices has shape {tuple(indices.shape)}: with query_heads expected one row per "
                             f"query head [B, Hq={Hq}, T, K]")
        per_kv_head = jax.ShapeDtypeStruct((indices.shape[0], Hkv) + indices.shape[2:], indices.dtype)
        check_stacked_args(q, k_all, v_all, layer, per_kv_head, lengths, block_size)
    else:  # every layer's rows [L, B, Hkv, T, K] take a row per query
        check_stacked_args(q, k_all, v_all, layer, indices, lengths, block_size, stacked_indices=stacked,
                           shared_rows=not stacked)
    Hkv = k_all.shape[2]
    if shared and (return_mass or head_map is not None or too_wide(T, q.shape[2] // Hkv)):
        raise ValueError(f"indices has shape {tuple(indices.shape)} (one row for all T={T} queries) with "
                         f"return_mass, a head_map or more than {SHARED_MAX_ROWS} query rows per KV head: expected "
                         f"[B={B}, Hkv={Hkv}, T={T}, K] (a row per query)")
    if head_map is not None:
        check_head_map(head_map, k_all.shape[2], k_all.shape[0])
        if return_mass:
            raise ValueError("head_map with return_mass: the entry mass is defined for unmapped heads only")
        if stacked:
            raise ValueError("head_map with every layer's index rows [L, B, Hkv, T, K]: expected one layer's rows "
                             "[B, Hkv, T, K]")
    gpu._check_supported(q, block_size, None, interpret)
    B, T, Hq, D = q.shape
    L, _, Hkv, N, _ = k_all.shape
    G, K = Hq // Hkv, indices.shape[-1]
    # Query heads: programs over the Hq rows, one query each, program h reading KV head h // G's cache.
    H, group, G = (Hq, G, 1) if query_heads else (Hkv, 1, G)
    Tg, rows = (1, T * G) if shared else (T, G)  # grid steps over the queries; query rows per program
    scale = default_scale(D, scale)
    block_k, splits, E, Gp = gpu.decode_split_plan(config, K, block_size, B * H * Tg, rows)

    mapped = head_map is not None
    stacked_map = mapped and jnp.ndim(head_map) == 2
    if finish is not None and (not return_mass or mapped or query_heads):
        raise ValueError("finish: expected return_mass, no head_map and no query_heads")
    if partials is not None:
        want = partial_shapes(q.shape, K, L, Hkv, block_size=block_size, config=config)
        got = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in partials]
        if finish is None or T != 1 or got != list(want):
            raise ValueError(f"partials {[(str(p.dtype), p.shape) for p in got]}: expected a finish, one token and "
                             f"{[(str(p.dtype), p.shape) for p in want]}")
    kernel = functools.partial(_decode_kernel_stacked, scale=scale, block_size=block_size, block_k=block_k,
                               entries_per_split=E, K=K, T=T, N=N, L=L, G=G, Hkv=Hkv, mapped=mapped,
                               stacked_map=stacked_map, mass=return_mass, stacked_indices=stacked, shared=shared,
                               finish=None if finish is None else finish.fn(splits, E),
                               finish_inputs=0 if finish is None else len(finish.args),
                               layer_partials=partials is not None)
    out_specs, out_shape = gpu.split_outputs(splits, B, H, Tg, Gp, D)
    if return_mass:  # per entry sum of exp(s - m), per iteration m; and how many entries the program wrote
        for width in (E, E // (block_k // block_size)):
            out_specs.append(pl.BlockSpec((None, None, None, None, Gp, width), lambda b, h, t, s: (s, b, h, t, 0, 0)))
            out_shape.append(jax.ShapeDtypeStruct((splits, B, Hkv, T, Gp, width), jnp.float32))
        out_specs.append(pl.BlockSpec((None, None, None, None, 1), lambda b, h, t, s: (s, b, h, t, 0)))
        out_shape.append(jax.ShapeDtypeStruct((splits, B, Hkv, T, 1), jnp.int32))
    if finish is not None:  # every split's partials of a row in its block (the last program reads them all)
        lead = (L, splits) if partials is not None else (splits,)  # with partials, every layer's too
        out_specs = [pl.BlockSpec(lead + spec.block_shape[1:], lambda b, h, t, s, im=spec.index_map, n=len(lead):
                                  (0,) * n + tuple(im(b, h, t, s))[1:]) for spec in out_specs] + list(finish.out_specs)
        if partials is not None:
            out_shape = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in partials]
        out_shape = out_shape + list(finish.out_shape)
    # Mapped: every KV head's index row of (b, t), the head chosen in-kernel by the head map. Stacked: every
    # layer's row of (b, h, t), the layer chosen in-kernel.
    if stacked:
        rows = pl.BlockSpec((L, None, None, None, K), lambda b, h, t, s: (0, b, h, t, 0))
    else:
        rows = pl.BlockSpec((None, Hkv if mapped else None, None, K),
                            (lambda b, h, t, s: (b, 0, t, 0)) if mapped else (lambda b, h, t, s: (b, h, t, 0)))
    in_specs = [
        pl.BlockSpec((1,), lambda b, h, t, s: (0,)),  # the layer index (wrapped and clamped in-kernel)
        pl.BlockSpec((1,), lambda b, h, t, s: (b,)),  # the row's length
        rows,
        # the token's queries (shared: every token's, [T * Hq, D])
        pl.BlockSpec((None, None, T * Hq if shared else Hq, D), lambda b, h, t, s: (b, t, 0, 0)),
        pl.BlockSpec((L, None, None, N, D), lambda b, h, t, s: (0, b, h // group, 0, 0)),  # every layer of the KV head
        pl.BlockSpec((L, None, None, N, D), lambda b, h, t, s: (0, b, h // group, 0, 0)),
    ]
    args = (jnp.asarray(layer, jnp.int32).reshape(1), lengths.astype(jnp.int32), indices.astype(jnp.int32),
            q.reshape(B, 1, T * Hq, D) if shared else q, k_all, v_all)
    aliases = {}
    if finish is not None:
        aliases = {len(args) + i: len(out_specs) - len(finish.out_specs) + o for i, o in finish.aliases.items()}
        in_specs += list(finish.in_specs)
        args += tuple(finish.args)
    if partials is not None:  # written in place through the first outputs, their blocks
        aliases.update({len(args) + i: i for i in range(_PARTIALS)})
        in_specs += out_specs[:_PARTIALS]
        args += tuple(partials)
    if mapped:  # clipped in-kernel: with every layer's map [L, Hkv] no XLA op runs on it per layer
        hm_shape = jnp.shape(head_map)
        in_specs = [pl.BlockSpec(hm_shape, lambda b, h, t, s: (0,) * len(hm_shape))] + in_specs
        args = (jnp.asarray(head_map).astype(jnp.int32),) + args
    return tuple(pl.pallas_call(
        kernel,
        grid=(B, H, Tg, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="sparse_decode_gathered_stacked" + ("_mass" if return_mass else "") + ("_finish" if finish else "")
        + ("_mapped" if mapped else "")
        + ("_query_heads" if query_heads else ""),
    )(*args))


# ---------------------------------------------------------------------------------------------------------
# Pallas TPU.


def _decode_kernel_stacked_tpu(layer_ref, *refs, **kw):
    """`tpu._decode_kernel` with one more scalar-prefetch ref in front (the layer; only the index maps read it)."""
    del layer_ref
    tpu._decode_kernel(*refs, **kw)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "return_lse", "config", "interpret"))
def sparse_decode_stacked_tpu(q: Array, k_all: Array, v_all: Array, layer: Array, indices: Array, lengths: Array,
                              *, block_size: int = 16, scale: float | None = None, return_lse: bool = False,
                              config: tpu.TpuConfig = tpu.TpuConfig(),
                              interpret: bool = False) -> Array | tuple[Array, Array]:
    """Gathered decode attention over layer `layer` of a stacked cache, Pallas TPU kernel.

    Args:
      q: [B, T, Hq, D]; k_all, v_all: [L, B, Hkv, N, D]; layer: i32[] (traced), as `k_all[layer]`;
        indices: int32[B, Hkv, T, K] (block_size % 8 == 0); lengths: int32[B].
      config: `tpu.TpuConfig`.
      interpret: run in the Pallas interpreter (CPU tests).

    Returns:
      [B, T, Hq, D] in q.dtype (and lse: f32[B, T, Hq] with return_lse).
    """
    check_stacked_args(q, k_all, v_all, layer, indices, lengths, block_size)
    tpu._check_supported(q, block_size, None, config)
    B, T, Hq, D = q.shape
    L, _, Hkv, N, _ = k_all.shape
    G, K = Hq // Hkv, indices.shape[-1]
    n = min(config.blocks_per_step, K)
    steps = pl.cdiv(K, n)
    M = steps * n
    scale = default_scale(D, scale)

    lengths = lengths.astype(jnp.int32)
    lim = jnp.minimum(lengths[:, None] - T + jnp.arange(T, dtype=jnp.int32), N - 1)  # [B, T]
    ent = jnp.pad(indices.astype(jnp.int32), ((0, 0), (0, 0), (0, 0), (0, M - K)), constant_values=-1)
    ent = jnp.where(blocks_at_or_before(ent, lim[:, None, :, None], block_size), ent, -1)  # drop useless ones
    blk = tpu._forward_fill(ent.reshape(-1, M))
    qg = q.reshape(B, T, Hkv, G, D).transpose(0, 2, 1, 3, 4)  # [B, Hkv, T, G, D]
    lay = layer_index(layer, L).reshape(1)

    def kv_spec(r):
        # Block r of step j of row (b, h, t): entry j * n + r of the prefetched table, in layer lay[0].
        return pl.BlockSpec(
            (None, None, None, block_size, D),
            lambda b, h, t, j, lay, lim, blk, ent: (lay[0], b, h, blk[((b * Hkv + h) * T + t) * M + j * n + r], 0))

    kernel = functools.partial(_decode_kernel_stacked_tpu, n=n, block_size=block_size, scale=scale, num_heads=Hkv,
                               T=T, M=M)
    o, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(B, Hkv, T, steps),
            in_specs=[pl.BlockSpec((None, None, None, G, D), lambda b, h, t, j, *_: (b, h, t, 0, 0))]
            + [kv_spec(r) for r in range(n)] + [kv_spec(r) for r in range(n)],
            out_specs=[pl.BlockSpec((None, None, None, G, D), lambda b, h, t, j, *_: (b, h, t, 0, 0)),
                       pl.BlockSpec((None, None, None, G, 1), lambda b, h, t, j, *_: (b, h, t, 0, 0))],
            scratch_shapes=[pltpu.VMEM((G, 1), jnp.float32), pltpu.VMEM((G, 1), jnp.float32),
                            pltpu.VMEM((G, D), jnp.float32)],
        ),
        out_shape=[jax.ShapeDtypeStruct((B, Hkv, T, G, D), q.dtype),
                   jax.ShapeDtypeStruct((B, Hkv, T, G, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="sparse_decode_gathered_stacked_tpu",
    )(lay, lim.reshape(-1), blk.reshape(-1), ent.reshape(-1), qg, *([k_all] * n), *([v_all] * n))

    out = o.transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, D)
    if return_lse:
        return out, lse[..., 0].transpose(0, 2, 1, 3).reshape(B, T, Hq)
    return out

"""Pallas GPU (Triton) kernels of the block_scores ops; both read the stacked cache [L, B, Hkv, N, D] in place.

Retrieval block max (`block_max_scores_gpu`): grid (B, T, S), S = ceil(nb / cb). Program (b, t, s) owns blocks
  [s * cb, (s + 1) * cb). Its K BlockSpec spans the L, Hkv and N axes of batch row b and the loads index
  `k_ref[layer, kv_head, rows, :]` (one indexer: the pointer is offset in place, nothing is sliced or copied).
  For each retrieval KV head r (a static loop over R; a head with no masked query head, or a program whose
  blocks are all outside [lo, hi), runs no iteration and reads nothing), iteration j < block_size gathers
  token j of each of the cb blocks (cb rows of K, stride block_size), computes the GQA group's logits
  [Gp, cb] = q_group . K^T with one tensor-core dot, masks the non-retrieval query heads and invisible
  tokens, and keeps a running max: after block_size iterations it holds the block max, written as f32[cb].
  Bytes: K of the R heads' visible middle blocks once; out B * T * nb * 4. No [.., N] logits reach HBM.

Gathered decode with entry mass (`sparse_decode_mass_gpu`): the split-K gathered decode of
  `pallas_kernels.sparse_attention.stacked` with its `return_mass` option (grid (B, Hkv, T, S), online softmax in
  f32): the kernel also writes, for
  every index entry and query row, the sum of exp(s - m) over the entry's tokens (m: the running max of the
  iteration that processed it) and that m. With the final logsumexp, mass = sum * exp(m - lse), computed in
  the jnp epilogue with the split combine. Extra bytes: 2 * Gp * K * 4 per (b, KV head, t); no second K read.

Both run in interpret mode on CPU (`interpret=True`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.block_scores.reference import check_block_max_args, check_heat_args
from pallas_kernels.sparse_attention import gpu as sgpu
from pallas_kernels.sparse_attention.common import default_scale
from pallas_kernels.sparse_attention.stacked import (Finish, decode_partials_stacked, layer_index, row_entries,
                                                     sparse_decode_stacked_gpu)
from pallas_kernels.topk_select.common import INT_MIN, float_keys
from pallas_kernels.topk_select.gpu_row import ROW_LIMIT, next_pow2, row_pick_mask, row_warps

Array = jax.Array

_MASK = -1e30  # finite "minus infinity" (as the other Triton kernels)
_MIN_ROWS = 16  # Triton's tensor-core dot needs M, N, K >= 16


_pow2 = sgpu._pow2


def unsupported_reason(dtype, head_dim: int, block_size: int) -> str | None:
    """Why the Triton kernels cannot take these arguments (None when they can): the gathered-decode kernel's
    rules (`sparse_attention.gpu.unsupported_reason`)."""
    return sgpu.unsupported_reason(dtype, head_dim, block_size, None)


def _check_supported(q: Array, block_size: int) -> None:
    reason = unsupported_reason(q.dtype, q.shape[-1], block_size)
    if reason is not None:
        raise ValueError(f"the Pallas GPU block_scores kernel cannot take {reason}")


# ---------------------------------------------------------------------------------------------------------
# Retrieval block max.


@dataclasses.dataclass(frozen=True)
class BlockMaxConfig:
    """Tuning of the block-max kernel.

    Attributes:
      blocks_per_program: cb, blocks per program (a power of two >= 16); None picks the largest of 64, 32, 16
        that still gives about `target_programs` programs.
      target_programs: grid size the heuristic aims for (a few waves of 132 SMs on an H100).
      num_warps, num_stages: Triton launch parameters.
    """

    blocks_per_program: int | None = None
    target_programs: int = 264
    num_warps: int = 4
    num_stages: int = 3


def _blocks_per_program(B: int, T: int, nb: int, config: BlockMaxConfig) -> int:
    if config.blocks_per_program is not None:
        cb = config.blocks_per_program
        if not _pow2(cb) or cb < _MIN_ROWS:
            raise ValueError(f"BlockMaxConfig.blocks_per_program={cb}: expected a power of two >= {_MIN_ROWS}")
        return cb
    for cb in (64, 32):
        if B * T * pl.cdiv(nb, cb) >= config.target_programs:
            return cb
    return _MIN_ROWS


def _block_max_kernel(lay_ref, kvh_ref, hm_ref, pos_ref, lo_ref, hi_ref, q_ref, k_ref, o_ref, *, scale: float,
                      block_size: int, cb: int, G: int, Gp: int, R: int, L: int, Hkv: int, N: int, nb: int):
    """One (b, t, s) program. Everything XLA would prepare is done here (the layer wrapped and clamped, the KV
    heads clamped, the head mask read as is, the last visible token from the position).

    Refs: lay_ref i32[1]; kvh_ref i32[R]; hm_ref bool[R, G] (query head g of KV head r counts); pos_ref, lo_ref,
    hi_ref i32[1] the row's position and middle range; q_ref [Hq, D] the row's queries; k_ref [L, Hkv, N, D]
    every layer and KV head of batch row b; o_ref f32[nb] the row's block scores (this program writes its cb).
    """
    layer = layer_index(lay_ref[0], L)
    s = pl.program_id(2)
    lim, lo, hi = jnp.minimum(pos_ref[0], N - 1), lo_ref[0], hi_ref[0]
    blk = s * cb + jnp.arange(cb, dtype=jnp.int32)
    blk_ok = (blk >= lo) & (blk < hi)
    live = (jnp.minimum(hi, s * cb + cb) > jnp.maximum(lo, s * cb)) & (lo < hi)
    lane = jnp.arange(Gp, dtype=jnp.int32)
    acc = jnp.full((cb,), -jnp.inf, jnp.float32)
    for r in range(R):
        kvh = jnp.clip(kvh_ref[r], 0, Hkv - 1)
        hm = hm_ref[r, jnp.minimum(lane, G - 1)] & (lane < G)  # [Gp]
        q = q_ref[kvh * G + jnp.minimum(lane, G - 1), :]  # [Gp, D] the GQA group (padding rows repeat row G-1)
        heads = hm[:, None]

        def body(j, acc, kvh=kvh, q=q, heads=heads):
            tok = blk * block_size + j
            ok = blk_ok & (tok <= lim)
            k = k_ref[layer, kvh, jnp.where(ok, tok, 0), :]  # [cb, D]: token j of each block
            logits = plgpu.dot(q, k, trans_b=True)  # [Gp, cb] f32
            t = jnp.max(jnp.where(heads, logits, -jnp.inf), axis=0)
            return jnp.maximum(acc, jnp.where(ok, t, -jnp.inf))

        n = jnp.where(live & (jnp.max(hm.astype(jnp.int32)) > 0), jnp.int32(block_size), jnp.int32(0))
        acc = lax.fori_loop(jnp.int32(0), n, body, acc)  # bounds of one dtype (Triton's scf.for needs it)
    plgpu.store(o_ref.at[pl.ds(s * cb, cb)], acc * scale, mask=blk < nb)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "config", "interpret"))
def block_max_scores_gpu(q: Array, k_all: Array, layer: Array, kv_heads: Array, head_mask: Array, positions: Array,
                         lo: Array, hi: Array, *, block_size: int, scale: float | None = None,
                         config: BlockMaxConfig = BlockMaxConfig(), interpret: bool = False) -> Array:
    """`reference.block_max_scores_reference` by the Pallas Triton kernel (see the module docstring); no XLA
    work around the launch."""
    check_block_max_args(q, k_all, layer, kv_heads, head_mask, positions, lo, hi, block_size)
    _check_supported(q, block_size)
    B, T, Hq, D = q.shape
    L, _, Hkv, N, _ = k_all.shape
    G, nb, R = Hq // Hkv, N // block_size, kv_heads.shape[0]
    Gp = max(_MIN_ROWS, pl.next_power_of_2(G))
    scale = default_scale(D, scale)
    cb = _blocks_per_program(B, T, nb, config)
    S = pl.cdiv(nb, cb)
    kernel = functools.partial(_block_max_kernel, scale=scale, block_size=block_size, cb=cb, G=G, Gp=Gp, R=R, L=L,
                               Hkv=Hkv, N=N, nb=nb)
    row = pl.BlockSpec((None, 1), lambda b, t, s: (b, t))
    return pl.pallas_call(
        kernel,
        grid=(B, T, S),
        in_specs=[
            pl.BlockSpec((1,), lambda b, t, s: (0,)),  # the layer index
            pl.BlockSpec((R,), lambda b, t, s: (0,)),  # retrieval KV heads
            pl.BlockSpec((R, G), lambda b, t, s: (0, 0)),  # their query-head masks
            row, row, row,  # position, lo, hi of the row
            pl.BlockSpec((None, None, Hq, D), lambda b, t, s: (b, t, 0, 0)),  # the row's queries
            pl.BlockSpec((L, None, Hkv, N, D), lambda b, t, s: (0, b, 0, 0, 0)),  # every layer and KV head of row b
        ],
        out_specs=pl.BlockSpec((None, None, nb), lambda b, t, s: (b, t, 0)),  # each program writes its cb blocks
        out_shape=jax.ShapeDtypeStruct((B, T, nb), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="evosparse_block_max",
    )(jnp.asarray(layer, jnp.int32).reshape(1), kv_heads.astype(jnp.int32), head_mask, positions.astype(jnp.int32),
      lo.astype(jnp.int32), hi.astype(jnp.int32), q, k_all)


# ---------------------------------------------------------------------------------------------------------
# Gathered decode with per-entry mass.


def sparse_decode_mass_gpu(q: Array, k_all: Array, v_all: Array, layer: Array, indices: Array, lengths: Array, *,
                           block_size: int = 1, scale: float | None = None,
                           config: sgpu.DecodeConfig = sgpu.DecodeConfig(), interpret: bool = False):
    """`reference.sparse_decode_mass_reference` by the stacked gathered-decode Triton kernel with its mass output
    (`sparse_attention.stacked.sparse_decode_stacked_gpu(..., return_mass=True)`).

    Args:
      q: [B, T, Hq, D]; k_all, v_all: [L, B, Hkv, N, D]; layer: i32[]; indices: int32[B, Hkv, T, K], or every
      layer's rows [L, B, Hkv, T, K] (layer `layer`'s read in place); lengths: int32[B]; block_size: a power of
      two; config: `sparse_attention.gpu.DecodeConfig`.

    Returns:
      (out [B, T, Hq, D] in q.dtype, mass f32[B, Hkv, T, K]).
    """
    _check_supported(q, block_size)
    return sparse_decode_stacked_gpu(q, k_all, v_all, layer, indices, lengths, block_size=block_size, scale=scale,
                                     return_mass=True, config=config, interpret=interpret)


def _group_lse(m_ref, l_ref, S: int, G: int, lead: tuple = ()):
    """The GQA group's merge weights over the S splits' partials (m_ref, l_ref f32[S, Gp]; only the first G rows
    read, padded to gq = next_pow2(G) >= 2): (w f32[sp, gq] each split's weight exp(m - m_all), its row mask and
    index arrays, lse f32[gq], l_safe, nonempty bool[gq]); loaded at once as [sp, gq] tensors (gathers by index
    arrays). lead: leading scalar indices of refs that hold more ([L, S, Gp] and lead (layer,))."""
    gq, sp = max(2, pl.next_power_of_2(G)), max(2, pl.next_power_of_2(S))
    split = jnp.arange(sp, dtype=jnp.int32)[:, None]  # [sp, 1]
    row = jnp.arange(gq, dtype=jnp.int32)[None, :]  # [1, gq]
    ok2 = (split < S) & (row < G)  # [sp, gq]
    at = tuple(jnp.full((sp, gq), x, jnp.int32) for x in lead) + (jnp.minimum(split, S - 1),
                                                                     jnp.broadcast_to(row, (sp, gq)))
    m = plgpu.load(m_ref.at[at], mask=ok2, other=_MASK)
    m_all = jnp.max(m, axis=0)  # [gq]
    w = jnp.where(ok2, jnp.exp(m - m_all[None, :]), 0.0)
    l_all = jnp.sum(w * plgpu.load(l_ref.at[at], mask=ok2, other=0.0), axis=0)
    nonempty = l_all > 0
    l_safe = jnp.where(nonempty, l_all, 1.0)
    return w, (ok2, at), m_all + jnp.log(l_safe), l_safe, nonempty


def _merge_outputs(o_ref, out_ref, row0, w, mask_at, l_safe, nonempty, G: int, at: tuple = ()):
    """Stores the group's merged output (the S splits' o_ref f32[S, Gp, D] weighted by w, over l) into rows
    row0 .. row0 + G - 1 of out_ref [rows, D] (or of out_ref[at], one indexer per store: Triton's lowering); the
    partials are read at `_group_lse`'s index arrays (its lead included)."""
    ok2, idx = mask_at
    d = o_ref.shape[-1]
    col = jnp.arange(d, dtype=jnp.int32)[None, None, :]
    ok3 = jnp.broadcast_to(ok2[:, :, None], ok2.shape + (d,))
    o = plgpu.load(o_ref.at[tuple(i[:, :, None] for i in idx) + (col,)], mask=ok3, other=0.0)
    out = jnp.where(nonempty[:, None], jnp.sum(w[:, :, None] * o, axis=0) / l_safe[:, None], 0.0)  # [gq, D]
    gq = out.shape[0]
    real2 = jnp.broadcast_to((jnp.arange(gq, dtype=jnp.int32) < G)[:, None], (gq, d))
    plgpu.store(out_ref.at[at + (pl.ds(row0, gq), slice(None))], out.astype(out_ref.dtype), mask=real2)


def _add_entry_mass(ent, el_ref, em_ref, nw_ref, entries, heat_ref, hrow, lse, nonempty, *, E: int, K: int, G: int):
    """Adds the softmax mass of index entries ent (i32[n], entry j = s * E + e of split s) into heat row hrow
    (heat_ref f32[Lh, nb], in place): el_ref f32[S, Gp, E] the entries' sums of exp(s - m), em_ref f32[S, Gp,
    E // per_iter] their iteration's m, nw_ref i32[S, 1] the entries each split wrote; entries(idx, valid) the
    row's index entries (blocks). The entries must be distinct blocks (no two lanes update one heat block)."""
    gq, n = lse.shape[0], ent.shape[0]
    S = el_ref.shape[0]
    s_j, e_j = jnp.minimum(ent // E, S - 1), ent % E
    written = (ent < K) & (ent < S * E) & (e_j < plgpu.load(nw_ref.at[s_j, 0]))  # [n]
    rows = jnp.arange(gq, dtype=jnp.int32)[:, None]  # [gq, 1]
    ok = written[None, :] & ((rows < G) & nonempty[:, None])
    at = (jnp.broadcast_to(s_j[None, :], (gq, n)), jnp.broadcast_to(rows, (gq, n)),
          jnp.broadcast_to(e_j[None, :], (gq, n)))
    el = plgpu.load(el_ref.at[at], mask=ok, other=0.0)
    em = plgpu.load(em_ref.at[at[:2] + (at[2] // (E // em_ref.shape[-1]),)], mask=ok, other=0.0)
    p = jnp.where(ok, el * jnp.exp(jnp.where(ok, em - lse[:, None], 0.0)), 0.0)
    mass = jnp.sum(p, axis=0) / G  # [n]
    blk = entries(jnp.minimum(ent, K - 1), written)
    hit = written & (blk >= 0)
    ref = heat_ref.at[hrow, jnp.where(hit, blk, heat_ref.shape[1])]  # masked lanes point past the row
    plgpu.store(ref, plgpu.load(ref, mask=hit, other=0.0) + mass, mask=hit)


def _finish_heat_kernel(lay_ref, hl_ref, idx_ref, o_ref, m_ref, l_ref, el_ref, em_ref, nw_ref, _heat_in, out_ref,
                        heat_ref, *, S: int, E: int, K: int, G: int, L: int, Lh: int, stacked: bool):
    """Program (b, kv head, split s) of one decode token: the GQA group's log-sum-exp from every split's (m, l),
    then split s's index entries' mass added into heat row `heat_layer` in place; split 0 also merges the S
    partials' outputs (the G real rows written).

    Refs: lay, hl i32[1] the cache layer and the heat row; idx i32[K] the entries (stacked: i32[L, K], every
    layer's, row `lay` read); o f32[S, Gp, D], m, l f32[S, Gp]; el f32[S, Gp, E], em f32[S, Gp, E // P] (the max of
    each iteration of P entries); nw i32[S, 1]; heat (in and out, aliased) f32[Lh, nb]; out [Gp, D]. Only the first
    next_pow2(G) rows of the partials are loaded (their padding rows were never written) and rows past G are
    masked. One program per split keeps the entries a program holds to E (H2O's 10K keys a row are 16 splits of
    640), and every split's entries are distinct blocks of the row, so the programs' read-modify-writes of the heat
    never meet. (`sparse_decode_heat_gpu` with tickets does all of this in the decode's own launch instead.)"""
    s = pl.program_id(2)
    w, mask_at, lse, l_safe, nonempty = _group_lse(m_ref, l_ref, S, G)

    @pl.when(s == 0)
    def _merge():
        _merge_outputs(o_ref, out_ref, 0, w, mask_at, l_safe, nonempty, G)

    row = layer_index(lay_ref[0], L) if stacked else None  # the layer's row of every layer's entries
    _split_mass(s, lse, nonempty, idx_ref, row, el_ref, em_ref, nw_ref, heat_ref, layer_index(hl_ref[0], Lh),
                E=E, K=K, G=G)


def _split_mass(s, lse, nonempty, idx_ref, row, el_ref, em_ref, nw_ref, heat_ref, hrow, *, E: int, K: int, G: int):
    """Split s's index entries' mass (the group's lse, nonempty from `_group_lse`) added into heat row hrow; the
    entries are row `row` of idx_ref (None: idx_ref is the row)."""
    ent = s * E + jnp.arange(max(16, pl.next_power_of_2(E)), dtype=jnp.int32)
    ent = jnp.where(ent < s * E + E, ent, K)  # lanes past this split's E entries: none
    entries = lambda i, ok: row_entries(idx_ref, row, i, ok)  # noqa: E731
    _add_entry_mass(ent, el_ref, em_ref, nw_ref, entries, heat_ref, hrow, lse, nonempty, E=E, K=K, G=G)


def _pending_mass_kernel(idx_ref, m_ref, l_ref, el_ref, em_ref, nw_ref, _heat_in, heat_ref, *, S: int, E: int,
                         K: int, G: int, first: int):
    """Program (layer first + l, b, kv head, split s) of `add_pending_mass_gpu`: `_finish_heat_kernel`'s mass add
    from that layer's kept partials, into the layer's heat row (idx_ref i32[L, K] every layer's entries of the row;
    the partials' blocks the layer's [S, ...]; heat f32[L, nb], in place)."""
    layer = pl.program_id(0) + first
    _, _, lse, _, nonempty = _group_lse(m_ref, l_ref, S, G)
    _split_mass(pl.program_id(3), lse, nonempty, idx_ref, layer, el_ref, em_ref, nw_ref, heat_ref, layer,
                E=E, K=K, G=G)


# Entries the one-launch finish's last program adds to the heat per chunk ([next_pow2(G), chunk] f32 tensors), and
# the most entries a row may have for that finish: each row's entries are the last program's alone, so H2O's 10K
# keys a row (the two launches spread them over one program per split) are not for it.
FINISH_CHUNK, FINISH_MAX_ENTRIES = 512, 2048


def _finish_in_launch(splits: int, E: int, *, G: int, K: int, Lh: int | None, interpret: bool, batch: int,
                      rows_out: int | None, layers: int | None = None):
    """The epilogue of `sparse_decode_heat_gpu`'s one launch (`stacked.Finish`): after storing its partials, each
    (b, h, split) program takes a ticket from the row's counter (an acquire-release atomic add at GPU scope, after a
    CTA barrier so that all its threads' stores come first); the program drawing ticket splits - 1 is the row's
    last, sees every split's partials, and does what `_finish_heat_kernel`'s programs do: the group's log-sum-exp,
    the merged output, every entry's mass into the heat row. It then sets the counter back to 0, so the same
    counters serve the next launch (no zeroing launch). Each row's partials are read once, by its last program, so
    no SM holds a stale L1 line of them. With rows_out the output is [rows_out, Hq, D], token row b (one token a
    row), and the last programs of batch row 0 also write the zero rows past `batch`.
    layers (the number of cache layers L): the partials are every layer's ([L, S, ...], `sparse_decode_pending_gpu`),
    read at the launch's layer, and the last program merges the output only (no heat: `add_pending_mass_gpu` adds
    the mass later)."""
    def finish(ins, outs, partials, entries):
        if layers is None:
            hl_ref, _heat_in, _tick_in = ins
            out_ref, heat_ref, tick_ref = outs
        else:
            lay_ref, _tick_in = ins
            out_ref, tick_ref = outs
        o_ref, m_ref, l_ref, el_ref, em_ref, nw_ref = partials
        if not interpret:  # the interpreter runs the programs one after another and has no barrier
            plgpu.debug_barrier()
        ticket = plgpu.atomic_add(tick_ref, (jnp.int32(0),), jnp.int32(1))
        row0 = pl.program_id(1) * G  # the group's first query head (read here: not inside the branch)
        b = pl.program_id(0)

        @pl.when(ticket == splits - 1)
        def _last():
            tick_ref[...] = jnp.zeros((1,), jnp.int32)
            lead = () if layers is None else (layer_index(lay_ref[0], layers),)
            w, mask_at, lse, l_safe, nonempty = _group_lse(m_ref, l_ref, splits, G, lead)
            _merge_outputs(o_ref, out_ref, row0, w, mask_at, l_safe, nonempty, G,
                           at=() if rows_out is None else (b,))
            if rows_out is not None and rows_out > batch:  # the GEMMs' padding rows, zeros
                gq, d = max(2, pl.next_power_of_2(G)), o_ref.shape[-1]
                zr = max(2, pl.next_power_of_2(rows_out - batch))
                shape = (zr, gq, d)
                r = jnp.broadcast_to(batch + jnp.arange(zr, dtype=jnp.int32)[:, None, None], shape)
                g = jnp.broadcast_to(jnp.arange(gq, dtype=jnp.int32)[None, :, None], shape)
                c = jnp.broadcast_to(jnp.arange(d, dtype=jnp.int32)[None, None, :], shape)
                plgpu.store(out_ref.at[r, row0 + g, c], jnp.zeros(shape, out_ref.dtype),
                            mask=(r < rows_out) & (g < G) & (b == 0))
            if layers is not None:
                return
            width = min(FINISH_CHUNK, max(16, pl.next_power_of_2(splits * E)))
            hrow = layer_index(hl_ref[0], Lh)
            for c in range(0, splits * E, width):  # static chunks: one for EvoSparse's 128 entries a row
                _add_entry_mass(c + jnp.arange(width, dtype=jnp.int32), el_ref, em_ref, nw_ref, entries, heat_ref,
                                hrow, lse, nonempty, E=E, K=K, G=G)
    return finish


def sparse_decode_heat_gpu(q: Array, k_all: Array, v_all: Array, layer: Array, indices: Array, lengths: Array,
                           heat: Array, heat_layer: Array | None = None, *, block_size: int = 1,
                           scale: float | None = None,
                           config: sgpu.DecodeConfig = sgpu.DecodeConfig(), tickets: Array | None = None,
                           rows_out: int | None = None, interpret: bool = False):
    """`reference.sparse_decode_heat_reference` in two launches (or in one, with tickets): the stacked gathered
    decode with its entry sums (`sparse_attention.stacked.decode_partials_stacked`), then one program per (row, KV
    head, split) (`_finish_heat_kernel`) that takes the group's log-sum-exp from the splits, adds its split's
    entries' mass into heat[heat_layer] in place (the heat buffer is aliased: only the B * Hkv * K touched blocks are
    read and written) and, in split 0, merges the outputs. This replaces the XLA epilogue of `sparse_decode_mass_gpu`
    (split max, split sum, written mask) and the heat scatter.

    Args:
      q: [B, 1, Hq, D]; k_all, v_all: [L, B, Hkv, N, D]; layer: i32[]; indices: int32[B, Hkv, 1, K] (valid
      entries unique and ascending per row, then -1), or every layer's rows [L, B, Hkv, 1, K] of which layer
      `layer`'s are used (read in place by both kernels); lengths: int32[B]; heat: f32[Lh, B, Hkv,
      N // block_size]; heat_layer: i32[] the heat row to update (None: `layer`); tickets: i32[B, Hkv, 1] zeros
      (as every such launch leaves them), or None: with them the finish runs in the decode's own launch, by the
      last program of each (row, KV head) to finish its split (`_finish_in_launch`); rows_out (with tickets): the
      output as [1, rows_out, Hq, D], token row b then zero rows (`models.attention.LayerContext.rows_out`).

    Returns:
      (out [B, 1, Hq, D] (or [1, rows_out, Hq, D]) in q.dtype, heat), and tickets (zeros again) when given.
    """
    check_heat_args(q, indices, heat, k_all, block_size)
    _check_supported(q, block_size)
    hl = jnp.asarray(layer if heat_layer is None else heat_layer, jnp.int32).reshape(1)
    if tickets is not None:
        out_spec, out_struct, tick_spec = _ticketed_output(q, k_all, tickets, rows_out)
        if indices.shape[-1] > FINISH_MAX_ENTRIES:
            raise ValueError(f"tickets with {indices.shape[-1]} index entries a row: the one-launch finish takes at "
                             f"most {FINISH_MAX_ENTRIES} (expected tickets=None: the two launches)")
        B, _, Hq, _ = q.shape
        heat_spec = pl.BlockSpec((heat.shape[0], None, None, heat.shape[-1]), lambda b, h, t, s: (0, b, h, 0))
        fin = Finish(fn=functools.partial(_finish_in_launch, G=Hq // k_all.shape[2], K=indices.shape[-1],
                                          Lh=heat.shape[0], interpret=interpret, batch=B, rows_out=rows_out),
                     in_specs=(pl.BlockSpec((1,), lambda b, h, t, s: (0,)), heat_spec, tick_spec),
                     args=(hl, heat, tickets),
                     out_specs=(out_spec, heat_spec, tick_spec),
                     out_shape=(out_struct, jax.ShapeDtypeStruct(heat.shape, heat.dtype),
                                jax.ShapeDtypeStruct(tickets.shape, tickets.dtype)),
                     aliases={1: 1, 2: 2})
        return decode_partials_stacked(q, k_all, v_all, layer, indices, lengths, block_size=block_size, scale=scale,
                                       return_mass=True, config=config, head_map=None, interpret=interpret,
                                       finish=fin)[-3:]
    o, m, l, el, em, nw = decode_partials_stacked(q, k_all, v_all, layer, indices, lengths, block_size=block_size,
                                                  scale=scale, return_mass=True, config=config, head_map=None,
                                                  interpret=interpret)
    S, B, Hkv, _, Gp, D = o.shape
    L, (Lh, nb), K, E = k_all.shape[0], (heat.shape[0], heat.shape[-1]), indices.shape[-1], el.shape[-1]
    G, Ei = q.shape[2] // Hkv, em.shape[-1]  # Ei: the splits' iterations (one max each)
    stacked = indices.ndim == 5
    part = lambda *tail: pl.BlockSpec((S, None, None, None) + tail,  # noqa: E731
                                      lambda b, h, s: (0, b, h, 0) + (0,) * len(tail))
    heat_spec = pl.BlockSpec((Lh, None, None, nb), lambda b, h, s: (0, b, h, 0))
    rows = (pl.BlockSpec((L, None, None, None, K), lambda b, h, s: (0, b, h, 0, 0)) if stacked
            else pl.BlockSpec((None, None, None, K), lambda b, h, s: (b, h, 0, 0)))
    scalar = pl.BlockSpec((1,), lambda b, h, s: (0,))
    out, heat = pl.pallas_call(
        functools.partial(_finish_heat_kernel, S=S, E=E, K=K, G=G, L=L, Lh=Lh, stacked=stacked),
        grid=(B, Hkv, S),
        in_specs=[scalar, scalar, rows, part(Gp, D), part(Gp), part(Gp), part(Gp, E), part(Gp, Ei), part(1),
                  heat_spec],
        out_specs=[pl.BlockSpec((None, None, Gp, D), lambda b, h, s: (b, h, 0, 0)), heat_spec],
        out_shape=[jax.ShapeDtypeStruct((B, Hkv, Gp, D), q.dtype), jax.ShapeDtypeStruct(heat.shape, heat.dtype)],
        input_output_aliases={9: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="evosparse_finish_heat",
    )(jnp.asarray(layer, jnp.int32).reshape(1), hl, indices.astype(jnp.int32), o, m, l, el, em, nw, heat)
    return out[:, :, :G].reshape(B, 1, Hkv * G, D), heat


def _ticketed_output(q: Array, k_all: Array, tickets: Array, rows_out: int | None):
    """(out spec, out struct, tickets spec) of a launch whose last programs merge the output (`_finish_in_launch`):
    the output [B, 1, Hq, D], or [1, rows_out, Hq, D] with rows_out; the tickets i32[B, Hkv, 1] checked."""
    B, _, Hq, D = q.shape
    Hkv = k_all.shape[2]
    if tickets.shape != (B, Hkv, 1) or tickets.dtype != jnp.int32:
        raise ValueError(f"tickets {tickets.dtype}{list(tickets.shape)}: expected int32[{B}, {Hkv}, 1] zeros")
    if rows_out is not None and rows_out < B:
        raise ValueError(f"rows_out={rows_out}: expected at least the batch of {B} token rows")
    if rows_out is None:
        spec = pl.BlockSpec((None, None, Hq, D), lambda b, h, t, s: (b, t, 0, 0))
    else:
        spec = pl.BlockSpec((None, rows_out, Hq, D), lambda b, h, t, s: (0, 0, 0, 0))
    shape = q.shape if rows_out is None else (1, rows_out, Hq, D)
    return spec, jax.ShapeDtypeStruct(shape, q.dtype), pl.BlockSpec((None, None, 1), lambda b, h, t, s: (b, h, 0))


def sparse_decode_pending_gpu(q: Array, k_all: Array, v_all: Array, layer: Array, indices: Array, lengths: Array,
                              pending: tuple, tickets: Array, *, scale: float | None = None,
                              config: sgpu.DecodeConfig = sgpu.DecodeConfig(), rows_out: int | None = None,
                              interpret: bool = False):
    """`sparse_decode_heat_gpu`'s one launch with the heat update left for later (blocks of one token: H2O's rows of
    10K keys, more than the last program of a row adds in time): each program stores its split's partials and entry
    sums into layer `layer`'s slot of `pending` (every layer's, `api.pending_shapes`, written in place), and the last
    program of each row merges the output (tickets, as there). `add_pending_mass_gpu`, once after every layer ran,
    adds all layers' entry mass into their heat rows, in place of one finish launch a layer.

    Args:
      q: [B, 1, Hq, D]; k_all, v_all: [L, B, Hkv, N, D]; layer: i32[]; indices: every layer's rows int32[L, B, Hkv,
      1, K] (valid entries unique and ascending per row, then -1); lengths: int32[B]; pending: the partials of
      `api.pending_shapes` (uninitialised is fine: a launch writes all that is read of its layer); tickets: i32[B, Hkv,
      1] zeros; rows_out: the output as [1, rows_out, Hq, D] (`models.attention.LayerContext.rows_out`).

    Returns:
      (out [B, 1, Hq, D] (or [1, rows_out, Hq, D]) in q.dtype, pending, tickets (zeros again)).
    """
    _check_supported(q, 1)
    if indices.ndim != 5:
        raise ValueError(f"indices has shape {tuple(indices.shape)}: expected every layer's rows [L, B, Hkv, 1, K]")
    out_spec, out_struct, tick_spec = _ticketed_output(q, k_all, tickets, rows_out)
    B, _, Hq, _ = q.shape
    L = k_all.shape[0]
    lay = pl.BlockSpec((1,), lambda b, h, t, s: (0,))
    fin = Finish(fn=functools.partial(_finish_in_launch, G=Hq // k_all.shape[2], K=indices.shape[-1], Lh=None,
                                      interpret=interpret, batch=B, rows_out=rows_out, layers=L),
                 in_specs=(lay, tick_spec), args=(jnp.asarray(layer, jnp.int32).reshape(1), tickets),
                 out_specs=(out_spec, tick_spec),
                 out_shape=(out_struct, jax.ShapeDtypeStruct(tickets.shape, tickets.dtype)), aliases={1: 1})
    res = decode_partials_stacked(q, k_all, v_all, layer, indices, lengths, block_size=1, scale=scale,
                                  return_mass=True, config=config, head_map=None, interpret=interpret, finish=fin,
                                  partials=tuple(pending))
    return res[-2], tuple(res[:-2]), res[-1]


def add_pending_mass_gpu(indices: Array, pending: tuple, heat: Array, *, group: int, first: int = 0,
                         interpret: bool = False) -> Array:
    """Adds the entry mass of layers first .. L - 1, kept by `sparse_decode_pending_gpu` in `pending`, into their heat
    rows: heat f32[L, B, Hkv, N] (blocks of one token), updated in place (returned); indices: those launches' rows
    int32[L, B, Hkv, 1, K]; group: the GQA group size (query heads a KV head). One launch, grid (L - first, B, Hkv,
    S): program (l, b, h, s) does for layer first + l what `_finish_heat_kernel`'s program (b, h, s) does, without
    the output."""
    el = pending[3]
    L, S, B, Hkv, _, Gp, E = el.shape
    K, N = indices.shape[-1], heat.shape[-1]
    if heat.shape[:3] != (L, B, Hkv) or indices.shape[:4] != (L, B, Hkv, 1) or not 0 <= first < L:
        raise ValueError(f"heat {tuple(heat.shape)}, indices {tuple(indices.shape)}, first={first}: expected "
                         f"[{L}, {B}, {Hkv}, N], [{L}, {B}, {Hkv}, 1, K] and 0 <= first < {L} for these partials")
    if not 0 < group <= Gp:
        raise ValueError(f"group={group}: expected the query heads a KV head, 1 .. {Gp}")

    def part(x):  # layer first + l's partials of row (b, h), every split
        tail = x.shape[5:]
        return pl.BlockSpec((None, S, None, None, None) + tail,
                            lambda l, b, h, s: (l + first, 0, b, h, 0) + (0,) * len(tail))
    heat_spec = pl.BlockSpec((L, None, None, N), lambda l, b, h, s: (0, b, h, 0))
    return pl.pallas_call(
        functools.partial(_pending_mass_kernel, S=S, E=E, K=K, G=group, first=first),
        grid=(L - first, B, Hkv, S),
        in_specs=[pl.BlockSpec((L, None, None, None, K), lambda l, b, h, s: (0, b, h, 0, 0))]
        + [part(x) for x in pending[1:]] + [heat_spec],
        out_specs=heat_spec,
        out_shape=jax.ShapeDtypeStruct(heat.shape, heat.dtype),
        input_output_aliases={6: 0},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="pending_mass",
    )(indices.astype(jnp.int32), *pending[1:], heat)


# ---------------------------------------------------------------------------------------------------------
# EvoSparse's block selection of one decode row.


def _select_blocks_kernel(ns_ref, hi_ref, nbv_ref, count_ref, full_ref, lay_ref, ret_ref, heat_ref, o_ref, *,
                          nb: int, P: int, wr: int, has_heat: bool, has_ret: bool, width: int, wpad: int,
                          heat_width: int, bits: int, L: int):
    """Row (b, kv head). Refs: n_s, hi, nbv, count, full i32[1] the row's; lay i32[1] the layer; ret i32[wr];
    heat f32[L, nb] (the row of every layer: row `layer`, wrapped and clamped, is read in place); o i32[width].
    (Separate operands, not one stacked array: stacking them was one more XLA launch per layer.)

    Only the keys stay live through the radix search (a block that is visible and in the middle but not a
    candidate has key INT_MIN: it is a retrieval block), to keep register pressure low."""
    n_s, hi, nbv, count, full = (r[0] for r in (ns_ref, hi_ref, nbv_ref, count_ref, full_ref))
    blk = jnp.arange(P, dtype=jnp.int32)
    vis = blk < jnp.minimum(nbv, nb)
    middle = (blk >= n_s) & (blk < hi)
    in_ret = jnp.zeros((P,), jnp.bool_)
    if has_ret:  # membership by a branchless binary search of every block in the ascending retrieval set
        wp = next_pow2(wr)
        slot = jnp.arange(wp, dtype=jnp.int32)
        n_ret = jnp.sum((plgpu.load(ret_ref.at[pl.ds(0, wp)], mask=slot < wr, other=-1) >= 0).astype(jnp.int32))
        below = jnp.zeros((P,), jnp.int32)  # count of retrieval blocks < blk
        step = wp
        while step >= 1:
            t = below + step
            v = plgpu.load(ret_ref.at[jnp.clip(t - 1, 0, wr - 1)])
            below = jnp.where((t <= n_ret) & (v < blk), t, below)
            step //= 2
        at = plgpu.load(ret_ref.at[jnp.clip(below, 0, wr - 1)])
        in_ret = (below < n_ret) & (at == blk)
    if has_heat:
        cand = vis & middle & jnp.logical_not(in_ret)
        n_cand = jnp.sum(cand.astype(jnp.int32))
        kk = jnp.minimum(jnp.clip(count, 0, heat_width), n_cand)
        layer = layer_index(lay_ref[0], L)
        x = plgpu.load(heat_ref.at[layer, pl.ds(0, P)], mask=blk < nb, other=0.0)
        key = jnp.where(cand, float_keys(x), INT_MIN)
        blk = jnp.arange(P, dtype=jnp.int32)  # recomputed after the search rather than kept live
        cand = key != INT_MIN
        vis = blk < jnp.minimum(nbv, nb)
        middle = (blk >= n_s) & (blk < hi)
        sel = vis & ((full != 0) | jnp.logical_not(middle) | jnp.logical_not(cand))
        sel = sel | row_pick_mask(key, cand, kk, n_cand, bits)
    else:
        sel = vis & ((full != 0) | jnp.logical_not(middle) | in_ret)
    s32 = sel.astype(jnp.int32)
    dst = jnp.cumsum(s32) - s32
    keep = sel & (dst < width)
    plgpu.store(o_ref.at[jnp.where(keep, dst, width)], blk, mask=keep)
    total = jnp.minimum(jnp.sum(s32), width)
    slot = jnp.arange(wpad, dtype=jnp.int32)
    plgpu.store(o_ref.at[pl.ds(0, wpad)], jnp.full((wpad,), -1, jnp.int32), mask=(slot >= total) & (slot < width))


def select_blocks_gpu(heat: Array | None, ret: Array | None, n_s: Array, hi: Array, nbv: Array, count: Array,
                      full: Array, *, num_kv_heads: int, nb: int, width: int, heat_width: int,
                      layer: Array | None = None, bits: int = 1, num_warps: int | None = None,
                      interpret: bool = False) -> Array:
    """`xla.select_blocks_xla` in one launch: one program per (row, KV head), grid (B, Hkv).

    The program holds the heat row in registers (P = next power of two >= nb keys): it marks the retrieval
    blocks (a binary search of each block in the ascending set: log2(wr) + 1 gathers), runs the exact in-register radix search for the heat threshold over the
    middle blocks outside the retrieval set (`topk_select.gpu_row.row_pick_mask`, ties by position), ORs in sink,
    local and retrieval, and writes the union ascending by one cumulative sum (then -1). It replaces the heat
    top-k launch and the ~15 XLA fusions of the merge. Heat must be finite (it is a sum of softmax masses).

    Args / returns: as `xla.select_blocks_xla` (ret: valid entries ascending, then -1); nb <= 32768. With `layer`,
    heat is the stacked heat f32[L, B, Hkv, nb], read in place (no slice of the layer's row is made).
    """
    B, Hkv = n_s.shape[0], num_kv_heads
    if nb > ROW_LIMIT:
        raise ValueError(f"nb={nb} blocks: the select_blocks kernel takes nb <= {ROW_LIMIT}")
    if not 1 <= width <= nb:
        raise ValueError(f"width={width}: expected 1 <= width <= nb={nb}")
    has_heat, has_ret = heat is not None, ret is not None
    if has_heat and layer is None:
        heat = heat[None]
    if has_heat and heat.shape[1:] != (B, Hkv, nb):
        want = (B, Hkv, nb) if layer is None else ("L", B, Hkv, nb)
        raise ValueError(f"heat of shape {heat.shape}: expected {want}")
    heat = heat.astype(jnp.float32) if has_heat else jnp.zeros((1, B, Hkv, 1), jnp.float32)
    ret = ret.astype(jnp.int32) if has_ret else jnp.full((B, 1), -1, jnp.int32)
    wr, (L, hn) = ret.shape[-1], (heat.shape[0], heat.shape[-1])
    lay = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)
    row = pl.BlockSpec((1,), lambda b, h: (b,))
    P = max(32, next_pow2(nb))
    return pl.pallas_call(
        functools.partial(_select_blocks_kernel, nb=nb, P=P, wr=wr, has_heat=has_heat, has_ret=has_ret,
                          width=width, wpad=max(32, next_pow2(width)), heat_width=heat_width, bits=bits, L=L),
        grid=(B, Hkv),
        in_specs=[row] * 5 + [pl.BlockSpec((1,), lambda b, h: (0,)), pl.BlockSpec((None, wr), lambda b, h: (b, 0)),
                  pl.BlockSpec((L, None, None, hn), lambda b, h: (0, b, h, 0))],
        out_specs=pl.BlockSpec((None, None, width), lambda b, h: (b, h, 0)),
        out_shape=jax.ShapeDtypeStruct((B, Hkv, width), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=row_warps(P) if num_warps is None else num_warps,
                                             num_stages=1),
        interpret=interpret, name="evosparse_select_blocks",
    )(*(x.astype(jnp.int32) for x in (n_s, hi, nbv, count, full)), lay, ret, heat)


# ---------------------------------------------------------------------------------------------------------
# EvoSparse's block selection from precomputed heat candidates.


CAND_LIMIT = 256  # widest candidate / retrieval row the rank kernel takes (pairwise [W, W] in registers)
# Warps of the rank kernel's programs (read when traced): 8 since 2026-11-29, EvoSparse's step at 100K, batch 4 on an
# H200 7.28 -> 7.01 ms (eval/results/h200/tuning/decode_knobs_round2.json; 16: 7.01, 2: 7.63).
CAND_WARPS = 8


def _select_cand_kernel(plan_ref, lay_ref, ret_ref, cand_ref, heat_ref, *o_refs, wr: int, wc: int, has_ret: bool,
                        less_ret: bool, width: int, wpad: int, heat_width: int, L: int, span: int = 0):
    """Row (b, kv head). Refs: plan i32[PLAN] the row's (n_s, hi, nbv, count, full, zeros); lay i32[1]; ret
    i32[wr]; cand i32[L, wc] (the row's heat candidates of every layer); heat f32[L, nb]; o i32[width]. Pairwise
    ranks over the candidates (no search over the row): the `count` hottest outside the retrieval set (less_ret:
    `count` less the retrieval set's valid entries, counted here), then the union written ascending.

    span > 0 (`select_span_gpu`): program (b, kv head, j) of a grid of `span` layers; lay i32[2] = (first layer,
    count); o i32[L, width] every layer's rows (aliased: only rows first .. first + count - 1 are written); the
    program selects layer first + j when j < count, else does nothing (o_refs: the aliased input, then o)."""
    o_ref = o_refs[-1]
    select = functools.partial(_select_cand_row, plan_ref, ret_ref, cand_ref, heat_ref, wr=wr, wc=wc, has_ret=has_ret,
                               less_ret=less_ret, width=width, wpad=wpad, heat_width=heat_width)
    if not span:
        select(layer_index(lay_ref[0], L), lambda at, val, mask: plgpu.store(o_ref.at[at], val, mask=mask))
        return
    j = pl.program_id(2)
    row = layer_index(lay_ref[0] + j, L)  # in range: the caller's first + count <= L
    pl.when(j < lay_ref[1])(
        lambda: select(row, lambda at, val, mask: plgpu.store(o_ref.at[row, at], val, mask=mask)))


def _select_cand_row(plan_ref, ret_ref, cand_ref, heat_ref, layer, put, *, wr: int, wc: int, has_ret: bool,
                     less_ret: bool, width: int, wpad: int, heat_width: int):
    """`_select_cand_kernel`'s selection of one row at layer `layer` (i32, in range); put(at, values, mask) stores
    into the row's output."""
    n_s, hi, nbv, count, full = (plan_ref[j] for j in range(5))
    i32 = jnp.int32
    cp, rp = max(16, next_pow2(wc)), max(16, next_pow2(wr))
    c = jnp.arange(cp, dtype=i32)
    cv = plgpu.load(cand_ref.at[layer, jnp.minimum(c, wc - 1)], mask=c < wc, other=-1)
    valid = (c < wc) & (cv >= n_s) & (cv < hi)
    r = jnp.arange(rp, dtype=i32)
    if has_ret:
        rv = plgpu.load(ret_ref.at[jnp.minimum(r, wr - 1)], mask=r < wr, other=-1)
        rmid = (r < wr) & (rv >= n_s) & (rv < hi)
        hit = (cv[:, None] == rv[None, :]) & rmid[None, :]
        valid = valid & (jnp.max(hit.astype(i32), axis=1) == 0)
        if less_ret:  # the set's valid entries, wherever they lie (`xla.select_from_candidates_xla`)
            count = count - jnp.sum(((r < wr) & (rv >= 0)).astype(i32))
    else:
        rv = jnp.full((rp,), -1, i32)
        rmid = r < 0
    hv = plgpu.load(heat_ref.at[layer, jnp.where(valid, cv, 0)], mask=valid, other=0.0)
    ahead = (hv[None, :] > hv[:, None]) | ((hv[None, :] == hv[:, None]) & (cv[None, :] < cv[:, None]))
    better = valid[None, :] & ahead  # ties to the lower block
    rank = jnp.sum(better.astype(i32), axis=1)
    chosen = valid & (rank < jnp.clip(count, 0, heat_width))
    n_mid = jnp.sum(rmid.astype(i32)) + jnp.sum(chosen.astype(i32))
    # Each middle block's slot: the middle blocks below it (both lists are disjoint).
    r_slot = n_s + jnp.sum((rmid[None, :] & (rv[None, :] < rv[:, None])).astype(i32), axis=1) \
        + jnp.sum((chosen[None, :] & (cv[None, :] < rv[:, None])).astype(i32), axis=1)
    c_slot = n_s + jnp.sum((chosen[None, :] & (cv[None, :] < cv[:, None])).astype(i32), axis=1) \
        + jnp.sum((rmid[None, :] & (rv[None, :] < cv[:, None])).astype(i32), axis=1)
    part = full == 0
    keep_r = rmid & part & (r_slot < width)
    keep_c = chosen & part & (c_slot < width)
    put(jnp.where(keep_r, r_slot, width), rv, keep_r)  # masked lanes point past the row
    put(jnp.where(keep_c, c_slot, width), cv, keep_c)
    j = jnp.arange(wpad, dtype=i32)
    after = j - n_s - n_mid
    ranged = jnp.where(j < n_s, j, jnp.where(after < nbv - hi, hi + after, -1))
    val = jnp.where(part, ranged, jnp.where(j < nbv, j, -1))
    put(pl.ds(0, wpad), val, (j < width) & (jnp.logical_not(part) | (j < n_s) | (after >= 0)))


def select_from_candidates_gpu(heat: Array, cand: Array, ret: Array | None, n_s: Array, hi: Array, nbv: Array,
                               count: Array, full: Array, *, num_kv_heads: int, width: int, heat_width: int,
                               layer: Array | None = None, count_less_ret: bool = False,
                               interpret: bool = False) -> Array:
    """`xla.select_from_candidates_xla` in one launch, grid (B, Hkv): pairwise ranks over the row's Wc heat
    candidates (read in place from the stacked candidates and heat with `layer`), no search over the blocks.
    Args / returns as there. The five row arrays are packed into one plan (`select_from_plan_gpu`)."""
    return select_from_plan_gpu(heat, cand, ret, make_plan(n_s, hi, nbv, count, full), num_kv_heads=num_kv_heads,
                                width=width, heat_width=heat_width, layer=layer, count_less_ret=count_less_ret,
                                interpret=interpret)


PLAN = 8  # a selection plan's entries per row: n_s, hi, nbv, count, full, then zeros (Triton blocks are powers of 2)


def make_plan(n_s: Array, hi: Array, nbv: Array, count: Array, full: Array, *extra: Array) -> Array:
    """i32[B, PLAN]: the five row arrays i32/bool[B] of `select_from_candidates` as one plan, then the caller's own
    `extra` rows (at most PLAN - 5; the kernel ignores them), zero padded."""
    rows = [x.astype(jnp.int32) for x in (n_s, hi, nbv, count, full, *extra)]
    if len(rows) > PLAN:
        raise ValueError(f"{len(extra)} extra plan rows: at most {PLAN - 5} fit beside the five")
    return jnp.stack(rows + [jnp.zeros_like(rows[0])] * (PLAN - len(rows)), axis=-1)


def select_from_plan_gpu(heat: Array, cand: Array, ret: Array | None, plan: Array, *, num_kv_heads: int, width: int,
                         heat_width: int, layer: Array | None = None, count_less_ret: bool = False,
                         interpret: bool = False) -> Array:
    """`select_from_candidates_gpu` given each row's five integers as one plan i32[B, PLAN] = (n_s, hi, nbv, count,
    full, zeros) (`make_plan`), read in-kernel: a plan made once per decode step (EvoSparse's `start_rows`) costs
    its layers no XLA kernel before the launch (five a layer when each layer derived them). count_less_ret: `count`
    is before the retrieval set, whose valid entries (ret >= 0) the kernel subtracts."""
    return _select_plan_call(heat, cand, ret, plan, num_kv_heads=num_kv_heads, width=width, heat_width=heat_width,
                             layer=layer, count_less_ret=count_less_ret, interpret=interpret)


def select_span_gpu(heat: Array, cand: Array, ret: Array | None, plan: Array, out: Array, first: Array,
                    count: Array, *, span: int, heat_width: int, count_less_ret: bool = False,
                    interpret: bool = False) -> Array:
    """`select_from_plan_gpu` of layers first .. first + count - 1 (count <= span, first + count <= L) in ONE launch,
    grid (B, Hkv, span): the selections of layers whose inputs are all known at once (EvoSparse's layers that
    inherit a retrieval set, made where the set is computed), written into their rows of out i32[L, B, Hkv, width]
    (aliased: the other rows are kept) and returned. heat f32[L, B, Hkv, nb] and cand i32[L, B, Hkv, Wc] stacked;
    first, count: i32[] (traced); span: the static grid extent (programs j >= count do nothing)."""
    if span < 1:
        raise ValueError(f"span={span}: expected at least one layer")
    if out.ndim != 4 or out.shape[:3] != heat.shape[:3]:
        raise ValueError(f"out of shape {out.shape}: expected [L, B, Hkv, width] beside heat {heat.shape}")
    return _select_plan_call(heat, cand, ret, plan, num_kv_heads=heat.shape[2], width=out.shape[-1],
                             heat_width=heat_width, layer=jnp.stack([jnp.asarray(first, jnp.int32),
                                                                     jnp.asarray(count, jnp.int32)]),
                             count_less_ret=count_less_ret, interpret=interpret, out=out, span=span)


def _select_plan_call(heat, cand, ret, plan, *, num_kv_heads: int, width: int, heat_width: int, layer,
                      count_less_ret: bool, interpret: bool, out: Array | None = None, span: int = 0) -> Array:
    B, Hkv = plan.shape[0], num_kv_heads
    if plan.ndim != 2 or plan.shape[1] != PLAN:
        raise ValueError(f"plan of shape {plan.shape}: expected [B, {PLAN}] (n_s, hi, nbv, count, full per row)")
    wide = max(cand.shape[-1], 0 if ret is None else ret.shape[-1])
    if wide > CAND_LIMIT:
        raise ValueError(f"{wide} candidates or retrieval blocks per row: the rank kernel takes at most "
                         f"CAND_LIMIT={CAND_LIMIT} (use the XLA version)")
    if layer is None:
        heat, cand = heat[None], cand[None]
    if heat.shape[1:3] != (B, Hkv) or cand.shape[:3] != heat.shape[:3]:
        raise ValueError(f"heat of shape {heat.shape} and candidates of shape {cand.shape}: expected [L, B={B}, "
                         f"Hkv={Hkv}, nb] and [L, B, Hkv, Wc]")
    has_ret = ret is not None
    ret = ret.astype(jnp.int32) if has_ret else jnp.full((B, 1), -1, jnp.int32)
    L, nb, wc, wr = heat.shape[0], heat.shape[-1], cand.shape[-1], ret.shape[-1]
    lay = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(-1)
    grid = (B, Hkv, span) if span else (B, Hkv)
    if span:  # every layer's rows of (b, h), the program's row written in place
        out_spec = pl.BlockSpec((L, None, None, width), lambda b, h, *_: (0, b, h, 0))
        out_shape = jax.ShapeDtypeStruct(out.shape, jnp.int32)
    else:
        out_spec = pl.BlockSpec((None, None, width), lambda b, h: (b, h, 0))
        out_shape = jax.ShapeDtypeStruct((B, Hkv, width), jnp.int32)
    args = (plan.astype(jnp.int32), lay, ret, cand.astype(jnp.int32), heat.astype(jnp.float32))
    return pl.pallas_call(
        functools.partial(_select_cand_kernel, wr=wr, wc=wc, has_ret=has_ret, less_ret=count_less_ret, width=width,
                          wpad=max(32, next_pow2(width)), heat_width=heat_width, L=L, span=span),
        grid=grid,
        in_specs=[pl.BlockSpec((None, PLAN), lambda b, h, *_: (b, 0)),
                  pl.BlockSpec((lay.shape[0],), lambda b, h, *_: (0,)),
                  pl.BlockSpec((None, wr), lambda b, h, *_: (b, 0)),
                  pl.BlockSpec((L, None, None, wc), lambda b, h, *_: (0, b, h, 0)),
                  pl.BlockSpec((L, None, None, nb), lambda b, h, *_: (0, b, h, 0))]
        + ([out_spec] if span else []),
        out_specs=out_spec,
        out_shape=out_shape,
        input_output_aliases={5: 0} if span else {},
        compiler_params=plgpu.CompilerParams(num_warps=CAND_WARPS, num_stages=1),
        interpret=interpret, name="evosparse_select_" + ("span" if span else "candidates"),
    )(*args, *((out.astype(jnp.int32),) if span else ()))

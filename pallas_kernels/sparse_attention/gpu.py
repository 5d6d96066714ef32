"""Pallas GPU (Triton) kernels of the gathered sparse-attention ops.

Decode (`sparse_decode_gpu`): split-K flash decoding over a gathered key set.
  grid (B, Hkv, T, S): one program per batch row, KV head, new token and split of the K index entries. The
  program holds the whole GQA group's queries as one [Gp, D] tile (G padded to >= 16 rows for the tensor-core
  dot), and each iteration gathers `block_k` key/value rows by index (block_k / block_size entries, each
  expanded to its block_size tokens) straight from the head-major cache [N, D] of its KV head, then updates an
  online softmax in f32. It writes a partial (o, m, l) per split; a jnp combine merges the S splits (as
  jax/experimental/pallas/ops/gpu/decode_attention.py does for dense decode). Each program stops after the
  last entry that can contribute (computed per row outside the kernel), so -1 padding costs nothing.

Prefill (`sparse_prefill_gpu`): tile-gathered causal flash attention.
  grid (B, Hq, nt): one program per batch row, query head and query tile of `tile` rows (the last tiles,
  which have the most selected keys, are scheduled first; the heads of a GQA group run side by side, so
  their shared K/V rows are served from L2). It iterates first
  over the tile's selected keys (gathered by index, `block_k` rows at a time, only up to the last entry before
  the tile start), then over the causal diagonal tile (contiguous rows), with an online softmax in f32.
  Small tiles (G * tile <= `PrefillConfig.gqa_rows`, G a power of two) go to `gpu_prefill_gqa` instead: one
  program per (KV head, tile) holding the whole GQA group, so each selected row is gathered once per tile.

Both read the inputs in place (no transposes, no copies of the cache) and run in interpret mode on CPU
(`interpret=True`). Semantics: exactly `reference.py`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.sparse_attention import gpu_prefill_gqa as gqa
from pallas_kernels.sparse_attention.common import check_decode_args, default_scale
from pallas_kernels.sparse_attention.gpu_common import (  # noqa: F401  (unsupported_reason, _MASK, _pow2: also used by other kernels)
    _MASK, _MIN_ROWS, _check_prefill, _check_supported, _gather_rows, _online_softmax_step, _pow2, _tile_attention,
    _useful_end, prefill_operands, unsupported_reason)

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tuning of the decode kernel.

    Attributes:
      block_k: key rows gathered per inner iteration (a power of two >= block_size).
      num_splits: splits of the index entries per (row, KV head, token); None picks enough splits for about
        `target_programs` programs in total.
      target_programs: grid size the split heuristic aims for: one wave, 132 SMs of an H100 holding two programs
        each (3 stages of 64-row K and V tiles, 96 KB). Against 512, at 100K on Llama-3.1-8B shapes, batch 4:
        EvoSparse 8.294 -> 8.234 ms a step, Kascade 9.672 -> 9.627; at batch 1 the oracle and EvoSparse within
        0.1% (eval/results/h100/decode_waves/). A config with smaller tiles fits more programs an SM and wants
        a larger target (H2O's 32-row tiles: 512).
      num_warps: warps per program.
      num_stages: software pipelining depth of the inner loop.
    """

    block_k: int = 64
    num_splits: int | None = None
    target_programs: int = 264
    num_warps: int = 4
    num_stages: int = 3  # H100, 128K B8 10%: 0.174 ms vs 0.188 at 2 (bench_attention_llama3-8b_128k_decode_tunings)


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Tuning of the prefill kernel.

    Attributes:
      block_k: key rows per inner iteration (selected keys and diagonal tile alike); a power of two.
      num_warps: warps per program.
      num_stages: software pipelining depth.
      gqa_rows: when the GQA group is a power of two G > 1, G * tile <= gqa_rows and D <= 128 (an M x D f32
        accumulator on 4 warps), one program takes the whole group of a query tile (`gpu_prefill_gqa`, M = G *
        tile rows, 4 warps, 3 stages): each selected K/V row is gathered once per tile instead of once per query
        head. H100, 128K, 10%, Llama-3.1-8B heads: at tile 32 56.3 ms against 115.1 for one program per head
        (eval/results/h100/prefill_gqa/); at tile 128 (M 512) it is slower, at tile 64 (M 256) about equal,
        hence 128. 0: never.
    """

    block_k: int = 64
    num_warps: int = 4  # H100, 128K, tile 128, 10%: 51.8 ms vs 67.1 at 8 warps (eval/results/h100/prefill_gqa/)
    num_stages: int = 2  # (at 4 warps 3 stages: 82 ms)
    gqa_rows: int = 128














# ---------------------------------------------------------------------------------------------------------
# Decode.


def _decode_kernel(pos_ref, end_ref, ent_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, scale: float,
                   block_size: int, block_k: int, entries_per_split: int):
    """One (b, h, t, split) program.

    Refs: pos_ref, end_ref: i32[1] (last token the query may see: its position, capped at N - 1; 1 + last
    useful entry of the row); ent_ref: i32[E] this
    split's entries; q_ref: [Gp, D]; k_ref, v_ref: [N, D]; outputs o_ref: f32[Gp, D], m_ref, l_ref: f32[Gp].
    """
    split = pl.program_id(3)
    pos = pos_ref[0]
    per_iter = block_k // block_size
    n_entries = jnp.clip(end_ref[0] - split * entries_per_split, 0, entries_per_split)
    q = q_ref[...]
    gp, d = q.shape

    def body(it, carry):
        ok, k, v = _gather_rows(ent_ref, k_ref, v_ref, it * per_iter, pos, block_size, block_k)
        return _online_softmax_step(q, k, v, ok[None, :], carry, scale)

    init = (jnp.zeros((gp, d), jnp.float32), jnp.full((gp,), _MASK, jnp.float32), jnp.zeros((gp,), jnp.float32))
    o, m, l = lax.fori_loop(0, pl.cdiv(n_entries, per_iter), body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def store_partials(o_ref, m_ref, l_ref, o: Array, m: Array, l: Array, G: int, at: tuple = ()) -> None:
    """Writes a program's split partials (o [Gp, D], m, l [Gp]): only the G real query rows, since the padding
    rows of the Gp block are never read (at G = 4 of 16 rows, a quarter of the bytes). at: the leading indices of
    the program's partials in blocks that hold more (every split's: `(split,)`), or () for a block of its own."""
    gp = o.shape[0]
    rows = jnp.arange(gp, dtype=jnp.int32) < G
    plgpu.store(o_ref.at[at + (pl.ds(0, gp), slice(None))], o, mask=jnp.broadcast_to(rows[:, None], o.shape))
    plgpu.store(m_ref.at[at + (pl.ds(0, gp),)], m, mask=rows)
    plgpu.store(l_ref.at[at + (pl.ds(0, gp),)], l, mask=rows)




def combine_splits(o: Array, m: Array, l: Array) -> tuple[Array, Array]:
    """Merges split partials: o f32[S, ..., D], m, l f32[S, ...] -> (normalised o f32[..., D] (zeros if empty),
    log-sum-exp f32[...] (-inf if empty)); also the dense decode kernel's (`pallas_kernels.dense_decode.gpu`)."""
    m_all = jnp.max(m, axis=0)
    w = jnp.exp(m - m_all[None])
    l_all = jnp.sum(w * l, axis=0)
    o_all = jnp.sum(w[..., None] * o, axis=0)
    nonempty = l_all > 0
    l_safe = jnp.where(nonempty, l_all, 1.0)
    out = jnp.where(nonempty[..., None], o_all / l_safe[..., None], 0.0)
    lse = jnp.where(nonempty, m_all + jnp.log(l_safe), -jnp.inf)
    return out, lse


def decode_split_plan(config: DecodeConfig, K: int, block_size: int, rows: int, G: int):
    """(block_k, splits, E entries per split, Gp padded GQA rows) of a gathered decode over K index entries
    for `rows` = B * Hkv * T programs before splitting (validates the config). Every split holds entries: once E is
    rounded up to whole iterations, the splits are the ones the K entries fill (EvoSparse's 128 blocks at batch 3
    over 8 KV heads: at a target of 512 programs 16 splits of 8, where the heuristic asked for 22, six of them empty
    until 2026-12-07; at the default 264, 11 splits of 12)."""
    block_k = max(config.block_k, block_size)
    if not _pow2(block_k):
        raise ValueError(f"DecodeConfig.block_k={config.block_k}: expected a power of two")
    if config.num_splits is not None and config.num_splits < 1:
        raise ValueError(f"DecodeConfig.num_splits={config.num_splits}: expected >= 1 or None")
    per_iter = block_k // block_size
    splits = config.num_splits or pl.cdiv(config.target_programs, rows)
    splits = max(1, min(splits, pl.cdiv(K, per_iter)))
    E = pl.cdiv(pl.cdiv(K, splits), per_iter) * per_iter  # entries per split
    return block_k, pl.cdiv(K, E) if E else 1, E, max(_MIN_ROWS, pl.next_power_of_2(G))


def split_outputs(splits: int, B: int, Hkv: int, T: int, Gp: int, D: int):
    """(out_specs, out_shape) of the split partials o f32[S, B, Hkv, T, Gp, D], m, l f32[S, B, Hkv, T, Gp] of a
    grid (B, Hkv, T, S)."""
    specs = [pl.BlockSpec((None, None, None, None, Gp, D), lambda b, h, t, s: (s, b, h, t, 0, 0)),
             pl.BlockSpec((None, None, None, None, Gp), lambda b, h, t, s: (s, b, h, t, 0)),
             pl.BlockSpec((None, None, None, None, Gp), lambda b, h, t, s: (s, b, h, t, 0))]
    shapes = [jax.ShapeDtypeStruct((splits, B, Hkv, T, Gp, D), jnp.float32),
              jax.ShapeDtypeStruct((splits, B, Hkv, T, Gp), jnp.float32),
              jax.ShapeDtypeStruct((splits, B, Hkv, T, Gp), jnp.float32)]
    return specs, shapes


def finish_splits(o: Array, m: Array, l: Array, G: int, dtype):
    """The split partials (`split_outputs`) merged: (out [B, T, Hq, D] in dtype, lse f32[B, Hkv, T, G])."""
    _, B, Hkv, T, _, D = o.shape
    out, lse = combine_splits(o[..., :G, :], m[..., :G], l[..., :G])  # [B, Hkv, T, G, D], [B, Hkv, T, G]
    return out.transpose(0, 2, 1, 3, 4).reshape(B, T, Hkv * G, D).astype(dtype), lse


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "return_lse", "config", "interpret"))
def sparse_decode_gpu(q: Array, k: Array, v: Array, indices: Array, lengths: Array, *, block_size: int = 1,
                      scale: float | None = None, return_lse: bool = False,
                      config: DecodeConfig = DecodeConfig(), interpret: bool = False) -> Array | tuple[Array, Array]:
    """Gathered decode attention, Pallas Triton kernel. Args and returns as `reference.sparse_decode_reference`.

    Args:
      q: [B, T, Hq, D]; k, v: [B, Hkv, N, D] head-major cache; indices: int32[B, Hkv, T, K]; lengths: int32[B].
      config: kernel tuning (`DecodeConfig`).
      interpret: run the kernel in the Pallas interpreter (CPU tests).

    Returns:
      [B, T, Hq, D] in q.dtype (and lse: f32[B, T, Hq] with return_lse).
    """
    check_decode_args(q, k, v, indices, lengths, block_size)
    _check_supported(q, block_size, None, interpret)
    B, T, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G, K = Hq // Hkv, indices.shape[3]
    scale = default_scale(D, scale)
    block_k, splits, E, Gp = decode_split_plan(config, K, block_size, B * Hkv * T, G)

    lengths = lengths.astype(jnp.int32)
    pos = lengths[:, None] - T + jnp.arange(T, dtype=jnp.int32)  # [B, T]
    limit = jnp.minimum(pos, N - 1)  # tokens past the cache end can never be valid
    ent = jnp.pad(indices.astype(jnp.int32), ((0, 0), (0, 0), (0, 0), (0, splits * E - K)), constant_values=-1)
    end = _useful_end(ent, limit[:, None, :], block_size)  # [B, Hkv, T]
    qg = q.reshape(B, T, Hkv, G, D).transpose(0, 2, 1, 3, 4)  # [B, Hkv, T, G, D]
    if Gp != G:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, 0), (0, Gp - G), (0, 0)))

    kernel = functools.partial(_decode_kernel, scale=scale, block_size=block_size, block_k=block_k,
                               entries_per_split=E)
    out_specs, out_shape = split_outputs(splits, B, Hkv, T, Gp, D)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(B, Hkv, T, splits),
        in_specs=[
            pl.BlockSpec((None, 1), lambda b, h, t, s: (b, t)),  # limit: last token the query may see
            pl.BlockSpec((None, None, 1), lambda b, h, t, s: (b, h, t)),  # end: 1 + last useful entry
            pl.BlockSpec((None, None, None, E), lambda b, h, t, s: (b, h, t, s)),  # this split's entries
            pl.BlockSpec((None, None, None, Gp, D), lambda b, h, t, s: (b, h, t, 0, 0)),  # GQA group queries
            pl.BlockSpec((None, None, N, D), lambda b, h, t, s: (b, h, 0, 0)),  # the KV head's whole cache
            pl.BlockSpec((None, None, N, D), lambda b, h, t, s: (b, h, 0, 0)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="sparse_decode_gathered",
    )(limit, end, ent, qg, k, v)

    out, lse = finish_splits(o, m, l, G, q.dtype)
    if return_lse:
        return out, lse.transpose(0, 2, 1, 3).reshape(B, T, Hq)
    return out


# ---------------------------------------------------------------------------------------------------------
# Prefill.






def _prefill_kernel(len_ref, end_ref, ent_ref, q_ref, k_ref, v_ref, o_ref, *, scale: float, block_size: int,
                    block_k: int, tile: int, num_tiles: int):
    """One (b, query head, query tile) program; grid step i runs tile num_tiles - 1 - i (the costliest first).

    Refs: len_ref, end_ref: i32[1] (row length; 1 + last useful entry of the tile); ent_ref: i32[Kp] the tile's
    entries; q_ref: [tile, D]; k_ref, v_ref: [Tp, D] (the KV head's keys, token stride Hkv * D);
    o_ref: [tile, D].
    """
    start = (num_tiles - 1 - pl.program_id(2)) * tile
    qpos = start + jnp.arange(tile, dtype=jnp.int32)
    o = _tile_attention(q_ref[...], qpos, len_ref[0], end_ref, ent_ref, k_ref, v_ref, start, tile, scale=scale,
                        block_size=block_size, block_k=block_k, tile=tile)
    o_ref[...] = o.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("tile", "block_size", "scale", "config", "interpret"))
def sparse_prefill_gpu(q: Array, k: Array, v: Array, indices: Array, lengths: Array, *, tile: int = 32,
                       block_size: int = 1, scale: float | None = None, config: PrefillConfig = PrefillConfig(),
                       interpret: bool = False) -> Array:
    """Tile-gathered prefill attention, Pallas Triton kernel. Args and returns as
    `reference.sparse_prefill_reference`.

    Args:
      q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]; indices: int32[B, Hkv, ceil(T/tile), K]; lengths: int32[B].
      tile: query rows per program; a power of two >= 16 (smaller powers of two only in interpret mode).
      config: kernel tuning (`PrefillConfig`).
      interpret: run the kernel in the Pallas interpreter (CPU tests).

    Returns:
      [B, T, Hq, D] in q.dtype; rows at or beyond lengths are zeros.
    """
    B, T, Hq, D, Hkv, G, nt = _check_prefill(q, k, v, indices, lengths, tile, block_size, interpret)
    if (G > 1 and _pow2(G) and G * tile <= config.gqa_rows and D <= 128
            and (interpret or G * tile >= _MIN_ROWS)):
        cfg = gqa.PrefillGQAConfig(block_k=config.block_k, rows_per_program=G * tile, num_warps=4, num_stages=3)
        return gqa.sparse_prefill_gqa_gpu(q, k, v, indices, lengths, tile=tile, block_size=block_size, scale=scale,
                                          config=cfg, interpret=interpret)
    scale = default_scale(D, scale)
    block_k = max(config.block_k, block_size)
    if not _pow2(block_k):
        raise ValueError(f"PrefillConfig.block_k={config.block_k}: expected a power of two")
    q, k, v, lens, end, ent = prefill_operands(q, k, v, indices, lengths, tile, block_size, block_k)
    Tp, Kp = q.shape[1], ent.shape[-1]

    kernel = functools.partial(_prefill_kernel, scale=scale, block_size=block_size, block_k=block_k, tile=tile,
                               num_tiles=nt)
    last = nt - 1  # grid step i runs query tile last - i: late tiles have the most keys, so they start first
    out = pl.pallas_call(
        kernel,
        grid=(B, Hq, nt),
        in_specs=[
            pl.BlockSpec((None, 1), lambda b, h, i: (b, 0)),  # row length
            pl.BlockSpec((None, None, None, 1), lambda b, h, i: (b, h // G, last - i, 0)),  # 1 + last useful entry
            pl.BlockSpec((None, None, None, Kp), lambda b, h, i: (b, h // G, last - i, 0)),  # the tile's entries
            pl.BlockSpec((None, tile, None, D), lambda b, h, i: (b, last - i, h, 0)),  # query tile of head h
            pl.BlockSpec((None, Tp, None, D), lambda b, h, i: (b, 0, h // G, 0)),  # KV head's keys
            pl.BlockSpec((None, Tp, None, D), lambda b, h, i: (b, 0, h // G, 0)),
        ],
        out_specs=pl.BlockSpec((None, tile, None, D), lambda b, h, i: (b, last - i, h, 0)),
        out_shape=jax.ShapeDtypeStruct((B, Tp, Hq, D), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="sparse_prefill_gathered",
    )(lens, end, ent, q, k, v)
    return out[:, :T]

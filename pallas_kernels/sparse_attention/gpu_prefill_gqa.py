"""Tile-gathered prefill attention with the GQA group packed into one program (Pallas Triton).

`sparse_prefill_gqa_gpu` computes exactly `reference.sparse_prefill_reference` (and what `gpu.sparse_prefill_gpu`
computes), but one program handles (b, part, KV head, query tile) instead of (b, query head, query tile): the G
query heads of the KV head for `r = tile // parts` consecutive query rows of the tile, i.e. a block of
M = G * r query rows ordered (row, head) (row m is query row start + part * r + m // G of head kv * G + m % G).
Each selected K/V block of the tile is then gathered once per part instead of once per query head, so the
gathered bytes fall by G / parts (Llama-3.1-8B, G = 4, tile 128, M = 256: parts = 2, half the bytes).

The queries of a program are one [r, G, D] block of q [B, T, Hq, D] (heads kv * G .. kv * G + G - 1 are
adjacent), loaded whole and reshaped to [M, D]; the output goes back the same way. Nothing is transposed or
copied outside the kernel (only the padding of T to whole tiles, as the per-head kernel does).

Where it is used: `gpu.sparse_prefill_gpu` hands a call to this kernel when G is a power of two > 1 and G * tile
<= `PrefillConfig.gqa_rows` (one part of M = G * tile rows): at Kascade's default tile of 32 it takes 56 ms where
one program per head takes 115 (H100, 128K, 10%; eval/results/h100/prefill_gqa/). At tile 128 (M 256 or 512) it
was no faster than one program per head, which therefore stays the kernel there.

Schedule: the grid is (B, parts, Hkv, nt); Triton launches the collapsed (B, parts) fastest, then the KV heads,
then the tiles, last tile first (the costliest, like `gpu.sparse_prefill_gpu`), so the parts of one
(KV head, tile) run side by side and share their gathered rows in L2. The diagonal loop of part p only visits
the key chunks up to its last query row.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.sparse_attention.common import default_scale
from pallas_kernels.sparse_attention.gpu_common import _MIN_ROWS, _check_prefill, _pow2, _tile_attention, prefill_operands

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class PrefillGQAConfig:
    """Tuning of the GQA-packed prefill kernel.

    Attributes:
      block_k: key rows per inner iteration (selected keys and diagonal tile alike); a power of two.
      rows_per_program: M, query rows of one program (G heads x tile // parts rows); a power of two. The
        number of parts per tile is G * tile / M; an M above G * tile is taken as G * tile (one part).
      num_warps: warps per program; a power of two.
      num_stages: software pipelining depth; >= 1.
    """

    block_k: int = 64
    rows_per_program: int = 256
    num_warps: int = 8
    num_stages: int = 2

    def validate(self) -> None:
        """Raises ValueError naming the first bad field."""
        for name in ("block_k", "rows_per_program", "num_warps"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or not _pow2(val):
                raise ValueError(f"PrefillGQAConfig.{name}={val!r}: expected a power of two >= 1")
        if not isinstance(self.num_stages, int) or isinstance(self.num_stages, bool) or self.num_stages < 1:
            raise ValueError(f"PrefillGQAConfig.num_stages={self.num_stages!r}: expected an int >= 1")


def plan(config: PrefillGQAConfig, G: int, tile: int, block_size: int, interpret: bool = False):
    """(M rows per program, parts per tile, r query rows per program, block_k) for a GQA group of G heads
    and query tiles of `tile` rows (validates the config against them)."""
    config.validate()
    if not _pow2(G):
        raise ValueError(f"G={G} query heads per KV head (Hq / Hkv): the GQA-packed kernel needs a power of two")
    M = min(config.rows_per_program, G * tile)
    if M < G:
        raise ValueError(f"PrefillGQAConfig.rows_per_program={config.rows_per_program}: expected >= G={G} "
                         f"(a program holds every head of its query rows)")
    if not interpret and M < _MIN_ROWS:
        raise ValueError(f"PrefillGQAConfig.rows_per_program={config.rows_per_program}: the Triton kernel needs "
                         f">= {_MIN_ROWS} rows per program (tensor-core dot)")
    r = M // G
    parts = tile // r
    return M, parts, r, max(config.block_k, block_size)


def _prefill_gqa_kernel(len_ref, end_ref, ent_ref, q_ref, k_ref, v_ref, o_ref, *, scale: float, block_size: int,
                        block_k: int, tile: int, rows: int, num_tiles: int):
    """One (b, part, KV head, query tile) program; grid step i runs tile num_tiles - 1 - i (the costliest first).

    Refs: len_ref, end_ref: i32[1] (row length; 1 + last useful entry of the tile); ent_ref: i32[Kp] the tile's
    entries; q_ref: [rows, G, D] (query rows start + part * rows .. of the KV head's G query heads);
    k_ref, v_ref: [Tp, D] (the KV head's keys, token stride Hkv * D); o_ref: [rows, G, D].
    """
    part = pl.program_id(1)
    start = (num_tiles - 1 - pl.program_id(3)) * tile
    r, G, d = q_ref.shape
    q = q_ref[...].reshape(r * G, d)  # row m = (query row m // G, head m % G)
    first = start + part * rows  # the program's first query row
    qpos = first + jnp.arange(r * G, dtype=jnp.int32) // G
    # The tile's keys start .. first + rows - 1: chunks past the program's last query row are never needed.
    o = _tile_attention(q, qpos, len_ref[0], end_ref, ent_ref, k_ref, v_ref, start, (part + 1) * rows, scale=scale,
                        block_size=block_size, block_k=block_k, tile=tile)
    o_ref[...] = o.reshape(r, G, d).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("tile", "block_size", "scale", "config", "interpret"))
def sparse_prefill_gqa_gpu(q: Array, k: Array, v: Array, indices: Array, lengths: Array, *, tile: int = 32,
                           block_size: int = 1, scale: float | None = None,
                           config: PrefillGQAConfig = PrefillGQAConfig(), interpret: bool = False) -> Array:
    """Tile-gathered prefill attention, GQA group packed per program (Pallas Triton). Args and returns as
    `reference.sparse_prefill_reference` and `gpu.sparse_prefill_gpu`.

    Args:
      q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]; indices: int32[B, Hkv, ceil(T/tile), K]; lengths: int32[B].
      tile: query rows per index row; a power of two >= 16 (smaller powers of two only in interpret mode).
      config: kernel tuning (`PrefillGQAConfig`); G = Hq / Hkv must be a power of two.
      interpret: run the kernel in the Pallas interpreter (CPU tests).

    Returns:
      [B, T, Hq, D] in q.dtype; rows at or beyond lengths are zeros.
    """
    B, T, Hq, D, Hkv, G, nt = _check_prefill(q, k, v, indices, lengths, tile, block_size, interpret)
    M, parts, r, block_k = plan(config, G, tile, block_size, interpret)
    scale = default_scale(D, scale)
    q, k, v, lens, end, ent = prefill_operands(q, k, v, indices, lengths, tile, block_size, block_k)
    Tp, Kp = q.shape[1], ent.shape[-1]

    kernel = functools.partial(_prefill_gqa_kernel, scale=scale, block_size=block_size, block_k=block_k,
                               tile=tile, rows=r, num_tiles=nt)
    last = nt - 1  # grid step i runs query tile last - i: late tiles have the most keys, so they start first
    qo_spec = pl.BlockSpec((None, r, G, D), lambda b, p, h, i: (b, (last - i) * parts + p, h, 0))
    out = pl.pallas_call(
        kernel,
        grid=(B, parts, Hkv, nt),
        in_specs=[
            pl.BlockSpec((None, 1), lambda b, p, h, i: (b, 0)),  # row length
            pl.BlockSpec((None, None, None, 1), lambda b, p, h, i: (b, h, last - i, 0)),  # 1 + last useful entry
            pl.BlockSpec((None, None, None, Kp), lambda b, p, h, i: (b, h, last - i, 0)),  # the tile's entries
            qo_spec,  # the part's query rows of the KV head's G query heads
            pl.BlockSpec((None, Tp, None, D), lambda b, p, h, i: (b, 0, h, 0)),  # KV head's keys
            pl.BlockSpec((None, Tp, None, D), lambda b, p, h, i: (b, 0, h, 0)),
        ],
        out_specs=qo_spec,
        out_shape=jax.ShapeDtypeStruct((B, Tp, Hq, D), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="sparse_prefill_gathered_gqa",
    )(lens, end, ent, q, k, v)
    return out[:, :T]

"""Tile-gathered sparse prefill attention as a Mosaic GPU (Hopper) kernel: TMA gathers of the selected key blocks
into shared memory, overlapped with WGMMA, and an online softmax.

`sparse_prefill_mgpu` computes exactly `reference.sparse_prefill_reference` (and what the Triton kernels of
`gpu.py` / `gpu_prefill_gqa.py` compute): query tile i attends to the tokens of its selected blocks that lie
before the tile start, plus its own tile causally; rows at or beyond `lengths` are zeros.

How the selected keys are gathered (the choice this kernel makes). Hopper's tensor copy engine (TMA) copies a
box at a dynamic offset; it has no row gather (the gather4 TMA is Blackwell's), and Pallas Mosaic GPU exposes no
`cp.async` on sm_90. A token-level selection (`block_size=1`, Kascade's) would need one TMA per key row and per
64 columns (the 128-byte swizzle bounds a box row), i.e. 4 copies, 4 barrier arrivals and a scalar index load
for every gathered K/V row, and the (8, 64)-tiled shared-memory layout that WGMMA reads cannot take one-row
copies at all. So this kernel takes the selection in **blocks of contiguous keys** (`block_size` a multiple of
8, e.g. 16, 64 or 128 tokens per index entry, in the existing index contract: entry j covers tokens
j*bs .. j*bs + bs - 1): each valid entry is one TMA copy of [bs, D] rows for K and one for V, straight into the
swizzled WGMMA operand buffers. Token-level indices keep running on the Triton kernel (`implementation=
"pallas_gpu"`, the default); a method that wants this kernel selects blocks (`block_size >= 8`).

Layout of the work. A CTA takes 128 query rows of one KV head's GQA group in one query tile: the group's G *
tile rows, ordered (query head, row), are cut into `parts` = G * tile / 128 CTAs of two compute warpgroups of 64
rows each (the WGMMA M side). At tile 128 a CTA is one query head's tile (4 CTAs per KV head and tile for
Llama's G = 4; they run side by side and share the gathered blocks in L2); at tile 32 one CTA holds all four
heads, so each block is gathered once per tile. G * tile = 64 runs one compute warpgroup. A third, memory
warpgroup streams the steps through `stages` ring buffers of `block_kv` keys: first the tile's selected blocks
(block_kv / bs entries a step, one TMA each for K and for V), then the diagonal tile (the same copies over
contiguous blocks). The compute warpgroups run Q.K^T (WGMMA, f32 accumulator), the online softmax (exp2, the
running max in log2 units) and P.V (WGMMA with P from registers), taking turns on the tensor cores (`schedule`)
as JAX's Mosaic GPU flash attention does.

Entries are compacted before the kernel (valid entries first, one cumsum and scatter in XLA, so -1 padding and
entries at or after the tile start may sit anywhere, as the contract allows); the kernel masks the tail of the
last selected step by a column count and the diagonal by position. Only the steps that hold valid keys run.

First H100 run (`jsparse bench sparse_prefill_mgpu`, B 1, Llama-3.1-8B heads, bf16, 10% per tile, random block
selections; the JSON is not committed yet): at 128K and tile 128, 24.9 ms = 572 TFLOP/s on the selected work with
blocks of 64 (27.0 ms, 527 TFLOP/s with blocks of 16), where the Triton kernel takes 51.1 ms on the same selection
(52.2 ms on a token-level one) and cuDNN's dense causal attention 240 ms; tile 64: 25.0 ms, tile 32 (blocks of 16):
27.4 ms; at 32K 2.0-2.3 ms against 4.0-4.8 (Triton) and 14.9 (cuDNN). Steps of 64 keys with 3 or 4 stages were
slower (28-33 ms at 128K, tile 128). Every compiled check against the reference passed.

Requirements (`unsupported_reason`): bf16 or f16 q, k, v alike; head_dim 64 or 128 (shared memory); block_size
a power of two in [8, block_kv]; tile 32, 64 or 128 with G * tile a multiple of 64 (G = Hq / Hkv); a CUDA device of
compute capability 9.x (or `interpret=True`: the Mosaic GPU interpreter on CPU, with simulated warpgroups,
barriers, TMA and shared memory). T is padded to whole tiles here.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.sparse_attention.common import blocks_before, check_prefill_args, default_scale

Array = jax.Array

LOG2E = math.log2(math.e)
ROWS = 64  # query rows of one compute warpgroup (the WGMMA M side)
TILES = (32, 64, 128)
HEAD_DIMS = (64, 128)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class MosaicPrefillConfig:
    """Tuning of the Mosaic GPU sparse prefill kernel.

    Attributes:
      block_kv: keys per pipeline step (64 or 128; a multiple of block_size).
      stages: K/V ring buffers in flight (>= 2; 2 x 128 keys x D 128 x 2 tensors = 128 KB of shared memory).
      schedule: the two compute warpgroups take turns on the tensor cores (one's WGMMA runs while the other
        computes its exps).
    """

    block_kv: int = 128
    stages: int = 2
    schedule: bool = True

    def validate(self) -> None:
        """Raises ValueError naming the first bad field."""
        if self.block_kv not in (64, 128):
            raise ValueError(f"MosaicPrefillConfig.block_kv={self.block_kv!r}: expected 64 or 128")
        if not isinstance(self.stages, int) or isinstance(self.stages, bool) or self.stages < 2:
            raise ValueError(f"MosaicPrefillConfig.stages={self.stages!r}: expected an int >= 2")


def _pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def unsupported_reason(dtype, head_dim: int, block_size: int, tile: int | None, group: int | None = None,
                       config: MosaicPrefillConfig = MosaicPrefillConfig()) -> str | None:
    """Why the Mosaic GPU prefill kernel cannot take these arguments on any device (None when it can).

    Args: dtype of q (k and v alike); head_dim D; block_size tokens per index entry; tile query rows per index
    row (None: decode, which this kernel does not do); group G = Hq / Hkv (None: not checked).
    """
    if tile is None:
        return "decode (the Mosaic GPU kernel is prefill only; use the Triton kernel, implementation='pallas_gpu')"
    if jnp.dtype(dtype) not in DTYPES:
        return f"dtype {jnp.dtype(dtype).name} (expected bfloat16 or float16)"
    if head_dim not in HEAD_DIMS:
        return f"head_dim D={head_dim} (expected one of {HEAD_DIMS}: larger heads exceed shared memory)"
    if not _pow2(block_size) or block_size < 8 or block_size > config.block_kv:
        return (f"block_size={block_size} (expected a power of two in [8, block_kv={config.block_kv}]: each index "
                f"entry is one TMA copy of whole 8-row tiles; token-level indices (block_size 1) run on the Triton "
                f"kernel, implementation='pallas_gpu')")
    if tile not in TILES:
        return f"tile={tile} (expected one of {TILES})"
    if group is not None and (group * tile) % ROWS:
        return (f"G * tile = {group} * {tile} = {group * tile} query rows per KV head and tile (expected a multiple "
                f"of {ROWS}, the WGMMA M side)")
    return None


def hopper() -> bool:
    """Whether the default device is a CUDA GPU of compute capability 9.x."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    cc = getattr(dev, "compute_capability", None)
    return dev.platform == "gpu" and isinstance(cc, str) and cc.startswith("9")


def _interpret(interpret):
    """None (compiled), or the Mosaic GPU interpreter's parameters: `interpret` is False, True or a
    `plgpu.InterpretGPUParams` (e.g. with detect_races=True)."""
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if interpret else None


def compact_entries(indices: Array, tile: int, block_size: int) -> tuple[Array, Array]:
    """The entries each query tile can use, moved to the front of its row.

    Args:
      indices: int32[B, Hkv, nt, K] selected blocks per query tile, -1 padded (any order).
      tile, block_size: as `sparse_prefill_mgpu`.

    Returns:
      (ent: int32[B, Hkv, nt, K], the valid entries (>= 0 and before the tile start) first, in their order,
       then zeros (block 0: an in-bounds copy, masked in the kernel); count: int32[B, Hkv, nt] valid entries).
    """
    K = indices.shape[-1]
    nt = indices.shape[2]
    ind = indices.astype(jnp.int32)
    starts = jnp.arange(nt, dtype=jnp.int32) * tile
    ok = blocks_before(ind, starts[:, None], block_size)
    count = jnp.sum(ok, axis=-1, dtype=jnp.int32)
    pos = jnp.where(ok, jnp.cumsum(ok, axis=-1, dtype=jnp.int32) - 1, K)  # K: dropped
    rows = ind.reshape(-1, K)
    out = jnp.zeros((rows.shape[0], K), jnp.int32).at[jnp.arange(rows.shape[0])[:, None], pos.reshape(-1, K)].set(
        rows, mode="drop")
    return out.reshape(ind.shape), count


def _accumulate(body, acc: Array, interpret) -> Array:
    """acc + the WGMMA products that `body(acc_ref)` issues into a fresh accumulator ref.

    Compiled, the products accumulate in place (`pl.run_state` over an accumulator initialised with acc). The
    Mosaic GPU interpreter does not run `run_state` (jax 0.11.2), so there the products go into a zeroed
    accumulator (`pl.run_scoped`) that is added to acc: the same sum.
    """
    if interpret:
        def scoped(acc_ref):
            body(acc_ref)
            return acc_ref[...]

        return acc + pl.run_scoped(scoped, plgpu.ACC(acc.shape, jnp.float32))
    return pl.run_state(body)(plgpu.ACC.init(acc))


def _pad_rows(x: Array, Tp: int) -> Array:
    T = x.shape[1]
    return x if Tp == T else jnp.pad(x, [(0, 0), (0, Tp - T), (0, 0), (0, 0)])


@functools.partial(jax.jit, static_argnames=("tile", "block_size", "scale", "config", "interpret"))
def sparse_prefill_mgpu(q: Array, k: Array, v: Array, indices: Array, lengths: Array, *, tile: int = 128,
                        block_size: int = 64, scale: float | None = None,
                        config: MosaicPrefillConfig = MosaicPrefillConfig(), interpret=False) -> Array:
    """Tile-gathered causal prefill attention over selected key blocks, Mosaic GPU kernel (Hopper).

    Args and returns as `reference.sparse_prefill_reference`:
      q: [B, T, Hq, D] bf16/f16 queries (positions 0 .. T-1); k, v: [B, T, Hkv, D] in q's dtype.
      indices: int32[B, Hkv, ceil(T/tile), K] selected blocks of `block_size` tokens per query tile, -1 padded
        (entries at or after the tile start are ignored).
      lengths: int32[B] valid tokens per row.
      tile: query rows per index row (32, 64 or 128).
      block_size: tokens per index entry, a power of two in [8, config.block_kv] (see the module docstring).
      scale: softmax scale (None: 1/sqrt(D)).
      config: `MosaicPrefillConfig`.
      interpret: False, True or a `plgpu.InterpretGPUParams`: run in the Mosaic GPU interpreter (CPU tests).

    Returns:
      [B, T, Hq, D] in q.dtype; rows at or beyond lengths are zeros.
    """
    check_prefill_args(q, k, v, indices, lengths, tile, block_size)
    config.validate()
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}: the Mosaic GPU kernel needs one dtype")
    reason = unsupported_reason(q.dtype, D, block_size, tile, G, config)
    if reason is not None:
        raise ValueError(f"the Mosaic GPU sparse prefill kernel cannot take {reason}")
    bkv, S, bs = config.block_kv, config.stages, block_size
    nt = indices.shape[2]
    E = bkv // bs  # index entries (TMA copies per tensor) per step
    Tp = max(nt * tile, bkv)
    q, k, v = _pad_rows(q, Tp), _pad_rows(k, Tp), _pad_rows(v, Tp)
    ent, count = compact_entries(indices, tile, bs)
    K = ent.shape[-1]
    lens = jnp.minimum(lengths.astype(jnp.int32), T)
    scale = default_scale(D, scale)
    c = scale * LOG2E  # logits to log2 units
    dtype = q.dtype

    rows_g = G * tile  # query rows per (KV head, tile), ordered (head, row)
    n_wg = min(2, rows_g // ROWS)  # compute warpgroups per CTA
    cta_rows = n_wg * ROWS
    parts = rows_g // cta_rows
    R = min(tile, ROWS)  # rows of one query head inside a warpgroup's 64
    chunks = ROWS // R  # query heads per warpgroup (2 at tile 32)
    schedule = config.schedule and n_wg == 2

    def kernel(q_ref, k_ref, v_ref, ent_ref, cnt_ref, len_ref, o_ref, q_smem2, k_smem, v_smem, q_ready,
               k_ready, v_ready, k_free, v_free, sched, *p_smem2):
        b = lax.axis_index("batch")
        ph = lax.axis_index("heads")
        part = lax.rem(ph, jnp.array(parts, ph.dtype))
        kh = lax.div(ph, jnp.array(parts, ph.dtype))
        ti = nt - 1 - lax.axis_index("tiles")  # the costliest (last) tiles first
        start = ti * tile
        start_d = jnp.minimum(start, Tp - bkv)  # the diagonal steps' first key (keys before start are masked)
        n_valid = cnt_ref[b, kh, ti]
        sel_keys = n_valid * bs
        n_sel = pl.cdiv(sel_keys, jnp.array(bkv, jnp.int32))
        n_steps = n_sel + pl.cdiv(tile, bkv)
        wg = lax.axis_index("wg")

        def turn():
            if schedule:
                plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(sched)

        @pl.when(wg < n_wg)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            q_smem = q_smem2.at[wg]
            base = part * cta_rows + wg * ROWS  # first (head, row) index of this warpgroup
            for j in range(chunks):  # query heads of the warpgroup (one unless tile < 64)
                m0 = base + j * R
                head = kh * G + lax.div(m0, jnp.array(tile, m0.dtype))
                row0 = start + lax.rem(m0, jnp.array(tile, m0.dtype))
                plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, R), head], q_smem.at[pl.ds(j * R, R)],
                                        q_ready.at[wg])
            plgpu.barrier_wait(q_ready.at[wg])

            r_iota = plgpu.broadcasted_iota(jnp.int32, (ROWS, bkv), 0, layout=plgpu.Layout.WGMMA)
            col = plgpu.broadcasted_iota(jnp.int32, (ROWS, bkv), 1, layout=plgpu.Layout.WGMMA)
            def positions(r):  # query position of each warpgroup row r (chunks of R rows, one per query head)
                if chunks == 1:
                    return start + lax.rem(base, jnp.array(tile, base.dtype)) + r
                return start + jnp.where(r >= R, r - R, r)  # (chunks == 2: tile 32)

            qpos = positions(r_iota)

            m = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l = plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.full((ROWS, D), 0.0, jnp.float32), plgpu.Layout.WGMMA)
            plgpu.barrier_wait(k_ready.at[0])
            pl.when(wg == 1)(turn)

            def step(i, carry, mask: str):
                acc, m, l = carry
                slot = lax.rem(i, jnp.array(S, i.dtype))

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                    turn()
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((ROWS, bkv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if mask == "count":  # the last selected step: columns past the valid entries
                    s = jnp.where(i * bkv + col < sel_keys, s, -jnp.inf)
                elif mask == "diagonal":  # keys of the query tile, causally
                    kpos = start_d + (i - n_sel) * bkv + col
                    s = jnp.where((kpos >= start) & (kpos <= qpos), s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=1) * c)
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, s.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l = l * alpha + p.sum(axis=1)
                p16 = p.astype(dtype)
                acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
                if schedule:
                    plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(v_ready.at[slot])
                if schedule:
                    plgpu.barrier_wait(sched)

                if p_smem2:  # (the interpreter's WGMMA takes its A operand from shared memory only)
                    p_smem2[0].at[wg][...] = p16
                    plgpu.commit_smem()
                    p_op = p_smem2[0].at[wg]
                else:  # P from registers
                    p_op = p16

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_op, v_smem.at[slot])
                    nxt = i + 1

                    @pl.when(nxt < n_steps)
                    def _():
                        plgpu.barrier_wait(k_ready.at[lax.rem(nxt, jnp.array(S, nxt.dtype))])

                acc = _accumulate(pv, acc, interpret)
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l

            full = lax.div(sel_keys, jnp.array(bkv, jnp.int32))  # selected steps with every column valid
            carry = lax.fori_loop(0, full, functools.partial(step, mask="none"), (acc, m, l))
            carry = lax.fori_loop(full, n_sel, functools.partial(step, mask="count"), carry)
            acc, m, l = lax.fori_loop(n_sel, n_steps, functools.partial(step, mask="diagonal"), carry)
            pl.when(wg == 0)(turn)

            # every row saw its own key (l > 0); rows at or beyond the length are zeros
            out = acc / lax.broadcast_in_dim(l, acc.shape, [0])
            rows_d = plgpu.broadcasted_iota(jnp.int32, (ROWS, D), 0, layout=plgpu.Layout.WGMMA)
            out = jnp.where(positions(rows_d) < len_ref[b], out, 0.0)
            q_smem[...] = out.astype(dtype)
            plgpu.commit_smem()
            for j in range(chunks):
                m0 = base + j * R
                head = kh * G + lax.div(m0, jnp.array(tile, m0.dtype))
                row0 = start + lax.rem(m0, jnp.array(tile, m0.dtype))
                plgpu.copy_smem_to_gmem(q_smem.at[pl.ds(j * R, R)], o_ref.at[b, pl.ds(row0, R), head])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == n_wg)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def load(i, slot):
                """Step i's copies into ring buffer `slot`: E blocks of bs rows for K and for V."""
                diag_row = start_d + (i - n_sel) * bkv
                rows = []
                for j in range(E):
                    e = jnp.minimum(i * E + j, K - 1)
                    sel_row = ent_ref[b, kh, ti, e] * bs
                    rows.append(jnp.where(i < n_sel, sel_row, diag_row + j * bs))
                for j, r in enumerate(rows):
                    plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(r, bs), kh], k_smem.at[slot, pl.ds(j * bs, bs)],
                                            k_ready.at[slot])
                for j, r in enumerate(rows):
                    plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(r, bs), kh], v_smem.at[slot, pl.ds(j * bs, bs)],
                                            v_ready.at[slot])

            for i in range(S):
                @pl.when(i < n_steps)
                def _(i=i):
                    load(jnp.int32(i), i)

            @pl.loop(0, n_steps - S)
            def _(i):
                slot = lax.rem(i, jnp.array(S, i.dtype))
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])
                load(i + S, slot)

            @pl.loop(jnp.maximum(n_steps - S, 0), n_steps)  # the last releases (every phase is observed)
            def _(i):
                slot = lax.rem(i, jnp.array(S, i.dtype))
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])

    tiling, swizzle = plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((B, Tp, Hq, D), dtype),
        scratch_types=[
            plgpu.SMEM((n_wg, ROWS, D), dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((S, bkv, D), dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((S, bkv, D), dtype, transforms=(tiling, swizzle)),
            plgpu.Barrier(num_arrivals=chunks, num_barriers=n_wg),
            plgpu.Barrier(num_arrivals=E, num_barriers=S),
            plgpu.Barrier(num_arrivals=E, num_barriers=S),
            plgpu.Barrier(num_arrivals=n_wg, num_barriers=S),
            plgpu.Barrier(num_arrivals=n_wg, num_barriers=S),
            plgpu.Barrier(num_arrivals=2),
        ] + ([plgpu.SMEM((n_wg, ROWS, bkv), dtype, transforms=(tiling, swizzle))] if interpret else []),
        grid=(parts * Hkv, nt, B),
        grid_names=("heads", "tiles", "batch"),
        num_threads=n_wg + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        kernel_name="sparse_prefill_mgpu", interpret=_interpret(interpret),
    )(q, k, v, ent, count, lens)
    return out[:, :T]


__all__ = ["MosaicPrefillConfig", "compact_entries", "hopper", "sparse_prefill_mgpu", "unsupported_reason"]

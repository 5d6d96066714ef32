"""Mosaic GPU (Hopper, warp-specialised) kernels of the anchor prefill scoring: the lse pass and the pooling pass.

The same two passes as the Triton kernels in `gpu_prefill` (same inputs, same outputs, same semantics as
`reference.tile_scores_reference`), written for the H100 in the manner of FlashAttention-3's forward pass: one
memory warpgroup streams operands into shared memory by TMA, two compute warpgroups each own `rows` rows of the
matmul's M side (default 128, two wgmma M-blocks) and, with `schedule`, take turns on the tensor cores (a shared
barrier), so one warpgroup's `wgmma` runs while the other computes its exps. Both passes are bounded by the exps
of the causal half of [T, T] (as many as a dense causal attention) and by Q.K^T (half a dense attention's
FLOPs).

  * `prefill_lse_mgpu`: grid (Hq, T / (2 rows), B). A CTA takes 2 x rows query rows of one head, streams the KV
    head's keys up to its diagonal `block_kv` at a time and keeps an online max and sum of exp2; writes each
    row's natural-log logsumexp f32[B, Hq, T]. The costliest (last) query blocks run first.
  * `tile_scores_mgpu`: grid (Hkv, T / (2 rows), B). A CTA takes 2 x rows keys of one KV head and streams, for
    every later block of 128 query rows and every query head of the GQA group in turn, the block's queries and
    their lse; it computes the transposed logits [rows keys, 128 query rows], sums exp2(s - lse) over the rows
    of each query tile in the block (`tile` 128, 64 or 32: one, two or four sums, static column slices of the
    logits) and over the group's heads, and writes each tile's pooled values. The keys at and after each
    tile's start (the upper triangle, which the kernel partly computes and partly leaves unwritten) are set to
    -inf afterwards by one XLA select (3 ms at 128K).

Measured on the H100 at 128K, Llama-3.1-8B heads, B 1 (eval/results/h100/anchor_mgpu/): lse pass 138 ms (Triton
204), pooling pass 128 ms at tile 128 and 145-155 ms at tile 32 (Triton 239 and 484), cuDNN's whole causal
attention 252-258 ms. Settings swept there: 128 rows per warpgroup beat 64 (fewer operand bytes per exp); the
turn-taking helps a little. Tried and dropped: FA3's intra-warpgroup pipelining (each warpgroup issuing its next
wgmma before its current exps; no faster at 64 rows, spills registers at 128; the code is at commit 4348553) and
FA4's polynomial exp2 on the FMA units (the exps cost only 14-35 ms of each pass).

Requirements (`mgpu_supported`): a CUDA device of compute capability 9.x, bf16 or f16, head_dim 64 or 128 (the
operand buffers of larger heads do not fit in shared memory), a tile of 32, 64 or 128 (the timings above are at
128); T is padded here. `gpu_prefill.prefill_lse_gpu` / `tile_scores_gpu` pick these kernels when they apply
(`PrefillScoresConfig.mosaic`), the Triton ones otherwise. CI runs them in the Mosaic GPU interpreter
(`interpret=True`: simulated shared memory, warpgroups, barriers and TMA) and lowers them for CUDA; the committed
GPU run compares them with the references compiled.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.anchor_attention.common import default_scale
from pallas_kernels.sparse_attention.mgpu_prefill import hopper  # noqa: F401  (re-exported)

Array = jax.Array

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
ROWS = 128  # default rows (lse pass) or keys (pooling pass) of one compute warpgroup's wgmma (its M side)
TILES = (32, 64, 128)  # query tiles the pooling pass takes
SPAN = 128  # query rows per step of the pooling pass (the N side of its wgmma): 128 / tile tiles at once


HEAD_DIMS = (64, 128)  # head dims whose operand buffers fit the H100's 227 KB of shared memory at the defaults


DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _dtypes_ok(q: Array, k: Array) -> bool:
    return jnp.dtype(q.dtype) in DTYPES and jnp.dtype(k.dtype) == jnp.dtype(q.dtype)


def mgpu_shapes_ok(q: Array, k: Array, tile: int | None = None) -> bool:
    """Whether the Mosaic GPU kernels take these operands (bf16/f16 q and k alike, head_dim 64 or 128, tile 32, 64
    or 128), on whatever device."""
    return _dtypes_ok(q, k) and q.shape[-1] in HEAD_DIMS and (tile is None or tile in TILES)


def mgpu_supported(q: Array, k: Array, tile: int | None = None) -> bool:
    """Whether the Mosaic GPU kernels take these operands on the default device (`mgpu_shapes_ok` and Hopper)."""
    return mgpu_shapes_ok(q, k, tile) and hopper()


def _check(q: Array, k: Array, block_kv: int, stages: int, rows: int) -> None:
    if not _dtypes_ok(q, k):
        raise ValueError(f"the Mosaic GPU scoring kernels take bf16 or f16 q and k (got {q.dtype}, {k.dtype})")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"head_dim D={q.shape[-1]}: the Mosaic GPU scoring kernels take {HEAD_DIMS}")
    if block_kv not in (64, 128):
        raise ValueError(f"block_kv={block_kv}: expected 64 or 128")
    if stages < 2:
        raise ValueError(f"stages={stages}: expected at least 2")
    if rows not in (64, 128):
        raise ValueError(f"rows={rows}: expected 64 or 128")


def _pad_rows(x: Array, Tp: int) -> Array:
    T = x.shape[1]
    return x if Tp == T else jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2))


def _turn(sched, schedule: bool) -> None:
    """With `schedule`, meet the other compute warpgroup at the shared barrier (the two take turns on the tensor
    cores; every call in one warpgroup must be matched by one in the other)."""
    if schedule:
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(sched)


def _slot(i, S: int):
    """Ring buffer of step i (i % S, in i's dtype)."""
    return lax.rem(i, jnp.array(S, i.dtype))


def _feed(n, S: int, load, free) -> None:
    """The memory warpgroup's loop: `load(i, slot)` issues step i's TMA copies into ring buffer `slot` = i % S, for
    i in [0, n); a buffer is refilled once both compute warpgroups have arrived at `free[slot]`, and the last S
    releases are waited for too (the interpreter checks that every barrier phase is observed)."""
    for i in range(S):
        @pl.when(i < n)
        def _(i=i):
            load(jnp.int32(i), i)

    @pl.loop(0, n - S)
    def _(i):
        slot = _slot(i, S)
        plgpu.barrier_wait(free.at[slot])
        load(i + S, slot)

    @pl.loop(jnp.maximum(n - S, 0), n)
    def _(i):
        plgpu.barrier_wait(free.at[_slot(i, S)])


def _rowsum_exp2(x: Array) -> Array:
    """Row sums of exp2(x), x [rows, cols] in the wgmma layout (both kernels' only exps of the logits; a hook
    the diagnostic script eval/gpu_anchor_exp_diag.py swapped to see what the exps cost; removed in issue 17,
    in git history at 6e8ff35)."""
    return jnp.exp2(x).sum(axis=1)


def _interpret(interpret):
    """The Mosaic GPU interpreter (CPU: simulated shared memory, warpgroups, barriers and TMA) or None: `interpret`
    is False, True (default parameters) or a `plgpu.InterpretGPUParams` (e.g. with detect_races=True)."""
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if interpret else None


def _smem_transforms():
    return plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)


@functools.partial(jax.jit, static_argnames=("scale", "block_kv", "stages", "schedule", "rows", "interpret"))
def prefill_lse_mgpu(q: Array, k: Array, *, scale: float | None = None, block_kv: int = 128, stages: int = 4,
                     schedule: bool = True, rows: int = ROWS, interpret=False) -> Array:
    """Causal logsumexp of every query row (as `gpu_prefill.prefill_lse_gpu`).

    Args:
      q: [B, T, Hq, D]; k: [B, T, Hkv, D] (bf16 or f16); scale: None divides by sqrt(D).
      block_kv: keys per pipeline step (64 or 128); stages: K buffers in flight; schedule: the two compute
        warpgroups take turns on the tensor cores; rows: query rows per compute warpgroup (64 or 128).
      interpret: False, True or a `plgpu.InterpretGPUParams`: run in the Mosaic GPU interpreter (CPU tests).

    Returns:
      f32[B, Hq, T], natural log of the scaled scores' sum of exp.
    """
    _check(q, k, block_kv, stages, rows)
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    cta = 2 * rows
    Tp = pl.cdiv(T, max(cta, block_kv)) * max(cta, block_kv)
    q, k = _pad_rows(q, Tp), _pad_rows(k, Tp)
    nq = Tp // cta
    c = default_scale(D, scale) * LOG2E
    dtype = q.dtype
    S = min(stages, Tp // block_kv)

    def kernel(q_ref, k_ref, lse_ref, q_smem2, k_smem, lse_smem2, k_ready, q_ready, k_free, sched):
        b = lax.axis_index("batch")
        h = lax.axis_index("heads")
        wg = lax.axis_index("wg")
        qi = nq - 1 - lax.axis_index("q_seq")  # the costliest query tiles first
        cta_steps = pl.cdiv((qi + 1) * cta, jnp.array(block_kv, jnp.int32))

        turn = functools.partial(_turn, sched, schedule)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            q_smem = q_smem2.at[wg]
            base = qi * cta + wg * rows
            steps = pl.cdiv(base + rows, jnp.array(block_kv, jnp.int32))
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(base, rows), h], q_smem, q_ready.at[wg])
            plgpu.barrier_wait(q_ready.at[wg])
            m = plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l = plgpu.layout_cast(jnp.full((rows,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            plgpu.barrier_wait(k_ready.at[0])
            pl.when(wg == 1)(turn)

            def update(s, m, l):  # online max and sum of exp2; m in units of the raw logits (one FMA per entry)
                m_new = jnp.maximum(m, s.max(axis=1))
                x = s * c - lax.broadcast_in_dim(m_new * c, s.shape, [0])
                return m_new, l * jnp.exp2((m - m_new) * c) + _rowsum_exp2(x)

            def mask(s, i):
                r = plgpu.broadcasted_iota(jnp.int32, (rows, block_kv), 0, layout=plgpu.Layout.WGMMA)
                col = plgpu.broadcasted_iota(jnp.int32, (rows, block_kv), 1, layout=plgpu.Layout.WGMMA)
                return jnp.where(r + base >= col + i * block_kv, s, -jnp.inf)

            def wait_next(i):
                @pl.when(i + 1 < steps)
                def _():
                    plgpu.barrier_wait(k_ready.at[_slot(i + 1, S)])

            def logits(i):
                """Step i's Q.K^T (the other warpgroup takes its turn while the tensor cores work)."""
                slot = _slot(i, S)

                def body(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                    turn()
                    return acc_ref[...]

                s = pl.run_scoped(body, plgpu.ACC((rows, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                return s

            def step(i, carry, masked: bool):
                s = logits(i)
                if masked:
                    s = mask(s, i)
                carry = update(s, *carry)
                turn()
                wait_next(i)
                return carry

            full = lax.div(base, jnp.array(block_kv, jnp.int32))
            carry = lax.fori_loop(0, full, functools.partial(step, masked=False), (m, l))
            m, l = lax.fori_loop(full, steps, functools.partial(step, masked=True), carry)

            def drain(i, _):  # steps the other warpgroup still runs: release their buffers, keep the turns
                slot = _slot(i, S)
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                turn()
                turn()

            lax.fori_loop(steps, cta_steps, drain, None)
            pl.when(wg == 0)(turn)
            lse_smem = lse_smem2.at[wg]
            lse_smem[...] = m * (c * LN2) + jnp.log(l)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(base, rows)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            kh = lax.div(h, jnp.array(G, h.dtype))

            def load(i, slot):
                plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(i * block_kv, block_kv), kh], k_smem.at[slot],
                                        k_ready.at[slot])

            _feed(cta_steps, S, load, k_free)

    tiling, swizzle = _smem_transforms()
    lse = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((B, Hq, Tp), jnp.float32),
        scratch_types=[
            plgpu.SMEM((2, rows, D), dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((S, block_kv, D), dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((2, rows), jnp.float32),
            plgpu.Barrier(num_barriers=S),
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_arrivals=2, num_barriers=S),
            plgpu.Barrier(num_arrivals=2),
        ],
        grid=(Hq, nq, B),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        kernel_name="anchor_prefill_lse_mgpu", interpret=_interpret(interpret),
    )(q, k)
    return lse[:, :, :T]


@functools.partial(jax.jit, static_argnames=("tile", "scale", "stages", "schedule", "rows", "interpret"))
def tile_scores_mgpu(q: Array, k: Array, lse: Array, *, tile: int = 128, scale: float | None = None,
                     stages: int = 2, schedule: bool = True, rows: int = ROWS, interpret=False) -> Array:
    """Tile-pooled causal scores (as `gpu_prefill.tile_scores_gpu`) given every row's logsumexp.

    Args:
      q: [B, T, Hq, D]; k: [B, T, Hkv, D] (bf16 or f16); lse: f32[B, Hq, T] natural-log logsumexp of the
        scaled causal scores (`prefill_lse_mgpu` or a dense attention's); tile: query rows per pooled row (32,
        64 or 128).
      stages: query buffers in flight; schedule: the two compute warpgroups take turns on the tensor cores;
        rows: keys per compute warpgroup (64 or 128).
      interpret: as `prefill_lse_mgpu`.

    Returns:
      f32[B, Hkv, ceil(T / tile), T]: -inf at and after each tile's first position.
    """
    if tile not in TILES:
        raise ValueError(f"tile={tile}: the Mosaic GPU pooling kernel takes a tile in {TILES}")
    _check(q, k, 64, stages, rows)
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    cta = 2 * rows
    Tp = pl.cdiv(T, cta) * cta
    nt = Tp // tile
    seg = SPAN // tile  # tiles per step: a step takes SPAN query rows, its row sums split by tile
    q, k = _pad_rows(q, Tp), _pad_rows(k, Tp)
    # exp2(c s - lse2): rows past T get +inf and add nothing
    lse2 = jnp.pad(lse.astype(jnp.float32) * LOG2E, ((0, 0), (0, 0), (0, Tp - T)), constant_values=jnp.inf)
    c = default_scale(D, scale) * LOG2E
    dtype = q.dtype
    S = stages

    def kernel(q_ref, k_ref, lse_ref, o_ref, k_smem2, q_smem, lse_smem, o_smem, k_ready, q_ready, l_ready,
               q_free, sched):
        b = lax.axis_index("batch")
        kh = lax.axis_index("heads")
        wg = lax.axis_index("wg")
        kb = lax.axis_index("kv_seq")  # the key block [kb * cta, (kb + 1) * cta)
        # the first SPAN-row query block holding a tile that starts after some of the block's keys
        first = kb * (cta // SPAN) + (1 if seg == 1 else 0)
        tiles = Tp // SPAN - first  # (query blocks; "tiles" when tile == SPAN)
        n_steps = tiles * G

        turn = functools.partial(_turn, sched, schedule)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            k_smem = k_smem2.at[wg]
            base = kb * cta + wg * rows
            plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(base, rows), kh], k_smem, k_ready.at[wg])
            plgpu.barrier_wait(k_ready.at[wg])

            @pl.when(tiles > 0)
            def _():
                plgpu.barrier_wait(q_ready.at[0])
                plgpu.barrier_wait(l_ready.at[0])
                pl.when(wg == 1)(turn)

            def logits(slot):
                """The transposed logits [keys, query rows] of the step in `slot` (the other warpgroup takes its
                turn while the tensor cores work)."""
                def body(acc_ref):
                    plgpu.wgmma(acc_ref, k_smem, q_smem.at[slot].transpose((1, 0)))
                    turn()
                    return acc_ref[...]

                return pl.run_scoped(body, plgpu.ACC((rows, SPAN), jnp.float32))

            def mass(s_t, slot):  # per tile of the step, the sum over its rows of exp2(c s - lse2)
                lse_t = plgpu.load(lse_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                x = s_t * c - lax.broadcast_in_dim(lse_t, s_t.shape, [1])
                return [_rowsum_exp2(x[:, j * tile:(j + 1) * tile]) for j in range(seg)]

            def wait_step(i):
                @pl.when(i < n_steps)
                def _():
                    ns = _slot(i, S)
                    plgpu.barrier_wait(q_ready.at[ns])
                    plgpu.barrier_wait(l_ready.at[ns])

            def write(j, acc):
                par = lax.rem(j, jnp.array(2, j.dtype))
                plgpu.wait_smem_to_gmem(seg, wait_read_only=True)  # the copies out of these buffers two steps ago
                for u in range(seg):
                    o_smem.at[wg, par, u][...] = acc[u]
                plgpu.commit_smem()
                for u in range(seg):
                    # (keys at or after a tile's start are overwritten by -inf below)
                    plgpu.copy_smem_to_gmem(o_smem.at[wg, par, u],
                                            o_ref.at[b, kh, (first + j) * seg + u, pl.ds(base, rows)])

            def zeros():
                z = plgpu.layout_cast(jnp.full((rows,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
                return [z] * seg

            def add(acc, part):
                return [a + b for a, b in zip(acc, part)]

            def tile_body(j, _):
                acc = zeros()
                for g in range(G):
                    i = j * G + g
                    slot = _slot(i, S)
                    acc = add(acc, mass(logits(slot), slot))
                    plgpu.commit_smem()  # our reads of the lse buffer, before TMA may overwrite it
                    plgpu.barrier_arrive(q_free.at[slot])
                    turn()
                    wait_step(i + 1)
                write(j, acc)
                return None

            lax.fori_loop(0, tiles, tile_body, None)

            @pl.when(tiles > 0)
            def _():
                pl.when(wg == 0)(turn)

            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def load(i, slot):
                t = first + lax.div(i, jnp.array(G, i.dtype))
                h = kh * G + lax.rem(i, jnp.array(G, i.dtype))
                plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(t * SPAN, SPAN), h], q_smem.at[slot], q_ready.at[slot])
                plgpu.copy_gmem_to_smem(lse_ref.at[b, h, pl.ds(t * SPAN, SPAN)], lse_smem.at[slot],
                                        l_ready.at[slot])

            _feed(n_steps, S, load, q_free)

    tiling, swizzle = _smem_transforms()
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((B, Hkv, nt, Tp), jnp.float32),
        scratch_types=[
            plgpu.SMEM((2, rows, D), dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((S, SPAN, D), dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((S, SPAN), jnp.float32),
            plgpu.SMEM((2, 2, seg, rows), jnp.float32),
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_barriers=S),
            plgpu.Barrier(num_barriers=S),
            plgpu.Barrier(num_arrivals=2, num_barriers=S),
            plgpu.Barrier(num_arrivals=2),
        ],
        grid=(Hkv, Tp // cta, B),
        grid_names=("heads", "kv_seq", "batch"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        kernel_name="anchor_prefill_pool_mgpu", interpret=_interpret(interpret),
    )(q, k, lse2)
    ntT = pl.cdiv(T, tile)
    before = jnp.arange(T, dtype=jnp.int32)[None, :] < (jnp.arange(ntT, dtype=jnp.int32) * tile)[:, None]
    return jnp.where(before, out[:, :, :ntT, :T], -jnp.inf)  # (one fused pass: slice and select)


__all__ = ["hopper", "mgpu_shapes_ok", "mgpu_supported", "prefill_lse_mgpu", "tile_scores_mgpu"]

"""Pallas GPU (Triton) kernel of the anchor decode layer's scoring pass, and the GPU anchor layer.

Bytes first (B = 8, Hkv = 8, N = 128K, D = 128, bf16, 10% budget): the dense decode reads K and V in full
(4 GiB). An anchor must see every key's post-softmax weight, so it reads K in full once (2 GiB), but V only
for the ~10% selected keys (0.2 GiB through `sparse_decode`); the scores it writes and re-reads are small
beside that (f32 logits, G rows per KV head: 128 MiB; pooled scores: 32 MiB). Its floor is thus a bit over
half of the dense decode's.

`_logits_kernel`, grid (B, Hkv, T, S): one program per row, KV head, new token and split of the keys (S
splits so the grid fills the GPU). It holds the GQA group's queries as one [Gp, D] tile (G padded to 16 rows
for the tensor-core dot), streams its split's keys `block_n` rows at a time, writes the G real rows of the
scaled logits to f32[B, Hkv, T, G, N], and keeps an online (max, sum of exp) per query head; with
`dense_output` it also reads V and accumulates the dense attention (flash decoding). Splits past the query's
position read nothing. Pooling: with AnchorConfig.pool="xla" the splits' partials are merged in XLA (logsumexp
per query head) and an XLA fusion pools; with pool="triton" the Triton pass `_pool_kernel` merges the partials
itself and pools, never reading the logits of keys past a query's position; "auto" (the default) takes the Triton
pass for one query row (batch 1 decode) and XLA for more. Selection (`topk_select`, Triton)
and the gathered attention (`sparse_decode`, Triton) follow (common.py).

Why the logits pass writes G values per key, not one: the pooled score sum_g exp(s_g - lse_g) needs each query
head's global logsumexp, known only after every split has run. A per-key scalar written earlier (say
sum_g exp(s_g - c_g) for split-local c_g) can be corrected afterwards by one factor per key, but the G heads
need G different factors exp(c_g - lse_g), so the exact pooled score cannot be recovered from it; getting
lse_g first costs a second read of K (2 GiB at 128K B8) against the 2 x 128 MiB of logits written and read.
The logits' round trip is ~0.08 ms of the layer's ~1.3 ms at 128K B8; the Triton pooling pass fuses the
merge-to-pool step into one read of them (eval/bench/anchor_variants.py times both).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.layers import layer_index
from pallas_kernels.sparse_attention import gpu as sparse_gpu
from pallas_kernels.anchor_attention.common import (check_args, check_diagonal_tile, combine_lse, default_scale,
                                                    diagonal_scores, force_diagonal, pool_scores,
                                                    positions, select, unstack)

Array = jax.Array

_MASK = -1e30
_MIN_ROWS = 16  # Triton's tensor-core dot needs M >= 16


@dataclasses.dataclass(frozen=True)
class AnchorConfig:
    """Tuning of the scoring kernel.

    Attributes:
      block_n: keys per inner iteration (a power of two >= 16).
      target_programs: grid size the split heuristic aims for.
      num_warps: warps per program.
      num_stages: software pipelining depth.
      pool: how the logits become pooled scores after the splits' (max, sum) partials are merged:
        "xla": an XLA logsumexp of the partials and an XLA fusion (`common.pool_scores`, then `force_diagonal`);
        "triton": `_pool_kernel`, one Triton pass that merges the splits' partials into each query head's
        logsumexp, reads each visible key's G logits once (keys past the query's position are never read) and
        writes its pooled score, visibility and diagonal applied;
        "auto" (the default): "triton" for at most `POOL_TRITON_ROWS` query rows (B * T), else "xla". In the
        model's decode step on an H100 at 100K the Triton pass was 0.5-0.8% faster at batch 1 (the oracle on
        Llama-3.1-8B and Qwen3-8B shapes, Kascade on Qwen3: there the XLA path's three small log-sum-exp kernels
        cost more than the pass) and level at batch 4 (eval/results/h100/pool_b1/); on an H200 at batch 4 the
        XLA path was 0.2-0.4% faster (eval/results/h200/pool_ab/).
      pool_block: keys per program of the Triton pooling pass (a power of two >= 16).
      pool_warps: warps per program of the Triton pooling pass.
    """

    block_n: int = 128
    target_programs: int = 1024
    num_warps: int = 4
    num_stages: int = 3
    pool: str = "auto"
    pool_block: int = 2048
    pool_warps: int = 4


POOL_TRITON_ROWS = 1  # query rows (B * T) up to which AnchorConfig(pool="auto") pools in Triton


def pool_path(config: AnchorConfig, rows: int) -> str:
    """The pooling path ("xla" or "triton") `decode_scores_gpu` takes for `rows` = B * T query rows."""
    if config.pool == "auto":
        return "triton" if rows <= POOL_TRITON_ROWS else "xla"
    return config.pool


_pow2 = sparse_gpu._pow2


def unsupported_reason(dtype, head_dim: int) -> str | None:
    """Why the Triton kernel cannot take these arguments (None when it can): dtype and head_dim as the gathered
    kernels (`sparse_attention.gpu.unsupported_reason`)."""
    return sparse_gpu.unsupported_reason(dtype, head_dim, 1, None)


def _logits_kernel(layer_ref, len_ref, q_ref, k_ref, *refs, scale: float, block_n: int, per_split: int, n: int,
                   G: int, T: int, L: int, gp: int, dense: bool):
    """One (b, h, t, split) program.

    Refs: layer i32[1] the cache layer to read (wrapped and clamped here, as jnp reads a traced index); len i32[1]
    the row's length (the query's position, its last visible key, is len - T + t; < 0: none); q [Hq, D] the
    token's queries (the program gathers its GQA group's G rows, padded to gp by repeating row G - 1, whose outputs
    are never used); k [L, N, D] every layer of the KV head (and v with dense); outputs logits f32[G, N] (only this
    split's visible chunks are written), m, l f32[gp] (and o f32[gp, D] with dense). Nothing is prepared in XLA
    before the launch (the positions, the padded queries and the layer index were three small kernels a layer).
    """
    if dense:
        v_ref, lg_ref, m_ref, l_ref, o_ref = refs
    else:
        lg_ref, m_ref, l_ref = refs
    layer = layer_index(layer_ref[0], L)
    lim = jnp.minimum(len_ref[0] - T + pl.program_id(2), n - 1)
    lane = jnp.arange(gp, dtype=jnp.int32)
    q = q_ref[pl.program_id(1) * G + jnp.minimum(lane, G - 1), :]  # [gp, D]
    d = q.shape[1]
    first = pl.program_id(3) * per_split
    count = jnp.clip(pl.cdiv(jnp.minimum(lim + 1, n), block_n) - first, 0, per_split)
    rows = jnp.arange(gp, dtype=jnp.int32)
    row_ok = rows < G
    exact = n % block_n == 0

    def body(i, carry):
        start = (first + i) * block_n
        kpos = start + jnp.arange(block_n, dtype=jnp.int32)
        cols = pl.ds(start, block_n)
        if exact:
            k = k_ref[layer, cols, :]  # one indexer (layer, rows, :), as Triton's lowering needs
        else:
            k = plgpu.load(k_ref.at[layer, cols, :], mask=(kpos < n)[:, None], other=0.0)
        s = plgpu.dot(q, k, trans_b=True) * scale  # [Gp, block_n] f32
        ok = kpos <= lim
        s = jnp.where(ok[None, :], s, _MASK)
        # Array indices on both axes (rows >= G and keys >= N are masked; never written).
        plgpu.store(lg_ref.at[rows[:, None], kpos[None, :]], s, mask=row_ok[:, None] & (kpos < n)[None, :])
        m, l = carry[0], carry[1]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.where(ok[None, :], jnp.exp(s - m_new[:, None]), 0.0)
        l = corr * l + jnp.sum(p, axis=1)
        if not dense:
            return m_new, l
        # Keys past the visible ones are garbage (maybe NaN): not loaded, where a 0 weight would not cancel them.
        v = plgpu.load(v_ref.at[layer, cols, :], mask=(kpos <= lim)[:, None], other=0.0)
        o = corr[:, None] * carry[2] + plgpu.dot(p.astype(v.dtype), v)
        return m_new, l, o

    init = (jnp.full((gp,), _MASK, jnp.float32), jnp.zeros((gp,), jnp.float32))
    if dense:
        init = init + (jnp.zeros((gp, d), jnp.float32),)
    out = lax.fori_loop(0, count, body, init)
    m_ref[...] = out[0]
    l_ref[...] = out[1]
    if dense:
        o_ref[...] = out[2]


def _pool_kernel(pos_ref, m_ref, l_ref, lg_ref, o_ref, *, G: int, S: int, bp: int, n: int, diagonal_tile: int):
    """One (b, h, t, key block) program of the pooling pass.

    Refs: pos i32[1] the query's position (last visible key; < 0: none); m, l f32[S, Gm] the scoring pass's
    split partials of each query head (running max, sum of exp(logit - max); rows >= G and splits that saw no
    key contribute nothing); lg f32[G, N] the logits (written only for visible keys); o f32[N] the pooled scores.
    Each program merges the S partials into the G logsumexps itself (a few hundred bytes, from L2), so no XLA
    fusion runs between the scoring pass and this one.
    """
    pos = pos_ref[0]
    gl, sp = pl.next_power_of_2(G), pl.next_power_of_2(S)
    rows = jnp.arange(gl, dtype=jnp.int32)
    split = jnp.arange(sp, dtype=jnp.int32)
    ok = (split < S)[:, None] & (rows < G)[None, :]
    m = plgpu.load(m_ref.at[split[:, None], rows[None, :]], mask=ok, other=_MASK)  # [sp, gl]
    l = plgpu.load(l_ref.at[split[:, None], rows[None, :]], mask=ok, other=0.0)
    m_all = jnp.max(m, axis=0)
    l_all = jnp.sum(jnp.exp(m - m_all[None, :]) * l, axis=0)  # an empty split: l = 0 (its m is finite)
    lse = jnp.where(l_all > 0, m_all + jnp.log(jnp.where(l_all > 0, l_all, 1.0)), jnp.inf)  # +inf: weight 0
    kpos = pl.program_id(3) * bp + jnp.arange(bp, dtype=jnp.int32)
    visible = (kpos <= pos) & (kpos < n)
    # Keys past the position were never written: masked, so never read (their lanes issue no load).
    s = plgpu.load(lg_ref.at[rows[:, None], kpos[None, :]], mask=(rows < G)[:, None] & visible[None, :],
                   other=_MASK)
    pooled = jnp.sum(jnp.exp(s - lse[:, None]), axis=0)  # padding rows: exp(-inf) = 0
    out = jnp.where(visible, pooled, -jnp.inf)
    if diagonal_tile:
        out = jnp.where(visible & (kpos >= (pos // diagonal_tile) * diagonal_tile), diagonal_scores(kpos), out)
    plgpu.store(o_ref.at[kpos], out, mask=kpos < n)


def pool_gpu(logits: Array, m: Array, l: Array, pos: Array, *, diagonal_tile: int = 0,
             config: AnchorConfig = AnchorConfig(), interpret: bool = False) -> Array:
    """`common.combine_lse`, `common.pool_scores` (then `common.force_diagonal`) as one Triton pass.

    Args:
      logits: f32[B, Hkv, T, G, N] (read only where visible).
      m, l: f32[S, B, Hkv, T, Gm] (Gm >= G) the split partials of each query head's softmax: running max and sum
        of exp(logit - max) over the split's visible keys (m anything finite and l = 0 for a split that saw none);
        rows >= G are ignored. One logsumexp lse f32[B, Hkv, T, G] is the partials m = lse[None], l = 1.
      pos: i32[B, T].

    Returns:
      f32[B, Hkv, T, N]: sum_g exp(logits - lse) over visible keys, -inf elsewhere, `common.diagonal_scores` on the
      diagonal tile.
    """
    B, Hkv, T, G, N = logits.shape
    S, Gm = m.shape[0], m.shape[-1]
    if m.shape != (S, B, Hkv, T, Gm) or l.shape != m.shape or Gm < G:
        raise ValueError(f"partials m {tuple(m.shape)}, l {tuple(l.shape)}: expected equal shapes [S, B={B}, "
                         f"Hkv={Hkv}, T={T}, Gm >= G={G}]")
    bp = config.pool_block
    part = pl.BlockSpec((S, None, None, None, Gm), lambda b, h, t, c: (0, b, h, t, 0))
    return pl.pallas_call(
        functools.partial(_pool_kernel, G=G, S=S, bp=bp, n=N, diagonal_tile=diagonal_tile),
        grid=(B, Hkv, T, pl.cdiv(N, bp)),
        in_specs=[pl.BlockSpec((None, 1), lambda b, h, t, c: (b, t)), part, part,
                  pl.BlockSpec((None, None, None, G, N), lambda b, h, t, c: (b, h, t, 0, 0))],
        out_specs=pl.BlockSpec((None, None, None, N), lambda b, h, t, c: (b, h, t, 0)),
        out_shape=jax.ShapeDtypeStruct((B, Hkv, T, N), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=config.pool_warps, num_stages=1),
        interpret=interpret,
        name="anchor_decode_pool",
    )(pos.astype(jnp.int32), m.astype(jnp.float32), l.astype(jnp.float32), logits)


def _check_config(config: AnchorConfig) -> None:
    if not _pow2(config.block_n) or config.block_n < 16:
        raise ValueError(f"AnchorConfig.block_n={config.block_n}: expected a power of two >= 16")
    if config.pool not in ("xla", "triton", "auto"):
        raise ValueError(f"AnchorConfig.pool={config.pool!r}: expected 'xla', 'triton' or 'auto'")
    if not _pow2(config.pool_block) or config.pool_block < 16:
        raise ValueError(f"AnchorConfig.pool_block={config.pool_block}: expected a power of two >= 16")


# Shared memory the scoring pass may plan for: the H100/H200 give a block 227 KiB; Triton's pipeline holds
# num_stages - 1 copies of each streamed tile, and about 16 KiB go to the rest. At f32, head_dim 128, with
# dense_output (K and V tiles), the default block_n 128 and 3 stages asked for 272 KiB and failed to launch on an
# H200 (eval/results/h200/gpu_suite/, 2026-12-04).
SMEM_BUDGET = 200 * 1024


def fitted_block_n(config: AnchorConfig, head_dim: int, itemsize: int, dense_output: bool) -> int:
    """config.block_n, halved (down to 16) until the pipelined K (and V, with dense_output) tiles fit
    SMEM_BUDGET: (num_stages - 1) * block_n * head_dim * itemsize per streamed operand, plus 16 KiB."""
    bn, tiles, copies = config.block_n, 2 if dense_output else 1, max(1, config.num_stages - 1)
    while bn > 16 and copies * tiles * bn * head_dim * itemsize + 16 * 1024 > SMEM_BUDGET:
        bn //= 2
    return bn


@functools.partial(jax.jit, static_argnames=("scale", "dense_output", "diagonal_tile", "config", "interpret"))
def decode_scores_gpu(q: Array, k: Array, v: Array, lengths: Array, *, layer: Array | None = None,
                      scale: float | None = None, dense_output: bool = False, diagonal_tile: int = 0,
                      config: AnchorConfig = AnchorConfig(),
                      interpret: bool = False) -> tuple[Array, Array | None]:
    """Pooled post-softmax scores of every key (and the dense attention with `dense_output`), one pass over K.

    Args:
      q: [B, T, Hq, D]; k, v: [B, Hkv, N, D] head-major cache, or with `layer` the stacked cache
        [L, B, Hkv, N, D] read in place at that layer; lengths: int32[B].
      layer: i32[] (traced) layer of a stacked cache, or None.
      scale: softmax scale (None: 1/sqrt(D)).
      dense_output: also attend densely (reads V in full).
      diagonal_tile: 0 or a tile size: each query's diagonal tile chosen first (`common.force_diagonal`).
      config: `AnchorConfig`.
      interpret: run the kernel in the Pallas interpreter (CPU tests).

    Returns:
      (scores f32[B, Hkv, T, N]: sum over the GQA group of the softmax weights, -inf where not visible;
       out [B, T, Hq, D] in q.dtype with dense_output, else None).
    """
    reason = unsupported_reason(q.dtype, q.shape[-1])
    if reason is not None:
        raise ValueError(f"the Pallas GPU anchor kernel cannot take {reason}")
    _check_config(config)
    if layer is None:
        k, v, layer = k[None], v[None], 0  # a leading unit axis: a free reshape
    L, B, Hkv, N, D = k.shape
    T, Hq = q.shape[1], q.shape[2]
    G = Hq // Hkv
    scale = default_scale(D, scale)
    bn = fitted_block_n(config, D, jnp.dtype(k.dtype).itemsize, dense_output)
    chunks = pl.cdiv(N, bn)
    want = max(1, min(chunks, pl.cdiv(config.target_programs, B * Hkv * T)))
    per = pl.cdiv(chunks, want)
    S = pl.cdiv(chunks, per)
    Gp = max(_MIN_ROWS, pl.next_power_of_2(G))

    pos = positions(lengths, T)

    cache_spec = pl.BlockSpec((L, None, None, N, D), lambda b, h, t, s: (0, b, h, 0, 0))  # every layer
    in_specs = [pl.BlockSpec((1,), lambda b, h, t, s: (0,)),  # the layer index
                pl.BlockSpec((1,), lambda b, h, t, s: (b,)),  # the row's length
                pl.BlockSpec((None, None, Hq, D), lambda b, h, t, s: (b, t, 0, 0)),  # the token's queries
                cache_spec]
    part = pl.BlockSpec((None, None, None, None, Gp), lambda b, h, t, s: (s, b, h, t, 0))
    out_specs = [pl.BlockSpec((None, None, None, G, N), lambda b, h, t, s: (b, h, t, 0, 0)), part, part]
    out_shape = [jax.ShapeDtypeStruct((B, Hkv, T, G, N), jnp.float32),
                 jax.ShapeDtypeStruct((S, B, Hkv, T, Gp), jnp.float32),
                 jax.ShapeDtypeStruct((S, B, Hkv, T, Gp), jnp.float32)]
    args = [jnp.asarray(layer).astype(jnp.int32).reshape(1), lengths.astype(jnp.int32), q, k]
    if dense_output:
        in_specs.append(cache_spec)
        out_specs.append(pl.BlockSpec((None, None, None, None, Gp, D), lambda b, h, t, s: (s, b, h, t, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((S, B, Hkv, T, Gp, D), jnp.float32))
        args.append(v)
    res = pl.pallas_call(
        functools.partial(_logits_kernel, scale=scale, block_n=bn, per_split=per, n=N, G=G, T=T, L=L, gp=Gp,
                          dense=dense_output),
        grid=(B, Hkv, T, S),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="anchor_decode_logits",
    )(*args)
    logits, m, l = res[0], res[1][..., :G], res[2][..., :G]
    m = jnp.where(l > 0, m, -jnp.inf)  # an empty split contributes nothing
    if pool_path(config, B * T) == "triton":  # the raw partials, merged in-kernel
        scores = pool_gpu(logits, res[1], res[2], pos, diagonal_tile=diagonal_tile, config=config,
                          interpret=interpret)
    else:
        scores = force_diagonal(pool_scores(logits, combine_lse(m, l), pos), pos, diagonal_tile)
    out = None
    if dense_output:
        w = jnp.where(l > 0, jnp.exp(m - jnp.max(m, axis=0)[None]), 0.0)  # [S, B, Hkv, T, G]
        den = jnp.sum(w * l, axis=0)
        o = jnp.sum(w[..., None] * res[3][..., :G, :], axis=0)
        o = jnp.where(den[..., None] > 0, o / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
        out = o.transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, D).astype(q.dtype)
    return scores, out


@functools.partial(jax.jit, static_argnames=("budget", "min_tokens", "K", "scale", "dense_output", "diagonal_tile",
                                             "with_output", "config", "select_config", "interpret"))
def anchor_decode_gpu(q: Array, k: Array, v: Array, lengths: Array, *, budget: float, min_tokens: int = 128,
                      K: int | None = None, layer: Array | None = None, scale: float | None = None,
                      dense_output: bool = False, diagonal_tile: int = 0, with_output: bool = True,
                      config: AnchorConfig = AnchorConfig(), select_config=None,
                      interpret: bool = False) -> tuple[Array | None, Array]:
    """Anchor decode layer on the GPU: Triton scoring pass, Triton top-k selection, Triton gathered attention.

    Args and returns as `reference.anchor_decode_reference`; with `layer` (i32[], traced) k and v are the
    stacked cache [L, B, Hkv, N, D], read in place at that layer; config: `AnchorConfig` of the scoring
    kernel; select_config: `topk_select.gpu.SelectConfig` (None: default); interpret: all kernels in the
    Pallas interpreter (CPU tests).
    """
    from pallas_kernels.topk_select import gpu as select_gpu

    K = check_args(q, *unstack(k, v, layer), lengths, budget, min_tokens, K)
    check_diagonal_tile(diagonal_tile)
    scores, out = decode_scores_gpu(q, k, v, lengths, layer=layer, scale=scale, dense_output=dense_output,
                                    diagonal_tile=diagonal_tile, config=config, interpret=interpret)
    pos = positions(lengths, q.shape[1])
    if interpret or select_config is not None:
        from pallas_kernels.anchor_attention.common import budget_count
        kk = budget_count(float(budget), pos + 1, min_tokens)[:, None, :]
        sc = select_config or select_gpu.SelectConfig()
        indices = select_gpu.topk_select_gpu(scores, kk, K, config=sc, interpret=interpret)
    else:
        indices = select(scores, pos, budget, min_tokens, K, "pallas_gpu")
    if out is None and not with_output:
        return None, indices
    if out is None and layer is None:
        out = sparse_gpu.sparse_decode_gpu(q, k, v, indices, lengths, scale=scale, interpret=interpret)
    elif out is None:
        from pallas_kernels.sparse_attention.stacked import sparse_decode_stacked_gpu
        out = sparse_decode_stacked_gpu(q, k, v, layer, indices, lengths, scale=scale, interpret=interpret)
    return out, indices

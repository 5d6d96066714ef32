"""Pallas GPU (Triton) split-K dense decode (flash decoding) over one layer of the stacked KV cache, in place.

grid (B, Hkv, R, S): one program per batch row, KV head, block of query rows and split of the cache.
  * Queries: the T new tokens times the GQA group's G heads form T * G rows per KV head (row = t * G + g, as
    `pallas_kernels.dense.dense_decode` orders them); a program gathers `Mb` of them from q as one [Mb, D] tile
    (padded to >= 16 rows for the tensor-core dot) and finds each row's last visible key from the batch row's
    length, so nothing runs in XLA before the launch. In plain decoding (T = 1) R = 1 and the whole group shares
    one read of the cache.
  * Keys: split s covers cache rows [s * chunk, (s + 1) * chunk); the program streams them `block_k` rows at a
    time straight from `k_all[layer, b, h]` (the K/V BlockSpec spans the L axis; the loads index it with the
    traced layer, so the pointer is offset in place and nothing is copied), with an online softmax in f32.
    It stops after the last key any of its rows may see (lengths masking per row, causal among the T new
    tokens), so splits past a row's length cost nothing; loads past that key are masked (zeros, never read
    out of bounds, whatever the cache holds there).
  * Each program writes its partial (o, m, l) for its real rows only; a jnp combine merges the S splits (and,
    with `return_lse`, gives each query row's log-sum-exp m + log l, which `pallas_kernels.head_probs` needs).
  * With `return_probs` each program also writes its rows' scaled logits of the keys it reads (f32, one more
    store per block, no second read of K), and one XLA pass turns them into each query head's post-softmax
    weights summed over the T new tokens, exp(logit - lse) where the row sees the key: the same weights as
    `pallas_kernels.head_probs` (which reads K again), for STS's draft record.

Runs in interpret mode on CPU (`interpret=True`). Semantics: exactly `reference.dense_decode_stacked_reference`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.sparse_attention import gpu as sparse_gpu
from pallas_kernels.sparse_attention.gpu_common import group_query_rows
from pallas_kernels.dense_decode.reference import check_args, check_record_args, default_scale, layer_index

Array = jax.Array

_MASK = -1e30  # finite "minus infinity" for the running max (exp(_MASK - x) underflows to 0)
_MIN_ROWS = 16  # Triton's tensor-core dot needs M >= 16


@dataclasses.dataclass(frozen=True)
class DenseDecodeConfig:
    """Tuning of the kernel.

    Attributes:
      block_k: cache rows per inner iteration (a power of two >= 16).
      block_q: most query rows per program (a power of two >= 16); T * G rows are padded to the next power of
        two >= 16 when they fit, else split over ceil(T * G / block_q) programs.
      num_splits: splits of the cache per (row, KV head, query block); None picks enough for about
        `target_programs` programs in total.
      target_programs: grid size the split heuristic aims for (a few waves of 132 SMs on an H100).
      num_warps: warps per program.
      num_stages: software pipelining depth of the inner loop; None: `_STAGES_SMALL_TILE` when a program holds the
        smallest tile (16 rows: plain decoding's T * G <= 16 rows, whose programs do little math per key and need
        more loads in flight), else `_STAGES` (eval/results/h200/dense_decode_t1/).
    """

    block_k: int = 64
    block_q: int = 64
    num_splits: int | None = None
    target_programs: int = 512
    num_warps: int = 4
    num_stages: int | None = None


_STAGES, _STAGES_SMALL_TILE = 3, 4

# The default config per head_dim where it is not `DenseDecodeConfig()`. At head_dim 64 (the STS draft's
# Llama-3.2-1B shape, SmolLM2) 128-key blocks (the same bytes per tile as 64 keys at head_dim 128) and 1024 target
# programs: the config with the smallest worst-case loss over the draft's measured shapes
# (eval/results/h200/dense_decode_d64/: 100K batch 7 6.73 -> 5.75 ms per 16-layer loop, with return_probs 8.18 ->
# 6.97 ms, batch 3 2.64 -> 2.86 ms), and in the STS round at 100K batch 7 and 32K batch 20 a faster round, at 100K
# batch 3 the same (NOTES.md there).
HEAD_DIM_DEFAULTS = {64: DenseDecodeConfig(block_k=128, target_programs=1024)}


# The record kernel's (`dense_decode_record_gpu`) default per head_dim where it is not `default_config`'s: at head_dim
# 64, 2048 target programs (its stores of the logits take more in flight: the STS draft's 16-layer loop at 100K, batch
# 7 on an H200 6.57 ms against 6.80 ms with 1024, the plain dense decode 5.76 ms; eval/results/h200/record_blocks/).
RECORD_HEAD_DIM_DEFAULTS = {64: DenseDecodeConfig(block_k=128, target_programs=2048)}


def default_config(head_dim: int, record: bool = False) -> DenseDecodeConfig:
    """The kernel's default config at `head_dim` (`HEAD_DIM_DEFAULTS`, else `DenseDecodeConfig()`; with `record`,
    the record kernel's: `RECORD_HEAD_DIM_DEFAULTS` first)."""
    if record and head_dim in RECORD_HEAD_DIM_DEFAULTS:
        return RECORD_HEAD_DIM_DEFAULTS[head_dim]
    return HEAD_DIM_DEFAULTS.get(head_dim, DenseDecodeConfig())


_pow2 = sparse_gpu._pow2


def unsupported_reason(dtype, head_dim: int) -> str | None:
    """Why the Triton kernel cannot take these arguments (None when it can): dtype and head_dim as the gathered
    kernels (`sparse_attention.gpu.unsupported_reason`)."""
    return sparse_gpu.unsupported_reason(dtype, head_dim, 1, None)


def _check_config(config: DenseDecodeConfig) -> None:
    for name in ("block_k", "block_q"):
        value = getattr(config, name)
        if not _pow2(value) or value < 16:
            raise ValueError(f"DenseDecodeConfig.{name}={value}: expected a power of two >= 16")
    if config.num_splits is not None and config.num_splits < 1:
        raise ValueError(f"DenseDecodeConfig.num_splits={config.num_splits}: expected >= 1 or None")
    if config.target_programs < 1:
        raise ValueError(f"DenseDecodeConfig.target_programs={config.target_programs}: expected >= 1")
    if config.num_stages is not None and config.num_stages < 1:
        raise ValueError(f"DenseDecodeConfig.num_stages={config.num_stages}: expected >= 1 or None")


def _decode_kernel(layer_ref, len_ref, q_ref, k_ref, v_ref, *refs, scale: float, block_k: int, chunk: int,
                   rows: int, outputs: str, block: int, mb: int, T: int, G: int, L: int, Lw: int):
    """One (b, h, query block, split) program; `rows` = T * G real query rows per KV head, `mb` of them a program.

    Refs: layer_ref: i32[1] the cache's layer (i32[2] with "record": then the record buffer's layer), wrapped and
    clamped here as jnp reads a traced index; len_ref: i32[1] the batch row's length (its T new tokens sit at
    positions len - T .. len - 1); q_ref: [T * Hq, D] the batch row's queries (the program gathers its rows: row
    r = t * G + g is query head h * G + g of token t; padding rows repeat the last real one and see no key);
    k_ref, v_ref: [L, N, D] (every layer of the program's KV head); outputs o_ref: f32[mb, D], m_ref, l_ref:
    f32[mb] (only real rows are written); then by `outputs`:
      "logits": s_ref f32[Mb, N], the scaled logits (masked -1e30 past a row's last key) of the real rows at the
        keys this program reads (the rest unwritten);
      "record" (T = 1: the rows are the KV head's G query heads, all seeing keys <= hi): the record buffers'
        inputs (aliased, unused), then w_ref f32[G, Lw, N]: the scaled logits of the keys <= hi written in place
        at w_ref[g, layer_ref[1], key], and bm_ref f32[G, Lw, NB]: their maxima over blocks of `block` keys
        (block j: keys j * block ..), -inf for the blocks past hi, the program's blocks of its split, in place.
    """
    o_ref, m_ref, l_ref = refs[:3] if outputs != "record" else refs[2:5]
    extra = refs[3:] if outputs != "record" else refs[5:]
    head = jnp.arange(mb, dtype=jnp.int32)  # row r of the tile: query head r of the KV group (T = 1 with "record")
    layer = layer_index(layer_ref[0], L)
    row = pl.program_id(2) * mb + head
    real = row < rows
    q, t = group_query_rows(q_ref, row, rows, G, T, pl.program_id(1))  # [mb, D]; padding rows repeat the last
    n = k_ref.shape[1]
    # Last key each row may see (its token's position, below N); -1: none (and every padding row).
    lim = jnp.where(real, jnp.maximum(jnp.minimum(len_ref[0] - T + t, n - 1), -1), -1)
    split = pl.program_id(3)
    hi = jnp.max(lim)  # last key any row of this program sees
    start = split * chunk
    n_iter = pl.cdiv(jnp.clip(hi + 1 - start, 0, chunk), block_k)
    d = q.shape[1]

    def body(i, carry):
        o, m, l = carry
        k0 = start + i * block_k
        kpos = k0 + jnp.arange(block_k, dtype=jnp.int32)
        live = (kpos <= hi)[:, None]  # rows past hi (the cache end included) are never read
        span = pl.ds(k0, block_k)
        k = plgpu.load(k_ref.at[layer, span, :], mask=live, other=0.0)
        v = plgpu.load(v_ref.at[layer, span, :], mask=live, other=0.0)
        ok = kpos[None, :] <= lim[:, None]  # [Mb, block_k]
        s = plgpu.dot(q, k, trans_b=True) * scale
        s = jnp.where(ok, s, _MASK)
        if outputs == "logits":
            plgpu.store(extra[0].at[:, span], s, mask=real[:, None] & (kpos <= hi)[None, :])
        elif outputs == "record":
            # Padding rows (r >= rows) and keys past hi are masked (no write; distinct addresses, so the
            # interpreter's scatter drops them too).
            w_ref, bm_ref = extra
            plgpu.store(w_ref.at[head[:, None], layer_index(layer_ref[1], Lw), kpos[None, :]], s,
                        mask=real[:, None] & (kpos <= hi)[None, :])
            store_block_max(bm_ref, k0, jnp.max(s.reshape(mb, block_k // block, block), axis=2))
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.where(ok, jnp.exp(s - m_new[:, None]), 0.0)
        l = corr * l + jnp.sum(p, axis=1)
        o = corr[:, None] * o + plgpu.dot(p.astype(v.dtype), v)
        return o, m_new, l

    def store_block_max(bm_ref, k0, bmax):  # bmax [Mb, block_k // block] of the blocks from key k0 on
        blk = k0 // block + jnp.arange(block_k // block, dtype=jnp.int32)
        plgpu.store(bm_ref.at[head[:, None], layer_index(layer_ref[1], Lw), blk[None, :]],
                    jnp.where((blk * block <= hi)[None, :], bmax, -jnp.inf),
                    mask=real[:, None] & (blk < bm_ref.shape[-1])[None, :])

    init = (jnp.zeros((mb, d), jnp.float32), jnp.full((mb,), _MASK, jnp.float32), jnp.zeros((mb,), jnp.float32))
    o, m, l = lax.fori_loop(0, n_iter, body, init)
    if outputs == "record":  # the split's blocks past hi: -inf (no key read)
        def past(i, c):
            store_block_max(extra[1], start + i * block_k, jnp.full((mb, block_k // block), -jnp.inf, jnp.float32))
            return c

        lax.fori_loop(n_iter, chunk // block_k, past, 0)
    plgpu.store(o_ref, o, mask=real[:, None])
    plgpu.store(m_ref, m, mask=real)
    plgpu.store(l_ref, l, mask=real)


def rows_by_kv_head(x: Array, Hkv: int, Rp: int) -> Array:
    """[B, T, Hq, ...] -> [B, Hkv, Rp, ...]: each KV head's T * G query rows (row = t * G + g, the kernels' order),
    zero-padded to Rp rows."""
    B, T, Hq = x.shape[:3]
    G, rows = Hq // Hkv, T * (Hq // Hkv)
    x = x.reshape(B, T, Hkv, G, *x.shape[3:]).swapaxes(1, 2).reshape(B, Hkv, rows, *x.shape[3:])
    return jnp.pad(x, ((0, 0), (0, 0), (0, Rp - rows)) + ((0, 0),) * (x.ndim - 3))


def row_limits(lengths: Array, T: int, G: int, N: int, Rp: int) -> Array:
    """i32[B, Rp]: the last key each query row may see (row = t * G + g; the T new tokens sit at positions
    lengths - T .. lengths - 1, below N), -1 for a row that sees none and for the padding rows."""
    pos = lengths.astype(jnp.int32)[:, None] - T + jnp.arange(T, dtype=jnp.int32)  # [B, T]
    lim = jnp.maximum(jnp.repeat(jnp.minimum(pos, N - 1), G, axis=1), -1)  # [B, T * G]
    return jnp.pad(lim, ((0, 0), (0, Rp - T * G)), constant_values=-1)


def plan(B: int, T: int, Hq: int, Hkv: int, N: int, config: DenseDecodeConfig) -> dict:
    """The static launch plan: rows per KV head, rows per program Mb, query blocks R, splits S, chunk."""
    rows = T * (Hq // Hkv)
    Mb = max(_MIN_ROWS, pl.next_power_of_2(rows)) if rows <= config.block_q else config.block_q
    R = pl.cdiv(rows, Mb)
    splits = config.num_splits or pl.cdiv(config.target_programs, B * Hkv * R)
    splits = max(1, min(splits, pl.cdiv(N, config.block_k)))
    chunk = pl.cdiv(pl.cdiv(N, splits), config.block_k) * config.block_k
    return dict(rows=rows, Mb=Mb, R=R, splits=pl.cdiv(N, chunk), chunk=chunk)


def _launch(q: Array, k_all: Array, v_all: Array, layer: Array, lengths: Array, scale: float | None,
            config: DenseDecodeConfig | None, interpret: bool, outputs: str = "", record: Array | None = None,
            bmax: Array | None = None, record_layer: Array | None = None, block: int = 0):
    """Checks the arguments and runs the kernel: (out [B, T, Hq, D], lse f32[B, Hkv, rows], lim i32[B, Rp] with
    outputs "logits" (else None), the extra outputs of `outputs` (`_decode_kernel`)). config None:
    `default_config(D, record=outputs == "record")`."""
    check_args(q, k_all, v_all, layer, lengths)
    reason = unsupported_reason(q.dtype, q.shape[-1])
    if reason is not None:
        raise ValueError(f"the Pallas GPU dense decode kernel cannot take {reason}")
    config = default_config(q.shape[-1], record=outputs == "record") if config is None else config
    _check_config(config)
    B, T, Hq, D = q.shape
    L, _, Hkv, N, _ = k_all.shape
    G = Hq // Hkv
    if outputs == "record":
        check_record_args(q, k_all, record, bmax, block, config.block_k)
        if G > config.block_q:
            raise ValueError(f"G={G} query heads per KV head: the record kernel holds a group in one tile, expected "
                             f"G <= DenseDecodeConfig.block_q={config.block_q}")
    scale = default_scale(D, scale)
    p = plan(B, T, Hq, Hkv, N, config)
    rows, Mb, R, splits, chunk = p["rows"], p["Mb"], p["R"], p["splits"], p["chunk"]
    Rp = R * Mb

    # Nothing is prepared in XLA before the launch: the kernel wraps the layer index, finds each row's last visible key
    # from the length and gathers its query rows from q (the regrouped, padded queries, the limits and the stacked
    # layer index were three small kernels a layer). A [B, T * Hq, D] view of q is a free reshape.
    lay = jnp.asarray(layer).astype(jnp.int32).reshape(1)
    if record is not None:
        lay = jnp.concatenate([lay, jnp.asarray(record_layer).astype(jnp.int32).reshape(1)])
    Lw = record.shape[2] if record is not None else 1

    kernel = functools.partial(_decode_kernel, scale=scale, block_k=config.block_k, chunk=chunk, rows=rows,
                               outputs=outputs, block=block, mb=Mb, T=T, G=G, L=L, Lw=Lw)
    in_specs = [
        pl.BlockSpec(lay.shape, lambda b, h, r, s: (0,)),  # the layer index (and the record buffer's)
        pl.BlockSpec((1,), lambda b, h, r, s: (b,)),  # the batch row's length
        pl.BlockSpec((None, T * Hq, D), lambda b, h, r, s: (b, 0, 0)),  # the batch row's queries
        pl.BlockSpec((L, None, None, N, D), lambda b, h, r, s: (0, b, h, 0, 0)),  # every layer of the KV head
        pl.BlockSpec((L, None, None, N, D), lambda b, h, r, s: (0, b, h, 0, 0)),
    ]
    out_specs = [
        pl.BlockSpec((None, None, None, Mb, D), lambda b, h, r, s: (s, b, h, r, 0)),
        pl.BlockSpec((None, None, None, Mb), lambda b, h, r, s: (s, b, h, r)),
        pl.BlockSpec((None, None, None, Mb), lambda b, h, r, s: (s, b, h, r)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((splits, B, Hkv, Rp, D), jnp.float32),
        jax.ShapeDtypeStruct((splits, B, Hkv, Rp), jnp.float32),
        jax.ShapeDtypeStruct((splits, B, Hkv, Rp), jnp.float32),
    ]
    args, aliases = [lay, lengths.astype(jnp.int32), q.reshape(B, T * Hq, D), k_all, v_all], {}
    if outputs == "logits":
        out_specs.append(pl.BlockSpec((None, None, Mb, N), lambda b, h, r, s: (b, h, r, 0)))
        out_shape.append(jax.ShapeDtypeStruct((B, Hkv, Rp, N), jnp.float32))
    elif outputs == "record":
        # record f32[B, Hq, Lw, N], bmax f32[B, Hq, Lw, NB]: the program of KV head h writes the rows of query heads
        # h * G .. h * G + G - 1, in place.
        specs = [pl.BlockSpec((None, G) + x.shape[2:], lambda b, h, r, s: (b, h, 0, 0)) for x in (record, bmax)]
        in_specs += specs
        args += [record, bmax]
        aliases = {len(args) - 2: 3, len(args) - 1: 4}
        out_specs += specs
        out_shape += [jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (record, bmax)]
    o, m, l, *extra = pl.pallas_call(
        kernel, grid=(B, Hkv, R, splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages or (
            _STAGES_SMALL_TILE if Mb <= _MIN_ROWS else _STAGES)),
        interpret=interpret,
        name="dense_decode_stacked" + ("_record" if outputs == "record" else ""),
    )(*args)

    # Padding rows were never written: slice them off before combining.
    # [B, Hkv, rows(, D)]
    out, lse = sparse_gpu.combine_splits(o[:, :, :, :rows], m[:, :, :, :rows], l[:, :, :, :rows])
    out = out.reshape(B, Hkv, T, G, D).transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, D).astype(q.dtype)
    lim = row_limits(lengths, T, G, N, Rp) if outputs == "logits" else None  # for return_probs' XLA pass
    return out, lse, lim, extra


@functools.partial(jax.jit, static_argnames=("scale", "return_lse", "return_probs", "config", "interpret"))
def dense_decode_stacked_gpu(q: Array, k_all: Array, v_all: Array, layer: Array, lengths: Array, *,
                             scale: float | None = None, return_lse: bool = False, return_probs: bool = False,
                             config: DenseDecodeConfig | None = None, interpret: bool = False):
    """Dense decode attention over layer `layer` of a stacked cache, read in place (Pallas Triton kernel).

    Args:
      q: [B, T, Hq, D] queries of the tokens at positions lengths - T .. lengths - 1.
      k_all: [L, B, Hkv, N, D] stacked head-major key cache (the new tokens written).
      v_all: [L, B, Hkv, N, D] stacked value cache.
      layer: i32[] (traced) layer to read, as `k_all[layer]`.
      lengths: i32[B] valid tokens per row.
      scale: softmax scale (None: 1/sqrt(D)).
      return_lse: also return each query row's log-sum-exp (from the partials the kernel writes anyway).
      return_probs: also return each query head's post-softmax weights summed over the T queries (the kernel
        writes the logits it computes; see the module docstring).
      config: `DenseDecodeConfig` (None: `default_config(D)`).
      interpret: run the kernel in the Pallas interpreter (CPU tests).

    Returns:
      [B, T, Hq, D] in q.dtype, as `reference.dense_decode_stacked_reference`; with return_lse and / or
      return_probs a tuple: that, then lse f32[B, T, Hq] (log-sum-exp of the row's scaled visible logits, -inf
      for a row with no visible key), then probs f32[B, Hq, N] (`pallas_kernels.head_probs.head_probs_stacked`'s
      weights: sum over t of exp(logit - lse) at the keys query t sees, 0 elsewhere).
    """
    out, lse, lim, logits = _launch(q, k_all, v_all, layer, lengths, scale, config, interpret,
                                    outputs="logits" if return_probs else "")
    B, T, Hq, D = q.shape
    Hkv, N = k_all.shape[2], k_all.shape[3]
    G, rows = Hq // Hkv, T * (Hq // Hkv)
    res = [out]
    if return_lse:
        res.append(lse.reshape(B, Hkv, T, G).transpose(0, 2, 1, 3).reshape(B, T, Hq))
    if return_probs:  # one pass over the logits: rows (t, g) of KV head h -> query head h * G + g, summed over t
        s = logits[0][:, :, :rows].reshape(B, Hkv, T, G, N)
        sees = jnp.arange(N)[None, None, None, None, :] <= lim[:, None, :rows, None].reshape(B, 1, T, G, 1)
        p = jnp.where(sees, jnp.exp(s - lse.reshape(B, Hkv, T, G)[..., None]), 0.0).sum(axis=2)
        res.append(p.reshape(B, Hq, N))
    return res[0] if len(res) == 1 else tuple(res)


@functools.partial(jax.jit, static_argnames=("block", "scale", "config", "interpret"),
                   donate_argnames=("record", "bmax"))
def dense_decode_record_gpu(q: Array, k_all: Array, v_all: Array, layer: Array, lengths: Array, record: Array,
                            bmax: Array, record_layer: Array, *, block: int = 16, scale: float | None = None,
                            config: DenseDecodeConfig | None = None, interpret: bool = False):
    """Dense decode of one new token per row that also writes its query heads' scaled logits and their maxima per
    block of keys into stacked record buffers in place (`reference.dense_decode_record_reference` is the
    specification).

    The kernel stores the logits it computes anyway (no second read of K, no XLA pass over them): row
    record[b, h, record_layer] gets query head h's logits at the keys it sees (keys < lengths[b]; the rest of the
    row is left as it was), and bmax[b, h, record_layer] their maxima over blocks of `block` keys (-inf for a block
    without a visible key; each program writes its split's blocks).

    Args:
      q: [B, 1, Hq, D] (bf16/f16); k_all, v_all: [L, B, Hkv, N, D]; layer: i32[] the cache's layer; lengths: i32[B]
        (after the write); record: f32[B, Hq, Lw, N] and bmax: f32[B, Hq, Lw, ceil(N / block)] (donated, updated
        in place); record_layer: i32[] their layer to write; block: keys per block of the maxima (a power of two
        <= config.block_k); config: None: `default_config(D, record=True)`.

    Returns:
      (out [B, 1, Hq, D] in q.dtype, lse f32[B, Hq] (-inf for a row with no visible key), record, bmax).
    """
    out, lse, _, (record, bmax) = _launch(q, k_all, v_all, layer, lengths, scale, config, interpret,
                                          outputs="record", record=record, bmax=bmax, record_layer=record_layer,
                                          block=block)
    return out, lse.reshape(q.shape[0], q.shape[2]), record, bmax

"""Token Sparse Attention key scoring as two Pallas GPU (Triton) kernels.

Never materialises the [W, T] probabilities: only per-query statistics (f32[B, Hq, S, W] for S key splits)
and the [B, Hq, T] result reach HBM.

  pass 1 `_lse_kernel`, grid (Hq, row blocks, S, B): for a block of window queries and the S-th slice of
    the valid keys [0, len), a flash-style online reduction over key blocks gives the row max m and the row
    sum l of exp (base 2). The S slices are merged in jnp into the log-sum-exp of every window query.
  pass 2 `_mean_prob_kernel`, grid (Hq, key blocks, B): recomputes q.k for one key block against all window
    queries, turns it into probabilities with the log-sum-exp of pass 1 and sums them over the queries.

Grid dimension 0 is CUDA's fastest-moving launch index, so the G query heads that read one KV head are
launched side by side and share its K blocks in L2. Keys are read from the caller's [B, T, Hkv, D] layout
(no transpose); loads past T are masked. Logits run in base 2 (`exp2`, scale folded with log2 e) as in
JAX's Triton flash attention.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tsa_scoring import common

Array = jax.Array

_NEG = -1e30  # finite "minus infinity": exp2(_NEG - m) == 0 and _NEG - _NEG == 0 (no NaN)
_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the two passes (all powers of two >= 16 except the counts).

    Attributes:
      block_q: window queries per pass-1 program and per pass-2 matmul.
      block_k: keys per step of pass 1's loop.
      block_k_mean: keys per pass-2 program (its output tile).
      num_splits: pass-1 slices of the valid keys per (head, query block); None picks ~one per 2048 keys.
      num_warps, num_stages: Triton launch parameters of both passes.
    """

    block_q: int = 64
    block_k: int = 64
    block_k_mean: int = 64
    num_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k", "block_k_mean"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"BlockSizes.{name} must be a power of two >= 16, got {v!r}")
        if self.num_splits is not None and (not isinstance(self.num_splits, int) or self.num_splits < 1):
            raise ValueError(f"BlockSizes.num_splits must be None or an int >= 1, got {self.num_splits!r}")


def _cdiv(a, b):
    # Non-negative traced ints (`//` and pl.cdiv do not lower on traced Triton scalars).
    return lax.div(a + b - 1, b)


def _load_keys(k_ref, start, block_k: int, seq_len: int, head_dim: int):
    """k_ref rows [start, start + block_k) -> [block_k, Dp], zeros past T and past D."""
    Dp = k_ref.shape[-1]
    idx = start + jnp.arange(block_k, dtype=jnp.int32)
    mask = (idx < seq_len)[:, None]
    if Dp != head_dim:
        mask = mask & (jnp.arange(Dp) < head_dim)[None, :]
    else:
        mask = jnp.broadcast_to(mask, (block_k, Dp))
    return plgpu.load(k_ref.at[pl.ds(start, block_k), :], mask=mask, other=0.0)


def _lse_kernel(len_ref, q_ref, k_ref, m_ref, l_ref, *, qk_scale, window, block_q, block_k,
                num_splits, seq_len, head_dim, precision):
    """Row max / row sum of exp2 over one slice of keys for block_q window queries.

    Refs: len_ref i32[] (this row's length); q_ref [block_q, Dp]; k_ref [T, Dp] (this KV head);
    m_ref, l_ref f32[block_q].
    """
    r, s = pl.program_id(1), pl.program_id(2)
    length = len_ref[()]
    rows = r * block_q + jnp.arange(block_q, dtype=jnp.int32)
    pos = length - window + rows  # query positions; slots with pos < 0 see no key
    row_ok = rows < window  # rows past W are padding
    q = q_ref[...]

    chunk = _cdiv(_cdiv(length, num_splits), block_k) * block_k  # slice of [0, length), block aligned
    start = s * chunk
    stop = jnp.minimum(start + chunk, length)
    n_blocks = _cdiv(jnp.maximum(stop - start, 0), block_k)

    def body(t, carry):
        m_prev, l_prev = carry
        k0 = start + t * block_k
        k = _load_keys(k_ref, k0, block_k, seq_len, head_dim)
        logits = plgpu.dot(q, k, trans_b=True, precision=precision) * qk_scale  # [block_q, block_k]
        cols = k0 + jnp.arange(block_k, dtype=jnp.int32)
        mask = (cols[None, :] <= pos[:, None]) & row_ok[:, None]
        logits = jnp.where(mask, logits, _NEG)
        m_next = jnp.maximum(m_prev, jnp.max(logits, axis=1))
        p = jnp.where(mask, jnp.exp2(logits - m_next[:, None]), 0.0)
        l_next = l_prev * jnp.exp2(m_prev - m_next) + jnp.sum(p, axis=1)
        return m_next, l_next

    m0 = jnp.full((block_q,), _NEG, jnp.float32)
    l0 = jnp.zeros((block_q,), jnp.float32)
    m, l = lax.fori_loop(0, n_blocks, body, (m0, l0))
    m_ref[...] = m
    l_ref[...] = l


def _mean_prob_kernel(len_ref, q_ref, lse_ref, k_ref, o_ref, *, qk_scale, window, block_q,
                      num_row_blocks, block_k, seq_len, head_dim, precision):
    """Sum over the window queries of softmax probabilities for one key block.

    Refs: len_ref i32[]; q_ref [Wp, Dp]; lse_ref f32[Wp] (base 2); k_ref [T, Dp]; o_ref f32[block_k].
    """
    j = pl.program_id(1)
    length = len_ref[()]
    k0 = j * block_k

    @pl.when(k0 >= length)
    def _():
        o_ref[...] = jnp.zeros((block_k,), jnp.float32)

    @pl.when(k0 < length)
    def _():
        k = _load_keys(k_ref, k0, block_k, seq_len, head_dim)
        cols = k0 + jnp.arange(block_k, dtype=jnp.int32)
        # Window slot i sees key k0 only if p_i = length - window + i >= k0: skip the query blocks before.
        first_row = jnp.maximum(k0 - length + window, 0)
        lo = lax.div(first_row, block_q)

        def body(c, acc):
            rows = c * block_q + jnp.arange(block_q, dtype=jnp.int32)
            q = q_ref[pl.ds(c * block_q, block_q), :]
            lse = lse_ref[pl.ds(c * block_q, block_q)]
            logits = plgpu.dot(q, k, trans_b=True, precision=precision) * qk_scale
            pos = length - window + rows
            mask = (cols[None, :] <= pos[:, None]) & (rows < window)[:, None]
            p = jnp.where(mask, jnp.exp2(logits - lse[:, None]), 0.0)
            return acc + jnp.sum(p, axis=0)

        o_ref[...] = lax.fori_loop(lo, num_row_blocks, body, jnp.zeros((block_k,), jnp.float32))


def _default_splits(seq_len: int, block_k: int) -> int:
    return max(1, min(64, pl.cdiv(seq_len, max(2048, block_k))))


@functools.partial(jax.jit, static_argnames=("window", "scale", "block_sizes", "interpret"))
def _mean_probs(q, k, lengths, *, window, scale, block_sizes, interpret):
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    bs = block_sizes
    Dp = max(16, pl.next_power_of_2(D))
    block_q = min(bs.block_q, max(16, pl.next_power_of_2(window)))
    Wp = pl.cdiv(window, block_q) * block_q
    R = Wp // block_q
    # Keys are read in blocks of up to block_k rows; a sequence shorter than a block is padded (tiny copy).
    Tk = max(T, bs.block_k, bs.block_k_mean)
    if Tk != T:
        k = jnp.pad(k, ((0, 0), (0, Tk - T), (0, 0), (0, 0)))
    S = bs.num_splits or _default_splits(T, bs.block_k)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    qk_scale = scale * _LOG2E

    qw = common.gather_window_queries(q, lengths, window)  # [B, W, Hq, D]
    qw = jnp.pad(qw.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, Wp - window), (0, Dp - D)))  # [B, Hq, Wp, Dp]

    params = plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages)
    len_spec = pl.BlockSpec((None,), lambda *g: (g[-1],))

    m, l = pl.pallas_call(
        functools.partial(
            _lse_kernel, qk_scale=qk_scale, window=window, block_q=block_q, block_k=bs.block_k,
            num_splits=S, seq_len=T, head_dim=D, precision=precision),
        grid=(Hq, R, S, B),
        in_specs=[
            len_spec,
            pl.BlockSpec((None, None, block_q, Dp), lambda h, r, s, b: (b, h, r, 0)),
            pl.BlockSpec((None, Tk, None, Dp), lambda h, r, s, b: (b, 0, h // G, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_q), lambda h, r, s, b: (b, h, s, r)),
            pl.BlockSpec((None, None, None, block_q), lambda h, r, s, b: (b, h, s, r)),
        ],
        out_shape=[jax.ShapeDtypeStruct((B, Hq, S, Wp), jnp.float32)] * 2,
        compiler_params=params,
        interpret=interpret,
        name="tsa_scoring_lse",
    )(lengths, qw, k)

    # Merge the S key slices: log2-sum-exp2 per window query.
    m_all = jnp.max(m, axis=2)
    l_all = jnp.sum(l * jnp.exp2(m - m_all[:, :, None]), axis=2)
    lse = jnp.where(l_all > 0, m_all + jnp.log2(jnp.where(l_all > 0, l_all, 1.0)), 0.0)  # [B, Hq, Wp]

    bk = bs.block_k_mean
    nkb = pl.cdiv(T, bk)
    sums = pl.pallas_call(
        functools.partial(
            _mean_prob_kernel, qk_scale=qk_scale, window=window, block_q=block_q, num_row_blocks=R, block_k=bk,
            seq_len=T, head_dim=D, precision=precision),
        grid=(Hq, nkb, B),
        in_specs=[
            len_spec,
            pl.BlockSpec((None, None, Wp, Dp), lambda h, j, b: (b, h, 0, 0)),
            pl.BlockSpec((None, None, Wp), lambda h, j, b: (b, h, 0)),
            pl.BlockSpec((None, Tk, None, Dp), lambda h, j, b: (b, 0, h // G, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, bk), lambda h, j, b: (b, h, j)),
        out_shape=jax.ShapeDtypeStruct((B, Hq, nkb * bk), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name="tsa_scoring_mean_probs",
    )(lengths, qw, lse, k)
    w_eff = jnp.maximum(jnp.minimum(lengths, window), 1).astype(jnp.float32)
    return sums[:, :, :T] / w_eff[:, None, None]


def tsa_mean_probs_gpu(
    q: Array,
    k: Array,
    *,
    window: int = 128,
    lengths: Array | None = None,
    scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> Array:
    """Mean softmax probability per (query head, key) over the last W queries; see reference.py.

    Args:
      q: [B, T, Hq, D] queries after RoPE (bf16, f16 or f32).
      k: [B, T, Hkv, D] keys after RoPE, same dtype.
      window: W.
      lengths: i32[B] valid tokens per row, or None (all T).
      scale: softmax scale (default 1 / sqrt(D)).
      block_sizes: tiles (default BlockSizes()).
      interpret: run the kernels in Pallas interpret mode (CPU).

    Returns:
      f32[B, Hq, T], 0 for keys >= lengths.
    """
    B, T, _, _, D = common.check_inputs(q, k, lengths)
    window = common.check_window(window)
    scale = common.default_scale(D, scale)
    lens = common.full_lengths(B, T, lengths)
    return _mean_probs(q, k, lens, window=window, scale=scale, block_sizes=block_sizes or BlockSizes(),
                       interpret=interpret)


def tsa_scores_gpu(
    q: Array,
    k: Array,
    *,
    window: int = 128,
    pool_kernel: int = 7,
    lengths: Array | None = None,
    scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> Array:
    """Pooled TSA key scores with the GPU kernels: f32[B, Hq, T] (see `tsa_mean_probs_gpu`)."""
    pool_kernel = common.check_pool_kernel(pool_kernel)
    mean = tsa_mean_probs_gpu(q, k, window=window, lengths=lengths, scale=scale, block_sizes=block_sizes,
                              interpret=interpret)
    return common.avg_pool_keys(mean, pool_kernel, lengths)

"""Pieces every Token Sparse Attention scoring implementation shares.

Argument checks, where the scoring window sits in each row, the gather of the window's queries (a small
[B, W, Hq, D] copy; the kernels never touch the full query tensor) and the key pooling, which is a cheap
jnp step after the kernels on every backend.

Window convention (used by the reference and both kernels): row b holds `len = lengths[b]` valid tokens;
window slot i in [0, W) is the query at position `p_i = len - W + i`; a slot is valid iff `p_i >= 0`, so
rows shorter than the window use all their `len` queries. Query slot i sees the keys `j <= p_i` (which
implies `j < len`).
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

IMPLEMENTATIONS = ("xla", "pallas_gpu", "pallas_tpu")


def _is_int(x) -> bool:
    return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_window(window) -> int:
    """Returns `window` (W) as an int; raises unless it is a positive int."""
    if not _is_int(window) or int(window) < 1:
        raise ValueError(f"window (W) must be a positive int (>= 1), got {window!r}")
    return int(window)


def check_pool_kernel(pool_kernel) -> int:
    """Returns `pool_kernel` as an int; raises unless it is a positive odd int."""
    if not _is_int(pool_kernel) or int(pool_kernel) < 1:
        raise ValueError(f"pool_kernel must be a positive odd int (1, 3, 5, ...), got {pool_kernel!r}")
    if int(pool_kernel) % 2 == 0:
        raise ValueError(
            f"pool_kernel must be odd so that 'same' pooling is centred (1, 3, 5, ...), got {pool_kernel!r}"
        )
    return int(pool_kernel)


def check_inputs(q: Array, k: Array, lengths: Array | None) -> tuple[int, int, int, int, int]:
    """Checks shapes and dtypes; returns (B, T, Hq, Hkv, D).

    Args:
      q: [B, T, Hq, D] floating queries (after RoPE).
      k: [B, T, Hkv, D] floating keys (after RoPE), same dtype as q.
      lengths: i32[B] valid tokens per row, each in [0, T], or None (all T valid). Concrete lengths are
        range-checked here; traced ones cannot be and must be in range (out-of-range values give
        unspecified scores).
    """
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, Hq, D], got shape {q.shape}")
    if k.ndim != 4:
        raise ValueError(f"k must be [B, T, Hkv, D], got shape {k.shape}")
    B, T, Hq, D = q.shape
    if k.shape[0] != B or k.shape[1] != T or k.shape[3] != D:
        raise ValueError(f"k must be [B={B}, T={T}, Hkv, D={D}] to match q {q.shape}, got {k.shape}")
    Hkv = k.shape[2]
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(f"query heads Hq={Hq} must be a multiple of KV heads Hkv={Hkv} (GQA)")
    if not jnp.issubdtype(q.dtype, jnp.floating) or q.dtype != k.dtype:
        raise ValueError(f"q and k must share one floating dtype, got q {q.dtype} and k {k.dtype}")
    if T < 1 or D < 1:
        raise ValueError(f"T and D must be >= 1, got q shape {q.shape}")
    if lengths is not None:
        if jnp.shape(lengths) != (B,):
            raise ValueError(f"lengths must be i32[B={B}], got shape {jnp.shape(lengths)}")
        if not jnp.issubdtype(jnp.result_type(lengths), jnp.integer):
            raise ValueError(f"lengths must be an integer array, got dtype {jnp.result_type(lengths)}")
        if not isinstance(lengths, jax.core.Tracer):
            lo, hi = int(np.min(np.asarray(lengths))), int(np.max(np.asarray(lengths)))
            if lo < 0 or hi > T:
                raise ValueError(f"lengths must lie in [0, T={T}], got values in [{lo}, {hi}]")
    return B, T, Hq, Hkv, D


def default_scale(head_dim: int, scale: float | None) -> float:
    """The softmax scale: `scale` if given, else 1 / sqrt(D) (Llama's attention scale)."""
    if scale is None:
        return float(head_dim) ** -0.5
    if not isinstance(scale, numbers.Real) or not np.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")
    return float(scale)


def full_lengths(batch: int, seq_len: int, lengths: Array | None) -> Array:
    """Returns lengths as i32[B] (all `seq_len` valid when None)."""
    if lengths is None:
        return jnp.full((batch,), seq_len, jnp.int32)
    return jnp.asarray(lengths).astype(jnp.int32)


def window_positions(lengths: Array, window: int) -> Array:
    """Positions of the window's query slots: i32[B, W], `p_i = len - W + i` (negative = invalid slot)."""
    return lengths[:, None] - window + jnp.arange(window, dtype=jnp.int32)[None, :]


def gather_window_queries(q: Array, lengths: Array, window: int) -> Array:
    """The window's queries: [B, W, Hq, D] (invalid slots hold some valid row; kernels mask them).

    Args:
      q: [B, T, Hq, D].
      lengths: i32[B].
      window: W.
    """
    T = q.shape[1]
    pos = jnp.clip(window_positions(lengths, window), 0, T - 1)  # [B, W]
    return jnp.take_along_axis(q, pos[:, :, None, None], axis=1)


def avg_pool_keys(scores: Array, pool_kernel: int, lengths: Array | None = None) -> Array:
    """Average pooling over keys: kernel `pool_kernel`, stride 1, 'same' zero padding, divisor pool_kernel.

    This is `torch.nn.functional.avg_pool1d(x, pool_kernel, stride=1, padding=pool_kernel // 2)` with its
    default `count_include_pad=True`, which is what the official TSA code calls. Keys at or beyond
    `lengths[b]` are treated as zeros going in (they are padding) and are set to 0 coming out.

    Args:
      scores: f32[B, H, T].
      pool_kernel: odd int >= 1.
      lengths: i32[B] or None (all T valid).

    Returns:
      f32[B, H, T].
    """
    pool_kernel = check_pool_kernel(pool_kernel)
    B, _, T = scores.shape
    valid = None
    if lengths is not None:
        valid = jnp.arange(T, dtype=jnp.int32)[None, None, :] < jnp.asarray(lengths, jnp.int32)[:, None, None]
        scores = jnp.where(valid, scores, 0.0)
    if pool_kernel > 1:
        half = pool_kernel // 2
        summed = jax.lax.reduce_window(
            scores, jnp.array(0, scores.dtype), jax.lax.add,
            window_dimensions=(1, 1, pool_kernel), window_strides=(1, 1, 1),
            padding=((0, 0), (0, 0), (half, half)),
        )
        scores = summed / pool_kernel
    if valid is not None:
        scores = jnp.where(valid, scores, 0.0)
    return scores

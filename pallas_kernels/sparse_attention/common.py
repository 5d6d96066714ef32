"""Argument checks and small helpers shared by every implementation of the gathered sparse-attention ops.

Shapes are static under `jax.jit`, so every check here runs at trace time and raises `ValueError` naming the
bad value and the valid range. Values inside arrays (indices, lengths) cannot be checked under tracing; their
contract is documented in `reference.py` and every implementation masks rather than trusts them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

Array = jax.Array


def default_scale(head_dim: int, scale: float | None) -> float:
    """The softmax scale: `scale` if given, else 1 / sqrt(head_dim)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale={scale}: expected a finite positive number (or None for 1/sqrt(D))")
    return scale


def _check_int_array(name: str, x: Array, shape: tuple[int, ...]) -> None:
    if not hasattr(x, "dtype"):
        raise ValueError(f"{name} is a {type(x).__name__}: expected an integer array (int32) of shape {tuple(shape)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} has dtype {x.dtype}: expected an integer dtype (int32)")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}: expected {tuple(shape)}")


def _check_heads(hq: int, hkv: int) -> None:
    if hkv <= 0 or hq % hkv:
        raise ValueError(f"Hq={hq} query heads is not a multiple of Hkv={hkv} KV heads (GQA needs Hq % Hkv == 0)")


def check_floating(**arrays: Array) -> None:
    """Attention inputs (queries, keys, values) must be floating point: integer arrays would be multiplied as
    integers, or rounded by the kernels' float casts, without a word."""
    for name, x in arrays.items():
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} has dtype {x.dtype}: expected a floating dtype (bfloat16, float16, float32)")


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r}: expected an int >= 1 (tokens per index entry)")


def check_decode_cache(q: Array, k: Array, v: Array) -> tuple[int, int, int, int, int, int]:
    """Validates decode queries q [B, T, Hq, D] against one layer's head-major cache k, v [B, Hkv, N, D] (GQA
    heads included); returns (B, T, Hq, D, Hkv, N)."""
    if q.ndim != 4:
        raise ValueError(f"q has shape {tuple(q.shape)}: expected [B, T, Hq, D]")
    B, T, Hq, D = q.shape
    if k.ndim != 4 or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k has shape {tuple(k.shape)}: expected a head-major cache [B={B}, Hkv, N, D={D}]")
    if v.shape != k.shape:
        raise ValueError(f"v has shape {tuple(v.shape)}: expected the shape of k, {tuple(k.shape)}")
    Hkv, N = k.shape[1], k.shape[2]
    _check_heads(Hq, Hkv)
    check_floating(q=q, k=k, v=v)
    return B, T, Hq, D, Hkv, N


def check_decode_args(q: Array, k: Array, v: Array, indices: Array, lengths: Array, block_size: int,
                      shared_rows: bool = False) -> None:
    """Validates the shapes of a `sparse_decode` call (see `reference.sparse_decode_reference`): indices
    [B, Hkv, T, K], or with shared_rows also [B, Hkv, 1, K] (one row for all T queries, `query_rows`)."""
    B, T, Hq, D, Hkv, N = check_decode_cache(q, k, v)
    _check_block_size(block_size)
    if N % block_size:
        raise ValueError(f"cache length N={N} is not a multiple of block_size={block_size}")
    if T < 1 or T > N:
        raise ValueError(f"T={T} new tokens: expected 1 <= T <= N={N}")
    rows = (1, T) if shared_rows else (T,)
    if indices.ndim != 4 or indices.shape[:2] != (B, Hkv) or indices.shape[2] not in rows or indices.shape[3] < 1:
        raise ValueError(f"indices has shape {tuple(indices.shape)}: expected [B={B}, Hkv={Hkv}, T={T}, K>=1]"
                         + (" (or [B, Hkv, 1, K], one row for every query)" if shared_rows else ""))
    _check_int_array("indices", indices, indices.shape)
    _check_int_array("lengths", lengths, (B,))


def query_rows(indices: Array, T: int) -> Array:
    """Decode index rows [B, Hkv, T, K] from rows that may be shared by the T queries ([B, Hkv, 1, K]: the
    same keys for every new token, as a speculative verification's selection), broadcast."""
    return jnp.broadcast_to(indices, indices.shape[:2] + (T,) + indices.shape[3:])


def check_prefill_args(q: Array, k: Array, v: Array, indices: Array, lengths: Array, tile: int,
                       block_size: int) -> None:
    """Validates the shapes of a `sparse_prefill` call (see `reference.sparse_prefill_reference`)."""
    if q.ndim != 4:
        raise ValueError(f"q has shape {tuple(q.shape)}: expected [B, T, Hq, D]")
    B, T, Hq, D = q.shape
    if k.ndim != 4 or k.shape[0] != B or k.shape[1] != T or k.shape[3] != D:
        raise ValueError(f"k has shape {tuple(k.shape)}: expected [B={B}, T={T}, Hkv, D={D}]")
    if v.shape != k.shape:
        raise ValueError(f"v has shape {tuple(v.shape)}: expected the shape of k, {tuple(k.shape)}")
    Hkv = k.shape[2]
    _check_heads(Hq, Hkv)
    check_floating(q=q, k=k, v=v)
    _check_block_size(block_size)
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tile={tile!r}: expected an int >= 1 (query rows per index row)")
    if tile % block_size:
        raise ValueError(f"tile={tile} is not a multiple of block_size={block_size}: a query tile must hold "
                         f"whole blocks")
    n_tiles = -(-T // tile)
    if indices.ndim != 4 or indices.shape[:3] != (B, Hkv, n_tiles) or indices.shape[3] < 1:
        raise ValueError(f"indices has shape {tuple(indices.shape)}: expected [B={B}, Hkv={Hkv}, "
                         f"ceil(T/tile)={n_tiles}, K>=1]")
    _check_int_array("indices", indices, indices.shape)
    _check_int_array("lengths", lengths, (B,))


def block_token_positions(indices: Array, block_size: int) -> Array:
    """Expands block indices to token positions.

    Args:
      indices: int[..., K] block indices, -1 padded.
      block_size: tokens per block.

    Returns:
      int32[..., K * block_size]: entry j's tokens j*bs .. j*bs + bs - 1, in order; a -1 entry gives
      negative positions (every one of them < 0), so `>= 0` tells the real tokens. So does an entry whose tokens
      lie past int32 (j > (2^31 - 1) // bs - 1: past any cache), where j * bs would wrap around to a real token.
    """
    indices = indices.astype(jnp.int32)
    if block_size == 1:
        return indices
    offsets = jnp.arange(block_size, dtype=jnp.int32)
    real = (indices >= 0) & (indices < (2 ** 31 - 1) // block_size)  # its last token j * bs + bs - 1 < 2^31
    tok = jnp.where(real[..., None], indices[..., None] * block_size + offsets, -1)
    return tok.reshape(*indices.shape[:-1], indices.shape[-1] * block_size)


def floor_blocks(x: Array, block_size: int) -> Array:
    """floor(x / block_size) of int32 x (negative x too): an arithmetic shift for a power-of-two block_size (what
    the Pallas kernels take; Triton lowers it), a floor division otherwise."""
    if block_size & (block_size - 1) == 0:
        return jax.lax.shift_right_arithmetic(x, jnp.full_like(x, block_size.bit_length() - 1))
    return jnp.floor_divide(x, block_size)


def blocks_at_or_before(indices: Array, limit: Array, block_size: int) -> Array:
    """Which entries are blocks (>= 0) starting at or before token `limit` (broadcast against indices; -1: none).

    Compared as indices <= floor(limit / block_size), never as indices * block_size <= limit: the product of an index
    past 2^31 / block_size wraps around int32 and would pass as a block before the limit. The Triton kernels take it
    in-kernel too (the entries they read are raw), so an entry it passes has tokens j * bs .. that do not wrap.
    """
    return (indices >= 0) & (indices <= floor_blocks(jnp.asarray(limit, jnp.int32), block_size))


def blocks_before(indices: Array, start: Array, block_size: int) -> Array:
    """Which entries are blocks (>= 0) starting before token `start` (>= 0, broadcast against indices): indices <
    ceil(start / block_size), without the int32 product that wraps around (`blocks_at_or_before`)."""
    return (indices >= 0) & (indices < -floor_blocks(-jnp.asarray(start, jnp.int32), block_size))

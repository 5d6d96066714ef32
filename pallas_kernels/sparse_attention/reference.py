"""Plain-jnp references of the gathered sparse-attention ops: the specification every kernel matches.

Two ops, one per phase (layouts as in the README's index contract):

  sparse_decode_reference(q: [B, T, Hq, D], k, v: [B, Hkv, N, D], indices: i32[B, Hkv, T, K], lengths: i32[B])
      -> [B, T, Hq, D] (and optionally lse: f32[B, T, Hq])
  sparse_prefill_reference(q: [B, T, Hq, D], k, v: [B, T, Hkv, D], indices: i32[B, Hkv, ceil(T/tile), K],
                           lengths: i32[B]) -> [B, T, Hq, D]

The index contract (shared by every implementation):
  * `indices` hold block numbers in units of `block_size` tokens (block j covers tokens j*bs .. j*bs + bs - 1;
    `block_size=1` means token positions). Entries are unique; by convention ascending with the -1 padding at
    the end, but the ops treat every entry on its own, so -1 may sit anywhere. A duplicated entry would count
    its keys twice (in every implementation alike), so methods must not emit duplicates.
  * Query head h reads KV head h // G (G = Hq // Hkv), so the whole GQA group shares one index row.
  * Entries (or tokens of a block) that fall outside the valid range (after the query's own position, at or
    beyond `lengths`, past the cache end) are ignored, never read out of bounds; so is an entry whose tokens lie
    past int32 (j > 2^31 / block_size - 1), whose j * bs would wrap around to a real token.
  * Softmax runs over exactly the valid selected keys, with f32 accumulation; a query row with no valid key
    outputs zeros (and, where returned, lse = -inf).

And two brute-force helpers that the tests of every method use: `masked_attention_reference` (a dense softmax
over a boolean mask) and `indices_to_mask` (the mask an index array stands for under this contract).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.sparse_attention.common import (block_token_positions, check_decode_args,
                                                    check_prefill_args, default_scale)

Array = jax.Array
_HIGHEST = jax.lax.Precision.HIGHEST


def _softmax_rows(logits: Array, valid: Array) -> tuple[Array, Array]:
    """Softmax over the last axis restricted to `valid`; rows with no valid entry give zeros.

    Args:
      logits: f32[..., S].
      valid: bool[..., S].

    Returns:
      (p: f32[..., S] probabilities (all zero on an empty row), lse: f32[...] logsumexp, -inf on an empty row).
    """
    logits = jnp.where(valid, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(logits - m_safe[..., None])  # exp(-inf) = 0 on masked entries
    l = jnp.sum(e, axis=-1)
    p = jnp.where(l[..., None] > 0, e / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    lse = jnp.where(l > 0, m_safe + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    return p, lse


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "return_lse"))
def sparse_decode_reference(q: Array, k: Array, v: Array, indices: Array, lengths: Array, *,
                            block_size: int = 1, scale: float | None = None,
                            return_lse: bool = False) -> Array | tuple[Array, Array]:
    """Gathered decode attention: each new token attends to its KV head's selected cache blocks only.

    Args:
      q: [B, T, Hq, D] (bf16/f16/f32) queries of the T newest tokens, at positions lengths - T + t.
      k: [B, Hkv, N, D] head-major key cache (the new tokens already written), N % block_size == 0.
      v: [B, Hkv, N, D] value cache, like k.
      indices: int32[B, Hkv, T, K] selected blocks per KV head and new token, -1 padded (see the module
        docstring for the contract).
      lengths: int32[B] valid tokens per row after the write (T <= lengths <= N).
      block_size: tokens per index entry.
      scale: softmax scale; None means 1 / sqrt(D).
      return_lse: also return the logsumexp of the scaled logits over the attended keys.

    Returns:
      out: [B, T, Hq, D] in q.dtype: softmax over the tokens of the selected blocks that are <= the query's
        position (causal) and < lengths; zeros for a query with no such token.
      lse (only with return_lse): f32[B, T, Hq]; a selected key's post-softmax probability is
        exp(scale * q.k - lse); -inf for a query with no valid key.
    """
    check_decode_args(q, k, v, indices, lengths, block_size)
    B, T, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = default_scale(D, scale)
    lengths = lengths.astype(jnp.int32)

    tok = block_token_positions(indices, block_size)  # [B, Hkv, T, S]
    pos = lengths[:, None] - T + jnp.arange(T, dtype=jnp.int32)  # [B, T]
    valid = (tok >= 0) & (tok <= pos[:, None, :, None]) & (tok < lengths[:, None, None, None]) & (tok < N)
    safe = jnp.clip(tok, 0, N - 1)
    bi = jnp.arange(B)[:, None, None, None]
    hi = jnp.arange(Hkv)[None, :, None, None]
    kg = k.astype(jnp.float32)[bi, hi, safe]  # [B, Hkv, T, S, D]
    # Rows never attended (past `lengths`, unselected) are garbage, maybe NaN: zeroed, not multiplied by a 0 weight.
    vg = jnp.where(valid[..., None], v.astype(jnp.float32)[bi, hi, safe], 0.0)

    qf = q.astype(jnp.float32).reshape(B, T, Hkv, G, D)
    logits = jnp.einsum("bthgd,bhtsd->bhgts", qf, kg, precision=_HIGHEST) * scale
    p, lse = _softmax_rows(logits, valid[:, :, None])  # [B, Hkv, G, T, S], [B, Hkv, G, T]
    out = jnp.einsum("bhgts,bhtsd->bthgd", p, vg, precision=_HIGHEST).reshape(B, T, Hq, D).astype(q.dtype)
    if return_lse:
        return out, lse.transpose(0, 3, 1, 2).reshape(B, T, Hq)
    return out


@functools.partial(jax.jit, static_argnames=("tile", "block_size", "scale"))
def sparse_prefill_reference(q: Array, k: Array, v: Array, indices: Array, lengths: Array, *, tile: int = 32,
                             block_size: int = 1, scale: float | None = None) -> Array:
    """Tile-gathered causal prefill attention: each query tile attends to its selected keys plus its diagonal.

    Query tile i holds rows i*tile .. i*tile + tile - 1. Its keys are (a) the tokens of the tile's selected
    blocks that lie before the tile start (entries with block * block_size >= i*tile are ignored), and (b) the
    causal diagonal tile, keys i*tile .. the query's own position, which is always added.

    Args:
      q: [B, T, Hq, D] (bf16/f16/f32) queries at positions 0 .. T-1 (right padded).
      k: [B, T, Hkv, D] keys of the same tokens.
      v: [B, T, Hkv, D] values.
      indices: int32[B, Hkv, ceil(T/tile), K] selected blocks per KV head and query tile, -1 padded.
      lengths: int32[B] valid tokens per row (0 <= lengths <= T).
      tile: query rows per index row; a multiple of block_size.
      block_size: tokens per index entry.
      scale: softmax scale; None means 1 / sqrt(D).

    Returns:
      [B, T, Hq, D] in q.dtype. Rows at or beyond lengths (padding) are zeros.
    """
    check_prefill_args(q, k, v, indices, lengths, tile, block_size)
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    nt = indices.shape[2]
    Tp = nt * tile
    scale = default_scale(D, scale)
    lengths = jnp.minimum(lengths.astype(jnp.int32), T)  # keys past T do not exist

    pad = [(0, 0), (0, Tp - T), (0, 0), (0, 0)]
    qf = jnp.pad(q.astype(jnp.float32), pad).reshape(B, nt, tile, Hkv, G, D)
    kf = jnp.pad(k.astype(jnp.float32), pad).transpose(0, 2, 1, 3)  # [B, Hkv, Tp, D]
    vf = jnp.pad(v.astype(jnp.float32), pad).transpose(0, 2, 1, 3)

    starts = jnp.arange(nt, dtype=jnp.int32) * tile  # [nt]
    sel = block_token_positions(indices, block_size)  # [B, Hkv, nt, S]
    sel_ok = (sel >= 0) & (sel < starts[:, None])
    diag = starts[:, None] + jnp.arange(tile, dtype=jnp.int32)  # [nt, tile]
    keys = jnp.concatenate([jnp.where(sel_ok, sel, 0), jnp.broadcast_to(diag, (B, Hkv, nt, tile))], -1)
    cand = jnp.concatenate([sel_ok, jnp.ones((B, Hkv, nt, tile), bool)], -1)  # [B, Hkv, nt, S + tile]

    qpos = diag  # [nt, tile] query positions
    valid = (cand[:, :, :, None, :]
             & (keys[:, :, :, None, :] <= qpos[None, None, :, :, None])
             & (qpos[None, None, :, :, None] < lengths[:, None, None, None, None]))  # [B, Hkv, nt, tile, S+tile]

    bi = jnp.arange(B)[:, None, None, None]
    hi = jnp.arange(Hkv)[None, :, None, None]
    kg = kf[bi, hi, keys]  # [B, Hkv, nt, S + tile, D]
    vg = jnp.where(jnp.any(valid, axis=3)[..., None], vf[bi, hi, keys], 0.0)  # rows no query attends: zeroed
    logits = jnp.einsum("birhgd,bhisd->bhgirs", qf, kg, precision=_HIGHEST) * scale
    p, _ = _softmax_rows(logits, valid[:, :, None])
    out = jnp.einsum("bhgirs,bhisd->birhgd", p, vg, precision=_HIGHEST)
    return out.reshape(B, Tp, Hq, D)[:, :T].astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "return_lse"))
def masked_attention_reference(q: Array, k: Array, v: Array, mask: Array, *, scale: float | None = None,
                               return_lse: bool = False) -> Array | tuple[Array, Array]:
    """The plain dense masked reference: a softmax over exactly the keys a boolean mask allows.

    Args:
      q: [B, Tq, Hq, D] queries.
      k: [B, Hkv, N, D] head-major keys (prefill callers transpose [B, T, Hkv, D] with .transpose(0, 2, 1, 3)).
      v: [B, Hkv, N, D] values.
      mask: bool[B, Hkv, Tq, N] (shared by a GQA group) or bool[B, Hq, Tq, N] (per query head).
      scale: softmax scale; None means 1 / sqrt(D).
      return_lse: also return f32[B, Tq, Hq] logsumexp (-inf on an empty row).

    Returns:
      [B, Tq, Hq, D] in q.dtype, zeros on rows whose mask is all False.
    """
    B, Tq, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    if mask.shape == (B, Hkv, Tq, N):
        mask = jnp.repeat(mask, G, axis=1)
    elif mask.shape != (B, Hq, Tq, N):
        raise ValueError(f"mask has shape {tuple(mask.shape)}: expected [B, Hkv, Tq, N] = {(B, Hkv, Tq, N)} "
                         f"or [B, Hq, Tq, N] = {(B, Hq, Tq, N)}")
    scale = default_scale(D, scale)
    kh = jnp.repeat(k.astype(jnp.float32), G, axis=1)  # [B, Hq, N, D]
    vh = jnp.repeat(v.astype(jnp.float32), G, axis=1)
    logits = jnp.einsum("bthd,bhnd->bhtn", q.astype(jnp.float32), kh, precision=_HIGHEST) * scale
    p, lse = _softmax_rows(logits, mask)
    out = jnp.einsum("bhtn,bhnd->bthd", p, vh, precision=_HIGHEST).astype(q.dtype)
    if return_lse:
        return out, lse.transpose(0, 2, 1)
    return out


def _scatter_selected(tok: Array, num_keys: int) -> Array:
    """bool[..., num_keys]: True at each token position of tok[..., S] (negative / out-of-range ignored)."""
    lead = tok.shape[:-1]
    flat = tok.reshape(-1, tok.shape[-1])
    flat = jnp.where((flat >= 0) & (flat < num_keys), flat, num_keys)  # out of range -> dropped
    rows = jnp.arange(flat.shape[0])[:, None]
    m = jnp.zeros((flat.shape[0], num_keys), bool).at[rows, flat].set(True, mode="drop")
    return m.reshape(*lead, num_keys)


@functools.partial(jax.jit, static_argnames=("num_keys", "block_size"))
def decode_indices_to_mask(indices: Array, lengths: Array, num_keys: int, *, block_size: int = 1) -> Array:
    """The attention mask that decode indices stand for.

    Args:
      indices: int32[B, Hkv, T, K] selected blocks (T new tokens at positions lengths - T + t).
      lengths: int32[B] valid tokens per row.
      num_keys: N, the cache length.
      block_size: tokens per index entry.

    Returns:
      bool[B, Hkv, T, N]: key n is attended by new token t iff n is in a selected block, n <= its position
      and n < lengths.
    """
    T = indices.shape[2]
    sel = _scatter_selected(block_token_positions(indices, block_size), num_keys)
    pos = lengths.astype(jnp.int32)[:, None] - T + jnp.arange(T, dtype=jnp.int32)  # [B, T]
    n = jnp.arange(num_keys, dtype=jnp.int32)
    causal = (n[None, None, :] <= pos[:, :, None]) & (n[None, None, :] < lengths[:, None, None])  # [B, T, N]
    return sel & causal[:, None]


@functools.partial(jax.jit, static_argnames=("seq_len", "tile", "block_size"))
def prefill_indices_to_mask(indices: Array, lengths: Array, seq_len: int, *, tile: int,
                            block_size: int = 1) -> Array:
    """The causal attention mask that prefill tile indices stand for (selected keys + the diagonal tile).

    Args:
      indices: int32[B, Hkv, ceil(T/tile), K] selected blocks per query tile.
      lengths: int32[B] valid tokens per row.
      seq_len: T.
      tile: query rows per index row.
      block_size: tokens per index entry.

    Returns:
      bool[B, Hkv, T, T]: query r attends key n iff n <= r < lengths and either n is in the diagonal tile
      (n >= tile_start(r)) or n is in one of the tile's selected blocks (which lie before tile_start(r)).
    """
    nt = indices.shape[2]
    starts = jnp.arange(nt, dtype=jnp.int32) * tile
    tok = block_token_positions(indices, block_size)
    tok = jnp.where(tok < starts[:, None], tok, -1)
    sel = _scatter_selected(tok, seq_len)  # [B, Hkv, nt, T]
    sel = jnp.repeat(sel, tile, axis=2)[:, :, :seq_len]  # [B, Hkv, T, T]
    r = jnp.arange(seq_len, dtype=jnp.int32)
    diag = (r[None, :] >= (r[:, None] // tile) * tile)  # key n in query r's tile or later
    causal = (r[None, :] <= r[:, None])
    valid_q = r[None, :, None] < jnp.minimum(lengths, seq_len)[:, None, None]  # [B, T, 1]
    return (sel | diag[None, None]) & causal[None, None] & valid_q[:, None]


def indices_to_mask(indices: Array, lengths: Array, num_keys: int, *, block_size: int = 1,
                    tile: int | None = None) -> Array:
    """`decode_indices_to_mask` when tile is None, else `prefill_indices_to_mask` (num_keys = T)."""
    if tile is None:
        return decode_indices_to_mask(indices, lengths, num_keys, block_size=block_size)
    return prefill_indices_to_mask(indices, lengths, num_keys, tile=tile, block_size=block_size)

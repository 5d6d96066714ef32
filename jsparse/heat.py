"""Heat: a decayed sum of the attention mass each key block received (EvoSparse's heat, H2O's accumulated score).

Per layer, KV head and block, after every decode step,  h <- lambda * h + s,  with s the post-softmax mass the
block received in that step (lambda: `decay`; lambda = 1 is H2O's plain accumulation). The heat is stacked over
layers, f32[L, B, Hkv, NB], and lives in a method's decode state; a method ranks blocks by it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jsparse import selection as sel
from pallas_kernels.block_scores import sparse_decode_mass

Array = jax.Array


def decay_heat(heat: Array, first_layer: int, decay: float) -> Array:
    """The stacked heat f32[L, ...] with the rows of layers >= first_layer multiplied by decay (one elementwise
    pass; the layers before first_layer are dense and keep their heat)."""
    sparse = jnp.arange(heat.shape[0]) >= first_layer
    return jnp.where(sparse.reshape((-1,) + (1,) * (heat.ndim - 1)), decay * heat, heat)


def heat_update(heat: Array, idx: Array, values: Array, decay: float) -> Array:
    """decay * heat + values summed into their blocks: heat f32[..., nb], idx i32[..., K] (valid entries unique,
    ascending, then -1), values f32[..., K]. One scatter-add into the decayed row (the -1 padding is mapped to
    distinct out-of-range blocks and dropped), so the indices are sorted and unique as XLA is told."""
    lead = idx.shape[:-1]
    nb, K = heat.shape[-1], idx.shape[-1]
    safe = jnp.where(idx >= 0, idx, nb + jnp.arange(K, dtype=idx.dtype))
    grids = jnp.meshgrid(*[jnp.arange(n) for n in lead], indexing="ij")
    at = tuple(jnp.broadcast_to(g[..., None], idx.shape) for g in grids) + (safe,)
    return (decay * heat).at[at].add(values.astype(heat.dtype), mode="drop", indices_are_sorted=True,
                                     unique_indices=True)


@functools.partial(jax.jit, static_argnames=("decay",))
def heat_step(heat: Array, mass: Array, decay: float) -> Array:
    """h <- lambda * h + s with s dense over the blocks: f32[..., NB] both (EvoSparse itself uses `heat_update`)."""
    return decay * heat + mass


def pool_blocks(x: Array, block_size: int, num_blocks: int) -> Array:
    """Sums f32[..., T] over blocks of `block_size` tokens: f32[..., num_blocks] (the last block partial, the
    blocks past ceil(T / block_size) zero)."""
    T = x.shape[-1]
    nb = -(-T // block_size)
    if nb > num_blocks:
        raise ValueError(f"{T} tokens need {nb} blocks of {block_size}, more than the {num_blocks} given")
    pad = [(0, 0)] * (x.ndim - 1)
    x = jnp.pad(x, pad + [(0, nb * block_size - T)]).reshape(x.shape[:-1] + (nb, block_size)).sum(-1)
    return jnp.pad(x, pad + [(0, num_blocks - nb)])


def prefill_heat(q: Array, k: Array, lengths: Array, window: int, decay: float, block_size: int,
                 num_blocks: int) -> Array:
    """The heat after dense decoding of each prompt's last `window` rows: h = sum_w lambda^(W-1-w) s_w.

    s_w is the post-softmax mass row w gives each block, the mean over the GQA group; rows before a short
    prompt's start add nothing.

    Args:
      q: [B, T, Hq, D]; k: [B, T, Hkv, D] (right-padded prompts); lengths: i32[B] valid tokens per row.
      window: W <= T rows; decay: lambda; block_size: tokens per block; num_blocks: NB >= ceil(T / block_size).
    Returns:
      f32[B, Hkv, NB].
    """
    T = q.shape[1]
    W = window
    rows = lengths[:, None] - W + jnp.arange(W)  # [B, W]
    qr = jnp.take_along_axis(q, jnp.clip(rows, 0, T - 1)[:, :, None, None], axis=1)  # [B, W, Hq, D]
    p = sel.group_probs(qr, jnp.swapaxes(k, 1, 2), rows).mean(axis=2)  # [B, Hkv, W, T]
    p = jnp.where((rows >= 0)[:, None, :, None], p, 0.0)  # a row before the prompt sees no key: its softmax is NaN
    weight = jnp.where(rows >= 0, decay ** (W - 1 - jnp.arange(W, dtype=jnp.float32)), 0.0)  # [B, W]
    h = jnp.einsum("bhwn,bw->bhn", p, weight)  # [B, Hkv, T]
    return pool_blocks(h, block_size, num_blocks)


def scan_rows(heat: Array | None, layer, step, xs, rows: Array | None = None):
    """Runs the T new rows of a decode in order over one layer's heat, so row t sees the heat after rows < t
    exactly as T = 1 decoding of the same tokens would.

    Args:
      heat: the stacked heat f32[L, B, Hkv, NB] (or None: no heat, the carry stays None); layer: i32[] this layer.
      step: (heat_l: f32[B, Hkv, NB] | None, x_t) -> (heat_l, out_t), one row.
      xs: a pytree of arrays [B, T, ...] (None leaves allowed), row t is x[:, t].
      rows: None, or every layer's heat before and after each row, f32[L, B, Hkv, T + 1, NB] (`begin_rows`: a
        speculative verification keeps the heat of the rows it accepts, `keep_rows`); this layer's slots 1 .. T
        are written.
    Returns:
      (outs: the out_t stacked as [B, T, ...], the stacked heat with this layer's row updated in place, rows
       with this layer's written (None when None)).
    """
    heat_l = None if heat is None else jax.lax.dynamic_index_in_dim(heat, layer, 0, keepdims=False)
    if rows is None or heat is None:
        heat_l, out = jax.lax.scan(step, heat_l, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), xs))
    else:
        def step_kept(h, x):
            h, o = step(h, x)
            return h, (o, h)

        heat_l, (out, after) = jax.lax.scan(step_kept, heat_l, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), xs))
        after = jnp.moveaxis(after, 0, 2)  # [B, Hkv, T, NB]
        layer_rows = jax.lax.dynamic_index_in_dim(rows, layer, 0, keepdims=False)
        layer_rows = jax.lax.dynamic_update_slice_in_dim(layer_rows, after.astype(rows.dtype), 1, axis=2)
        rows = jax.lax.dynamic_update_index_in_dim(rows, layer_rows, layer, axis=0)
    if heat is not None:
        heat = jax.lax.dynamic_update_index_in_dim(heat, heat_l, layer, axis=0)
    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), out), heat, rows


def begin_rows(heat: Array, T: int) -> Array:
    """The rows buffer of a T-row decode whose rows may be rolled back (a speculative verification): f32[L, B,
    Hkv, T + 1, NB], every slot the heat before it (slot t + 1 becomes the heat after row t in the layers that
    update it; the others keep theirs)."""
    L, B, H, NB = heat.shape
    return jnp.broadcast_to(heat[:, :, :, None], (L, B, H, T + 1, NB))


def keep_rows(rows: Array, count: Array) -> Array:
    """The heat after each batch row's first count[b] decode rows (0: the heat before them), f32[L, B, Hkv, NB],
    from `begin_rows`' buffer after the decode; count: i32[B] in [0, T]."""
    idx = jnp.clip(count.astype(jnp.int32), 0, rows.shape[3] - 1)
    return jnp.take_along_axis(rows, idx[None, :, None, None, None], axis=3)[:, :, :, 0]


def attend_with_mass(q_t: Array, k_all: Array, v_all: Array, layer: Array, idx: Array, lengths: Array,
                     block_size: int, implementation: str | None = None, config=None):
    """Attention of one decode row over selected blocks, with the mass each block received (the heat's s).

    One gathered-decode kernel (`block_scores.sparse_decode_mass`) returns each selected block's softmax mass
    from partial sums it keeps while attending (no second gather of K).

    Args:
      q_t: [B, Hq, D]; k_all, v_all: [L, B, Hkv, N, D] the stacked cache, read at `layer` (i32[]);
      idx: i32[B, Hkv, K] blocks ascending, -1 padded; lengths: i32[B] visible keys (0: read nothing).
    Returns:
      (out: [B, Hq, D], mass: f32[B, Hkv, K] the post-softmax mass of each entry of idx, mean over the GQA group;
      `heat_update` sums it into the blocks).
    """
    out, emass = sparse_decode_mass(q_t[:, None], k_all, v_all, layer, idx[:, :, None], lengths,
                                    block_size=block_size, implementation=implementation, config=config)
    return out[:, 0], emass[:, :, 0]

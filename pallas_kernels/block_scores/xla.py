"""XLA fallback of the block_scores ops (any backend). Slicing the layer out of the stacked cache copies it
inside a layer scan; that is acceptable off the GPU, where these run (CPU tests and evaluation)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.block_scores.reference import check_block_max_args
from pallas_kernels.sparse_attention import sparse_decode
from pallas_kernels.sparse_attention.common import default_scale
from pallas_kernels.sparse_attention.stacked import check_stacked_args, layer_index

Array = jax.Array


@functools.partial(jax.jit, static_argnames=("block_size", "scale"))
def block_max_scores_xla(q: Array, k_all: Array, layer: Array, kv_heads: Array, head_mask: Array, positions: Array,
                         lo: Array, hi: Array, *, block_size: int, scale: float | None = None) -> Array:
    """`reference.block_max_scores_reference` with one gather of the R KV heads and the input precision."""
    check_block_max_args(q, k_all, layer, kv_heads, head_mask, positions, lo, hi, block_size)
    B, T, Hq, D = q.shape
    L, _, Hkv, N, _ = k_all.shape
    G, nb = Hq // Hkv, N // block_size
    scale = default_scale(D, scale)
    kvh = jnp.clip(kv_heads.astype(jnp.int32), 0, Hkv - 1)
    k = k_all[layer_index(layer, L), :, kvh]  # [R, B, N, D]
    qr = jnp.take(q.reshape(B, T, Hkv, G, D), kvh, axis=2)  # [B, T, R, G, D]
    s = jnp.einsum("btrgd,rbnd->btrgn", qr, k.astype(q.dtype), preferred_element_type=jnp.float32) * scale
    s = jnp.where(head_mask[None, None, :, :, None], s, -jnp.inf).max(axis=(2, 3))  # [B, T, N]
    s = jnp.where(jnp.arange(N)[None, None] <= positions[..., None], s, -jnp.inf)
    s = s.reshape(B, T, nb, block_size).max(axis=-1)
    j = jnp.arange(nb)[None, None]
    return jnp.where((j >= lo[..., None]) & (j < hi[..., None]), s, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("block_size", "scale"))
def sparse_decode_mass_xla(q: Array, k_all: Array, v_all: Array, layer: Array, indices: Array, lengths: Array, *,
                           block_size: int = 1, scale: float | None = None):
    """Gathered decode (`sparse_decode(implementation="xla")`) and the entry mass recomputed from its lse (one
    more gather of the selected K rows)."""
    check_stacked_args(q, k_all, v_all, layer, indices, lengths, block_size)
    B, T, Hq, D = q.shape
    L, _, Hkv, N, _ = k_all.shape
    G, K, bs, nb = Hq // Hkv, indices.shape[-1], block_size, N // block_size
    sc = default_scale(D, scale)
    out, lse = sparse_decode(q, k_all, v_all, indices, lengths, layer=layer, block_size=bs, scale=scale,
                             return_lse=True, implementation="xla")
    kb = k_all.reshape(L, B, Hkv, nb, bs, D)
    bi, hi = jnp.arange(B)[:, None, None, None], jnp.arange(Hkv)[None, :, None, None]
    kg = kb[layer_index(layer, L), bi, hi, jnp.clip(indices, 0, nb - 1)]  # [B, Hkv, T, K, bs, D]
    qg = q.reshape(B, T, Hkv, G, D)
    s = jnp.einsum("bthgd,bhtksd->bhtgks", qg, kg.astype(q.dtype), preferred_element_type=jnp.float32) * sc
    pos = lengths.astype(jnp.int32)[:, None] - T + jnp.arange(T)  # [B, T]
    tok = indices[..., None] * bs + jnp.arange(bs)  # [B, Hkv, T, K, bs]
    valid = (indices[..., None] >= 0) & (tok <= pos[:, None, :, None, None])
    lse_g = lse.reshape(B, T, Hkv, G).transpose(0, 2, 1, 3)[..., None, None]  # [B, Hkv, T, G, 1, 1]
    p = jnp.where(valid[:, :, :, None] & jnp.isfinite(lse_g), jnp.exp(s - lse_g), 0.0)
    return out, p.sum(-1).mean(axis=3)

"""Plain-jnp specification of the block_scores ops (see the package docstring)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.sparse_attention.common import default_scale
from pallas_kernels.sparse_attention.stacked import check_stacked_args, layer_index, select_layer

Array = jax.Array


def check_block_max_args(q: Array, k_all: Array, layer: Array, kv_heads: Array, head_mask: Array,
                         positions: Array, lo: Array, hi: Array, block_size: int) -> None:
    """Validates a `block_max_scores` call (shapes and dtypes; values are masked, not trusted)."""
    if q.ndim != 4:
        raise ValueError(f"q has shape {tuple(q.shape)}: expected [B, T, Hq, D]")
    B, T, Hq, D = q.shape
    if k_all.ndim != 5 or k_all.shape[1] != B or k_all.shape[4] != D:
        raise ValueError(f"k_all has shape {tuple(k_all.shape)}: expected a stacked head-major cache "
                         f"[L, B={B}, Hkv, N, D={D}]")
    Hkv, N = k_all.shape[2], k_all.shape[3]
    if Hkv <= 0 or Hq % Hkv:
        raise ValueError(f"Hq={Hq} query heads is not a multiple of Hkv={Hkv} KV heads")
    if not isinstance(block_size, int) or block_size < 1 or N % block_size:
        raise ValueError(f"block_size={block_size!r}: expected an int >= 1 dividing the cache length N={N}")
    layer = jnp.asarray(layer)
    if layer.ndim != 0 or not jnp.issubdtype(layer.dtype, jnp.integer):
        raise ValueError(f"layer has shape {tuple(layer.shape)} and dtype {layer.dtype}: expected an integer "
                         f"scalar in [0, L={k_all.shape[0]})")
    if kv_heads.ndim != 1 or not jnp.issubdtype(kv_heads.dtype, jnp.integer) or kv_heads.shape[0] < 1:
        raise ValueError(f"kv_heads has shape {tuple(kv_heads.shape)} and dtype {kv_heads.dtype}: expected "
                         f"int32[R] with R >= 1")
    R, G = kv_heads.shape[0], Hq // Hkv
    if tuple(head_mask.shape) != (R, G) or head_mask.dtype != jnp.bool_:
        raise ValueError(f"head_mask has shape {tuple(head_mask.shape)} and dtype {head_mask.dtype}: expected "
                         f"bool[R={R}, G={G}]")
    for name, x in (("positions", positions), ("lo", lo), ("hi", hi)):
        if tuple(x.shape) != (B, T) or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} has shape {tuple(x.shape)} and dtype {x.dtype}: expected int32[B={B}, T={T}]")


def block_max_scores_reference(q: Array, k_all: Array, layer: Array, kv_heads: Array, head_mask: Array,
                               positions: Array, lo: Array, hi: Array, *, block_size: int,
                               scale: float | None = None) -> Array:
    """Block max of the retrieval heads' logits.

    Args:
      q: [B, T, Hq, D] queries. k_all: [L, B, Hkv, N, D] stacked key cache. layer: i32[] (as `k_all[layer]`:
        negatives wrap, then clamp).
      kv_heads: i32[R] KV heads to read (values clamped to [0, Hkv)); head_mask: bool[R, G] which query heads
        of each one's GQA group count (query head kv_heads[r] * G + g).
      positions: i32[B, T] each query's position: keys at or before it are visible.
      lo, hi: i32[B, T]: only blocks lo <= j < hi are scored.
      block_size: tokens per block; scale: logit scale (None: 1/sqrt(D)).

    Returns:
      f32[B, T, N // block_size]: max over (r, g) with head_mask[r, g] and over the visible tokens of block j
      of q[b, t, kv_heads[r] * G + g] . k[kv_heads[r], token] * scale; -inf where the block is outside
      [lo, hi), has no visible token, or no head is masked in.
    """
    check_block_max_args(q, k_all, layer, kv_heads, head_mask, positions, lo, hi, block_size)
    B, T, Hq, D = q.shape
    Hkv, N = k_all.shape[2], k_all.shape[3]
    G, nb = Hq // Hkv, N // block_size
    scale = default_scale(D, scale)
    kvh = jnp.clip(kv_heads.astype(jnp.int32), 0, Hkv - 1)
    k = select_layer(k_all, layer)[:, kvh].astype(jnp.float32)  # [B, R, N, D]
    qr = jnp.take(q.reshape(B, T, Hkv, G, D), kvh, axis=2).astype(jnp.float32)  # [B, T, R, G, D]
    s = jnp.einsum("btrgd,brnd->btrgn", qr, k, precision="highest") * scale
    s = jnp.where(head_mask[None, None, :, :, None], s, -jnp.inf).max(axis=(2, 3))  # [B, T, N]
    s = jnp.where(jnp.arange(N)[None, None] <= positions[..., None], s, -jnp.inf)
    s = s.reshape(B, T, nb, block_size).max(axis=-1)
    j = jnp.arange(nb)[None, None]
    return jnp.where((j >= lo[..., None]) & (j < hi[..., None]), s, -jnp.inf)


def sparse_decode_mass_reference(q: Array, k_all: Array, v_all: Array, layer: Array, indices: Array,
                                 lengths: Array, *, block_size: int = 1, scale: float | None = None):
    """Gathered decode attention and the mass of each index entry, by a dense masked softmax.

    Args:
      q: [B, T, Hq, D]; k_all, v_all: [L, B, Hkv, N, D]; layer: i32[]; indices: int32[B, Hkv, T, K] selected
        blocks (unique, -1 padded); lengths: int32[B] (query t sits at lengths - T + t).

    Returns:
      (out [B, T, Hq, D] in q.dtype, exactly `sparse_decode(..., layer=layer)`;
       mass f32[B, Hkv, T, K]: sum of the softmax weights of the entry's visible tokens, mean over the G query
       heads of the KV head; 0 for -1 entries and for queries with no visible key).
    """
    check_stacked_args(q, k_all, v_all, layer, indices, lengths, block_size)
    B, T, Hq, D = q.shape
    Hkv, N = k_all.shape[2], k_all.shape[3]
    G, K = Hq // Hkv, indices.shape[-1]
    scale = default_scale(D, scale)
    k = select_layer(k_all, layer).astype(jnp.float32)
    v = select_layer(v_all, layer).astype(jnp.float32)
    pos = lengths.astype(jnp.int32)[:, None] - T + jnp.arange(T)  # [B, T]
    tok = indices[..., None] * block_size + jnp.arange(block_size)  # [B, Hkv, T, K, bs]
    ok = (indices[..., None] >= 0) & (tok <= pos[:, None, :, None, None]) & (tok < N)
    tok = jnp.where(ok, tok, 0).reshape(B, Hkv, T, K * block_size)
    ok = ok.reshape(B, Hkv, T, K * block_size)
    bi, hi = jnp.arange(B)[:, None, None, None], jnp.arange(Hkv)[None, :, None, None]
    kg, vg = k[bi, hi, tok], v[bi, hi, tok]  # [B, Hkv, T, K*bs, D]
    qg = q.reshape(B, T, Hkv, G, D).astype(jnp.float32)
    s = jnp.einsum("bthgd,bhtnd->bhtgn", qg, kg, precision="highest") * scale
    s = jnp.where(ok[:, :, :, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(ok[:, :, :, None], jnp.exp(s - m), 0.0)
    den = e.sum(-1, keepdims=True)
    p = jnp.where(den > 0, e / jnp.where(den > 0, den, 1.0), 0.0)  # [B, Hkv, T, G, K*bs]
    out = jnp.einsum("bhtgn,bhtnd->bthgd", p, vg, precision="highest").reshape(B, T, Hq, D)
    mass = p.reshape(B, Hkv, T, G, K, block_size).sum(-1).mean(axis=3)
    return out.astype(q.dtype), mass


def check_heat_args(q: Array, indices: Array, heat: Array, k_all: Array, block_size: int) -> None:
    """Validates the extra arguments of a `sparse_decode_heat` call: one new token, heat [Lh, B, Hkv, N / bs]."""
    B, Hkv, N = k_all.shape[1:4]
    if q.shape[1] != 1:
        raise ValueError(f"q has {q.shape[1]} new tokens: sparse_decode_heat takes one (T = 1)")
    want = (B, Hkv, N // block_size)
    if heat.ndim != 4 or tuple(heat.shape[1:]) != want or heat.dtype != jnp.float32:
        raise ValueError(f"heat has shape {tuple(heat.shape)} and dtype {heat.dtype}: expected f32[Lh, "
                         f"{', '.join(map(str, want))}]")


def sparse_decode_heat_reference(q: Array, k_all: Array, v_all: Array, layer: Array, indices: Array,
                                 lengths: Array, heat: Array, heat_layer: Array | None = None, *, block_size: int = 1,
                                 scale: float | None = None):
    """One decode token's gathered decode over k_all[layer] and its entry mass added into the stacked heat's row
    heat_layer (None: `layer`): (out [B, 1, Hq, D], heat f32[Lh, B, Hkv, nb] with heat[heat_layer, b, h,
    indices[b, h, 0, j]] += mass[b, h, 0, j] for the valid entries (unique per row))."""
    check_heat_args(q, indices, heat, k_all, block_size)
    out, mass = sparse_decode_mass_reference(q, k_all, v_all, layer, indices, lengths, block_size=block_size,
                                             scale=scale)
    idx = indices[:, :, 0]
    B, Hkv, K = idx.shape
    hit = (idx[..., None] == jnp.arange(heat.shape[-1])) & (idx[..., None] >= 0)  # [B, Hkv, K, nb]
    add = jnp.sum(jnp.where(hit, mass[:, :, 0, :, None], 0.0), axis=2)
    row = layer_index(layer if heat_layer is None else heat_layer, heat.shape[0])
    return out, heat.at[row].add(add)

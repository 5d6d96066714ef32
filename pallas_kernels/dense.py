"""Dense attention through `jax.nn.dot_product_attention` (cuDNN on GPU, XLA elsewhere).

Two entry points, one per phase, both with the library's layouts:

  dense_prefill(q: [B, T, Hq, D], k, v: [B, T, Hkv, D], window=None) -> [B, T, Hq, D]      causal, GQA
  dense_decode(q: [B, T, Hq, D], k, v: [B, Hkv, N, D], lengths: i32[B], window=None) -> [B, T, Hq, D]

On the CPU, causal prefill runs as `tiled_causal_attention` (query tiles that read only the keys up to
their last row, in jnp): about 3x less CPU time than XLA's full masked [T, T] attention at T = 2K (B 2, 9 query
heads over 3 KV heads, head_dim 64: 0.33 against 1.09 CPU-s per layer), the same values to f32 rounding.

Both take an optional sliding window (the models' `sliding_window`): query i sees key j iff i - window < j <= i
(transformers' rule). Prefill takes it static and runs `local_attention` (O(T * window)); decode takes it as
data (an i32 scalar, 0 = full attention, so one compiled layer serves windowed and full layers) and masks
positions in XLA.

Decode reads the head-major cache without a transpose: a GQA group's G query heads (times the T new
tokens) become the query sequence of a single-head attention whose batch is B * Hkv, so the cache is only
reshaped ([B, Hkv, N, D] -> [B * Hkv, N, 1, D]), never transposed, and each KV head is read once; the values of
rows past the lengths (garbage, maybe NaN) are zeroed on the way, since the attention weights them by 0.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp

from pallas_kernels.local_attention import local_attention
from pallas_kernels.sharding import active_mesh, dims, per_shard

Array = jax.Array


CAUSAL_TILE = 256  # query rows per tile of `tiled_causal_attention` (at most MAX_CAUSAL_TILES tiles)
MAX_CAUSAL_TILES = 32  # bounds the unrolled tiles (compile time) at long prompts: the tile grows instead


def _implementation(q: Array) -> str | None:
    # cuDNN's fused kernels need bf16/f16 on a GPU; everything else takes the XLA path.
    if jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    return "xla"


def causal_tile(T: int) -> int:
    """Query rows per tile of `tiled_causal_attention` for a prompt of T tokens: CAUSAL_TILE, or more (a multiple
    of 128) when T would need over MAX_CAUSAL_TILES tiles."""
    return max(CAUSAL_TILE, -(-T // (MAX_CAUSAL_TILES * 128)) * 128)


def tiled_causal_attention(q: Array, k: Array, v: Array, *, tile: int | None = None) -> Array:
    """Causal GQA attention in query tiles, each against only the keys up to its last row (plain jnp).

    Tile i (rows s..e-1) computes its logits against keys 0..e-1 and masks the ones after each row, so the upper
    triangle of the [T, T] map is skipped tile by tile and a tile's logits ([B, Hkv, G, tile, e] f32) stay small;
    the G query heads of a KV head share its keys without a copy. The values equal
    `jax.nn.dot_product_attention(q, k, v, is_causal=True)` up to f32 rounding (the sums run in another order).

    Args:
      q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] (Hq a multiple of Hkv).
      tile: query rows per tile (static; default `causal_tile(T)`).
    Returns:
      [B, T, Hq, D] in q's dtype; logits and softmax in f32 (at least).
    """
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"q has {Hq} heads, not a multiple of the {Hkv} KV heads")
    tile = causal_tile(T) if tile is None else operator.index(tile)
    if tile < 1:
        raise ValueError(f"tile={tile}: expected >= 1 query rows")
    G = Hq // Hkv
    acc = jnp.promote_types(q.dtype, jnp.float32)
    qh = (q.reshape(B, T, Hkv, G, D).transpose(0, 2, 3, 1, 4) * (D ** -0.5)).astype(q.dtype)  # [B, Hkv, G, T, D]
    kh = k.transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
    vh = v.transpose(0, 2, 1, 3)
    outs = []
    for s in range(0, T, tile):
        e = min(s + tile, T)
        logits = jnp.einsum("bhgqd,bhkd->bhgqk", qh[:, :, :, s:e], kh[:, :, :e], preferred_element_type=acc)
        causal = jnp.arange(s, e)[:, None] >= jnp.arange(e)[None, :]  # [e - s, e]
        logits = jnp.where(causal, logits, -jnp.inf)
        p = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
        out = jnp.einsum("bhgqk,bhkd->bhgqd", p, vh[:, :, :e].astype(acc)) / jnp.sum(p, axis=-1, keepdims=True)
        outs.append(out)
    out = jnp.concatenate(outs, axis=3)  # [B, Hkv, G, T, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, Hq, D).astype(q.dtype)


def dense_prefill(q: Array, k: Array, v: Array, *, window: int | None = None,
                  implementation: str | None = None) -> Array:
    """Causal attention over a right-padded prompt (padding rows produce values nobody reads).

    Args:
      q: [B, T, Hq, D]; k, v: [B, T, Hkv, D].
      window: None (full causal attention) or a static sliding window >= 1: query i sees keys i - window < j <= i
        (`local_attention`, whose backend choice `implementation` then names).
      implementation: None picks by backend (CPU: `tiled_causal_attention`; GPU bf16/f16: cuDNN; else XLA), or
        'xla' / 'cudnn' for `jax.nn.dot_product_attention`'s.
    Returns:
      [B, T, Hq, D] in q's dtype. Under a mesh (`pallas_kernels.sharding`), per shard: rows over data, heads
      over model.
    """
    if active_mesh() is not None:
        s = dims(4, 0, 2)
        return per_shard(lambda q, k, v: dense_prefill(q, k, v, window=window, implementation=implementation),
                         [q, k, v], [s, s, s], s)
    if window is not None:
        return local_attention(q, k, v, window=window, implementation=implementation)
    if implementation is None and jax.default_backend() == "cpu":
        return tiled_causal_attention(q, k, v)
    impl = implementation or _implementation(q)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)


def dense_decode(q: Array, k: Array, v: Array, lengths: Array, *, window: Array | int | None = None,
                 implementation: str | None = None) -> Array:
    """Attention of the T newest tokens over a head-major cache.

    Args:
      q: [B, T, Hq, D] queries of the tokens at positions lengths - T .. lengths - 1.
      k, v: [B, Hkv, N, D] cache (the new tokens already written).
      lengths: i32[B] valid tokens per row.
      window: None, or i32[] (traced or not): the query at position p sees keys p - window < j <= p, with 0
        meaning full attention. Windowed decode runs on XLA with a position mask.
    Returns:
      [B, T, Hq, D] in q's dtype. Under a mesh (`pallas_kernels.sharding`), per shard: rows over data, heads
      over model.
    """
    if active_mesh() is not None:
        qs, kv = dims(4, 0, 2), dims(4, 0, 1)
        traced = isinstance(window, jax.Array)
        args = [q, k, v, lengths] + ([window] if traced else [])

        def local(q, k, v, lengths, *rest):
            return dense_decode(q, k, v, lengths, window=rest[0] if traced else window,
                                implementation=implementation)
        return per_shard(local, args, [qs, kv, kv, dims(1, 0)] + ([()] if traced else []), qs)
    B, T, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    # [B, T, Hkv, G, D] -> [B * Hkv, T * G, 1, D]: query index = t * G + g.
    qg = q.reshape(B, T, Hkv, G, D).transpose(0, 2, 1, 3, 4).reshape(B * Hkv, T * G, 1, D)
    kg = k.reshape(B * Hkv, N, 1, D)
    vg = v.reshape(B * Hkv, N, 1, D)
    kv_len = jnp.repeat(lengths.astype(jnp.int32), Hkv)
    # Rows past the lengths are garbage (maybe NaN) that no query sees; dot_product_attention weights them by 0,
    # and 0 * NaN is NaN, so their values are zeroed (XLA fuses this into the copy or the matmul that reads V).
    vg = jnp.where((jnp.arange(N)[None, :] < kv_len[:, None])[:, :, None, None], vg, jnp.zeros((), vg.dtype))
    if T == 1 and window is None:
        impl = implementation or _implementation(q)
        out = jax.nn.dot_product_attention(qg, kg, vg, key_value_seq_lengths=kv_len, implementation=impl)
        seen = jnp.broadcast_to((kv_len > 0)[:, None], (B * Hkv, G))
    else:
        # Query t sits at position p = lengths - T + t and sees keys lo <= j <= p (causal among the new tokens).
        t = jnp.arange(T * G) // G
        pos = kv_len[:, None] - T + t[None]  # [B*Hkv, T*G]
        keys = jnp.arange(N)[None, None, :]
        mask = keys <= pos[:, :, None]
        if window is not None:
            if not isinstance(window, jax.Array):
                window = operator.index(window)
                if window < 0:
                    raise ValueError(f"window={window}: expected >= 0 tokens (0 = full attention)")
            window = jnp.asarray(window, jnp.int32)
            lo = jnp.where(window > 0, pos - window + 1, 0)
            mask = mask & (keys >= lo[:, :, None])
        out = jax.nn.dot_product_attention(qg, kg, vg, mask=mask[:, None], implementation="xla")
        seen = mask.any(axis=-1)  # [B*Hkv, T*G]
    # A query that sees no key (a row of length 0; with T > 1, a row shorter than T) attends to nothing: zeros, as
    # the reference and the kernels give (dot_product_attention would average every value).
    out = jnp.where(seen[:, :, None, None], out, jnp.zeros((), out.dtype))
    return out.reshape(B, Hkv, T, G, D).transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, D)

"""Plain-jnp specification of dense decode attention over one layer of the stacked KV cache.

  dense_decode_stacked_reference(q: [B, T, Hq, D], k_all, v_all: [L, B, Hkv, N, D], layer: i32[],
                                 lengths: i32[B], return_lse=False) -> [B, T, Hq, D] (, lse f32[B, T, Hq])

It equals `pallas_kernels.dense.dense_decode(q, k_all[layer], v_all[layer], lengths)`: query t of row b sits
at position lengths[b] - T + t and attends to keys 0 .. that position (causal among the T new tokens), keys
at or past N never; query head h reads KV head h // G (G = Hq // Hkv). Softmax in f32; a query with no
visible key (position < 0) outputs zeros. `layer` follows jnp indexing of a traced index (negatives count from
the end, then clamp to [0, L - 1], as XLA's dynamic slice), so no value of it reads out of bounds.
With `return_lse` it also returns each query row's log-sum-exp of its scaled visible logits (-inf for a row with
no visible key), from which `decode_probs_reference` (and `pallas_kernels.head_probs`, whose specification it
is) rebuilds the post-softmax weights.

  dense_decode_record_reference(q: [B, 1, Hq, D], k_all, v_all, layer, lengths, record: f32[B, Hq, Lw, N],
                                bmax: f32[B, Hq, Lw, NB], record_layer: i32[], block) -> (out, lse, record, bmax)

is one new token per row that also writes each query head's scaled logits into row `record_layer` of a stacked
record buffer (the keys it sees; the rest of the row kept) and their maxima over blocks of `block` keys
(`block_max`) into bmax: what the STS draft's recording step needs to choose its top keys without an N-wide pass.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.layers import check_layer, layer_index, select_layer  # noqa: F401  (re-exported)
from pallas_kernels.sparse_attention.common import check_floating
from pallas_kernels.sparse_attention.common import default_scale  # noqa: F401  (re-exported)

Array = jax.Array
_HIGHEST = jax.lax.Precision.HIGHEST


def check_args(q: Array, k_all: Array, v_all: Array, layer: Array, lengths: Array) -> None:
    """Validates shapes and dtypes (at trace time); raises ValueError naming the bad value."""
    if q.ndim != 4:
        raise ValueError(f"q has shape {tuple(q.shape)}: expected [B, T, Hq, D]")
    B, T, Hq, D = q.shape
    if k_all.ndim != 5 or k_all.shape[1] != B or k_all.shape[4] != D:
        raise ValueError(f"k_all has shape {tuple(k_all.shape)}: expected a stacked head-major cache "
                         f"[L, B={B}, Hkv, N, D={D}]")
    if v_all.shape != k_all.shape:
        raise ValueError(f"v_all has shape {tuple(v_all.shape)}: expected the shape of k_all, {tuple(k_all.shape)}")
    check_floating(q=q, k_all=k_all, v_all=v_all)
    Hkv, N = k_all.shape[2], k_all.shape[3]
    if Hkv <= 0 or Hq % Hkv:
        raise ValueError(f"Hq={Hq} query heads is not a multiple of Hkv={Hkv} KV heads (GQA needs Hq % Hkv == 0)")
    if T < 1 or T > N:
        raise ValueError(f"T={T} new tokens: expected 1 <= T <= N={N}")
    check_layer(layer, k_all.shape[0])
    if tuple(lengths.shape) != (B,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths has shape {tuple(lengths.shape)} and dtype {lengths.dtype}: expected "
                         f"int32[B={B}]")


def check_record_args(q: Array, k_all: Array, record: Array, bmax: Array, block: int,
                      block_k: int | None = None) -> None:
    """Validates `dense_decode_record`'s extra arguments (at trace time); raises ValueError naming the bad value."""
    B, T, Hq, _ = q.shape
    N = k_all.shape[3]
    if T != 1:
        raise ValueError(f"q has T={T} new tokens: the record writes one query's logits per row (T = 1)")
    if record.ndim != 4 or record.shape[:2] != (B, Hq) or record.shape[3] != N or record.dtype != jnp.float32:
        raise ValueError(f"record has shape {tuple(record.shape)} and dtype {record.dtype}: expected "
                         f"f32[B={B}, Hq={Hq}, Lw, N={N}]")
    if block < 1 or block & (block - 1) or (block_k is not None and block > block_k):
        raise ValueError(f"block={block}: expected a power of two"
                         + (f" <= the kernel's block_k={block_k}" if block_k is not None else ""))
    want = record.shape[:3] + (-(-N // block),)
    if tuple(bmax.shape) != want or bmax.dtype != jnp.float32:
        raise ValueError(f"bmax has shape {tuple(bmax.shape)} and dtype {bmax.dtype}: expected f32{list(want)} "
                         f"(the record's [B, Hq, Lw] and ceil(N / block={block}) blocks)")


def select_layer(x_all: Array, layer: Array) -> Array:
    """x_all[layer] for x_all: [L, ...] (a dynamic slice: XLA copies it when a custom call consumes it)."""
    return jax.lax.dynamic_index_in_dim(x_all, layer_index(layer, x_all.shape[0]), 0, keepdims=False)


def _scaled_logits(q: Array, k: Array, lengths: Array, scale: float | None) -> tuple[Array, Array]:
    """(logits f32[B, Hkv, G, T, N] of q: [B, T, Hq, D] . k: [B, Hkv, N, D] * scale (query head h = kv * G + g),
    visible bool[B, 1, 1, T, N]: query t sees keys <= lengths - T + t, as the decode)."""
    B, T, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    qf = q.astype(jnp.float32).reshape(B, T, Hkv, Hq // Hkv, D)
    logits = jnp.einsum("bthgd,bhnd->bhgtn", qf, k.astype(jnp.float32), precision=_HIGHEST) * default_scale(D, scale)
    pos = lengths.astype(jnp.int32)[:, None] - T + jnp.arange(T, dtype=jnp.int32)  # [B, T]
    valid = jnp.arange(N)[None, None, :] <= pos[:, :, None]  # [B, T, N]
    return logits, valid[:, None, None]


def decode_lse(q: Array, k: Array, lengths: Array, scale: float | None = None) -> Array:
    """f32[B, T, Hq]: log-sum-exp over the visible keys of q: [B, T, Hq, D] . k: [B, Hkv, N, D] * scale (query t
    sees keys <= lengths - T + t, as the decode); -inf for a row with no visible key."""
    B, T, Hq, _ = q.shape
    logits, valid = _scaled_logits(q, k, lengths, scale)
    lse = jax.nn.logsumexp(jnp.where(valid, logits, -jnp.inf), axis=-1)  # [B, Hkv, G, T]
    return lse.transpose(0, 3, 1, 2).reshape(B, T, Hq)


@functools.partial(jax.jit, static_argnames=("scale", "return_lse"))
def dense_decode_stacked_reference(q: Array, k_all: Array, v_all: Array, layer: Array, lengths: Array, *,
                                   scale: float | None = None, return_lse: bool = False):
    """Dense decode attention of the T newest tokens over layer `layer` of a stacked cache.

    Args:
      q: [B, T, Hq, D] (bf16/f16/f32) queries at positions lengths - T .. lengths - 1.
      k_all: [L, B, Hkv, N, D] stacked head-major key cache (the new tokens already written).
      v_all: [L, B, Hkv, N, D] stacked value cache.
      layer: i32[] layer to read.
      lengths: i32[B] valid tokens per row after the write.
      scale: softmax scale (None: 1/sqrt(D)).
      return_lse: also return the log-sum-exp of each query row (`decode_lse`).

    Returns:
      [B, T, Hq, D] in q.dtype; with return_lse, (that, lse f32[B, T, Hq]).
    """
    check_args(q, k_all, v_all, layer, lengths)
    B, T, Hq, D = q.shape
    v = select_layer(v_all, layer).astype(jnp.float32)
    logits, valid = _scaled_logits(q, select_layer(k_all, layer), lengths, scale)  # [B, Hkv, G, T, N]
    logits = jnp.where(valid, logits, -jnp.inf)
    v = jnp.where(jnp.any(valid, axis=(2, 3))[..., None], v, 0.0)  # rows no query sees (maybe NaN): zeroed
    m = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    l = jnp.sum(e, axis=-1, keepdims=True)
    p = jnp.where(l > 0, e / jnp.where(l > 0, l, 1.0), 0.0)
    out = jnp.einsum("bhgtn,bhnd->bthgd", p, v, precision=_HIGHEST).reshape(B, T, Hq, D).astype(q.dtype)
    if not return_lse:
        return out
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)[..., 0]  # [B, Hkv, G, T]
    return out, lse.transpose(0, 3, 1, 2).reshape(B, T, Hq)


@functools.partial(jax.jit, static_argnames=("scale",))
def decode_probs_reference(q: Array, k_all: Array, layer: Array, lengths: Array, lse: Array, *,
                           scale: float | None = None) -> Array:
    """Post-softmax weights of the T newest queries over layer `layer` of a stacked cache, summed over T:
    p[b, h, n] = sum over t of exp(q[b, t, h] . k[b, h // G, n] * scale - lse[b, t, h]) at the keys query t sees
    (n <= lengths[b] - T + t), 0 elsewhere; lse as `dense_decode_stacked_reference(..., return_lse=True)` gives
    it. q: [B, T, Hq, D], k_all: [L, B, Hkv, N, D], lengths: i32[B], lse: f32[B, T, Hq] -> f32[B, Hq, N].
    (The specification of `dense_decode_stacked(..., return_probs=True)` and of `pallas_kernels.head_probs`.)"""
    B, T, Hq, _ = q.shape
    Hkv, N = k_all.shape[2], k_all.shape[3]
    logits, valid = _scaled_logits(q, select_layer(k_all, layer), lengths, scale)  # [B, Hkv, G, T, N]
    row_lse = lse.astype(jnp.float32).reshape(B, T, Hkv, Hq // Hkv).transpose(0, 2, 3, 1)[..., None]
    p = jnp.where(valid, jnp.exp(logits - row_lse), 0.0)
    return p.sum(axis=3).reshape(B, Hq, N)


def block_max(x: Array, lengths: Array, block: int) -> Array:
    """Maxima of x f32[B, H, N] over blocks of `block` keys, keys >= lengths[b] left out: f32[B, H, ceil(N / block)]
    (block j: keys j * block ..), -inf for a block without a key below lengths."""
    B, H, N = x.shape
    nb = -(-N // block)
    x = jnp.where(jnp.arange(N)[None, None, :] < lengths[:, None, None], x, -jnp.inf)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, nb * block - N)), constant_values=-jnp.inf)
    return x.reshape(B, H, nb, block).max(axis=-1)


def write_record(q: Array, k: Array, lengths: Array, record: Array, bmax: Array, record_layer: Array, block: int,
                 scale: float | None = None) -> tuple[Array, Array]:
    """The record part of `dense_decode_record_reference` for one layer's keys k: [B, Hkv, N, D]: (record with row
    `record_layer` holding the scaled logits of the keys each query sees, bmax with that row's block maxima)."""
    B, _, Hq, _ = q.shape
    N = k.shape[2]
    logits, valid = _scaled_logits(q, k, lengths, scale)  # [B, Hkv, G, 1, N]
    logits, valid = logits.reshape(B, Hq, N), valid.reshape(B, 1, N)
    row = layer_index(record_layer, record.shape[2])
    old = jax.lax.dynamic_index_in_dim(record, row, axis=2, keepdims=False)
    record = jax.lax.dynamic_update_index_in_dim(record, jnp.where(valid, logits, old), row, axis=2)
    return record, jax.lax.dynamic_update_index_in_dim(bmax, block_max(logits, lengths, block), row, axis=2)


@functools.partial(jax.jit, static_argnames=("block", "scale"))
def dense_decode_record_reference(q: Array, k_all: Array, v_all: Array, layer: Array, lengths: Array,
                                  record: Array, bmax: Array, record_layer: Array, *, block: int = 16,
                                  scale: float | None = None):
    """Dense decode of one new token per row, its query heads' scaled logits and their block maxima written into
    stacked record buffers.

    Args:
      q: [B, 1, Hq, D]; k_all, v_all: [L, B, Hkv, N, D]; layer: i32[]; lengths: i32[B] (after the write);
      record: f32[B, Hq, Lw, N]; bmax: f32[B, Hq, Lw, ceil(N / block)]; record_layer: i32[] their layer to write;
      block: keys per block.

    Returns:
      (out [B, 1, Hq, D] in q.dtype, as `dense_decode_stacked_reference`; lse f32[B, Hq]; record with
      record[b, h, record_layer, n] = q[b, 0, h] . k_all[layer, b, h // G, n] * scale for n < lengths[b] (the
      other entries as they were); bmax with bmax[b, h, record_layer] = `block_max` of those logits).
      exp(logit - lse) at the visible keys is `decode_probs_reference`'s weight.
    """
    check_args(q, k_all, v_all, layer, lengths)
    check_record_args(q, k_all, record, bmax, block)
    out, lse = dense_decode_stacked_reference(q, k_all, v_all, layer, lengths, scale=scale, return_lse=True)
    record, bmax = write_record(q, select_layer(k_all, layer), lengths, record, bmax, record_layer, block, scale)
    return out, lse[:, 0], record, bmax

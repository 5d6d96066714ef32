"""Token compression: each head keeps a subset of the tokens, attends in the compressed space, writes back.

A prefill method that keeps a per-head token subset (TSA's coverage selection, or any other rule) gathers each
head's kept Q, K, V rows into a compressed sequence, runs causal dense attention there and scatters the outputs
back to their positions (zeros, or the rows of a fill attention, elsewhere). Kept positions keep their order, so
causality in the compressed space is the original causality. The kept count is data-dependent while shapes are
static: the compressed length is a static capacity C, chosen among a few buckets (`capacities`) by `lax.switch`
(`attend_at_capacity`). Each head's kept tokens fill the first slots of its compressed row and empty slots come
after them, so under the causal mask no kept query ever sees an empty slot.

Under a mesh (`pallas_kernels.sharding`) the gathers run per shard (rows over data, heads over model: a head's
kept rows come from its own Q, K, V); XLA's partitioner would otherwise all-gather Q, K and V for them.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallas_kernels import sharding as shard
from pallas_kernels.dense import dense_prefill

Array = jax.Array
I32 = jnp.int32
CAPACITY_ALIGN = 128


def capacities(T: int, buckets: int, exact: int | None = None) -> tuple[int, ...]:
    """The static compressed capacities for a length-T prefill: ceil(i * T / buckets) rounded up to a multiple
    of 128 and capped at T, i = 1..buckets (ascending, distinct, the last one T); `exact` (a count known before
    the prefill, e.g. TSA's fixed kept share of T) adds that count rounded up the same way."""
    align = lambda n: min(T, -(-n // CAPACITY_ALIGN) * CAPACITY_ALIGN)  # noqa: E731
    caps = {align(math.ceil(i * T / buckets)) for i in range(1, buckets + 1)}
    if exact is not None:
        caps.add(align(max(int(exact), 1)))
    return tuple(sorted(caps | {T}))


def attend_at_capacity(largest: Array, caps: tuple[int, ...], attend: Callable[[int], Any],
                       dense: Callable[[], Any], nothing_dropped: Array) -> Any:
    """`attend(C)` at the smallest capacity C of `caps` (ascending, static) holding `largest` (i32[], the batch's
    largest kept count), or `dense()` when nothing_dropped (bool[]): one `lax.switch` over 1 + len(caps) branches
    (each returning the same pytree: an output, or TSA's output and its inner method's state)."""
    which = jnp.searchsorted(jnp.asarray(caps, I32), largest).astype(I32) + 1
    which = jnp.where(nothing_dropped, 0, jnp.minimum(which, len(caps)))
    return jax.lax.switch(which, [dense] + [lambda c=c: attend(c) for c in caps])


@struct.dataclass
class Selection:
    """Each selecting head's kept tokens, both ways round.

    indices: i32[B, H, C] kept positions ascending, then -1 (C: the static capacity).
    slot: i32[B, H, T] the compressed slot of each position, -1 where it is not kept.
    (H = Hq for "query_head" selection, Hkv for "kv_head" and "kv_union".)
    """

    indices: Array
    slot: Array

    @property
    def keep(self) -> Array:
        return self.slot >= 0



def selection_from_keep(keep: Array, capacity: int) -> Selection:
    """The Selection of a keep mask bool[B, H, T] (each row's kept positions ascending in its first slots)."""
    per = shard.dims(3, 0, 1)
    indices, slot = shard.per_shard(lambda keep: _selection_from_keep(keep, capacity), [keep], [per], (per, per))
    return Selection(indices=indices, slot=slot)


def _selection_from_keep(keep: Array, capacity: int) -> tuple[Array, Array]:
    B, H, T = keep.shape
    slot = jnp.where(keep, jnp.cumsum(keep, axis=-1, dtype=I32) - 1, -1)
    b = jnp.arange(B)[:, None, None]
    h = jnp.arange(H)[None, :, None]
    indices = jnp.full((B, H, capacity), -1, I32).at[b, h, jnp.where(keep, slot, capacity)].set(
        jnp.broadcast_to(jnp.arange(T, dtype=I32), (B, H, T)), mode="drop")
    return indices, slot


def union_selection(sel: Selection, num_kv_heads: int, capacity: int) -> Selection:
    """"kv_union": the union of each GQA group's query-head selections, one Selection per KV head."""
    B, Hq, T = sel.slot.shape
    keep = sel.keep.reshape(B, num_kv_heads, Hq // num_kv_heads, T).any(axis=2)
    return selection_from_keep(keep, capacity)


def compress(q: Array, k: Array, v: Array, sel: Selection):
    """Gathers the kept rows into compressed sequences.

    Args:
      q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]; sel: a Selection over Hq ("query_head") or Hkv ("kv_head") heads.

    Returns:
      (qc: [B, C, Hq, D], kc, vc: [B, C, Hq, D] per query head, or [B, C, Hkv, D] per KV head). Empty slots
      hold position 0's rows (they come after every kept slot, so causally no kept query sees them).
    """
    rows = shard.dims(4, 0, 2)
    return shard.per_shard(_compress, [q, k, v, sel.indices], [rows, rows, rows, shard.dims(3, 0, 1)],
                           (rows, rows, rows))


def _compress(q: Array, k: Array, v: Array, indices: Array):
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    H = indices.shape[1]
    idx = jnp.swapaxes(jnp.where(indices >= 0, indices, 0), 1, 2)  # [B, C, H]
    b = jnp.arange(B)[:, None, None]
    hq = jnp.arange(Hq, dtype=I32)[None, None, :]
    if H == Hq:
        qc = q[b, idx, hq]
        kc, vc = k[b, idx, hq // G], v[b, idx, hq // G]
    elif H == Hkv:
        qc = q[b, idx[:, :, hq[0, 0] // G], hq]
        hk = jnp.arange(Hkv, dtype=I32)[None, None, :]
        kc, vc = k[b, idx, hk], v[b, idx, hk]
    else:
        raise ValueError(f"selection has {H} heads: expected Hq={Hq} or Hkv={Hkv}")
    return qc, kc, vc


def decompress(out_c: Array, sel: Selection, fill_rows: Array | None = None) -> Array:
    """Writes compressed outputs back to their positions: out_c [B, C, Hq, D] -> [B, T, Hq, D], zeros (or the rows
    of `fill_rows`: [B, T, Hq, D]) on the positions a head did not keep (a gather by each position's slot, which
    equals scattering into zeros or into `fill_rows`)."""
    if fill_rows is not None and fill_rows.shape != (out_c.shape[0], sel.slot.shape[2]) + out_c.shape[2:]:
        raise ValueError(f"fill_rows has shape {fill_rows.shape}: expected "
                         f"{(out_c.shape[0], sel.slot.shape[2]) + out_c.shape[2:]} ([B, T, Hq, D])")
    rows = shard.dims(4, 0, 2)
    args = [out_c, sel.slot] + ([] if fill_rows is None else [fill_rows])
    return shard.per_shard(_decompress, args, [rows, shard.dims(3, 0, 1)] + [rows] * (len(args) - 2), rows)


def _decompress(out_c: Array, slot: Array, fill_rows: Array | None = None) -> Array:
    B, C, Hq, D = out_c.shape
    H = slot.shape[1]
    slot = jnp.swapaxes(slot, 1, 2)  # [B, T, H]
    if H != Hq:
        slot = jnp.repeat(slot, Hq // H, axis=2)
    b = jnp.arange(B)[:, None, None]
    hq = jnp.arange(Hq, dtype=I32)[None, None, :]
    out = out_c[b, jnp.maximum(slot, 0), hq]
    if fill_rows is None:
        return jnp.where((slot >= 0)[..., None], out, jnp.zeros((), out.dtype))
    return jnp.where((slot >= 0)[..., None], out, fill_rows.astype(out.dtype))


def attend_compressed(q: Array, k: Array, v: Array, sel: Selection,
                      attend: Callable[[Array, Array, Array], Array] = dense_prefill,
                      fill_rows: Array | None = None) -> Array:
    """Compress, causal attention in the compressed space, decompress (dropped positions: zeros or the rows of
    `fill_rows`): [B, T, Hq, D]."""
    return decompress(attend(*compress(q, k, v, sel)), sel, fill_rows)


def masked_reference_mask(sel: Selection, num_query_heads: int) -> Array:
    """bool[B, Hq, T, T]: query i attends key j iff the head kept both and j <= i (the test reference)."""
    keep = sel.keep
    if keep.shape[1] != num_query_heads:
        keep = jnp.repeat(keep, num_query_heads // keep.shape[1], axis=1)
    T = keep.shape[-1]
    causal = jnp.tril(jnp.ones((T, T), bool))
    return keep[..., :, None] & keep[..., None, :] & causal


def causal_map_sparsity(kept, lengths) -> np.ndarray:
    """f64[...]: the fraction 1 - k (k + 1) / (n (n + 1)) of a causal attention map of n tokens that keeping k of
    them skips (kept, lengths: int arrays that broadcast; n < 1 counts as 1)."""
    k = np.asarray(kept, np.float64)
    n = np.maximum(np.asarray(lengths, np.float64), 1.0)
    return 1.0 - k * (k + 1.0) / (n * (n + 1.0))


def attention_map_sparsity(kept: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """f64[L]: per layer, the fraction of the causal attention map not computed, averaged over rows:
    1 - k (k + 1) / (n (n + 1)) for k kept of n tokens (kept: i32[L, B], lengths: i32[B])."""
    return np.mean(causal_map_sparsity(kept, np.asarray(lengths)[None]), axis=1)


def kept_summary(kept: np.ndarray, lengths: np.ndarray) -> dict:
    """What a compressed prefill kept, for kept: i32[L, B] tokens per layer and row of lengths: i32[B]:
    {"kept": kept, "kept_fraction": f64[L], "attention_map_sparsity": f64[L]} (means over rows)."""
    n = np.asarray(lengths)
    return {"kept": kept, "kept_fraction": np.mean(kept / np.maximum(n, 1)[None], axis=1),
            "attention_map_sparsity": attention_map_sparsity(kept, n)}

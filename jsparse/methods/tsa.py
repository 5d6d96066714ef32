"""Token Sparse Attention (TSA, Jo et al. 2026): per-head token compression for prefill.

In a sparse layer, for q: [B, T, Hq, D] and k, v: [B, T, Hkv, D] after RoPE, with n = lengths[b] valid tokens
per right-padded row, window W and prefix P = max(n - W, 0):

  1. Scores: `tsa_scores(q, k, window=W, pool_kernel)` -> f32[B, Hq, T], the mean softmax probability the last
     W queries give each key, average-pooled over keys (pallas_kernels/tsa_scoring).
  2. Dynamic token coverage (tau): over the prefix keys j < P, sum the scores over heads and normalise to a
     distribution p_j; sort ascending and drop the tail whose cumulative mass stays below tau
     (n_drop = #{i : cumsum(sorted p)_i < tau}); keep K = max(P - n_drop, min_tokens) prefix tokens. Every head
     keeps the same K, each by its own top-K over its own scores (ties: the lower position first); the last W
     positions (the window) are always kept; kept positions are ascending. Rows with n <= min_tokens + W stay
     dense, and so does tau = 0 (nothing has cumulative mass < 0).
  3. Compress, attend, decompress: gather each head's kept Q, K, V rows, run causal dense attention over the
     compressed sequence (cuDNN on GPU via `pallas_kernels.dense.dense_prefill`), and write each head's outputs
     back to their positions, zeros elsewhere; the model's o_proj follows (outside the method). The compressed
     positions keep their original order, so causality in the compressed space is the original causality:
     a kept query at position i sees exactly the kept keys j <= i of its head. (`fill="local"`, not in the
     paper: the positions a head dropped get a sliding-window attention instead of zeros; see below.)
  4. The KV cache keeps the full K and V (the model writes it); decode is dense unless an inner method is
     composed (`tsa+kascade`: Kascade's decode).

Which layers are sparse comes from the drift calibration (`jsparse calibrate tsa`, tsa_calibration.py): an
artifact of kind "tsa" holding `sparse_layers`. Without an artifact every layer but layer 0 is sparse (layer 0
is dense in every method of this library; the official code's uncalibrated default is the second half of the
layers, which `sparse_layers=tuple(range(L // 2, L))` reproduces).

GQA (`selection`):
  "query_head" (default, the paper): each query head h selects on its own scores; its K/V rows are gathered from
     KV head h // G at h's positions, so the compressed K/V are per query head ([B, C, Hq, D]) and the compressed
     attention is multi-head (G times the K/V gather traffic of the KV heads, the attention FLOPs unchanged).
  "kv_head": the scores are summed over each GQA group and every query head of a group shares its KV head's
     selection; the compressed attention stays GQA ([B, C, Hkv, D] K/V). Used by compositions whose inner method
     works per KV head (Kascade's head maps and group-pooled top-k).
  "kv_union" (not in the paper): every query head selects as in "query_head" (same count, its own top-k), and a
     KV head keeps the union of its group's selections, so a token one head of the group needs stays for all of
     them; the compressed attention stays GQA and a head keeps at least the paper's count. On the bundled
     SmolLM2 (GQA 9/3) "query_head" loses passkeys placed early in the prompt (a head that drops the needle gives
     its tokens no output in that layer); see eval/results/h100/tsa_smollm2_4k_16*/NOTES.md for the numbers.

What a head's dropped positions get (`fill`):
  "local" (the default; not in the paper): causal sliding-window attention over the full K/V, the last `local_window` keys
     (default 64) plus the first `local_sinks` tokens (default 4), from `pallas_kernels.local_attention` (a
     Triton kernel on GPU, a Mosaic kernel on TPU up to a window of 129 and 128 sinks, blocked jnp otherwise).
     It runs for every row, O(T * (local_window + local_sinks)) work: 1.8 ms against a 106 ms compressed
     attention at 128K on an H100 (Llama-3.1-8B heads). On the bundled SmolLM2 the paper's zeros lose passkeys
     placed early in the prompt and add 2.6-4% perplexity at tau 0.005: a dropped token's hidden state misses
     the head's contribution in every sparse layer, and the needle's digits lose the context that marks them as
     the key. The local fill keeps each token's neighbourhood, dense's passkey accuracy and perplexity within 1%
     (eval/results/h100/tsa_fill_local_4k_16/NOTES.md has the numbers), so it is the default.
  "zeros" (the paper's behaviour, `fill="zeros"`): no output from that head in that layer; the residual stream
     carries the token on.

Static shapes: the kept count is data-dependent, so the compressed sequence has a static capacity C. With
`capacity_buckets = n`, the capacities are ceil(i * T / n) rounded up to a multiple of 128 (and T), i = 1..n;
`lax.switch` runs the smallest capacity that holds the batch's largest kept count (and plain dense attention when
no row drops a token). Each head's kept tokens fill the first slots of its compressed row; the empty slots come
after them, so under the causal mask no kept query ever sees an empty slot, and empty slots' outputs are dropped.
`capacity_buckets = 1` always uses C = T. Compositions use C = T (the inner method's cross-layer state is shaped
by T).

Differences from the official code (dongwonjo/Token-Sparse-Attention, sparse_cluster.py): there, a layer that
drops nothing stays dense and one that drops n_drop > 0 tokens drops n_drop + 1; here exactly the tokens whose
cumulative mass stays below tau are dropped (dropped mass < tau). The official count is per batch; here it is
per row (right padding). The scoring pools over [0, n) rather than the prefix alone (see `tsa_scores`).

Composition (`TSA(inner=method)`, registered as "tsa+kascade"): in sparse layers the inner method's prefill runs
on the compressed sequence (its `ctx.lengths` are the kept counts, `ctx.hidden` is None), in dense layers on the
full one; decode is the inner method's. Kascade carries anchor indices from layer to layer, and the compressed
coordinates of two layers differ, so the wrapper translates them: it remembers which original position each
compressed slot of the anchor layer held, and before a reuse layer it maps the anchor's selected keys to original
positions and then into this layer's compressed positions (keys this layer dropped are dropped), taking for each
compressed query tile the anchor row of the tile that holds the tile's first query. With identical coordinates
(both layers dense) this is the identity, so `tsa+kascade` with tau = 0 is Kascade.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jsparse.artifacts import ARTIFACT_JSON, ArtifactError, load_artifact
from jsparse.methods import kascade as kascade_mod
from jsparse.methods.base import register
from jsparse.methods.common import kwargs_for
from models import attention as attention_protocol
from pallas_kernels.dense import dense_decode, dense_prefill
from pallas_kernels.local_attention import local_attention
from pallas_kernels.tsa_scoring import tsa_scores
from pallas_kernels.tsa_scoring.common import check_pool_kernel, check_window

Array = jax.Array
I32 = jnp.int32
ARTIFACT_KIND = "tsa"
SELECTIONS = ("query_head", "kv_head", "kv_union")
FILLS = ("zeros", "local")
CAPACITY_ALIGN = 128
_SENTINEL_BITS = 0x7F800001  # one above the bit pattern of +inf: no score reaches it


# ----------------------------------------------------------------------------------------------- checks


def check_tau(tau) -> float:
    """tau (the coverage threshold) must be a real number in [0, 1)."""
    if isinstance(tau, bool) or not isinstance(tau, (int, float, np.integer, np.floating)) \
            or not 0.0 <= float(tau) < 1.0:
        raise ValueError(f"tau={tau!r}: expected the dropped attention mass as a fraction in [0, 1)")
    return float(tau)


def _check_nonneg_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 0:
        raise ValueError(f"{name}={value!r}: expected an integer >= 0")
    return int(value)


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise ValueError(f"{name}={value!r}: expected an integer >= 1")
    return int(value)


def check_sparse_layers(sparse_layers, num_layers: int) -> tuple[int, ...]:
    layers = tuple(sorted(int(l) for l in sparse_layers))
    if len(set(layers)) != len(layers) or (layers and (layers[0] < 0 or layers[-1] >= num_layers)):
        raise ValueError(f"sparse_layers={list(layers)}: expected distinct layers in [0, {num_layers})")
    return layers


def capacities(T: int, buckets: int) -> tuple[int, ...]:
    """The static compressed capacities for a length-T prefill: ceil(i * T / buckets) rounded up to a multiple
    of 128 and capped at T, i = 1..buckets (ascending, distinct, the last one T)."""
    caps = {min(T, -(-math.ceil(i * T / buckets) // CAPACITY_ALIGN) * CAPACITY_ALIGN) for i in range(1, buckets + 1)}
    return tuple(sorted(caps | {T}))


# ----------------------------------------------------------------------------------------------- selection


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


def _prefix(lengths: Array, window: int):
    """(P: i32[B] prefix lengths, W_eff: i32[B] window tokens) of rows with `lengths` valid tokens."""
    n = lengths.astype(I32)
    return jnp.maximum(n - window, 0), jnp.minimum(n, window)


def coverage_counts(scores: Array, lengths: Array, *, tau: float, window: int, min_tokens: int) -> Array:
    """Dynamic token coverage: how many tokens each row keeps.

    Args:
      scores: f32[B, H, T] key scores (any number of heads; they are summed).
      lengths: i32[B] valid tokens per row.
      tau: the dropped mass, in [0, 1). window: W. min_tokens: the least number of prefix tokens kept.

    Returns:
      i32[B]: kept tokens per row, window included: K + min(W, n) with K = max(P - n_drop, min_tokens) on sparse
      rows, n on dense rows (n <= min_tokens + W).
    """
    B, H, T = scores.shape
    n = lengths.astype(I32)
    P, w_eff = _prefix(n, window)
    in_prefix = jnp.arange(T, dtype=I32)[None, :] < P[:, None]  # [B, T]
    g = jnp.where(in_prefix, jnp.sum(scores.astype(jnp.float32), axis=1), 0.0)
    total = jnp.sum(g, axis=-1, keepdims=True)
    p = jnp.where(in_prefix, g / jnp.where(total > 0, total, 1.0), jnp.inf)  # out-of-prefix keys sort last
    cum = jnp.cumsum(jnp.sort(p, axis=-1), axis=-1)
    n_drop = jnp.sum(cum < tau, axis=-1, dtype=I32)
    k_prefix = jnp.maximum(P - n_drop, min_tokens)
    return jnp.where(n <= min_tokens + window, n, k_prefix + w_eff).astype(I32)


def _kth_largest_bits(bits: Array, k: Array) -> Array:
    """The bit pattern of each row's k-th largest entry: max t with #{bits >= t} >= k (0x7f800000 when k = 0).

    bits: i32[B, H, T] non-negative f32 scores as int32 (order-preserving), -1 for keys not to be chosen;
    k: i32[B, 1], at most the number of choosable keys. A binary search over the 31-bit range: 31 counting
    passes over the scores, no sort.
    """
    lo = jnp.zeros(bits.shape[:-1], I32)
    hi = jnp.full(bits.shape[:-1], _SENTINEL_BITS, I32)

    def body(_, lohi):
        lo, hi = lohi
        mid = lo + (hi - lo) // 2
        ok = jnp.sum(bits >= mid[..., None], axis=-1, dtype=I32) >= k
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, 31, body, (lo, hi))
    return lo


def select_tokens(scores: Array, lengths: Array, counts: Array, *, window: int, capacity: int) -> Selection:
    """Each head's top-(count - W) prefix keys on its own scores, plus the window, ascending.

    Args:
      scores: f32[B, H, T] (>= 0) per selecting head.
      lengths: i32[B] valid tokens per row; counts: i32[B] kept tokens per row (from `coverage_counts`, or set
        explicitly), min(W, n) <= counts <= n.
      window: W. capacity: C, static, >= max(counts).

    Returns:
      Selection with indices i32[B, H, C] and slot i32[B, H, T].
    """
    B, H, T = scores.shape
    P, w_eff = _prefix(lengths, window)
    k_prefix = (counts.astype(I32) - w_eff)[:, None]  # [B, 1]
    pos = jnp.arange(T, dtype=I32)
    in_prefix = (pos[None, :] < P[:, None])[:, None]  # [B, 1, T]
    in_window = ((pos[None, :] >= P[:, None]) & (pos[None, :] < lengths[:, None]))[:, None]
    s = scores.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(jnp.where(s > 0, s, 0.0), I32)
    bits = jnp.where(in_prefix, bits, -1)
    thr = _kth_largest_bits(bits, k_prefix)[..., None]  # [B, H, 1]
    above = bits > thr
    need = k_prefix[..., None] - jnp.sum(above, axis=-1, keepdims=True, dtype=I32)
    tied = bits == thr
    keep = above | (tied & (jnp.cumsum(tied, axis=-1, dtype=I32) <= need)) | in_window
    return selection_from_keep(keep, capacity)


def selection_from_keep(keep: Array, capacity: int) -> Selection:
    """The Selection of a keep mask bool[B, H, T] (each row's kept positions ascending in its first slots)."""
    B, H, T = keep.shape
    slot = jnp.where(keep, jnp.cumsum(keep, axis=-1, dtype=I32) - 1, -1)
    b = jnp.arange(B)[:, None, None]
    h = jnp.arange(H)[None, :, None]
    indices = jnp.full((B, H, capacity), -1, I32).at[b, h, jnp.where(keep, slot, capacity)].set(
        jnp.broadcast_to(jnp.arange(T, dtype=I32), (B, H, T)), mode="drop")
    return Selection(indices=indices, slot=slot)


def union_selection(sel: Selection, num_kv_heads: int, capacity: int) -> Selection:
    """"kv_union": the union of each GQA group's query-head selections, one Selection per KV head."""
    B, Hq, T = sel.slot.shape
    keep = sel.keep.reshape(B, num_kv_heads, Hq // num_kv_heads, T).any(axis=2)
    return selection_from_keep(keep, capacity)


def selection_scores(scores: Array, num_kv_heads: int, selection: str) -> Array:
    """f32[B, Hq, T] scores -> the selecting heads' scores (summed over each GQA group for "kv_head")."""
    if selection in ("query_head", "kv_union"):
        return scores
    B, Hq, T = scores.shape
    return scores.reshape(B, num_kv_heads, Hq // num_kv_heads, T).sum(axis=2)


# ----------------------------------------------------------------------------------------------- compress


def compress(q: Array, k: Array, v: Array, sel: Selection):
    """Gathers the kept rows into compressed sequences.

    Args:
      q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]; sel: a Selection over Hq ("query_head") or Hkv ("kv_head") heads.

    Returns:
      (qc: [B, C, Hq, D], kc, vc: [B, C, Hq, D] per query head, or [B, C, Hkv, D] per KV head). Empty slots
      hold position 0's rows (they come after every kept slot, so causally no kept query sees them).
    """
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    H = sel.indices.shape[1]
    idx = jnp.swapaxes(jnp.where(sel.indices >= 0, sel.indices, 0), 1, 2)  # [B, C, H]
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
    B, C, Hq, D = out_c.shape
    H = sel.slot.shape[1]
    slot = jnp.swapaxes(sel.slot, 1, 2)  # [B, T, H]
    if H != Hq:
        slot = jnp.repeat(slot, Hq // H, axis=2)
    b = jnp.arange(B)[:, None, None]
    hq = jnp.arange(Hq, dtype=I32)[None, None, :]
    out = out_c[b, jnp.maximum(slot, 0), hq]
    if fill_rows is None:
        return jnp.where((slot >= 0)[..., None], out, jnp.zeros((), out.dtype))
    if fill_rows.shape != out.shape:
        raise ValueError(f"fill_rows has shape {fill_rows.shape}: expected {out.shape} ([B, T, Hq, D])")
    return jnp.where((slot >= 0)[..., None], out, fill_rows.astype(out.dtype))


def attend_compressed(q: Array, k: Array, v: Array, sel: Selection,
                      attend: Callable[[Array, Array, Array], Array] = dense_prefill,
                      fill_rows: Array | None = None) -> Array:
    """Compress, causal attention in the compressed space, decompress (dropped positions: zeros or the rows of
    `fill_rows`): [B, T, Hq, D]."""
    return decompress(attend(*compress(q, k, v, sel)), sel, fill_rows)


def check_fill(fill, local_window, local_sinks) -> tuple[str, int, int]:
    """TSA's `fill` ("zeros" or "local"), a positive `local_window` and non-negative `local_sinks` (as ints)."""
    if fill not in FILLS:
        raise ValueError(f"fill={fill!r}: expected one of {list(FILLS)}")
    return fill, _check_positive_int("local_window", local_window), _check_nonneg_int("local_sinks", local_sinks)


def masked_reference_mask(sel: Selection, num_query_heads: int) -> Array:
    """bool[B, Hq, T, T]: query i attends key j iff the head kept both and j <= i (the test reference)."""
    keep = sel.keep
    if keep.shape[1] != num_query_heads:
        keep = jnp.repeat(keep, num_query_heads // keep.shape[1], axis=1)
    T = keep.shape[-1]
    causal = jnp.tril(jnp.ones((T, T), bool))
    return keep[..., :, None] & keep[..., None, :] & causal


# ----------------------------------------------------------------------------------------------- Kascade adapter


def translate_anchor_indices(anchor_idx: Array, anchor_map: Array, head_map: Array, cur_map: Array,
                             cur_slot: Array, tile: int) -> Array:
    """Kascade anchor indices from the anchor layer's compressed coordinates to this layer's.

    Args:
      anchor_idx: i32[B, Hkv, nT, K] the anchor's selection (its compressed positions, -1 padded), one row per
        compressed query tile of the anchor layer.
      anchor_map: i32[B, Hkv, T] original position of each anchor slot (T for empty slots).
      head_map: i32[Hkv] the anchor KV head each of this layer's KV heads reuses.
      cur_map: i32[B, Hkv, T] original position of each of this layer's slots (T for empty slots).
      cur_slot: i32[B, Hkv, T] this layer's slot of each original position (-1 if not kept).
      tile: Kascade's query tile.

    Returns:
      i32[B, Hkv, nT, K] in this layer's compressed positions, ascending, -1 padded, already head-mapped (use
      them with an identity head map). Every key lies strictly before its tile's first query.
    """
    B, Hkv, nT, K = anchor_idx.shape
    T = anchor_map.shape[-1]
    a_idx = jnp.take(anchor_idx, head_map, axis=1)
    a_map = jnp.take(anchor_map, head_map, axis=1)
    first = jnp.minimum(jnp.arange(nT, dtype=I32) * tile, T - 1)
    p0 = cur_map[:, :, first]  # [B, Hkv, nT] original position of each tile's first query
    search = jax.vmap(jax.vmap(lambda a, v: jnp.searchsorted(a, v, side="right")))
    a_pos = jnp.clip(search(a_map, p0) - 1, 0, T - 1)  # the anchor slot at or before p0
    rows = jnp.take_along_axis(a_idx, (a_pos // tile)[..., None], axis=2)  # [B, Hkv, nT, K]
    valid = rows >= 0
    orig = jnp.take_along_axis(a_map, jnp.where(valid, rows, 0).reshape(B, Hkv, nT * K), axis=2)
    valid = valid & (orig.reshape(B, Hkv, nT, K) < T)
    cur = jnp.take_along_axis(cur_slot, jnp.minimum(orig, T - 1), axis=2).reshape(B, Hkv, nT, K)
    valid = valid & (cur >= 0)
    big = jnp.iinfo(I32).max
    cur = jnp.sort(jnp.where(valid, cur, big), axis=-1)
    return jnp.where(cur == big, -1, cur).astype(I32)


# ----------------------------------------------------------------------------------------------- method


@struct.dataclass
class TSAState:
    """kept: i32[L, B] tokens each layer kept per row in the last prefill (n on dense layers and rows; with
    "kv_union" the mean over KV heads of their union sizes, rounded);
    inner: the inner method's state; anchor_map: i32[B, Hkv, T] original position of each compressed slot of
    the latest Kascade anchor layer (inside a composed prefill only)."""

    kept: Array
    inner: Any = None
    anchor_map: Optional[Array] = None


@struct.dataclass
class TSALayerInfo:
    sparse: Array  # i32[L]: 1 where the layer's prefill is token-sparse
    inner: Any = None  # the inner method's layer_info


@register("tsa")
@struct.dataclass
class TSA:
    """Token Sparse Attention for prefill, optionally around an inner method (see the module docstring).

    Attributes:
      tau: coverage threshold, the attention mass a row may drop, in [0, 1) (default 0.005).
      window: W, the trailing queries that score the keys and are always kept (default 128).
      pool_kernel: odd average-pooling kernel over the key scores (default 7).
      min_tokens: the least number of prefix tokens kept per head (default 1024).
      sparse_layers: the layers whose prefill is sparse; None = every layer but 0.
      selection: "query_head" (each query head selects; default), "kv_head" (GQA group-shared) or "kv_union"
        (each query head selects, each KV head keeps its group's union; not in the paper).
      capacity_buckets: static compressed capacities per prefill length (default 8; 1 = always T).
      fill: what a head's dropped positions get: "local" (default; sliding-window attention over the last
        `local_window` keys and the first `local_sinks` tokens; not in the paper: the paper's zeros lose needles
        on the bundled model) or "zeros" (the paper's behaviour: no output from that head).
      local_window: keys of the "local" fill's window, the query itself included (default 64).
      local_sinks: leading tokens every "local" fill row attends to as well (default 4).
      inner: the method run inside the compressed space and for decode (None: dense).
    """

    tau: float = struct.field(pytree_node=False, default=0.005)
    window: int = struct.field(pytree_node=False, default=128)
    pool_kernel: int = struct.field(pytree_node=False, default=7)
    min_tokens: int = struct.field(pytree_node=False, default=1024)
    sparse_layers: Optional[tuple] = struct.field(pytree_node=False, default=None)
    selection: str = struct.field(pytree_node=False, default="query_head")
    capacity_buckets: int = struct.field(pytree_node=False, default=8)
    fill: str = struct.field(pytree_node=False, default="local")
    local_window: int = struct.field(pytree_node=False, default=64)
    local_sinks: int = struct.field(pytree_node=False, default=4)
    inner: Any = None

    def __post_init__(self):
        check_tau(self.tau)
        check_window(self.window)
        check_pool_kernel(self.pool_kernel)
        _check_nonneg_int("min_tokens", self.min_tokens)
        _check_positive_int("capacity_buckets", self.capacity_buckets)
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection={self.selection!r}: expected one of {list(SELECTIONS)}")
        _, local_window, local_sinks = check_fill(self.fill, self.local_window, self.local_sinks)
        object.__setattr__(self, "local_window", local_window)  # plain ints (static, hashable fields)
        object.__setattr__(self, "local_sinks", local_sinks)
        if self.sparse_layers is not None:
            if isinstance(self.sparse_layers, (str, bytes)) or not hasattr(self.sparse_layers, "__iter__"):
                raise ValueError(f"sparse_layers={self.sparse_layers!r}: expected a sequence of layer indices")
            # A static field must be hashable: store the layers as a sorted tuple of ints.
            object.__setattr__(self, "sparse_layers", check_sparse_layers(self.sparse_layers, 1 << 30))
        if self.inner is not None and self.selection == "kv_union":
            raise ValueError("selection='kv_union' with an inner method: the inner method runs on per-row "
                             "compressed lengths, which a per-KV-head union does not have; use 'kv_head'")
        if isinstance(self.inner, kascade_mod.Kascade) and self.selection != "kv_head":
            raise ValueError(f"selection={self.selection!r} with an inner Kascade: Kascade selects per KV head "
                             "(head maps, group-pooled top-k), so the compressed space must keep the KV heads; "
                             "use selection='kv_head'")

    # --------------------------------------------------------------------------------------- building

    @classmethod
    def build(cls, cfg=None, artifact: str | None = None, fingerprint: str | None = None, **options):
        """`make_method("tsa", cfg=..., artifact=DIR, tau=...)`: sparse layers from a "tsa" artifact (or every
        layer but 0 without one); the other options are the dataclass fields (budget etc. are ignored)."""
        options = kwargs_for(cls, options)
        if artifact:
            options["sparse_layers"] = load_sparse_layers(artifact, fingerprint, cfg)
        return cls(**options)

    def layers(self, num_layers: int) -> tuple[int, ...]:
        """The sparse layers of an L-layer model."""
        if self.sparse_layers is None:
            return tuple(range(1, num_layers))
        return check_sparse_layers(self.sparse_layers, num_layers)

    # --------------------------------------------------------------------------------------- protocol

    @property
    def _kascade(self) -> bool:
        return isinstance(self.inner, kascade_mod.Kascade)

    def init_state(self, cfg, batch, max_len):
        inner = None if self.inner is None else self.inner.init_state(cfg, batch, max_len)
        return TSAState(kept=jnp.zeros((cfg.num_layers, batch), I32), inner=inner)

    def layer_info(self, cfg):
        sparse = np.zeros((cfg.num_layers,), np.int32)
        sparse[list(self.layers(cfg.num_layers))] = 1
        inner = None if self.inner is None else self.inner.layer_info(cfg)
        return TSALayerInfo(sparse=jnp.asarray(sparse), inner=inner)

    def start(self, cfg, state, phase, batch, q_len, kv_len):
        inner = state.inner
        if self.inner is not None:
            inner = attention_protocol.start(self.inner, cfg, inner, phase, batch, q_len, kv_len)
        anchor_map = None
        if self._kascade and phase == "prefill":
            anchor_map = jnp.broadcast_to(jnp.arange(q_len, dtype=I32), (batch, cfg.num_kv_heads, q_len))
        return TSAState(kept=state.kept, inner=inner, anchor_map=anchor_map)

    def finish(self, state, phase):
        inner = state.inner if self.inner is None else attention_protocol.finish(self.inner, state.inner, phase)
        return TSAState(kept=state.kept, inner=inner)

    def decode(self, ctx, q, cache, state):
        if self.inner is None:
            return dense_decode(q, cache.k, cache.v, ctx.lengths), state
        out, inner = self.inner.decode(ctx.replace(info=ctx.info.inner), q, cache, state.inner)
        return out, state.replace(inner=inner)

    def prefill(self, ctx, q, k, v, state):
        B, T = q.shape[:2]
        if self.tau == 0.0 or T <= self.min_tokens + self.window:  # nothing can be dropped: dense, exactly
            return self._dense_prefill(ctx, q, k, v, state)
        return jax.lax.cond(ctx.info.sparse > 0,
                            lambda: self._sparse_prefill(ctx, q, k, v, state),
                            lambda: self._dense_prefill(ctx, q, k, v, state))

    def prefill_layer_sparsity(self, cfg, state: TSAState, lengths) -> dict[int, np.ndarray]:
        """The attention-map sparsity of the last prefill per sparse layer and row (the paper's Table 3).

        Args:
          state: the state a prefill returned (its `kept`: i32[L, B] tokens each layer kept per row).
          lengths: i32[B] the rows' prompt lengths in that prefill.
        Returns:
          {sparse layer: f64[B]} the fraction 1 - k (k + 1) / (n (n + 1)) of the causal attention map the
          compression skipped (k kept of n tokens; 0 on rows short enough to stay dense). Used by the eval
          harness (`layer_sparsity` in results.json).
        """
        kept = np.asarray(state.kept, np.float64)
        n = np.maximum(np.asarray(lengths, np.float64), 1.0)
        if kept.shape[1] != n.shape[0]:
            raise ValueError(f"state.kept has {kept.shape[1]} rows but lengths has {n.shape[0]}")
        frac = 1.0 - kept * (kept + 1.0) / (n * (n + 1.0))[None]
        return {layer: frac[layer] for layer in self.layers(cfg.num_layers)}

    # --------------------------------------------------------------------------------------- pieces

    def select(self, q: Array, k: Array, lengths: Array, capacity: int | None = None):
        """(counts i32[B], Selection) of one sparse layer; capacity None = T. ("kv_union": counts are the
        per-query-head counts; each KV head's union keeps at least that many.)"""
        scores = tsa_scores(q, k, window=self.window, pool_kernel=self.pool_kernel, lengths=lengths)
        scores = selection_scores(scores, k.shape[2], self.selection)
        counts = coverage_counts(scores, lengths, tau=self.tau, window=self.window, min_tokens=self.min_tokens)
        cap = q.shape[1] if capacity is None else capacity
        return counts, self._selection(scores, lengths, counts, k.shape[2], cap)

    def _selection(self, scores, lengths, counts, num_kv_heads: int, capacity: int) -> Selection:
        if self.selection != "kv_union":
            return select_tokens(scores, lengths, counts, window=self.window, capacity=capacity)
        sel = select_tokens(scores, lengths, counts, window=self.window, capacity=scores.shape[-1])
        return union_selection(sel, num_kv_heads, capacity)

    def _fill(self, q: Array, k: Array, v: Array) -> Array | None:
        """The rows a head's dropped positions get: None (zeros) or the "local" sliding-window attention."""
        if self.fill == "zeros":
            return None
        return local_attention(q, k, v, window=self.local_window, sinks=self.local_sinks)

    def _record(self, state, layer, counts):
        return state.kept.at[layer].set(counts.astype(I32))

    def _dense_prefill(self, ctx, q, k, v, state):
        kept = self._record(state, ctx.layer, ctx.lengths)
        if self.inner is None:
            return dense_prefill(q, k, v), state.replace(kept=kept)
        B, T, Hq, _ = q.shape
        H = k.shape[2] if self.selection in ("kv_head", "kv_union") else Hq
        ident = jnp.broadcast_to(jnp.arange(T, dtype=I32), (B, H, T))
        out, state = self._inner_prefill(ctx, q, k, v, state, ident, ident)
        return out, state.replace(kept=kept)

    def _sparse_prefill(self, ctx, q, k, v, state):
        B, T = q.shape[:2]
        lengths = ctx.lengths
        scores = tsa_scores(q, k, window=self.window, pool_kernel=self.pool_kernel, lengths=lengths)
        scores = selection_scores(scores, k.shape[2], self.selection)
        counts = coverage_counts(scores, lengths, tau=self.tau, window=self.window, min_tokens=self.min_tokens)
        nothing_dropped = jnp.all(counts >= lengths)
        if self.selection == "kv_union":  # the union's size is only known after the selection
            union = union_selection(select_tokens(scores, lengths, counts, window=self.window, capacity=T),
                                    k.shape[2], T)
            sizes = jnp.sum(union.keep, axis=-1, dtype=I32)  # [B, Hkv]
            kept = self._record(state, ctx.layer, jnp.round(jnp.mean(sizes, axis=1)).astype(I32))
            largest = jnp.max(sizes)
        else:
            kept = self._record(state, ctx.layer, counts)
            largest = jnp.max(counts)

        if self.inner is not None:  # capacity T: the inner method's state is shaped for T queries
            def compressed():
                sel = self._selection(scores, lengths, counts, k.shape[2], T)
                qc, kc, vc = compress(q, k, v, sel)
                cur_map = jnp.where(sel.indices >= 0, sel.indices, T)
                out_c, st = self._inner_prefill(ctx.replace(lengths=counts, hidden=None), qc, kc, vc, state,
                                                cur_map, sel.slot)
                return decompress(out_c, sel, self._fill(q, k, v)), st

            out, state = jax.lax.cond(nothing_dropped,
                                      lambda: self._dense_prefill(ctx, q, k, v, state), compressed)
            return out, state.replace(kept=kept)

        caps = capacities(T, self.capacity_buckets)

        def branch(cap):
            def fn():
                if self.selection == "kv_union":
                    sel = selection_from_keep(union.keep, cap)
                else:
                    sel = select_tokens(scores, lengths, counts, window=self.window, capacity=cap)
                return attend_compressed(q, k, v, sel, fill_rows=self._fill(q, k, v))
            return fn

        which = jnp.searchsorted(jnp.asarray(caps, I32), largest).astype(I32) + 1
        which = jnp.where(nothing_dropped, 0, jnp.minimum(which, len(caps)))
        out = jax.lax.switch(which, [lambda: dense_prefill(q, k, v)] + [branch(c) for c in caps])
        return out, state.replace(kept=kept)

    def _inner_prefill(self, ctx, q, k, v, state, cur_map, cur_slot):
        """The inner method's prefill in (possibly compressed) coordinates; cur_map / cur_slot: i32[B, H, T]
        original position of each slot (T: empty) and slot of each original position (-1: not kept)."""
        info = ctx.info.inner
        if not self._kascade:
            out, inner = self.inner.prefill(ctx.replace(info=info), q, k, v, state.inner)
            return out, state.replace(inner=inner)
        reuse = info.role == kascade_mod.ROLE_REUSE
        anchor = state.inner.indices
        translated = translate_anchor_indices(anchor, state.anchor_map, info.head_map, cur_map, cur_slot,
                                              self.inner.tile)
        ident = jnp.arange(info.head_map.shape[0], dtype=I32)
        call_info = kascade_mod.LayerRole(role=info.role, head_map=ident)
        call_state = kascade_mod.KascadeState(indices=jnp.where(reuse, translated, anchor))
        out, new = self.inner.prefill(ctx.replace(info=call_info), q, k, v, call_state)
        inner = kascade_mod.KascadeState(indices=jnp.where(reuse, anchor, new.indices))
        anchor_map = jnp.where(reuse, state.anchor_map, cur_map)
        return out, state.replace(inner=inner, anchor_map=anchor_map)


# ----------------------------------------------------------------------------------------------- artifacts


def load_sparse_layers(path: str, fingerprint: str | None, cfg=None) -> tuple[int, ...]:
    """The sparse layers stored in a "tsa" artifact (checked against the model's fingerprint and layers)."""
    art = load_artifact(path, ARTIFACT_KIND, fingerprint)
    layers = tuple(int(l) for l in np.asarray(art.arrays["sparse_layers"]).ravel())
    num_layers = cfg.num_layers if cfg is not None else 1 << 30
    return check_sparse_layers(layers, num_layers)


def artifact_kind(path: str) -> str:
    """The kind recorded in an artifact folder's artifact.json."""
    meta = os.path.join(path, ARTIFACT_JSON)
    if not os.path.exists(meta):
        raise ArtifactError(f"no artifact at {path!r}: {ARTIFACT_JSON} is missing")
    try:
        with open(meta) as f:
            return str(json.load(f).get("kind"))
    except (OSError, json.JSONDecodeError) as e:
        raise ArtifactError(f"artifact at {path!r} is corrupt: {e}") from e


def split_artifacts(artifact: str | None, kinds: tuple[str, ...]) -> dict[str, str]:
    """Artifact folders by kind from one string of folders separated by os.pathsep (':' on Linux, ';' on
    Windows), each routed by the kind in its artifact.json."""
    out: dict[str, str] = {}
    for path in (artifact or "").split(os.pathsep):
        if not path:
            continue
        kind = artifact_kind(path)
        if kind not in kinds:
            raise ArtifactError(f"artifact at {path!r} is a {kind!r} artifact: expected one of {list(kinds)}")
        if kind in out:
            raise ArtifactError(f"two {kind!r} artifacts given: {out[kind]!r} and {path!r}")
        out[kind] = path
    return out


@register("tsa+kascade")
class TSAKascade:
    """Builder of TSA around Kascade: TSA prefill with Kascade's attention inside the compressed space, Kascade
    decode (the method object is a `TSA` with `inner` a `Kascade` and selection "kv_head").

    Artifacts: `artifact` is one folder or several separated by os.pathsep, each routed by its kind, e.g.
    `jsparse eval --methods tsa+kascade --artifact tsa+kascade=artifacts/kascade:artifacts/tsa`; or pass
    `kascade_artifact=` / `tsa_artifact=` (Python). The Kascade artifact is required; without a TSA artifact
    every layer but 0 is TSA-sparse. `budget`, `tile`, `min_tokens` go to Kascade; `tau`, `window`,
    `pool_kernel`, `tsa_min_tokens`, `sparse_layers`, `fill`, `local_window`, `local_sinks` to TSA.
    """

    EXTRA_OPTIONS = ("tsa_min_tokens",)  # an option of the builder's own (see `jsparse.methods.base.method_options`)

    @classmethod
    def build(cls, cfg=None, artifact: str | None = None, fingerprint: str | None = None,
              kascade_artifact: str | None = None, tsa_artifact: str | None = None, **options):
        paths = split_artifacts(artifact, (kascade_mod.ARTIFACT_KIND, ARTIFACT_KIND))
        kascade_artifact = kascade_artifact or paths.get(kascade_mod.ARTIFACT_KIND)
        tsa_artifact = tsa_artifact or paths.get(ARTIFACT_KIND)
        inner = kascade_mod.Kascade.build(cfg=cfg, artifact=kascade_artifact, fingerprint=fingerprint, **options)
        tsa_options = {k: options[k] for k in ("tau", "window", "pool_kernel", "sparse_layers", "fill",
                                               "local_window", "local_sinks") if k in options}
        if "tsa_min_tokens" in options:
            tsa_options["min_tokens"] = options["tsa_min_tokens"]
        return TSA.build(cfg=cfg, artifact=tsa_artifact, fingerprint=fingerprint, inner=inner,
                         selection="kv_head", capacity_buckets=1, **tsa_options)


# ----------------------------------------------------------------------------------------------- sparsity


def attention_map_sparsity(kept: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """f64[L]: per layer, the fraction of the causal attention map not computed, averaged over rows:
    1 - k (k + 1) / (n (n + 1)) for k kept of n tokens (kept: i32[L, B], lengths: i32[B])."""
    k = np.asarray(kept, np.float64)
    n = np.maximum(np.asarray(lengths, np.float64), 1.0)[None]
    return np.mean(1.0 - k * (k + 1) / (n * (n + 1)), axis=1)


def prefill_sparsity(params, cfg, method: TSA, tokens, lengths) -> dict:
    """Runs one prefill and reports what TSA kept: {"kept": i32[L, B], "kept_fraction": f64[L],
    "attention_map_sparsity": f64[L]} (means over rows; dense layers keep everything)."""
    from models import llama
    from models.cache import init_cache

    tokens = jnp.asarray(tokens, I32)
    lengths = jnp.asarray(lengths, I32)
    B, T = tokens.shape

    @jax.jit
    def run(params, tokens, lengths):
        cache = init_cache(cfg, B, T, params.embed.dtype)
        _, _, state = llama.prefill(params, cfg, method, tokens, lengths, cache, method.init_state(cfg, B, T))
        return state.kept

    kept = np.asarray(run(params, tokens, lengths))
    n = np.asarray(lengths)
    return {"kept": kept, "kept_fraction": np.mean(kept / np.maximum(n, 1)[None], axis=1),
            "attention_map_sparsity": attention_map_sparsity(kept, n)}

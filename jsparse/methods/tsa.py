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
  3. Compress, attend, decompress (`jsparse.compression`): gather each head's kept Q, K, V rows, run causal dense
     attention over the compressed sequence (cuDNN on GPU), and write each head's outputs back to their
     positions; the model's o_proj follows. Kept positions keep their order, so a kept query at position i sees
     exactly the kept keys j <= i of its head. The compressed length is a static capacity: with
     `capacity_buckets = n`, ceil(i * T / n) rounded up to a multiple of 128 (and T), i = 1..n, the smallest
     that holds the batch's largest kept count (dense attention when no row drops a token). Around Kascade the
     same buckets hold Kascade's anchors and reuse layers (its state padded back to T's shape); around another
     inner method, whose state is shaped for T queries, the capacity is T.
  4. The KV cache keeps the full K and V (the model writes it); decode is dense unless an inner method is
     composed (`tsa+kascade`: Kascade's decode).

Which layers are sparse comes from the drift calibration (`jsparse calibrate tsa`, tsa_calibration.py): an
artifact of kind "tsa" holding `sparse_layers`. Without one every layer but 0 is sparse (the official code's
uncalibrated default, the second half of the layers, is `sparse_layers=tuple(range(L // 2, L))`).

GQA (`selection`): "query_head" (default, the paper): each query head selects on its own scores, its K/V rows
gathered from its KV head, so the compressed attention is multi-head. "kv_head": scores summed over each GQA
group, one selection per KV head, the compressed attention stays GQA (for inner methods that select per KV head,
as Kascade). "kv_union" (not in the paper): each query head selects as in "query_head" and a KV head keeps the
union of its group's selections (GQA, at least the paper's count per head): on the bundled SmolLM2 (GQA 9/3)
"query_head" loses passkeys placed early in the prompt (eval/results/h100/tsa_smollm2_4k_16*/NOTES.md).

A head's dropped positions (`fill`): "local" (default; not in the paper) get causal sliding-window attention over
the full K/V, the last `local_window` keys (64) plus the first `local_sinks` tokens (4), from
`pallas_kernels.local_attention`: O(T * (local_window + local_sinks)) work, 1.8 ms against a 106 ms compressed
attention at 128K on an H100 (Llama-3.1-8B heads). "zeros" (the paper's) give no output from that head in that
layer. On the bundled SmolLM2 zeros lose passkeys placed early in the prompt and add 2.6-4% perplexity at tau
0.005 (a dropped token misses the head's contribution in every sparse layer); the local fill keeps dense's
passkey accuracy and perplexity within 1% (eval/results/h100/tsa_fill_local_4k_16/NOTES.md).

Differences from the official code (dongwonjo/Token-Sparse-Attention, sparse_cluster.py): there, a layer that
drops nothing stays dense and one that drops n_drop > 0 tokens drops n_drop + 1; here exactly the tokens whose
cumulative mass stays below tau are dropped (dropped mass < tau). The official count is per batch; here it is
per row (right padding). The scoring pools over [0, n) rather than the prefix alone (see `tsa_scores`).

Composition (`TSA(inner=method)`, registered as "tsa+kascade"): in sparse layers the inner method's prefill runs
on the compressed sequence (its `ctx.lengths` are the kept counts, `ctx.hidden` is None), in dense layers on the
full one; decode is the inner method's. Kascade's anchor indices cross layers whose compressed coordinates differ:
`kascade.prefill_in_coordinates` translates them, so `tsa+kascade` with tau = 0 is Kascade. A reuse layer attends
only to keys its anchor saw, so an anchor that a TSA-dense reuse layer reads is kept TSA-dense as well (`layers`).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jsparse import selection as sel
from jsparse.artifacts import ArtifactError, load_artifact
from jsparse.compression import (Selection, attend_at_capacity, attend_compressed, attention_map_sparsity,  # noqa: F401
                                 capacities, causal_map_sparsity, compress, decompress, kept_summary,
                                 masked_reference_mask, selection_from_keep, union_selection)
from jsparse.methods import kascade as kascade_mod
from jsparse.methods.base import register
from jsparse.methods.common import decode_dense, kwargs_for, prefill_state, refuse_unused
from jsparse.methods.kascade import translate_anchor_indices  # noqa: F401  (re-exported)
from models import attention as attention_protocol
from pallas_kernels.dense import dense_prefill
from pallas_kernels.local_attention import local_attention
from pallas_kernels.tsa_scoring import tsa_scores
from pallas_kernels.tsa_scoring.common import check_pool_kernel, check_window

Array = jax.Array
I32 = jnp.int32
ARTIFACT_KIND = "tsa"
SELECTIONS = ("query_head", "kv_head", "kv_union")
FILLS = ("zeros", "local")

# ----------------------------------------------------------------------------------------------- config checks


def check_tau(tau) -> float:
    """tau (the coverage threshold) must be a real number in [0, 1)."""
    if not sel.is_real(tau) or not 0.0 <= float(tau) < 1.0:
        raise ValueError(f"tau={tau!r}: expected the dropped attention mass as a fraction in [0, 1)")
    return float(tau)


def check_kept_fraction(fraction) -> float | None:
    """kept_fraction (a fixed share of each row in place of the coverage count) must be None or a real number in
    (0, 1]."""
    if fraction is None:
        return None
    if not sel.is_real(fraction) or not 0.0 < float(fraction) <= 1.0:
        raise ValueError(f"kept_fraction={fraction!r}: expected None (coverage) or the kept share of each row "
                         f"in (0, 1]")
    return float(fraction)


def check_sparse_layers(sparse_layers, num_layers: int) -> tuple[int, ...]:
    return sel.check_layers("sparse_layers", sparse_layers, num_layers)


def check_fill(fill, local_window, local_sinks) -> tuple[str, int, int]:
    """TSA's `fill` ("zeros" or "local"), a positive `local_window` and non-negative `local_sinks` (as ints)."""
    if fill not in FILLS:
        raise ValueError(f"fill={fill!r}: expected one of {list(FILLS)}")
    return fill, sel.check_positive_int("local_window", local_window), sel.check_positive_int("local_sinks",
                                                                                             local_sinks, 0)


# ----------------------------------------------------------------------------------------------- selection


def _prefix(lengths: Array, window: int, xp=jnp):
    """(P: i32[B] prefix lengths, W_eff: i32[B] window tokens) of rows with `lengths` valid tokens."""
    n = lengths.astype(np.int32)
    return xp.maximum(n - window, 0), xp.minimum(n, window)


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
    n = lengths.astype(I32)
    P, w_eff = _prefix(n, window)
    in_prefix = jnp.arange(scores.shape[-1], dtype=I32)[None, :] < P[:, None]  # [B, T]
    n_drop = sel.coverage_drop_count(jnp.sum(scores.astype(jnp.float32), axis=1), in_prefix, tau)
    k_prefix = jnp.maximum(P - n_drop, min_tokens)
    return jnp.where(n <= min_tokens + window, n, k_prefix + w_eff).astype(I32)


def fixed_counts(lengths: Array, *, fraction: float, window: int, min_tokens: int, xp=jnp) -> Array:
    """A fixed share of each row in place of the coverage count: i32[B] kept tokens, window included,
    round(fraction * n) with at least `min_tokens` prefix tokens and at most n; n on dense rows (n <= min_tokens + W),
    as `coverage_counts`. xp: jnp, or np for static lengths (`TSA.capacities`; the same f32 arithmetic)."""
    n = lengths.astype(np.int32)
    P, w_eff = _prefix(n, window, xp)
    total = xp.round(xp.float32(fraction) * n.astype(np.float32)).astype(np.int32)
    k_prefix = xp.minimum(xp.maximum(total - w_eff, min_tokens), P)
    return xp.where(n <= min_tokens + window, n, k_prefix + w_eff).astype(np.int32)


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
    T = scores.shape[-1]
    P, w_eff = _prefix(lengths, window)
    k_prefix = (counts.astype(I32) - w_eff)[:, None]  # [B, 1]
    pos = jnp.arange(T, dtype=I32)
    in_prefix = (pos[None, :] < P[:, None])[:, None]  # [B, 1, T]
    in_window = ((pos[None, :] >= P[:, None]) & (pos[None, :] < lengths[:, None]))[:, None]
    keep = sel.topk_mask(scores, k_prefix, in_prefix) | in_window
    return selection_from_keep(keep, capacity)


def selection_scores(scores: Array, num_kv_heads: int, selection: str) -> Array:
    """f32[B, Hq, T] scores -> the selecting heads' scores (summed over each GQA group for "kv_head")."""
    if selection in ("query_head", "kv_union"):
        return scores
    return sel.group_sum(scores, num_kv_heads)


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
      capacity_buckets: static compressed capacities per prefill length (default 8; 1 = always T; each is one
        branch of a `lax.switch`, compiled once per prefill length).
      fill: what a head's dropped positions get: "local" (default; sliding-window attention) or "zeros" (the
        paper's: no output from that head).
      local_window: keys of the "local" fill's window, the query itself included (default 64).
      local_sinks: leading tokens every "local" fill row attends to as well (default 4).
      kept_fraction: None (default: the coverage count at tau) or a fixed share of each row, in (0, 1]: every
        sparse layer keeps round(kept_fraction * n) tokens (window included, at least min_tokens prefix tokens)
        and tau is unused; the selection is still the top-scored tokens, and the prefill has a capacity at the
        count a full row keeps besides the buckets (`capacities`). Not in the paper: a fixed budget, and
        the way benchmarks on random weights (whose flat attention makes coverage keep nearly every token) set
        the paper's operating point (0.68: 54% attention-map sparsity).
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
    kept_fraction: Optional[float] = struct.field(pytree_node=False, default=None)
    inner: Any = None

    def __post_init__(self):
        check_tau(self.tau)
        object.__setattr__(self, "kept_fraction", check_kept_fraction(self.kept_fraction))
        check_window(self.window)
        check_pool_kernel(self.pool_kernel)
        sel.check_positive_int("min_tokens", self.min_tokens, 0)
        sel.check_positive_int("capacity_buckets", self.capacity_buckets)
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection={self.selection!r}: expected one of {list(SELECTIONS)}")
        _, local_window, local_sinks = check_fill(self.fill, self.local_window, self.local_sinks)
        object.__setattr__(self, "local_window", local_window)  # plain ints (static, hashable fields)
        object.__setattr__(self, "local_sinks", local_sinks)
        if self.sparse_layers is not None:  # a static field must be hashable: a sorted tuple of ints
            object.__setattr__(self, "sparse_layers", check_sparse_layers(self.sparse_layers, 1 << 30))
        if self.inner is not None and not isinstance(self.inner, kascade_mod.Kascade):
            raise ValueError(f"inner={type(self.inner).__name__}: TSA runs an inner method in compressed coordinates, "
                             "and only Kascade translates its state back to positions (another method's state, H2O's "
                             "scores say, would stay in compressed slots and be read as positions); expected a "
                             "Kascade or None")
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
        layer but 0 without one; an explicit `sparse_layers` wins over the artifact's, which is still checked
        against the model); the other options are the dataclass fields (budget etc. are ignored)."""
        options = kwargs_for(cls, options)
        if options.get("kept_fraction") is not None:
            refuse_unused("tsa", options, ("tau",), f"kept_fraction={options['kept_fraction']!r} keeps a fixed share "
                          "of each row in place of the coverage count at tau")
        if options.get("fill") == "zeros":
            refuse_unused("tsa", options, ("local_window", "local_sinks"), "fill='zeros' attends no local window")
        if artifact:
            layers = load_sparse_layers(artifact, fingerprint, cfg)
            if options.get("sparse_layers") is None:
                options["sparse_layers"] = layers
        return cls(**options)

    def layers(self, num_layers: int) -> tuple[int, ...]:
        """The sparse layers of an L-layer model (with an inner Kascade, less the anchors of dense reuse layers:
        see `_sparse_flags`)."""
        return tuple(int(l) for l in np.flatnonzero(np.asarray(self._sparse_flags(num_layers))))

    def _given_layers(self, num_layers: int) -> tuple[int, ...]:
        if self.sparse_layers is None:
            return tuple(range(1, num_layers))
        return check_sparse_layers(self.sparse_layers, num_layers)

    def _sparse_flags(self, num_layers: int) -> Array:
        """i32[L], 1 on the layers whose prefill is token-sparse. Around Kascade, an anchor that a TSA-dense reuse
        layer reads stays dense too: a reuse layer attends only to keys its anchor saw, so a dense layer reusing a
        compressed anchor would lose every token the anchor's compression dropped (on SmolLM2, layers 18-19
        reusing TSA-sparse anchor 17 lost the passkey that TSA and Kascade alone keep)."""
        sparse = np.zeros((num_layers,), np.int32)
        sparse[list(self._given_layers(num_layers))] = 1
        if not self._kascade:
            return jnp.asarray(sparse)
        dense = jnp.asarray(1 - sparse)
        return jnp.asarray(sparse) * (1 - kascade_mod.anchors_read_by(self.inner.roles, dense))

    # --------------------------------------------------------------------------------------- protocol

    @property
    def _kascade(self) -> bool:
        return isinstance(self.inner, kascade_mod.Kascade)

    def check_model(self, cfg):
        """Its sparse layers within the model's (`models.attention.check_model` checks the inner method)."""
        self._given_layers(cfg.num_layers)

    def init_state(self, cfg, batch, max_len):
        inner = None if self.inner is None else self.inner.init_state(cfg, batch, max_len)
        return TSAState(kept=jnp.zeros((cfg.num_layers, batch), I32), inner=inner)

    def segments(self, cfg, phase):
        """Decode runs as the inner method's (`tsa+kascade`: Kascade's runs of one role, no per-layer switch);
        prefill, and TSA alone, one run."""
        fn = getattr(self.inner, "segments", None)
        return None if fn is None or phase != "decode" else fn(cfg, phase)

    def layer_info(self, cfg):
        inner = None if self.inner is None else self.inner.layer_info(cfg)
        return TSALayerInfo(sparse=self._sparse_flags(cfg.num_layers), inner=inner)

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
        if self.inner is None:  # dense, as the dense method decodes (on a GPU the stacked cache read in place)
            return decode_dense(ctx, q, cache), state
        out, inner = self.inner.decode(ctx.replace(info=ctx.info.inner), q, cache, state.inner)
        return out, state.replace(inner=inner)

    def prefill(self, ctx, q, k, v, state):
        B, T = q.shape[:2]
        # Nothing can be dropped (tau 0 drops nothing; with kept_fraction tau is unused): dense, exactly.
        if (self.tau == 0.0 and self.kept_fraction is None) or T <= self.min_tokens + self.window:
            return self._dense_prefill(ctx, q, k, v, state)
        return jax.lax.cond(ctx.info.sparse > 0,
                            lambda: self._sparse_prefill(ctx, q, k, v, state),
                            lambda: self._dense_prefill(ctx, q, k, v, state))

    def prefill_layer_sparsity(self, cfg, state: TSAState, lengths) -> dict[int, np.ndarray]:
        """{sparse layer: f64[B]} the fraction of the causal attention map the last prefill skipped per row
        (`compression.causal_map_sparsity`; the paper's Table 3), from the state it returned (its `kept`: i32[L, B])
        and the rows' prompt lengths i32[B]. Used by the eval harness (`layer_sparsity` in results.json).

        Around Kascade (tsa+kascade) the map a layer computes is Kascade's top-k among the K tokens TSA kept (K = n
        on TSA-dense layers): 1 - (its entries over K tokens, `selection.topk_map_entries` by the layer's role) /
        (n (n + 1) / 2), for every layer TSA or Kascade makes sparse.

        With fill="local" each of the n - K dropped rows also attends its local window and sinks, min(C, p + 1)
        keys for a row at position p (C = local_window + local_sinks). The state does not keep which rows were
        dropped, so they are counted as if they were the last n - K positions, the most any n - K rows can attend:
        the fraction given is then a lower bound (within a few thousandths at 1K tokens and above)."""
        kept = np.asarray(state.kept)
        n = np.asarray(lengths)
        if kept.shape[1] != np.shape(n)[0]:
            raise ValueError(f"state.kept has {kept.shape[1]} rows but lengths has {np.shape(n)[0]}")
        full = np.maximum(n, 1) * (np.maximum(n, 1) + 1) / 2.0

        def fill(K):  # the most entries n - K dropped rows' local fill can have: sum_{j=K+1}^{n} min(C, j)
            if self.fill == "zeros":
                return 0.0
            C = self.local_window + self.local_sinks
            lo, m = np.asarray(K, np.float64) + 1.0, np.minimum(n, C).astype(np.float64)
            ramp = np.where(m >= lo, (lo + m) * (m - lo + 1.0) / 2.0, 0.0)
            return ramp + C * np.maximum(0.0, n - np.maximum(lo - 1.0, C))

        if self.inner is None:
            return {layer: causal_map_sparsity(kept[layer], n) - fill(kept[layer]) / full
                    for layer in self.layers(cfg.num_layers)}
        tsa_layers = set(self.layers(cfg.num_layers))
        out = {}
        for layer, budget in enumerate(self.inner.layer_budgets()):
            if budget is None and layer not in tsa_layers:
                continue
            K = kept[layer] if layer in tsa_layers else n
            out[layer] = 1.0 - (sel.topk_map_entries(budget, K, self.inner.min_tokens) + fill(K)) / full
        return out

    def achieved_sparsity(self, cfg, positions) -> float:
        """The decode rule: TSA decodes densely (0.0); around Kascade, Kascade's decode (`Kascade.achieved_sparsity`).
        Its prefill's sparsity is measured (`prefill_layer_sparsity`)."""
        return 0.0 if self.inner is None else self.inner.achieved_sparsity(cfg, positions)

    # --------------------------------------------------------------------------------------- pieces

    def select(self, q: Array, k: Array, lengths: Array, capacity: int | None = None):
        """(counts i32[B], Selection) of one sparse layer; capacity None = T. ("kv_union": counts are the
        per-query-head counts; each KV head's union keeps at least that many.)"""
        scores, counts = self._coverage(q, k, lengths)
        cap = q.shape[1] if capacity is None else capacity
        return counts, self._selection(scores, lengths, counts, k.shape[2], cap)

    def capacities(self, T: int) -> tuple[int, ...]:
        """The static compressed capacities of a length-T prefill: `capacity_buckets` buckets and, with a
        `kept_fraction`, the count a full row keeps (so a fixed share runs at its own capacity, not the next
        bucket's)."""
        exact = None
        if self.kept_fraction is not None:  # T is static: the count in numpy
            exact = int(fixed_counts(np.asarray([T]), fraction=self.kept_fraction, window=self.window,
                                     min_tokens=self.min_tokens, xp=np)[0])
        return capacities(T, self.capacity_buckets, exact)

    def _coverage(self, q: Array, k: Array, lengths: Array):
        """(the selecting heads' scores f32[B, H, T], kept counts i32[B]) of one sparse layer."""
        scores = tsa_scores(q, k, window=self.window, pool_kernel=self.pool_kernel, lengths=lengths)
        scores = selection_scores(scores, k.shape[2], self.selection)
        if self.kept_fraction is not None:
            return scores, fixed_counts(lengths, fraction=self.kept_fraction, window=self.window,
                                        min_tokens=self.min_tokens)
        return scores, coverage_counts(scores, lengths, tau=self.tau, window=self.window, min_tokens=self.min_tokens)

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
        scores, counts = self._coverage(q, k, lengths)
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

        if self.inner is not None:
            def compressed(cap):
                sel = self._selection(scores, lengths, counts, k.shape[2], cap)
                qc, kc, vc = compress(q, k, v, sel)
                cur_map = jnp.where(sel.indices >= 0, sel.indices, T)
                cur_map = jnp.pad(cur_map, [(0, 0), (0, 0), (0, T - cap)], constant_values=T)
                out_c, st = self._inner_prefill(ctx.replace(lengths=counts, hidden=None), qc, kc, vc, state,
                                                cur_map, sel.slot)
                return decompress(out_c, sel, self._fill(q, k, v)), st

            # Kascade runs at the capacity buckets (its state padded back to T's shape); another inner method's
            # state is shaped for T queries, so it runs at capacity T.
            caps = self.capacities(T) if self._kascade else (T,)
            out, state = attend_at_capacity(largest, caps, compressed,
                                            lambda: self._dense_prefill(ctx, q, k, v, state), nothing_dropped)
            return out, state.replace(kept=kept)

        def attend(cap):
            if self.selection == "kv_union":
                s = selection_from_keep(union.keep, cap)
            else:
                s = select_tokens(scores, lengths, counts, window=self.window, capacity=cap)
            return attend_compressed(q, k, v, s, fill_rows=self._fill(q, k, v))

        out = attend_at_capacity(largest, self.capacities(T), attend,
                                 lambda: dense_prefill(q, k, v), nothing_dropped)
        return out, state.replace(kept=kept)

    def _inner_prefill(self, ctx, q, k, v, state, cur_map, cur_slot):
        """The inner method's prefill in (possibly compressed) coordinates; cur_map / cur_slot: i32[B, H, T]
        original position of each slot (T: empty) and slot of each original position (-1: not kept)."""
        ctx = ctx.replace(info=ctx.info.inner)
        if not self._kascade:
            out, inner = self.inner.prefill(ctx, q, k, v, state.inner)
            return out, state.replace(inner=inner)
        out, inner, anchor_map = kascade_mod.prefill_in_coordinates(self.inner, ctx, q, k, v, state.inner, state.anchor_map, cur_map,
                                                 cur_slot)
        return out, state.replace(inner=inner, anchor_map=anchor_map)


def load_sparse_layers(path: str, fingerprint: str | None, cfg=None) -> tuple[int, ...]:
    """The sparse layers stored in a "tsa" artifact (checked against the model's fingerprint and layers)."""
    art = load_artifact(path, ARTIFACT_KIND, fingerprint)
    if cfg is not None:  # its per-layer arrays have the calibrated model's layer count
        for name in ("drift", "normalized_rank"):
            if name in art.arrays and np.shape(art.arrays[name]) != (cfg.num_layers,):
                raise ArtifactError(f"TSA artifact at {path!r} has {name} of shape {np.shape(art.arrays[name])}: "
                                    f"expected ({cfg.num_layers},), one value per layer of this model (an artifact "
                                    "made for another model?)")
    layers = list(np.asarray(art.arrays["sparse_layers"]).ravel())  # as stored: a float is refused, not truncated
    num_layers = cfg.num_layers if cfg is not None else 1 << 30
    return check_sparse_layers(layers, num_layers)


# ----------------------------------------------------------------------------------------------- sparsity


def prefill_sparsity(params, cfg, method: TSA, tokens, lengths) -> dict:
    """Runs one prefill and reports what TSA kept: {"kept": i32[L, B], "kept_fraction": f64[L],
    "attention_map_sparsity": f64[L]} (means over rows; dense layers keep everything)."""
    kept = np.asarray(prefill_state(params, cfg, method, tokens, lengths).kept)
    return kept_summary(kept, np.asarray(lengths))

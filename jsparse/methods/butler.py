"""TokenButler: decode attention over the keys a learned ~1% predictor ranks highest (Akhauri et al., 2025).

At layer 0 of every forward the predictor (`butler_predictor.Predictor`) runs once on the layer's normed input
(`ctx.hidden`) and yields, for every later layer l >= 1 and query head h, a predicted query q'[l, h] of the new
tokens and a predicted key k'[l, h] that is appended to the method's state, so the state holds k' for every
position seen so far. The first `dense_layers` layers (and the calibrated `dense_set`) attend densely. Every other
layer ranks the visible keys by the predicted logits `q'[l, h] . k'[l, h // (Hq / Hk')] / sqrt(d')` and attends to
the top k of them (k = min(max(ceil(b * n), min_tokens), n) over the n visible keys); the first `sink` tokens and
the `local` most recent ones (the query's own included) are always kept and count toward k.

Defaults (`butler`), each measured on the development corpus (Alice, 2 windows of 1024 tokens, budget 0.5,
perplexity with decode simulated per row; dense 27.87, oracle 27.97, Quest 27.98, StreamingLLM 29.74; the committed
2000-step predictor; `jsparse bench butler_coverage` gives the per-layer numbers):
  * the paper's rule (sinks only, layer 0 dense; registered as `butler-paper`): 28.84. Selection is not the
    bottleneck's cause in the pipeline: the same rule on the true logits gives 27.93.
  * `local` most recent tokens always kept: 32: 28.27, 64: 28.25 (128: 28.52; 1/4/16: 28.81/28.75/28.65).
    Not in the paper: a recency safety net for the predictor's misses next to the query. Default 32 (with the
    two items below: 32: 27.96, 64: 27.99).
  * `dense_layers` = 2 (as Quest; with local=64): 28.23.
  * `dense_set`: per-layer calibration. The few layers where the predictor's selection loses most (largest mean
    relative attention-output error against dense on dev windows; `jsparse bench butler_coverage
    --dense-count 3` writes them into the artifact's metadata, which `build` reads) attend densely, and with
    `rebalance` (default) the other sparse layers get the smaller budget b' = (n * b - e) / (n - e) (n layers
    >= dense_layers, e of them calibrated dense), so the method keeps as many keys as with budget b everywhere
    from layer dense_layers on: the achieved sparsity equals Quest's. Layers 7, 17, 20 for the committed
    predictor (picked alike with local 32 or 64): 27.99 with local=64 (b' = 0.44), against Quest's 27.98. By
    hand, layers 7, 20, 24: 28.03 at b' = 0.44, 27.98 at b = 0.5 on the other layers (lower achieved sparsity).
  * the mean attention mass the selection covers is not what separates the methods: per layer, the paper's rule
    already covers more of the dense attention (0.965 averaged over layers and heads) than Quest (0.939), with
    a smaller attention-output error (0.052 vs 0.071), yet its perplexity is worse. A plausible reading (not
    measured): the predictor sees only layer 0's input, so its misses are correlated across layers and the
    same keys are lost everywhere. A better-trained predictor is the remaining lever (`jsparse train-predictor`).
With all three (the default): 27.96 (achieved sparsity equal to Quest's). Without the calibrated layers: 28.27
(local=32, dense_layers=1), 28.23 (local=64, dense_layers=2); calibrated layers with dense_layers=1 (local=64):
28.02.
`butler-local` is the earlier variant (local=32, no calibrated layers); `butler-paper` the paper's rule.

Selection per head. The paper selects per query head. The index contract of the gathered kernels is per KV head,
so two modes (`selection`):
  "head"   (default, the paper) every query head keeps its own top-k: the keys become a bool[B, Hq, T, N] mask
           and attention runs as the dense masked reference (`masked_attention_reference`). Exact, but O(N) work.
  "group"  the predicted post-softmax weights are summed over each GQA group and every KV head keeps one top-k
           for its group, in the index contract: attention runs through the gathered sparse kernels
           (`attend_selected`), the fast path on accelerators. On the dev corpus it costs quality (28.84 ->
           29.30 with the paper's rule): the group's heads want different keys.

One decode token with selection "head" (`gathered`, the default on a GPU without a mesh): right after the predictor
runs in layer 0, every sparse layer's keys are chosen at once (`kept_indices`: the predicted logits of all layers by
one kernel, `pallas_kernels.predicted_logits`, which writes them as the top-k's scores, -inf past the query and +inf
on its sinks and window (`forced_keys`), and one `topk_select` over all their rows) and each sparse layer attends to
its query heads' keys through one launch of the gathered decode kernel over the query heads (`common.attend_per_query_head`, reading
the stacked cache in place): the keys of `head_mask` and the same softmax as the mask path, which T > 1 tokens, the
"group" selection and the CPU by default take. Decode scans layer 0, the dense layers and the sparse layers as
separate runs (`segments`), so no layer waits on a `lax.switch`.

Prefill is dense (TokenButler is a decode method); it fills the predictor's caches for the prompt.

State (`ButlerState`, sized by `init_state(cfg, batch, max_len)`):
  attn_k, attn_v  f32[B, N, attn_heads, attn_head_dim]  the predictor's own attention cache (keys after RoPE)
  keys            f32[L', B, Hk', N, d']                  predicted keys k' of every position (L' = L - 1; bf16
                                                          with key_dtype="bfloat16")
  queries         f32[L', B, Hq, T, d']                   predicted queries of a decode forward's T tokens (added by
                                                          `start`, dropped by `finish`)
  kept            i32[L', B, Hq, 1, K]                    a gathered one-token decode's keys of every predicted
                                                          layer (added by `start`, filled in layer 0, dropped by
                                                          `finish`)

The predictor comes from `jsparse train-predictor --model M --data FILE... --steps N --out DIR`, which writes DIR as an
artifact of kind "butler" (flattened params in arrays.npz, the PredictorConfig in the metadata) keyed to the
model's fingerprint; `--method butler --artifact DIR` loads it.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jsparse import selection as sel
from jsparse.artifacts import load_artifact
from jsparse.methods.base import register
from jsparse.methods.butler_predictor import Predictor, PredictorConfig, unflatten_params
from jsparse.methods.common import (TokenBudget, attend_dense, attend_per_query_head, attend_selected, dense_prefill,
                                    kwargs_for, refuse_derived, refuse_unused, scratch)
from models.attention import runs_of
from models.sharding import constrain
from pallas_kernels.predicted_logits import predicted_logits as logits_op
from pallas_kernels.sharding import active_mesh, dims, per_shard
from pallas_kernels.sparse_attention.reference import decode_indices_to_mask, masked_attention_reference
from pallas_kernels.topk_select import topk_select

ARTIFACT_KIND = "butler"
DEFAULT_LOCAL = 32
DEFAULT_DENSE_LAYERS = 2
SELECTIONS = ("head", "group")
F32 = jnp.float32
KEY_DTYPES = ("float32", "bfloat16")  # `Butler.key_dtype`


@struct.dataclass
class ButlerState:
    attn_k: jax.Array  # f32[B, N, attn_heads, attn_head_dim]
    attn_v: jax.Array
    keys: jax.Array  # f32[L', B, Hk', N, d'] (bf16 with key_dtype="bfloat16")
    queries: Optional[jax.Array] = None  # f32[L', B, Hq, T, d'] inside a forward
    kept: Optional[jax.Array] = None  # i32[L', B, Hq, 1, K] inside a gathered one-token decode forward


def predicted_logits(qp: jax.Array, kp: jax.Array, positions: jax.Array, forced=None) -> jax.Array:
    """Predicted logits of one layer (or of a stack of layers) over the visible keys.

    Args:
      qp: f32[..., B, Hq, T, d'] predicted queries; kp: f32 or bf16 [..., B, Hk', N, d'] predicted keys (query
        head h uses key head h // (Hq / Hk')); positions: i32[B, T] query positions (query t sees keys <=
        positions[b, t]).
      forced: None, or (sink, window_start i32[B, T]) of `forced_keys`: those keys score +inf.
    Returns:
      f32[..., B, Hq, T, N]: q'k'^T / sqrt(d'), -inf on keys a query cannot see, +inf on the forced ones
      (`pallas_kernels.predicted_logits`: on a GPU a kernel reading the keys once, where XLA's dot autotuner copied
      a stack of layers' keys, and writing the bounded logits in that one pass; the same arithmetic for one layer or
      many).
    """
    *lead, Hq, T, d = qp.shape
    Hk, N = kp.shape[-3], kp.shape[-2]
    row = lambda a: a[:, None, None, :]  # noqa: E731  [B, T] -> [B, Hk', 1, T], the op's query rows [..., B, Hk', G, T]
    sink, start = forced if forced is not None else (0, None)
    # kp in the state's dtype (`Butler.key_dtype`): the op upcasts each tile it reads, so bf16 keys are read as bf16.
    return logits_op(qp.astype(F32).reshape(*lead, Hk, Hq // Hk, T, d), kp, last=row(positions), keep_first=sink,
                     keep_from=None if start is None else row(start)).reshape(*lead, Hq, T, N)


def forced_keys(positions: jax.Array, k_dyn: jax.Array, sink: int, local: int):
    """The keys every row keeps, as (sink, window_start i32[B, T]): the first `sink` positions and the `local` most
    recent ones (window_start .. the query's own position), so they are kept and counted in k; the window shrinks to
    k - sink where k is smaller than sink + local. positions, k_dyn: i32[B, T] (keys kept per row)."""
    window = jnp.clip(jnp.minimum(local, k_dyn - sink), 0)  # [B, T]
    return sink, positions - window + 1


def _with_forced(scores: jax.Array, positions: jax.Array, k_dyn: jax.Array, sink: int, local: int) -> jax.Array:
    """scores: f32[B, H, T, N] (-inf: not visible) with the visible keys of `forced_keys` at +inf."""
    sink, start = forced_keys(positions, k_dyn, sink, local)
    n = jnp.arange(scores.shape[-1])[None, None, :]
    forced = (n < sink) | (n >= start[:, :, None])  # [B, T, N]
    return jnp.where(forced[:, None] & (scores > sel.NEG_INF), jnp.inf, scores)


def head_mask(logits: jax.Array, positions: jax.Array, lengths: jax.Array, budget: float, min_tokens: int,
              K: int, sink: int, local: int = 0) -> jax.Array:
    """bool[B, Hq, T, N]: each query head's top-k keys by predicted logit (`predicted_logits`), the sinks and
    the local window first.

    Under a mesh each device selects for its own rows and heads: the predictor's logits are computed whole on every
    device, and left to XLA the selection ran for every head on every device and all-gathered the scores over the
    data axis (a [B, Hq, T, N] f32 tensor a layer, a step)."""
    N = logits.shape[-1]
    logits = constrain(logits, ("batch", "heads", None, None))
    k_dyn = sel.budget_tokens(budget, positions + 1, min_tokens)  # [B, T]
    scores = _with_forced(logits, positions, k_dyn, sink, local)
    idx = sel.topk_indices(scores, jnp.broadcast_to(k_dyn[:, None, :], scores.shape[:-1]), K, per_shard=True)
    return per_shard(lambda i, n: decode_indices_to_mask(i, n, N), [idx, lengths], [dims(4, 0, 1), dims(1, 0)],
                     dims(4, 0, 1))


def group_indices(logits: jax.Array, num_kv_heads: int, positions: jax.Array, budget: float, min_tokens: int,
                  K: int, sink: int, local: int = 0) -> jax.Array:
    """int32[B, Hkv, T, K]: per KV head, the top-k keys by predicted post-softmax weight summed over the GQA
    group (the sinks and the local window first), in the index contract. Per device under a mesh, as `head_mask`."""
    B, Hq, T, N = logits.shape
    logits = constrain(logits, ("batch", "heads", None, None))
    probs = jax.nn.softmax(logits, axis=-1).reshape(B, num_kv_heads, Hq // num_kv_heads, T, N).sum(axis=2)
    visible = (logits > sel.NEG_INF)[:, :1]  # [B, 1, T, N], the same for every head
    k_dyn = sel.budget_tokens(budget, positions + 1, min_tokens)  # [B, T]
    pooled = _with_forced(jnp.where(visible, probs, sel.NEG_INF), positions, k_dyn, sink, local)
    return sel.topk_indices(pooled, jnp.broadcast_to(k_dyn[:, None, :], pooled.shape[:-1]), K, per_shard=True)


@register("butler")
@struct.dataclass
class Butler(TokenBudget):
    """TokenButler decode (see the module docstring). `params`: the predictor's parameters (leaves)."""

    dense_prefill = True  # a decode method: its prefill attends to every key (and runs the predictor)

    params: Any = None
    pcfg: PredictorConfig = struct.field(pytree_node=False, default=None)
    sink: int = struct.field(pytree_node=False, default=4)
    local: int = struct.field(pytree_node=False, default=DEFAULT_LOCAL)
    selection: str = struct.field(pytree_node=False, default="head")
    dense_layers: int = struct.field(pytree_node=False, default=DEFAULT_DENSE_LAYERS)
    dense_set: tuple = struct.field(pytree_node=False, default=())
    rebalance: bool = struct.field(pytree_node=False, default=True)
    # One decode token with selection "head" through the gathered kernel (module docstring); None: on a GPU.
    gathered: Optional[bool] = struct.field(pytree_node=False, default=None)
    # dtype of the predicted keys kept in the state (KEY_DTYPES): "float32" (the predictor's own precision, the
    # default) or "bfloat16" (half the bytes a decode step reads for them, the logits still summed in f32: 0.57x ->
    # 0.73x dense at 100K, batch 4 on an H200; on the bundled model the same passkey completions and a perplexity
    # 0.06% apart, eval/results/cpu/butler_key_dtype/).
    key_dtype: str = struct.field(pytree_node=False, default="float32")

    def __post_init__(self):
        super().__post_init__()
        sel.check_positive_int("sink", self.sink, 0)
        sel.check_positive_int("local", self.local, 0)
        if self.dense_layers < 1:
            raise ValueError(f"dense_layers={self.dense_layers}: butler needs layer 0 dense (the predictor reads "
                             "layer 0's input), expected >= 1")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection={self.selection!r}: expected one of {SELECTIONS}")
        if self.key_dtype not in KEY_DTYPES:
            raise ValueError(f"key_dtype={self.key_dtype!r}: expected one of {KEY_DTYPES}")
        num_layers = self.pcfg.num_layers if self.pcfg is not None else np.iinfo(np.int32).max
        object.__setattr__(self, "dense_set", sel.check_layers("dense_set", self.dense_set, num_layers))

    def extra_dense(self, num_layers: int) -> tuple[int, ...]:
        """The calibrated dense layers beyond the first `dense_layers`."""
        return tuple(x for x in self.dense_set if self.dense_layers <= x < num_layers)

    def sparse_budget(self, num_layers: int) -> float:
        """The budget of the sparse layers: `budget`, or with `rebalance` and calibrated dense layers, the smaller
        budget b' that keeps the same number of keys over layers >= dense_layers as `budget` on all of them:
        b' = (n * budget - e) / (n - e) for n = L - dense_layers layers of which e are calibrated dense."""
        e = len(self.extra_dense(num_layers))
        n = num_layers - self.dense_layers
        if not e or not self.rebalance or self.budget >= 1.0:
            return self.budget
        b = (n * self.budget - e) / (n - e) if n > e else 0.0
        if b <= 0.0:
            raise ValueError(
                f"budget={self.budget} is below what this predictor's calibrated dense layers allow: dense_set="
                f"{list(self.extra_dense(num_layers))} keeps {e} of the {n} layers >= dense_layers="
                f"{self.dense_layers} dense, so with rebalance the budget must exceed {e}/{n} = {e / n:.4f} "
                f"(supported budgets: ({e / n:.4f}, 1]); for a smaller budget pass dense_set=() (every layer "
                "sparse) or rebalance=False (the dense layers on top of the budget); on the command line "
                "--method-option butler.dense_set=[] or butler.rebalance=false")
        return b

    def min_budget(self, num_layers: int) -> float:
        """The budget this method's calibrated dense layers need with `rebalance` (budgets must exceed it)."""
        e = len(self.extra_dense(num_layers))
        return e / (num_layers - self.dense_layers) if e and self.rebalance else 0.0

    def achieved_sparsity(self, cfg, positions) -> float:
        """Fraction of visible keys skipped, averaged over layers and query positions (decode rule)."""
        L = cfg.num_layers
        sparse_layers = max(L - self.dense_layers - len(self.extra_dense(L)), 0)
        return sparse_layers / L * sel.topk_sparsity(self.sparse_budget(L), positions, self.min_tokens)

    @classmethod
    def build(cls, cfg=None, artifact: str | None = None, fingerprint: str | None = None, **options):
        if not artifact:
            raise ValueError("butler needs a trained predictor: run `jsparse train-predictor --model M --data "
                             "FILE... --steps N --out DIR` and pass --artifact DIR")
        refuse_derived("butler", options, {key: (None, "its artifact") for key in ("params", "pcfg")})
        refuse_unused("butler", options, ("tile",), "its prefill is dense, with no query tiles")
        art = load_artifact(artifact, ARTIFACT_KIND, fingerprint)
        if "predictor_config" not in art.meta:
            raise ValueError(f"butler artifact at {artifact!r} has no predictor_config in its metadata")
        pcfg = PredictorConfig.from_dict(art.meta["predictor_config"])
        if options.get("dense_set") is None and "dense_set" in art.meta:
            options["dense_set"] = tuple(art.meta["dense_set"])  # the artifact's calibration (see the docstring)
        return cls.from_params(cfg, pcfg, unflatten_params(art.arrays, pcfg), **options)

    @classmethod
    def from_params(cls, cfg, pcfg: PredictorConfig, params, **options):
        """A Butler for model `cfg` with the given predictor (checked against the model's shape)."""
        if cfg is not None:
            pcfg.check_model(cfg)
        method = cls(params=params, pcfg=pcfg, **kwargs_for(cls, options))
        method.sparse_budget(pcfg.num_layers)  # a budget the calibrated dense layers cannot pay for fails here
        return method

    # -- protocol

    def check_model(self, cfg):
        """Refuses a predictor made for another model (`PredictorConfig.check_model`)."""
        if self.pcfg is not None:
            self.pcfg.check_model(cfg)

    def init_state(self, cfg, batch, max_len):
        c = self.pcfg
        return ButlerState(
            attn_k=jnp.zeros((batch, max_len, c.attn_heads, c.attn_head_dim), F32),
            attn_v=jnp.zeros((batch, max_len, c.attn_heads, c.attn_head_dim), F32),
            keys=jnp.zeros((c.predicted_layers, batch, c.key_heads, max_len, c.head_dim), self.key_dtype))

    def is_gathered(self) -> bool:
        """Whether a one-token decode with selection "head" runs gathered (`gathered`; None: on a GPU without a
        mesh)."""
        if self.selection != "head":
            return False
        if self.gathered is None:
            return jax.default_backend() == "gpu" and active_mesh() is None
        return bool(self.gathered)

    def key_width(self, n: int) -> int:
        """The static top-k width over a cache of n keys (the sparse layers' budget)."""
        return sel.budget_tokens(self.sparse_budget(self.pcfg.num_layers), n, self.min_tokens)

    def start(self, cfg, state, phase, batch, q_len, kv_len):
        c = self.pcfg
        # Prefill attends densely and reads no predicted query: none is kept (at 32K tokens of Llama-3.1-8B's
        # predictor they would be 4 GB per row).
        queries = None if phase == "prefill" else jnp.zeros((c.predicted_layers, batch, c.num_heads, q_len,
                                                              c.head_dim), F32)
        kept = None
        if phase == "decode" and q_len == 1 and self.is_gathered():
            # Replaced whole by layer 0 (`decode`'s `first`: `kept_indices`), segmented or not, before any layer
            # reads it: no fill (`scratch`).
            kept = scratch((c.predicted_layers, batch, c.num_heads, 1, self.key_width(kv_len)), jnp.int32)
        return state.replace(queries=queries, kept=kept)

    def finish(self, state, phase):
        return state.replace(queries=None, kept=None)

    def run_predictor(self, hidden, positions, state: ButlerState) -> ButlerState:
        """Runs the predictor on hidden: [B, T, E] at positions: i32[B, T]; appends k', sets this forward's q'."""
        qp, kp, ak, av = Predictor(self.pcfg).apply({"params": self.params}, hidden, positions, state.attn_k,
                                                    state.attn_v, method=Predictor.extend)
        b = jnp.arange(hidden.shape[0])[:, None]
        keys = state.keys.at[:, b, :, positions].set(kp.astype(state.keys.dtype), mode="drop")
        queries = None if state.queries is None else qp.transpose(2, 0, 3, 1, 4).astype(F32)  # None: prefill
        return state.replace(attn_k=ak, attn_v=av, keys=keys, queries=queries)

    def prefill(self, ctx, q, k, v, state):
        B, T = q.shape[:2]
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        state = jax.lax.cond(ctx.layer == 0, lambda: self.run_predictor(ctx.hidden, positions, state),
                             lambda: state)
        return dense_prefill(q, k, v), state

    def segments(self, cfg, phase: str):
        """Decode scans runs of layers of one kind apart (`models.attention.segments`): layer 0 ("first": dense, and
        the predictor runs), the dense layers (the first `dense_layers` and the calibrated `dense_set`) and the
        sparse ones, so no layer waits on a `lax.switch` (a GPU reads its predicate back to the host in every layer).
        Prefill is one run."""
        if phase != "decode":
            return None
        L = cfg.num_layers
        dense = set(range(min(self.dense_layers, L))) | set(self.extra_dense(L))
        return runs_of(["first"] + ["dense" if layer in dense else "sparse" for layer in range(1, L)])

    def decode(self, ctx, q, cache, state):
        positions = sel.decode_positions(ctx.lengths, q.shape[1])
        segment = getattr(ctx, "segment", None)

        def first():  # layer 0: dense; the predictor runs, and a gathered decode chooses every layer's keys
            st = self.run_predictor(ctx.hidden, positions, state)
            if st.kept is not None:  # a gathered one-token decode: every sparse layer's keys at once
                st = st.replace(kept=self.kept_indices(st, positions, cache.k.shape[2]))
            return attend_dense(q, cache, ctx.lengths), st

        def dense():
            return attend_dense(q, cache, ctx.lengths), state

        def sparse():
            return self.sparse_decode(ctx, q, cache, state)

        if segment is not None:  # a run of one kind (`segments`)
            return {"first": first, "dense": dense, "sparse": sparse}[segment]()
        dense_layer = ctx.layer < self.dense_layers
        for x in self.dense_set:
            dense_layer = dense_layer | (ctx.layer == x)
        branch = jnp.where(ctx.layer == 0, 0, jnp.where(dense_layer, 1, 2))
        return jax.lax.switch(branch, [first, dense, sparse])

    # -- selection

    def layer_logits(self, layer, positions, state: ButlerState):
        """f32[B, Hq, T, N] predicted logits of `layer` (>= 1) for this forward's queries (-inf: not visible)."""
        qp = jax.lax.dynamic_index_in_dim(state.queries, layer - 1, 0, keepdims=False)  # [B, Hq, T, d']
        kp = jax.lax.dynamic_index_in_dim(state.keys, layer - 1, 0, keepdims=False)  # [B, Hk', N, d']
        return predicted_logits(qp, kp, positions)

    def kept_indices(self, state: ButlerState, positions, N: int):
        """Every predicted layer's keys of selection "head" for one decode token, at once (after the predictor ran
        in layer 0; a layer's predicted logits do not depend on the layers before it): i32[L', B, Hq, 1, K]
        ascending, -1 padded, the keys of `head_mask` (the same logits, sinks and local window first, top-k by
        `topk_select`, ties to the lower position as `lax.top_k`'s)."""
        budget = self.sparse_budget(self.pcfg.num_layers)
        k_dyn = sel.budget_tokens(budget, positions + 1, self.min_tokens)  # [B, 1]
        # [L', B, Hq, 1, N], bounded as the logits are written (no masked copy of every layer's logits)
        scores = predicted_logits(state.queries, state.keys, positions,
                                  forced_keys(positions, k_dyn, self.sink, self.local))
        return topk_select(scores, jnp.broadcast_to(k_dyn[:, None, :], scores.shape[:-1]), self.key_width(N))

    def sparse_decode(self, ctx, q, cache, state):
        T, N = q.shape[1], cache.k.shape[2]
        if T == 1 and state.kept is not None:  # gathered: layer 0 chose every layer's keys (`kept_indices`)
            idx = jax.lax.dynamic_index_in_dim(state.kept, ctx.layer - 1, 0, keepdims=False)  # [B, Hq, 1, K]
            return attend_per_query_head(q, cache, idx, ctx.lengths), state
        positions = sel.decode_positions(ctx.lengths, T)
        logits = self.layer_logits(ctx.layer, positions, state)
        budget = self.sparse_budget(self.pcfg.num_layers)
        K = sel.budget_tokens(budget, N, self.min_tokens)
        if self.selection == "head":
            mask = head_mask(logits, positions, ctx.lengths, budget, self.min_tokens, K, self.sink, self.local)
            return masked_attention_reference(q, cache.k, cache.v, mask), state
        idx = group_indices(logits, cache.k.shape[1], positions, budget, self.min_tokens, K, self.sink,
                            self.local)
        return attend_selected(q, cache, idx, ctx.lengths), state


@register("butler-local")
class ButlerLocal:
    """`butler` with a 32-token local window, layer 0 dense and no calibrated dense layers (the earlier
    `butler-local`, whose dense_layers was 1; `butler`'s is 2 since bc62cbf)."""

    TAKES_ARTIFACT = True  # its predictor, passed on to `Butler.build`

    @classmethod
    def build(cls, **options):
        return Butler.build(**_variant_defaults(options, local=32, dense_layers=1, dense_set=()))


@register("butler-paper")
class ButlerPaper:
    """The paper's rule: sinks only (no local window), layer 0 dense, no calibrated dense layers."""

    TAKES_ARTIFACT = True  # its predictor, passed on to `Butler.build`

    @classmethod
    def build(cls, **options):
        return Butler.build(**_variant_defaults(options, local=0, dense_layers=1, dense_set=()))


def _variant_defaults(options: dict, **defaults) -> dict:
    """A variant's defaults for the options not given, or given as None (`local=null` on the command line would
    otherwise keep butler's own default)."""
    return {**options, **{k: v for k, v in defaults.items() if options.get(k) is None}}

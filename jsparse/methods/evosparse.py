"""EvoSparse: decode-time block sparsity from sink + local + retrieval + heat blocks.

Keys are grouped in blocks of `block_size` (16) tokens. Layers 0 .. dense_layers-1 (default 2) attend densely.
In every other layer, for each KV head, a decode query at position p attends to the union of

  * sink blocks       the first n_s blocks;
  * local blocks      the n_l most recent blocks (the query's own, partial, block included);
  * retrieval blocks  the n_r blocks outside sink and local with the largest block-max of q . K^T / sqrt(d) over
                      the layer's retrieval heads (found by `jsparse calibrate evosparse`, see
                      evosparse_calibration.py). A layer holding no retrieval head inherits the set the last
                      retrieval layer computed (cross-layer propagation; in decode it runs no scoring at all:
                      such layers are scanned apart from the scoring ones, `EvoSparse.segments`);
  * heat blocks       the n_h blocks outside the three sets above with the largest heat, where per layer, KV
                      head and block, after every decode step,  h <- lambda * h + s,  s = the post-softmax mass
                      the block received in that step's sparse attention (mean over the GQA group, so s sums to
                      1 over the blocks; 0 for blocks not attended). Selection at a step uses the heat of the
                      steps before it.

Budget (`jsparse.budget_split`). k tokens per query: `budget_tokens` (k = min(budget_tokens, p + 1)) when given,
else the fraction rule of the other methods, k = min(max(ceil(budget * (p + 1)), min_tokens), p + 1): kb =
ceil(k / block_size) blocks, split by the fractions (sink, local, retrieval, heat), which sum to 1 (small budgets
favour sink and local; the local window, which holds the query's own position, has a block at every budget).
Retrieval slots left empty (a layer before the first retrieval layer, too few candidates) go to heat; without heat
(evosparse-noheat) they stay empty, so such a layer attends its sink and local blocks only (`achieved_sparsity`
counts it). When kb covers every visible block the query attends to all of them (dense attention).

Choices the paper leaves open (documented here, measured where noted):
  * retrieval set -> KV heads: ONE set per layer shared by all KV heads, ranked by the block-max over every
    retrieval head of the layer; only the KV heads holding one are read (`kv_heads`), only in layers holding one.
  * retrieval heads (`jsparse.retrieval_heads`): the top `num_retrieval_heads` (layer, query head) pairs by
    calibrated score; default max(1, round(1.5% of L * Hq)).
  * prefill is dense (EvoSparse is a decode method). It initialises the heat as if the prompt's last
    `heat_window` (64) tokens had been decoded densely: h = sum_w lambda^(W-1-w) s_w (heat_window=0: zeros).
  * T > 1 new tokens (perplexity "decode simulated per row"): exact. The retrieval sets of all T rows are
    computed at once (they depend only on q and K); heat selection, attention and the heat update run row by row
    (`heat.scan_rows`), so row t sees the heat after rows < t exactly as T = 1 decoding would.
  * defaults: fractions (sink, local, retrieval, heat) = (1/16, 3/8, 5/16, 1/4), decay lambda = 0.5, chosen by
    a development sweep on SmolLM2 (eval/results/cpu/evosparse_dev_sweep/README.md).

Ablations (registered names): "evosparse-noheat", "evosparse-noretrieval", "sink-local" drop components; the
default fractions of the dropped ones are given to the remaining ones in proportion (the total budget stays the
same). Fractions the user gives are taken as given: those of the kept components must sum to 1, and a dropped
component's must be 0 or omitted.

State (`EvoState`): heat f32[L, B, Hkv, N / block_size] crosses decode steps (`jsparse.heat`); the retrieval set
i32[B, T, Wr] crosses layers inside one forward (`start` adds it, `finish` drops it). For one new token `start`
decays every sparse layer's heat at once and `start_rows` takes every layer's heat candidates (one top-k launch);
the candidates outside a layer's retrieval set are ranked into its blocks, for each group of layers that inherit one
set at once (`selection_groups`, `group_select`), and each sparse layer adds its mass in place
(`block_scores.sparse_decode_heat`). The heat is the recurrence above exactly; the selection sees fl(lambda * h),
which orders the blocks as h does up to rounding ties (none for lambda a power of two, as the default 0.5).
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jsparse import budget_split
from jsparse import selection as sel
from jsparse.budget_split import split_counts  # noqa: F401  (re-exported)
from jsparse.heat import (attend_with_mass, begin_rows, decay_heat, heat_step, heat_update,  # noqa: F401
                          keep_rows, prefill_heat, scan_rows)
from jsparse.methods.base import register
from jsparse.methods.common import (attend_dense, dense_prefill, kwargs_for, refuse_derived, refuse_unused,
                                    stacked_cache)
from models.attention import runs_of
from jsparse.retrieval_heads import (DEFAULT_HEAD_FRACTION, RetrievalLayout, default_num_heads,  # noqa: F401
                                     load_retrieval_heads, retrieval_blocks, retrieval_layout, top_heads)
from pallas_kernels.block_scores import (heat_candidates, select_blocks, select_from_plan, select_span,
                                         sparse_decode_heat)
from pallas_kernels.block_scores.gpu import CAND_LIMIT, make_plan
from pallas_kernels.sharding import active_mesh
from pallas_kernels.sparse_attention import sparse_decode

Array = jax.Array
ARTIFACT_KIND = "evosparse"
KERNEL_BLOCK = 128  # the sparse kernels' key block: block_size must divide it
COMPONENTS = ("sink", "local", "retrieval", "heat")
DEFAULT_FRACTIONS = (1 / 16, 3 / 8, 5 / 16, 1 / 4)  # sink, local, retrieval, heat
DEFAULT_DECAY = 0.5
DECODE_CONFIG = None  # the gathered decode's DecodeConfig on the GPU (None: the kernel's default); read when traced
# The defaults come from a development sweep on SmolLM2 (eval/results/cpu/evosparse_dev_sweep/README.md: inside
# the swept range the choice moves perplexity +-0.3%; dropping a component matters more).
DEFAULTS_NOTE = "fractions (1/16, 3/8, 5/16, 1/4), decay 0.5: chosen by the development sweep above"


@struct.dataclass
class EvoState:
    """heat: f32[L, B, Hkv, NB] (NB = max_len / block_size) decayed sparse-attention mass per block, or None
    without heat; retrieval: i32[B, T, Wr] the latest retrieval blocks (ascending, -1 padded) inside one
    decode forward, else None; heat_cand: every layer's heat candidates of a one-token decode forward (the
    n_h + n_r hottest middle blocks, `start_rows`), else None; plan: beside them, each row's block budget
    (`block_scores.gpu.make_plan`: sink, middle end, visible blocks, heat count before the retrieval set, full,
    then the retrieval count n_r), the same in every layer of the forward; sel: beside them, the attended blocks of
    every sparse layer, each group's made at once (`EvoSparse.selection_groups`)."""

    heat: Optional[Array] = None
    retrieval: Optional[Array] = None
    heat_cand: Optional[Array] = None  # i32[L, B, Hkv, Wc] inside one T = 1 decode forward (`start_rows`)
    plan: Optional[Array] = None  # i32[B, PLAN] every layer's selection plan beside heat_cand (`start_rows`)
    # i32[L, B, Hkv, Kb] the sparse layers' selections inside one T = 1 decode forward, each made with its group
    # (`EvoSparse.selection_groups`), or None
    sel: Optional[Array] = None
    heat_rows: Optional[Array] = None  # f32[L, B, Hkv, T + 1, NB] inside a speculative verification
    # i32[B, Hkv, 1] zeros inside a one-token decode forward with `finish_in_launch` (`start_rows`): the row
    # counters of the gathered decode's one-launch finish, which every launch hands back as zeros
    tickets: Optional[Array] = None


def check_fractions(fractions: Sequence[float]) -> tuple[float, ...]:
    """The budget split (sink, local, retrieval, heat): numbers >= 0 that sum to 1."""
    return budget_split.check_fractions(fractions, [f"{c}_fraction" for c in COMPONENTS])


_cumulative_fixed = budget_split.cumulative_fixed


@register("evosparse")
@struct.dataclass
class EvoSparse:
    """The method (see the module docstring). Static configuration:

    budget: fraction of the visible keys in (0, 1] (ignored when budget_tokens is given).
    budget_tokens: keys per query as a token count (e.g. 512), or None.
    min_tokens: floor of the fraction rule (as the other methods). block_size: tokens per block, dividing 128.
    sink/local/retrieval/heat_fraction: the budget split (sum to 1). decay: lambda in (0, 1).
    dense_layers: the first layers attend densely. heat_window: prompt rows that initialise the heat in prefill.
    branchless: decode without lax.cond (None: on a GPU; see `is_branchless`). Same results either way.
    kernels: implementation of the block_scores ops (None: by backend; "xla", "pallas_gpu", "reference").
    retrieval_layers: the layers holding retrieval heads, ascending (static; `from_heads` sets it from the
    layout), or None: then decode scores every layer and keeps the set of the layers that hold one.
    group_select: a one-token decode makes the selections of the layers that share their inputs at once (one
    launch on a GPU, `selection_groups`) instead of one per layer; the same blocks either way.
    finish_in_launch: on a GPU, a one-token decode layer's gathered decode also merges its splits and adds the
    mass into the heat, by the last program of each row (`block_scores.sparse_decode_heat`'s tickets), instead of a
    second launch; the same results either way.
    Leaves: layout (RetrievalLayout) or None without retrieval.
    """

    dense_prefill = True  # a decode method: its prefill attends to every key (and seeds the heat)

    layout: Optional[RetrievalLayout] = None
    retrieval_layers: Optional[tuple[int, ...]] = struct.field(pytree_node=False, default=None)
    # (Hq, Hkv) of the model the layout was placed for (`from_heads`): checked against the model it runs on, where
    # the layout's own arrays are traced (`check_model`).
    layout_heads: Optional[tuple[int, int]] = struct.field(pytree_node=False, default=None)
    budget: float = struct.field(pytree_node=False, default=0.1)
    budget_tokens: Optional[int] = struct.field(pytree_node=False, default=None)
    min_tokens: int = struct.field(pytree_node=False, default=128)
    block_size: int = struct.field(pytree_node=False, default=16)
    sink_fraction: float = struct.field(pytree_node=False, default=DEFAULT_FRACTIONS[0])
    local_fraction: float = struct.field(pytree_node=False, default=DEFAULT_FRACTIONS[1])
    retrieval_fraction: float = struct.field(pytree_node=False, default=DEFAULT_FRACTIONS[2])
    heat_fraction: float = struct.field(pytree_node=False, default=DEFAULT_FRACTIONS[3])
    decay: float = struct.field(pytree_node=False, default=DEFAULT_DECAY)
    dense_layers: int = struct.field(pytree_node=False, default=2)
    heat_window: int = struct.field(pytree_node=False, default=64)
    branchless: Optional[bool] = struct.field(pytree_node=False, default=None)
    kernels: Optional[str] = struct.field(pytree_node=False, default=None)
    group_select: bool = struct.field(pytree_node=False, default=True)
    finish_in_launch: bool = struct.field(pytree_node=False, default=True)

    def __post_init__(self):
        sel.check_budget(self.budget)
        if self.budget_tokens is not None:
            sel.check_positive_int("budget_tokens", self.budget_tokens)
        sel.check_positive_int("min_tokens", self.min_tokens, 0)
        sel.check_positive_int("block_size", self.block_size)
        if KERNEL_BLOCK % self.block_size:
            raise ValueError(f"block_size={self.block_size}: expected a divisor of the kernel block of "
                             f"{KERNEL_BLOCK} tokens (1, 2, 4, 8, 16, 32, 64 or 128)")
        check_fractions(self.fractions)
        cum = _cumulative_fixed(self.fractions)
        if self.local_fraction < 1 / budget_split.FIX or cum[1] == cum[0]:  # else split_counts might give it none
            raise ValueError(f"local_fraction={self.local_fraction!r}: expected at least 1/{budget_split.FIX} (the "
                             "local window holds the query's own position, whose block every budget attends)")
        if not sel.is_real(self.decay) or not 0.0 < float(self.decay) < 1.0:
            raise ValueError(f"decay={self.decay!r}: expected lambda in the open interval (0, 1)")
        object.__setattr__(self, "decay", float(self.decay))
        sel.check_positive_int("dense_layers", self.dense_layers, 0)
        sel.check_positive_int("heat_window", self.heat_window, 0)
        for name in ("group_select", "finish_in_launch"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name}={getattr(self, name)!r}: expected true or false")
        if self.kernels not in (None, "xla", "pallas_gpu", "reference"):
            raise ValueError(f"kernels={self.kernels!r}: expected None, 'xla', 'pallas_gpu' or 'reference'")
        if self.retrieval_layers is not None:
            layers = self.retrieval_layers
            if not all(sel.is_int(x) and x >= 0 for x in layers) or list(layers) != sorted(set(layers)):
                raise ValueError(f"retrieval_layers={layers!r}: expected ascending distinct layer indices >= 0")
            has = None if self.layout is None else self.layout.has_retrieval
            # Only a concrete layout is checked (jax also rebuilds the method from tracers and placeholders).
            has = np.asarray(has) if isinstance(has, (np.ndarray, jax.Array)) and \
                not isinstance(has, jax.core.Tracer) and np.ndim(has) == 1 else None
            if has is not None and tuple(int(x) for x in np.flatnonzero(has)) != tuple(int(x) for x in layers):
                raise ValueError(f"retrieval_layers={layers!r}: the layout's retrieval heads are in layers "
                                 f"{tuple(int(x) for x in np.flatnonzero(has))}")

    # ------------------------------------------------------------------------------------------- building

    @classmethod
    def build(cls, cfg=None, artifact: str | None = None, fingerprint: str | None = None,
              num_retrieval_heads: int | None = None, **options):
        """From options and a `jsparse calibrate evosparse` artifact (needed when retrieval_fraction > 0)."""
        source = "the retrieval heads of its artifact (`from_heads`)"
        options = refuse_derived("evosparse", kwargs_for(cls, options),
                                 {key: (None, source) for key in ("layout", "retrieval_layers", "layout_heads")})
        retrieval = options.get("retrieval_fraction", DEFAULT_FRACTIONS[2])
        if not sel.is_real(retrieval):
            raise ValueError(f"retrieval_fraction={retrieval!r}: expected a fraction of the budget in [0, 1]")
        if float(retrieval) == 0.0:  # no retrieval heads: an artifact (or their count) would be read for nothing
            for key, value in (("artifact", artifact), ("num_retrieval_heads", num_retrieval_heads)):
                if value:
                    raise ValueError(f"evosparse {key}={value!r} with retrieval_fraction=0: the retrieval heads "
                                     "are not used (leave it out, or give the retrieval blocks a share)")
            return cls(**options)
        if not artifact:
            raise ValueError("evosparse needs its retrieval heads: run `jsparse calibrate evosparse --model M "
                             "--out DIR` and pass DIR (`jsparse generate --artifact DIR`, `jsparse eval --artifact "
                             "evosparse=DIR`, artifact=DIR in Python)")
        if cfg is None:
            raise ValueError("evosparse needs the model config (cfg) to place its retrieval heads")
        heads = load_retrieval_heads(artifact, ARTIFACT_KIND, fingerprint, cfg, num_retrieval_heads)
        return cls.from_heads(cfg, heads, **options)

    @classmethod
    def from_heads(cls, cfg, heads: Sequence[tuple[int, int]], **options):
        """EvoSparse with explicit retrieval heads [(layer, query head), ...]."""
        if not heads:
            raise ValueError("no retrieval heads given: expected at least one (layer, head) pair")
        return cls(layout=retrieval_layout(cfg, heads), retrieval_layers=tuple(sorted({int(l) for l, _ in heads})),
                   layout_heads=(cfg.num_heads, cfg.num_kv_heads), **options)

    @property
    def fractions(self) -> tuple[float, float, float, float]:
        return (self.sink_fraction, self.local_fraction, self.retrieval_fraction, self.heat_fraction)

    @property
    def uses_heat(self) -> bool:
        return self.heat_fraction > 0

    @property
    def uses_retrieval(self) -> bool:
        return self.retrieval_fraction > 0

    # ------------------------------------------------------------------------------------------- budget

    @property
    def block_budget(self) -> budget_split.BlockBudget:
        # The local window (component 1) always has a block: a query attends its own position.
        return budget_split.BlockBudget(self.budget, self.min_tokens, self.block_size, self.fractions,
                                        self.budget_tokens, ensure=1)

    def widths(self, N: int) -> dict:
        """Static widths for a cache of N tokens: Kb (selected blocks), and each component's width."""
        nb, Kb, (ws, wl, wr, wh) = self.block_budget.widths(N)
        # A component in use keeps a width of at least 1 (its count may be 0: at a budget of one or two blocks
        # the local window takes them), so its top-k has an output to write.
        wr = max(wr, 1) if self.uses_retrieval else 0
        if not self.uses_heat:
            wh = 0
        elif self.uses_retrieval:
            wh = max(min(wh + wr, Kb), 1)  # heat fills retrieval slots left empty
        else:
            wh = max(wh, 1)
        return dict(nb=nb, Kb=Kb, sink=ws, local=wl, retrieval=wr, heat=wh)

    def _row_budget(self, pos: Array):
        """pos: i32[...] query positions -> (kb blocks, visible blocks, (n_s, n_l, n_r, n_h))."""
        return self.block_budget.row(pos)

    def achieved_sparsity(self, cfg, positions) -> float:
        """Fraction of visible keys not attended, over layers and query positions (decode rule, blocks rounded).

        Without heat (evosparse-noheat) the retrieval slots of a sparse layer before the first retrieval layer stay
        empty: it attends its sink and local blocks only, counted so (with static `retrieval_layers`)."""
        L = cfg.num_layers
        sparse_layers = max(L - self.dense_layers, 0)
        full = np.mean(1.0 - self.block_budget.attended_fraction(positions))
        starved = 0
        if not self.uses_heat and self.uses_retrieval and self.retrieval_layers is not None:
            first = min(self.retrieval_layers, default=L)
            starved = max(min(first, L) - self.dense_layers, 0)
        if not starved:
            return float(sparse_layers / L * full)
        p = np.asarray(positions, np.int64)
        kb, visible, (n_s, n_l, _, _) = self._row_budget(p)
        visible = np.asarray(visible)
        blocks = np.where(np.asarray(kb) >= visible, visible, np.asarray(n_s) + np.asarray(n_l))  # all, or sink + local
        part = np.mean(1.0 - budget_split.blocks_fraction(blocks, p, self.block_size))
        return float(((sparse_layers - starved) * full + starved * part) / L)

    # ------------------------------------------------------------------------------------------- protocol

    def init_state(self, cfg, batch, max_len):
        if not self.uses_heat:
            return EvoState()
        nb = -(-max_len // self.block_size)
        return EvoState(heat=jnp.zeros((cfg.num_layers, batch, cfg.num_kv_heads, nb), jnp.float32))

    def check_model(self, cfg):
        """Refuses retrieval heads placed for another model's heads (their layers: `models.attention.check_model`)."""
        if not self.uses_retrieval or self.layout is None:
            return
        want = (cfg.num_heads, cfg.num_kv_heads)
        group = self.layout.head_mask.shape[-1]  # a layout made without `from_heads`: its group size at least
        got = self.layout_heads
        if (got is not None and got != want) or group != want[0] // want[1]:
            placed = f"Hq, Hkv = {got}" if got is not None else f"GQA groups of {group} query heads"
            raise ValueError(f"evosparse's retrieval heads were placed for a model of {placed}, but this model has "
                             f"Hq, Hkv = {want}: build it for this model")

    def layer_info(self, cfg):
        if not self.uses_retrieval:
            return None
        if self.layout is None:
            raise ValueError("evosparse with retrieval_fraction > 0 needs retrieval heads (EvoSparse.from_heads or "
                             "an artifact)")
        return self.layout

    def start(self, cfg, state, phase, batch, q_len, kv_len):
        """Decode: an empty retrieval set; for one new token also every sparse layer's decay h <- lambda * h at
        once (each layer then adds its mass in place; see the module docstring). Rows of a q_len > 1 decode are
        decayed and updated row by row inside each layer (`heat_update`)."""
        if phase != "decode":
            return state
        # They belong to one forward (`start_rows`).
        state = state.replace(heat_cand=None, plan=None, sel=None, tickets=None)
        if self.uses_heat and q_len == 1:
            state = state.replace(heat=decay_heat(state.heat, self.dense_layers, self.decay))
        if not self.uses_retrieval:
            return state
        wr = self.widths(kv_len)["retrieval"]
        return state.replace(retrieval=jnp.full((batch, q_len, wr), -1, jnp.int32))

    def begin_verify(self, state, rows: int):
        """Before a speculative verification of `rows` tokens: keep the heat after each of them (`heat.begin_rows`),
        so that `end_verify` keeps the rows the round accepts."""
        return state if state.heat is None else state.replace(heat_rows=begin_rows(state.heat, rows))

    def end_verify(self, state, count):
        """After the verification: the heat after each batch row's first count[b] rows (i32[B]; a rejected row
        neither decays the heat nor adds its mass)."""
        return state if state.heat is None else state.replace(heat=keep_rows(state.heat_rows, count), heat_rows=None)

    def start_rows(self, cfg, state, phase, lengths, q_len, kv_len):
        """One-token decode: every layer's heat candidates at once (`block_scores.heat_candidates`: the n_h + n_r
        hottest middle blocks of each row, one top-k launch), so a layer only ranks those outside its retrieval
        set (`select_from_plan`); a layer's heat does not change before it runs, so the blocks are the same. The
        rows' block budget goes beside them as one plan (`plan`): each layer's selection kernel reads it, where
        each layer derived it again in XLA (five small kernels a layer on a GPU)."""
        if phase != "decode" or q_len != 1 or not self.uses_heat or state.heat is None:
            return state
        if self.finish_in_launch:
            state = state.replace(tickets=jnp.zeros(state.heat.shape[1:3] + (1,), jnp.int32))
        width = self.widths(state.heat.shape[-1] * self.block_size)["heat"]
        if width > CAND_LIMIT:  # too many candidates to rank pairwise: search each row
            return state
        plan = self.row_plan(lengths.astype(jnp.int32) - 1)
        cand = heat_candidates(state.heat, plan[:, 0], plan[:, 1], plan[:, 3], width)
        state = state.replace(heat_cand=cand, plan=plan)
        groups = self.selection_groups(state.heat.shape[0])
        if groups is None or active_mesh() is not None:
            return state
        L, B, Hkv, nb = state.heat.shape
        state = state.replace(sel=jnp.full((L, B, Hkv, self.widths(nb * self.block_size)["Kb"]), -1, jnp.int32))
        first, count = groups[0]
        return self._select_group(state, first, count, count) if count else state

    def selection_groups(self, num_layers: int):
        """With `group_select` (and heat, and static retrieval layers where there are retrieval heads): where each
        sparse layer's selection of a one-token decode is made, as ((first, count), per_layer). A sparse layer's
        selection reads its own heat and candidates, the forward's plan and the retrieval set it inherits: every
        input is known once the last retrieval layer at or before it has scored (before any layer when none has,
        or without retrieval), and its heat does not change before it runs. So the sparse layers first ..
        first + count - 1 that inherit one set are selected at once: (first, count) of `start_rows` first, then
        per_layer[l] of layer l (a scoring layer; (0, 0) for the others). None: each layer selects for itself."""
        if not (self.group_select and self.uses_heat) or (self.uses_retrieval and self.retrieval_layers is None):
            return None
        L, d = num_layers, min(self.dense_layers, num_layers)
        score = sorted(self.retrieval_layers) if self.uses_retrieval else []
        maker = {m: max([s for s in score if s <= m], default=-1) for m in range(d, L)}  # -1: `start_rows`
        made = {x: [m for m in maker if maker[m] == x] for x in set(maker.values())}
        group = {x: (ms[0], len(ms)) for x, ms in made.items()}
        return group.get(-1, (0, 0)), tuple(group.get(l, (0, 0)) for l in range(L))

    def _select_group(self, state, first, count, span: int):
        """state.sel with the selections of the sparse layers first .. first + count - 1 (count <= span) made at once
        (`block_scores.select_span`), from the current retrieval set."""
        ret = None if state.retrieval is None else state.retrieval[:, 0]
        w = self.widths(state.heat.shape[-1] * self.block_size)
        sel_ = select_span(state.heat, state.heat_cand, ret, state.plan, state.sel, first, count, span=span,
                           heat_width=w["heat"], count_less_ret=ret is not None, implementation=self.kernels)
        return state.replace(sel=sel_)

    def row_plan(self, pos: Array) -> Array:
        """i32[B, PLAN] of decode rows at positions pos: i32[B]: their block budget as the selection kernel reads it
        (`block_scores.gpu.make_plan`): sink n_s, middle end nbv - n_l, visible blocks nbv, the heat count before the
        retrieval set n_h + n_r (n_r is 0 without retrieval), full (kb >= nbv), then n_r."""
        kb, nbv, (n_s, n_l, n_r, n_h) = self._row_budget(pos)
        return make_plan(n_s, nbv - n_l, nbv, n_h + n_r, kb >= nbv, n_r)

    def finish(self, state, phase):
        return state.replace(retrieval=None, heat_cand=None, plan=None, sel=None, tickets=None)

    def prefill(self, ctx, q, k, v, state):
        out = dense_prefill(q, k, v)
        if self.uses_heat and self.heat_window > 0:  # as if the prompt's last heat_window rows were decoded
            h = prefill_heat(q, k, ctx.lengths, min(self.heat_window, q.shape[1]), self.decay, self.block_size,
                             state.heat.shape[-1])
            state = state.replace(heat=jax.lax.dynamic_update_index_in_dim(state.heat, h, ctx.layer, axis=0))
        return out, state

    def segments(self, cfg, phase: str):
        """Decode scans each run of layers of one kind apart (`models.attention.segments`), so no layer runs
        another kind's kernels, with no `lax.cond`: the dense first layers ("dense") and the sparse ones
        ("sparse"); with static `retrieval_layers`, also the layers that score their retrieval heads (tag
        suffix ":score") apart from those that inherit the set (":inherit"), which then run no scoring at all.
        Prefill is one run."""
        if phase != "decode":
            return None
        kind = lambda l: "dense" if l < self.dense_layers else "sparse"  # noqa: E731
        if self.uses_retrieval and self.retrieval_layers is not None:
            if self.retrieval_layers and self.retrieval_layers[-1] >= cfg.num_layers:
                raise ValueError(f"retrieval_layers={self.retrieval_layers}: the model has {cfg.num_layers} layers")
            held = set(self.retrieval_layers)
            return runs_of(kind(l) + (":score" if l in held else ":inherit") for l in range(cfg.num_layers))
        if not 0 < self.dense_layers < cfg.num_layers:
            return None
        return runs_of(kind(l) for l in range(cfg.num_layers))

    @property
    def is_branchless(self) -> bool:
        """Whether decode runs without `lax.cond` (branchless=None: on a GPU, where a conditional waits for its
        predicate on the host). Branchless, the retrieval scoring runs in every layer (reading no key where the
        layer holds no retrieval head) and is selected by has_retrieval (unless the layers holding one are static,
        `retrieval_layers`, and scanned apart: `segments`); called layer by layer (no ctx.segment),
        a layer runs both attentions, the other one's lengths 0 (reading nothing), and selects."""
        if self.branchless is None:
            return jax.default_backend() == "gpu"
        return bool(self.branchless)

    def decode(self, ctx, q, cache, state):
        T, N = q.shape[1], cache.k.shape[2]
        if N % self.block_size:
            raise ValueError(f"cache capacity N={N} is not a multiple of block_size={self.block_size}")
        if self.uses_heat and state.heat.shape[-1] != N // self.block_size:
            raise ValueError(f"heat state has {state.heat.shape[-1]} blocks but the cache holds "
                             f"{N // self.block_size}: init_state(max_len) must be the cache capacity {N}")
        pos = sel.decode_positions(ctx.lengths, T)  # [B, T]
        branchless = self.is_branchless
        retrieval = state.retrieval
        kind, _, scoring = (ctx.segment or "").partition(":")
        if self.uses_retrieval and scoring == "score":  # a run of layers holding retrieval heads (`segments`)
            retrieval = self.retrieval_blocks(ctx.info, q, cache, pos, plan=state.plan)
            if state.sel is not None:  # the selections of the sparse layers that inherit this set, at once
                groups = self.selection_groups(state.heat.shape[0])[1]
                span = max(c for _, c in groups)
                if span:
                    first, count = jnp.asarray(groups, jnp.int32)[ctx.layer]
                    state = self._select_group(state.replace(retrieval=retrieval), first, count, span)
        elif self.uses_retrieval and scoring != "inherit":
            if branchless:  # no retrieval heads here: the block max reads nothing and the top-k picks none
                retrieval = jnp.where(ctx.info.has_retrieval,
                                      self.retrieval_blocks(ctx.info, q, cache, pos, ctx.info.has_retrieval),
                                      state.retrieval)
            else:
                retrieval = jax.lax.cond(ctx.info.has_retrieval,
                                         lambda: self.retrieval_blocks(ctx.info, q, cache, pos),
                                         lambda: state.retrieval)
        state = state.replace(retrieval=retrieval)
        if kind == "dense":  # the model scans the dense first layers apart (`segments`)
            return attend_dense(q, cache, ctx.lengths), state
        if kind == "sparse":
            return self._sparse_decode(ctx, q, cache, state, pos)
        if not branchless:
            return jax.lax.cond(ctx.layer < self.dense_layers,
                                lambda: (attend_dense(q, cache, ctx.lengths), state),
                                lambda: self._sparse_decode(ctx, q, cache, state, pos))
        if self.dense_layers == 0:
            return self._sparse_decode(ctx, q, cache, state, pos)
        dense = ctx.layer < self.dense_layers
        out_d = attend_dense(q, cache, jnp.where(dense, ctx.lengths, 0))
        out_s, state = self._sparse_decode(ctx, q, cache, state, pos, live=~dense)
        return jnp.where(dense, out_d, out_s), state

    # ------------------------------------------------------------------------------------------- pieces

    def retrieval_blocks(self, info: RetrievalLayout, q: Array, cache, pos: Array, active=None, plan=None) -> Array:
        """The retrieval set of every new token, i32[B, T, Wr] (`retrieval_heads.retrieval_blocks` over the blocks
        outside sink and local); q: [B, T, Hq, D]; cache: the layer's view; pos: i32[B, T]; active: bool[] or
        None (False: choose no block; the caller discards the result); plan: `start_rows`'s plan of a one-token
        forward (its sink, middle end and n_r columns), or None (the budget derived here)."""
        k_all, _, layer = stacked_cache(cache)
        if plan is not None and pos.shape[1] == 1:
            n_s, hi, n_r = plan[:, 0:1], plan[:, 1:2], plan[:, 5:6]  # [B, 1] each, one slice of the plan
        else:
            _, nbv, (n_s, n_l, n_r, _) = self._row_budget(pos)
            hi = nbv - n_l
        return retrieval_blocks(info, q, k_all, layer, pos, n_s, hi,
                                n_r if active is None else jnp.where(active, n_r, 0),
                                self.widths(cache.k.shape[2])["retrieval"], self.block_size, self.kernels)

    def _sparse_decode(self, ctx, q, cache, state, pos, live=None):
        """The sparse layer; live: bool[] or None (False: a dense layer run branchless, whose attention reads
        nothing and whose heat stays)."""
        B, T, Hq, D = q.shape
        heat = state.heat
        ret = state.retrieval  # [B, T, Wr] or None
        Hkv, N = cache.k.shape[1], cache.k.shape[2]
        if T == 1:  # one decode token: the heat was decayed by `start`; the mass is added in place
            k_all, v_all, layer = stacked_cache(cache)
            grouped = state.sel is not None and getattr(cache, "layer", None) is not None and live is None and (
                ctx.segment is not None or not self.uses_retrieval)  # else a scoring layer made no group
            if grouped:  # made with its group (`selection_groups`): every layer's rows, this layer's read in place
                rows = state.sel[:, :, :, None]
            else:
                rows = self.select_blocks(heat, None if ret is None else ret[:, 0], pos[:, 0], Hkv, N,
                                          layer=ctx.layer, cand=state.heat_cand, plan=state.plan)
                if not self.uses_heat:
                    return self.attend(q[:, 0], cache, rows, pos[:, 0], live=live)[0][:, None].astype(q.dtype), state
                rows = rows[:, :, None]
            # live=False: lengths 0, so every entry's mass is 0 and the heat is unchanged. (ctx.lengths is pos + 1:
            # no kernel derives it again.)
            lengths = ctx.lengths if live is None else jnp.where(live, ctx.lengths, 0)
            res = sparse_decode_heat(q, k_all, v_all, layer, rows, lengths, heat, ctx.layer,
                                     block_size=self.block_size, implementation=self.kernels, config=DECODE_CONFIG,
                                     tickets=state.tickets, rows_out=ctx.rows_out if live is None else None)
            return res[0].astype(q.dtype), state.replace(heat=res[1], tickets=res[2] if len(res) > 2 else None)

        def row(heat_l, xs):
            q_t, ret_t, pos_t = xs  # [B, Hq, D], [B, Wr] | None, [B]
            idx = self.select_blocks(heat_l, ret_t, pos_t, Hkv, N)
            out, mass = self.attend(q_t, cache, idx, pos_t, live=live)
            if self.uses_heat:
                new = heat_update(heat_l, idx, mass, self.decay)
                heat_l = new if live is None else jnp.where(live, new, heat_l)
            return heat_l, out

        out, heat, rows = scan_rows(heat if self.uses_heat else None, ctx.layer, row, (q, ret, pos),
                                    rows=state.heat_rows)
        return out.astype(q.dtype), state.replace(heat=heat, heat_rows=rows)

    def select_blocks(self, heat_l, ret, pos, Hkv: int, N: int, layer=None, cand=None, plan=None) -> Array:
        """The attended blocks of one decode row: i32[B, Hkv, Kb] ascending, -1 padded.

        Sink [0, n_s) and local [nbv - n_l, nbv) are ranges; the retrieval blocks and the heat blocks lie between
        them and are disjoint (heat excludes the retrieval set and also fills the retrieval slots the set left
        empty); `pallas_kernels.block_scores.select_blocks` (one Triton kernel per row on the GPU) builds the
        union.

        Args:
          heat_l: f32[B, Hkv, nb] this layer's heat (None without heat), or with `layer` (i32[]) the stacked heat
          f32[L, B, Hkv, nb] (read in place); ret: i32[B, Wr] the retrieval set (or None); pos: i32[B] the query
          positions; Hkv, N: KV heads and cache length; cand: the stacked heat candidates of `start_rows`
          (with `layer`), or None (search the heat row); plan: `start_rows`'s plan of these positions beside cand
          (the rows' budget read in-kernel), or None (`row_plan`).
        """
        w = self.widths(N)
        if cand is not None and heat_l is not None:
            plan = self.row_plan(pos) if plan is None else plan
            return select_from_plan(heat_l, cand, ret, plan, num_kv_heads=Hkv, width=w["Kb"], heat_width=w["heat"],
                                    layer=layer, count_less_ret=ret is not None, implementation=self.kernels)
        kb, nbv, (n_s, n_l, n_r, n_h) = self._row_budget(pos)
        n_ret_valid = jnp.zeros_like(n_r) if ret is None else jnp.sum(ret >= 0, axis=-1)
        count = n_h + (n_r - n_ret_valid) if ret is not None or self.uses_retrieval else n_h
        return select_blocks(heat_l, ret, n_s, nbv - n_l, nbv, count, kb >= nbv, num_kv_heads=Hkv, nb=w["nb"],
                             width=w["Kb"], heat_width=w["heat"], layer=None if heat_l is None else layer,
                             implementation=self.kernels)

    def attend(self, q_t: Array, cache, idx: Array, pos: Array, live=None):
        """Attention of one row q_t: [B, Hq, D] at positions pos: i32[B] over blocks idx: i32[B, Hkv, K]: (out:
        [B, Hq, D], mass f32[B, Hkv, K] per entry with heat (`heat.attend_with_mass`), else None); live=False:
        lengths 0 (the kernel reads nothing; a dense layer run branchless)."""
        lengths = pos + 1 if live is None else jnp.where(live, pos + 1, 0)
        k_all, v_all, layer = stacked_cache(cache)
        if not self.uses_heat:
            out = sparse_decode(q_t[:, None], k_all, v_all, idx[:, :, None], lengths, layer=layer,
                                block_size=self.block_size)
            return out[:, 0], None
        return attend_with_mass(q_t, k_all, v_all, layer, idx, lengths, self.block_size, self.kernels,
                                DECODE_CONFIG)


# ----------------------------------------------------------------------------------------------- ablations


def ablation_fractions(fractions: Sequence[float], drop: Sequence[str]) -> tuple[float, ...]:
    """The fractions with the `drop` components set to 0 and the rest scaled up in proportion (sum 1)."""
    return budget_split.drop_components(fractions, COMPONENTS, drop)


def _ablation(name: str, drop: tuple[str, ...]):
    def build(cfg=None, artifact=None, fingerprint=None, **options):
        if "heat" in drop:
            refuse_unused(name, options, ("decay", "heat_window"), "this ablation keeps no heat")
        given = tuple(options.pop(f"{c}_fraction", None) for c in COMPONENTS)
        for c, g in zip(COMPONENTS, given):
            if c in drop and g is not None and (not sel.is_real(g) or g != 0):
                raise ValueError(f"{c}_fraction={g!r}: this ablation drops the {c} component (0 or omit it)")
        kept = [c for c in COMPONENTS if c not in drop]
        if any(g is not None for c, g in zip(COMPONENTS, given) if c in kept):  # the user's split: as given
            fr = tuple(0.0 if c in drop else (d if g is None else g)
                       for c, g, d in zip(COMPONENTS, given, DEFAULT_FRACTIONS))
            check_fractions(fr)  # the kept components' fractions must sum to 1 (not rescaled behind the user)
        else:
            fr = ablation_fractions(DEFAULT_FRACTIONS, drop)  # the defaults of the kept components, scaled to sum 1
        options.update({f"{c}_fraction": f for c, f in zip(COMPONENTS, fr)})
        return EvoSparse.build(cfg=cfg, artifact=artifact if "retrieval" not in drop else None,
                               fingerprint=fingerprint, **options)
    build.TAKES_ARTIFACT = "retrieval" not in drop  # without retrieval heads there is nothing to read
    return build


register("evosparse-noheat")(_ablation("evosparse-noheat", ("heat",)))
register("evosparse-noretrieval")(_ablation("evosparse-noretrieval", ("retrieval",)))
register("sink-local")(_ablation("sink-local", ("retrieval", "heat")))

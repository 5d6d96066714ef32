"""The correctness check of `jsparse bench model`: each method's decode step against its own masked reference.

Before anything is timed, every method of the run decodes on a small model of the run's shape family (the
preset with 8 layers, 2 KV heads of the preset's group size and head dimension, random weights in the run's
dtype; `check_config`), with its state built as the timed run builds it (`eval.bench.model.bench_method`; only
EvoSparse's token budget is scaled to the small context, 128 tokens instead of 2048, so that it selects):

  1. a batch of 2 prompts of 384 and 301 random tokens is prefilled by the library's `models.llama.prefill`
     (so the method's state, heat, scores or predicted keys, is the one a real decode starts from); where the
     timed run has rows of batch 1, a batch of one prompt of 301 tokens is checked too (`CHECK_ONE_ROW`): a step
     can take another path for one query row (the anchor layers' pooling, `AnchorConfig.pool="auto"`);
  2. `steps` (2) decode steps run the library's step, `models.llama.decode(params, cfg, method, ...)`, the
     function the timed `fori_loop` calls, jitted. In the same jitted call the model decodes the same token
     again with the method wrapped in a probe (`Probe`): at every layer the probe calls the method's own `decode`
     on that layer's q and cache, builds from the method's own state and selection functions the mask of the
     keys it selected (`SELECTED`), and measures the method's attention output against
     `masked_attention_reference` (a dense softmax over exactly those keys). The probe returns the method's
     output, so every layer sees the inputs of the real step (a near tie in a later layer's top-k cannot make
     the two runs choose different keys);
  3. the probe's logits must equal the plain step's (the probe changed nothing; `probe_logits_tol` leaves room
     for the compiler fusing the two programs differently), and every element of every layer's attention output,
     over rows, heads and steps, must satisfy |out - ref| <= rtol * |ref| + atol.

The JSON's `check` per method: `reference` (what the mask is read from), `max_abs_err` (largest |out - ref|),
`tol` (rtol, atol and the rule), `err_over_tol` (the largest |out - ref| / (rtol |ref| + atol): passes at <= 1),
`passed`, `shape`, per layer the error and the fraction of the visible keys the method kept
(`kept_fraction_per_layer`: a check over a dense selection would prove little), `wrong_selection_err_over_tol`
(the same ratio against the reference with every selected key moved one position later, what an off-by-one
selection would score: above 1 where the check can tell such a selection; one or two keys of a few hundred
moved, as for dense, can stay below) and `seconds` (the check's wall time, compiles included). With more than one
batch checked (`run_checks(shapes=...)`) these fields are the worst batch's (a failed one first, else the largest
`err_over_tol`), `passed` holds only if every batch passed, and `by_shape` lists each batch's `batch`, `lengths`,
`err_over_tol` and `passed`. `run_checks` raises `CheckFailed` naming the methods that failed, with their errors.

Tolerances, by the output dtype, atol = atol_v * max|v| of the layer's cache:
  * bf16: rtol 2^-6, atol_v 2^-8. The kernel and the reference each round the output once (one unit in the last
    place, <= 2^-7 |out|: rtol allows two), and the GPU kernels multiply the softmax weights rounded to bf16 by
    V: each weight is off by at most the unit roundoff u = 2^-8 relative, so the output by at most
    u * sum_i p_i |v_i| <= u * max|v| (atol_v = u). That bound is reached only where one weight dominates, and
    there |ref| ~ |v| and rtol covers it; spread weights round in both directions and their errors cancel.
  * f16: the same reasoning with 3 more mantissa bits: rtol 2^-9, atol_v 2^-11.
  * f32: rtol 1e-3, atol_v 2e-3 (a GPU kernel may multiply f32 in TF32, 10 mantissa bits; the reference runs at
    HIGHEST precision). On the CPU the f32 errors are ~1e-6 (tests/test_bench_model.py).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jsparse import selection as sel
from models import llama
from models.cache import init_cache
from models.params import random_params, with_layout
from pallas_kernels.sparse_attention.reference import decode_indices_to_mask, masked_attention_reference

CHECK_LAYERS, CHECK_KV_HEADS, CHECK_HIDDEN, CHECK_VOCAB = 8, 2, 256, 512
CHECK_LENGTHS = (384, 301)  # the batch of 2 prompts (ragged: the second row is padded to 384 = 3 x 128)
CHECK_ONE_ROW = (301,)  # the batch of one prompt, checked beside it where the run times batch 1
CHECK_STEPS = 2
CHECK_CAPACITY = 512
CHECK_EVO_TOKENS = 128  # EvoSparse's token budget at the check's context (the timed run: 2048 of 32K-128K)
# (rtol, atol_v) by dtype: an element passes where |out - ref| <= rtol * |ref| + atol_v * max|v| (module docstring).
TOLERANCES = {"bfloat16": (2.0 ** -6, 2.0 ** -8), "float16": (2.0 ** -9, 2.0 ** -11), "float32": (1e-3, 2e-3)}


class CheckFailed(RuntimeError):
    """A method's decode step disagrees with its masked reference (the message names methods and errors)."""


def check_config(cfg):
    """The small model of the check: cfg with 8 layers, hidden 256, 2 KV heads of cfg's GQA group size (Hq = 2G)
    and cfg's head dimension, vocabulary 512; everything else (RoPE, q/k norm, biases) kept."""
    G = cfg.num_heads // cfg.num_kv_heads
    return dataclasses.replace(cfg, num_layers=CHECK_LAYERS, hidden_size=CHECK_HIDDEN,
                               intermediate_size=2 * CHECK_HIDDEN, num_heads=CHECK_KV_HEADS * G,
                               num_kv_heads=CHECK_KV_HEADS, vocab_size=CHECK_VOCAB, layer_windows=(),
                               sliding_window=None)


# ------------------------------------------------------------------------------------------- selected keys
# SELECTED[name](method, ctx, q, cache, state_in, state_out) -> bool[B, Hkv or Hq, T, N]: the keys the method's
# decode of this layer attended, from its own state (state_in: before the layer, state_out: after it) and its own
# selection functions. q: [B, T, Hq, D]; cache: the layer's LayerKV (k, v: [B, Hkv, N, D]).


def visible_keys(ctx, q, cache):
    """bool[B, Hkv, T, N]: every key a decode query may see (dense attention)."""
    B, T = q.shape[:2]
    Hkv, N = cache.k.shape[1], cache.k.shape[2]
    pos = sel.decode_positions(ctx.lengths, T)  # [B, T]
    vis = jnp.arange(N)[None, None, :] <= pos[:, :, None]
    return jnp.broadcast_to(vis[:, None], (B, Hkv, T, N))


def _dense_below(method, ctx, q, cache, sparse_mask):
    """The first `method.dense_layers` layers attend densely (TokenBudget's switch)."""
    return jnp.where(ctx.layer < method.dense_layers, visible_keys(ctx, q, cache), sparse_mask)


def _oracle(m, ctx, q, cache, s_in, s_out):
    from jsparse.methods.oracle import select_decode
    N = cache.k.shape[2]
    pos = sel.decode_positions(ctx.lengths, q.shape[1])
    idx = select_decode(q, cache.k, pos, m.budget, m.min_tokens, m.k_static(N), m.tile)
    return _dense_below(m, ctx, q, cache, decode_indices_to_mask(idx, ctx.lengths, N))


def _streaming(m, ctx, q, cache, s_in, s_out):
    from jsparse.methods.streaming import sink_window
    B, T = q.shape[:2]
    Hkv, N = cache.k.shape[1], cache.k.shape[2]
    pos = sel.decode_positions(ctx.lengths, T)
    idx = sink_window(pos + 1, sel.budget_tokens(m.budget, pos + 1, m.min_tokens), m.sink, m.k_static(N))
    idx = jnp.broadcast_to(idx[:, None], (B, Hkv) + idx.shape[1:])
    return _dense_below(m, ctx, q, cache, decode_indices_to_mask(idx, ctx.lengths, N))


def _quest(m, ctx, q, cache, s_in, s_out):
    from jsparse.methods.quest import page_mask
    pos = sel.decode_positions(ctx.lengths, q.shape[1])
    mask = page_mask(q, cache.k, pos, m.budget, m.min_tokens, m.page_size)  # [B, Hq, T, N]
    vis = jnp.repeat(visible_keys(ctx, q, cache), q.shape[2] // cache.k.shape[1], axis=1)
    return jnp.where(ctx.layer < m.dense_layers, vis, mask)


def _h2o(m, ctx, q, cache, s_in, s_out):
    _one_token("h2o", q)
    N = cache.k.shape[2]
    score = jax.lax.dynamic_index_in_dim(s_in.score, ctx.layer, 0, keepdims=False)  # before this step's update
    keep = m.kept_keys(score, ctx.lengths - 1, m.k_static(N))  # [B, Hkv, N]
    return _dense_below(m, ctx, q, cache, keep[:, :, None])


def _kascade(m, ctx, q, cache, s_in, s_out):
    from jsparse.methods.kascade import ROLE_ANCHOR, ROLE_DENSE_ANCHOR
    N = cache.k.shape[2]
    if m.reuse_scale != 1.0:
        raise ValueError(f"kascade reuse_scale={m.reuse_scale}: the check reads an anchor's selection from the state, "
                         "which holds the anchor's own top-k only at reuse_scale 1 (the benchmark's Kascade)")
    anchor = decode_indices_to_mask(s_out.indices, ctx.lengths, N)  # the anchor's selection, handed on
    reuse = decode_indices_to_mask(jnp.take(s_in.indices, ctx.info.head_map, axis=1), ctx.lengths, N)
    role = ctx.info.role
    return jnp.where(role == ROLE_DENSE_ANCHOR, visible_keys(ctx, q, cache),
                     jnp.where(role == ROLE_ANCHOR, anchor, reuse))


def _evosparse(m, ctx, q, cache, s_in, s_out):
    _one_token("evosparse", q)
    Hkv, N = cache.k.shape[1], cache.k.shape[2]
    pos = sel.decode_positions(ctx.lengths, 1)[:, 0]
    ret = None if s_out.retrieval is None else s_out.retrieval[:, 0]  # the set this layer used
    idx = m.select_blocks(s_in.heat, ret, pos, Hkv, N, layer=ctx.layer, cand=s_in.heat_cand)  # [B, Hkv, Kb]
    mask = decode_indices_to_mask(idx[:, :, None], ctx.lengths, N, block_size=m.block_size)
    return _dense_below(m, ctx, q, cache, mask)


def _butler(m, ctx, q, cache, s_in, s_out):
    from jsparse.methods.butler import group_indices, head_mask
    T, N = q.shape[1], cache.k.shape[2]
    pos = sel.decode_positions(ctx.lengths, T)
    budget = m.sparse_budget(m.pcfg.num_layers)
    K = sel.budget_tokens(budget, N, m.min_tokens)
    layer = jnp.maximum(ctx.layer, 1)  # layer 0 has no predicted logits (it is dense)
    logits = m.layer_logits(layer, pos, s_in)  # the predictor ran in layer 0 of this step
    if m.selection == "head":
        mask = head_mask(logits, pos, ctx.lengths, budget, m.min_tokens, K, m.sink, m.local)  # [B, Hq, T, N]
    else:
        idx = group_indices(logits, cache.k.shape[1], pos, budget, m.min_tokens, K, m.sink, m.local)
        mask = jnp.repeat(decode_indices_to_mask(idx, ctx.lengths, N), q.shape[2] // cache.k.shape[1], axis=1)
    dense = ctx.layer < m.dense_layers
    for x in m.dense_set:
        dense = dense | (ctx.layer == x)
    vis = jnp.repeat(visible_keys(ctx, q, cache), q.shape[2] // cache.k.shape[1], axis=1)
    return jnp.where(dense, vis, mask)


# What each method's mask is read from (the JSON's `reference`).
REFERENCE = {
    "dense": "every visible key",
    "kascade": "layer 0 every visible key; an anchor the indices it hands on in its state (KascadeState.indices); "
               "a reuse layer the state's indices of the latest anchor through its head map",
    "evosparse": "first dense_layers every visible key; then the blocks of EvoSparse.select_blocks on the state's "
                 "heat (and heat candidates) and the retrieval set the layer used, in blocks of block_size",
    "quest": "first dense_layers every visible key; then quest.page_mask (per query head)",
    "streaming": "streaming.sink_window: the sink tokens and the recent window",
    "oracle": "layer 0 every visible key; then oracle.select_decode (exact pooled top-k, the diagonal tile kept)",
    "h2o": "H2O.kept_keys on the state's accumulated score before the step: the recent window and the heavy hitters",
    "butler": "dense layers every visible key; then, on the predictor's logits in the state (Butler.layer_logits), "
              "butler.head_mask per query head (selection 'head') or butler.group_indices (selection 'group')",
}


def _one_token(name, q):
    if q.shape[1] != 1:
        raise ValueError(f"the {name} check decodes one token per step; got T={q.shape[1]}")


SELECTED: dict[str, Callable] = {
    "dense": lambda m, ctx, q, cache, s_in, s_out: visible_keys(ctx, q, cache),
    "kascade": _kascade, "evosparse": _evosparse, "quest": _quest, "streaming": _streaming, "oracle": _oracle,
    "h2o": _h2o, "butler": _butler,
}


# ------------------------------------------------------------------------------------------- the probe


@struct.dataclass
class ProbeState:
    """The method's own state (`inner`) and, per layer, f32[L]: the largest |out - ref| of the method's
    attention output against the reference (`err`), the largest |out - ref| / (rtol |ref| + atol) (`ratio`; the
    check passes where it is <= 1), the same ratio against the reference over the mask shifted one key later
    (`wrong`), the largest |v| of the layer's cache (`vmax`; atol = atol_v * vmax) and the fraction of the
    visible keys the mask keeps (`kept`)."""

    inner: Any
    err: jax.Array
    ratio: jax.Array
    wrong: jax.Array
    vmax: jax.Array
    kept: jax.Array


def token_rows(out, q_shape):
    """A method's decode attention as [B, T, Hq, D]: out as it is, or its token rows when the method answered in
    the GEMMs' padded rows [1, R, Hq, D] (`models.attention.LayerContext.rows_out`: the model pads on a GPU).
    Before 2026-12-07 the probe compared those [1, R] rows with the [B, T] reference by broadcasting, so every
    method answering there (EvoSparse's one-launch finish since 30bea18) failed its check on a GPU."""
    B, T = q_shape[:2]
    if out.shape[:2] == (B, T):
        return out
    if out.shape[0] != 1 or out.shape[1] < B * T:
        raise ValueError(f"decode attention of shape {tuple(out.shape)}: expected [{B}, {T}, ...] or the GEMMs' "
                         f"rows [1, R >= {B * T}, ...]")
    return out[0, :B * T].reshape((B, T) + out.shape[2:])


@struct.dataclass
class Probe:
    """Wraps a method: every layer runs the method's own `decode` and measures its output against
    `masked_attention_reference` over `selected(...)`, the keys the method chose; returns the method's output."""

    inner: Any
    selected: Callable = struct.field(pytree_node=False)
    rtol: float = struct.field(pytree_node=False, default=2.0 ** -7)
    atol_v: float = struct.field(pytree_node=False, default=2.0 ** -8)

    def layer_info(self, cfg):
        return self.inner.layer_info(cfg)

    def segments(self, cfg, phase):
        fn = getattr(self.inner, "segments", None)
        return None if fn is None else fn(cfg, phase)

    def start(self, cfg, state, phase, batch, q_len, kv_len):
        fn = getattr(self.inner, "start", None)
        return state if fn is None else state.replace(inner=fn(cfg, state.inner, phase, batch, q_len, kv_len))

    def start_rows(self, cfg, state, phase, lengths, q_len, kv_len):
        fn = getattr(self.inner, "start_rows", None)
        return state if fn is None else state.replace(inner=fn(cfg, state.inner, phase, lengths, q_len, kv_len))

    def finish(self, state, phase):
        fn = getattr(self.inner, "finish", None)
        return state if fn is None else state.replace(inner=fn(state.inner, phase))

    def decode(self, ctx, q, cache, state):
        out, inner = self.inner.decode(ctx, q, cache, state.inner)
        mask = self.selected(self.inner, ctx, q, cache, state.inner, inner)
        ref = masked_attention_reference(q, cache.k, cache.v, mask).astype(jnp.float32)
        rows = token_rows(out, q.shape)  # measured as [B, T, Hq, D]; the model takes `out` as the method gave it
        vis = visible_keys(ctx, q, cache)
        if mask.shape[1] != vis.shape[1]:
            vis = jnp.repeat(vis, mask.shape[1] // vis.shape[1], axis=1)
        shifted = jnp.roll(mask, 1, axis=-1) & vis  # every selected key one position later (key 0 dropped)
        wrong = masked_attention_reference(q, cache.k, cache.v, shifted).astype(jnp.float32)
        kept = jnp.sum(mask & vis) / jnp.maximum(jnp.sum(vis), 1)
        vmax = jnp.max(jnp.abs(cache.v.astype(jnp.float32)))
        outf = rows.astype(jnp.float32)
        ratio = lambda a, b: jnp.max(jnp.abs(a - b) / (self.rtol * jnp.abs(b) + self.atol_v * vmax))  # noqa: E731
        at = lambda a, x: a.at[ctx.layer].max(x)  # noqa: E731
        return out, ProbeState(inner=inner, err=at(state.err, jnp.max(jnp.abs(outf - ref))),
                               ratio=at(state.ratio, ratio(outf, ref)), wrong=at(state.wrong, ratio(outf, wrong)),
                               vmax=at(state.vmax, vmax), kept=at(state.kept, kept))


@functools.partial(jax.jit, static_argnames=("cfg", "selected", "rtol", "atol_v"))
def checked_step(params, method, tok, cache, state, *, cfg, selected, rtol, atol_v):
    """One decode step of `models.llama.decode` (the timed loop's step) and the same step probed.

    Returns ((next tokens i32[B, 1], cache, state) of the plain step, (max |plain - probed| logits, max |plain
    logits|), and the probe's per-layer err, ratio, wrong, vmax, kept: f32[L] each (`ProbeState`))."""
    logits, new_cache, new_state = llama.decode(params, cfg, method, tok, cache, state)
    zeros = jnp.zeros((cfg.num_layers,), jnp.float32)
    probe = Probe(inner=method, selected=selected, rtol=rtol, atol_v=atol_v)
    start = ProbeState(inner=state, err=zeros, ratio=zeros, wrong=zeros, vmax=zeros, kept=zeros)
    p_logits, _, p = llama.decode(params, cfg, probe, tok, cache, start)
    tok = jnp.argmax(logits[:, -1:], -1).astype(jnp.int32)
    diff = (jnp.max(jnp.abs(logits - p_logits)), jnp.max(jnp.abs(logits)))
    return (tok, new_cache, new_state), diff, (p.err, p.ratio, p.wrong, p.vmax, p.kept)


@functools.partial(jax.jit, static_argnames=("cfg", "capacity"))
def _prefill(params, method, tokens, lengths, *, cfg, capacity):
    B = tokens.shape[0]
    cache = init_cache(cfg, B, capacity, params.embed.dtype)
    logits, cache, state = llama.prefill(params, cfg, method, tokens, lengths, cache,
                                         method.init_state(cfg, B, capacity))
    return jnp.argmax(logits, -1).astype(jnp.int32)[:, None], cache, state


def check_method(name: str, method, cfg, params, *, lengths=CHECK_LENGTHS, steps: int = CHECK_STEPS,
                 capacity: int = CHECK_CAPACITY) -> dict:
    """The check of one method on model `cfg` with `params`: prefill of len(lengths) random prompts, then `steps`
    checked decode steps. Returns the JSON's check dict (see the module docstring)."""
    if name not in SELECTED:
        raise ValueError(f"no masked reference for method {name!r}: expected one of {sorted(SELECTED)}")
    dtype = jnp.dtype(params.embed.dtype).name
    if dtype not in TOLERANCES:
        raise ValueError(f"check dtype {dtype}: expected one of {sorted(TOLERANCES)}")
    rtol, atol_v = TOLERANCES[dtype]
    B, T = len(lengths), max(lengths)
    tokens = jax.random.randint(jax.random.key(11), (B, T), 0, cfg.vocab_size)
    tok, cache, state = _prefill(params, method, tokens, jnp.asarray(lengths, jnp.int32), cfg=cfg, capacity=capacity)
    per_step, logit_diff, logit_max = [], 0.0, 0.0
    for _ in range(steps):
        (tok, cache, state), d, probe = checked_step(params, method, tok, cache, state, cfg=cfg,
                                                     selected=SELECTED[name], rtol=rtol, atol_v=atol_v)
        logit_diff, logit_max = max(logit_diff, float(d[0])), max(logit_max, float(d[1]))
        per_step.append(np.stack([np.asarray(x) for x in probe]))
    err, ratio, wrong, vmax, kept = np.max(np.stack(per_step), axis=0)  # [L] each, the worst step
    finite = bool(np.isfinite(err).all() and np.isfinite(ratio).all())
    # The probe returns the method's output, so its logits equal the plain step's up to the compiler's freedom
    # to fuse the two programs differently (an output ulp of some layer, carried on): rtol of the largest logit.
    logit_tol = rtol * max(logit_max, 1.0)
    passed = bool(finite and ratio.max() <= 1.0 and logit_diff <= logit_tol)
    return {
        "reference": "masked_attention_reference over the keys the method selected: " + REFERENCE[name],
        "max_abs_err": float(err.max()),
        "tol": {"rtol": rtol, "atol": atol_v * float(vmax.max()),
                "rule": "elementwise |out - ref| <= rtol * |ref| + atol, atol = atol_v * max|v|", "atol_v": atol_v},
        "err_over_tol": float(ratio.max()), "passed": passed,
        "wrong_selection_err_over_tol": float(wrong.max()),
        "probe_logits_max_diff": logit_diff, "probe_logits_tol": logit_tol,
        "err_per_layer": [float(x) for x in err], "kept_fraction_per_layer": [round(float(x), 4) for x in kept],
        "shape": {"layers": cfg.num_layers, "hidden": cfg.hidden_size, "heads": cfg.num_heads,
                  "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "batch": B, "lengths": list(lengths),
                  "decode_steps": steps, "capacity": capacity, "dtype": dtype},
    }


def merge_checks(checks: list[dict]) -> dict:
    """One method's check dict over several batches (`check_method`'s dicts, one a batch): the worst batch's
    fields (a failed one first, else the largest err_over_tol), `passed` only if every batch passed, and
    `by_shape`: each batch's batch, lengths, err_over_tol and passed."""
    if not checks:
        raise ValueError("merge_checks: expected at least one check")
    worst = min(checks, key=lambda c: (c["passed"], -c["err_over_tol"]))
    return {**worst, "passed": all(c["passed"] for c in checks),
            "by_shape": [{"batch": c["shape"]["batch"], "lengths": c["shape"]["lengths"],
                          "err_over_tol": c["err_over_tol"], "passed": c["passed"]} for c in checks]}


def run_checks(shape_cfg, methods, build: Callable, dtype=jnp.bfloat16, *, raise_on_failure: bool = True,
               seed: int = 0, layout: str = "default", shapes=(CHECK_LENGTHS,)) -> dict[str, dict]:
    """The check of every method of a run at model shape `shape_cfg` (the preset of the timed run): {name: check
    dict}. build(name, cfg) -> the method as the timed run builds it, for the check's model config `cfg`
    (`eval.bench.model.bench_method`). Raises CheckFailed naming each failed method, its error and tolerance
    (after checking them all). layout: the weights' layout (`models.params.with_layout`), as the timed run's.
    shapes: the prompt lengths of each batch checked (`merge_checks` joins them; `CHECK_ONE_ROW` for batch 1)."""
    cfg = check_config(shape_cfg)
    params = with_layout(random_params(cfg, jax.random.key(seed), dtype), layout, donate=True)
    out = {}
    for name in methods:
        t0 = time.perf_counter()
        try:
            method = build(name, cfg)
            out[name] = merge_checks([check_method(name, method, cfg, params, lengths=lengths) for lengths in shapes])
        except Exception as e:  # noqa: BLE001 - a check that cannot run fails, naming the error
            out[name] = {"passed": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        c = out[name]
        c["seconds"] = round(time.perf_counter() - t0, 1)  # compiles included
        print(f"check {name}: " + ("passed" if c["passed"] else "FAILED") +
              (f" (max_abs_err {c['max_abs_err']:.3g}, err/tol {c['err_over_tol']:.3g}; a selection one key off: "
               f"err/tol {c['wrong_selection_err_over_tol']:.3g}; probe logits diff {c['probe_logits_max_diff']:.3g})"
               if "max_abs_err" in c else f" ({c['error']})"), flush=True)
    failed = {n: c for n, c in out.items() if not c["passed"]}
    if failed and raise_on_failure:
        raise CheckFailed(failure_message(failed))
    return out


def failure_message(failed: dict[str, dict], timed: bool = False) -> str:
    """What a failed check says; timed: the run timed the methods before checking them (`eval.bench.model`)."""
    parts = []
    for n, c in failed.items():
        if "error" in c:
            parts.append(f"{n}: the check did not run ({c['error']})")
        else:
            t = c["tol"]
            parts.append(f"{n}: max_abs_err {c['max_abs_err']:.4g}, {c['err_over_tol']:.3g}x the tolerance "
                         f"(rtol {t['rtol']:.3g}, atol {t['atol']:.3g})" if not c["err_over_tol"] <= 1.0
                         else f"{n}: probed logits differ from the plain step's by {c['probe_logits_max_diff']:.4g} "
                              f"> {c['probe_logits_tol']:.3g}")
    return ("decode step differs from its masked reference on the check shape: " + "; ".join(parts) +
            (" (the run's JSON holds the timings beside the failed checks: do not use those methods' figures; "
             "`--no-check` skips the check)" if timed else " (nothing timed; `--no-check` skips the check)"))

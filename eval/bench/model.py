"""End-to-end benchmark of the model with every method: prefill time and decode tokens/s beside the floors.

Random weights of a real model shape (default Llama-3.1-8B), bf16. For each method, context and batch: prefill
of the whole context (time, TFLOP/s) and decode steps with a cache holding the context (tokens/s), beside the
floors: prefill FLOPs over the measured matmul rate; decode bytes per step (every weight once + the K/V and the
selection state the method must read) over the measured HBM bandwidth.

    python -m eval.bench.model --shape llama3-8b --context 8192,32768 --batch 1,8 --out bench.json
    python -m eval.bench.model --methods dense,kascade,evosparse,quest,streaming,oracle,h2o,butler \\
        --context 32768,100000 --batch 1,4 --out bench_methods.json

`--batch max` (with `--methods`) times each context at the largest batch at which every listed method's cache and
state fit beside the weights (`largest_batch`, from the device's free memory; the issue's "largest that fits"):

    python -m eval.bench.model --methods dense,kascade,evosparse --context 131072 --batch 1,4,max --out b.json

The decode loop is the library's own decode (`models.llama.decode` in a jitted `fori_loop`, the cache and the method's
state carried and donated); `--loop generate` times `jsparse generate`'s own loop instead
(`models.generate.decode_loop`: a `while_loop` that stops on the tokens, with its sampling and bookkeeping). Methods
whose calibration means nothing on random weights get synthetic state of the right shape (the JSON's `state` field says
which): Kascade 5 anchors evenly spread (layer 0 first) with the identity head map; EvoSparse 1.5% of the heads as
retrieval heads drawn at random (as eval/bench/evosparse.py); TokenButler a randomly initialised predictor of the
model's preset size. `tsa` and `tsa+kascade` are prefill methods: `tsa` decodes as dense and `tsa+kascade` exactly as
`kascade` (TSA hands Kascade's per-role runs of layers on), so they get prefill rows only (`--prefill-context`, which
they need). Random weights give flat attention, on which TSA's coverage keeps nearly every token, so both keep a fixed
share of every row (`TSA.kept_fraction`, `--tsa-kept`, default 0.68: the paper's 54% attention-map sparsity), the
selection still TSA's own scoring; `tsa+kascade` runs Kascade's synthetic state inside the compressed space.

`--attention-only` cuts the preset's hidden and MLP widths to 512 and keeps its attention (layers, heads, KV heads,
head dim): the prefill and decode rows then time each method's whole-model attention, its selection state
included, through the model's own path (issue 19's whole-model attention figures, with TSA's overhead in):

    python -m eval.bench.model --methods dense,kascade,tsa,tsa+kascade --context '' --prefill-context 131072 \\
        --attention-only --out bench_attention_only.json

In the same process, after the timing, each method's decode step is checked against its own masked reference on a
small model of the same shape family (eval/bench/model_check.py: 8 layers, batch 2, prompts of 384 and 301 tokens,
and one prompt of 301 where the run times batch 1; the run's dtype; the method and its state built as here): at
every layer the method's attention output must equal a dense softmax over exactly the keys it selected (read from
its own state and selection functions) within |out - ref| <= rtol * |ref| + atol. The JSON's `methods` holds each
method's `check`; a failed check ends the run with a non-zero exit naming the method and its error (the JSON is
written first, its rows beside the failure). `--no-check` skips it. The check runs after the timing because run
before it, it slowed every timed step by 1-4% (H200, 100K, batch 4, alternating runs: dense 16.38-16.41 ->
16.60-16.61 ms, EvoSparse 6.70 -> 6.94 ms; eval/results/h200/fixed_cost/order_*.json).

Run it with JAX's default preallocation (the bench sets its fraction to 0.95 unless XLA_PYTHON_CLIENT_MEM_FRACTION
is set). With XLA_PYTHON_CLIENT_PREALLOCATE=false the allocator grows on demand and keeps the earlier rows' regions in
pieces: on an H100 every 100K, batch 4 row then ran out of memory allocating one 24.4 GiB cache half
(eval/results/h100/generate_loop/NOTES.md). The bench warns when that variable is false and records it in the JSON.

Decode timing: one untimed call of `--steps` steps from the filled cache (its time per step is the row's
`first_call_step_ms`: the first steps after a fill, with any one-time work a method does there, such as H2O ranking
every score once, and the first execution's own costs), then one timed call of as many steps going on from where the
first left off (`step_ms`: steady-state decode, each method's state the one its own steps left).

Each row carries `speedup` (dense step time / the method's, dense measured in the same run),
`floor_speedup` (dense bytes per step / the method's bytes per step, weights included) and their ratio
`floor_fraction`, the issue's "share of its own bytes-floor speedup".
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench import common as bm
from jsparse.xla_flags import GPU_XLA_FLAGS
from jsparse.methods import make_method
from models import llama
from models.cache import KVCache, init_cache
from models.generate import Sampling, decode_loop, default_unroll_layers, round_up, stop_ids
from models.params import LAYOUTS, is_fused, random_params, with_layout
from models.presets import preset
from models.compile_options import model_jit


def merged_xla_flags(current: str, extra: str) -> str:
    """XLA_FLAGS `current` with the flags of `extra` appended (a later flag wins), each one not already there
    verbatim: the `jsparse` command has set the defaults that `--xla-flags` repeats, and the JSON records the result."""
    present = current.split()
    return " ".join(present + [f for f in extra.split() if f not in present])


def param_bytes(params) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))


def decode_bytes(cfg, params, batch: int, context: int) -> int:
    """Bytes a decode step must read: every weight once (one embedding row only) + the K/V of the context."""
    emb = params.embed.size * params.embed.dtype.itemsize
    weights = param_bytes(params) - emb + cfg.hidden_size * 2 * batch
    if params.lm_head is None:
        weights += emb  # tied: the LM head reads the embedding matrix
    kv = 2 * cfg.num_layers * batch * cfg.num_kv_heads * context * cfg.head_dim * 2
    return weights + kv


def prefill_flops(cfg, batch: int, T: int) -> float:
    """Matmul FLOPs of one prefill: every layer's weights at each of the T positions, causal attention (half of
    T x T), the LM head at each row's last position only (the prefill returns the last logits). Runs before
    2026-11-27 (`bench_model_llama3-8b.json`, `bench_model_methods_32k.json`) counted the LM head at every position,
    about 4% more at Llama-3.1-8B's shape."""
    vocab = cfg.vocab_size * cfg.hidden_size
    per_token = cfg.num_params() - vocab - (0 if cfg.tie_word_embeddings else vocab)  # the embedding is a lookup
    attn = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * T * T / 2
    return batch * (2 * per_token * T + 2 * vocab + attn)


@functools.partial(model_jit, static_argnames=("cfg", "steps"), donate_argnames=("cache",))
def decode_steps(params, method, tok, cache, *, cfg, steps):
    def body(_, carry):
        tok, cache = carry
        logits, cache, _ = llama.decode(params, cfg, method, tok, cache, None)
        return jnp.argmax(logits, -1).astype(jnp.int32), cache
    return jax.lax.fori_loop(0, steps, body, (tok, cache))


@functools.partial(model_jit, static_argnames=("cfg",))
def prefill_only(params, method, tokens, *, cfg):
    """(logits, the kept counts i32[L, B] TSA records per layer, or None for the other methods) of one prefill."""
    B, T = tokens.shape
    cache = init_cache(cfg, B, T, params.embed.dtype)
    state = method.init_state(cfg, B, T)
    logits, cache, state = llama.prefill(params, cfg, method, tokens, jnp.full((B,), T, jnp.int32), cache, state)
    return logits, getattr(state, "kept", None)


def bench_params(cfg, layout: str = "default", dtype=jnp.bfloat16, seed: int = 0):
    """Random weights of `cfg` in `layout` for the benchmarks, drawn and fused in one jitted program.

    One program, so that the weights are its outputs, allocated side by side, and its f32 draws are its temporaries,
    freed above them. Drawn leaf by leaf and fused afterwards (`with_layout(random_params(...))` eagerly), they
    left holes between the weights: on an H200 at Llama-3.1-8B shapes, 15 GiB of weights left 118 GiB free, yet the
    largest free block was 109 GiB. Then the two 56 GiB caches of 128K, batch 7 did not fit, though 112 GiB did
    (eval/results/h200/largest_batch/, `oom_probe.py`)."""
    build = jax.jit(lambda key: with_layout(random_params(cfg, key, dtype), layout))
    return build(jax.random.key(seed))


MAX_BATCH = "max"  # `--batch max`: the largest batch at which every method's decode case fits (`largest_batch`)
BATCH_HEADROOM = 2**30  # beside the caches and states: decode temporaries (35-154 MB at 128K, batch 7 on the H200)


def decode_memory(cfg, method, capacity: int, dtype) -> tuple[int, int]:
    """(bytes per batch row, bytes whatever the batch) of a decode case: the K and V caches and the method's state,
    its shapes from `method.init_state` (nothing allocated)."""
    cache_row = 2 * cfg.num_layers * cfg.num_kv_heads * capacity * cfg.head_dim * jnp.dtype(dtype).itemsize

    def state_bytes(batch):
        state = jax.eval_shape(lambda: method.init_state(cfg, batch, capacity))
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))

    one, two = state_bytes(1), state_bytes(2)
    return cache_row + two - one, 2 * one - two


def allocator_warning(env=os.environ) -> str | None:
    """The warning `main` prints when XLA_PYTHON_CLIENT_PREALLOCATE turns JAX's preallocation off (the module
    docstring says why the large rows need it); None when preallocation is on."""
    value = env.get("XLA_PYTHON_CLIENT_PREALLOCATE")
    if value is None or value.strip().lower() not in ("false", "0"):
        return None
    return (f"XLA_PYTHON_CLIENT_PREALLOCATE={value}: the allocator grows on demand and splits its free memory "
            "between rows, so the large rows may run out of memory (on an H100 every 100K, batch 4 row did, "
            "eval/results/h100/generate_loop/NOTES.md); unset it for figures that need the whole device")


def memory_stats(device=None) -> dict:
    """The allocator's statistics of `device` (default: the first), which `--batch max` reads; ValueError naming
    the device when it reports none (the CPU)."""
    device = device or jax.devices()[0]
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        raise ValueError(f"--batch {MAX_BATCH} needs a device that reports its memory (memory_stats); {device} does "
                         "not: expected explicit batch sizes")
    return stats


def _memory_gib(device=None) -> dict | None:
    """The allocator's bytes in use and largest free block of `device` (default: the first), in GiB, for a row of
    the JSON (what an out-of-memory row had beside it); None on a device that reports no memory (the CPU)."""
    try:
        stats = memory_stats(device)
    except ValueError:
        return None
    return {k: round(stats.get(k, 0) / 2**30, 3) for k in ("bytes_limit", "bytes_in_use", "largest_free_block_bytes")}


def largest_batch(cfg, methods, capacity: int, dtype, device=None) -> int:
    """The largest batch at which the decode case of every method in `methods` (method objects) fits beside what
    `device` (default: the first) holds now: caches and state (`decode_memory`) plus BATCH_HEADROOM within the
    allocator's free bytes, or its largest free block if smaller (each cache is one buffer; the weights of
    `bench_params` leave one block, eval/results/h200/largest_batch/). On the H200 with Llama-3.1-8B weights that
    is batch 7 at 128K, the largest measured there."""
    stats = memory_stats(device)
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    free = min(free, stats.get("largest_free_block_bytes", free)) - BATCH_HEADROOM
    fits = []
    for method in methods:
        per_row, fixed = decode_memory(cfg, method, capacity, dtype)
        fits.append((free - fixed) // per_row)
    batch = int(min(fits))
    if batch < 1:
        raise ValueError(f"--batch {MAX_BATCH}: not even batch 1 fits at capacity {capacity} ({free / 2**30:.1f} "
                         f"GiB free beside the weights); expected a shorter context")
    return batch


def parse_batches(text: str) -> list:
    """'1,4,max' -> [1, 4, "max"]: positive batch sizes and MAX_BATCH, else ValueError naming the value."""
    out = []
    for x in (x.strip() for x in text.split(",")):
        if not x:
            continue
        if x == MAX_BATCH:
            out.append(x)
        elif x.isdigit() and int(x) >= 1:
            out.append(int(x))
        else:
            raise ValueError(f"--batch: {x!r} is not a batch size: expected positive integers or {MAX_BATCH!r}")
    return out


def probe_model(shape: str, smoke: bool = False):
    """(cfg, random bf16 params in the default layout) of a preset, for the probes under eval/results that time the
    model's step through `method_rows`; smoke: a 4-layer, 256-wide model of the preset's kind (a probe's harness on a
    CPU)."""
    cfg = preset(shape)
    if smoke:
        cfg = dataclasses.replace(cfg, num_layers=4, hidden_size=256, intermediate_size=512, num_heads=4,
                                  num_kv_heads=2, head_dim=64, vocab_size=512)
    return cfg, with_layout(random_params(cfg, jax.random.key(0), jnp.bfloat16), "default", donate=True)


def probe_rows(cfg, params, runs, apply, context: int, hbm: float, steps: int = 16) -> list[dict]:
    """A probe's decode rows: for each (name, method, batch, setting) of `runs`, apply(setting) (the probe's change
    to what the step traces, None the library's), then that method's `method_rows` row afresh (its traces cleared),
    with `variant` = name; a run that raises (a config that cannot compile) gives a row with its error. apply(None)
    last."""
    rows = []
    for name, method, batch, setting in runs:
        try:
            apply(setting)
            jax.clear_caches()
            row = method_rows(cfg, params, (method,), (context,), (batch,), steps, hbm, 0.1)[0]
        except Exception as e:  # noqa: BLE001 - recorded, the other runs still go
            row = dict(method=method, batch=batch, error=f"{type(e).__name__}: {e}"[:500])
        row.update(variant=name)
        rows.append(row)
        print(f"{method} b{batch} {name}: {row.get('step_ms', float('nan')):.3f} ms", flush=True)
    apply(None)
    return rows


def probe_record(command: str, rows: list, **fields) -> dict:
    """A probe's JSON: the device facts, its `command` (how to run it again), its other fields and its rows."""
    return {**bm.device_facts(), "command": command, **fields, "rows": rows}


def filled_cache(cfg, batch, context, capacity, dtype, seed: int = 3):
    """A cache whose first `context` positions (all `capacity`, in fact) hold random normal keys and values, drawn
    layer by layer into one buffer each (no temporary as large as the cache).

    Random everywhere, not a tiled block: a cache that repeats every few hundred positions gives every score
    hundreds of exact ties, the worst case of the exact top-k selections (before 2026-11-25 this cache repeated a
    256-position block, and Kascade's anchor selection fell back to its slow path on most rows)."""
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim)

    @jax.jit
    def fill(key):
        put = lambda i, buf: buf.at[i].set(jax.random.normal(jax.random.fold_in(key, i), shape[1:], dtype))  # noqa
        return jax.lax.fori_loop(0, shape[0], put, jnp.zeros(shape, dtype))

    return KVCache(k=fill(jax.random.key(seed)), v=fill(jax.random.key(seed + 1)),
                   lengths=jnp.full((batch,), context, jnp.int32))


def filled_state(method, cfg, cache: KVCache, capacity: int, seed: int = 5):
    """(the method's decode state as a run would have it after a prefill of `cache`, how it was made).

    A zero state (`init_state`) makes every head, row and layer choose the same keys: Quest's page bounds all 0
    score every page alike, and the ties go to the lowest pages; zero H2O scores, EvoSparse heat and TokenButler
    keys likewise. The step then reads fewer distinct bytes than its byte model counts (Quest's G query heads'
    page sets are one), which flattered the share of the runs before 2026-12-03. So:
      Quest: the page bounds of the cache's keys, layer by layer (`quest.page_bounds`, its own prefill rule);
      any other state (H2O's scores, EvoSparse's heat, TokenButler's predictor cache and keys): random normal
        values of the state's shapes and dtypes, drawn leaf by leaf along the leading axis (synthetic: what a
        prefill would leave depends on weights that are random here; each head's choice differs, as in a run);
        integer leaves (H2O's carried candidates, stale after a prefill) as `init_state` makes them.
    """
    from jsparse.methods.quest import Quest, QuestState, finite_bounds, page_bounds

    batch = cache.k.shape[1]
    shapes = jax.eval_shape(lambda: method.init_state(cfg, batch, capacity))
    if isinstance(method, Quest):
        @jax.jit
        def bounds(k, lengths):
            return jax.lax.map(lambda kl: finite_bounds(*page_bounds(kl, lengths, method.page_size)), k)

        kmin, kmax = bounds(cache.k, cache.lengths)
        return QuestState(kmin=kmin, kmax=kmax), "the cache's page bounds (Quest's prefill rule)"
    if not jax.tree_util.tree_leaves(shapes):
        return method.init_state(cfg, batch, capacity), "none"

    def fill(shape, key, init):
        if not jnp.issubdtype(shape.dtype, jnp.floating):
            return init
        if len(shape.shape) < 2:
            return jax.random.normal(key, shape.shape, shape.dtype)

        @jax.jit
        def draw(key):  # one leading slice at a time: no temporary as large as the leaf
            put = lambda i, buf: buf.at[i].set(  # noqa: E731
                jax.random.normal(jax.random.fold_in(key, i), shape.shape[1:], shape.dtype))
            return jax.lax.fori_loop(0, shape.shape[0], put, jnp.zeros(shape.shape, shape.dtype))
        return draw(key)

    leaves, tree = jax.tree_util.tree_flatten(shapes)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    ints = [not jnp.issubdtype(sh.dtype, jnp.floating) for sh in leaves]
    # The integer leaves' own values (an index -1 means "none"; zeros would name key 0), made only where there are any,
    # in one jit that returns them alone: the float leaves (H2O's scores) are not allocated a second time.
    def int_leaves():
        return [x for x, i in zip(jax.tree_util.tree_leaves(method.init_state(cfg, batch, capacity)), ints) if i]
    made = iter(jax.jit(int_leaves)() if any(ints) else ())
    inits = [next(made) if i else None for i in ints]
    state = jax.tree_util.tree_unflatten(tree, [fill(sh, k, i) for sh, k, i in zip(leaves, keys, inits)])
    return state, "random normal values of its shapes (synthetic: each head's choice differs, as in a run)"


ATTENTION_ONLY_WIDTH = 512  # the hidden and MLP width of `--attention-only`


def attention_only_config(cfg):
    """The preset with its hidden and MLP widths cut to ATTENTION_ONLY_WIDTH: the same attention (layers, heads, KV
    heads, head dim) through the model's own prefill and decode, with projections and MLP about 1% of a 128K
    prefill (Llama-3.1-8B: 44 TFLOP of projections against 4.5 PFLOP of attention), so a method's whole-model time
    is its attention's (and its selection state's) across all layers."""
    return dataclasses.replace(cfg, hidden_size=ATTENTION_ONLY_WIDTH, intermediate_size=ATTENTION_ONLY_WIDTH)


# -------------------------------------------------------------------------------------------- the methods

METHODS = ("dense", "kascade", "evosparse", "quest", "streaming", "oracle", "h2o", "butler")
PREFILL_METHODS = ("tsa", "tsa+kascade")  # prefill rows only: their decode is dense's / Kascade's
# Built without --budget (`bench_method`), and what each keeps instead.
UNBUDGETED = {"dense": "dense attends to every key", "evosparse": "EvoSparse keeps its 2048-token budget",
              "tsa": "TSA its --tsa-kept share"}


def unread_budget(budget: float | None, methods, subject: str | None = None) -> str | None:
    """The error of a --budget that none of `methods` (names, or variants NAME:...) reads, each of UNBUDGETED; None
    when one reads it or none was given. subject: how the message names the methods (default: their list)."""
    names = list(dict.fromkeys(m.split(":")[0] for m in methods))
    if budget is None or not all(m in UNBUDGETED for m in names):
        return None
    subject = subject or f"{sorted(set(methods))} are"
    return f"--budget {budget:g}: {subject} built without it ({', '.join(UNBUDGETED[m] for m in names)})"
KASCADE_ANCHORS = 5
TSA_KEPT = 0.68  # the paper's operating point: 1 - 0.68^2 = 54% attention-map sparsity


def kascade_anchors(cfg, count: int = KASCADE_ANCHORS) -> list[int]:
    """`count` anchor layers evenly spread over the model, layer 0 first: the synthetic Kascade state of a model of
    random weights (calibration on random weights means nothing)."""
    return sorted({round(i * cfg.num_layers / count) for i in range(count)})


def bench_method(name: str, cfg, budget: float, evo_budget_tokens: int | None = None, tsa_kept: float = TSA_KEPT,
                 options: dict | None = None):
    """(method, how its state was made) for the benchmark at model shape `cfg`; evo_budget_tokens: EvoSparse's
    token budget (None: the benchmark's 2048; the correctness check's small context takes a smaller one);
    tsa_kept: the fixed kept share of `tsa` and `tsa+kascade` (see the module docstring); options: more keyword
    options of the method (`--method-option`, e.g. {"tile": 128} for kascade; tsa+kascade's are split between
    Kascade and TSA as its builder splits them)."""
    from jsparse.methods.base import check_options
    options = dict(options or {})
    method, how = _bench_method(name, cfg, budget, evo_budget_tokens, tsa_kept, options)
    check_options(name, options, method)  # a misspelled option is an error, not ignored
    return method, how


def _bench_method(name, cfg, budget, evo_budget_tokens, tsa_kept, options):
    said = f"; options {options}" if options else ""
    if name == "dense":
        if options:
            raise ValueError(f"dense takes no options, got {options}")
        return make_method("dense"), "none"
    if name in ("kascade", "tsa+kascade"):
        from jsparse.methods.kascade import Kascade
        from jsparse.methods.tsa_kascade import around_kascade, split_options
        kascade_options, tsa_options = split_options(options) if name == "tsa+kascade" else (options, {})
        anchors = kascade_anchors(cfg)
        kascade = Kascade.from_anchors(cfg, anchors, **{"budget": budget, **kascade_options})
        how = f"synthetic: anchors {anchors}, identity head map (calibration on random weights means nothing)"
        if name == "kascade":
            return kascade, how + said
        return (around_kascade(kascade, **{"kept_fraction": tsa_kept, **tsa_options}),
                f"{how}; TSA keeps a fixed {tsa_kept} of every row (coverage on random weights keeps nearly all)"
                f"{said}")
    if name == "tsa":
        from jsparse.methods.tsa import TSA
        return (TSA(**{"kept_fraction": tsa_kept, **options}),
                f"synthetic: a fixed {tsa_kept} of every row kept (coverage on random weights keeps nearly all){said}")
    if name == "evosparse":
        from eval.bench import evo_layout as be
        from jsparse.methods.evosparse import EvoSparse
        heads = be.model_heads(cfg)
        tokens = be.BUDGET_TOKENS if evo_budget_tokens is None else evo_budget_tokens
        return (EvoSparse.from_heads(cfg, heads, **{"budget_tokens": tokens, "block_size": be.BLOCK, **options}),
                f"synthetic: {len(heads)} retrieval heads drawn at random (seed 0), budget {tokens} tokens "
                f"in blocks of {be.BLOCK}{said}")
    if name == "butler":
        from jsparse.methods.butler import Butler
        from jsparse.methods.butler_predictor import init_params
        from train.predictor import preset_config
        pcfg = preset_config(cfg)
        return (Butler.from_params(cfg, pcfg, init_params(pcfg, jax.random.key(7)), **{"budget": budget, **options}),
                "synthetic: a randomly initialised predictor of the preset size (training on random weights means "
                f"nothing){said}")
    if name in ("quest", "streaming", "oracle", "h2o"):
        return make_method(name, **{"budget": budget, **options}), "none (no calibration)" + said
    raise ValueError(f"unknown method {name!r} for the model benchmark: expected some of "
                     f"{list(METHODS + PREFILL_METHODS)}")


def attention_bytes(name: str, method, cfg, batch: int, n: int) -> int:
    """Bytes one decode step's attention must read over all layers at context n: K/V rows (bf16) and the
    selection state the method reads (and writes) per step. Counted from the method as built, its options included
    (dense layers, budgets, Kascade's roles and reuse budget, EvoSparse's token budget, blocks and components,
    TokenButler's calibrated dense layers)."""
    from jsparse import selection as sel
    U = batch * cfg.num_kv_heads * cfg.head_dim * 2  # one token position of K (or V), all rows and KV heads
    L = cfg.num_layers
    dense_layer = 2 * n * U
    if name == "dense":
        return L * dense_layer
    min_tokens = getattr(method, "min_tokens", 128)
    if name == "evosparse":
        from eval.bench import evo_layout as be
        d = min(method.dense_layers, L)
        tokens = method.block_budget.keys(n)  # EvoSparse's own rule: a token count, else the fraction rule
        block = method.block_size
        heads = be.model_heads(cfg) if method.uses_retrieval else []
        kinds = be.layer_kinds(cfg, heads, d)
        fl = {R: be.attention_floors(batch, n, 1.0, R, cfg, sel=-(-tokens // block) * block, block=block,
                                     heat=method.uses_heat) for R in kinds}
        return d * dense_layer + sum(c * fl[R]["retrieval_bytes"] for R, c in kinds.items())

    def picked(budget):  # the K and V rows of a budget's selection
        return 2 * sel.budget_tokens(budget, n, min_tokens) * U

    # The exact pooled scores of a layer that scores every key (Kascade's anchors, the oracle's sparse layers): each
    # query head's f32 logits written by the scoring pass and read by the pooling (the pooled score needs every
    # head's logsumexp over the whole row first: `pallas_kernels.anchor_attention.gpu`), and the f32 pooled scores
    # written and read once by the selection. Counted since 2026-12-06 (omitted before, which overstated these two
    # methods' floors by 0.3-8%), as H2O's scores and Quest's bounds are.
    scores = batch * cfg.num_kv_heads * n * (2 * cfg.num_heads // cfg.num_kv_heads * 4 + 2 * 4)
    if name == "kascade":  # layer 0 dense; each anchor scores the whole K, then reads its picked rows
        from jsparse.methods.kascade import ROLE_ANCHOR, ROLE_DENSE_ANCHOR
        roles = np.asarray(method.roles)
        dense, anchors = int((roles == ROLE_DENSE_ANCHOR).sum()), int((roles == ROLE_ANCHOR).sum())
        return (dense * (dense_layer + scores) + anchors * (n * U + scores + picked(method.budget))
                + (L - dense - anchors) * picked(method.reuse_budget))
    d = min(method.dense_layers, L)
    if name == "oracle":  # exact scores over K, then the picked rows
        return d * dense_layer + (L - d) * (n * U + scores + picked(method.budget))
    if name == "streaming":
        return d * dense_layer + (L - d) * picked(method.budget)
    if name == "quest":  # per-page min and max of K (f32, `QuestState`) + each query head's pages
        # Quest picks pages per query head: a KV head's G query heads read up to G sets (their union; with the cache's
        # own page bounds they rarely overlap). Counted as G sets since 2026-11-28 (one set before, which overstated
        # the floor); the bounds as f32 since 2026-12-03 (counted as bf16 before, which overstated it too).
        pages = -(-n // method.page_size)
        G = cfg.num_heads // cfg.num_kv_heads
        return d * dense_layer + (L - d) * (2 * 2 * pages * U + G * picked(method.budget))
    if name == "h2o":
        # The gathered decode's selection ranks the W carried candidates of each row (their positions read and
        # written, their scores gathered: `H2OState.cand`) instead of the whole accumulated score row (f32), which
        # was counted here before 2026-12-06 (rows * n * 4 a layer); the k kept entries' scores are updated.
        # With carry=False the whole score row again. The kept keys' entry sums, each query head's f32 written by the
        # gathered decode and read by the mass add (the mass needs the group's log-sum-exp over every split first:
        # `block_scores.gpu`), are counted since 2026-12-07 (omitted before, as Kascade's logits were until
        # 2026-12-06, which overstated H2O's floor by 1-2%).
        rows = batch * cfg.num_kv_heads
        k = sel.budget_tokens(method.budget, n, min_tokens)
        ranked = 3 * rows * method.kept_width(k) * 4 if method.carry else rows * n * 4
        sums = 2 * rows * k * (cfg.num_heads // cfg.num_kv_heads) * 4
        return d * dense_layer + (L - d) * (2 * k * U + ranked + 2 * rows * k * 4 + sums)
    if name == "butler":  # the predicted keys of every predicted layer (f32, or bf16 with key_dtype) + the picked rows
        # Selection "head" picks per query head: a KV head's G query heads read up to G sets (counted as G since
        # 2026-11-29, when the gathered decode came; one set before, which overstated the floor). The calibrated
        # dense layers (dense_set) read the whole cache; the others pick at the rebalanced budget.
        c = method.pcfg
        d += len(method.extra_dense(L))
        G = cfg.num_heads // cfg.num_kv_heads if method.selection == "head" else 1
        keys = (L - 1) * batch * c.key_heads * n * c.head_dim * jnp.dtype(method.key_dtype).itemsize
        # The predictor's own attention block reads its f32 K/V cache in full, and its f32 weights, every step.
        predictor = 2 * batch * n * c.attn_heads * c.attn_head_dim * 4 + 4 * c.num_params()
        return d * dense_layer + (L - d) * G * picked(method.sparse_budget(L)) + keys + predictor
    raise ValueError(f"no byte model for method {name!r}")


LOOPS = ("fori", "generate")


@functools.partial(model_jit, static_argnames=("cfg", "steps", "unroll", "loop"), donate_argnames=("cache", "state"))
def method_decode_steps(params, method, tok, cache, state, *, cfg, steps, unroll: int | bool = 1,
                        loop: str = "fori"):
    """`steps` greedy decode steps of `models.llama.decode` (the library's step), carrying the method's state;
    unroll: the layer scan's (`models.llama.decode`'s `unroll`; True unrolls it in full).

    loop: "fori", a `fori_loop` of `steps` (a known trip count), or "generate", `generate_tokens`' own loop
    (`models.generate.decode_loop`: a `while_loop` whose stop the tokens decide, with its sampling, EOS and
    output bookkeeping; greedy, no EOS id given; `generate_tokens(unroll_layers=True)` unrolls its layer scan)."""
    if loop == "generate":
        B = tok.shape[0]
        res = decode_loop(params, method, tok[:, 0], cache, state, jax.random.key(0), cfg=cfg, sampling=Sampling(),
                          eos=stop_ids(()), stop=steps + 1,
                          out=jnp.full((B, steps + 1), -1, jnp.int32), done=jnp.zeros((B,), bool),
                          num=jnp.ones((B,), jnp.int32), unroll=unroll)
        return res[0][:, None], res[1], res[2]
    if loop != "fori":
        raise ValueError(f"loop={loop!r}: expected one of {LOOPS}")

    def body(_, carry):
        tok, cache, state = carry
        logits, cache, state = llama.decode(params, cfg, method, tok, cache, state, unroll=unroll)
        return jnp.argmax(logits, -1).astype(jnp.int32), cache, state
    return jax.lax.fori_loop(0, steps, body, (tok, cache, state))


STEPS = 16  # decode steps timed per case (`--steps`)


def layer_unroll(layer_scan: str | None) -> int | bool:
    """`llama.decode`'s unroll for "unrolled" (True), "rolled" (1) or None (generate's default on this backend,
    `models.generate.default_unroll_layers`)."""
    if layer_scan is None:
        layer_scan = "unrolled" if default_unroll_layers() else "rolled"
    if layer_scan not in ("unrolled", "rolled"):
        raise ValueError(f"layer_scan={layer_scan!r}: expected 'unrolled', 'rolled' or None")
    return True if layer_scan == "unrolled" else 1


def decode_capacity(context: int, steps: int = STEPS) -> int:
    """The cache capacity of a decode case: `context` tokens and `steps` decode steps, with room for twice the steps,
    rounded up to 256 (the same for every method of a case; `jsparse bench profile_decode_step` and `op_census` size
    theirs by it too)."""
    return round_up(context + 2 * steps + 1, 256)


def method_rows(cfg, params, methods, contexts, batches, steps, hbm, budget, prefill_contexts=(),
                mm: float = 0.0, built: dict | None = None, tsa_kept: float = TSA_KEPT,
                method_options: dict | None = None, unroll: int | bool | None = None,
                loop: str = "fori") -> list[dict]:
    """Decode rows (and prefill rows at `prefill_contexts`, batch 1) of every method; dense first. The prefill
    methods (PREFILL_METHODS) get prefill rows only. unroll: the decode layer scan's (None: generate's default on
    this backend, `layer_unroll`), loop: the decode loop (`method_decode_steps`).

    built: {row name: (method, how its state was made)} for names whose method is not `bench_method(name)`'s
    (a variant named "method:variant" takes the byte model of "method"; eval/bench/profile_decode_step.py)."""
    import time

    rows = []
    unroll = layer_unroll(None) if unroll is None else unroll
    weights = decode_bytes(cfg, params, 1, 0)
    opts = method_options or {}
    built = {m: (built or {}).get(m) or bench_method(m, cfg, budget, tsa_kept=tsa_kept, options=opts.get(m))
             for m in methods}
    decoders = [m for m in methods if m not in PREFILL_METHODS]
    for context in contexts:
        capacity = decode_capacity(context, steps)
        for asked in batches:
            batch = asked
            if asked == MAX_BATCH:  # with nothing but the weights on the device
                batch = largest_batch(cfg, [built[m][0] for m in decoders], capacity, params.embed.dtype)
                print(f"--batch {MAX_BATCH} at context {context}: batch {batch}", flush=True)
            dense_ms = None
            for name in decoders:
                method, how = built[name]
                row = dict(phase="decode", method=name, context=context, batch=batch, state=how)
                if asked == MAX_BATCH:
                    row["batch_asked"] = MAX_BATCH
                cache = state = tok = None
                try:
                    # Compiled on abstract shapes before the cache is filled, and nothing of this row kept after it:
                    # compiled beside its cache after the batch-1 rows, dense's 100K, batch 4 row ran out of memory
                    # on an H100 (a 23.6 GiB largest free block read beside a 24.4 GiB cache half), and fit this
                    # way (eval/results/h100/e2e/NOTES.md; the mechanism is not settled).
                    tok = jnp.zeros((batch, 1), jnp.int32)
                    shapes = jax.eval_shape(lambda: (filled_cache(cfg, batch, context, capacity, params.embed.dtype),
                                                     method.init_state(cfg, batch, capacity)))  # noqa: B023
                    step = method_decode_steps.lower(params, method, tok, *shapes, cfg=cfg, steps=steps,
                                                     unroll=unroll, loop=loop).compile()
                    cache = filled_cache(cfg, batch, context, capacity, params.embed.dtype)
                    state, row["state_values"] = filled_state(method, cfg, cache, capacity)
                    row["memory_gib"] = _memory_gib()  # beside the cache and state, before the first call
                    t0 = time.perf_counter()
                    tok, cache, state = step(params, method, tok, cache, state)
                    jax.block_until_ready(tok)  # warm
                    row["first_call_step_ms"] = (time.perf_counter() - t0) * 1e3 / steps
                    # The timed steps go on from the warm ones (positions context + steps ..), so every method's
                    # state is the one its own steps left: steady-state decode. Before 2026-12-06 the lengths were
                    # rewound to the context, leaving e.g. H2O's carried candidates ahead of the positions; no step
                    # time moved measurably with the change (eval/results/h100/e2e_1206c/NOTES.md).
                    t0 = time.perf_counter()
                    tok, cache, state = step(params, method, tok, cache, state)
                    jax.block_until_ready(tok)
                    ms = (time.perf_counter() - t0) * 1e3 / steps
                    n = context + steps + steps // 2  # the timed steps' middle position
                    nbytes = weights + attention_bytes(name.split(":")[0], method, cfg, batch, n)
                    dense_bytes = weights + attention_bytes("dense", None, cfg, batch, n)
                    row.update(step_ms=ms, tokens_per_s=batch / (ms * 1e-3), bytes=nbytes,
                               floor_ms=nbytes / (hbm * 1e9) * 1e3, floor_speedup=dense_bytes / nbytes)
                    if name == "dense":
                        dense_ms = ms
                    if dense_ms is not None:
                        row["speedup"] = dense_ms / ms
                        row["floor_fraction"] = row["speedup"] / row["floor_speedup"]
                except Exception as e:  # noqa: BLE001 - out of memory and the like: record and go on
                    row["error"] = str(e).splitlines()[0][:300]
                    row["memory_gib_at_error"] = _memory_gib()
                del cache, state, tok  # none of this row's buffers stays under the next row's cache
                rows.append(row)
                print(row, flush=True)
    for context in prefill_contexts:
        dense_ms = None
        for name in methods:
            method, how = built[name]
            row = dict(phase="prefill", method=name, context=context, batch=1, state=how)
            try:
                tokens = jax.random.randint(jax.random.key(1), (1, context), 0, cfg.vocab_size)
                # The warm-up call (compiles) is also the one whose kept counts are read.
                _, kept = jax.block_until_ready(prefill_only(params, method, tokens, cfg=cfg))
                ms = bm.time_ms(lambda t: prefill_only(params, method, t, cfg=cfg), tokens, warmup=0, iters=2)
                row.update(prefill_ms=ms, prefill_tokens_per_s=context / (ms * 1e-3),
                           flop_floor_ms=prefill_flops(cfg, 1, context) / (mm * 1e12) * 1e3)
                if name in PREFILL_METHODS:  # the share TSA kept, as it recorded it (its sparse layers)
                    kept = np.asarray(kept)
                    layers = list(method.layers(cfg.num_layers))
                    row.update(tsa_sparse_layers=len(layers),
                               tsa_kept_fraction=float(kept[layers].mean() / context) if layers else None)
                if name == "dense":
                    dense_ms = ms
                if dense_ms is not None:
                    row["speedup"] = dense_ms / ms
            except Exception as e:  # noqa: BLE001
                row["error"] = str(e).splitlines()[0][:300]
            rows.append(row)
            print(row, flush=True)
    return rows


def method_checks(cfg, methods, budget: float, check: bool, method_options: dict | None = None,
                  layout: str = "default", one_row: bool = False) -> dict:
    """{method: {"check": ...}} for the JSON: each method's correctness check (`model_check.run_checks`, in bf16 as
    the timed run; a failed one is recorded, and `_raise_failed` raises for it), or a note that it was skipped.
    one_row: the run timed batch 1, so a batch of one prompt is checked beside the batch of two."""
    if not check:
        return {m: {"check": "skipped (--no-check)"} for m in methods}
    from eval.bench import model_check
    def build(name, small_cfg):
        return bench_method(name, small_cfg, budget, evo_budget_tokens=model_check.CHECK_EVO_TOKENS,
                            options=(method_options or {}).get(name))[0]
    shapes = (model_check.CHECK_LENGTHS,) + ((model_check.CHECK_ONE_ROW,) if one_row else ())
    return {m: {"check": c} for m, c in model_check.run_checks(cfg, methods, build, jnp.bfloat16, layout=layout,
                                                               raise_on_failure=False, shapes=shapes).items()}


def _raise_failed(checks: dict) -> None:
    """CheckFailed naming every method of `checks` (method_checks' dict) whose check failed, if any."""
    from eval.bench import model_check
    failed = {m: c["check"] for m, c in checks.items() if isinstance(c["check"], dict) and not c["check"]["passed"]}
    if failed:
        raise model_check.CheckFailed(model_check.failure_message(failed, timed=True))


def run_methods(shape: str, methods, contexts, batches, steps: int, out: str | None, budget: float,
                prefill_contexts=(), check: bool = True, tsa_kept: float = TSA_KEPT, attention_only: bool = False,
                method_options: dict | None = None, layout: str = "default", unroll: int | bool | None = None,
                loop: str = "fori"):
    cfg = attention_only_config(preset(shape)) if attention_only else preset(shape)
    unroll = layer_unroll(None) if unroll is None else unroll
    if methods[0] != "dense":
        methods = ("dense",) + tuple(m for m in methods if m != "dense")  # the baseline of the same run, first
    if not prefill_contexts:  # the prefill methods have no decode rows of their own
        methods = tuple(m for m in methods if m not in PREFILL_METHODS)
    facts = bm.device_facts()
    hbm = bm.measure_hbm_gbs()
    params = bench_params(cfg, layout)
    mm = bm.measure_matmul_tflops() if prefill_contexts else 0.0
    rows = method_rows(cfg, params, methods, contexts, batches, steps, hbm, budget, prefill_contexts, mm,
                       tsa_kept=tsa_kept, method_options=method_options, unroll=unroll, loop=loop)
    nparams, fused = param_bytes(params), is_fused(params)
    del params  # the check's small model next (after the timing: the module docstring says why)
    one_row = any(r.get("batch") == 1 for r in rows if r.get("phase") == "decode")  # a "max" batch of 1 too
    checks = method_checks(cfg, tuple(m for m in methods if m not in PREFILL_METHODS), budget, check, method_options,
                           layout, one_row)
    checks.update({m: {"check": f"prefill only: decodes as {'dense' if m == 'tsa' else 'kascade'} (checked there); "
                                "its prefill kernels are checked by `jsparse bench tsa`"}
                   for m in methods if m in PREFILL_METHODS})
    payload = {**facts, "benchmark": "model_methods", "xla_flags": os.environ.get("XLA_FLAGS", ""), "shape": shape,
               "dtype": "bfloat16", "weights": "random", "budget": budget, "tsa_kept_fraction": tsa_kept,
               "attention_only": attention_only, "method_options": method_options or {},
               "config": {k: getattr(cfg, k) for k in ("num_layers", "hidden_size", "intermediate_size", "num_heads",
                                                       "num_kv_heads", "head_dim", "vocab_size")},
               "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
               "preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"), "measured_hbm_gbs": hbm,
               "param_bytes": nparams, "fused_projections": fused, "decode_steps_timed": steps,
               "decode_layer_unroll": unroll, "decode_loop": loop, "measured_matmul_tflops": mm or None,
               "methods": checks, "rows": rows}
    if out:
        bm.write_json(out, payload)
    if contexts:
        print(bm.table([r for r in rows if r["phase"] == "decode"],
                       ["method", "context", "batch", "step_ms", "tokens_per_s", "speedup", "floor_speedup",
                        "floor_fraction"]))
    if prefill_contexts:
        print(bm.table([r for r in rows if r["phase"] == "prefill"], ["method", "context", "prefill_ms", "speedup"]))
    _raise_failed(checks)
    return payload


def run(shape: str, contexts, batches, steps: int = 16, out: str | None = None, check: bool = True,
        layout: str = "default"):
    cfg = preset(shape)
    facts = bm.device_facts()
    hbm = bm.measure_hbm_gbs()
    mm = bm.measure_matmul_tflops()
    params = bench_params(cfg, layout)
    method = make_method("dense")
    rows = []
    for context in contexts:
        for batch in batches:
            row = {"context": context, "batch": batch}
            tokens = jax.random.randint(jax.random.key(1), (batch, context), 0, cfg.vocab_size)
            try:
                ms = bm.time_ms(lambda t: prefill_only(params, method, t, cfg=cfg), tokens, warmup=1, iters=3)
                flops = prefill_flops(cfg, batch, context)
                row.update(prefill_ms=ms, prefill_tflops=flops / (ms * 1e-3) / 1e12,
                           prefill_roofline_ms=flops / (mm * 1e12) * 1e3)
            except Exception as e:  # noqa: BLE001 - record out-of-memory and go on
                row["prefill_error"] = str(e).splitlines()[0][:200]
            try:
                capacity = round_up(context + steps + 1, 256)
                cache = filled_cache(cfg, batch, context, capacity, jnp.bfloat16)
                tok = jnp.zeros((batch, 1), jnp.int32)
                tok, cache = decode_steps(params, method, tok, cache, cfg=cfg, steps=steps)  # compile + warm
                jax.block_until_ready(tok)
                cache = KVCache(k=cache.k, v=cache.v, lengths=jnp.full((batch,), context, jnp.int32))
                import time
                t0 = time.perf_counter()
                tok, cache = decode_steps(params, method, tok, cache, cfg=cfg, steps=steps)
                jax.block_until_ready(tok)
                step_ms = (time.perf_counter() - t0) * 1e3 / steps
                nbytes = decode_bytes(cfg, params, batch, context + steps // 2)
                row.update(decode_step_ms=step_ms, decode_tokens_per_s=batch / (step_ms * 1e-3),
                           decode_roofline_ms=nbytes / (hbm * 1e9) * 1e3,
                           decode_roofline_tokens_per_s=batch / (nbytes / (hbm * 1e9)),
                           decode_gbs=nbytes / (step_ms * 1e-3) / 1e9)
                del cache
            except Exception as e:  # noqa: BLE001
                row["decode_error"] = str(e).splitlines()[0][:200]
            rows.append(row)
            print(row, flush=True)
    nparams, fused = param_bytes(params), is_fused(params)
    del params
    checks = method_checks(cfg, ("dense",), 0.1, check, layout=layout,  # after the timing (module docstring)
                           one_row=1 in [r["batch"] for r in rows])
    payload = {**facts, "benchmark": "model_dense", "xla_flags": os.environ.get("XLA_FLAGS", ""), "shape": shape,
               "dtype": "bfloat16", "weights": "random", "measured_hbm_gbs": hbm, "measured_matmul_tflops": mm,
               "param_bytes": nparams, "fused_projections": fused, "decode_steps_timed": steps, "methods": checks,
               "rows": rows}
    if out:
        bm.write_json(out, payload)
    print(bm.table(rows, ["context", "batch", "prefill_ms", "prefill_tflops", "prefill_roofline_ms",
                          "decode_step_ms", "decode_tokens_per_s", "decode_roofline_tokens_per_s", "decode_gbs"]))
    _raise_failed(checks)
    return payload


def main(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b", help="model shape preset (llama3-8b, qwen3-8b)")
    p.add_argument("--context", default="8192,32768", type=bm.positive_ints,
                   help="comma-separated context lengths of the decode rows (with --methods, '' times prefill only)")
    p.add_argument("--batch", default="1,8",
                   help=f"comma-separated batch sizes; with --methods also '{MAX_BATCH}': the largest at which every "
                        "method's cache and state fit beside the weights (largest_batch)")
    p.add_argument("--steps", type=bm.positive_int, default=STEPS,
                   help="decode steps timed per case, going on from as many untimed ones")
    bm.add_out_argument(p, "bench_model.json", optional=True)
    p.add_argument("--methods", default="dense",
                   help=f"comma-separated methods (some of {','.join(METHODS + PREFILL_METHODS)}); anything beside "
                        "dense runs the per-method comparison (dense first, in the same run); tsa and tsa+kascade "
                        "get prefill rows only and need --prefill-context")
    p.add_argument("--budget", type=float, default=None, help="kept fraction of the context for the budgeted "
                   "methods, in (0, 1] (default 0.1; EvoSparse keeps its 2048-token budget)")
    p.add_argument("--prefill-context", default=[], type=bm.positive_ints,
                   help="with --methods: comma-separated contexts at which to time each method's prefill (batch 1)")
    p.add_argument("--tsa-kept", type=float, default=None,
                   help=f"the fixed kept share of every row for tsa and tsa+kascade (default {TSA_KEPT}: the paper's "
                        "54%% attention-map sparsity; coverage on random weights keeps nearly every token)")
    p.add_argument("--xla-flags", default=" ".join(GPU_XLA_FLAGS),
                   help="XLA_FLAGS for this run, set before the backend starts (default: jsparse.xla_flags.GPU_XLA_FLAGS, "
                        "cuBLAS GEMMs reading the stacked weights in place; see eval/results/h100/bench_decode_step.json)")
    p.add_argument("--attention-only", action="store_true",
                   help=f"with --methods: the preset's hidden and MLP widths cut to {ATTENTION_ONLY_WIDTH} (its "
                        "attention unchanged), so each method's prefill and decode time is its whole-model attention "
                        "through the model's own path (projections and MLP about 1%% of a 128K prefill)")
    p.add_argument("--method-option", action="append", default=None, metavar="METHOD.OPTION=VALUE",
                   help="an option of one method's builder (repeatable, comma-separated), e.g. kascade.tile=128 or "
                        "tsa+kascade.tile=128 (tsa+kascade splits its options between Kascade and TSA as its builder "
                        "does); VALUE is read as JSON where it parses")
    p.add_argument("--layout", default="default", choices=LAYOUTS,
                   help="the weights' layout: default (what jsparse.load gives: q/k/v and gate/up fused into one "
                        "weight each on a GPU, models.params), fused, or separate (one GEMM per projection)")
    scan = p.add_mutually_exclusive_group()
    scan.add_argument("--unroll-layers", dest="layer_scan", action="store_const", const="unrolled",
                      help="with --methods: time decode steps whose layer scan is unrolled in full "
                           "(models.llama.decode(unroll=True)); the default on a GPU, as in generate "
                           "(models.generate.default_unroll_layers)")
    scan.add_argument("--rolled-layers", dest="layer_scan", action="store_const", const="rolled",
                      help="with --methods: time decode steps whose layer scan is rolled (a loop over the layers: "
                           "a counter, slices and a gap a layer; eval/results/h100/unroll_lead/NOTES.md); the "
                           "default elsewhere")
    p.add_argument("--loop", default="fori", choices=LOOPS,
                   help="with --methods: the decode loop timed: fori (default), a fori_loop of --steps decode steps, "
                        "or generate, the loop `jsparse generate` runs (models.generate.decode_loop: a while_loop "
                        "that stops on the tokens, with its sampling and bookkeeping; greedy)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the correctness check that runs after the timing (each method's decode step against its "
                        "masked reference on a small model; see above)")
    a = p.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # 100K x batch 4: 53 GB of cache + 16 GB weights
    if a.xla_flags:
        os.environ["XLA_FLAGS"] = merged_xla_flags(os.environ.get("XLA_FLAGS", ""), a.xla_flags)
    contexts = a.context
    try:
        cfg = bm.shape_preset(a.shape)
        for flag, given in (("--context", contexts), ("--prefill-context", a.prefill_context)):
            bm.check_contexts(flag, given, cfg, a.shape)
    except ValueError as e:
        p.error(str(e))
    try:
        batches = parse_batches(a.batch)
    except ValueError as e:
        p.error(str(e))
    methods = tuple(m.strip() for m in a.methods.split(",") if m.strip())
    unknown = sorted(set(methods) - set(METHODS) - set(PREFILL_METHODS))
    if unknown:
        p.error(f"--methods: unknown {unknown}; expected some of {list(METHODS + PREFILL_METHODS)}")
    if methods == ("dense",):  # what only the per-method comparison reads
        given = [flag for flag, v in (("--budget", a.budget), ("--tsa-kept", a.tsa_kept),
                                      ("--prefill-context", a.prefill_context or None)) if v is not None]
        if given:
            p.error(f"{', '.join(given)}: the per-method comparison's (--methods dense,...); dense alone takes none")
    if methods != ("dense",) and (error := unread_budget(a.budget, methods)):  # (dense alone: refused above)
        p.error(error)
    a.budget = 0.1 if a.budget is None else a.budget
    try:
        bm.check_budget(a.budget)
    except ValueError as e:
        p.error(str(e))
    a.tsa_kept = TSA_KEPT if a.tsa_kept is None else a.tsa_kept
    from jsparse.methods.tsa import check_kept_fraction
    try:
        check_kept_fraction(a.tsa_kept)
    except ValueError as e:
        p.error(f"--tsa-kept: {e}")
    from eval.harness import parse_method_options
    try:
        method_options = parse_method_options(a.method_option, methods)
    except ValueError as e:
        p.error(str(e))
    if MAX_BATCH in batches and methods == ("dense",):
        p.error(f"--batch {MAX_BATCH}: the decode comparison's (--methods dense,...); dense alone also times "
                "prefill at each batch: expected explicit batch sizes")
    if MAX_BATCH in batches:
        try:
            memory_stats()
        except ValueError as e:
            p.error(str(e))
    if (prefill_only := [m for m in methods if m in PREFILL_METHODS]) and not a.prefill_context:
        p.error(f"--methods: {prefill_only} time prefill rows only (their decode is dense's / kascade's): expected "
                "--prefill-context, or --methods without them")
    if not contexts and (methods == ("dense",) or not a.prefill_context):
        p.error("--context is empty: expected decode contexts, or --methods with --prefill-context")
    from eval.bench.model_check import CheckFailed
    if warning := allocator_warning():
        print(f"{p.prog}: warning: {warning}", file=sys.stderr, flush=True)
    try:
        out = bm.out_path(a.out, "bench_model.json")
    except ValueError as e:
        p.error(str(e))
    try:
        if methods == ("dense",):
            if method_options:
                p.error("--method-option: dense alone takes no options")
            if a.attention_only:
                p.error("--attention-only compares methods: give --methods (dense and others)")
            scan_flag = {"unrolled": "--unroll-layers", "rolled": "--rolled-layers"}.get(a.layer_scan)
            for flag, given in ((scan_flag, a.layer_scan), ("--loop", a.loop != "fori")):
                if given:
                    p.error(f"{flag} times the methods' decode loop: give --methods (dense and others)")
            run(a.shape, contexts, batches, a.steps, out, check=not a.no_check, layout=a.layout)
        else:
            run_methods(a.shape, methods, contexts, batches, a.steps, out, a.budget, a.prefill_context,
                        check=not a.no_check, tsa_kept=a.tsa_kept, attention_only=a.attention_only,
                        method_options=method_options, layout=a.layout, unroll=layer_unroll(a.layer_scan), loop=a.loop)
    except CheckFailed as e:
        sys.exit(f"{p.prog}: error: {e}")


if __name__ == "__main__":
    main()

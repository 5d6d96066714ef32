"""H100 benchmark of EvoSparse decode (issue 6) against the best dense decode, at Llama-3.1-8B shapes.

Run on a GPU machine from the repository root:

    GIT_COMMIT=$(git rev-parse HEAD) jsparse bench evosparse --out /some/dir/

What it does (about 3.5 minutes on an H100; cases are skipped once a time budget is spent: the 100K attention
cases run first, after the decode step (while the GPU memory is empty), then the other contexts):
  1. Check (compiled on the GPU, bf16, B = 2, N = 8192): the EvoSparse layer with a budget covering every block
     equals dense decode (max abs error / max abs dense <= 2e-2), and at budget 2048 it equals a dense softmax
     over exactly the keys of the blocks it selected (the selection is recomputed with `select_blocks`).
  2. Attention, per layer (Hq = 32, Hkv = 8, D = 128, bf16, B in {1, 4}, N in {32K, 64K, 100K, 128K}, budget 2048
     tokens in blocks of 16): dense decode by cuDNN (`dense_decode(implementation="cudnn")`, K/V read once, no
     repeated heads), by XLA, and by the in-place Pallas split-K kernel of the model's dense layers (the best of
     the three is the baseline); EvoSparse's sparse layer without retrieval heads (heat + sink + local + the
     inherited retrieval set) and with retrieval heads in R KV heads (it also reads K of those R heads), for
     every R of the model below and R = 2. Each is a jitted `lax.fori_loop` of `--iters` layer calls (the heat
     state carried and decayed as `start` does at every step, over the 3 layers' heat, more than a layer's share
     of the model's one decay per step; the query perturbed by the previous output so nothing is hoisted),
     divided by the count. The "sparse layer average" weights these layers as the model's 30 sparse layers are
     made (15 retrieval heads = 1.5% of 1024, drawn at random in layers >= 2, seed 0: 17 layers inherit, 11 hold
     retrieval heads in one KV head, 2 in two). `evo_sparse_layer_r2_ms` keeps the earlier, coarser weighting
     (every retrieval layer timed with R = 2).
  3. The whole decode step, end to end (random weights of Llama-3.1-8B, 32 layers, bf16, context 100,000, batch
     1 and 4; capacity 100,352): dense (cuDNN attention) vs EvoSparse (layers 0-1 dense). The cache is filled as
     in eval/bench/model.py (`filled_cache`); steps run in one jitted fori_loop carrying the cache and the
     method's state (heat), timed over `--steps` steps.

  3b. The whole model's attention of one decode step as ONE jitted program at 100K and the largest batch
     (`model_program_rows`): 32 layers each reading its own layer of a stacked cache, outputs chained into the
     next layer's query, EvoSparse (start + 2 dense + 30 sparse layers, the model's retrieval layout) against 32
     dense layers (Pallas split-K); no timed loop, no per-call dispatch between layers. `--no-program` skips it.

  4. At the first context (100K): the two layers again with lax.cond (branchless=False, the layout before the
     GPU default), and each part of a sparse layer timed alone with its floor: retrieval (block max kernel +
     top-k, R = 2 KV heads), block_max (the kernel alone), select (heat top-k, retrieval exclusion, merge, by
     the one-launch search of the heat row), select_cand (the same from the step's heat candidates: what a layer
     runs now), heat_candidates (the step's candidates of the 3 layers' heat, once per step in the model),
     attend (gathered decode), attend_mass (gathered decode with the entry mass), heat_update (the step's decay
     of the 3-layer heat and an XLA scatter-add of the mass), attend_heat (what the layer runs:
     `sparse_decode_heat`, the gathered decode then one launch that merges the splits and adds the mass into
     the heat in place; also at 2, 4, 8 and 16 splits: attend_heat_s<n>). Checks also compare the block_scores
     kernels, compiled, with their references. The decode step at the largest batch is also run with lax.cond
     (`evosparse_cond`).

Floors (bytes moved at the measured HBM bandwidth): dense attention reads K and V once (2 B Hkv N D 2 bytes);
an EvoSparse sparse layer reads the selected K/V blocks and the heat row of its layer (read for the selection
and the update, written, f32), and in a retrieval layer K of its R KV heads. Decode step floor: every weight once (as
bench_model.decode_bytes) plus the attention floors of all layers.

Writes the JSON named by --out (default ./bench_evosparse.json; device, jax version, date, GIT_COMMIT, measured HBM
GB/s, checks, rows) and prints a table last. Options: `--contexts 32768,65536`, `--batches 1,4`, `--iters N`, `--steps N`, `--no-e2e`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench import model as bench_model
from eval.bench.common import (add_out_argument, device_facts, measure_hbm_gbs, out_path, positive_int, positive_ints,
                               require_gpu, table, time_ms, write_json)
from jsparse.xla_flags import set_xla_flags
from jsparse.methods.evosparse import EvoSparse, EvoState, decay_heat, default_num_heads
from models.attention import LayerContext, LayerKV
from models.attention import start as start_forward
from models.cache import KVCache
from models.generate import round_up
from models.params import random_params
from models.presets import preset
from pallas_kernels.dense import dense_decode
from pallas_kernels.dense_decode import dense_decode_stacked
from pallas_kernels.block_scores import block_max_scores, heat_add, sparse_decode_heat, sparse_decode_mass
from pallas_kernels.sparse_attention import sparse_decode
from pallas_kernels.sparse_attention.gpu import DecodeConfig
from pallas_kernels.sparse_attention.reference import decode_indices_to_mask, masked_attention_reference

BUDGET_S = 215.0  # no new attention case after this many seconds
E2E_BUDGET_S = 190.0  # no new decode-step case after this many seconds
CONTEXT_E2E = 100_000
from eval.bench.evo_layout import BLOCK, BUDGET_TOKENS, CFG8B, attention_floors, layer_kinds, model_heads  # noqa: E402,F401


def layer_cfg():
    """A 3-layer config of 8B attention shapes: layers 0-1 dense, layer 2 sparse (with or without retrieval)."""
    return dataclasses.replace(CFG8B, num_layers=3)


EVO_KERNELS = None  # --evo-kernels: None (Triton on the GPU) or "xla" (fallback if a kernel fails to compile)


def method_for(cfg, heads, **kw):
    kw.setdefault("kernels", EVO_KERNELS)
    return EvoSparse.from_heads(cfg, heads, budget_tokens=BUDGET_TOKENS, block_size=BLOCK, **kw)


def _state(method, cfg, B, N, key):
    st = method.init_state(cfg, B, N)
    st = st.replace(heat=jax.random.uniform(key, st.heat.shape))  # non-trivial heat ranking
    return method.start(cfg, st, "decode", B, 1, N)


@functools.partial(jax.jit, static_argnames=("iters",))
def evo_layers(method, q, k, v, lengths, state, layer, *, iters):
    """`iters` calls of layer `layer`'s decode (2, traced as in the model's scan), carrying the state; each call
    is preceded by what the model runs once per decode step (`start` and `start_rows`: the heat decay and the
    heat candidates of the 3-layer state; in the model that work is shared by its 30 sparse layers)."""
    info = jax.tree_util.tree_map(lambda x: x[layer], method.layer_info(None))
    ctx = LayerContext(layer=layer, lengths=lengths, info=info)
    B, N = q.shape[0], k.shape[2]

    def body(_, c):
        acc, st = c
        st = start_forward(method, layer_cfg(), st, "decode", B, 1, N, lengths=lengths)
        out, st = method.decode(ctx, (q + acc[:, :, :, :1] * 1e-3).astype(q.dtype), LayerKV(k=k, v=v), st)
        # the step's own fields, made again by the next start_forward
        return out.astype(jnp.float32) * 0.5, st.replace(heat_cand=None, plan=None, sel=None, tickets=None)

    acc, st = jax.lax.fori_loop(0, iters, body, (jnp.zeros(q.shape, jnp.float32), state))
    return acc.sum() + st.heat.sum()


@functools.partial(jax.jit, static_argnames=("iters", "impl"))
def dense_layers(q, k, v, lengths, *, iters, impl):
    """`iters` dense decode calls: impl "cudnn" / "xla" (jax.nn.dot_product_attention on the [B, Hkv, N, D]
    cache, no repeated KV heads) or "pallas_inplace" (the split-K kernel the model's dense layers use)."""
    def body(_, acc):
        qi = (q + acc[:, :, :, :1] * 1e-3).astype(q.dtype)
        if impl == "pallas_inplace":
            out = dense_decode_stacked(qi, k[None], v[None], jnp.int32(0), lengths, implementation="pallas_gpu")
        else:
            out = dense_decode(qi, k, v, lengths, implementation=impl)
        return out.astype(jnp.float32) * 0.5

    return jax.lax.fori_loop(0, iters, body, jnp.zeros(q.shape, jnp.float32)).sum()


@functools.partial(jax.jit, static_argnames=("iters", "part"))
def part_loop(method, q, k, v, lengths, state, *, iters, part):
    """`iters` calls of one part of layer 2 of a sparse layer (inputs perturbed by the running checksum)."""
    info = jax.tree_util.tree_map(lambda x: x[2], method.layer_info(None))
    B, _, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    pos = lengths - 1
    cache = LayerKV(k=k, v=v)
    idx0 = method.select_blocks(state.heat, state.retrieval[:, 0], pos, Hkv, N, layer=2)
    cand0 = method.start_rows(None, state, "decode", lengths, 1, N).heat_cand
    emass0 = jnp.full(idx0.shape, 1.0 / idx0.shape[-1], jnp.float32)

    def body(_, c):
        acc, heat = c
        qi = (q + acc * 1e-3).astype(q.dtype)
        if part == "retrieval":  # block max (kernel) + top-k
            ret = method.retrieval_blocks(info, qi, cache, pos[:, None])
            return acc + ret.sum() * 1e-9, heat
        if part == "block_max":  # the kernel alone
            s = block_max_scores(qi, k[None], jnp.int32(0), info.kv_heads, info.head_mask, pos[:, None],
                                 jnp.zeros_like(pos[:, None]), pos[:, None] // BLOCK + 1, block_size=BLOCK,
                                 implementation=EVO_KERNELS)
            return acc + jnp.max(s) * 1e-9, heat
        if part == "select":  # heat top-k, retrieval exclusion, merge (the stacked heat read in place)
            heat = heat.at[2, 0, 0, 0].add(acc * 1e-9)
            idx = method.select_blocks(heat, state.retrieval[:, 0], pos, Hkv, N, layer=2)
            return acc + idx.sum() * 1e-9, heat
        if part == "select_cand":  # the layer's selection from precomputed heat candidates (what it runs now)
            heat = heat.at[2, 0, 0, 0].add(acc * 1e-9)
            idx = method.select_blocks(heat, state.retrieval[:, 0], pos, Hkv, N, layer=2, cand=cand0)
            return acc + idx.sum() * 1e-9, heat
        if part == "heat_candidates":  # the step's candidates of every layer (here the 3 layers' heat)
            heat = heat.at[2, 0, 0, 0].add(acc * 1e-9)
            c = method.start_rows(None, state.replace(heat=heat), "decode", lengths, 1, N).heat_cand
            return acc + c[2, 0, 0, 0] * 1e-9, heat
        if part == "attend":  # gathered decode, no mass
            out = sparse_decode(qi, k[None], v[None], idx0[:, :, None], lengths, layer=jnp.int32(0), block_size=BLOCK)
            return acc + out.astype(jnp.float32).sum() * 1e-9, heat
        if part == "attend_mass":  # gathered decode with the entry mass
            out, m = sparse_decode_mass(qi, k[None], v[None], jnp.int32(0), idx0[:, :, None], lengths,
                                        block_size=BLOCK, implementation=EVO_KERNELS)
            return acc + (out.astype(jnp.float32).sum() + m.sum()) * 1e-9, heat
        if part.startswith("attend_heat"):  # what the layer runs: decode + mass into the heat ("_s<n>": n splits)
            cfg = None if part == "attend_heat" else DecodeConfig(num_splits=int(part.split("_s")[-1]))
            out, heat = sparse_decode_heat(qi, k[None], v[None], jnp.int32(0), idx0[:, :, None], lengths, heat,
                                           jnp.int32(2), block_size=BLOCK, implementation=EVO_KERNELS, config=cfg)
            return acc + out.astype(jnp.float32).sum() * 1e-9, heat
        if part == "heat_update":  # the step's decay of the (3-layer) heat, then the in-place scatter-add
            heat = decay_heat(heat, method.dense_layers, method.decay)
            heat = heat_add(heat, jnp.int32(2), idx0, emass0 + acc * 1e-9)
            return acc + heat[2, 0, 0, 0] * 1e-9, heat
        raise ValueError(part)

    acc, heat = jax.lax.fori_loop(0, iters, body, (jnp.float32(0), state.heat))
    return acc + heat.sum()


PARTS = ("retrieval", "block_max", "select", "select_cand", "heat_candidates", "attend", "attend_mass",
         "heat_update", "attend_heat")
HEAT_SPLITS = (2, 4, 8, 16)  # the layer's decode + heat step at these split counts (part rows only)


def part_rows(inherit, compute, q, k, v, lengths, key, iters, hbm) -> dict:
    """Each part of a sparse layer timed alone (ms per layer call) beside its floor from bytes."""
    B, N = q.shape[0], k.shape[2]
    Hkv, D, nb = k.shape[1], k.shape[3], k.shape[2] // BLOCK
    R = int(np.asarray(compute.layout.head_mask[2]).any(-1).sum())
    ms = lambda b: b / (hbm * 1e9) * 1e3  # noqa: E731
    floors = dict(retrieval=B * R * N * D * 2, block_max=B * R * N * D * 2, select=B * Hkv * nb * 4,
                  select_cand=3 * B * Hkv * 128 * 4, heat_candidates=3 * B * Hkv * nb * 4,
                  attend=2 * B * Hkv * BUDGET_TOKENS * D * 2, attend_mass=2 * B * Hkv * BUDGET_TOKENS * D * 2,
                  heat_update=2 * B * Hkv * nb * 4 / (CFG8B.num_layers - 2),  # a sparse layer's share of the decay
                  attend_heat=2 * B * Hkv * BUDGET_TOKENS * D * 2)
    out = {}
    for part in PARTS + tuple(f"attend_heat_s{n}" for n in HEAT_SPLITS):
        m = compute if part in ("retrieval", "block_max") else inherit
        st = _state(m, layer_cfg(), B, N, key)
        st = st.replace(retrieval=jnp.broadcast_to(jnp.arange(st.retrieval.shape[-1], dtype=jnp.int32) * 3 + 40,
                                                   st.retrieval.shape))  # an inherited set in the middle
        try:
            out[f"part_{part}_ms"] = time_ms(lambda: part_loop(m, q, k, v, lengths, st, iters=iters, part=part),
                                             warmup=2, iters=5) / iters
        except Exception as e:  # noqa: BLE001 - record and go on
            out[f"part_{part}_error"] = str(e).splitlines()[0][:200]
        out[f"part_{part}_floor_ms"] = ms(floors[part.split("_s")[0]])
    out["part_retrieval_heads"] = R
    return out


def kernel_checks(key) -> list[dict]:
    """The block_scores kernels, compiled on the GPU (bf16), against their references."""
    B, N, L = 2, 8192, 3
    ks = jax.random.split(key, 4)
    q = jax.random.normal(ks[0], (B, 1, 32, 128), jnp.bfloat16)
    k = jax.random.normal(ks[1], (L, B, 8, N, 128), jnp.bfloat16)
    v = jax.random.normal(ks[2], (L, B, 8, N, 128), jnp.bfloat16)
    pos = jnp.array([[N - 1], [5000]], jnp.int32)
    kvh = jnp.array([0, 5], jnp.int32)
    hm = jnp.array([[True, False, False, True], [False, True, False, False]])
    lo, hi = jnp.array([[1], [3]], jnp.int32), pos // BLOCK + 1 - 24
    out = []
    args = (q, k, jnp.int32(1), kvh, hm, pos, lo, hi)
    got = block_max_scores(*args, block_size=BLOCK, implementation="pallas_gpu")
    want = block_max_scores(*args, block_size=BLOCK, implementation="reference")
    fin = jnp.isfinite(want)
    err = float(jnp.max(jnp.where(fin, jnp.abs(got - want), 0.0)))
    same_inf = bool(jnp.all(fin == jnp.isfinite(got)))
    out.append(dict(check="block_max_kernel_vs_reference", max_abs_err=err, ok=err <= 5e-2 and same_inf))
    rng = np.random.default_rng(0)
    idx = np.sort(np.stack([[rng.choice(300, 128, replace=False) for _ in range(8)] for _ in range(B)]), -1)
    idx[:, :, 120:] = -1
    idx = jnp.asarray(idx, jnp.int32)[:, :, None]
    lengths = pos[:, 0] + 1
    o1, m1 = sparse_decode_mass(q, k, v, jnp.int32(2), idx, lengths, block_size=BLOCK, implementation="pallas_gpu")
    o2, m2 = sparse_decode_mass(q, k, v, jnp.int32(2), idx, lengths, block_size=BLOCK, implementation="reference")
    eo = float(jnp.max(jnp.abs(o1.astype(jnp.float32) - o2.astype(jnp.float32))) / jnp.max(jnp.abs(o2.astype(jnp.float32))))
    em = float(jnp.max(jnp.abs(m1 - m2)))
    out.append(dict(check="decode_mass_kernel_vs_reference", rel_err_out=eo, max_abs_err_mass=em,
                    ok=eo <= 2e-2 and em <= 2e-3))
    heat = jax.random.uniform(ks[3], (L, B, 8, N // BLOCK))
    for splits in (None, 4):
        cfg = None if splits is None else DecodeConfig(num_splits=splits)
        o1, h1 = sparse_decode_heat(q, k, v, jnp.int32(2), idx, lengths, heat, block_size=BLOCK,
                                    implementation="pallas_gpu", config=cfg)
        o2, h2 = sparse_decode_heat(q, k, v, jnp.int32(2), idx, lengths, heat, block_size=BLOCK,
                                    implementation="reference")
        eo = float(jnp.max(jnp.abs(o1.astype(jnp.float32) - o2.astype(jnp.float32))) /
                   jnp.max(jnp.abs(o2.astype(jnp.float32))))
        eh = float(jnp.max(jnp.abs(h1 - h2)))
        out.append(dict(check=f"decode_heat_kernel_vs_reference[splits={splits}]", rel_err_out=eo,
                        max_abs_err_heat=eh, ok=eo <= 2e-2 and eh <= 2e-3))
    # The one-launch block selection at the benchmark's shape (100K / 16 blocks, budget 2048), heat with ties.
    m = EvoSparse(budget_tokens=BUDGET_TOKENS, block_size=BLOCK)
    Nc = round_up(CONTEXT_E2E, 256)
    wd = m.widths(Nc)
    for trial in range(3):
        heat = jnp.asarray(np.round(rng.random((4, 8, wd["nb"])) * (4 if trial else 1e6)) / 4, jnp.float32)
        ret = np.full((4, max(wd["retrieval"], 1)), -1, np.int32)
        ret[:, :5] = np.sort(rng.choice(np.arange(10, 5000), (4, 5), replace=False), -1)
        pos_s = jnp.asarray([Nc - 1, 4000, 70000, 2100 * trial], jnp.int32)
        r = None if trial == 2 else jnp.asarray(ret)
        got = m.replace(kernels="pallas_gpu").select_blocks(heat, r, pos_s, 8, Nc)
        want = m.replace(kernels="xla").select_blocks(heat, r, pos_s, 8, Nc)
        out.append(dict(check=f"select_blocks_kernel_vs_xla[{trial}]", equal=bool(jnp.all(got == want)),
                        ok=bool(jnp.all(got == want))))
        # The same selection from the step's heat candidates (top-k launch + the rank kernel), compiled.
        mg = m.replace(kernels="pallas_gpu")
        cand = mg.start_rows(None, EvoState(heat=heat[None]), "decode", pos_s + 1, 1, Nc).heat_cand
        got = mg.select_blocks(heat[None], r, pos_s, 8, Nc, layer=jnp.int32(0), cand=cand)
        out.append(dict(check=f"select_from_candidates_kernel_vs_xla[{trial}]", equal=bool(jnp.all(got == want)),
                        ok=bool(jnp.all(got == want))))
    for r in out:
        print(r, flush=True)
    return out


def check(key) -> list[dict]:
    """Correctness on the GPU (bf16): full budget = dense; budget 2048 = masked dense over its own blocks."""
    cfg = layer_cfg()
    B, N = 2, 8192
    ks = jax.random.split(key, 4)
    q = jax.random.normal(ks[0], (B, 1, 32, 128), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, 8, N, 128), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, 8, N, 128), jnp.bfloat16)
    lengths = jnp.array([N, 5001], jnp.int32)
    heads = [(2, 0), (2, 9)]
    out = []
    for name, m in (("full_budget_vs_dense", EvoSparse.from_heads(cfg, heads, budget=1.0, min_tokens=1)),
                    ("budget2048_vs_masked", method_for(cfg, heads))):
        st = _state(m, cfg, B, N, ks[3])
        info = jax.tree_util.tree_map(lambda x: x[2], m.layer_info(cfg))
        ctx = LayerContext(layer=jnp.int32(2), lengths=lengths, info=info)
        got, _ = jax.jit(lambda m, st: m.decode(ctx, q, LayerKV(k=k, v=v), st))(m, st)
        if name.startswith("full"):
            want = dense_decode(q, k, v, lengths, implementation="xla")
        else:
            pos = lengths - 1
            ret = m.retrieval_blocks(info, q, LayerKV(k=k, v=v), pos[:, None])[:, 0]
            idx = m.select_blocks(st.heat[2], ret, pos, 8, N)
            mask = decode_indices_to_mask(idx[:, :, None], lengths, N, block_size=BLOCK)
            want = masked_attention_reference(q, k, v, mask)
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))) /
                    jnp.max(jnp.abs(want.astype(jnp.float32))))
        out.append(dict(check=name, rel_err=err, ok=err <= 2e-2))
        print(out[-1], flush=True)
    return out


def attention_rows(contexts, batches, iters, hbm, heads_model, t0, first_context=None) -> list[dict]:
    cfg = layer_cfg()
    L = CFG8B.num_layers
    kinds = layer_kinds(CFG8B, heads_model)  # {R: sparse layers}
    share = sum(n for R, n in kinds.items() if R) / (L - 2)
    G = 4
    rows = []
    for B in batches:
        for N in contexts:
            row = dict(part="attention", batch=B, context=N, budget_tokens=BUDGET_TOKENS, block=BLOCK)
            if time.perf_counter() - t0 > BUDGET_S:
                row["skipped"] = "time budget"
                rows.append(row)
                continue
            try:
                ks = jax.random.split(jax.random.key(N + B), 4)
                q = jax.random.normal(ks[0], (B, 1, 32, 128), jnp.bfloat16)
                k = jax.random.normal(ks[1], (B, 8, N, 128), jnp.bfloat16)
                v = jax.random.normal(ks[2], (B, 8, N, 128), jnp.bfloat16)
                lengths = jnp.full((B,), N, jnp.int32)
                per = lambda ms: ms / iters  # noqa: E731

                def timed(label, fn):
                    try:
                        row[label] = per(time_ms(fn, warmup=2, iters=5))
                    except Exception as e:  # noqa: BLE001 - e.g. cuDNN missing: record, go on
                        row[label.replace("_ms", "_error")] = str(e).splitlines()[0][:200]

                timed("dense_cudnn_ms", lambda: dense_layers(q, k, v, lengths, iters=iters, impl="cudnn"))
                timed("dense_xla_ms", lambda: dense_layers(q, k, v, lengths, iters=iters, impl="xla"))
                timed("dense_pallas_ms", lambda: dense_layers(q, k, v, lengths, iters=iters, impl="pallas_inplace"))
                # Layer 2 inherits (retrieval heads only in layer 1, dense) / computes (R KV heads hold them).
                inherit = method_for(cfg, [(1, 0)])
                computes = {R: method_for(cfg, [(2, r * G + r % G) for r in range(R)])
                            for R in sorted(set(kinds) | {2}) if R}
                compute = computes[2]
                cases = [("evo_inherit_ms", inherit)] + [(f"evo_retrieval_r{R}_ms", m) for R, m in computes.items()]
                for label, m in cases:
                    st = _state(m, cfg, B, N, ks[3])
                    timed(label, lambda: evo_layers(m, q, k, v, lengths, st, jnp.int32(2), iters=iters))
                row["evo_retrieval_ms"] = row.get("evo_retrieval_r2_ms", math.nan)  # the earlier name (R = 2)
                if N == first_context:  # the same layers with lax.cond (the layout before the branchless one)
                    for label, m in (("evo_inherit_cond_ms", inherit), ("evo_retrieval_cond_ms", compute)):
                        m = m.replace(branchless=False)
                        st = _state(m, cfg, B, N, ks[3])
                        timed(label, lambda: evo_layers(m, q, k, v, lengths, st, jnp.int32(2), iters=iters))
                    row.update(part_rows(inherit, compute, q, k, v, lengths, ks[3], iters, hbm))
                row["evo_sparse_layer_ms"] = sum(n * row["evo_inherit_ms" if R == 0 else f"evo_retrieval_r{R}_ms"]
                                                 for R, n in kinds.items()) / (L - 2)
                row["evo_sparse_layer_r2_ms"] = share * row["evo_retrieval_ms"] + (1 - share) * row["evo_inherit_ms"]
                row["layer_kinds"] = {str(R): n for R, n in sorted(kinds.items())}
                best = min(row.get(f"dense_{n}_ms", math.inf) for n in ("cudnn", "xla", "pallas"))
                row["dense_best_ms"] = best
                row["speedup_sparse_layer"] = best / row["evo_sparse_layer_ms"]
                # Whole-model attention: 2 dense layers + 30 sparse ones.
                row["speedup_model_attention"] = (L * best) / (2 * best + (L - 2) * row["evo_sparse_layer_ms"])
                row.update(attention_floors(B, N, hbm, R=2))
                row["evo_floor_layer_ms"] = sum(n * attention_floors(B, N, hbm, R=R)["retrieval_floor_ms"]
                                                for R, n in kinds.items()) / (L - 2)
                del q, k, v
            except Exception as e:  # noqa: BLE001 - record and go on
                row["error"] = str(e).splitlines()[0][:300]
            rows.append(row)
            print(row, flush=True)
    return rows


def model_program_rows(B: int, heads_model, hbm) -> list[dict]:
    """The whole model's attention of one decode step as ONE jitted program (what the decode step runs, without
    its GEMMs): L = 32 layers, each reading its own layer of a stacked [L, B, Hkv, N, D] cache in place (49 GiB
    at 100K, B 4: no layer's selection can hit in L2 from another layer's reads), each layer's output fed into
    the next layer's query; EvoSparse = `start` (the heat decay) + layers 0-1 dense + 30 sparse layers with the
    model's retrieval layout (the method's own decode, as the model's scan calls it), against 32 dense layers
    by the best dense kernel (the in-place Pallas split-K). Timed with warm-up and the median of 5."""
    cfg = CFG8B
    L, N = cfg.num_layers, round_up(CONTEXT_E2E, 256)
    rows = []
    try:
        cache = bench_model.filled_cache(cfg, B, CONTEXT_E2E, N, jnp.bfloat16)
        k_all, v_all, lengths = cache.k, cache.v, cache.lengths
        q = jax.random.normal(jax.random.key(5), (B, 1, cfg.num_heads, cfg.head_dim), jnp.bfloat16)
        m = method_for(cfg, heads_model)
        state = m.init_state(cfg, B, N)
        state = state.replace(heat=jax.random.uniform(jax.random.key(6), state.heat.shape))
        info_all = m.layer_info(cfg)

        def chain(x, o):
            return (x.astype(jnp.float32) + 1e-3 * o.astype(jnp.float32)).astype(x.dtype)

        def evo_program(m, q, k_all, v_all, lengths, state):
            state = start_forward(m, cfg, state, "decode", B, 1, N, lengths=lengths)
            x = q
            for layer in range(L):
                lay = jnp.int32(layer)
                info = jax.tree_util.tree_map(lambda a: a[layer], info_all)
                ctx = LayerContext(layer=lay, lengths=lengths, info=info,
                                   segment="dense" if layer < m.dense_layers else "sparse")
                view = LayerKV(k=k_all[layer], v=v_all[layer], k_all=k_all, v_all=v_all, layer=lay)
                o, state = m.decode(ctx, x, view, state)
                x = chain(x, o)
            return x, state.heat

        def dense_program(q, k_all, v_all, lengths):
            x = q
            for layer in range(L):
                x = chain(x, dense_decode_stacked(x, k_all, v_all, jnp.int32(layer), lengths,
                                                  implementation="pallas_gpu"))
            return x

        evo = jax.jit(evo_program)
        dense = jax.jit(dense_program)
        t_evo = time_ms(lambda: evo(m, q, k_all, v_all, lengths, state), warmup=2, iters=5)
        t_dense = time_ms(lambda: dense(q, k_all, v_all, lengths), warmup=2, iters=5)
        fl = {R: attention_floors(B, CONTEXT_E2E, hbm, R) for R in layer_kinds(cfg, heads_model)}
        kinds = layer_kinds(cfg, heads_model)
        dense_floor = L * next(iter(fl.values()))["dense_floor_ms"]
        evo_floor = 2 * next(iter(fl.values()))["dense_floor_ms"] + sum(n * fl[R]["retrieval_floor_ms"]
                                                                     for R, n in kinds.items())
        per_dense = t_dense / L
        rows.append(dict(part="model_attention_program", batch=B, context=CONTEXT_E2E, layers=L,
                         evosparse_ms=t_evo, dense_ms=t_dense, speedup=t_dense / t_evo,
                         sparse_layer_ms=(t_evo - 2 * per_dense) / (L - 2), dense_layer_ms=per_dense,
                         speedup_sparse_layer=per_dense / ((t_evo - 2 * per_dense) / (L - 2)),
                         evosparse_floor_ms=evo_floor, dense_floor_ms=dense_floor,
                         layer_kinds={str(R): n for R, n in sorted(kinds.items())}))
        del cache, k_all, v_all
    except Exception as e:  # noqa: BLE001 - out of memory and the like: record and go on
        rows.append(dict(part="model_attention_program", batch=B, context=CONTEXT_E2E,
                         error=str(e).splitlines()[0][:300]))
    print(rows[-1], flush=True)
    return rows


# bench_model.decode_steps with the method's state (EvoSparse's heat) carried across the steps.
decode_steps = bench_model.method_decode_steps


def e2e_rows(batches, steps, hbm, heads_model, params, t0) -> list[dict]:
    cfg = CFG8B
    dense = bench_model.make_method("dense")
    evo = method_for(cfg, heads_model)
    capacity = round_up(CONTEXT_E2E + steps + 1, 256)
    weights = bench_model.decode_bytes(cfg, params, 1, 0)
    L = cfg.num_layers
    kinds = layer_kinds(cfg, heads_model)
    rows = []
    for B in batches:
        cases = [("dense", dense), ("evosparse", evo)]
        if B == max(batches):
            cases.append(("evosparse_cond", evo.replace(branchless=False)))
        for name, m in cases:
            row = dict(part="decode_step", method=name, batch=B, context=CONTEXT_E2E)
            if time.perf_counter() - t0 > E2E_BUDGET_S:
                row["skipped"] = "time budget"
                rows.append(row)
                continue
            cache = None
            try:
                cache = bench_model.filled_cache(cfg, B, CONTEXT_E2E, capacity, jnp.bfloat16)
                state = m.init_state(cfg, B, capacity) if name != "dense" else None
                tok = jnp.zeros((B, 1), jnp.int32)
                tok, cache, state = decode_steps(params, m, tok, cache, state, cfg=cfg, steps=steps)  # compile
                jax.block_until_ready(tok)
                cache = KVCache(k=cache.k, v=cache.v, lengths=jnp.full((B,), CONTEXT_E2E, jnp.int32))
                t = time.perf_counter()
                tok, cache, state = decode_steps(params, m, tok, cache, state, cfg=cfg, steps=steps)
                jax.block_until_ready(tok)
                ms = (time.perf_counter() - t) * 1e3 / steps
                fl = {R: attention_floors(B, CONTEXT_E2E + steps // 2, hbm, R) for R in kinds}
                dense_bytes = next(iter(fl.values()))["dense_bytes"]
                kv = L * dense_bytes if name == "dense" else (
                    2 * dense_bytes + sum(n * fl[R]["retrieval_bytes"] for R, n in kinds.items()))
                nbytes = weights + kv
                row.update(step_ms=ms, tokens_per_s=B / (ms * 1e-3), floor_ms=nbytes / (hbm * 1e9) * 1e3,
                           weights_floor_ms=weights / (hbm * 1e9) * 1e3, bytes=nbytes)
            except Exception as e:  # noqa: BLE001 - out of memory and the like: record and go on
                row["error"] = str(e).splitlines()[0][:300]
            del cache
            rows.append(row)
            print(row, flush=True)
    for B in batches:
        d = [r for r in rows if r["batch"] == B and r.get("method") == "dense" and "step_ms" in r]
        for e in [r for r in rows if r["batch"] == B and r.get("method", "").startswith("evosparse") and "step_ms" in r]:
            if d:
                e["speedup_vs_dense"] = d[0]["step_ms"] / e["step_ms"]
    return rows


def main(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="32768,65536,100000,131072", type=positive_ints)
    p.add_argument("--batches", default="1,4", type=positive_ints)
    p.add_argument("--e2e-batches", default="1,4", type=positive_ints)
    p.add_argument("--iters", type=positive_int, default=20, help="layer calls per timed loop (attention part)")
    p.add_argument("--steps", type=positive_int, default=16, help="decode steps per timed loop (end to end)")
    p.add_argument("--no-e2e", action="store_true")
    p.add_argument("--evo-kernels", default=None, choices=["xla", "pallas_gpu"],
                   help="EvoSparse's block_scores kernels (default: Triton on the GPU)")
    p.add_argument("--no-kernel-checks", action="store_true")
    p.add_argument("--no-program", action="store_true", help="skip the one-program whole-model attention")
    add_out_argument(p, "bench_evosparse.json")
    a = p.parse_args(argv)
    if not a.batches:
        p.error("--batches is empty: expected one or more batch sizes")
    try:
        require_gpu("evosparse")
        a.out = out_path(a.out, "bench_evosparse.json")
    except ValueError as e:
        p.error(str(e))
    global EVO_KERNELS
    EVO_KERNELS = a.evo_kernels
    set_xla_flags()  # cuBLAS GEMMs + dynamic-slice fusion, before the backend starts (as bench_model)
    # The batch-4 decode step holds 16 GB of weights and a 24.5 GiB cache (donated): more than JAX's default 75%.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    t0 = time.perf_counter()
    contexts = [round_up(n, 256) for n in a.contexts]  # 100000 -> 100096 (whole blocks)
    batches = a.batches
    facts = device_facts()
    hbm = measure_hbm_gbs()
    heads_model = model_heads(CFG8B)
    checks = check(jax.random.key(0)) + ([] if a.no_kernel_checks else kernel_checks(jax.random.key(1)))
    # The decode step first, then the 100K attention cases, then the other contexts while time is left.
    first = [n for n in contexts if n == round_up(CONTEXT_E2E, 256)]
    e2e = []
    if not a.no_e2e:  # first, while the GPU memory is empty (a 100K batch-4 cache is 24.5 GiB)
        params = random_params(CFG8B, jax.random.key(0), jnp.bfloat16)
        e2e = e2e_rows(a.e2e_batches, a.steps, hbm, heads_model, params, t0)
        del params
        jax.clear_caches()
    program = [] if a.no_program else model_program_rows(max(batches), heads_model, hbm)
    jax.clear_caches()
    rows = attention_rows(first, batches, a.iters, hbm, heads_model, t0, first_context=first[0] if first else None)
    rows += attention_rows([n for n in contexts if n not in first], batches, a.iters, hbm, heads_model, t0)
    rows.sort(key=lambda r: (r["batch"], r["context"]))
    payload = {**facts, "benchmark": "evosparse decode vs dense (cuDNN / XLA)",
               "xla_flags": os.environ.get("XLA_FLAGS", ""),
               "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"), "shape": "llama3-8b", "dtype": "bfloat16",
               "budget_tokens": BUDGET_TOKENS, "evo_kernels": EVO_KERNELS or "default", "block_size": BLOCK, "measured_hbm_gbs": hbm,
               "retrieval_heads_e2e": [list(h) for h in heads_model], "checks": checks, "attention": rows,
               "decode_step": e2e, "model_attention_program": program, "seconds": time.perf_counter() - t0}
    write_json(a.out, payload)
    print(table(rows, ["batch", "context", "dense_cudnn_ms", "dense_xla_ms", "dense_pallas_ms", "evo_inherit_ms",
                       "evo_retrieval_r1_ms", "evo_retrieval_ms", "evo_sparse_layer_r2_ms",
                       "evo_sparse_layer_ms", "evo_floor_layer_ms", "dense_floor_ms", "speedup_sparse_layer",
                       "speedup_model_attention"]))
    parts = [r for r in rows if "part_attend_ms" in r]
    print(table(parts, ["batch", "context"] + [f"part_{p}_{x}" for p in PARTS for x in ("ms", "floor_ms")]
                + [f"part_attend_heat_s{n}_ms" for n in HEAT_SPLITS]))
    print(table(program, ["batch", "context", "layers", "evosparse_ms", "dense_ms", "speedup", "sparse_layer_ms",
                          "dense_layer_ms", "speedup_sparse_layer", "evosparse_floor_ms", "dense_floor_ms", "error"]))
    print(table(e2e, ["method", "batch", "context", "step_ms", "floor_ms", "weights_floor_ms", "tokens_per_s",
                      "speedup_vs_dense", "error"]))


if __name__ == "__main__":
    main()

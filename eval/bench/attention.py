"""`jsparse bench attention`: sparse attention kernels against the dense baselines measured in the same run.

    jsparse bench attention --shape llama3-8b --context 32768,131072 --batch 8 --budget 0.1 --out FILE.json
    jsparse bench attention --phase prefill --shape llama3-8b --context 32768,131072 --out FILE.json
    (or python -m eval.bench.attention with the same arguments)

Random bf16 inputs of a real model's attention shape (heads, KV heads, head dim and layer count from
models/presets.py). Every time is a median after warm-up (`eval.bench.common.time_ms`; calls faster than 2 ms
are dispatched back to back in groups, so launch latency overlaps).

Decode (B = --batch, one new token, the cache full at each context N):
  * dense: cuDNN (`pallas_kernels.dense.dense_decode`), XLA einsum over the head-major cache, and the Triton
    split-K kernel (`pallas_kernels.dense_decode`); the best of them is "dense" in every ratio;
  * gathered attention over K = budget * N selected tokens (`sparse_attention.sparse_decode`: the Triton
    kernel at block_size 1 and 16, XLA's gather), GB/s of the selected K/V bytes;
  * selection of K of N per (row, KV head) on the anchor's pooled scores: `topk_select` (Triton radix; a few
    configurations) against `lax.top_k` alone and `lax.top_k` + the sort to ascending order (what
    `jsparse.selection.topk_indices` costs);
  * the Kascade anchor layer (`anchor_attention.anchor_decode`: scoring pass + selection + gathered
    attention), its parts, and the dense anchor (layer 0: dense attention and selection in one pass);
  * whole-model attention time for Kascade with --anchors anchors (layer 0 included) of L layers: the sum
    over layers of layer 0 (dense anchor) + the other anchors + the reuse layers (gathered attention over an
    anchor's indices through a head map), against L dense decode layers, each layer timed as its own call
    ("kascade_model_sum"); and the same L layers run as ONE jitted program, each layer's output fed into the
    next one's query, against L dense layers run the same way ("kascade_model_program": no per-call dispatch
    between layers, as in the model's decode step);
Prefill (B = --prefill-batch, T = each context, tile = --tile query rows per index row, bs = --block-size):
  * dense cuDNN causal attention (`pallas_kernels.dense.dense_prefill`), TFLOP/s;
  * tile-gathered attention (`sparse_attention.sparse_prefill`) over the anchor's indices: the Triton kernel
    ("sparse_prefill_gpu"); with bs > 1 the anchor selects blocks of bs keys (Kascade's `prefill_block_size`)
    and "sparse_prefill" is the kernel the entry point picks (on Hopper the Mosaic GPU kernel for bs >= 8;
    recorded as `kernel`), with the Triton kernel on the same blocks beside it as "sparse_prefill_gpu";
  * the tile-pooled scores without [T, T] (`anchor_attention.gpu_prefill`: the lse pass, the pooling pass, or
    cuDNN's lse for the dense anchor; the Mosaic GPU kernels on Hopper, and the Triton ones beside them as
    "[triton]"), the selection over them (over blocks with bs > 1), the anchor layers (`anchor_prefill_gpu`
    with block_size=bs), and the whole-model sum ("kascade_model_sum": layer 0 + the other anchors + the reuse
    layers, the reuse layer timed on the kernel the model would run; issue 19's target: >= 3.2x cuDNN at 128K,
    tile 128).
Checks (compiled, against the jnp references, on smaller shapes, device memory poisoned with NaNs first):
topk_select equals lax.top_k exactly; the anchor kernels choose a valid top-k of the reference scores and
match the reference attention; the reuse layers' prefill kernels (Triton, and the one `sparse_attention.sparse_prefill`
picks: Mosaic GPU for blocks on Hopper) match the reference on the anchor's selection; the tile-pooled scores match
the reference.

The JSON names the device, jax version, date, commit, the measured HBM bandwidth and matmul rate, every record
and check, and a summary of the issue's targets. Sections past --time-budget seconds are recorded as skipped.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench import common as bm

TOL = 2e-2  # bf16 outputs: max abs error / max abs reference


# --------------------------------------------------------------------------------------------------------
# The CLI.


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="llama3-8b", help="model shape preset: llama3-8b or qwen3-8b")
    p.add_argument("--context", default="32768,131072", help="comma-separated context lengths (decode cache "
                   "length N, prefill length T)")
    p.add_argument("--batch", type=bm.positive_int, default=8, help="decode batch size (default 8)")
    p.add_argument("--prefill-batch", type=bm.positive_int, default=1, help="prefill batch size (default 1)")
    p.add_argument("--budget", type=float, default=0.1, help="kept fraction of the context (default 0.1)")
    p.add_argument("--min-tokens", type=bm.nonnegative_int, default=128, help="floor of Kascade's budget rule (default 128)")
    p.add_argument("--phase", choices=("decode", "prefill", "both"), default="decode",
                   help="which phase to benchmark (default decode)")
    p.add_argument("--anchors", type=bm.positive_int, default=5,
                   help="Kascade anchor layers, layer 0 included (default 5)")
    p.add_argument("--tile", type=bm.positive_int, default=128, help="prefill query rows per index row (default 128)")
    p.add_argument("--block-size", type=int, default=1,
                   help="prefill: Kascade's anchors select key blocks of this many tokens (jsparse's kascade "
                        "prefill_block_size: the tile scores summed per block, ceil(k / bs) blocks kept); the "
                        "reuse and anchor layers then gather blocks, on Hopper with the Mosaic GPU kernel for "
                        "bs >= 8. A power of two dividing --tile (default 1: token selection)")
    p.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    p.add_argument("--no-variants", action="store_true", help="default kernel configurations only")
    p.add_argument("--time-budget", type=float, default=270.0,
                   help="seconds after which remaining sections are recorded as skipped (default 270)")
    p.add_argument("--interpret", action="store_true",
                   help="run the Pallas GPU kernels in the interpreter (a CPU smoke test at tiny sizes)")
    bm.add_out_argument(p, "bench_attention.json", optional=True)


def add_bench_attention_parser(bench_subparsers) -> argparse.ArgumentParser:
    """Adds `attention` to the `jsparse bench` subcommands (sets func=run_bench_attention)."""
    p = bench_subparsers.add_parser(
        "attention", help="sparse attention kernels, selection and Kascade layers vs dense cuDNN/XLA",
        description=__doc__.split("\n\n")[2] if __doc__ else None)
    _add_arguments(p)
    p.set_defaults(func=run_bench_attention)
    return p


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    return run_bench_attention(p.parse_args(argv))


# --------------------------------------------------------------------------------------------------------
# Timing and bookkeeping.


class Bench:
    """Records, checks and the time budget of one run."""

    def __init__(self, args):
        self.args = args
        self.t0 = time.perf_counter()
        self.records: list[dict] = []
        self.checks: list[dict] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over_budget(self) -> bool:
        return self.elapsed() > self.args.time_budget

    def time(self, fn: Callable, *args) -> float:
        """Median ms of fn(*args): compile + one call first, then `bm.time_ms` (fast calls grouped)."""
        jax.block_until_ready(fn(*args))
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        once = (time.perf_counter() - t) * 1e3
        if once > 50:
            return bm.time_ms(fn, *args, warmup=1, iters=3)
        if once > 2:
            return bm.time_ms(fn, *args, warmup=2, iters=10)
        inner = 8

        def group(*a):
            out = None
            for _ in range(inner):
                out = fn(*a)
            return out

        return bm.time_ms(group, *args, warmup=2, iters=15) / inner

    def record(self, name: str, fn: Callable | None, *args, **meta) -> dict:
        """Times fn(*args) into a record {section..., impl: name, ms, ...} (errors and skips recorded too)."""
        rec = dict(meta, impl=name)
        if self.over_budget():
            rec["skipped"] = "time budget"
        elif fn is None:
            rec["skipped"] = meta.get("why", "not available")
        else:
            try:
                rec["ms"] = self.time(fn, *args)
            except Exception as e:  # noqa: BLE001 - record (out of memory, unsupported) and go on
                rec["error"] = (type(e).__name__ + ": " + str(e).strip().splitlines()[0])[:300]
        rec.pop("why", None)
        self.records.append(rec)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()}, flush=True)
        return rec

    def check(self, **rec) -> None:
        self.checks.append(rec)
        print("check", rec, flush=True)


def poison() -> None:
    """Fills (then frees) 1 GiB of device memory with NaNs, so output buffers the kernels forget start as NaN."""
    if jax.default_backend() != "gpu":
        return
    x = jnp.full((1 << 29,), jnp.nan, jnp.bfloat16)
    x.block_until_ready()
    del x


def rel_err(got, want) -> float:
    got = jnp.asarray(got, jnp.float32)
    want = jnp.asarray(want, jnp.float32)
    err = jnp.max(jnp.where(jnp.isfinite(want), jnp.abs(got - want), 0.0))
    bad = jnp.any(jnp.isfinite(want) & ~jnp.isfinite(got))
    scale = jnp.maximum(jnp.max(jnp.where(jnp.isfinite(want), jnp.abs(want), 0.0)), 1e-30)
    return float("inf") if bool(bad) else float(err / scale)


@jax.jit
def selection_gap(indices, scores, kk):
    """How far `indices` [..., K] is from a top-kk choice of `scores` [..., N] (on the device).

    Returns:
      (max over rows of (best unselected score - worst selected score), 0 if none; count mismatches: rows whose
       number of chosen positions differs from min(kk, finite scores); bad: rows with duplicates, unsorted
       entries or a -inf pick).
    """
    N = scores.shape[-1]
    kk = jnp.broadcast_to(kk, indices.shape[:-1])
    valid = indices >= 0
    chosen = jnp.zeros(scores.shape, jnp.int32)
    rows = jnp.indices(indices.shape[:-1])
    flat = jnp.where(valid, indices, N)
    chosen = chosen.at[(*[r[..., None] for r in rows], flat)].add(1, mode="drop")
    picked = jnp.where(chosen > 0, scores, jnp.inf)
    rest = jnp.where((chosen == 0) & jnp.isfinite(scores), scores, -jnp.inf)
    gap = jnp.max(jnp.maximum(jnp.max(rest, -1) - jnp.min(picked, -1), 0.0))
    n_fin = jnp.sum(scores > -jnp.inf, -1)
    count_bad = jnp.sum(jnp.sum(valid, -1) != jnp.minimum(kk, n_fin))
    nxt = jnp.concatenate([indices[..., 1:], jnp.full(indices.shape[:-1] + (1,), -1, indices.dtype)], -1)
    order_bad = valid & (nxt >= 0) & (nxt <= indices)
    pad_bad = ~valid & (nxt >= 0)
    inf_pick = (chosen > 0) & ~(scores > -jnp.inf)
    bad = jnp.sum(jnp.any(order_bad | pad_bad, -1)) + jnp.sum(jnp.any(inf_pick, -1)) + jnp.sum(chosen > 1)
    return gap, count_bad, bad


# --------------------------------------------------------------------------------------------------------
# Decode.


def _kinds(interpret: bool):
    """The GPU kernels' modules and the keyword that runs them in the interpreter."""
    from pallas_kernels.anchor_attention import gpu as anchor_gpu
    from pallas_kernels.anchor_attention import gpu_prefill
    from pallas_kernels.sparse_attention import gpu as sparse_gpu
    from pallas_kernels.topk_select import gpu as select_gpu
    return anchor_gpu, gpu_prefill, sparse_gpu, select_gpu, dict(interpret=True) if interpret else {}


def check_decode(run: Bench, cfg, budget: float, min_tokens: int) -> None:
    """Compiled checks of topk_select and anchor_decode against the references (B = 2, N = 8192)."""
    from pallas_kernels.anchor_attention import reference as anchor_ref
    from pallas_kernels.anchor_attention.common import budget_count, positions
    from pallas_kernels.sparse_attention.reference import sparse_decode_reference
    from pallas_kernels.topk_select import topk_select_reference

    anchor_gpu, _, _, select_gpu, ik = _kinds(run.args.interpret)
    B, N = (2, 8192) if not run.args.interpret else (1, 256)
    Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ks = jax.random.split(jax.random.key(7), 4)
    q = jax.random.normal(ks[0], (B, 1, Hq, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, Hkv, N, D), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, Hkv, N, D), jnp.bfloat16)
    lengths = jnp.array([N - 37] + [N] * (B - 1), jnp.int32)
    K = budget_count(budget, N, min_tokens)
    for dense in (False, True):
        try:
            poison()
            out, idx = jax.jit(lambda *a: anchor_gpu.anchor_decode_gpu(
                *a, budget=budget, min_tokens=min_tokens, dense_output=dense, **ik))(q, k, v, lengths)
            want, want_idx = anchor_ref.anchor_decode_reference(q, k, v, lengths, budget=budget,
                                                                min_tokens=min_tokens, dense_output=dense)
            scores = anchor_ref.decode_scores_reference(q, k, lengths)
            kk = budget_count(budget, positions(lengths, 1) + 1, min_tokens)[:, None, :]
            gap, count_bad, bad = (float(x) for x in selection_gap(idx, scores, kk))
            own = want if dense else sparse_decode_reference(q, k, v, idx, lengths)
            e = rel_err(out, own)
            same = float(jnp.mean(jnp.all(idx == want_idx, -1)))
            run.check(what="anchor_decode", dense_output=dense, B=B, N=N, K=K, out_rel_err=e, selection_gap=gap,
                      count_mismatch=count_bad, malformed_rows=bad, rows_equal_to_reference=same,
                      ok=bool(e <= TOL and gap <= 1e-3 and count_bad == 0 and bad == 0))
        except Exception as e:  # noqa: BLE001
            run.check(what="anchor_decode", dense_output=dense, error=repr(e)[:300], ok=False)
    # The stacked-cache gathered kernel the model runs (layer 1 of 2 read in place), with and without a head map.
    from pallas_kernels.sparse_attention import stacked as stacked_gpu
    from pallas_kernels.sparse_attention.testing import random_decode_indices
    rng = np.random.default_rng(7)
    k_all, v_all = jnp.stack([v, k]), jnp.stack([k, v])
    roll = jnp.asarray(np.roll(np.arange(Hkv), 3), jnp.int32)
    for T, bs, mapped in ((1, 1, False), (1, 1, True), (2, 16, True), (1, 16, False)):
        try:
            poison()
            qq = jax.random.normal(jax.random.key(T + bs), (B, T, Hq, D), jnp.bfloat16)
            ind = jnp.asarray(random_decode_indices(rng, np.asarray(lengths), Hkv, T, max(1, K // bs), block_size=bs))
            hm = roll if mapped else None
            got = jax.jit(lambda qq, ka, va, i, l: stacked_gpu.sparse_decode_stacked_gpu(
                qq, ka, va, jnp.int32(1), i, l, block_size=bs, head_map=hm, **ik))(qq, k_all, v_all, ind, lengths)
            want = sparse_decode_reference(qq, k, v, jnp.take(ind, roll, axis=1) if mapped else ind, lengths,
                                           block_size=bs)
            e = rel_err(got, want)
            run.check(what="sparse_decode_stacked", T=T, block_size=bs, head_map=mapped, out_rel_err=e, ok=e <= TOL)
        except Exception as e:  # noqa: BLE001
            run.check(what="sparse_decode_stacked", T=T, block_size=bs, head_map=mapped, error=repr(e)[:300],
                      ok=False)
    # Exact equality of the selection with lax.top_k on the reference scores (with ties: rounded scores).
    scores = anchor_ref.decode_scores_reference(q, k, lengths)
    for name, s in (("pooled scores", scores), ("rounded (many ties)", jnp.round(scores * 64) / 64)):
        for kk in (K, jnp.array([[[K // 3]]] * B, jnp.int32)):
            try:
                poison()
                got = jax.jit(lambda s, kk: select_gpu.topk_select_gpu(s, kk, K, **ik))(s, kk)
                want = topk_select_reference(s, kk, K)
                run.check(what="topk_select", scores=name, N=N, K=K, kk="K" if kk is K else "K/3",
                          equal=bool(jnp.all(got == want)), ok=bool(jnp.all(got == want)))
            except Exception as e:  # noqa: BLE001
                run.check(what="topk_select", scores=name, error=repr(e)[:300], ok=False)


def run_decode(run: Bench, cfg, N: int, summary: dict) -> None:
    from pallas_kernels.anchor_attention.common import budget_count
    from pallas_kernels.dense import dense_decode
    from pallas_kernels.sparse_attention import xla as sparse_xla
    from pallas_kernels.sparse_attention.testing import strided_indices
    from pallas_kernels.topk_select import topk_select_reference

    anchor_gpu, _, sparse_gpu, select_gpu, ik = _kinds(run.args.interpret)
    from pallas_kernels.sparse_attention import stacked as stacked_gpu
    args = run.args
    B, Hq, Hkv, D, L = args.batch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    budget, mt = args.budget, args.min_tokens
    K = budget_count(budget, N, mt)
    sec = dict(phase="decode", N=N, B=B)
    ks = jax.random.split(jax.random.key(N), 4)
    q = jax.random.normal(ks[0], (B, 1, Hq, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, Hkv, N, D), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, Hkv, N, D), jnp.bfloat16)
    lengths = jnp.full((B,), N, jnp.int32)
    kv_bytes = 2 * B * Hkv * N * D * 2
    sel_bytes = 2 * B * Hkv * K * D * 2

    # Dense baselines.
    dense = {}
    fns = {"dense_cudnn": jax.jit(lambda q, k, v, l: dense_decode(q, k, v, l)),
           "dense_xla_einsum": jax.jit(bm.dense_einsum_decode)}
    if jax.default_backend() == "gpu" or args.interpret:
        from pallas_kernels.dense_decode import gpu as dense_gpu
        if not args.interpret:
            fns["dense_pallas_splitk"] = jax.jit(
                lambda q, k, v, l: dense_gpu.dense_decode_stacked_gpu(q, k[None], v[None], jnp.int32(0), l))
    for name, fn in fns.items():
        r = run.record(name, fn, q, k, v, lengths, **sec, bytes=kv_bytes)
        if "ms" in r:
            dense[name] = r["ms"]
            r["gbs"] = kv_bytes / (r["ms"] * 1e-3) / 1e9
    best = min(dense.values()) if dense else float("nan")
    best_name = min(dense, key=dense.get) if dense else None
    for r in run.records:
        if r.get("phase") == "decode" and r.get("N") == N and r.get("impl") in dense:
            r["speedup_vs_best_dense"] = best / r["ms"]

    def add(name, fn, *a, nbytes=None, **meta):
        r = run.record(name, fn, *a, **sec, **meta)
        if "ms" in r:
            r["ratio_to_best_dense"] = r["ms"] / best
            r["speedup_vs_best_dense"] = best / r["ms"]
            if nbytes:
                r["bytes"] = nbytes
                r["gbs"] = nbytes / (r["ms"] * 1e-3) / 1e9
        return r

    # The anchor: scores, selection, gathered attention.
    scores, _ = jax.jit(lambda *a: anchor_gpu.decode_scores_gpu(*a, **ik))(q, k, v, lengths)
    kk = jnp.full((B, 1, 1), K, jnp.int32)
    idx = jax.jit(lambda s: select_gpu.topk_select_gpu(s, kk, K, **ik))(scores)
    sel = dict(K=K, rows=B * Hkv)
    add("select_topk_select_gpu", jax.jit(lambda s: select_gpu.topk_select_gpu(s, kk, K, **ik)), scores,
        part="selection", **sel)
    if not args.no_variants:
        for name, c in (("fused", select_gpu.SelectConfig(path="fused")),
                        ("fused_bits2", select_gpu.SelectConfig(path="fused", bits_per_pass=2)),
                        ("sample_s4096", select_gpu.SelectConfig(path="sample", sample_size=4096))):
            add(f"select_topk_select_gpu[{name}]",
                jax.jit(lambda s, c=c: select_gpu.topk_select_gpu(s, kk, K, config=c, **ik)), scores,
                part="selection", **sel)
    add("select_lax_top_k", jax.jit(lambda s: jax.lax.top_k(s, K)[1]), scores, part="selection", **sel)
    add("select_lax_top_k_sorted", jax.jit(lambda s: topk_select_reference(s, kk, K)), scores, part="selection",
        **sel)

    add("scores_pass_gpu", jax.jit(lambda *a: anchor_gpu.decode_scores_gpu(*a, **ik)[0]), q, k, v, lengths,
        part="anchor", nbytes=kv_bytes // 2)
    for bs in (1, 16):
        if bs == 1:
            ind = idx
        else:
            ind = strided_indices(jax.random.key(3), jnp.full((B, Hkv, 1), N // bs, jnp.int32), K // bs, K // bs)
        nb = 2 * B * Hkv * (K // bs) * bs * D * 2
        add(f"sparse_decode_gpu[bs{bs}]",
            jax.jit(lambda q, k, v, i, l, bs=bs: sparse_gpu.sparse_decode_gpu(q, k, v, i, l, block_size=bs, **ik)),
            q, k, v, ind, lengths, part="sparse", block_size=bs, nbytes=nb, K=K // bs)
        add(f"sparse_decode_stacked_gpu[bs{bs}]",  # what the model runs: the layer read in place, no XLA glue
            jax.jit(lambda q, k, v, i, l, bs=bs: stacked_gpu.sparse_decode_stacked_gpu(
                q, k[None], v[None], jnp.int32(0), i, l, block_size=bs, **ik)),
            q, k, v, ind, lengths, part="sparse", block_size=bs, nbytes=nb, K=K // bs)
        add(f"sparse_decode_xla[bs{bs}]",
            jax.jit(lambda q, k, v, i, l, bs=bs: sparse_xla.sparse_decode_xla(q, k, v, i, l, block_size=bs)),
            q, k, v, ind, lengths, part="sparse", block_size=bs, nbytes=nb, K=K // bs)
    if not args.no_variants:  # tunings of the stacked gathered kernel at block_size 1
        nb1 = 2 * B * Hkv * K * D * 2
        for name, c in (("bk128", sparse_gpu.DecodeConfig(block_k=128)),
                        ("s3", sparse_gpu.DecodeConfig(num_stages=3)),
                        ("tp1024", sparse_gpu.DecodeConfig(target_programs=1024)),
                        ("tp256", sparse_gpu.DecodeConfig(target_programs=256)),
                        ("w8", sparse_gpu.DecodeConfig(num_warps=8))):
            add(f"sparse_decode_stacked_gpu[bs1,{name}]",
                jax.jit(lambda q, k, v, i, l, c=c: stacked_gpu.sparse_decode_stacked_gpu(
                    q, k[None], v[None], jnp.int32(0), i, l, config=c, **ik)),
                q, k, v, idx, lengths, part="sparse", block_size=1, nbytes=nb1, K=K)
    anchor_bytes = kv_bytes // 2 + sel_bytes
    r_anchor = add("anchor_decode_gpu", jax.jit(lambda *a: anchor_gpu.anchor_decode_gpu(
        *a, budget=budget, min_tokens=mt, **ik)), q, k, v, lengths, part="anchor", nbytes=anchor_bytes, K=K)
    r_dense_anchor = add("anchor_decode_gpu[dense_output]", jax.jit(lambda *a: anchor_gpu.anchor_decode_gpu(
        *a, budget=budget, min_tokens=mt, dense_output=True, **ik)), q, k, v, lengths, part="anchor",
        nbytes=kv_bytes, K=K)
    if not args.no_variants:
        for name, c in (("bn64", anchor_gpu.AnchorConfig(block_n=64)),
                        ("bn256_w8", anchor_gpu.AnchorConfig(block_n=256, num_warps=8)),
                        ("2048prog", anchor_gpu.AnchorConfig(target_programs=2048))):
            add(f"scores_pass_gpu[{name}]", jax.jit(lambda *a, c=c: anchor_gpu.decode_scores_gpu(
                *a, config=c, **ik)[0]), q, k, v, lengths, part="anchor", nbytes=kv_bytes // 2)
    from pallas_kernels.anchor_attention import xla as anchor_xla
    add("anchor_decode_xla_scores", jax.jit(lambda *a: anchor_xla.anchor_decode_xla(
        *a, budget=budget, min_tokens=mt)), q, k, v, lengths, part="anchor", K=K)

    # Whole-model attention for Kascade: layer 0 (dense anchor) + the other anchors + reuse layers.
    # A reuse layer as the model runs it: the stacked cache read in place, the head map applied in-kernel.
    head_map = jnp.asarray(np.roll(np.arange(Hkv), 1), jnp.int32)
    r_reuse = add("kascade_reuse_layer", jax.jit(lambda q, k, v, i, l: stacked_gpu.sparse_decode_stacked_gpu(
        q, k[None], v[None], jnp.int32(0), i, l, head_map=head_map, **ik)), q, k, v, idx, lengths, part="kascade",
        K=K)
    if not args.no_variants:  # the earlier form: an XLA gather of the index rows, then the kernel
        add("kascade_reuse_layer[take]", jax.jit(lambda q, k, v, i, l: sparse_gpu.sparse_decode_gpu(
            q, k, v, jnp.take(i, head_map, axis=1), l, **ik)), q, k, v, idx, lengths, part="kascade", K=K)
    A = args.anchors
    if all("ms" in r for r in (r_anchor, r_dense_anchor, r_reuse)) and dense:
        total = r_dense_anchor["ms"] + (A - 1) * r_anchor["ms"] + (L - A) * r_reuse["ms"]
        dense_total = L * best
        run.records.append(dict(sec, impl="kascade_model_sum", part="kascade", layers=L, anchors=A,
                                ms=total, dense_ms=dense_total, dense_impl=best_name,
                                speedup_vs_best_dense=dense_total / total,
                                layers_ms=dict(layer0_dense_anchor=r_dense_anchor["ms"], anchor=r_anchor["ms"],
                                               reuse=r_reuse["ms"])))
        print(run.records[-1], flush=True)
    # The same layers as ONE program (what the model runs: no per-call dispatch between layers): every layer
    # reads the same K/V (4 GiB at 128K B8, far beyond L2) and feeds its output into the next layer's query, so
    # nothing is hoisted or merged; dense runs the best kernel (Pallas split-K) the same way.
    if jax.default_backend() == "gpu" or args.interpret:
        from pallas_kernels.dense_decode import gpu as dense_gpu
        Lp = L if not args.interpret else min(L, 4)
        anchor_layers = {0} | {round(i * Lp / A) for i in range(1, A)}
        zero = jnp.int32(0)

        def chain(x, o):
            return (x.astype(jnp.float32) + 1e-3 * o.astype(jnp.float32)).astype(x.dtype)

        def kascade_program(q, k, v, l):
            k, v, x, idx = k[None], v[None], q, None
            for layer in range(Lp):
                if layer in anchor_layers:
                    o, idx = anchor_gpu.anchor_decode_gpu(x, k, v, l, budget=budget, min_tokens=mt, K=K, layer=zero,
                                                          dense_output=layer == 0, **ik)
                else:
                    o = stacked_gpu.sparse_decode_stacked_gpu(x, k, v, zero, idx, l, head_map=head_map, **ik)
                x = chain(x, o)
            return x

        def dense_program(q, k, v, l):
            k, v, x = k[None], v[None], q
            for _ in range(Lp):
                x = chain(x, dense_gpu.dense_decode_stacked_gpu(x, k, v, zero, l, **ik))
            return x

        r_kp = run.record("kascade_model_program", jax.jit(kascade_program), q, k, v, lengths, **sec, part="kascade",
                          layers=Lp, anchors=sorted(anchor_layers))
        r_dp = run.record("dense_model_program", jax.jit(dense_program), q, k, v, lengths, **sec, part="kascade",
                          layers=Lp)
        if "ms" in r_kp and "ms" in r_dp:
            r_kp["speedup_vs_dense_program"] = r_dp["ms"] / r_kp["ms"]
            print(r_kp, flush=True)
    by = {r["impl"]: r for r in run.records if r.get("phase") == "decode" and r.get("N") == N and "ms" in r}
    summary[f"decode_N{N}"] = {
        "best_dense": best_name, "best_dense_ms": best,
        "gathered_speedup": {n: by[n]["speedup_vs_best_dense"] for n in by
                             if n.startswith(("sparse_decode_gpu", "sparse_decode_stacked_gpu"))},
        "gathered_hbm_fraction": {n: by[n]["gbs"] / run.hbm for n in by
                                  if n.startswith(("sparse_decode_gpu", "sparse_decode_stacked_gpu"))},
        "selection_ratio_to_dense": {n: by[n]["ratio_to_best_dense"] for n in by if n.startswith("select_")},
        "anchor_ratio_to_dense": by.get("anchor_decode_gpu", {}).get("ratio_to_best_dense"),
        "dense_anchor_ratio_to_dense": by.get("anchor_decode_gpu[dense_output]", {}).get("ratio_to_best_dense"),
        "kascade_model_speedup": by.get("kascade_model_sum", {}).get("speedup_vs_best_dense"),
        "kascade_model_speedup_one_program": by.get("kascade_model_program", {}).get("speedup_vs_dense_program"),
        "targets": "gathered >= 8x (>= 85% HBM), selection <= 0.25, anchor <= 1.3, kascade model >= 4.5x (at 128K)"}


# --------------------------------------------------------------------------------------------------------
# Prefill.


def check_prefill(run: Bench, cfg, budget: float, min_tokens: int, tile: int, block_size: int = 1) -> None:
    """Compiled checks of the tile-pooled scores and the anchor prefill (block_size: its selection in blocks)
    against the references (T = 2048)."""
    from pallas_kernels.anchor_attention import reference as anchor_ref
    from pallas_kernels.anchor_attention.common import block_counts, pool_blocks
    from pallas_kernels.sparse_attention.reference import sparse_prefill_reference

    from pallas_kernels.sparse_attention import api as sparse_api

    _, gpu_prefill, sparse_gpu, _, ik = _kinds(run.args.interpret)
    T = 2048 if not run.args.interpret else 64
    tile = tile if not run.args.interpret else 16
    bs = min(block_size, tile)
    Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ks = jax.random.split(jax.random.key(11), 3)
    q, k, v = (jax.random.normal(kk, (1, T, h, D), jnp.bfloat16) for kk, h in zip(ks, (Hq, Hkv, Hkv)))
    lengths = jnp.array([T - 37], jnp.int32)
    try:
        want = anchor_ref.tile_scores_reference(q, k, tile=tile)
        want_rows = anchor_ref.tile_scores_reference(q, k, tile=tile, lengths=lengths)  # the padding adds nothing
        configs = [("default", gpu_prefill.PrefillScoresConfig())]  # (Mosaic GPU on Hopper)
        if not run.args.interpret:
            configs.append(("triton", gpu_prefill.PrefillScoresConfig(mosaic=False)))
        for name, c in configs:
            poison()
            got = jax.jit(lambda q, k, c=c: gpu_prefill.tile_scores_gpu(q, k, tile=tile, config=c, **ik))(q, k)
            fin_ok = bool(jnp.all(jnp.isfinite(got) == jnp.isfinite(want)))
            e = rel_err(got, want)
            run.check(what="tile_scores", config=name, T=T, tile=tile, rel_err=e, finite_pattern_ok=fin_ok,
                      ok=bool(e <= 1e-2 and fin_ok))
        if not run.args.interpret:
            try:  # cuDNN's lse comes through a JAX-internal entry point: optional, not counted in the exit code
                lse_pass = gpu_prefill.prefill_lse_gpu(q, k)
                _, lse_cudnn = jax.jit(gpu_prefill.dense_prefill_with_lse)(q, k, v)
                d = float(jnp.max(jnp.abs(lse_pass - lse_cudnn)))
                run.check(what="cudnn_lse_vs_lse_pass", T=T, max_abs_diff=d, ok=bool(d <= 2e-2), optional=True)
            except Exception as e:  # noqa: BLE001
                run.check(what="cudnn_lse_vs_lse_pass", error=repr(e)[:300], ok=False, optional=True)
        for dense in (False, True):
            poison()
            out, idx = jax.jit(lambda *a: gpu_prefill.anchor_prefill_gpu(
                *a, tile=tile, budget=budget, min_tokens=min_tokens, dense_output=dense, block_size=bs,
                **ik))(q, k, v, lengths)
            kk = block_counts(budget, T, tile, min_tokens, bs)[None, None, :]
            gap, count_bad, bad = (float(x) for x in selection_gap(idx, pool_blocks(want_rows, bs), kk))
            ref_out = (jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla") if dense else
                       sparse_prefill_reference(q, k, v, idx, lengths, tile=tile, block_size=bs))
            e = rel_err(out[:, :T - 37] if not dense else out, ref_out[:, :T - 37] if not dense else ref_out)
            run.check(what="anchor_prefill", dense_output=dense, T=T, tile=tile, block_size=bs, out_rel_err=e,
                      selection_gap=gap, count_mismatch=count_bad, malformed_rows=bad,
                      ok=bool(e <= TOL and gap <= 1e-2 and count_bad == 0 and bad == 0))
            if not dense:
                sel_idx = idx
        # The reuse layers' kernels on the anchor's selection: the Triton kernel, and the one the entry point picks
        # (the Mosaic GPU kernel for blocks on Hopper), the two the timed section runs.
        ref_out = sparse_prefill_reference(q, k, v, sel_idx, lengths, tile=tile, block_size=bs)
        kernels = {"pallas_gpu": lambda q, k, v, i, l: sparse_gpu.sparse_prefill_gpu(
            q, k, v, i, l, tile=tile, block_size=bs, **ik)}
        picked = "pallas_gpu" if run.args.interpret else sparse_api._pick(None, q, bs, tile, Hq // Hkv)
        if picked != "pallas_gpu":
            kernels[picked] = lambda q, k, v, i, l: sparse_api.sparse_prefill(q, k, v, i, l, tile=tile, block_size=bs)
        for name, fn in kernels.items():
            poison()
            got = jax.jit(fn)(q, k, v, sel_idx, lengths)
            e = rel_err(got[:, :T - 37], ref_out[:, :T - 37])
            run.check(what="sparse_prefill", kernel=name, T=T, tile=tile, block_size=bs, out_rel_err=e, ok=bool(e <= TOL))
    except Exception as e:  # noqa: BLE001
        run.check(what="prefill", error=repr(e)[:300], ok=False)


def run_prefill(run: Bench, cfg, T: int, summary: dict) -> None:
    from pallas_kernels.anchor_attention.common import block_counts, block_width, budget_count, pool_blocks
    from pallas_kernels.dense import dense_prefill
    from pallas_kernels.sparse_attention import api as sparse_api

    _, gpu_prefill, sparse_gpu, select_gpu, ik = _kinds(run.args.interpret)
    args = run.args
    B, Hq, Hkv, D, L = args.prefill_batch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    budget, mt, tile, bs = args.budget, args.min_tokens, args.tile, args.block_size
    K = budget_count(budget, T, mt)  # keys; the index width is ceil(K / bs) entries
    Kb = block_width(K, bs)
    nt = -(-T // tile)
    sec = dict(phase="prefill", T=T, B=B, tile=tile, block_size=bs)
    ks = jax.random.split(jax.random.key(T), 3)
    q, k, v = (jax.random.normal(kk, (B, T, h, D), jnp.bfloat16) for kk, h in zip(ks, (Hq, Hkv, Hkv)))
    lengths = jnp.full((B,), T, jnp.int32)
    dense_flops = 4 * D * Hq * B * T * (T + 1) / 2
    qk_flops = dense_flops / 2

    r = run.record("dense_cudnn_causal", jax.jit(dense_prefill), q, k, v, **sec)
    dense_ms = r.get("ms", float("nan"))
    if "ms" in r:
        r.update(tflops=dense_flops / (r["ms"] * 1e-3) / 1e12, speedup_vs_dense=1.0)

    def add(name, fn, *a, flops=None, **meta):
        rec = run.record(name, fn, *a, **sec, **meta)
        if "ms" in rec:
            rec["ratio_to_dense"] = rec["ms"] / dense_ms
            rec["speedup_vs_dense"] = dense_ms / rec["ms"]
            if flops:
                rec["tflops"] = flops / (rec["ms"] * 1e-3) / 1e12
        return rec

    add("lse_pass_gpu", jax.jit(lambda q, k: gpu_prefill.prefill_lse_gpu(q, k, **ik)), q, k, part="scores",
        flops=qk_flops)
    lse = jax.jit(lambda q, k: gpu_prefill.prefill_lse_gpu(q, k, **ik))(q, k)
    pool_flops = 2 * D * Hq * B * tile * tile * nt * (nt - 1) / 2  # keys strictly before each tile
    add("pool_pass_gpu", jax.jit(lambda q, k, l: gpu_prefill.tile_scores_gpu(q, k, tile=tile, lse=l, **ik)),
        q, k, lse, part="scores", flops=pool_flops)
    if not args.interpret:  # the Triton kernels where the default above ran the Mosaic GPU ones
        c = gpu_prefill.PrefillScoresConfig(mosaic=False)
        add("lse_pass_gpu[triton]", jax.jit(lambda q, k: gpu_prefill.prefill_lse_gpu(q, k, config=c)), q, k,
            part="scores", flops=qk_flops)
        add("pool_pass_gpu[triton]", jax.jit(lambda q, k, l: gpu_prefill.tile_scores_gpu(
            q, k, tile=tile, lse=l, config=c)), q, k, lse, part="scores", flops=pool_flops)
    if not args.no_variants and not args.interpret:
        PSC = functools.partial(gpu_prefill.PrefillScoresConfig, mosaic=False)
        for name, c in (("bn128_pool64_w8", PSC(block_n=128, pool_block_n=64)),
                        ("w4", PSC(num_warps=4)),
                        ("bn32_pool64_w4_s3", PSC(block_n=32, pool_block_n=64, num_warps=4, num_stages=3))):
            add(f"lse_pass_gpu[{name}]", jax.jit(lambda q, k, c=c: gpu_prefill.prefill_lse_gpu(q, k, config=c)),
                q, k, part="scores", flops=qk_flops)
            add(f"pool_pass_gpu[{name}]", jax.jit(lambda q, k, l, c=c: gpu_prefill.tile_scores_gpu(
                q, k, tile=tile, lse=l, config=c)), q, k, lse, part="scores", flops=pool_flops)
    if not args.interpret:
        add("dense_cudnn_with_lse", jax.jit(gpu_prefill.dense_prefill_with_lse), q, k, v, part="scores",
            flops=dense_flops)
    scores = jax.jit(lambda q, k, l: pool_blocks(gpu_prefill.tile_scores_gpu(q, k, tile=tile, lse=l, **ik),
                                                 bs))(q, k, lse)  # [B, Hkv, nT, ceil(T / bs)]
    del lse
    kk = block_counts(budget, T, tile, mt, bs)[None, None, :]
    idx = jax.jit(lambda s: select_gpu.topk_select_gpu(s, kk, Kb, **ik))(scores)
    add("select_topk_select_gpu", jax.jit(lambda s: select_gpu.topk_select_gpu(s, kk, Kb, **ik)), scores,
        part="selection", rows=B * Hkv * nt, K=Kb)
    if not args.no_variants and not args.interpret:
        c = select_gpu.SelectConfig(bits_per_pass=2)
        add("select_topk_select_gpu[bits2]", jax.jit(lambda s: select_gpu.topk_select_gpu(s, kk, Kb, config=c)),
            scores, part="selection", rows=B * Hkv * nt, K=Kb)
    del scores
    counts = np.asarray(block_counts(budget, T, tile, mt, bs), np.int64) * bs  # keys attended before each tile
    pairs = int(np.sum(counts * tile) + nt * tile * (tile + 1) // 2)
    sparse_flops = 4 * D * Hq * B * pairs
    frac = pairs / (T * (T + 1) / 2)
    r_triton = add("sparse_prefill_gpu", jax.jit(lambda q, k, v, i, l: sparse_gpu.sparse_prefill_gpu(
        q, k, v, i, l, tile=tile, block_size=bs, **ik)), q, k, v, idx, lengths, part="sparse", flops=sparse_flops,
        attended_fraction=frac, kernel="pallas_gpu")
    r_reuse = r_triton
    kernel = "pallas_gpu" if args.interpret else sparse_api._pick(None, q, bs, tile, Hq // Hkv)
    if kernel != "pallas_gpu":  # the kernel the model's reuse layers run (Mosaic GPU for blocks on Hopper)
        r_reuse = add("sparse_prefill", jax.jit(lambda q, k, v, i, l: sparse_api.sparse_prefill(
            q, k, v, i, l, tile=tile, block_size=bs)), q, k, v, idx, lengths, part="sparse", flops=sparse_flops,
            attended_fraction=frac, kernel=kernel)
    akw = dict(tile=tile, budget=budget, min_tokens=mt, block_size=bs)
    r_anchor = add("anchor_prefill_gpu", jax.jit(lambda *a: gpu_prefill.anchor_prefill_gpu(*a, **akw, **ik)),
                   q, k, v, lengths, part="anchor", K=Kb)
    r_l0 = add("anchor_prefill_gpu[dense_output]", jax.jit(lambda *a: gpu_prefill.anchor_prefill_gpu(
        *a, **akw, dense_output=True, **ik)), q, k, v, lengths, part="anchor", K=Kb)
    r_l0c = {} if args.interpret else add(
        "anchor_prefill_gpu[dense_output,cudnn_lse]", jax.jit(lambda *a: gpu_prefill.anchor_prefill_gpu(
            *a, **akw, dense_output=True, dense_lse=True)), q, k, v, lengths, part="anchor", K=Kb)
    A = args.anchors
    l0 = min([r["ms"] for r in (r_l0, r_l0c) if "ms" in r], default=None)
    if l0 is not None and all("ms" in r for r in (r_anchor, r_reuse)) and math.isfinite(dense_ms):
        total = l0 + (A - 1) * r_anchor["ms"] + (L - A) * r_reuse["ms"]
        run.records.append(dict(sec, impl="kascade_model_sum", part="kascade", layers=L, anchors=A, ms=total,
                                dense_ms=L * dense_ms, speedup_vs_dense=L * dense_ms / total,
                                reuse_kernel=r_reuse.get("kernel"),
                                layers_ms=dict(layer0_dense_anchor=l0, anchor=r_anchor["ms"],
                                               reuse=r_reuse["ms"])))
        print(run.records[-1], flush=True)
    by = {r["impl"]: r for r in run.records if r.get("phase") == "prefill" and r.get("T") == T and "ms" in r}
    summary[f"prefill_T{T}"] = {
        "dense_cudnn_ms": dense_ms,
        "block_size": bs,
        "reuse_kernel": r_reuse.get("kernel"),
        "sparse_prefill_speedup": by.get(r_reuse["impl"], {}).get("speedup_vs_dense"),
        "sparse_prefill_triton_speedup": by.get("sparse_prefill_gpu", {}).get("speedup_vs_dense"),
        "anchor_ratio_to_dense": by.get("anchor_prefill_gpu", {}).get("ratio_to_dense"),
        "kascade_model_speedup": by.get("kascade_model_sum", {}).get("speedup_vs_dense"),
        "targets": "kascade model prefill >= 3.2x cuDNN at 128K with tile 128, >= 2.8x with tile 32 (issue 19)"}


# --------------------------------------------------------------------------------------------------------


def run_bench_attention(args) -> int:
    """Runs the benchmark described in the module docstring; returns 0 if every check passed."""
    cfg = bm.shape_preset(args.shape)
    try:
        contexts = bm.positive_ints(args.context)  # kept a string in args: the JSON records the command's options
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"--context {args.context!r}: {e}") from None
    if not contexts:
        raise ValueError(f"--context {args.context!r}: expected comma-separated positive integers")
    bm.check_contexts("--context", contexts, cfg, args.shape)
    bm.check_budget(args.budget)
    from pallas_kernels.anchor_attention.common import check_block_size
    check_block_size(args.block_size, args.tile, "--block-size")
    if not 1 <= args.anchors <= cfg.num_layers:
        raise ValueError(f"--anchors {args.anchors}: expected 1 .. {cfg.num_layers} (layer 0 included)")
    if not args.interpret:
        bm.require_gpu("attention", "--interpret")
    out = bm.out_path(args.out, "bench_attention.json")  # after the checks, before the run: none leaves a folder
    run = Bench(args)
    facts = bm.device_facts()
    print(f"# {facts}", flush=True)
    run.hbm = bm.measure_hbm_gbs() if not args.interpret else float("nan")
    mm = bm.measure_matmul_tflops() if not args.interpret else float("nan")
    summary: dict = {}
    phases = ("decode", "prefill") if args.phase == "both" else (args.phase,)
    if not args.no_check:
        if "decode" in phases:
            check_decode(run, cfg, args.budget, args.min_tokens)
        if "prefill" in phases:
            check_prefill(run, cfg, args.budget, args.min_tokens, args.tile, args.block_size)
    for phase in phases:
        for n in contexts:
            print(f"# {phase} {n} ({run.elapsed():.0f} s)", flush=True)
            if run.over_budget():
                run.records.append(dict(phase=phase, context=n, skipped="time budget"))
                continue
            (run_decode if phase == "decode" else run_prefill)(run, cfg, n, summary)
    payload = dict(facts, benchmark="attention: sparse kernels, selection, Kascade layers vs dense",
                   shape=dict(preset=args.shape, layers=cfg.num_layers, Hq=cfg.num_heads, Hkv=cfg.num_kv_heads,
                              D=cfg.head_dim, dtype="bfloat16"),
                   args={k: v for k, v in vars(args).items() if not callable(v)},
                   xla_flags=os.environ.get("XLA_FLAGS", ""), hbm_gbs_measured=run.hbm,
                   matmul_tflops_measured=mm, summary=summary, checks=run.checks, records=run.records,
                   wall_s=run.elapsed())
    if out:
        bm.write_json(out, payload)
    cols = ["phase", "N", "T", "impl", "ms", "gbs", "tflops", "speedup_vs_best_dense", "ratio_to_best_dense",
            "speedup_vs_dense", "ratio_to_dense", "skipped", "error"]
    print(bm.table(run.records, cols))
    print(f"measured HBM {run.hbm:.0f} GB/s, matmul {mm:.0f} TFLOP/s; {run.elapsed():.0f} s"
          + (f"; wrote {out}" if out else ""))
    ok = all(c.get("ok") for c in run.checks if not c.get("optional"))
    if not ok:
        print("SOME CHECKS FAILED", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""H100 benchmark of the whole Token Sparse Attention prefill step against cuDNN dense causal attention (issue 5).

Run on a GPU machine from the repository root:

    GIT_COMMIT=$(git rev-parse HEAD) jsparse bench tsa --out /some/dir/

What it does (about 2 minutes on an H100; cases past a 165 s budget are recorded as skipped):
  1. Checks, compiled on the GPU (bf16, Llama-3.1-8B heads, T = 2048):
     a. the step at a kept fraction of 0.5 (cuDNN over the gathered [B, C, Hq, D] with is_causal=True) against the
        masked dense reference in f32 (query i attends key j iff its head kept both and j <= i; dropped rows 0),
        for selection "query_head" and "kv_head" (tolerance: max abs error / max abs reference <= 2e-2);
     b. the selection itself: every head keeps exactly the row's count, ascending, the last W positions included;
     c. the registered method's prefill (`TSA.prefill`: Pallas scoring, coverage at tau = 0.05, capacity buckets
        under lax.switch) against the masked reference built from its own selection;
     d. the step with `fill="local"` (dropped rows: sliding window of 64 keys + 4 sinks, `local_attention`) against
        the same reference with the dropped rows taken from a banded f32 reference.
  2. Timing at Llama-3.1-8B attention shapes (B = 1, Hq = 32, Hkv = 8, D = 128, bf16, W = 128, pooling 7) for
     T in {32768, 65536, 131072}. Random weights give flat attention, so the kept fraction f is set explicitly
     (the coverage count is computed and timed, then replaced by C = f * T rounded to 128): f = 0.68 (the paper's
     54% attention-map sparsity, 1 - 0.68^2), 0.5 and 0.3. Each part is jitted and timed alone (median after
     warm-up), and the whole step is jitted and timed end to end:
       scoring    `tsa_scores` (Pallas Triton kernel), f32[B, Hq, T]
       index      `coverage_counts` (sort + cumsum over the head-summed scores) and `select_tokens` (per-head
                  threshold by a 31-step bit binary search, compaction by cumsum), as "coverage" and "select"
       gather     `compress`: Q, K, V rows per query head -> [B, C, Hq, D] x 3
       attention  cuDNN causal attention over the compressed sequence
       scatter    `decompress`: outputs back to [B, T, Hq, D], zeros elsewhere
       fill       `local_attention` (Triton kernel; window 64, 4 sinks): what dropped rows get with
                  `fill="local"` (not in the paper)
       total      the whole step in one jit; also with fill="local" (total_local_ms, overhead_share_local counts
                  the fill as overhead)
     against cuDNN dense causal GQA attention at the same T. Also the whole step with selection "kv_head" (GQA kept
     in the compressed space). Each part has a floor: bytes at the measured HBM bandwidth or FLOPs at the
     measured bf16 matmul rate (see `floors`).
  Reported: speedup = dense / total, ideal = 1 / f^2, overhead share = (scoring + index + gather + scatter) /
  (their sum + attention).

Writes the JSON named by --out (default ./bench_tsa.json; device, jax version, date, GIT_COMMIT, checks, every case)
and prints a table last.
Options: `--lengths 32768,65536`, `--fractions 0.68,0.5`, `--iters N`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench.common import (add_out_argument, device_facts, measure_hbm_gbs, measure_matmul_tflops, out_path,
                               positive_ints, require_gpu, table, time_ms, write_json)
from jsparse.compression import attend_compressed, compress, decompress, masked_reference_mask
from jsparse.methods.tsa import TSA, TSALayerInfo, coverage_counts, select_tokens, selection_scores
from models.attention import LayerContext
from pallas_kernels.local_attention import banded_mask, local_attention
from pallas_kernels.sparse_attention.reference import masked_attention_reference
from pallas_kernels.tsa_scoring import tsa_scores

BUDGET_S = 165.0
HQ, HKV, D, W, POOL, TAU, MIN_TOKENS = 32, 8, 128, 128, 7, 0.005, 1024
LOCAL_WINDOW, LOCAL_SINKS = 64, 4  # TSA's fill="local" defaults
EXP_PER_S = 3.9e12  # H100 SXM special-function throughput (FlashAttention-3 paper)


def cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def _inputs(T, seed=0, B=1):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, T, HQ, D), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, T, HKV, D), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, T, HKV, D), jnp.float32).astype(jnp.bfloat16)
    return q, k, v


def capacity_for(fraction: float, T: int) -> int:
    return int(min(T, max(W + 128, round(fraction * T / 128) * 128)))


def _rel_err(got, want, rows) -> float:
    got = np.asarray(got[:, :rows], np.float64)
    want = np.asarray(want[:, :rows], np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _reference(q, k, v, sel, fill="zeros"):
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    qf, kf, vf = f32(q), f32(k).transpose(0, 2, 1, 3), f32(v).transpose(0, 2, 1, 3)
    out = masked_attention_reference(qf, kf, vf, masked_reference_mask(sel, HQ))
    if fill == "zeros":
        return out
    T = q.shape[1]
    band = jnp.asarray(banded_mask(T, LOCAL_WINDOW, LOCAL_SINKS))
    local = masked_attention_reference(qf, kf, vf, jnp.broadcast_to(band, (q.shape[0], HQ, T, T)))
    keep = jnp.repeat(sel.keep, HQ // sel.keep.shape[1], axis=1).transpose(0, 2, 1)[..., None]
    return jnp.where(keep, out, local)


def checks() -> list[dict]:
    rows = []
    T = 2048
    q, k, v = _inputs(T, seed=1)
    lengths = jnp.full((1,), T, jnp.int32)
    C = capacity_for(0.5, T)
    counts = jnp.full((1,), C, jnp.int32)
    for selection, fill in (("query_head", "zeros"), ("kv_head", "zeros"), ("query_head", "local")):
        out, _ = _step_jit(q, k, v, lengths, counts, C, selection, fill)
        s = selection_scores(_scoring(q, k, lengths), HKV, selection)
        sel = _select(s, lengths, counts, C)
        err = _rel_err(out, _reference(q, k, v, sel, fill), T)
        idx, keep = np.asarray(sel.indices), np.asarray(sel.keep)
        sel_ok = bool(np.all(keep.sum(-1) == C) and np.all(np.diff(idx, axis=-1) > 0) and np.all(keep[..., -W:]))
        name = f"step f=0.5 {selection}" + ("" if fill == "zeros" else f" fill={fill}")
        rows.append({"check": name, "rel_err": err, "selection_ok": sel_ok, "ok": bool(err <= 2e-2 and sel_ok)})
    m = TSA(tau=0.05, min_tokens=256)
    ctx = LayerContext(layer=jnp.int32(1), lengths=lengths, info=TSALayerInfo(sparse=jnp.int32(1)))
    out, state = jax.jit(m.prefill)(ctx, q, k, v, m.init_state(_Cfg(), 1, T))
    counts, sel = jax.jit(m.select)(q, k, lengths)
    err = _rel_err(out, _reference(q, k, v, sel), T)
    kept = int(np.asarray(state.kept)[1, 0])
    rows.append({"check": "method prefill tau=0.05", "rel_err": err, "kept": kept, "T": T,
                 "ok": bool(err <= 2e-2 and kept == int(counts[0]) and kept < T)})
    return rows


class _Cfg:
    num_layers = 2


def floors(T: int, C: int, hbm_gbs: float, tflops: float) -> dict:
    """Lower bounds in ms per part: bytes / HBM bandwidth or FLOPs / bf16 matmul rate (whichever is larger)."""
    bw, rate = hbm_gbs * 1e9, tflops * 1e12
    ms = lambda s: s * 1e3  # noqa: E731
    score_flops = 2 * 2 * 2 * HQ * W * T * D  # two passes over the keys, QK^T (and the mean of P)
    score_exp = 2 * W * HQ * T / EXP_PER_S
    score_bytes = 2 * HKV * T * D * 2
    kv_rows = min(HKV * T, HQ * C)
    return {
        "scoring": ms(max(score_flops / rate, score_exp, score_bytes / bw)),
        "index": ms((HQ * T * 4 * 2 + HQ * C * 4) / bw),  # read the scores, write slots and indices
        "gather": ms((HQ * C * D * 2 + 2 * kv_rows * D * 2 + 3 * HQ * C * D * 2) / bw),
        "attention": ms(4 * HQ * D * C * (C + 1) / 2 / rate),
        "scatter": ms((HQ * C * D * 2 + HQ * T * 4 + HQ * T * D * 2) / bw),
        "dense": ms(4 * HQ * D * T * (T + 1) / 2 / rate),
    }


# Module-level jits, so a length's scoring and coverage compile once for all its kept fractions.
_scoring = jax.jit(lambda q, k, lengths: tsa_scores(q, k, window=W, pool_kernel=POOL, lengths=lengths))
_coverage = jax.jit(lambda s, lengths: coverage_counts(s, lengths, tau=TAU, window=W, min_tokens=MIN_TOKENS))
_select = jax.jit(lambda s, lengths, counts, C: select_tokens(s, lengths, counts, window=W, capacity=C),
                  static_argnums=3)
_gather = jax.jit(compress)
_attention = jax.jit(cudnn)
_scatter = jax.jit(decompress)
_fill = jax.jit(lambda q, k, v: local_attention(q, k, v, window=LOCAL_WINDOW, sinks=LOCAL_SINKS))


@jax.jit
def _dense(q, k, v):
    return cudnn(q, k, v)


def _step(q, k, v, lengths, counts, C, selection, fill="zeros"):
    """The whole TSA step: scoring, coverage (timed, then replaced by the explicit count), selection, gather,
    cuDNN causal attention over the compressed sequence, scatter (into zeros, or into the local fill)."""
    s = selection_scores(tsa_scores(q, k, window=W, pool_kernel=POOL, lengths=lengths), HKV, selection)
    measured = coverage_counts(s, lengths, tau=TAU, window=W, min_tokens=MIN_TOKENS)
    sel = select_tokens(s, lengths, counts, window=W, capacity=C)
    rows = None if fill == "zeros" else local_attention(q, k, v, window=LOCAL_WINDOW, sinks=LOCAL_SINKS)
    return attend_compressed(q, k, v, sel, cudnn, fill_rows=rows), measured


_step_jit = jax.jit(_step, static_argnums=(5, 6, 7))


def bench_case(T: int, fraction: float, dense_ms: float, iters: int, hbm_gbs: float, tflops: float) -> dict:
    q, k, v = _inputs(T)
    lengths = jnp.full((1,), T, jnp.int32)
    C = capacity_for(fraction, T)
    counts = jnp.full((1,), C, jnp.int32)
    t = lambda f, *a: time_ms(f, *a, warmup=2, iters=iters)  # noqa: E731

    scores = _scoring(q, k, lengths)
    sel = _select(scores, lengths, counts, C)
    qc, kc, vc = _gather(q, k, v, sel)
    out_c = _attention(qc, kc, vc)
    parts = {
        "scoring": t(_scoring, q, k, lengths),
        "coverage": t(_coverage, scores, lengths),
        "select": t(lambda s: _select(s, lengths, counts, C), scores),
        "gather": t(_gather, q, k, v, sel),
        "attention": t(_attention, qc, kc, vc),
        "scatter": t(_scatter, out_c, sel),
        "fill": t(_fill, q, k, v),
    }
    del qc, kc, vc, out_c
    parts["index"] = parts["coverage"] + parts["select"]
    total = t(lambda *a: _step_jit(*a, C, "query_head"), q, k, v, lengths, counts)
    total_kv = t(lambda *a: _step_jit(*a, C, "kv_head"), q, k, v, lengths, counts)
    total_local = t(lambda *a: _step_jit(*a, C, "query_head", "local"), q, k, v, lengths, counts)
    overhead = parts["scoring"] + parts["index"] + parts["gather"] + parts["scatter"]
    overhead_local = overhead + parts["fill"]
    fl = floors(T, C, hbm_gbs, tflops)
    return {
        "T": T, "kept_fraction": fraction, "C": C, "attention_map_sparsity": 1 - (C * (C + 1)) / (T * (T + 1)),
        "dense_ms": dense_ms, "total_ms": total, "total_kv_head_ms": total_kv,
        "parts_ms": parts, "floors_ms": fl,
        "speedup": dense_ms / total, "speedup_kv_head": dense_ms / total_kv, "ideal_speedup": T * T / (C * C),
        "overhead_ms": overhead, "overhead_share": overhead / (overhead + parts["attention"]),
        "overhead_share_of_total": overhead / total,
        "total_local_ms": total_local, "speedup_local": dense_ms / total_local,
        "overhead_share_local": overhead_local / (overhead_local + parts["attention"]),
    }


def main(argv=None, prog=None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="32768,65536,131072", type=positive_ints)
    p.add_argument("--fractions", default="0.68,0.5,0.3")
    p.add_argument("--iters", type=int, default=0, help="timed calls per measurement (default: 10, 5 at >= 64K)")
    add_out_argument(p, "bench_tsa.json")
    args = p.parse_args(argv)
    lengths = args.lengths
    from jsparse.methods.tsa import check_kept_fraction
    try:
        fractions = [check_kept_fraction(float(x)) for x in args.fractions.split(",")]
    except ValueError as e:  # a word, or a share outside (0, 1]
        p.error(f"--fractions {args.fractions}: {e}")
    if args.iters < 0:
        p.error(f"--iters {args.iters}: expected a positive integer, or 0 for the default")
    try:
        require_gpu("tsa")
        path = out_path(args.out, "bench_tsa.json")  # before the run: a bad --out ends none
    except ValueError as e:
        p.error(str(e))
    t0 = time.perf_counter()
    facts = device_facts()
    hbm, tflops = measure_hbm_gbs(), measure_matmul_tflops()
    print(f"{facts}\nHBM {hbm:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s", flush=True)
    check_rows = checks()
    for r in check_rows:
        print("check", r, flush=True)
    payload = {**facts, "hbm_gbs": hbm, "matmul_tflops": tflops,
               "config": {"B": 1, "Hq": HQ, "Hkv": HKV, "D": D, "dtype": "bfloat16", "window": W, "pool_kernel": POOL,
                          "tau": TAU, "min_tokens": MIN_TOKENS, "dense": "cudnn causal GQA",
                          "compressed_attention": "cudnn causal on gathered [B, C, Hq, D] (query_head)"},
               "checks": check_rows, "cases": []}
    for T in sorted(lengths, reverse=True):  # the acceptance case (128K, f = 0.68) first
        iters = args.iters or (10 if T < 65536 else 5)
        if time.perf_counter() - t0 > BUDGET_S:
            payload["cases"].append({"T": T, "skipped": "time budget"})
            continue
        q, k, v = _inputs(T)
        dense_ms = time_ms(_dense, q, k, v, warmup=2, iters=iters)
        del q, k, v
        print(f"T={T} dense {dense_ms:.2f} ms", flush=True)
        for f in fractions:
            if time.perf_counter() - t0 > BUDGET_S:
                payload["cases"].append({"T": T, "kept_fraction": f, "skipped": "time budget"})
                continue
            try:
                case = bench_case(T, f, dense_ms, iters, hbm, tflops)
            except Exception as e:  # noqa: BLE001  (out of memory or a lowering error: record, go on)
                case = {"T": T, "kept_fraction": f, "error": f"{type(e).__name__}: {str(e)[:500]}"}
            payload["cases"].append(case)
            print(case, flush=True)
            write_json(path, payload)
    payload["seconds"] = time.perf_counter() - t0
    write_json(path, payload)

    rows = []
    for c in sorted(payload["cases"], key=lambda c: (c.get("T", 0), -c.get("kept_fraction", 0))):
        if "parts_ms" not in c:
            rows.append({"T": c.get("T"), "f": c.get("kept_fraction"), "note": c.get("skipped") or c.get("error")})
            continue
        pm, fl = c["parts_ms"], c["floors_ms"]
        rows.append({"T": c["T"], "f": c["kept_fraction"], "map sparsity": c["attention_map_sparsity"],
                     "dense ms": c["dense_ms"], "TSA ms": c["total_ms"], "speedup": c["speedup"],
                     "ideal": c["ideal_speedup"], "kv_head ms": c["total_kv_head_ms"],
                     "local-fill ms": c["total_local_ms"], "fill ms": c["parts_ms"]["fill"],
                     "local speedup": c["speedup_local"], "overhead share local": c["overhead_share_local"],
                     "score ms (floor)": f"{pm['scoring']:.2f} ({fl['scoring']:.2f})",
                     "index ms (floor)": f"{pm['index']:.2f} ({fl['index']:.2f})",
                     "gather ms (floor)": f"{pm['gather']:.2f} ({fl['gather']:.2f})",
                     "attn ms (floor)": f"{pm['attention']:.2f} ({fl['attention']:.2f})",
                     "scatter ms (floor)": f"{pm['scatter']:.2f} ({fl['scatter']:.2f})",
                     "overhead share": c["overhead_share"]})
    cols = ["T", "f", "map sparsity", "dense ms", "TSA ms", "speedup", "ideal", "kv_head ms", "local-fill ms",
            "fill ms", "local speedup", "overhead share local", "score ms (floor)",
            "index ms (floor)", "gather ms (floor)", "attn ms (floor)", "scatter ms (floor)", "overhead share",
            "note"]
    errs = ", ".join("%s: %.1e" % (r["check"], r["rel_err"]) for r in check_rows)
    print("\nchecks: %s (%s)" % ("all ok" if all(r["ok"] for r in check_rows) else "FAILED", errs))
    print(f"wrote {path} ({payload['seconds']:.0f} s)\n")
    print(table(rows, cols))
    return 0 if all(r["ok"] for r in check_rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""H100 check and timing of the GQA-packed tile-gathered prefill kernel (`gpu_prefill_gqa.sparse_prefill_gqa_gpu`)
against the per-head kernel (`gpu.sparse_prefill_gpu` with `PrefillConfig(gqa_rows=0)`) and cuDNN dense causal
attention.

Run on a GPU machine from the repository root (about 100 s on an H100; 25 GQA configs, 5 per-head ones, cuDNN):

    GIT_COMMIT=$(git rev-parse HEAD) jsparse bench prefill_gqa --out /some/dir/prefill_gqa.json

Shapes: Llama-3.1-8B attention, B 1, T 131072, Hq 32, Hkv 8, D 128, bf16, tile 128 (`--tile`: 32 and 64 too; with
`--tile` below 128 only the one-part configs, M = G * tile, and a short sweep around them). Each (KV head, query tile)
selects 10% of the positions before the tile (ceil(0.1 * tile start) keys), as random sorted unique indices
built on the device (`testing.strided_indices`: one jittered sample per stratum), -1 padded to
K = ceil(0.1 * T).

What it does:
  1. Correctness, compiled on the GPU at T 4096: the per-head kernel, the GQA kernel at its default config and
     at M 128, against each other and against `reference.sparse_prefill_reference` (max abs error).
  2. Timing (warm-up 2, median of 5, results blocked on) at T 131072 of `sparse_prefill_gpu` (default config),
     the per-head kernel at 4 more configs (4 warps, 3 stages), `sparse_prefill_gqa_gpu` at M 128 / 256 x
     block_k 32 / 64 x num_warps 4 / 8 x num_stages 2 / 3 (plus 9 extras: 16 warps, M 512, block_k 128), and
     cuDNN dense causal attention (`pallas_kernels.dense.dense_prefill`). A config
     that fails to compile or run is recorded with its error and skipped. TFLOP/s counts
     4 * B * Hq * D * (selected keys + diagonal keys) per query row, summed (dense: the causal triangle).

Writes the JSON named by --out (device facts, the check, every variant) and prints a table last.
Variants past a 200 s budget are recorded as skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench.common import (add_out_argument, device_facts, out_path, positive_int, require_gpu, table, time_ms,
                               write_json)
from pallas_kernels.dense import dense_prefill
from pallas_kernels.sparse_attention import gpu
from pallas_kernels.sparse_attention.gpu_prefill_gqa import PrefillGQAConfig, sparse_prefill_gqa_gpu
from pallas_kernels.sparse_attention.reference import sparse_prefill_reference
from pallas_kernels.sparse_attention.testing import strided_indices

B, HQ, HKV, D, TILE, BUDGET = 1, 32, 8, 128, 128, 0.1
BUDGET_S = 200.0
KW: dict = {}  # {"interpret": True} in the CPU smoke run (--smoke)


def inputs(T: int, seed: int = 0):
    """q [B, T, Hq, D], k, v [B, T, Hkv, D] bf16; indices i32[B, Hkv, nt, K]; lengths; counts i64[nt]."""
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, T, HQ, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, T, HKV, D), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, T, HKV, D), jnp.bfloat16)
    nt = -(-T // TILE)
    K = math.ceil(BUDGET * T)
    starts = jnp.arange(nt, dtype=jnp.int32) * TILE
    counts = jnp.minimum(jnp.ceil(BUDGET * starts.astype(jnp.float32)).astype(jnp.int32), starts)  # [nt]
    limit = jnp.broadcast_to(starts, (B, HKV, nt))
    idx = jax.jit(strided_indices, static_argnums=3)(ks[3], limit, jnp.broadcast_to(counts, limit.shape), K)
    lengths = jnp.full((B,), T, jnp.int32)
    return q, k, v, idx, lengths, np.asarray(counts, np.int64)


def flops(T: int, counts: np.ndarray) -> float:
    nt = counts.shape[0]
    pairs = float(np.sum(counts) * TILE + nt * TILE * (TILE + 1) // 2)  # every row valid (lengths = T)
    return 4.0 * B * HQ * D * pairs


def gathered_gb(counts: np.ndarray, gathers_per_tile: int) -> float:
    """K and V bytes gathered from HBM/L2 by the selected loops (bf16), for all KV heads."""
    return float(np.sum(counts)) * HKV * B * gathers_per_tile * 2 * D * 2 / 1e9


def per_head(q, k, v, idx, lengths):  # (gqa_rows=0: never the packed kernel, which small tiles now default to)
    return gpu.sparse_prefill_gpu(q, k, v, idx, lengths, tile=TILE, config=gpu.PrefillConfig(gqa_rows=0), **KW)


def gqa(config: PrefillGQAConfig):
    return jax.jit(lambda q, k, v, i, l: sparse_prefill_gqa_gpu(q, k, v, i, l, tile=TILE, config=config,
                                                                           **KW))


def max_err(a, b) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def check(T: int = 4096) -> dict:
    q, k, v, idx, lengths, _ = inputs(T, seed=1)
    want = sparse_prefill_reference(q, k, v, idx, lengths, tile=TILE)
    res = {"T": T}
    try:
        base = jax.jit(per_head)(q, k, v, idx, lengths)
        res["per_head_vs_reference"] = max_err(base, want)
        for name, cfg in (("gqa_default", PrefillGQAConfig()), ("gqa_M128", PrefillGQAConfig(rows_per_program=128)),
                          ("gqa_M128_w4", PrefillGQAConfig(rows_per_program=128, num_warps=4))):
            out = gqa(cfg)(q, k, v, idx, lengths)
            res[f"{name}_vs_per_head"] = max_err(out, base)
            res[f"{name}_vs_reference"] = max_err(out, want)
        tol = 3e-2 * max(1.0, float(jnp.max(jnp.abs(want))))  # bf16 outputs against the f32 reference
        res["tolerance"] = tol
        res["ok"] = all(val <= tol for key, val in res.items() if key.endswith(("_per_head", "_reference")))
    except Exception as e:  # noqa: BLE001 - recorded, the timings still run
        res.update(ok=False, error=repr(e)[:500])
    print("check:", res, flush=True)
    return res


def variants() -> list[tuple[str, PrefillGQAConfig]]:
    if TILE < 128:  # one program per (KV head, tile): M = G * tile, one gather per tile
        M = HQ // HKV * TILE
        return [(f"gqa_M{M}_bk{bk}_w{w}_s{s}", PrefillGQAConfig(bk, M, w, s))
                for bk, w, s in ((64, 4, 2), (64, 8, 2), (32, 4, 2), (64, 4, 3), (128, 8, 2))]
    out = []
    for M in (256, 128):
        for bk in (64, 32):
            for w in (8, 4):
                for s in (2, 3):
                    out.append((f"gqa_M{M}_bk{bk}_w{w}_s{s}", PrefillGQAConfig(bk, M, w, s)))
    # Extras: 16 warps (M 256 / 512 hold a large f32 accumulator), whole-group programs (M 512), block_k 128.
    for bk, M, w, s in ((64, 256, 16, 2), (64, 256, 16, 3), (128, 256, 16, 2), (128, 128, 4, 2), (128, 128, 8, 2),
                        (32, 512, 8, 2), (64, 512, 8, 2), (32, 512, 16, 2), (64, 512, 16, 2)):
        out.append((f"gqa_M{M}_bk{bk}_w{w}_s{s}", PrefillGQAConfig(bk, M, w, s)))
    return out


PER_HEAD_EXTRAS = [gpu.PrefillConfig(64, 4, 2, 0), gpu.PrefillConfig(64, 4, 3, 0), gpu.PrefillConfig(64, 8, 3, 0),
                   gpu.PrefillConfig(32, 4, 3, 0)]  # the per-head kernel at the warps / stages the GQA one likes


def main(argv=None, prog=None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_out_argument(p, "prefill_gqa.json")
    p.add_argument("--T", type=positive_int, default=131072)
    p.add_argument("--tile", type=positive_int, default=128, help="query rows per index row (default 128)")
    p.add_argument("--smoke", action="store_true", help="CPU dry run: interpreter, T 512, check at T 256")
    args = p.parse_args(argv)
    try:
        if not args.smoke:
            require_gpu("prefill_gqa", "--smoke")
        args.out = out_path(args.out, "prefill_gqa.json")
    except ValueError as e:
        p.error(str(e))
    global TILE
    TILE = args.tile
    if args.smoke:
        KW["interpret"] = True
        args.T = 512
    t_start = time.perf_counter()
    facts = device_facts()
    print(facts, flush=True)
    payload = {**facts,
               "shape": dict(B=B, T=args.T, Hq=HQ, Hkv=HKV, D=D, tile=TILE, dtype="bfloat16", budget=BUDGET)}
    payload["check"] = check(256 if args.smoke else 4096)

    T = args.T
    q, k, v, idx, lengths, counts = inputs(T)
    fl = flops(T, counts)
    dense_fl = 4.0 * B * HQ * D * T * (T + 1) / 2
    payload["flops"] = fl
    payload["selected_keys_per_head_total"] = int(np.sum(counts) * TILE)
    G = HQ // HKV
    rows: list[dict] = []

    def record(name, fn, f, **meta):
        rec = dict(variant=name, **meta)
        if time.perf_counter() - t_start > BUDGET_S:
            rec["skipped"] = "time budget"
        else:
            try:
                t0 = time.perf_counter()
                jax.block_until_ready(fn(q, k, v, idx, lengths))  # compile + first run
                rec["first_call_s"] = time.perf_counter() - t0
                ms = time_ms(fn, q, k, v, idx, lengths, warmup=2, iters=5)
                rec.update(ms=ms, tflops=f / (ms * 1e-3) / 1e12)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is recorded and skipped
                rec["error"] = repr(e)[:500]
        rows.append(rec)
        print(rec, flush=True)
        return rec

    record("dense_cudnn_causal", jax.jit(lambda q, k, v, i, l: dense_prefill(q, k, v)), dense_fl, kernel="dense")
    base = record("sparse_prefill_gpu", jax.jit(per_head), fl, kernel="per_head",
                  config=dataclasses.asdict(gpu.PrefillConfig()),
                  gathered_gb=gathered_gb(counts, G))
    for c in [] if args.smoke or TILE < 128 else PER_HEAD_EXTRAS:
        record(f"sparse_prefill_gpu_bk{c.block_k}_w{c.num_warps}_s{c.num_stages}",
               jax.jit(lambda q, k, v, i, l, c=c: gpu.sparse_prefill_gpu(q, k, v, i, l, tile=TILE, config=c)), fl,
               kernel="per_head", config=dataclasses.asdict(c), gathered_gb=gathered_gb(counts, G))
    for name, cfg in variants()[:2] if args.smoke else variants():
        parts = G * TILE // min(cfg.rows_per_program, G * TILE)
        record(name, gqa(cfg), fl, kernel="gqa", config=dataclasses.asdict(cfg), parts=parts,
               gathered_gb=gathered_gb(counts, parts))
    dense_ms = rows[0].get("ms")
    for r in rows:
        if "ms" in r:
            if dense_ms:
                r["speedup_vs_dense"] = dense_ms / r["ms"]
            if "ms" in base:
                r["speedup_vs_per_head"] = base["ms"] / r["ms"]
    timed = [r for r in rows if r.get("kernel") == "gqa" and "ms" in r]
    if timed:
        best = min(timed, key=lambda r: r["ms"])
        payload["best_gqa"] = {key: best.get(key) for key in ("variant", "ms", "tflops", "speedup_vs_per_head",
                                                                "speedup_vs_dense")}
    for r in rows:
        r["status"] = "ok" if "ms" in r else ("skipped" if "skipped" in r else "FAILED")
    payload["variants"] = rows
    payload["total_s"] = time.perf_counter() - t_start
    write_json(args.out, payload)
    print(f"wrote {args.out} ({payload['total_s']:.0f} s); check ok={payload['check'].get('ok')}")
    print(table(rows, ["variant", "status", "ms", "tflops", "speedup_vs_per_head", "speedup_vs_dense",
                       "gathered_gb"]))
    return 0 if payload["check"].get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())

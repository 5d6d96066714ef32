"""The anchor layers' selection (Kascade's anchors, the oracle's every sparse layer) at issue 24's cells, on one GPU.

The scores are the real thing: `anchor_attention.gpu.decode_scores_gpu` of random bf16 queries over a random bf16
cache of Llama-3.1-8B / Qwen3-8B heads (Hq 32, Hkv 8, D 128) at the bench's context, one decode token, then
`topk_select_gpu` keeps budget 0.1 (min 128) of them per (row, KV head), K wide, as `anchor_attention.common.select`
does. For each case (batch, context) it times, in a jitted loop of 31 calls (a step's sparse layers; each call's k
depends on the one before, so nothing is hoisted), every `SelectConfig` variant below, and checks its indices
against the default's (exact equality); the "reduce2d" variants turn `gpu_row.REDUCE_2D` on (each radix pass's
candidate counts in one 2-D reduction instead of one per two candidates). First, the one-launch "row" path on rows
of EvoSparse's retrieval block scores (random normal), with and without REDUCE_2D. Then the scoring pass with its pooling in XLA (the default) and in Triton
(`AnchorConfig(pool="triton")`), 31 calls, outputs compared.

    GIT_COMMIT=<sha> PYTHONPATH=. python3 probe.py      (SMOKE=1: a small shape in the Pallas interpreter, on a CPU)

Writes $OUT/topk_tune.json and prints a table last (us per call).
"""
import json, os, sys, time

import pallas_kernels.topk_select.gpu_row as gpu_row

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench.common import device_facts, pipelined_ms
from pallas_kernels.anchor_attention.common import budget_count
from pallas_kernels.anchor_attention.gpu import AnchorConfig, decode_scores_gpu
from pallas_kernels.topk_select.gpu import SelectConfig, topk_select_gpu

SMOKE = bool(os.environ.get("SMOKE"))
HQ, HKV, D = (4, 1, 16) if SMOKE else (32, 8, 128)
LOOP = 3 if SMOKE else 31
CASES = [(1, 600)] if SMOKE else [(4, 100000), (1, 100000), (2, 100000), (3, 100000), (1, 32000), (4, 32000),
                                  (7, 32000)]
FULL = {(4, 100000), (1, 32000), (7, 32000)}  # every variant; the other cases the default and the best few
VARIANTS = {
    "default": SelectConfig(),
    "row_bits4": SelectConfig(row_bits=4),
    "sample1024": SelectConfig(sample_size=1024),
    "sample4096": SelectConfig(sample_size=4096),
    "cb512": SelectConfig(compact_block_n=512),
    "cb2048": SelectConfig(compact_block_n=2048),
    "tp512": SelectConfig(target_programs=512),
    "tp2048": SelectConfig(target_programs=2048),
    "tp4096": SelectConfig(target_programs=4096),
    "warps8": SelectConfig(num_warps=8),
    "ordered": SelectConfig(path="ordered"),
    "fused": SelectConfig(path="fused"),
    "row": SelectConfig(path="row"),
    "bits4_cb2048_tp2048": SelectConfig(row_bits=4, compact_block_n=2048, target_programs=2048),
    "reduce2d": SelectConfig(),  # gpu_row.REDUCE_2D on: each radix pass's counts in one 2-D reduction
    "reduce2d_bits4": SelectConfig(row_bits=4),
    "reduce2d_row": SelectConfig(path="row"),
}
# Rows of EvoSparse's retrieval block scores (100K / 16 blocks, 128 kept) on the one-launch "row" path.
ROW_CASES = [] if SMOKE else [(32, 6256, 128), (8, 6256, 128), (32, 2016, 128)]
if SMOKE:
    VARIANTS = {k: v for k, v in VARIANTS.items() if k in ("default", "row_bits4", "ordered", "row", "reduce2d")}
    VARIANTS = {k: (v if k == "row" else SelectConfig(**{**v.__dict__, "sample_size": 32, "band_cap": 64}))
                for k, v in VARIANTS.items()}
OUT = os.path.join(os.environ.get("OUT", "/tmp"), "topk_tune.json")
T0 = time.time()
BUDGET_S = 280.0


def set_2d(name):
    on = name.startswith("reduce2d")
    if gpu_row.REDUCE_2D != on:
        gpu_row.REDUCE_2D = on
        jax.clear_caches()  # the kernels trace again


def row_cases(facts, rows):
    for R, N, k in ROW_CASES:
        x = jax.random.normal(jax.random.key(R + N), (R, N), jnp.float32)
        kk = jnp.full((R,), k, jnp.int32)
        ref = None
        for name in ("default", "reduce2d", "default"):
            set_2d(name)
            out = np.asarray(topk_select_gpu(x, kk, k))
            ref = out if ref is None else ref
            us = pipelined_ms(select_loop(SelectConfig(), k), (x, kk), n=10) * 1e3 / LOOP
            rows.append({"rows": R, "N": N, "K": k, "variant": name, "path": SelectConfig().pick_path(N, R, k),
                         "us_per_call": us, "equal_to_default": bool(np.array_equal(out, ref))})
            print(rows[-1], flush=True)
            json.dump({**facts, "rows": rows}, open(OUT, "w"), indent=1)


def select_loop(cfg, K):
    @jax.jit
    def run(scores, kk):
        def body(i, c):
            acc, k = c
            idx = topk_select_gpu(scores, k, K, config=cfg, interpret=SMOKE).reshape(-1)
            return acc + idx[0], k + jnp.minimum(idx[0], 0)  # k unchanged; a dependence
        return jax.lax.fori_loop(0, LOOP, body, (jnp.int32(0), kk))[0]
    return run


def score_loop(cfg, pos_n):
    @jax.jit
    def run(q, k, lengths):
        def body(i, c):
            acc, n = c
            s, _ = decode_scores_gpu(q, k, k, n, config=cfg, interpret=SMOKE)
            return acc + s[0, 0, 0, 0], n + jnp.minimum(s[:, 0, 0, 0], 0).astype(jnp.int32) * 0
        return jax.lax.fori_loop(0, LOOP, body, (jnp.float32(0), lengths))[0]
    return run


def main():
    rows = []
    facts = {**device_facts(), "commit": os.environ.get("GIT_COMMIT"), "command": "python " + " ".join(sys.argv)}
    best = []
    row_cases(facts, rows)
    for B, ctx in CASES:
        if time.time() - T0 > BUDGET_S:
            rows.append({"batch": B, "context": ctx, "skipped": "time budget"})
            continue
        N = ctx + 16
        ks = jax.random.split(jax.random.key(B * 7 + ctx), 2)
        q = jax.random.normal(ks[0], (B, 1, HQ, D), jnp.bfloat16)
        k = jax.random.normal(ks[1], (B, HKV, N, D), jnp.bfloat16)
        lengths = jnp.full((B,), ctx, jnp.int32)
        scores, _ = decode_scores_gpu(q, k, k, lengths, interpret=SMOKE)
        pos = lengths[:, None] - 1
        K = budget_count(0.1, N, 128)
        kk = jnp.broadcast_to(budget_count(0.1, pos + 1, 128)[:, None, :], (B, HKV, 1))
        ref = None
        names = list(VARIANTS) if (B, ctx) in FULL or SMOKE else ["default"] + best[:3]
        for name in names:
            cfg = VARIANTS[name]
            if name.endswith("row") and N > 32768:
                continue
            set_2d(name)
            try:
                out = np.asarray(topk_select_gpu(scores, kk, K, config=cfg, interpret=SMOKE))
                if ref is None:
                    ref = out
                same = bool(np.array_equal(out, ref))
                us = pipelined_ms(select_loop(cfg, K), (scores, kk), n=1 if SMOKE else 10) * 1e3 / LOOP
            except Exception as e:  # noqa: BLE001
                print("fail", B, ctx, name, repr(e)[:300], flush=True)
                rows.append({"batch": B, "context": ctx, "variant": name, "error": repr(e)[:300]})
                continue
            path = cfg.pick_path(N, B * HKV, K)
            rows.append({"batch": B, "context": ctx, "N": N, "K": K, "variant": name, "path": path,
                         "us_per_call": us, "equal_to_default": same})
            print(rows[-1], flush=True)
            json.dump({**facts, "rows": rows}, open(OUT, "w"), indent=1)
        if (B, ctx) in FULL and not best:
            r = sorted([r for r in rows if r.get("context") == ctx and r.get("batch") == B and "us_per_call" in r
                        and r["variant"] != "default" and r["equal_to_default"]], key=lambda r: r["us_per_call"])
            best = [r["variant"] for r in r]
        set_2d("default")
        s_ref = None
        for pool in ("xla", "triton"):
            cfg = AnchorConfig(pool=pool)
            s, _ = decode_scores_gpu(q, k, k, lengths, config=cfg, interpret=SMOKE)
            s = np.asarray(s)
            s_ref = s if s_ref is None else s_ref
            err = float(np.max(np.abs(np.where(np.isfinite(s_ref), s - s_ref, 0.0))))
            us = pipelined_ms(score_loop(cfg, N), (q, k, lengths), n=1 if SMOKE else 10) * 1e3 / LOOP
            rows.append({"batch": B, "context": ctx, "N": N, "variant": f"scores_pool_{pool}", "us_per_call": us,
                         "max_abs_diff_vs_xla": err, "same_inf": bool(np.array_equal(np.isinf(s), np.isinf(s_ref)))})
            print(rows[-1], flush=True)
            json.dump({**facts, "rows": rows}, open(OUT, "w"), indent=1)
    print("\n| batch | context | variant | path | us a call | equal |")
    for r in rows:
        if "us_per_call" in r:
            print(f"| {r.get('batch', r.get('rows'))} | {r.get('context', r.get('N'))} | {r['variant']} | {r.get('path', '')} | {r['us_per_call']:.1f} | "
                  f"{r.get('equal_to_default', r.get('max_abs_diff_vs_xla'))} |")


if __name__ == "__main__":
    main()

"""GPU check and timing of the Mosaic GPU anchor scoring kernels (`anchor_attention.mgpu_prefill`) against the
Triton ones (`anchor_attention.gpu_prefill`), on the H100.

    python -m eval.gpu_anchor_mgpu --out DIR [--context 131072]

Checks, compiled: the lse and the pooled scores of both (Mosaic GPU with 64 and 128 rows per warpgroup) against each other and against the jnp reference at a
few small shapes (odd lengths included). Then times, at the given context (B 1, Llama-3.1-8B heads: 32 query, 8
KV, d 128, bf16): cuDNN causal attention, the Triton lse and pooling passes, and the Mosaic GPU passes in a few
settings. Writes DIR/anchor_mgpu.json and prints a table last.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from eval.benchmarking import device_facts, table, time_ms, write_json


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--context", type=int, default=131072, help="T of the timed shapes (default 131072)")
    p.add_argument("--iters", type=int, default=10, help="timed calls per variant (default 10)")
    args = p.parse_args(argv)

    from pallas_kernels.anchor_attention import gpu_prefill as tri, mgpu_prefill as mg
    from pallas_kernels.anchor_attention.reference import tile_scores_reference
    from pallas_kernels.dense import dense_prefill

    out = dict(device_facts(), checks=[], records=[])
    for (B, T, Hq, Hkv, D) in ((1, 4096, 32, 8, 128), (2, 3000, 8, 2, 128), (1, 1000, 6, 2, 64)):
        kq, kk = jax.random.split(jax.random.key(T))
        q = jax.random.normal(kq, (B, T, Hq, D), jnp.bfloat16)
        k = jax.random.normal(kk, (B, T, Hkv, D), jnp.bfloat16)
        lse_t = tri.prefill_lse_gpu(q, k)
        lse_m = mg.prefill_lse_mgpu(q, k)
        lse_m2 = mg.prefill_lse_mgpu(q, k, rows=128)
        sc_t = tri.tile_scores_gpu(q, k, tile=128, lse=lse_t)
        sc_m = mg.tile_scores_mgpu(q, k, lse_t)
        sc_m2 = mg.tile_scores_mgpu(q, k, lse_t, rows=128)
        fin = np.isfinite(np.asarray(sc_t))
        rel = float(np.max(np.abs(np.where(fin, np.asarray(sc_m) - np.asarray(sc_t), 0)))
                    / np.max(np.abs(np.where(fin, np.asarray(sc_t), 0))))
        rel = max(rel, float(np.max(np.abs(np.where(fin, np.asarray(sc_m2) - np.asarray(sc_t), 0)))
                             / np.max(np.abs(np.where(fin, np.asarray(sc_t), 0)))))
        rec = dict(B=B, T=T, Hq=Hq, Hkv=Hkv, D=D,
                   lse_max_abs_diff=float(max(jnp.max(jnp.abs(lse_m - lse_t)), jnp.max(jnp.abs(lse_m2 - lse_t)))),
                   pool_rel_err_vs_triton=rel, pattern_ok=bool((np.isfinite(np.asarray(sc_m)) == fin).all()
                                                               and (np.isfinite(np.asarray(sc_m2)) == fin).all()))
        if T <= 3000:
            ref = np.asarray(tile_scores_reference(q, k, tile=128))
            f2 = np.isfinite(ref)
            sc_full = np.asarray(mg.tile_scores_mgpu(q, k, mg.prefill_lse_mgpu(q, k)))
            rec["pool_rel_err_vs_reference"] = float(np.max(np.abs(np.where(f2, sc_full - ref, 0)))
                                                     / np.max(np.abs(np.where(f2, ref, 0))))
        rec["ok"] = bool(rec["lse_max_abs_diff"] < 1e-3 and rel < 1e-4 and rec["pattern_ok"]
                         and rec.get("pool_rel_err_vs_reference", 0) < 1e-4)
        out["checks"].append(rec)
        print("check", rec, flush=True)

    T, Hq, Hkv, D = args.context, 32, 8, 128
    kq, kk, kv = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(kq, (1, T, Hq, D), jnp.bfloat16)
    k = jax.random.normal(kk, (1, T, Hkv, D), jnp.bfloat16)
    v = jax.random.normal(kv, (1, T, Hkv, D), jnp.bfloat16)
    qk_flops = 2 * Hq * D * T * (T + 1) / 2  # the causal half of Q.K^T

    def rec(impl, fn, *a, flops=qk_flops):
        try:
            ms = time_ms(fn, *a, iters=args.iters)
            r = dict(impl=impl, T=T, ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
        except Exception as e:  # noqa: BLE001 - a variant that does not fit is recorded, not fatal
            r = dict(impl=impl, T=T, error=repr(e)[:300])
        out["records"].append(r)
        print(r, flush=True)
        return r

    rec("dense_cudnn_causal", jax.jit(dense_prefill), q, k, v, flops=2 * qk_flops)
    rec("lse_triton", jax.jit(tri.prefill_lse_gpu), q, k)
    lse = jax.jit(tri.prefill_lse_gpu)(q, k)
    lse_variants = ((128, 4, False, 64, True), (128, 4, True, 64, True), (64, 4, False, 128, True),
                    (64, 4, True, 128, True), (128, 4, False, 128, True), (128, 4, True, 128, False))
    for bkv, st, sch, rows, ov in lse_variants:
        rec(f"lse_mgpu[bkv{bkv},s{st},rows{rows}{',sched' if sch else ''}{'' if ov else ',no_overlap'}]",
            jax.jit(lambda q, k, b=bkv, s=st, c=sch, r=rows, o=ov: mg.prefill_lse_mgpu(
                q, k, block_kv=b, stages=s, schedule=c, rows=r, overlap=o)), q, k)
    rec("pool_triton", jax.jit(lambda q, k, l: tri.tile_scores_gpu(q, k, tile=128, lse=l)), q, k, lse)
    pool_variants = ((2, True, 64, True), (2, False, 64, True), (3, True, 64, True), (2, True, 128, True),
                     (2, True, 128, False))
    for st, sch, rows, ov in pool_variants:
        rec(f"pool_mgpu[s{st},rows{rows}{'' if sch else ',nosched'}{'' if ov else ',no_overlap'}]",
            jax.jit(lambda q, k, l, s=st, c=sch, r=rows, o=ov: mg.tile_scores_mgpu(
                q, k, l, stages=s, schedule=c, rows=r, overlap=o)), q, k, lse)
    nt = T // 128
    x = jnp.zeros((1, Hkv, nt, T), jnp.float32)
    rec("upper_triangle_select", jax.jit(lambda x: jnp.where(
        jnp.arange(T)[None, :] < (jnp.arange(nt) * 128)[:, None], x, -jnp.inf)), x, flops=0)

    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "anchor_mgpu.json"), out)
    print(table([c for c in out["checks"]], ["B", "T", "Hq", "Hkv", "D", "lse_max_abs_diff", "pool_rel_err_vs_triton",
                                            "pool_rel_err_vs_reference", "ok"]))
    print(table(out["records"], ["impl", "T", "ms", "tflops", "error"]))


if __name__ == "__main__":
    main()

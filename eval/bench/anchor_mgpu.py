"""GPU check and timing of the Mosaic GPU anchor scoring kernels (`anchor_attention.mgpu_prefill`) against the
Triton ones (`anchor_attention.gpu_prefill`), on the H100.

    python -m eval.bench.anchor_mgpu --out DIR [--context 131072]

Checks, compiled: the lse and the pooled scores of both (Mosaic GPU with 64 and 128 rows per warpgroup; tiles of
128, 64 and 32 query rows) against each other and against the jnp reference at a few small shapes (odd lengths
included). Then times, at the given context (B 1, Llama-3.1-8B heads: 32 query, 8
KV, d 128, bf16): cuDNN causal attention, the Triton lse and pooling passes, and the Mosaic GPU passes in a few
settings. Writes DIR/anchor_mgpu.json and prints a table last.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp

from eval.bench.attention import rel_err
from eval.bench.common import device_facts, out_path, positive_int, require_gpu, table, time_ms, write_json


def main(argv=None, prog=None) -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--context", type=positive_int, default=131072, help="T of the timed shapes (default 131072)")
    p.add_argument("--iters", type=positive_int, default=10, help="timed calls per variant (default 10)")
    args = p.parse_args(argv)
    try:
        require_gpu("anchor_mgpu")
        path = out_path(os.path.join(args.out, ""), "anchor_mgpu.json")  # a folder, made before the run
    except ValueError as e:
        p.error(str(e))

    from pallas_kernels.anchor_attention import gpu_prefill as tri, mgpu_prefill as mg
    from pallas_kernels.anchor_attention.reference import tile_scores_reference
    from pallas_kernels.dense import dense_prefill

    out = dict(device_facts(), checks=[], records=[])
    for (B, T, Hq, Hkv, D) in ((1, 4096, 32, 8, 128), (2, 3000, 8, 2, 128), (1, 1000, 6, 2, 64)):
        kq, kk = jax.random.split(jax.random.key(T))
        q = jax.random.normal(kq, (B, T, Hq, D), jnp.bfloat16)
        k = jax.random.normal(kk, (B, T, Hkv, D), jnp.bfloat16)
        lse_t = tri.prefill_lse_gpu(q, k, config=tri.PrefillScoresConfig(mosaic=False))
        lse_diff = max(float(jnp.max(jnp.abs(mg.prefill_lse_mgpu(q, k, rows=r) - lse_t))) for r in (64, 128))

        def compare(got, want):
            """(relative error over the finite entries, whether the -inf pattern is equal)"""
            return rel_err(got, want), bool(jnp.all(jnp.isfinite(got) == jnp.isfinite(want)))

        rec = dict(B=B, T=T, Hq=Hq, Hkv=Hkv, D=D, lse_max_abs_diff=lse_diff)
        errs, pattern = [], True
        for tile in (128, 64, 32):
            want = tri.tile_scores_gpu(q, k, tile=tile, lse=lse_t, config=tri.PrefillScoresConfig(mosaic=False))
            for rows in ((64, 128) if tile == 128 else (128,)):
                e, p_ok = compare(mg.tile_scores_mgpu(q, k, lse_t, tile=tile, rows=rows), want)
                errs.append(e)
                pattern &= p_ok
        rec.update(pool_rel_err_vs_triton=max(errs), pattern_ok=pattern)
        if T <= 3000:
            e, p_ok = compare(mg.tile_scores_mgpu(q, k, mg.prefill_lse_mgpu(q, k)),
                              tile_scores_reference(q, k, tile=128))
            rec.update(pool_rel_err_vs_reference=e, pattern_ok=pattern and p_ok)
        rec["ok"] = bool(rec["lse_max_abs_diff"] < 1e-3 and max(errs) < 1e-4 and rec["pattern_ok"]
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
    tcfg = tri.PrefillScoresConfig(mosaic=False)
    rec("lse_triton", jax.jit(lambda q, k: tri.prefill_lse_gpu(q, k, config=tcfg)), q, k)
    lse = jax.jit(lambda q, k: tri.prefill_lse_gpu(q, k, config=tcfg))(q, k)
    for bkv, st, sch, rows in ((128, 4, True, 128), (128, 4, False, 128)):
        rec(f"lse_mgpu[bkv{bkv},s{st},rows{rows}{',sched' if sch else ''}]",
            jax.jit(lambda q, k, b=bkv, s=st, c=sch, r=rows: mg.prefill_lse_mgpu(
                q, k, block_kv=b, stages=s, schedule=c, rows=r)), q, k)
    rec("pool_triton", jax.jit(lambda q, k, l: tri.tile_scores_gpu(q, k, tile=128, lse=l, config=tcfg)), q, k, lse,
        flops=2 * Hq * D * T * (T - 128) / 2)
    for st, sch, rows, tile in ((2, True, 128, 128), (2, True, 128, 64), (2, True, 128, 32), (3, True, 128, 32)):
        rec(f"pool_mgpu[tile{tile},s{st},rows{rows}{'' if sch else ',nosched'}]",
            jax.jit(lambda q, k, l, s=st, c=sch, r=rows, t=tile: mg.tile_scores_mgpu(
                q, k, l, tile=t, stages=s, schedule=c, rows=r)), q, k, lse,
            flops=2 * Hq * D * T * (T - tile) / 2)
    for tile in (64, 32):
        rec(f"pool_triton[tile{tile}]", jax.jit(lambda q, k, l, t=tile: tri.tile_scores_gpu(
            q, k, tile=t, lse=l, config=tri.PrefillScoresConfig(mosaic=False))), q, k, lse,
            flops=2 * Hq * D * T * (T - tile) / 2)
    nt = T // 128
    x = jnp.zeros((1, Hkv, nt, T), jnp.float32)
    rec("upper_triangle_select", jax.jit(lambda x: jnp.where(
        jnp.arange(T)[None, :] < (jnp.arange(nt) * 128)[:, None], x, -jnp.inf)), x, flops=0)

    write_json(path, out)
    print(table(out["checks"], ["B", "T", "Hq", "Hkv", "D", "lse_max_abs_diff", "pool_rel_err_vs_triton",
                                "pool_rel_err_vs_reference", "pattern_ok", "ok"]))
    print(table(out["records"], ["impl", "T", "ms", "tflops", "error"]))


if __name__ == "__main__":
    main()

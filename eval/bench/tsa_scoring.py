"""H100 check and timing of the Token Sparse Attention scoring kernel (issue 5, build item 1).

Run on a GPU machine from the repository root:

    GIT_COMMIT=$(git rev-parse HEAD) jsparse bench tsa_scoring --out /some/dir/

What it does (about 1-2 minutes on an H100; cases past a 170 s budget are recorded as skipped):
  1. Correctness, compiled on the GPU, at small shapes that hit every edge (B = 3 rows of lengths 1000,
     517 and 50 < W; GQA and MQA; D = 128 and 64; f32 and bf16): `tsa_scores_gpu` against the jnp
     reference on the same inputs. Tolerance (max abs error / max abs reference): f32 1e-4, bf16 1e-2.
  2. At Llama-3.1-8B shapes (B = 1, Hq = 32, Hkv = 8, D = 128, bf16, W = 128, pool 7) and
     T in {32768, 65536, 131072}, with a row length of T - 77 (odd, not a tile multiple):
     a. the kernel against the reference (which materialises [1, 32, 128, T] f32, ~2 GiB at 128K);
     b. the time of the whole scoring op (window gather, both passes, merge, pooling; jitted) for a few
        tile variants, median of 20 after 3 warm-ups;
     c. the time of cuDNN causal prefill attention at the same T
        (`jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")`), and the
        scoring time as a share of it;
     d. the floor of the scoring op: 2 passes x 2 * Hq * W * T * D FLOPs at the measured matmul rate,
        2 passes x W * Hq * T exponentials at H100's 3.9 T/s special-function rate, and the bytes of K
        read twice at the measured HBM bandwidth.

Writes the JSON named by --out (default ./tsa_scoring.json; device, jax version, date, GIT_COMMIT, every case) and
prints a table last.
Options: `--lengths 32768,65536` and `--no-variants` (default tiles only) if time is short.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench.common import (add_out_argument, device_facts, measure_hbm_gbs, measure_matmul_tflops, out_path,
                               positive_ints, require_gpu, time_ms, write_json)
from pallas_kernels.tsa_scoring import gpu, reference

BUDGET_S = 170.0
HQ, HKV, D, W, POOL = 32, 8, 128, 128, 7
EXP_PER_S = 3.9e12  # H100 SXM special-function (MUFU) throughput, FlashAttention-3 paper

VARIANTS = {
    "default": gpu.BlockSizes(),
    "q128_w8": gpu.BlockSizes(block_q=128, block_k=64, block_k_mean=64, num_warps=8),
    "k128_w8": gpu.BlockSizes(block_q=64, block_k=128, block_k_mean=128, num_warps=8),
    "q128_k128_w8_s3": gpu.BlockSizes(block_q=128, block_k=128, block_k_mean=128, num_warps=8, num_stages=3),
}


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _inputs(B, T, Hq, Hkv, D, dtype, seed):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (B, T, Hq, D), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, T, Hkv, D), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, T, Hkv, D), jnp.float32).astype(dtype)
    return q, k, v


def _scoring_fn(block_sizes):
    return jax.jit(lambda q, k, l: gpu.tsa_scores_gpu(
        q, k, window=W, pool_kernel=POOL, lengths=l, block_sizes=block_sizes))


def _reference_fn():
    return jax.jit(lambda q, k, l: reference.tsa_scores_reference(q, k, window=W, pool_kernel=POOL, lengths=l))


def small_checks() -> list[dict]:
    rows = []
    cases = [  # (B, T, Hq, Hkv, D, W, lengths, dtype, tol)
        (3, 1000, 8, 2, 128, 128, [1000, 517, 50], jnp.float32, 1e-4),
        (3, 1000, 8, 2, 128, 128, [1000, 517, 50], jnp.bfloat16, 1e-2),
        (2, 777, 9, 3, 64, 100, [777, 333], jnp.bfloat16, 1e-2),  # SmolLM2 heads, W not a tile multiple
        (1, 300, 4, 1, 128, 128, [299], jnp.bfloat16, 1e-2),  # MQA
    ]
    for i, (B, T, Hq, Hkv, Dh, Wc, lens, dtype, tol) in enumerate(cases):
        q, k, _ = _inputs(B, T, Hq, Hkv, Dh, dtype, seed=i)
        lens = jnp.array(lens, jnp.int32)
        want = reference.tsa_scores_reference(q, k, window=Wc, pool_kernel=POOL, lengths=lens)
        row = dict(B=B, T=T, Hq=Hq, Hkv=Hkv, D=Dh, W=Wc, lengths=np.asarray(lens).tolist(),
                   dtype=jnp.dtype(dtype).name, tol=tol)
        for name, bs in VARIANTS.items():
            got = gpu.tsa_scores_gpu(q, k, window=Wc, pool_kernel=POOL, lengths=lens, block_sizes=bs)
            err = _rel_err(got, want)
            tail_zero = all(float(jnp.abs(got[b, :, n:]).max(initial=0.0)) == 0.0
                            for b, n in enumerate(np.asarray(lens)))
            row[f"rel_err_{name}"] = err
            row[f"ok_{name}"] = bool(err < tol and tail_zero)
        rows.append(row)
        print("check", row, flush=True)
    return rows


def long_case(T: int, variants: dict, peak_tflops: float, hbm_gbs: float, t_start: float) -> dict:
    q, k, v = _inputs(1, T, HQ, HKV, D, jnp.bfloat16, seed=T)
    length = T - 77
    lens = jnp.array([length], jnp.int32)
    row: dict = dict(T=T, length=length)

    want = jax.block_until_ready(_reference_fn()(q, k, lens))
    default = _scoring_fn(VARIANTS["default"])
    got = default(q, k, lens)
    row["rel_err"] = _rel_err(got, want)
    row["tail_zero"] = float(jnp.abs(got[:, :, length:]).max()) == 0.0
    row["ok"] = bool(row["rel_err"] < 1e-2 and row["tail_zero"])
    # Same top keys? (what TSA's selection consumes): overlap of the top 10% per head.
    kk = max(1, length // 10)
    top_got = np.asarray(jax.lax.top_k(got[0, :, :length], kk)[1])
    top_want = np.asarray(jax.lax.top_k(want[0, :, :length], kk)[1])
    row["top10pct_overlap"] = float(np.mean([len(np.intersect1d(a, b)) / kk for a, b in zip(top_got, top_want)]))
    del want

    row["scoring_ms"] = {}
    for name, bs in variants.items():
        if time.perf_counter() - t_start > BUDGET_S:
            row["scoring_ms"][name] = "skipped (budget)"
            continue
        fn = default if name == "default" else _scoring_fn(bs)
        row["scoring_ms"][name] = time_ms(fn, q, k, lens, warmup=3, iters=20)
        print(f"T={T} scoring {name}: {row['scoring_ms'][name]:.3f} ms", flush=True)

    attn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
    iters = 20
    row["attention_ms"] = time_ms(attn, q, k, v, warmup=3, iters=iters)
    row["attention_tflops"] = 4 * HQ * D * T * T / 2 / (row["attention_ms"] * 1e-3) / 1e12
    timed = {n: t for n, t in row["scoring_ms"].items() if isinstance(t, float)}
    best = min(timed, key=timed.get)
    row["best_variant"] = best
    row["best_scoring_ms"] = timed[best]
    row["share_of_attention"] = timed[best] / row["attention_ms"]

    flops = 2 * (2 * HQ * W * length * D)
    exps = 2 * HQ * W * length
    kbytes = 2 * length * HKV * D * 2
    row["floor_ms"] = {
        "matmul": flops / (peak_tflops * 1e12) * 1e3,
        "exp": exps / EXP_PER_S * 1e3,
        "k_bytes": kbytes / (hbm_gbs * 1e9) * 1e3,
    }
    print(f"T={T}", row, flush=True)
    return row


def main(argv=None, prog=None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="32768,65536,131072", type=positive_ints)
    p.add_argument("--no-variants", action="store_true")
    add_out_argument(p, "tsa_scoring.json")
    args = p.parse_args(argv)
    try:
        require_gpu("tsa_scoring")
        path = out_path(args.out, "tsa_scoring.json")  # before the run: a bad --out ends none
    except ValueError as e:
        p.error(str(e))
    t_start = time.perf_counter()

    record: dict = dict(device_facts())
    record["git_commit"] = os.environ.get("GIT_COMMIT", record.get("commit"))
    record["config"] = dict(Hq=HQ, Hkv=HKV, D=D, W=W, pool_kernel=POOL, dtype="bfloat16", B=1,
                            variants={n: dataclasses.asdict(b) for n, b in VARIANTS.items()})
    record["measured_matmul_tflops"] = measure_matmul_tflops()
    record["measured_hbm_gbs"] = measure_hbm_gbs()
    record["checks"] = small_checks()

    variants = {"default": VARIANTS["default"]} if args.no_variants else VARIANTS
    record["cases"] = []
    for T in args.lengths:
        if time.perf_counter() - t_start > BUDGET_S:
            record["cases"].append(dict(T=T, skipped="budget"))
            continue
        record["cases"].append(long_case(T, variants, record["measured_matmul_tflops"],
                                         record["measured_hbm_gbs"], t_start))
    record["wall_s"] = time.perf_counter() - t_start
    record["all_ok"] = bool(all(all(v for kk, v in r.items() if kk.startswith("ok_")) for r in record["checks"])
                            and all(r.get("ok", False) for r in record["cases"] if "skipped" not in r))

    write_json(path, record)

    print(f"\nwrote {path}; device {record['device']}, jax {record['jax']}, commit {record['git_commit']}")
    print(f"small-shape checks: {sum(all(v for kk, v in r.items() if kk.startswith('ok_')) for r in record['checks'])}"
          f"/{len(record['checks'])} ok; all_ok={record['all_ok']}")
    print(f"{'T':>7} {'rel_err':>8} {'top10%':>6} {'score ms':>9} {'variant':>16} {'cudnn ms':>9} {'share':>7} "
          f"{'floor ms':>8}")
    for r in record["cases"]:
        if "skipped" in r:
            print(f"{r['T']:>7} skipped ({r['skipped']})")
            continue
        floor = max(r["floor_ms"].values())
        print(f"{r['T']:>7} {r['rel_err']:8.1e} {r['top10pct_overlap']:6.3f} {r['best_scoring_ms']:9.3f} "
              f"{r['best_variant']:>16} {r['attention_ms']:9.2f} {100 * r['share_of_attention']:6.2f}% {floor:8.3f}")
    return 0 if record["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""GPU check and timing of `pallas_kernels.local_attention` (TSA's fill="local"): sliding-window attention with sinks.

Run on a GPU machine from the repository root:

    GIT_COMMIT=$(git rev-parse HEAD) jsparse bench local_attention --out /some/dir/

What it does (about a minute on an H100):
  1. Checks the compiled Triton kernel against a dense masked f32 reference (query i sees key j iff j <= i and
     (i - j < window or j < sinks)) at small shapes: bf16 and f32, T not a multiple of the blocks, D 64 and 128,
     window 1 / 64 / 300, sinks 0 / 4 / 1000 (sinks spanning many key blocks).
  2. At Llama-3.1-8B heads (B 1, Hq 32, Hkv 8, D 128, bf16), T = 131072, window 64, 4 sinks: times the kernel at
     each block size of a small sweep (checked against the blocked jnp version), the blocked jnp version
     (`local_attention_reference`, XLA) and cuDNN's own sliding window (`jax.nn.dot_product_attention` with
     `local_window_size`, no sinks: the strongest dense baseline for the window alone), and gives the HBM floor
     (read Q, K, V once, write the output).
Writes the JSON named by --out (default ./local_attention.json) and prints a table last.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp

from eval.bench.common import (add_out_argument, device_facts, measure_hbm_gbs, out_path, require_gpu, table, time_ms,
                               write_json)
from pallas_kernels.local_attention import BlockSizes, banded_mask, local_attention_gpu, local_attention_reference
from pallas_kernels.sparse_attention.reference import masked_attention_reference

HQ, HKV, D, WINDOW, SINKS = 32, 8, 128, 64, 4


def _inputs(T, Hq, Hkv, D, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(kk, (1, T, h, D), jnp.float32).astype(dtype)
                 for kk, h in zip(ks, (Hq, Hkv, Hkv)))


def checks() -> list[dict]:
    rows = []
    for T, d, window, sinks, dtype in [(1000, 128, 64, 4, jnp.bfloat16), (1000, 64, 300, 0, jnp.float32),
                                       (777, 128, 1, 0, jnp.bfloat16), (1500, 128, 64, 1000, jnp.bfloat16),
                                       (2048, 128, 64, 4, jnp.float32)]:
        q, k, v = _inputs(T, 4, 2, d, dtype, seed=T)
        f = lambda x: x.astype(jnp.float32)  # noqa: E731
        mask = jnp.broadcast_to(jnp.asarray(banded_mask(T, window, sinks)), (1, 4, T, T))
        want = masked_attention_reference(f(q), f(k).transpose(0, 2, 1, 3), f(v).transpose(0, 2, 1, 3), mask)
        got = f(jax.jit(lambda q, k, v, w=window, s=sinks: local_attention_gpu(q, k, v, window=w, sinks=s))(q, k, v))
        err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
        tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
        rows.append({"check": f"T={T} D={d} window={window} sinks={sinks} {jnp.dtype(dtype).name}",
                     "rel_err": err, "ok": bool(err <= tol)})
    return rows


def main(argv=None, prog=None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_out_argument(p, "local_attention.json")
    args = p.parse_args(argv)
    try:
        require_gpu("local_attention")
        path = out_path(args.out, "local_attention.json")  # before the run: a bad --out ends none
    except ValueError as e:
        p.error(str(e))
    t0 = time.perf_counter()
    facts = device_facts()
    hbm = measure_hbm_gbs()
    check_rows = checks()
    for r in check_rows:
        print("check", r, flush=True)
    T = 131072
    q, k, v = _inputs(T, HQ, HKV, D, jnp.bfloat16)
    floor_ms = (2 * q.size * 2 + 2 * k.size * 2) / (hbm * 1e9) * 1e3
    ref = jax.jit(lambda q, k, v: local_attention_reference(q, k, v, window=WINDOW, sinks=SINKS))
    want = ref(q, k, v).astype(jnp.float32)
    cases = [{"impl": "xla blocked jnp", "ms": time_ms(ref, q, k, v, warmup=2, iters=5)}]
    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, local_window_size=(WINDOW - 1, 0), implementation="cudnn"))
    try:
        cases.append({"impl": "cudnn sliding window (no sinks)", "ms": time_ms(cudnn, q, k, v, warmup=2, iters=10)})
    except Exception as e:  # noqa: BLE001  (record, go on)
        cases.append({"impl": "cudnn sliding window (no sinks)", "error": f"{type(e).__name__}: {str(e)[:300]}"})
    for bq in (64, 128):
        for bk in (32, 64):
            for nw in (4, 8):
                bs = BlockSizes(block_q=bq, block_k=bk, num_warps=nw)
                fn = jax.jit(lambda q, k, v, bs=bs: local_attention_gpu(q, k, v, window=WINDOW, sinks=SINKS,
                                                                         block_sizes=bs))
                err = float(jnp.max(jnp.abs(fn(q, k, v).astype(jnp.float32) - want)))
                cases.append({"impl": f"triton bq{bq} bk{bk} warps{nw}" + (" (default)" if bs == BlockSizes() else ""),
                              "ms": time_ms(fn, q, k, v, warmup=2, iters=10), "max_abs_diff_vs_xla": err})
    for c in cases:
        if "ms" in c:
            c["floor_ms"], c["x_floor"] = floor_ms, c["ms"] / floor_ms
    payload = {**facts, "hbm_gbs": hbm,
               "config": {"B": 1, "T": T, "Hq": HQ, "Hkv": HKV, "D": D, "dtype": "bfloat16", "window": WINDOW,
                          "sinks": SINKS},
               "checks": check_rows, "cases": cases, "seconds": time.perf_counter() - t0}
    write_json(path, payload)
    ok = all(r["ok"] for r in check_rows)
    print("\nchecks: %s (%s)" % ("all ok" if ok else "FAILED",
                                 ", ".join("%s: %.1e" % (r["check"], r["rel_err"]) for r in check_rows)))
    print(f"wrote {path}\n")
    print(table(cases, ["impl", "ms", "floor_ms", "x_floor", "max_abs_diff_vs_xla", "error"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

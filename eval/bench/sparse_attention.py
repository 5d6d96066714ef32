"""H100 check and timing of the gathered sparse-attention kernels (decode and tile-gathered prefill).

Run on a GPU machine from the repository root:

    GIT_COMMIT=$(git rev-parse HEAD) jsparse bench sparse_attention --out /some/dir/

What it does (about 2-3 minutes on an H100; sections past a 210 s budget are recorded as skipped):
  1. Decode at B=8, Hq=32, Hkv=8, D=128, bf16, N in {32768, 131072}, budget 10% (K = N/10 tokens), block_size
     1 and 16:
     a. correctness, compiled: the Pallas kernel (`sparse_decode_gpu`, with lse) and the XLA gather
        (`sparse_decode_xla`) against `sparse_decode_reference` on fresh random inputs with odd row lengths
        and -1 padding, each run after the device memory was poisoned with NaNs (so an output element the
        kernel forgot to write shows up); tolerance: max abs error / max abs reference <= 2e-2 (bf16), and
        lse within 2e-2; also T = 2 at N = 32768;
     b. timing (median of 20 samples of 5 back-to-back calls, after 3 warm-ups): dense cuDNN decode
        (`pallas_kernels.dense.dense_decode`), dense XLA einsum decode (head-major cache), the XLA gather,
        the Pallas kernel with its default `DecodeConfig` and a few variants (at N = 131072);
        GB/s of K/V bytes read, and the speed-up over the best dense decode.
  2. Prefill at B=1, T=32768, Hq=32, Hkv=8, D=128, bf16, tile 128, a rolling 10% budget per query tile
     (k_i = min(max(ceil(0.1 * L_i), 128), L_i) keys before tile i's start L_i), block_size 1 and 16:
     correctness of the Pallas and XLA prefill against the reference at T = 8192 (row length 8192 - 37),
     then timing at T = 32768 against cuDNN causal prefill (`dense_prefill`), with TFLOP/s of the attended
     (query, key) pairs.

Writes the JSON named by --out (default ./sparse_attention.json; device, jax version, date, GIT_COMMIT, measured HBM
GB/s, every case) and prints a table last. Options: `--contexts 32768` and `--no-variants` if time is short.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench.common import (add_out_argument, dense_einsum_decode, device_facts, measure_hbm_gbs, out_path,
                               positive_int, positive_ints, require_gpu, table, write_json)
from pallas_kernels.dense import dense_decode, dense_prefill
from pallas_kernels.sparse_attention import gpu, reference, xla
from pallas_kernels.sparse_attention.testing import strided_indices

BUDGET_S = 210.0
B, HQ, HKV, D = 8, 32, 8, 128
DTYPE = jnp.bfloat16
BUDGET = 0.10
TOL = 2e-2
POISON_ELEMS = 1 << 29  # 1 GiB of bf16
DECODE_VARIANTS = {
    "bk32_w4": gpu.DecodeConfig(block_k=32, num_warps=4),
    "bk128_w4": gpu.DecodeConfig(block_k=128, num_warps=4),
    "bk64_w8_s3": gpu.DecodeConfig(block_k=64, num_warps=8, num_stages=3),
    "bk64_1024prog": gpu.DecodeConfig(block_k=64, target_programs=1024),
}
PREFILL_VARIANTS = {
    "bk64_w4": gpu.PrefillConfig(block_k=64, num_warps=4),
    "bk32_w4_s3": gpu.PrefillConfig(block_k=32, num_warps=4, num_stages=3),
}

T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def time_ms(fn, *args, warmup: int = 3, samples: int = 20, inner: int = 5) -> float:
    """Median per-call time in ms: `samples` samples of `inner` back-to-back calls (dispatch overlapped),
    after `warmup` calls. Slow functions (> 5 ms) take one call per sample."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    if time.perf_counter() - t > 5e-3:
        inner = 1
    times = []
    for _ in range(samples):
        t = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / inner * 1e3)
    return float(statistics.median(times))


def poison() -> None:
    """Fills (then frees) 1 GiB of device memory with NaNs, so reused output buffers start as NaN."""
    x = jnp.full((POISON_ELEMS,), jnp.nan, jnp.bfloat16)
    x.block_until_ready()
    del x


def rel_err(got, want) -> float:
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    if not np.all(np.isfinite(got[np.isfinite(want)])):
        return float("inf")
    fin = np.isfinite(want)
    return float(np.abs(got[fin] - want[fin]).max() / max(np.abs(want[fin]).max(), 1e-30))


def lse_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    fin = np.isfinite(want)
    if not np.array_equal(np.isfinite(got), fin):
        return float("inf")
    return float(np.abs(got[fin] - want[fin]).max()) if fin.any() else 0.0


def decode_inputs(N: int, T: int, bs: int, seed: int, odd: bool):
    """Random q/k/v, row lengths (odd and short of N when `odd`), and 10%-budget indices with -1 padding."""
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (B, T, HQ, D), DTYPE)
    k = jax.random.normal(ks[1], (B, HKV, N, D), DTYPE)
    v = jax.random.normal(ks[2], (B, HKV, N, D), DTYPE)
    if odd:
        lengths = N - 1 - 2 * jax.random.randint(ks[3], (B,), 0, 500)  # odd, < N
    else:
        lengths = jnp.full((B,), N, jnp.int32)
    K = max(1, round(BUDGET * N) // bs)
    blocks = -(-lengths // bs)  # blocks holding valid tokens
    count = K - (jax.random.randint(ks[4], (B, HKV, T), 0, max(1, K // 20)) if odd else 0)  # some -1 padding
    limit = jnp.broadcast_to(blocks[:, None, None], (B, HKV, T))
    idx = strided_indices(ks[5], limit, count, K)
    return q, k, v, idx, lengths.astype(jnp.int32), K


def run_decode(N: int, variants: bool, records: list, checks: list) -> None:
    kv_bytes_dense = 2 * B * HKV * N * D * 2
    fns = {
        "dense_cudnn": jax.jit(lambda q, k, v, l: dense_decode(q, k, v, l)),
        "dense_xla_einsum": jax.jit(dense_einsum_decode),
    }
    q, k, v, _, lengths, _ = decode_inputs(N, 1, 1, seed=1, odd=False)
    dense = {}
    for name, fn in fns.items():
        try:
            dense[name] = time_ms(fn, q, k, v, lengths)
            records.append(dict(phase="decode", N=N, block_size=None, impl=name, ms=dense[name],
                                gbs=kv_bytes_dense / (dense[name] * 1e-3) / 1e9))
        except Exception as e:  # noqa: BLE001 - record and go on
            records.append(dict(phase="decode", N=N, impl=name, error=repr(e)[:300]))
    best_dense = min(dense.values()) if dense else float("nan")
    for r in records:
        if r.get("phase") == "decode" and r.get("N") == N and r.get("impl") in dense:
            r["speedup_vs_best_dense"] = best_dense / r["ms"]
    del q, k, v

    for bs in (1, 16):
        if elapsed() > BUDGET_S:
            records.append(dict(phase="decode", N=N, block_size=bs, skipped="time budget"))
            continue
        # Correctness on fresh random inputs (odd lengths, -1 padding), T = 1 (and T = 2 at the first N).
        for T in ((1, 2) if N == 32768 else (1,)):
            q, k, v, idx, lengths, K = decode_inputs(N, T, bs, seed=10 + bs + T, odd=True)
            want, want_lse = jax.jit(lambda *a: reference.sparse_decode_reference(
                *a, block_size=bs, return_lse=True))(q, k, v, idx, lengths)
            for name, fn in {
                "pallas_gpu": lambda *a: gpu.sparse_decode_gpu(*a, block_size=bs, return_lse=True),
                "xla_gather": lambda *a: xla.sparse_decode_xla(*a, block_size=bs, return_lse=True),
            }.items():
                poison()
                got, got_lse = jax.jit(fn)(q, k, v, idx, lengths)
                e, el = rel_err(got, want), lse_err(got_lse, want_lse)
                checks.append(dict(phase="decode", N=N, T=T, block_size=bs, K=K, impl=name, rel_err=e,
                                   lse_abs_err=el, ok=bool(e <= TOL and el <= TOL)))
            del q, k, v, want
        # Timing at full length.
        q, k, v, idx, lengths, K = decode_inputs(N, 1, bs, seed=3 + bs, odd=False)
        sel_bytes = 2 * B * HKV * K * bs * D * 2
        impls = {"xla_gather": jax.jit(lambda *a: xla.sparse_decode_xla(*a, block_size=bs)),
                 "pallas_gpu": jax.jit(lambda *a: gpu.sparse_decode_gpu(*a, block_size=bs))}
        if variants and N == max(ARGS.contexts):
            for vname, cfg in DECODE_VARIANTS.items():
                impls[f"pallas_gpu[{vname}]"] = jax.jit(
                    lambda *a, cfg=cfg: gpu.sparse_decode_gpu(*a, block_size=bs, config=cfg))
        for name, fn in impls.items():
            if elapsed() > BUDGET_S:
                records.append(dict(phase="decode", N=N, block_size=bs, impl=name, skipped="time budget"))
                continue
            try:
                ms = time_ms(fn, q, k, v, idx, lengths)
                records.append(dict(phase="decode", N=N, block_size=bs, K=K, impl=name, ms=ms,
                                    gbs=sel_bytes / (ms * 1e-3) / 1e9, speedup_vs_best_dense=best_dense / ms))
            except Exception as e:  # noqa: BLE001
                records.append(dict(phase="decode", N=N, block_size=bs, impl=name, error=repr(e)[:300]))
        del q, k, v


def prefill_inputs(T: int, bs: int, tile: int, seed: int, length: int):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (1, T, HQ, D), DTYPE)
    k = jax.random.normal(ks[1], (1, T, HKV, D), DTYPE)
    v = jax.random.normal(ks[2], (1, T, HKV, D), DTYPE)
    nt = -(-T // tile)
    L = np.arange(nt) * tile  # keys before each tile
    k_tok = np.minimum(np.maximum(np.ceil(BUDGET * L), 128), L).astype(np.int64)  # rolling budget per tile
    counts = k_tok // bs
    K = max(1, int(counts.max()))
    limit = jnp.broadcast_to(jnp.asarray(L // bs, jnp.int32), (1, HKV, nt))
    idx = strided_indices(ks[3], jnp.maximum(limit, 1), jnp.asarray(counts, jnp.int32), K)
    idx = jnp.where(limit[..., None] > 0, idx, -1)  # tile 0 has nothing before it
    pairs = int(np.sum(counts * bs * tile) + nt * tile * (tile + 1) // 2)  # attended (query, key) pairs / head
    return q, k, v, idx, jnp.array([length], jnp.int32), K, pairs


def run_prefill(T: int, tile: int, variants: bool, records: list, checks: list) -> None:
    q, k, v, _, lengths, _, _ = prefill_inputs(T, 1, tile, seed=20, length=T)
    dense_flops = 4 * D * HQ * T * (T + 1) / 2
    try:
        dense_ms = time_ms(jax.jit(dense_prefill), q, k, v)
        records.append(dict(phase="prefill", T=T, impl="dense_cudnn_causal", ms=dense_ms,
                            tflops=dense_flops / (dense_ms * 1e-3) / 1e12, speedup_vs_dense=1.0))
    except Exception as e:  # noqa: BLE001
        dense_ms = float("nan")
        records.append(dict(phase="prefill", T=T, impl="dense_cudnn_causal", error=repr(e)[:300]))
    del q, k, v

    for bs in (1, 16):
        if elapsed() > BUDGET_S:
            records.append(dict(phase="prefill", T=T, block_size=bs, skipped="time budget"))
            continue
        Tc = min(8192, T)
        q, k, v, idx, lengths, K, _ = prefill_inputs(Tc, bs, tile, seed=30 + bs, length=Tc - 37)
        want = jax.jit(lambda *a: reference.sparse_prefill_reference(*a, tile=tile, block_size=bs))(
            q, k, v, idx, lengths)
        for name, fn in {"pallas_gpu": lambda *a: gpu.sparse_prefill_gpu(*a, tile=tile, block_size=bs),
                         "xla_gather": lambda *a: xla.sparse_prefill_xla(*a, tile=tile, block_size=bs)}.items():
            poison()
            e = rel_err(jax.jit(fn)(q, k, v, idx, lengths), want)
            checks.append(dict(phase="prefill", T=Tc, block_size=bs, K=K, tile=tile, impl=name, rel_err=e,
                               ok=bool(e <= TOL)))
        del q, k, v, want

        q, k, v, idx, lengths, K, pairs = prefill_inputs(T, bs, tile, seed=40 + bs, length=T)
        flops = 4 * D * HQ * pairs
        impls = {"pallas_gpu": jax.jit(lambda *a: gpu.sparse_prefill_gpu(*a, tile=tile, block_size=bs)),
                 "xla_gather": jax.jit(lambda *a: xla.sparse_prefill_xla(*a, tile=tile, block_size=bs))}
        if variants:
            for vname, cfg in PREFILL_VARIANTS.items():
                impls[f"pallas_gpu[{vname}]"] = jax.jit(
                    lambda *a, cfg=cfg: gpu.sparse_prefill_gpu(*a, tile=tile, block_size=bs, config=cfg))
        for name, fn in impls.items():
            if elapsed() > BUDGET_S:
                records.append(dict(phase="prefill", T=T, block_size=bs, impl=name, skipped="time budget"))
                continue
            try:
                ms = time_ms(fn, q, k, v, idx, lengths)
                records.append(dict(phase="prefill", T=T, block_size=bs, K=K, tile=tile, impl=name, ms=ms,
                                    tflops=flops / (ms * 1e-3) / 1e12, speedup_vs_dense=dense_ms / ms,
                                    attended_fraction=pairs / (T * (T + 1) / 2)))
            except Exception as e:  # noqa: BLE001
                records.append(dict(phase="prefill", T=T, block_size=bs, impl=name, error=repr(e)[:300]))
        del q, k, v


def main(argv=None, prog=None) -> int:
    global ARGS
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--contexts", default="32768,131072", type=positive_ints, help="decode cache lengths N")
    p.add_argument("--prefill-length", type=positive_int, default=32768)
    p.add_argument("--tile", type=positive_int, default=128)
    p.add_argument("--no-variants", action="store_true", help="default kernel configs only")
    p.add_argument("--no-prefill", action="store_true")
    add_out_argument(p, "sparse_attention.json")
    ARGS = p.parse_args(argv)
    try:
        require_gpu("sparse_attention")
        out = out_path(ARGS.out, "sparse_attention.json")  # before the run: a bad --out ends none
    except ValueError as e:
        p.error(str(e))

    facts = device_facts()
    print(f"# {facts}", flush=True)
    hbm = measure_hbm_gbs()
    records, checks = [], []
    for N in ARGS.contexts:
        print(f"# decode N={N} ({elapsed():.0f} s)", flush=True)
        run_decode(N, not ARGS.no_variants, records, checks)
    if not ARGS.no_prefill:
        print(f"# prefill T={ARGS.prefill_length} ({elapsed():.0f} s)", flush=True)
        run_prefill(ARGS.prefill_length, ARGS.tile, not ARGS.no_variants, records, checks)
    for r in records:
        if "gbs" in r:
            r["hbm_fraction"] = r["gbs"] / hbm

    payload = dict(facts, benchmark="gathered sparse attention: Pallas Triton / XLA gather vs dense cuDNN / XLA",
                   shape=dict(B=B, Hq=HQ, Hkv=HKV, D=D, dtype="bfloat16", budget=BUDGET,
                              prefill=dict(B=1, T=ARGS.prefill_length, tile=ARGS.tile)),
                   default_decode_config=dataclasses.asdict(gpu.DecodeConfig()),
                   default_prefill_config=dataclasses.asdict(gpu.PrefillConfig()),
                   hbm_gbs_measured=hbm, checks=checks, records=records, wall_s=elapsed())
    write_json(out, payload)

    print(table(checks, ["phase", "N", "T", "block_size", "K", "impl", "rel_err", "lse_abs_err", "ok"]))
    print()
    print(f"measured HBM: {hbm:.0f} GB/s; wrote {out} in {elapsed():.0f} s")
    print(table(records, ["phase", "N", "T", "block_size", "K", "impl", "ms", "gbs", "hbm_fraction", "tflops",
                          "speedup_vs_best_dense", "speedup_vs_dense", "skipped", "error"]))
    return 0 if all(c["ok"] for c in checks) else 1


ARGS = None

if __name__ == "__main__":
    sys.exit(main())

"""H100 check and timing of exact top-k selection (`pallas_kernels.topk_select`): every GPU path, and `lax.top_k`.

It checks and times the old multi-pass GPU path, the single-launch "row" kernel, the glue-free "fused" path and
the sampled-bracket "sample" path against `lax.top_k`.

Run on a GPU machine from the repository root (about 40-80 s on an H100):

    GIT_COMMIT=$(git rev-parse HEAD) jsparse bench topk_select --out /some/dir/

What it does:
  1. Correctness, compiled on the GPU: every variant below that applies, at every case's shape, on two inputs
     (random normal scores with per-row k around the case's k, and adversarial rows: heavy ties, all-equal,
     all -inf, NaNs of several payloads with +-0.0 / +-inf, a few distinct values), plus small odd shapes
     (N = 1, 33, 300, 1000 with k = 0 and k above the valid count), against `topk_select_reference`:
     EXACT equality of the int32 index arrays.
  2. Timing (eval.bench.common.time_ms: 3 warm-ups, median of 20, results blocked on) at
     (rows, N, k) = (64, 131072, 13108), (64, 32768, 3277), (32, 6256, 64), (4, 6256, 64), (4, 8192, 40) of:
       passes   the old path (8 counting launches at 4 bits with XLA glue, final count, split plan, compaction)
       fused    32 / bits counting launches + final count + compaction, no XLA between them (4 and 2 bits)
       row_bN   the single-launch kernel, N radix bits per in-kernel pass (N <= 32768 only)
       sample   the sampled-bracket path (N >= 4096; _cb2048: compaction chunks of 2048; _s2048: a sample of
                2048 and a band of 32768; sample_small: 256 / 1024 on the short odd shapes)
       auto     what `topk_select` picks by default (row_b2 when N <= 16384, else sample; not timed again)
       lax_top_k      `lax.top_k(x, k)` alone (values + indices, not the index contract)
       reference      `topk_select_reference` (top_k + mask + sort: the contract)
     with the number of kernels each launches (custom calls in its lowered module).

  3. The Kascade case (issue 24; `--cases kascade` runs only it and the small checks): 32 rows like the Kascade
     anchor scores of `jsparse bench model` at 100K context, batch 4, on the cache it used before 918fbd1
     (`testing.kascade_like_rows`: keys tiled with a period of 256, so each score is tied ~390 times;
     N = 100096, k = 10001 .. 10004, K = 10010), every variant exact against the reference, and timed:
       sample           the sampled path (the default for N > 16384)
       fused, lax_top_k, reference   as above
     beside how the sampled path resolves the rows (`resolution`: rows per way, from its own launches 1-2). The
     sampled path before issue 24 (a fixed stride that aliased with the period, so 18 of the 32 rows took the
     one-program streaming fallback: 0.570 ms against 0.157 ms) was measured by this case at 918fbd1
     (eval/results/h100/topk_select_kascade.json) and then removed.

Writes the JSON named by --out (default ./topk_select.json) (device facts and every case) and prints a table last. Cases past a 150 s
budget are recorded as skipped.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench.common import add_out_argument, device_facts, out_path, require_gpu, table, time_ms, write_json
from pallas_kernels.topk_select import gpu, gpu_row, gpu_sample, topk_select_reference
from pallas_kernels.topk_select.testing import adversarial, kascade_like_rows

BUDGET_S = 150.0
CASES = [(64, 131072, 13108), (64, 32768, 3277), (32, 6256, 64), (4, 6256, 64), (4, 8192, 40)]


def variants(N: int) -> dict:
    v = {"passes": gpu.SelectConfig(path="passes"),
         "fused": gpu.SelectConfig(path="fused"),
         "fused_b2": gpu.SelectConfig(path="fused", bits_per_pass=2)}
    if N <= gpu_row.ROW_LIMIT:
        for b in (1, 2, 4):
            v[f"row_b{b}"] = gpu.SelectConfig(path="row", row_bits=b)
    if N >= 4096:
        v["sample"] = gpu.SelectConfig(path="sample")
        v["sample_cb2048"] = gpu.SelectConfig(path="sample", compact_block_n=2048)
        v["sample_s2048"] = gpu.SelectConfig(path="sample", sample_size=2048, band_cap=32768)
    elif N >= 256:
        v["sample_small"] = gpu.SelectConfig(path="sample", sample_size=256, band_cap=1024)
    return v


def auto_variant(N: int, R: int, K: int) -> str:
    """The variant above that `topk_select`'s default config runs for R rows of N, width K (timed once, reported
    twice)."""
    c = gpu.SelectConfig()
    p = c.pick_path(N, R, K)
    return f"row_b{c.row_bits}" if p == "row" else p




def row_ks(rng, R: int, k: int, K: int) -> np.ndarray:
    ks = np.clip(k + rng.integers(-k // 4 - 2, k // 4 + 3, R), -1, K + 3).astype(np.int32)
    ks[: min(3, R)] = [0, K, K + 5][: min(3, R)]
    return ks


SMOKE = os.environ.get("TOPK_SMOKE") == "1"  # CPU dry run of this script: interpreter, tiny cases


def select_fn(config, K):
    return jax.jit(lambda x, k: gpu.topk_select_gpu(x, k, K, config=config, interpret=SMOKE))


def kernels_of(fn, *args) -> int:
    return fn.lower(*args).as_text().count("stablehlo.custom_call")


def check(fn, x: np.ndarray, k: np.ndarray, K: int) -> bool:
    want = np.asarray(topk_select_reference(jnp.asarray(x), jnp.asarray(k), K))
    got = np.asarray(fn(jnp.asarray(x), jnp.asarray(k)))
    return got.shape == want.shape and bool(np.array_equal(got, want))


def small_checks() -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for R, N, K in [(6, 1, 4), (12, 33, 50), (12, 300, 40), (12, 1000, 700)][: 1 if SMOKE else 4]:
        for name, config in variants(N).items():
            if name in ("passes", "fused_b2"):  # the old, tested path; fused at 2 bits is fused at 4 bits' code
                continue
            fn = select_fn(config, K)
            x = adversarial(rng, R, N)
            ok = all(check(fn, x, row_ks(rng, R, K // 2, min(K, N)), K) for _ in range(2))
            out.append({"R": R, "N": N, "K": K, "variant": name, "exact": ok})
    return out


def case(R: int, N: int, k: int, t_start: float) -> list[dict]:
    rng = np.random.default_rng(N + k)
    x = jax.random.normal(jax.random.key(N), (R, N), jnp.float32)
    kv = jnp.full((R,), k, jnp.int32)
    x_adv = adversarial(rng, R, N)
    rows = []
    for name, config in variants(N).items():
        rec = {"rows": R, "N": N, "k": k, "variant": name}
        if time.perf_counter() - t_start > BUDGET_S:
            rec["skipped"] = "time budget"
            rows.append(rec)
            continue
        try:
            fn = select_fn(config, k)
            rec["path"] = config.pick_path(N, R, k)
            rec["kernels"] = kernels_of(fn, x, kv)
            rec["exact"] = (check(fn, np.asarray(x), row_ks(rng, R, k, k), k)
                            and check(fn, x_adv, row_ks(rng, R, k, k), k))
            rec["ms"] = time_ms(fn, x, kv, **({"warmup": 1, "iters": 1} if SMOKE else {}))
        except Exception as e:  # a variant that does not compile is a result, not the end of the run
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(rec)
    auto = next(r for r in rows if r["variant"] == auto_variant(N, R, k))
    rows.append({**auto, "variant": "auto", "same_as": auto_variant(N, R, k)})
    top_k = jax.jit(lambda a: jax.lax.top_k(a, k))
    ref = jax.jit(lambda a, kk: topk_select_reference(a, kk, k))
    rows.append({"rows": R, "N": N, "k": k, "variant": "lax_top_k", "ms": time_ms(top_k, x)})
    rows.append({"rows": R, "N": N, "k": k, "variant": "reference", "ms": time_ms(ref, x, kv)})
    base = next((r.get("ms") for r in rows if r["variant"] == "passes"), None)
    for r in rows:
        if base and r.get("ms"):
            r["speedup_vs_passes"] = base / r["ms"]
        r["bytes_MB"] = R * N * 4 / 1e6
    return rows


KASCADE = dict(rows=32, context=100_000, capacity=100_096, K=10_010)  # B 4 x Hkv 8; bench model's cache capacity


def resolution(x, k, K: int) -> dict:
    """How the sampled path resolves each row, counted from its launches 1 and 2 at the default config:
    {'a', 'band', 'b', 'fallback'} -> rows ('a' / 'b': t at a bracket end)."""
    c = gpu.SelectConfig()
    sample = c.sample_for("sample", x.shape[-1])
    cap = c.band_cap or gpu_sample.band_capacity(K, x.shape[-1], sample, c.sample_sigmas)
    kw = dict(sample=sample, sigmas=c.sample_sigmas, cap=cap, bits=c.row_bits,
              block_n=c.compact_block_n, target_programs=c.target_programs, params=None, interpret=SMOKE)
    kk = np.clip(np.asarray(k), 0, K)
    _, counts, nb, _ = jax.jit(lambda a, b: gpu_sample.sample_band(a, b[:, None], K, **kw))(x, k)
    cnt, nb = np.asarray(counts).sum(1), np.asarray(nb)[:, 0]
    gt_a, ge_a = cnt[:, 0], cnt[:, 0] + cnt[:, 1]
    at_a = (gt_a < kk) & (kk <= ge_a)
    band = (ge_a < kk) & (kk <= ge_a + nb) & (nb <= cap)
    at_b = (ge_a + nb < kk) & (kk <= ge_a + nb + cnt[:, 2])
    return {"a": int(at_a.sum()), "band": int(band.sum()), "b": int(at_b.sum()),
            "fallback": int((~(at_a | band | at_b) & (kk > 0)).sum())}


def kascade_case() -> list[dict]:
    """The Kascade case (module docstring, 3.)."""
    R, ctx, cap, K = ((4, 9000, 9088, 910) if SMOKE else
                      (KASCADE["rows"], KASCADE["context"], KASCADE["capacity"], KASCADE["K"]))
    xn, kn = kascade_like_rows(np.random.default_rng(24), R, ctx, cap)
    x, kv = jnp.asarray(xn), jnp.asarray(kn)
    want = np.asarray(topk_select_reference(x, kv, K))
    fns = {"sample": select_fn(gpu.SelectConfig(path="sample"), K),
           "fused": select_fn(gpu.SelectConfig(path="fused"), K)}
    rows = []
    for name, fn in fns.items():
        rec = {"case": "kascade", "rows": R, "N": cap, "k": int(kn.max()), "K": K, "variant": name}
        try:
            rec["exact"] = bool(np.array_equal(np.asarray(fn(x, kv)), want))
            if name == "sample":
                rec["resolution"] = resolution(x, kv, K)
            rec["ms"] = time_ms(fn, x, kv, **({"warmup": 1, "iters": 1} if SMOKE else {}))
        except Exception as e:  # a variant that does not compile is a result, not the end of the run
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(rec)
    top_k = jax.jit(lambda a: jax.lax.top_k(a, K))
    ref = jax.jit(lambda a, kk: topk_select_reference(a, kk, K))
    rows.append({"case": "kascade", "rows": R, "N": cap, "k": int(kn.max()), "K": K, "variant": "lax_top_k",
                 "ms": time_ms(top_k, x)})
    rows.append({"case": "kascade", "rows": R, "N": cap, "k": int(kn.max()), "K": K, "variant": "reference",
                 "ms": time_ms(ref, x, kv)})
    base = next((r.get("ms") for r in rows if r["variant"] == "lax_top_k"), None)
    for r in rows:
        if base and r.get("ms"):
            r["speedup_vs_lax_top_k"] = base / r["ms"]
    return rows


def main(argv=None, prog=None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_out_argument(p, "topk_select.json")
    p.add_argument("--cases", default="all", choices=["all", "kascade"],
                   help="all: the small checks, the timed cases and the Kascade case; kascade: the small checks "
                        "and the Kascade case only")
    args = p.parse_args(argv)
    try:
        if not SMOKE:
            require_gpu("topk_select", "TOPK_SMOKE=1")
        path = out_path(args.out, "topk_select.json")  # before the run: a bad --out ends none
    except ValueError as e:
        p.error(str(e))
    t_start = time.perf_counter()
    facts = device_facts()
    tiny = jnp.zeros((4, 64), jnp.float32)
    facts["one_launch_ms"] = time_ms(jax.jit(lambda a: a + 1.0), tiny)  # the floor of any single-kernel op
    print(facts, flush=True)
    small = small_checks()
    print(f"small checks: {sum(r['exact'] for r in small)}/{len(small)} exact "
          f"({time.perf_counter() - t_start:.1f} s)", flush=True)
    rows = []
    for R, N, k in ([] if args.cases == "kascade" else [(3, 40, 5), (2, 200, 20)] if SMOKE else CASES):
        rows += case(R, N, k, t_start)
        print(f"case {(R, N, k)} done at {time.perf_counter() - t_start:.1f} s", flush=True)
    kascade = kascade_case()
    print(f"kascade case done at {time.perf_counter() - t_start:.1f} s", flush=True)
    all_exact = (all(r["exact"] for r in small) and all(r.get("exact", True) for r in rows + kascade)
                 and not any("error" in r for r in kascade))
    write_json(path,
               {**facts, "all_exact": all_exact, "small_checks": small, "cases": rows, "kascade": kascade,
                "wall_s": time.perf_counter() - t_start})
    bad = [r for r in small if not r["exact"]] + [r for r in rows + kascade
                                                  if r.get("exact") is False or "error" in r]
    for r in bad:
        print("NOT EXACT / ERROR:", r)
    if rows:
        print(table(rows, ["rows", "N", "k", "variant", "path", "kernels", "exact", "ms", "speedup_vs_passes"]))
    for r in kascade:
        r["resolution"] = " ".join(f"{w}:{n}" for w, n in r.get("resolution", {}).items()) or None
    print(table(kascade, ["case", "rows", "N", "k", "variant", "exact", "resolution", "ms", "speedup_vs_lax_top_k"]))
    print(f"all exact: {all_exact}; wall {time.perf_counter() - t_start:.1f} s")
    return 0 if all_exact else 1


if __name__ == "__main__":
    sys.exit(main())

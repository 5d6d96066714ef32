"""Can a latency-bound launch warm the next GEMM's weights in L2 for free? (issue 24's lead, `../l2_warm/NOTES.md`)

`../l2_warm/` found the ceiling: the O projection's GEMM (x [B, 4096] @ W [4096, 4096] bf16, 32 MiB) takes about 7
us instead of 14 when W was read just before it beside a sparse layer's K/V. A decode step runs latency-bound
launches just before that GEMM (H2O's score update, EvoSparse's selections and its gathered decode's tail: 8-20 us
each, reading a few MB), where most of the HBM bandwidth idles. This probe asks whether extra programs appended to
such a launch's grid, each reading its slice of W (`eviction_policy="evict_last"`, the values feeding a store that
never happens, so the loads are kept), make the GEMM after it faster without lengthening the launch.

The latency-bound launch is a stand-in: P programs, each a chain of C dependent scalar loads (pointer chasing through
a random permutation), about the length of those launches. Per iteration of a jitted fori_loop (each iteration
depends on the one before): a 96 MiB XLA reduction (the flush: what the layers between two uses of W read), then:
  chain:         the launch alone;
  chain+pf:      the launch with Q prefetch programs (its own length with them);
  chain,gemm:    the launch, then the GEMM (W cold: the baseline);
  chain+pf,gemm: the launch with the prefetch programs, then the GEMM;
  chain,pf,gemm: the launch, a launch of the prefetch programs alone, then the GEMM (the read serialised);
and flush alone. Each variant's time less the flush's is what it adds to a step. Q: 128, 256, 512 (about one to four
programs an SM of an H100's 132; divisors of W's rows); with and without evict_last (at 256).

Usage (GPU): GIT_COMMIT=<sha> OUT=... python3 eval/results/h100/l2_prefetch/probe.py (about a minute)
  SMOKE=1 JAX_PLATFORMS=cpu: interpret mode, small shapes, a few iterations (what tests/ can run; no timings).
"""
import functools
import json
import os
import time
from datetime import datetime, timezone

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

SMOKE = os.environ.get("SMOKE") == "1"
D = 256 if SMOKE else 4096  # W [D, D]: Llama-3.1-8B's and Qwen3-8B's O projection at 4096
FLUSH = (2 ** 16 if SMOKE else 96 * 2 ** 20) // 2  # bf16 elements of the flush
CHAIN = 2 ** 12 if SMOKE else 2 ** 22  # the permutation the chains walk (16 MiB of int32)
P, C = 32, (4 if SMOKE else 12)  # latency programs and each one's dependent loads (HBM: about 0.7 us each)
TILE_R, TILE_C = 8, (128 if SMOKE else 1024)  # a prefetch program's tile of W
ITERS, REPEATS = (2, 1) if SMOKE else (200, 5)
INTERPRET = SMOKE


def _prefetch(w_ref, out_ref, block: jax.Array, q: int, evict: bool):
    """Program `block` of q reads its D // q rows of W, a [TILE_R, TILE_C] tile at a time; the values feed a store
    that never happens (|sum| << 1e30), which the compiler cannot drop, so the loads stay."""
    rows = D // q
    acc = jnp.zeros((TILE_R, TILE_C), jnp.float32)
    for r in range(0, rows, TILE_R):
        for c in range(0, D, TILE_C):
            w = plgpu.load(w_ref.at[pl.ds(block * rows + r, TILE_R), pl.ds(c, TILE_C)],
                           eviction_policy="evict_last" if evict else None)
            acc = acc + w.astype(jnp.float32)
    s = jnp.sum(acc)
    plgpu.store(out_ref.at[pl.ds(P, 1)], jnp.full((1,), s), mask=jnp.full((1,), s == 1e30))


@functools.lru_cache(maxsize=None)
def _launch(q: int, evict: bool, chain: bool):
    """One launch: P chain programs (none with chain=False), then q prefetch programs of W (none with q=0)."""
    first = P if chain else 0

    def kernel(start_ref, nxt_ref, w_ref, out_ref):
        pid = pl.program_id(0)
        if chain:
            @pl.when(pid < P)
            def _chain():
                i0 = (start_ref[0] + pid * 7919) % CHAIN
                end = jax.lax.fori_loop(0, C, lambda _, i: nxt_ref[i], i0).astype(jnp.float32)
                plgpu.store(out_ref.at[pl.ds(pid, 1)], jnp.full((1,), end))
        if q:
            @pl.when(pid >= first)
            def _pf():
                _prefetch(w_ref, out_ref, pid - first, q, evict)

    return pl.pallas_call(kernel, grid=(first + q,), out_shape=jax.ShapeDtypeStruct((P + 1,), jnp.float32),
                          compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), interpret=INTERPRET)


def variant(name: str, q: int, evict: bool, B: int):
    """A jitted loop of ITERS iterations of `name` (module docstring); returns run(args) -> float."""
    steps = name.split(",") if name != "flush" else []

    @jax.jit
    def run(W, Z, nxt, x):
        def body(_, c):
            s = jnp.sum(Z.astype(jnp.float32) * c) * 1e-30 + c  # the flush (times the carry: not hoisted)
            start = (s * 0).astype(jnp.int32)[None] + 1
            t = s
            for step in steps:
                if step in ("chain", "chain+pf"):
                    out = _launch(q if step == "chain+pf" else 0, evict, True)(start, nxt, W)
                    t = t + jnp.sum(out[:P]) * 1e-30
                elif step == "pf":
                    out = _launch(q, evict, False)(start + (t * 0).astype(jnp.int32), nxt, W)
                    t = t + out[P] * 0
                elif step == "gemm":
                    y = (x * (t * 1e-30).astype(x.dtype)) @ W
                    t = t + y[0, 0].astype(jnp.float32) * 1e-30
            return t
        return jax.lax.fori_loop(0, ITERS, body, jnp.float32(0.0))
    return run


def timed(run, args) -> float:
    jax.block_until_ready(run(*args))
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        jax.block_until_ready(run(*args))
        best = min(best, (time.perf_counter() - t0) / ITERS * 1e6)
    return best


def check(args) -> dict:
    """The chains compute what they claim, prefetch programs beside them: each chain's end equals numpy's walk."""
    W, _, nxt, _ = args
    start = jnp.array([1], jnp.int32)
    got = np.asarray(_launch(256 if not SMOKE else 32, True, True)(start, nxt, W))[:P]
    perm = np.asarray(nxt)
    want = []
    for p in range(P):
        i = (1 + p * 7919) % CHAIN
        for _ in range(C):
            i = perm[i]
        want.append(float(i))
    return {"chains_equal_numpy": bool(np.array_equal(got, np.asarray(want, np.float32)))}


def main():
    k = jax.random.split(jax.random.key(0), 3)
    W = jax.random.normal(k[0], (D, D), jnp.bfloat16)
    Z = jax.random.normal(k[1], (FLUSH,), jnp.bfloat16)
    nxt = jnp.asarray(np.random.default_rng(0).permutation(CHAIN).astype(np.int32))
    rows, checks = [], None
    for B in (1, 4):
        x = jax.random.normal(k[2], (B, D), jnp.bfloat16)
        args = (W, Z, nxt, x)
        if checks is None:
            checks = check(args)
            if not checks["chains_equal_numpy"]:
                raise SystemExit(f"the chain launch disagrees with numpy: {checks}")
        base = timed(variant("flush", 0, True, B), args)
        cases = [("chain", 0, True), ("chain,gemm", 0, True)]
        for q in ((32,) if SMOKE else (128, 256, 512)):
            cases += [("chain+pf", q, True), ("chain+pf,gemm", q, True), ("chain,pf,gemm", q, True)]
        if not SMOKE:
            cases += [("chain+pf", 256, False), ("chain+pf,gemm", 256, False)]
        for name, q, evict in cases:
            us = timed(variant(name, q, evict, B), args)
            rows.append({"batch": B, "variant": name, "q": q, "evict_last": evict, "us": us, "flush_us": base,
                         "added_us": us - base})
            print(rows[-1], flush=True)
    out = dict(command="GIT_COMMIT=<sha> OUT=$OUT python3 eval/results/h100/l2_prefetch/probe.py",
               device=jax.devices()[0].device_kind, jax=jax.__version__, commit=os.environ.get("GIT_COMMIT"),
               date=datetime.now(timezone.utc).isoformat(), smoke=SMOKE, iters=ITERS, shapes=dict(
                   D=D, flush_bytes=2 * FLUSH, chain=CHAIN, P=P, C=C, tile=[TILE_R, TILE_C]), check=checks, rows=rows)
    with open(os.path.join(os.environ.get("OUT", "."), "l2_prefetch.json"), "w") as f:
        json.dump(out, f, indent=1)
    print("| batch | variant | Q | evict_last | us added to the flush |")
    for r in rows:
        print(f"| {r['batch']} | {r['variant']} | {r['q']} | {r['evict_last']} | {r['added_us']:.2f} |")


if __name__ == "__main__":
    main()

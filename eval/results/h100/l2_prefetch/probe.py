"""Can a launch of a decode step warm the next GEMM's weights in L2 for free? (issue 24's lead, `../l2_warm/NOTES.md`)

`../l2_warm/` found the ceiling: the O projection's GEMM (x [B, 4096] @ W [4096, 4096] bf16, 32 MiB) takes about 7
us instead of 14 when W was read just before it beside a sparse layer's K/V. Just before that GEMM a sparse decode
step runs launches that leave most of the HBM bandwidth idle: latency-bound ones (H2O's score update, 7.8 us a layer
at 100K, batch 4; EvoSparse's selections) and the gathered decode itself (EvoSparse: 17 MB in 19.5 us, a third of
the bandwidth). This probe asks whether extra programs appended to such a launch's grid, each reading its slice of W
(`eviction_policy="evict_last"`; the values feed a store that never happens, so the loads are kept), make the GEMM
after it faster without lengthening the launch by as much.

Two stand-ins for those launches, P programs each:
  chain:  a chain of C dependent scalar loads a program (pointer chasing through a random permutation of 16 MiB),
          about the length of a latency-bound launch;
  stream: a 16 MiB array read once (a sparse layer's K/V rows), P programs of 64 KB, with the default eviction or
          (streamF) `evict_first`, so that the stream does not push W out of L2.
Per iteration of a jitted fori_loop (each iteration depends on the one before): a 96 MiB XLA reduction (the flush:
what the layers between two uses of W read), then one of these, `+pf` appending Q prefetch programs to the launch,
`,pf` running them as a launch of their own, `,gemm` the GEMM after it:
  chain, chain+pf, chain,gemm, chain+pf,gemm, chain,pf,gemm; stream, stream+pf, stream,gemm, stream+pf,gemm,
  streamF+pf,gemm; and flush alone.
Each variant's time less the flush's is what it adds to a step: `X+pf,gemm` against `X,gemm` is the answer, `X+pf`
against `X` what the prefetch costs the launch. Q: 128, 256, 512 (about one to four programs an SM of an H100's
132; divisors of W's rows); chain+pf without evict_last at 256.

Usage (GPU): GIT_COMMIT=<sha> OUT=... python3 eval/results/h100/l2_prefetch/probe.py (about a minute)
  SMOKE=1 JAX_PLATFORMS=cpu: interpret mode, small shapes, a few iterations (the code paths; no timings).
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
P, C = 32, (4 if SMOKE else 12)  # chain programs and each one's dependent loads (HBM: about 0.7 us each)
TILE_R, TILE_C = 8, (128 if SMOKE else 1024)  # a [TILE_R, TILE_C] bf16 tile: 16 KB (2 KB in SMOKE)
STREAM_ROWS, STREAM_P = (64, 8) if SMOKE else (8192, 256)  # the stream [STREAM_ROWS, TILE_C] bf16 (16 MiB), P
ITERS, REPEATS = (2, 1) if SMOKE else (200, 5)
INTERPRET = SMOKE
SLOTS = max(P, STREAM_P) + 1  # the launches' output: one value per chain or stream program, then the sink


def _read_rows(ref, first: jax.Array, rows: int, cols: int, evict):
    """f32[] the sum of ref[first : first + rows, :cols], a [TILE_R, TILE_C] tile at a time (eviction `evict`)."""
    acc = jnp.zeros((TILE_R, TILE_C), jnp.float32)
    for r in range(0, rows, TILE_R):
        for c in range(0, cols, TILE_C):
            acc = acc + plgpu.load(ref.at[pl.ds(first + r, TILE_R), pl.ds(c, TILE_C)],
                                   eviction_policy=evict).astype(jnp.float32)
    return jnp.sum(jnp.sum(acc, axis=1), axis=0)  # by axis (a full sum failed to lower for CUDA)


@functools.lru_cache(maxsize=None)
def _launch(kind: str, q: int, evict_w: bool = True):
    """One launch: the programs of `kind` ("chain", "stream", "streamF" or "none"), then q prefetch programs of W
    (none with q=0). Output f32[SLOTS]: each chain's end or stream program's sum, the sink last (never written)."""
    first = {"chain": P, "stream": STREAM_P, "streamF": STREAM_P, "none": 0}[kind]

    def kernel(start_ref, nxt_ref, s_ref, w_ref, out_ref):
        pid = pl.program_id(0)
        if kind == "chain":
            @pl.when(pid < first)
            def _chain():
                i0 = (start_ref[0] + pid * 7919) % CHAIN
                end = jax.lax.fori_loop(0, C, lambda _, i: nxt_ref[i], i0).astype(jnp.float32)
                plgpu.store(out_ref.at[pl.ds(pid, 1)], jnp.full((1,), end))
        elif kind != "none":
            @pl.when(pid < first)
            def _stream():
                rows = STREAM_ROWS // STREAM_P
                total = _read_rows(s_ref, pid * rows, rows, TILE_C, "evict_first" if kind == "streamF" else None)
                plgpu.store(out_ref.at[pl.ds(pid, 1)], jnp.full((1,), total))
        if q:
            @pl.when(pid >= first)
            def _prefetch():
                rows = D // q
                s = _read_rows(w_ref, (pid - first) * rows, rows, D, "evict_last" if evict_w else None)
                # Never true for W's values (|sum| << 1e30): the loads feed a store the compiler cannot drop.
                plgpu.store(out_ref.at[pl.ds(SLOTS - 1, 1)], jnp.full((1,), s), mask=jnp.full((1,), s == 1e30))

    return pl.pallas_call(kernel, grid=(first + q,), out_shape=jax.ShapeDtypeStruct((SLOTS,), jnp.float32),
                          compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), interpret=INTERPRET)


def variant(name: str, q: int, evict_w: bool = True):
    """A jitted loop of ITERS iterations of `name` (module docstring): run(W, Z, S, nxt, x) -> f32[]."""
    steps = name.split(",") if name != "flush" else []

    @jax.jit
    def run(W, Z, S, nxt, x):
        def body(_, c):
            t = jnp.sum(Z.astype(jnp.float32) * c) * 1e-30 + c  # the flush (times the carry: not hoisted)
            for step in steps:
                if step == "gemm":
                    y = (x * (t * 1e-30).astype(x.dtype)) @ W
                    t = t + y[0, 0].astype(jnp.float32) * 1e-30
                    continue
                kind, pf = (step[:-3], q) if step.endswith("+pf") else ("none" if step == "pf" else step,
                                                                        q if step == "pf" else 0)
                start = (t * 0).astype(jnp.int32)[None] + 1  # after what came before
                out = _launch(kind, pf, evict_w)(start, nxt, S, W)
                t = t + jnp.sum(out[:SLOTS - 1]) * 1e-30 + out[SLOTS - 1] * 0
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
    """The launches compute what they claim, prefetch programs beside them: each chain's end equals numpy's walk,
    each stream program's sum numpy's sum of its rows."""
    W, _, S, nxt, _ = args
    start = jnp.array([1], jnp.int32)
    q = 32 if SMOKE else 256
    chains = np.asarray(_launch("chain", q)(start, nxt, S, W))[:P]
    perm = np.asarray(nxt)
    want = []
    for p in range(P):
        i = (1 + p * 7919) % CHAIN
        for _ in range(C):
            i = perm[i]
        want.append(i)
    sums = np.asarray(_launch("streamF", q)(start, nxt, S, W))[:STREAM_P]
    s = np.asarray(S, np.float32).reshape(STREAM_P, -1).sum(axis=1)
    return {"chains_equal_numpy": bool(np.array_equal(chains, np.asarray(want, np.float32))),
            "stream_sums_close": bool(np.allclose(sums, s, rtol=1e-4, atol=1e-2))}


def main():
    k = jax.random.split(jax.random.key(0), 4)
    W = jax.random.normal(k[0], (D, D), jnp.bfloat16)
    Z = jax.random.normal(k[1], (FLUSH,), jnp.bfloat16)
    S = jax.random.normal(k[2], (STREAM_ROWS, TILE_C), jnp.bfloat16)
    nxt = jnp.asarray(np.random.default_rng(0).permutation(CHAIN).astype(np.int32))
    checks = check((W, Z, S, nxt, None))
    if not all(checks.values()):
        raise SystemExit(f"a launch disagrees with numpy: {checks}")
    rows = []
    for B in (1, 4):
        args = (W, Z, S, nxt, jax.random.normal(k[3], (B, D), jnp.bfloat16))
        base = timed(variant("flush", 0), args)
        cases = [("chain", 0, True), ("chain,gemm", 0, True), ("stream", 0, True), ("stream,gemm", 0, True)]
        for q in ((32,) if SMOKE else (128, 256, 512)):
            cases += [(v, q, True) for v in ("chain+pf", "chain+pf,gemm", "chain,pf,gemm", "stream+pf",
                                             "stream+pf,gemm", "streamF+pf,gemm")]
        if not SMOKE:
            cases += [("chain+pf", 256, False), ("chain+pf,gemm", 256, False)]
        for name, q, evict_w in cases:
            us = timed(variant(name, q, evict_w), args)
            rows.append({"batch": B, "variant": name, "q": q, "evict_last": evict_w, "us": us, "flush_us": base,
                         "added_us": us - base})
            print(rows[-1], flush=True)
    out = dict(command="GIT_COMMIT=<sha> OUT=$OUT python3 eval/results/h100/l2_prefetch/probe.py",
               device=jax.devices()[0].device_kind, jax=jax.__version__, commit=os.environ.get("GIT_COMMIT"),
               date=datetime.now(timezone.utc).isoformat(), smoke=SMOKE, iters=ITERS,
               shapes=dict(D=D, flush_bytes=2 * FLUSH, chain=CHAIN, P=P, C=C, tile=[TILE_R, TILE_C],
                           stream=[STREAM_ROWS, TILE_C], stream_programs=STREAM_P), check=checks, rows=rows)
    with open(os.path.join(os.environ.get("OUT", "."), "l2_prefetch.json"), "w") as f:
        json.dump(out, f, indent=1)
    print("| batch | variant | Q | evict_last | us added to the flush |")
    for r in rows:
        print(f"| {r['batch']} | {r['variant']} | {r['q']} | {r['evict_last']} | {r['added_us']:.2f} |")


if __name__ == "__main__":
    main()

"""Can a second GPU stream warm the O projection's weights in L2 while a sparse layer's latency-bound gathered decode
runs? (`../l2_warm/`: read just before, the GEMM takes about 7 us instead of 14; the ceiling of issue 24's lead.)
JAX's `compute_on("gpu_stream:1")` with XLA's `--xla_gpu_experimental_stream_annotation=true` puts a computation on
its own stream; this probe asks whether that overlap happens inside a jitted layer loop and what it buys.

Per iteration of a `fori_loop` over 32 layers (each depending on the one before), Llama-3.1-8B shapes, bf16:
  base:   the library's gathered decode (`sparse_decode_stacked_gpu`: batch B, 8 KV heads, 32 query heads, 2048
          random ascending keys a row of a 100K cache, EvoSparse's budget) -> x [B, 4096] -> x @ Wo[layer];
  serial: base with a reduction over Wo[layer] (32 MiB) between the decode and the GEMM, on the main stream;
  stream: base with that reduction on stream 1 (`compute_on`), started with the decode (it reads only Wo[layer]
          and the loop's carry), the GEMM after both.
Wo is stacked [32, 4096, 4096] (1 GiB: no layer's weights are in L2 from the last iteration).

    OUT=... python3 eval/results/h100/l2_stream/probe.py      (GPU; sets the XLA flag itself)
    SMOKE=1 JAX_PLATFORMS=cpu python3 ...                      (the harness on a CPU, small shapes, no streams)
"""
import json
import os
import time
from datetime import datetime, timezone

SMOKE = bool(os.environ.get("SMOKE"))
if not SMOKE:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_experimental_stream_annotation=true").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.compute_on import compute_on  # noqa: E402

from pallas_kernels.sparse_attention.stacked import sparse_decode_stacked_gpu  # noqa: E402

L, HKV, HQ, D = (4, 2, 8, 64) if SMOKE else (32, 8, 32, 128)
E = HQ * D
N, K = (4096, 256) if SMOKE else (100_000, 2048)
ITERS, REPS = (2, 1) if SMOKE else (64, 5)


def setup(B):
    k = jax.random.split(jax.random.key(0), 6)
    kc = jax.random.normal(k[0], (1, B, HKV, N, D), jnp.bfloat16)
    vc = jax.random.normal(k[1], (1, B, HKV, N, D), jnp.bfloat16)
    q = jax.random.normal(k[2], (B, 1, HQ, D), jnp.bfloat16)
    idx = jnp.sort(jax.random.choice(k[3], N, (B * HKV, K), replace=True), axis=-1)
    idx = idx.reshape(B, HKV, 1, K).astype(jnp.int32)
    wo = jax.random.normal(k[4], (L, E, E), jnp.bfloat16) * 0.01
    return kc, vc, q, idx, wo


def prefetch(wo, layer, c):
    """A read of Wo[layer] (the slice inside: a sliced operand handed to the stream's call would be copied first)."""
    w = jax.lax.dynamic_index_in_dim(wo, layer, keepdims=False)
    return jnp.sum(w.astype(jnp.float32)) * c


def make(kind, B):
    lengths = jnp.full((B,), N, jnp.int32)
    on_stream = compute_on(compute_type="gpu_stream:1", out_memory_spaces=jax.memory.Space.Device)(prefetch) \
        if not SMOKE else prefetch

    @jax.jit
    def run(kc, vc, q, idx, wo):
        def body(i, c):
            layer = i % L
            w = jax.lax.dynamic_index_in_dim(wo, layer, keepdims=False)
            qq = q * (1 + c * 1e-30).astype(q.dtype)
            s = jnp.float32(0)
            if kind == "stream":
                s = on_stream(wo, layer, c * 1e-30)
            out = sparse_decode_stacked_gpu(qq, kc, vc, jnp.int32(0), idx, lengths, interpret=SMOKE)
            x = out.reshape(B, E)
            if kind == "serial":
                s = prefetch(wo, layer, c * 1e-30)
            x = x * (1 + s * 1e-30).astype(x.dtype)
            y = x @ w
            return c + y[0, 0].astype(jnp.float32) * 1e-30
        return jax.lax.fori_loop(0, ITERS, body, jnp.float32(0.0))
    return run


def timed(kind, B):
    args = setup(B)
    run = make(kind, B)
    run(*args).block_until_ready()
    best = float("inf")
    for _ in range(REPS):
        t = time.perf_counter()
        run(*args).block_until_ready()
        best = min(best, (time.perf_counter() - t) / ITERS * 1e6)
    hlo = run.lower(*args).compile().as_text()
    return best, hlo.count("_xla_stream_annotation"), "async-start" in hlo or "call-start" in hlo


rows = []
for B in (4, 1):
    for kind in ("base", "serial", "stream", "base"):
        us, annotated, is_async = timed(kind, B)
        rows.append(dict(batch=B, variant=kind, us_per_layer=us, stream_annotations=annotated, async_ops=is_async))
        print(f"b{B} {kind:7s} {us:8.2f} us a layer  (stream annotations in HLO: {annotated}, async: {is_async})",
              flush=True)
out = dict(command="OUT=$OUT python3 eval/results/h100/l2_stream/probe.py", device=jax.devices()[0].device_kind,
           jax=jax.__version__, commit=os.environ.get("GIT_COMMIT"), date=datetime.now(timezone.utc).isoformat(),
           xla_flags=os.environ.get("XLA_FLAGS"), iters=ITERS, rows=rows)
with open(os.path.join(os.environ.get("OUT", "."), "l2_stream.json"), "w") as f:
    json.dump(out, f, indent=1)

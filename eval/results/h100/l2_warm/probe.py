"""Would an L2-warm O projection pay? The ceiling of prefetching a layer's O-projection weights into L2 while its
latency-bound sparse attention runs (issue 24's lead; nothing in the library does it).

In a jitted fori_loop (each iteration depends on the one before, so nothing is hoisted), per iteration:
  warm:  one XLA reduction reads W (and, with +kv, a 17 MB stream beside it), then the GEMM x @ W;
  cold:  the same reduction over Y (another matrix of W's size) instead, then x @ W;
  read:  the reduction alone (no GEMM), over W.
warm - read and cold - read are the GEMM's time after W was just read, and after 32 MB of other data was.
Shapes: x [B, 4096] bf16, W [4096, 4096] bf16 (Llama-3.1-8B's and Qwen3-8B's O projection, 32 MiB).
Usage (GPU): OUT=... python3 probe.py
"""
import json
import os
import time
from datetime import datetime, timezone

import jax
import jax.numpy as jnp

D, ITERS = 4096, 400


def loop(kind, B, kv):
    k = jax.random.split(jax.random.key(0), 4)
    W = jax.random.normal(k[0], (D, D), jnp.bfloat16)
    Y = jax.random.normal(k[1], (D, D), jnp.bfloat16)
    Z = jax.random.normal(k[2], (17 * 2 ** 20 // 2,), jnp.bfloat16)  # a sparse layer's K/V rows, 17 MB
    x = jax.random.normal(k[3], (B, D), jnp.bfloat16)

    @jax.jit
    def run(W, Y, Z, x):
        def body(i, c):
            src = Y if kind == "cold" else W
            s = jnp.sum(src.astype(jnp.float32) * c)
            if kv:
                s = s + jnp.sum(Z.astype(jnp.float32) * c)
            if kind == "read":
                return c + s * 1e-30
            y = (x * (s * 1e-30).astype(x.dtype)) @ W
            return c + y[0, 0].astype(jnp.float32) * 1e-30
        return jax.lax.fori_loop(0, ITERS, body, jnp.float32(0.0))

    run(W, Y, Z, x).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        run(W, Y, Z, x).block_until_ready()
        best = min(best, (time.perf_counter() - t) / ITERS * 1e6)
    return best


rows = []
for B in (1, 4):
    for kv in (False, True):
        r = {k: loop(k, B, kv) for k in ("read", "warm", "cold")}
        r.update(batch=B, kv_stream=kv, gemm_after_warm_us=r["warm"] - r["read"],
                 gemm_after_cold_us=r["cold"] - r["read"])
        rows.append(r)
out = dict(command="OUT=$OUT python3 eval/results/h100/l2_warm/probe.py", device=jax.devices()[0].device_kind,
           jax=jax.__version__, commit=os.environ.get("GIT_COMMIT"), date=datetime.now(timezone.utc).isoformat(),
           iters=ITERS, rows=rows)
with open(os.path.join(os.environ.get("OUT", "."), "l2_warm.json"), "w") as f:
    json.dump(out, f, indent=1)
print("| batch | +kv 17MB | read us | warm us | cold us | GEMM after W read | GEMM after Y read |")
for r in rows:
    print(f"| {r['batch']} | {r['kv_stream']} | {r['read']:.2f} | {r['warm']:.2f} | {r['cold']:.2f} | "
          f"{r['gemm_after_warm_us']:.2f} | {r['gemm_after_cold_us']:.2f} |")

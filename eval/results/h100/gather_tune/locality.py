"""Does the gathered decode's read rate depend on where its keys lie? (H100, 100K, batch 4, Llama-3.1-8B heads)

The same kernel (`sparse_attention.stacked.sparse_decode_stacked_gpu`, Kascade's reuse layer, the library's config)
over 10,010 keys a row of a 100K cache, the keys laid out four ways: random and ascending (Kascade's, the oracle's
rows), runs of 16 and of 64 consecutive keys at random places, and one run of consecutive keys; beside the dense
split-K kernel (`dense_decode.gpu.dense_decode_stacked_gpu`) over the whole 100K. Each in a jitted loop of 32 calls (a
step's layers). GB/s counts the K/V rows read. Writes $OUT/locality.json.
"""
import json, os, sys

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench.common import device_facts, pipelined_ms
from pallas_kernels.dense_decode.gpu import dense_decode_stacked_gpu
from pallas_kernels.sparse_attention.stacked import sparse_decode_stacked_gpu

B, HQ, HKV, D, N, K, L, CTX = 4, 32, 8, 128, 100096, int(os.environ.get("KEYS", 10010)), 2, 100000
SMOKE = bool(os.environ.get("SMOKE"))
if SMOKE:
    B, HQ, HKV, D, N, K, CTX = 1, 4, 1, 16, 1024, 128, 1000


def layouts(rng):
    rows = B * HKV

    def runs(r):
        starts = np.stack([np.sort(rng.choice(CTX // r, -(-K // r), replace=False)) for _ in range(rows)]) * r
        return (starts[:, :, None] + np.arange(r)).reshape(rows, -1)[:, :K]
    return {"random": np.sort(np.stack([rng.choice(CTX, K, replace=False) for _ in range(rows)]), -1),
            "runs_of_16": runs(16), "runs_of_64": runs(64),
            "one_run": np.broadcast_to(np.arange(CTX - K, CTX), (rows, K))}


def loop(fn):
    @jax.jit
    def run(*a):
        def body(i, acc):
            return acc + fn(i % L, *a)[:, :, :1, :1].astype(jnp.float32)
        return jax.lax.fori_loop(0, 32, body, jnp.zeros((B, 1, 1, 1), jnp.float32))
    return run


def main():
    ks = jax.random.split(jax.random.key(0), 3)
    k_all = jax.random.normal(ks[0], (L, B, HKV, N, D), jnp.bfloat16)
    v_all = jax.random.normal(ks[1], (L, B, HKV, N, D), jnp.bfloat16)
    q = jax.random.normal(ks[2], (B, 1, HQ, D), jnp.bfloat16)
    lengths = jnp.full((B,), CTX, jnp.int32)
    hm = jnp.arange(HKV, dtype=jnp.int32)
    rows = []
    per_key = 2 * B * HKV * D * 2 * 32  # K and V bytes of one key position over the rows, 32 calls
    for name, idx in layouts(np.random.default_rng(0)).items():
        idx = jnp.asarray(np.ascontiguousarray(idx).reshape(B, HKV, 1, K), jnp.int32)
        run = loop(lambda layer, q, k, v, idx, n: sparse_decode_stacked_gpu(q, k, v, layer, idx, n, head_map=hm,
                                                                            interpret=SMOKE))
        t = pipelined_ms(run, (q, k_all, v_all, idx, lengths), n=10)
        rows.append({"kernel": "gathered", "keys": name, "ms_32_calls": t, "gb_s": per_key * K / t / 1e6})
        print(rows[-1], flush=True)
    run = loop(lambda layer, q, k, v, n: dense_decode_stacked_gpu(q, k, v, layer, n, interpret=SMOKE))
    t = pipelined_ms(run, (q, k_all, v_all, lengths), n=10)
    rows.append({"kernel": "dense", "keys": "all", "ms_32_calls": t, "gb_s": per_key * CTX / t / 1e6})
    print(rows[-1], flush=True)
    json.dump({**device_facts(), "commit": os.environ.get("GIT_COMMIT"), "command": "python " + " ".join(sys.argv),
               "shape": dict(B=B, Hq=HQ, Hkv=HKV, D=D, N=N, K=K, context=CTX), "rows": rows},
              open(os.path.join(os.environ.get("OUT", "/tmp"), os.environ.get("JSON", "locality.json")), "w"), indent=1)


if __name__ == "__main__":
    main()

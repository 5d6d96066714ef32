"""The gathered decode kernels' tuning at issue 24's weakest cell (100K, batch 4, Llama-3.1-8B heads), on one GPU.

Times, in a jitted loop of 32 calls (as the 32 layers of a step), Kascade's reuse-layer kernel
(`sparse_attention.stacked.sparse_decode_stacked_gpu` with the head map) and H2O's gathered decode with its score
update (`block_scores.gpu.sparse_decode_heat_gpu`), each over 10,010 keys a row (budget 0.1), for every
`DecodeConfig` of block_k 32/64/128, 4/8 warps, 3/4 stages and 512/1024 target programs. Kascade's rows are 10,010
random keys ascending; H2O's 5,005 random keys below a window of the 5,005 newest. Each config's output is checked
against the default config's first. Writes $OUT/gather_tune.json and prints the best configs last.
"""
import functools, itertools, json, os, sys, time

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench.common import device_facts, pipelined_ms
from pallas_kernels.block_scores.gpu import sparse_decode_heat_gpu
from pallas_kernels.sparse_attention.gpu import DecodeConfig
from pallas_kernels.sparse_attention.stacked import sparse_decode_stacked_gpu

B, HQ, HKV, D, N, K, L = 4, 32, 8, 128, 100096, 10010, 2
CTX = 100000
SMOKE = bool(os.environ.get("SMOKE"))
if SMOKE:
    B, HQ, HKV, D, N, K = 1, 4, 1, 16, 512, 64
    CTX = 500


def inputs():
    ks = jax.random.split(jax.random.key(0), 4)
    k_all = jax.random.normal(ks[0], (L, B, HKV, N, D), jnp.bfloat16)
    v_all = jax.random.normal(ks[1], (L, B, HKV, N, D), jnp.bfloat16)
    q = jax.random.normal(ks[2], (B, 1, HQ, D), jnp.bfloat16)
    rng = np.random.default_rng(0)
    kas = np.sort(np.stack([rng.choice(CTX, K, replace=False) for _ in range(B * HKV)]), -1).reshape(B, HKV, 1, K)
    w = K // 2
    heavy = np.sort(np.stack([rng.choice(CTX - w, K - w, replace=False) for _ in range(B * HKV)]), -1)
    h2o = np.concatenate([heavy, np.broadcast_to(np.arange(CTX - w, CTX), (B * HKV, w))], -1).reshape(B, HKV, 1, K)
    h2o = np.broadcast_to(h2o[None], (L,) + h2o.shape)
    lengths = jnp.full((B,), CTX, jnp.int32)
    heat = jnp.zeros((L, B, HKV, N), jnp.float32)
    return q, k_all, v_all, jnp.asarray(kas, jnp.int32), jnp.asarray(h2o, jnp.int32), lengths, heat


def kascade_loop(cfg):
    @jax.jit
    def run(q, k_all, v_all, idx, lengths):
        hm = jnp.arange(HKV, dtype=jnp.int32)
        def body(i, acc):
            o = sparse_decode_stacked_gpu(q, k_all, v_all, i % L, idx, lengths, head_map=hm, config=cfg,
                                          interpret=SMOKE)
            return acc + o[:, :, :1, :1].astype(jnp.float32)
        return jax.lax.fori_loop(0, 32, body, jnp.zeros((B, 1, 1, 1), jnp.float32))
    return run


def h2o_loop(cfg):
    @functools.partial(jax.jit, donate_argnums=(5,))
    def run(q, k_all, v_all, idx, lengths, heat):
        def body(i, c):
            acc, heat = c
            o, heat = sparse_decode_heat_gpu(q, k_all, v_all, i % L, idx, lengths, heat, config=cfg,
                                             interpret=SMOKE)
            return acc + o[:, :, :1, :1].astype(jnp.float32), heat
        return jax.lax.fori_loop(0, 32, body, (jnp.zeros((B, 1, 1, 1), jnp.float32), heat))
    return run


def main():
    q, k_all, v_all, kas, h2o, lengths, heat = inputs()
    rows = []
    ref = {}
    grid = [DecodeConfig()] if SMOKE else [
        DecodeConfig(block_k=bk, num_warps=w, num_stages=s, target_programs=tp)
        for bk, w, s, tp in itertools.product((32, 64, 128), (4, 8), (3, 4), (512, 1024))]
    for kernel in ("kascade", "h2o"):
        for cfg in [DecodeConfig(block_k=32 if kernel == "h2o" else 64)] + grid:
            try:
                if kernel == "kascade":
                    f = lambda: sparse_decode_stacked_gpu(q, k_all, v_all, 1, kas, lengths,  # noqa: E731
                                                          head_map=jnp.arange(HKV, dtype=jnp.int32), config=cfg,
                                                          interpret=SMOKE)
                    out = np.asarray(f(), np.float32)
                    run = kascade_loop(cfg)
                    t = pipelined_ms(run, (q, k_all, v_all, kas, lengths), n=10)
                else:
                    out, h = sparse_decode_heat_gpu(q, k_all, v_all, 1, h2o, lengths, jnp.zeros_like(heat),
                                                    config=cfg, interpret=SMOKE)
                    out = np.concatenate([np.asarray(out, np.float32).ravel(), np.asarray(h[1], np.float32).ravel()])
                    run = h2o_loop(cfg)
                    hs = [jnp.zeros_like(heat)]
                    def call(*a):
                        o, hs[0] = run(*a, hs[0])
                        return o
                    t = pipelined_ms(call, (q, k_all, v_all, h2o, lengths), n=10)
            except Exception as e:  # noqa: BLE001
                print("fail", kernel, cfg, repr(e)[:300], flush=True)
                continue
            if kernel not in ref:
                ref[kernel] = out
            err = float(np.max(np.abs(out - ref[kernel])) / (np.max(np.abs(ref[kernel])) + 1e-12))
            gb = 2 * B * HKV * K * D * 2 * 32 / 1e9
            rows.append({"kernel": kernel, "block_k": cfg.block_k, "num_warps": cfg.num_warps,
                         "num_stages": cfg.num_stages, "target_programs": cfg.target_programs,
                         "ms_32_layers": t, "kv_tb_s": gb / t, "rel_err_vs_first": err})
            print(rows[-1], flush=True)
            json.dump({**device_facts(), "commit": os.environ.get("GIT_COMMIT"),
                       "command": "python " + " ".join(sys.argv), "shape": dict(B=B, Hq=HQ, Hkv=HKV, D=D, N=N, K=K),
                       "rows": rows}, open(os.path.join(os.environ.get("OUT", "/tmp"), "gather_tune.json"), "w"),
                      indent=1)
    for kernel in ("kascade", "h2o"):
        rs = sorted([r for r in rows if r["kernel"] == kernel], key=lambda r: r["ms_32_layers"])
        print(kernel, "first (the library's):", [r for r in rows if r["kernel"] == kernel][:1])
        for r in rs[:4]:
            print(kernel, r)


if __name__ == "__main__":
    main()

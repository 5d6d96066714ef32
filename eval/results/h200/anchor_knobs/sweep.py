"""The anchor decode layer's scoring kernel (`anchor_attention.gpu.decode_scores_gpu`) under `AnchorConfig`
variants, on the GPU, at `jsparse bench model`'s 100K, batch 4 (Llama-3.1-8B: 32 / 8 heads, d 128, bf16, a stacked
cache of 2 layers read in place at layer 1): device us per call of the scores alone and of the whole anchor op
(`anchor_decode_gpu`: scores, pooling, top-k, gathered attention), without and with the dense output (layer 0).
Each variant's pooled scores are compared with the default's (max abs difference) and its selection with the
default's (rows equal). Writes $OUT/anchor_knobs.json and prints a table.

    OUT=... PYTHONPATH=. python3 eval/results/h200/anchor_knobs/sweep.py
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench.common import device_facts
from eval.bench.profile_ops import profile
from pallas_kernels.anchor_attention import gpu as agpu

B, HQ, HKV, D, N, L = 4, 32, 8, 128, 100096, 2
K = 10010
C = agpu.AnchorConfig
VARIANTS = {
    "default": C(),
    "bn64": C(block_n=64), "bn256": C(block_n=256),
    "w8": C(num_warps=8), "bn256_w8": C(block_n=256, num_warps=8),
    "s2": C(num_stages=2), "s4": C(num_stages=4), "s5": C(num_stages=5),
    "tp512": C(target_programs=512), "tp2048": C(target_programs=2048), "tp4096": C(target_programs=4096),
    "bn64_s4": C(block_n=64, num_stages=4), "bn256_w8_s4": C(block_n=256, num_warps=8, num_stages=4),
    "tp2048_s4": C(target_programs=2048, num_stages=4),
    "pool_triton": C(pool="triton"), "pool_triton_b4096_w8": C(pool="triton", pool_block=4096, pool_warps=8),
}


def timed(name, fn, args):
    """`profile`, or the error of a config the GPU cannot run (e.g. its pipeline past shared memory)."""
    try:
        return profile(name, fn, args, 10)
    except Exception as e:  # noqa: BLE001 - recorded in the JSON, the sweep goes on
        return {"error": f"{type(e).__name__}: {str(e)[:200]}", "device_us": float("nan")}


def main():
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (B, 1, HQ, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], (L, B, HKV, N, D), jnp.bfloat16)
    v = jax.random.normal(ks[2], (L, B, HKV, N, D), jnp.bfloat16)
    lengths = jnp.array([100000, 99990, 100000, 77777], jnp.int32)
    lay = jnp.int32(1)
    res = {**device_facts(), "shape": dict(B=B, Hq=HQ, Hkv=HKV, D=D, N=N, K=K), "variants": {}}
    ref_scores = ref_idx = None
    for name, cfg in VARIANTS.items():
        scores = jax.jit(lambda q, k, v, l, cfg=cfg: agpu.decode_scores_gpu(q, k, v, l, layer=lay, config=cfg)[0])
        op = jax.jit(lambda q, k, v, l, cfg=cfg: agpu.anchor_decode_gpu(q, k, v, l, budget=0.1, K=K, layer=lay,
                                                                        config=cfg))
        dense = jax.jit(lambda q, k, v, l, cfg=cfg: agpu.anchor_decode_gpu(q, k, v, l, budget=0.1, K=K, layer=lay,
                                                                           dense_output=True, config=cfg))
        try:
            s = scores(q, k, v, lengths)
            idx = op(q, k, v, lengths)[1]
        except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
            res["variants"][name] = {"config": str(cfg), "error": f"{type(e).__name__}: {str(e)[:200]}"}
            continue
        if ref_scores is None:
            ref_scores, ref_idx = s, idx
        fin = jnp.isfinite(ref_scores)
        row = {"config": str(cfg),
               "scores_max_abs_vs_default": float(jnp.max(jnp.where(fin, jnp.abs(s - ref_scores), 0.0))),
               "same_infinities": bool(jnp.array_equal(jnp.isfinite(s), fin)),
               "rows_equal_selection": float(jnp.mean(jnp.all(idx == ref_idx, axis=-1))),
               "scores": timed(f"scores_{name}", scores, (q, k, v, lengths)),
               "anchor": timed(f"anchor_{name}", op, (q, k, v, lengths)),
               "anchor_dense": timed(f"dense_{name}", dense, (q, k, v, lengths))}
        res["variants"][name] = row
    with open(os.path.join(os.environ.get("OUT", "."), "anchor_knobs.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    print("\nvariant               scores  anchor  dense-anchor   (device us per call)  scores diff  rows equal")
    for name, r in res["variants"].items():
        if "error" in r:
            print(f"{name:20} {r['error'][:90]}")
            continue
        print(f"{name:20} {r['scores']['device_us']:7.1f} {r['anchor']['device_us']:7.1f} "
              f"{r['anchor_dense']['device_us']:9.1f}   {r['scores_max_abs_vs_default']:.1e} {r['same_infinities']} "
              f"{r['rows_equal_selection']:.3f}")


if __name__ == "__main__":
    main()

"""The gathered decode with the heat update (`block_scores.sparse_decode_heat_gpu`, its finish kernel one program
per (row, KV head, split)) against the path it replaces in H2O (`sparse_decode_mass_gpu` + the XLA scatter
`xla.heat_add`) and against the jnp reference, on the GPU, at the shapes of `jsparse bench model` at 100K, batch 4
(Llama-3.1-8B: 32 query / 8 KV heads, d 128, bf16; 2 cache layers, every layer's index rows read in place):

  h2o        blocks of 1 token, 10010 keys a row (H2O's budget 0.1);
  evosparse  blocks of 16 tokens, 128 blocks a row (EvoSparse's 2048 tokens).

Checks out and heat (allclose; the reference in f32 on a 4K slice of the same rows), then times both paths from a
profiler trace (device us per call). Writes $OUT/check_heat.json.

    OUT=... PYTHONPATH=. python3 eval/results/h200/h2o_heat/check_heat.py
    SMOKE=1 ...   (CPU: the kernels in interpret mode at 1/16 of the length, no timing)
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench.common import device_facts
from eval.bench.profile_ops import profile
from pallas_kernels.block_scores import gpu, reference, xla

B, HQ, HKV, D, L = 4, 32, 8, 128, 2
SMOKE = bool(os.environ.get("SMOKE"))


def rows(key, n_blocks: int, K: int) -> jnp.ndarray:
    """i32[L, B, Hkv, 1, K]: K distinct blocks of n_blocks ascending per row, the last 3 entries -1."""
    r = jax.random.uniform(key, (L, B, HKV, 1, n_blocks)).argsort(-1)[..., :K].astype(jnp.int32)
    r = jnp.sort(r, axis=-1)
    return jnp.where(jnp.arange(K) < K - 3, r, -1)


def case(name, N, bs, K, small_n):
    ks = jax.random.split(jax.random.key(len(name)), 5)
    q = jax.random.normal(ks[0], (B, 1, HQ, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], (L, B, HKV, N, D), jnp.bfloat16)
    v = jax.random.normal(ks[2], (L, B, HKV, N, D), jnp.bfloat16)
    idx = rows(ks[3], N // bs, K)
    heat = jax.random.uniform(ks[4], (L, B, HKV, N // bs))
    lengths = jnp.array([N, N - 5, N // 2, 0], jnp.int32)  # a short row and an empty one
    layer, hl = jnp.int32(1), jnp.int32(0)

    new = jax.jit(lambda q, k, v, i, l, h: gpu.sparse_decode_heat_gpu(q, k, v, layer, i, l, h, hl, block_size=bs,
                                                                               interpret=SMOKE))

    def old_fn(q, k, v, i, l, h):
        out, mass = gpu.sparse_decode_mass_gpu(q, k, v, layer, i, l, block_size=bs, interpret=SMOKE)
        return out, xla.heat_add(h, hl, i[1, :, :, 0], mass[:, :, 0])

    old = jax.jit(old_fn)
    args = (q, k, v, idx, lengths, heat)
    o_new, h_new = new(*args)
    o_old, h_old = old(*args)
    res = {"N": N, "block_size": bs, "K": K,
           "out_max_abs_new_vs_old": float(jnp.abs(o_new.astype(jnp.float32) - o_old.astype(jnp.float32)).max()),
           "heat_max_abs_new_vs_old": float(jnp.abs(h_new - h_old).max()),
           "heat_moved": float(jnp.abs(h_new - heat).max())}
    # The reference (f32, one-hot heat update) on the first small_n keys of the cache: rows cut to them.
    sk, sv = k[:, :, :, :small_n].astype(jnp.float32), v[:, :, :, :small_n].astype(jnp.float32)
    si = jnp.where(idx < small_n // bs, idx, -1)
    si = jnp.sort(jnp.where(si < 0, jnp.iinfo(jnp.int32).max, si), axis=-1)
    si = jnp.where(si == jnp.iinfo(jnp.int32).max, -1, si)
    sl = jnp.minimum(lengths, small_n)
    sh = heat[..., : small_n // bs]
    want_o, want_h = reference.sparse_decode_heat_reference(q.astype(jnp.float32), sk, sv, layer, si[1], sl, sh, hl,
                                                            block_size=bs)
    got_o, got_h = gpu.sparse_decode_heat_gpu(q.astype(jnp.float32), sk, sv, layer, si, sl, sh, hl, block_size=bs,
                                              interpret=SMOKE)
    res["ref_out_max_abs"] = float(jnp.abs(got_o - want_o).max())
    res["ref_heat_max_abs"] = float(jnp.abs(got_h - want_h).max())
    res["ok"] = bool(res["out_max_abs_new_vs_old"] <= 2e-2 and res["heat_max_abs_new_vs_old"] <= 1e-5
                     and res["ref_out_max_abs"] <= 1e-3 and res["ref_heat_max_abs"] <= 1e-5 and res["heat_moved"] > 0)
    if not SMOKE:
        res["new"] = profile(f"{name}_new", new, args, 10)
        res["old"] = profile(f"{name}_old", old, args, 10)
    return res


def main():
    out = {**device_facts(), "cases": {}}
    n = 100096 // 16 if SMOKE else 100096
    out["cases"]["h2o"] = case("h2o", n, 1, -(-n // 10), 4096 // 16 if SMOKE else 4096)
    out["cases"]["evosparse"] = case("evosparse", n, 16, 128 // 16 if SMOKE else 128, 4096 // 16 if SMOKE else 4096)
    with open(os.path.join(os.environ.get("OUT", "."), "check_heat.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    for name, r in out["cases"].items():
        t = "" if SMOKE else f" new {r['new']['device_us']:.1f} us, old {r['old']['device_us']:.1f} us;"
        print(f"{name}: ok={r['ok']}{t} "
              f"out new-old {r['out_max_abs_new_vs_old']:.2e}, heat new-old {r['heat_max_abs_new_vs_old']:.2e}, "
              f"ref out {r['ref_out_max_abs']:.2e}, ref heat {r['ref_heat_max_abs']:.2e}")


if __name__ == "__main__":
    main()

"""Diagnostic (H100): what do the exps cost in the Mosaic GPU lse and pooling passes?

    GIT_COMMIT=... PYTHONPATH=. python eval/gpu_anchor_exp_diag.py     (writes $OUT/exp_diag.json)

Times both passes at 128K (Llama-3.1-8B heads, B 1) with the row sums of exp2 (`mgpu_prefill._rowsum_exp2`)
replaced by: the default (MUFU ex2), no exp at all (the logits themselves: wrong results, the time without exps),
exp2 on the FMA/ALU pipes (round by the 1.5 * 2^23 trick, degree-5 polynomial, ~3e-6 relative error), and a split
of each step's columns between the two (FlashAttention-4's idea). Errors against the default at T 4096 first.
"""
import json
import os

import jax
import jax.numpy as jnp
from jax import lax

from eval.bench.attention import rel_err
from eval.bench.common import device_facts, time_ms
from pallas_kernels.anchor_attention import mgpu_prefill as mg


def exp2_fma(x):
    """2^x for x <= 0 on the FMA/ALU pipes: round-to-nearest by the 1.5*2^23 trick, degree-5 polynomial."""
    x = jnp.maximum(x, -126.0)
    t = x + 12582912.0
    f = x - (t - 12582912.0)
    p = 1.0 + f * (0.6931472 + f * (0.2402265 + f * (0.05550411 + f * (0.009618129 + f * 0.001333355))))
    bits = lax.bitcast_convert_type(p, jnp.int32) + lax.shift_left(lax.bitcast_convert_type(t, jnp.int32), 23)
    return lax.bitcast_convert_type(bits, jnp.float32)


def split(k):
    """Row sums of exp2: the first k columns on the FMA units, the rest by MUFU."""
    return lambda x: exp2_fma(x[:, :k]).sum(axis=1) + jnp.exp2(x[:, k:]).sum(axis=1)


VARIANTS = (("mufu", lambda x: jnp.exp2(x).sum(axis=1)), ("identity", lambda x: x.sum(axis=1)),
            ("fma_all", lambda x: exp2_fma(x).sum(axis=1)), ("split32", split(32)), ("split16", split(16)),
            ("split48", split(48)))


def main() -> None:
    T, Hq, Hkv, D = 131072, 32, 8, 128
    kq, kk = jax.random.split(jax.random.key(1))
    q = jax.random.normal(kq, (1, T, Hq, D), jnp.bfloat16)
    k = jax.random.normal(kk, (1, T, Hkv, D), jnp.bfloat16)
    res = dict(device_facts(), records=[])
    small_q, small_k = q[:, :4096], k[:, :4096]
    want_l = mg.prefill_lse_mgpu(small_q, small_k)
    want_p = mg.tile_scores_mgpu(small_q, small_k, want_l)
    lse = None
    for name, fn in VARIANTS:
        mg._rowsum_exp2 = fn
        jax.clear_caches()  # the kernels are traced again with the swapped function
        r = dict(exp=name)
        try:
            lse_f = jax.jit(lambda q, k: mg.prefill_lse_mgpu(q, k))
            pool_f = jax.jit(lambda q, k, l: mg.tile_scores_mgpu(q, k, l))
            r["lse_err"] = float(jnp.max(jnp.abs(lse_f(small_q, small_k) - want_l)))
            r["pool_rel_err"] = rel_err(pool_f(small_q, small_k, want_l), want_p)
            if lse is None:  # the default's lse, for every variant's pooling
                lse = lse_f(q, k)
            r["lse_ms"] = time_ms(lse_f, q, k, iters=5)
            r["pool_ms"] = time_ms(pool_f, q, k, lse, iters=5)
        except Exception as e:  # noqa: BLE001 - recorded
            r["error"] = repr(e)[:400]
        print(r, flush=True)
        res["records"].append(r)
    with open(os.path.join(os.environ.get("OUT", "."), "exp_diag.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

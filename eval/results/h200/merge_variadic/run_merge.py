"""The gathered and dense decodes' split merge as one variadic reduce ("variadic", `combine_variadic` below, put in
place of `pallas_kernels.sparse_attention.gpu.combine_splits`) against the library's merge ("xla3": the weights, the
denominator and the weighted sum, three XLA fusions): H200 experiment for issue 24, not adopted (NOTES.md).

1. Check: `sparse_decode_stacked_gpu` and `dense_decode_stacked_gpu` at Llama-3.1-8B decode heads (100K cache,
   10% gathered, batch 4) with both merges on the same random inputs, and against the f32 reference.
2. Launches: the compiled StreamingLLM decode step's fusions and custom calls with each merge.
3. Timing: `method_rows` (the `jsparse bench model` rows) of METHODS at 100K, batch 4, budget 0.1, in ROUNDS
   (default "variadic,xla3,variadic,xla3"), each after `jax.clear_caches()`.
Writes $OUT/merge_variadic.json and prints a table.  Usage (GPU): OUT=... python eval/results/h200/merge_variadic/run_merge.py
"""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench import common as bm
from eval.bench import model as bmod
from eval.results.h200.unroll.unroll import timed_rounds
from models.cache import KVCache
from pallas_kernels.dense_decode.gpu import dense_decode_stacked_gpu
from pallas_kernels.sparse_attention import gpu as sparse_gpu
from pallas_kernels.sparse_attention.reference import sparse_decode_reference
from pallas_kernels.sparse_attention.stacked import sparse_decode_stacked_gpu

XLA3 = sparse_gpu.combine_splits


def _merge_pair(a, b):
    """Two (m, l, o) online-softmax partials as one: the combiner of the variadic reduce."""
    (m1, l1, o1), (m2, l2, o2) = a, b
    m = jnp.maximum(m1, m2)
    w1, w2 = jnp.exp(m1 - m), jnp.exp(m2 - m)  # m is finite (_MASK, not -inf, marks an empty split)
    return m, w1 * l1 + w2 * l2, w1 * o1 + w2 * o2


def combine_variadic(o, m, l):
    """`combine_splits` as one variadic reduce over S (m and l broadcast along D)."""
    mb, lb = (jnp.broadcast_to(a[..., None], o.shape) for a in (m, l))
    init = (jnp.float32(sparse_gpu._MASK), jnp.float32(0), jnp.float32(0))
    m_all, l_all, o_all = jax.lax.reduce((mb, lb, o), init, _merge_pair, (0,))
    nonempty = l_all > 0
    l_safe = jnp.where(nonempty, l_all, 1.0)
    out = jnp.where(nonempty, o_all / l_safe, 0.0)
    lse = jnp.where(nonempty[..., 0], m_all[..., 0] + jnp.log(l_safe[..., 0]), -jnp.inf)
    return out, lse


def use(merge):
    sparse_gpu.combine_splits = combine_variadic if merge == "variadic" else XLA3
    jax.clear_caches()


def check():
    B, Hq, Hkv, D, N, K, L = 4, 32, 8, 128, 100096, 10010, 2
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (B, 1, Hq, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], (L, B, Hkv, N, D), jnp.bfloat16)
    v = jax.random.normal(ks[2], (L, B, Hkv, N, D), jnp.bfloat16)
    lengths = jnp.array([100000, 99000, 60000, 2000], jnp.int32)
    idx = jnp.sort(jax.random.randint(ks[3], (B, Hkv, 1, K), 0, 100000), axis=-1)
    idx = jnp.where(idx < lengths[:, None, None, None], idx, -1)
    out = {}
    for merge in ("xla3", "variadic"):
        use(merge)
        s = sparse_decode_stacked_gpu(q, k, v, jnp.int32(1), idx, lengths)
        d = dense_decode_stacked_gpu(q, k, v, jnp.int32(1), lengths)
        out[merge] = (np.asarray(s, np.float32), np.asarray(d, np.float32))
    ref = np.asarray(sparse_decode_reference(q.astype(jnp.float32), k[1].astype(jnp.float32),
                                             v[1].astype(jnp.float32), idx, lengths), np.float32)
    res = dict(sparse_vs_xla3=float(np.abs(out["variadic"][0] - out["xla3"][0]).max()),
               dense_vs_xla3=float(np.abs(out["variadic"][1] - out["xla3"][1]).max()),
               sparse_vs_f32_reference=float(np.abs(out["variadic"][0] - ref).max()),
               xla3_sparse_vs_f32_reference=float(np.abs(out["xla3"][0] - ref).max()))
    res["passed"] = res["sparse_vs_xla3"] <= 0.0079 and res["dense_vs_xla3"] <= 0.0079 and \
        res["sparse_vs_f32_reference"] <= 0.02
    print("check", res, flush=True)
    return res


def launches(cfg, params, name):
    method, _ = bmod.bench_method(name, cfg, 0.1)
    B, cap = 4, 100352
    sds = jax.ShapeDtypeStruct
    cache = KVCache(k=sds((cfg.num_layers, B, cfg.num_kv_heads, cap, cfg.head_dim), jnp.bfloat16),
                    v=sds((cfg.num_layers, B, cfg.num_kv_heads, cap, cfg.head_dim), jnp.bfloat16),
                    lengths=sds((B,), jnp.int32))
    state = jax.eval_shape(lambda: method.init_state(cfg, B, cap))
    text = bmod.method_decode_steps.lower(params, method, sds((B, 1), jnp.int32), cache, state, cfg=cfg,
                                          steps=2).compile().as_text()
    return dict(fusions=len(re.findall(r"= \S+ fusion\(", text)), custom_calls=len(re.findall(r"custom-call\(", text)))


def main():
    out = os.environ.get("OUT", "/tmp")
    methods = tuple(os.environ.get("METHODS", "dense,streaming,kascade").split(","))
    rounds = os.environ.get("ROUNDS", "variadic,xla3,variadic,xla3").split(",")
    res = dict(bm.device_facts(), command="OUT=... python eval/results/h200/merge_variadic/run_merge.py",
               methods=methods, context=100000, batch=4, budget=0.1)
    res["check"] = check()
    cfg = bmod.preset("llama3-8b")
    hbm = bm.measure_hbm_gbs()
    params = bmod.bench_params(cfg, "default")
    res["launches"] = {}
    for merge in ("xla3", "variadic"):
        use(merge)
        res["launches"][merge] = launches(cfg, params, "streaming")
    print("launches (streaming step HLO)", res["launches"], flush=True)
    timed_rounds(res, "merge", rounds, use, cfg, params, hbm, methods, os.path.join(out, "merge_variadic.json"))


if __name__ == "__main__":
    main()

"""EvoSparse's one-launch finish (`EvoSparse.finish_in_launch`, `block_scores.gpu.sparse_decode_heat_gpu` with
tickets) against the two launches (the gathered decode, then `evosparse_finish_heat`), on a GPU (NOTES.md):

1. check: Llama-3.1-8B decode shapes (Hkv 8, G 4, D 128, blocks of 16, 128 entries = 2048 tokens a row) at 100K,
   batch 4 and 1, random bf16 cache, heat and index rows drawn afresh in each of REPEATS rounds; the one-launch
   result (output and heat) against the two launches', the tickets handed back as zeros, and the output
   in the GEMMs' 8 padded rows (`rows_out`): the same rows, then zeros. The last program of
   each row reads the other splits' partials through an acquire-release ticket: a missed write shows up here.
2. time: `method_rows` (the rows of `jsparse bench model`, 16 timed steps) of dense and EvoSparse with
   finish_in_launch true and false, alternating, each traced afresh (CASES shape:batch:context).

    PYTHONPATH=. python eval/results/h100/evo_finish/probe.py     # writes $OUT/probe_<shape>.json
    SMOKE=1 JAX_PLATFORMS=cpu PYTHONPATH=. python eval/results/h100/evo_finish/probe.py   # the check, interpreted
"""

import json
import os
import time
from datetime import datetime, timezone

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.block_scores import gpu
from pallas_kernels.sparse_attention.gpu import DecodeConfig


def check(B, N=100096, L=2, Hkv=8, G=4, D=128, bs=16, K=128, repeats=5, interpret=False):
    key = jax.random.key(B)
    kk, kv, kq = jax.random.split(key, 3)
    k_all = jax.random.normal(kk, (L, B, Hkv, N, D), jnp.bfloat16)
    v_all = jax.random.normal(kv, (L, B, Hkv, N, D), jnp.bfloat16)
    nb = N // bs
    worst, rounds = {"out": 0.0, "heat": 0.0}, 0
    for r in range(repeats):
        kr = jax.random.fold_in(kq, r)
        q = jax.random.normal(kr, (B, 1, Hkv * G, D), jnp.bfloat16)
        lengths = jnp.asarray(np.random.default_rng(r).integers(N // 2, N, B), jnp.int32)
        rng = np.random.default_rng(100 + r)
        rows = np.full((B, Hkv, 1, K), -1, np.int32)
        for b in range(B):
            vis = int(lengths[b] - 1) // bs + 1
            for h in range(Hkv):
                used = rng.integers(K // 2, K + 1)
                rows[b, h, 0, :used] = np.sort(rng.choice(vis, used, replace=False))
        heat = jax.random.uniform(jax.random.fold_in(kr, 1), (L, B, Hkv, nb))
        args = (q, k_all, v_all, jnp.int32(1), jnp.asarray(rows), lengths, heat)
        o2, h2 = jax.jit(lambda *a: gpu.sparse_decode_heat_gpu(*a, block_size=bs, config=DecodeConfig(),
                                                              interpret=interpret))(*args)
        o1, h1, t1 = jax.jit(lambda *a: gpu.sparse_decode_heat_gpu(
            *a, block_size=bs, config=DecodeConfig(), tickets=jnp.zeros((B, Hkv, 1), jnp.int32),
            interpret=interpret))(*args)
        o3 = jax.jit(lambda *a: gpu.sparse_decode_heat_gpu(  # in the GEMMs' 8 padded rows
            *a, block_size=bs, config=DecodeConfig(), tickets=jnp.zeros((B, Hkv, 1), jnp.int32), rows_out=8,
            interpret=interpret))(*args)[0]
        assert not np.asarray(o3[0, B:]).any() and np.isfinite(np.asarray(o3, np.float32)).all()
        np.testing.assert_array_equal(np.asarray(o3[0, :B], np.float32), np.asarray(o1[:, 0], np.float32))
        worst["out"] = max(worst["out"], float(jnp.max(jnp.abs(o1.astype(jnp.float32) - o2.astype(jnp.float32)))))
        worst["heat"] = max(worst["heat"], float(jnp.max(jnp.abs(h1 - h2))))
        assert not np.asarray(t1).any(), "tickets not handed back as zeros"
        rounds += 1
    ok = worst["out"] <= 1e-2 and worst["heat"] <= 1e-5
    return dict(batch=B, context=N, rounds=rounds, max_abs_diff=worst, passed=bool(ok))


def main(out_dir):
    from eval.bench import common as bm
    from eval.bench.model import method_rows
    from models.params import random_params, with_layout
    from models.presets import preset
    shape = os.environ.get("SHAPE", "llama3-8b")
    checks = [check(b) for b in (4, 1)] if os.environ.get("CHECK", "1") == "1" else []
    for c in checks:
        print("check", c, flush=True)
    cfg = preset(shape)
    hbm = bm.measure_hbm_gbs()
    params = with_layout(random_params(cfg, jax.random.key(0), jnp.bfloat16), "default", donate=True)
    rows = []
    for case in os.environ.get("CASES", "4:100000").split():
        b, n = (int(x) for x in case.split(":"))
        for rep, flag in enumerate(os.environ.get("ORDER", "1 0 1 0").split()):
            for m in ("dense", "evosparse") if rep in (0, 3) else ("evosparse",):
                jax.clear_caches()
                opts = {"evosparse": {"finish_in_launch": flag == "1"}}
                row = method_rows(cfg, params, (m,), (n,), (b,), 16, hbm, 0.1, method_options=opts)[0]
                row.update(finish_in_launch=flag == "1", rep=rep)
                rows.append(row)
                print(f"{shape} {n} b{b} rep {rep} {m} finish_in_launch={flag}: {row.get('step_ms', float('nan')):.3f}"
                      " ms", flush=True)
    out = {**bm.device_facts(), "date": datetime.now(timezone.utc).isoformat(),
           "commit": os.environ.get("GIT_COMMIT", ""), "shape": shape,
           "command": f"SHAPE={shape} PYTHONPATH=. python eval/results/h100/evo_finish/probe.py",
           "measured_hbm_gbs": hbm, "checks": checks, "rows": rows}
    with open(os.path.join(out_dir, f"probe_{shape}.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    t0 = time.time()
    if os.environ.get("SMOKE"):  # CPU: the check's code in interpret mode on a small cache
        print(check(2, N=2048, K=16, repeats=1, interpret=True))
    else:
        main(os.environ.get("OUT", "."))
    print(f"done in {time.time() - t0:.0f} s")

"""The top-k's sample size (`SelectConfig.sample_size`) on the rows Kascade's anchors and the oracle select from at
100K, batch 4 (the "sample" path) and on H2O's every-layer rows (the "ordered" path), on the GPU: device us per
call from a profiler trace, each variant checked equal to `topk_select_reference`. Rows:

  anchor    the pooled scores of an anchor layer on random bf16 q and K (`anchor_attention.gpu.decode_scores_gpu`,
            32 rows of 100096, -inf past each row's length), k 10010;
  pooled    32 synthetic pooled-like rows (exp(2 N(0,1)) / N), k 10010;
  ties      32 Kascade-like rows of heavy ties (`testing.kascade_like_rows`);
  h2o       1024 pooled-like rows of 100096, k 5005 ("ordered");
with ROUND=2 instead, pooled-like rows at other shapes: 32 rows of 32768 (k 3277) and of 131072 (k 13108), 8 rows
of 100096 (batch 1, k 10010), 24 rows of 100096 (Qwen3-8B's 8 KV heads at batch 3); with ROUND=3, many rows
of 100096 at k 10010 on the "sample" path: 256, and 3840 (TokenButler's every layer and head at once).

Writes $OUT/topk_sample.json (round 1) or $OUT/topk_sample_roundN.json and prints a table.

    OUT=... PYTHONPATH=. python3 eval/results/h200/topk_sample/sweep.py
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
from pallas_kernels.topk_select import gpu, topk_select_reference
from pallas_kernels.topk_select.testing import kascade_like_rows

N, K = 100096, 10010
SIZES = (2048, 4096, 8192, 16384)


def pooled(key, R, n):
    return jnp.exp(2.0 * jax.random.normal(key, (R, n))) / n


def rows2():
    ks = jax.random.split(jax.random.key(1), 4)
    for name, key, R, n, kw in (("32k", ks[0], 32, 32768, 3277), ("128k", ks[1], 32, 131072, 13108),
                                ("b1", ks[2], 8, N, K), ("b3", ks[3], 24, N, K)):
        yield name, pooled(key, R, n), jnp.full((R,), kw, jnp.int32), kw


def rows3():
    ks = jax.random.split(jax.random.key(2), 2)
    for name, key, R in (("r256", ks[0], 256), ("butler", ks[1], 3840)):
        yield name, pooled(key, R, N), jnp.full((R,), K, jnp.int32), K


def rows():
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (4, 1, 32, 128), jnp.bfloat16)
    kc = jax.random.normal(ks[1], (4, 8, N, 128), jnp.bfloat16)
    lengths = jnp.array([100000, 99990, 100000, 77777], jnp.int32)
    scores = agpu.decode_scores_gpu(q, kc, kc, lengths)[0].reshape(32, N)
    del kc
    yield "anchor", scores, jnp.full((32,), K, jnp.int32), K
    yield "pooled", pooled(ks[2], 32, N), jnp.full((32,), K, jnp.int32), K
    x, k = kascade_like_rows(np.random.default_rng(0), 32, 100000, N)
    yield "ties", jnp.asarray(x), jnp.asarray(k), K
    yield "h2o", pooled(ks[2], 1024, N), jnp.full((1024,), 5005, jnp.int32), 5005


def main():
    rnd = os.environ.get("ROUND", "1")
    res = {**device_facts(), "cases": {}}
    select = gpu.topk_select_gpu.__wrapped__
    for name, x, k, kw in {"1": rows, "2": rows2, "3": rows3}[rnd]():
        want = np.asarray(topk_select_reference(x, k, kw))
        row = res["cases"][name] = {"rows": int(x.shape[0]), "N": int(x.shape[1]), "K": kw,
                                    "path": gpu.SelectConfig().pick_path(x.shape[1], x.shape[0], kw)}
        for size in SIZES:
            cfg = gpu.SelectConfig(sample_size=size)
            f = jax.jit(lambda x, k, cfg=cfg: select(x, k, kw, config=cfg))
            try:
                r = profile(f"{name}_{size}", f, (x, k), 10)
                r["exact"] = bool(np.array_equal(np.asarray(f(x, k)), want))
            except Exception as e:  # noqa: BLE001 - recorded
                r = {"error": f"{type(e).__name__}: {str(e)[:200]}", "device_us": float("nan"), "exact": False}
            row[str(size)] = r
    with open(os.path.join(os.environ.get("OUT", "."), "topk_sample.json" if rnd == "1" else
                           f"topk_sample_round{rnd}.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    print("\ncase     path     " + "".join(f"{s:>10}" for s in SIZES) + "   (device us per call; * not exact)")
    for name, row in res["cases"].items():
        cells = "".join(f"{row[str(s)]['device_us']:9.1f}{'' if row[str(s)]['exact'] else '*'}" for s in SIZES)
        print(f"{name:8} {row['path']:8} {cells}")


if __name__ == "__main__":
    main()

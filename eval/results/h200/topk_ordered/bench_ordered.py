"""The ordered-band top-k path (`pallas_kernels.topk_select.gpu_ordered`, SelectConfig(path="ordered")) against the
sampled-bracket path (the default for rows over 16K) on the GPU: exactness against `topk_select_reference`, then
wall time per call (eval.bench.common.time_ms: median of 20 after 3 warm-ups, one call each, dispatch included).

Cases (rows, N, K): the STS draft's record after its layer scan at 100K, batch 3 (16 layers x 3 rows x 32 heads =
1536 rows; K = 520, the budget 512 + 8, and 2080, `mask_pool` 4), the same rows per layer (96), and Kascade's
anchor rows at 100K, batch 4, budget 0.1 (32 rows of ~N / 256 ties per value, `testing.kascade_like_rows`).
Scores: per row the softmax weights of two queries over N keys (logits N(0, 2^2)) summed, 0 past a per-row length
(rows 100 to 300 keys short of N), as the draft's recording step gives them; adversarial rows for exactness only.
Usage (GPU): OUT=... GIT_COMMIT=... python eval/results/h200/topk_ordered/bench_ordered.py. Writes $OUT/topk_ordered.json
($OUT/topk_ordered_round2.json with VARIANTS=round2: the ordered path's sample size, stages and skip_empty).
"""
import datetime, json, os, sys

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench.common import time_ms
from pallas_kernels.topk_select import gpu, topk_select_reference
from pallas_kernels.topk_select.testing import adversarial, kascade_like_rows

N = 100000
# VARIANTS=round2 (the second run): the sample size, the band kernel's pipeline stages and `skip_empty` of the
# ordered path (gpu_ordered.topk_select_ordered called directly), on the STS cases only.
ROUND2 = os.environ.get("VARIANTS") == "round2"
JSON = "topk_ordered_round2.json" if ROUND2 else "topk_ordered.json"
if ROUND2:
    from pallas_kernels.topk_select import gpu_ordered
    _o = lambda **kw: ("direct", kw)  # noqa: E731
    VARIANTS = {"sample": gpu.SelectConfig(path="sample"), "ordered": gpu.SelectConfig(path="ordered"),
                "o_s4096": _o(sample=4096), "o_s2048": _o(sample=2048), "o_skip": _o(skip_empty=True),
                "o_st3": _o(num_stages=3), "o_s4096_skip": _o(sample=4096, skip_empty=True),
                "o_s4096_skip_st3": _o(sample=4096, skip_empty=True, num_stages=3),
                "o_s4096_skip_b512": _o(sample=4096, skip_empty=True, block_n=512)}
else:
    VARIANTS = {
        "sample": gpu.SelectConfig(path="sample"),
        "ordered": gpu.SelectConfig(path="ordered"),
        "ordered_b2048": gpu.SelectConfig(path="ordered", compact_block_n=2048),
        "ordered_w8": gpu.SelectConfig(path="ordered", num_warps=8),
        "ordered_b2048_w8": gpu.SelectConfig(path="ordered", compact_block_n=2048, num_warps=8),
        "ordered_b4096_w8": gpu.SelectConfig(path="ordered", compact_block_n=4096, num_warps=8),
    }


def probs_rows(key, R, n):
    k1, k2 = jax.random.split(key)
    logits = 2.0 * jax.random.normal(k1, (R, 2, n), jnp.float32)
    length = n - jax.random.randint(k2, (R, 1), 100, 300)
    logits = jnp.where(jnp.arange(n)[None, None] < length[:, None], logits, -jnp.inf)
    return jax.nn.softmax(logits, axis=-1).sum(axis=1), length[:, 0]


def main():
    out = os.environ.get("OUT", "/tmp")
    res = dict(command=("VARIANTS=round2 " if ROUND2 else "") + "python eval/results/h200/topk_ordered/bench_ordered.py", device=jax.devices()[0].device_kind,
               jax=jax.__version__, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               commit=os.environ.get("GIT_COMMIT", "unknown"), cases=[])
    rng = np.random.default_rng(0)
    cases = [("sts_after_scan", 1536, 520), ("sts_after_scan_pool4", 1536, 2080), ("sts_per_layer", 96, 520),
             ("sts_per_layer_pool4", 96, 2080), ("kascade_b4", 32, None)]
    if ROUND2:
        cases = cases[:4]
    for name, R, K in cases:
        if K is None:
            xs, ks = kascade_like_rows(rng, R, context=N - 100, capacity=N)
            x, k = jnp.asarray(xs), jnp.asarray(ks)
            K = int(ks.max())
        else:
            x, length = probs_rows(jax.random.key(R + K), R, N)
            k = jnp.minimum(length, K).astype(jnp.int32)
        want = np.asarray(topk_select_reference(x, k, K))
        adv = jnp.asarray(adversarial(rng, min(R, 64), N))
        kadv = jnp.asarray(rng.integers(-2, K + 3, adv.shape[0]).astype(np.int32))
        want_adv = np.asarray(topk_select_reference(adv, kadv, K))
        row = dict(case=name, rows=R, n=N, K=K)
        for vname, cfg in VARIANTS.items():
            if isinstance(cfg, tuple):
                fn = jax.jit(lambda x, k, kw=cfg[1]: gpu_ordered.topk_select_ordered(x, k, K, **kw))
            else:
                fn = jax.jit(lambda x, k, cfg=cfg: gpu.topk_select_gpu(x, k, K, config=cfg))
            exact = bool(np.array_equal(np.asarray(fn(x, k)), want))
            exact_adv = bool(np.array_equal(np.asarray(fn(adv, kadv)), want_adv))
            row[vname] = dict(ms=time_ms(fn, x, k), exact=exact, exact_adversarial=exact_adv)
            print(f"{name:22s} R {R:5d} K {K:6d} {vname:18s} {row[vname]['ms']:8.3f} ms exact {exact} adv {exact_adv}",
                  flush=True)
        res["cases"].append(row)
        json.dump(res, open(os.path.join(out, JSON), "w"), indent=1)
    print("\ncase                   " + " ".join(f"{v:>16s}" for v in VARIANTS))
    for row in res["cases"]:
        print(f"{row['case']:22s} " + " ".join(f"{row[v]['ms']:16.3f}" for v in VARIANTS))


if __name__ == "__main__":
    main()

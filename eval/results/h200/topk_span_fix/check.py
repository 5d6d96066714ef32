"""The ordered top-k path after aa7a4cf (its select kernel masks the band's scores to the span; its band capacity
capped at ROW_LIMIT), on the GPU (compiled kernels, not the interpreter):
  1. exactness against `topk_select_reference` of the masked scores, every span-taking path ("row", "ordered",
     "sample", "fused"), with k at and near N and short spans (before the fix the ordered path chose positions
     outside the span there; eval/results/h200/topk_span_fix/NOTES.md), continuous and adversarial rows;
  2. an explicit "ordered" path at K = N = 100096 (it failed before on a band capacity of 131072);
  3. wall time of the ordered path on the STS draft's rows after its layer scan (1536 rows of 100K, K 520 and 2080),
     with and without a span, beside the path's 2026-11-28 figures (`../topk_ordered/`: 1.150 / 0.993 ms).
Usage (GPU): OUT=... GIT_COMMIT=... python eval/results/h200/topk_span_fix/check.py. Writes $OUT/check.json."""
import datetime, json, os

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench.common import time_ms
from pallas_kernels.topk_select import gpu, topk_select_reference
from pallas_kernels.topk_select.common import mask_span
from pallas_kernels.topk_select.testing import adversarial

PATHS = {"row": gpu.SelectConfig(path="row"), "ordered": gpu.SelectConfig(path="ordered", sample_size=256),
         "sample": gpu.SelectConfig(path="sample", sample_size=256), "fused": gpu.SelectConfig(path="fused")}


def main():
    out = os.environ.get("OUT", "/tmp")
    res = dict(command="python eval/results/h200/topk_span_fix/check.py", device=jax.devices()[0].device_kind,
               jax=jax.__version__, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               commit=os.environ.get("GIT_COMMIT", "unknown"), exact={}, timing=[])
    rng = np.random.default_rng(0)
    R, N = 8, 2048
    x = rng.standard_normal((R, N)).astype(np.float32)
    x[4:] = adversarial(rng, 4, N)
    lo = np.array([0, 1000, 7, 0, 0, 500, 3, 100], np.int32)
    hi = np.array([100, 1010, 1900, 2048, 64, 2048, 2000, 101], np.int32)
    span = (jnp.asarray(lo), jnp.asarray(hi))
    xs = jnp.asarray(x)
    for name, cfg in PATHS.items():
        ok = True
        for K, kv in [(N, N), (N, 1843), (1843, 1843), (N, 1990), (512, 300)]:
            k = jnp.full((R,), kv, jnp.int32)
            want = np.asarray(topk_select_reference(mask_span(xs, span), k, K))
            got = np.asarray(gpu.topk_select_gpu(xs, k, K, span=span, config=cfg))
            same = bool(np.array_equal(got, want))
            outside = int(((got >= 0) & ((got < lo[:, None]) | (got >= hi[:, None]))).sum())
            ok &= same and outside == 0
            print(f"{name:8s} K {K:5d} k {kv:5d} exact {same} picks outside the span {outside}", flush=True)
        res["exact"][name] = ok
    n = 100096
    xb = jnp.asarray(rng.standard_normal((2, n)).astype(np.float32))
    kb = jnp.asarray([n, n // 2], jnp.int32)
    got = gpu.topk_select_gpu(xb, kb, n, config=gpu.SelectConfig(path="ordered"))
    res["exact"]["ordered_K_100096"] = bool(np.array_equal(np.asarray(got), np.asarray(topk_select_reference(xb, kb, n))))
    print("ordered K=N=100096 exact", res["exact"]["ordered_K_100096"], flush=True)
    Nt = 100000
    for K in (520, 2080):
        key = jax.random.key(K)
        logits = 2.0 * jax.random.normal(key, (1536, 2, Nt), jnp.float32)
        xt = jax.nn.softmax(logits, axis=-1).sum(axis=1)
        kt = jnp.full((1536,), K, jnp.int32)
        sp = (jnp.zeros((1536,), jnp.int32), jnp.full((1536,), Nt - 200, jnp.int32))
        cfg = gpu.SelectConfig(path="ordered")
        plain = jax.jit(lambda x, k: gpu.topk_select_gpu(x, k, K, config=cfg))
        spanned = jax.jit(lambda x, k: gpu.topk_select_gpu(x, k, K, span=sp, config=cfg))
        exact = bool(np.array_equal(np.asarray(spanned(xt, kt)),
                                    np.asarray(topk_select_reference(mask_span(xt, sp), kt, K))))
        row = dict(rows=1536, n=Nt, K=K, ordered_ms=time_ms(plain, xt, kt), ordered_span_ms=time_ms(spanned, xt, kt),
                   span_exact=exact)
        res["timing"].append(row)
        print(row, flush=True)
    json.dump(res, open(os.path.join(out, "check.json"), "w"), indent=1)
    print("\nexact:", res["exact"])
    for r in res["timing"]:
        print(f"K {r['K']:5d} ordered {r['ordered_ms']:.3f} ms, with a span {r['ordered_span_ms']:.3f} ms")


if __name__ == "__main__":
    main()

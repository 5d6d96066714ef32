"""GPU check of `topk_select(..., span=(lo, hi))` against the reference on the masked scores, at the shapes H2O and
EvoSparse call it with at 100K, batch 4 (every layer's rows at once: 32 x 4 x 8 = 1024 rows): H2O's token scores
(100096 per row, the "ordered" path) and EvoSparse's block heat (6256 blocks, the "row" path), each row's span
(lo, hi) its middle. Device time of the spanned call against the masked copy + the plain call (profiler trace).
Writes $OUT/check_span.json; prints a table last.
"""
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.getcwd())
from eval.bench.common import device_facts  # noqa: E402
from eval.bench.profile_decode_step import trace_calls  # noqa: E402
from pallas_kernels.topk_select import topk_select, topk_select_reference  # noqa: E402
from pallas_kernels.topk_select.common import mask_span  # noqa: E402

CASES = {"h2o_tokens": (100096, 5005, 0), "evosparse_blocks": (6256, 384, 4)}  # N, width, sink (lo)
if os.environ.get("SMOKE"):  # a CPU check of the script (the reference paths; no kernels, an empty profile)
    CASES = {"h2o_tokens": (2048, 100, 0), "evosparse_blocks": (1024, 64, 4)}


def main():
    res = dict(device_facts(), cases={})
    rng = np.random.default_rng(0)
    for name, (N, W, lo0) in CASES.items():
        L, B, H = 32, 4, 8
        x = jnp.asarray(np.exp(2.0 * rng.standard_normal((L, B, H, N))).astype(np.float32) / N)
        p = np.array([N - 97, N - 500, N // 2, N - 1], np.int32)  # each row's position
        hi = jnp.asarray(p - 40)[:, None]  # the window's start
        lo = jnp.full((B, 1), lo0, jnp.int32)
        k = jnp.broadcast_to(jnp.asarray(np.minimum(W, p - 40 - lo0))[:, None], (L, B, H))
        span = (jnp.broadcast_to(lo, (L, B, H)), jnp.broadcast_to(hi, (L, B, H)))
        spanned = jax.jit(lambda x, k, lo, hi: topk_select(x, k, W, span=(lo, hi)))
        masked = jax.jit(lambda x, k, lo, hi: topk_select(mask_span(x, (lo, hi)), k, W))
        want = np.asarray(topk_select_reference(mask_span(x, span), k, W))
        got = np.asarray(spanned(x, k, *span))
        got_m = np.asarray(masked(x, k, *span))
        row = dict(N=N, width=W, rows=L * B * H, exact=bool(np.array_equal(got, want)),
                   exact_masked=bool(np.array_equal(got_m, want)))
        for tag, f in (("spanned", spanned), ("masked", masked)):
            t = trace_calls(f"/tmp/check_span_{name}_{tag}", f, (x, k, *span), 5, 8)
            row[tag] = dict(device_us=t["device_us_per_step"], top=t["top"][:5])
        res["cases"][name] = row
        print(name, "exact", row["exact"], row["exact_masked"], "device us: spanned %.1f masked %.1f" % (
            row["spanned"]["device_us"], row["masked"]["device_us"]), flush=True)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "check_span.json"), "w"), indent=1)
    assert all(c["exact"] and c["exact_masked"] for c in res["cases"].values()), "a spanned selection differs"


if __name__ == "__main__":
    main()

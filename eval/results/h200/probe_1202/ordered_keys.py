"""The ordered top-k's band of positions only (`gpu_ordered.topk_select_ordered(..., store_keys=False)`: the band
pass stores each band score's position, not its key, and the select kernel gathers the scores by position) against
the library's band of keys and positions, on the GPU: exactness against `topk_select_reference`, then device time
per call (profiler trace). Shapes: H2O's every-layer rows at 100K, batch 4 (1024 x 100096, K 5005, the row's middle
as its span) and the STS draft's record (1536 x 100096, K 520 and 2080). Writes $OUT/ordered_keys.json.
SMOKE=1: small shapes in interpret mode on the CPU.

It ran at 6b15e89 (`ordered_keys.json`), where `store_keys` was an option. The library has kept only the band of
positions since (`../h2o_1202/NOTES.md`), so this script runs only at that commit.
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
from pallas_kernels.topk_select import gpu_ordered, topk_select_reference  # noqa: E402
from pallas_kernels.topk_select.common import mask_span  # noqa: E402

SMOKE = bool(os.environ.get("SMOKE"))
N = 16384 if SMOKE else 100096
CASES = {"h2o": (64 if SMOKE else 1024, 800 if SMOKE else 5005, True),
         "sts_520": (64 if SMOKE else 1536, 84 if SMOKE else 520, False),
         "sts_2080": (64 if SMOKE else 1536, 330 if SMOKE else 2080, False)}


def main():
    res = dict(device_facts(), command="python eval/results/h200/probe_1202/ordered_keys.py", cases={})
    rng = np.random.default_rng(0)
    for name, (R, K, spanned) in CASES.items():
        x = jnp.asarray((np.exp(2.0 * rng.standard_normal((R, N))) / N).astype(np.float32))
        k = jnp.asarray(rng.integers(K // 2, K + 1, R).astype(np.int32))
        span = jnp.stack([jnp.zeros((R,), jnp.int32), jnp.full((R,), N - 200, jnp.int32)], -1) if spanned else None
        ref_x = x if span is None else mask_span(x, (span[:, 0], span[:, 1]))
        want = np.asarray(topk_select_reference(ref_x, k, K))
        row = dict(rows=R, N=N, K=K, spanned=spanned)
        for keys in (True, False):
            f = jax.jit(lambda x, k, sp, keys=keys: gpu_ordered.topk_select_ordered(
                x, k, K, span=sp, store_keys=keys, interpret=SMOKE))
            got = np.asarray(f(x, k, span))
            t = trace_calls(f"/tmp/ordered_keys_{name}_{keys}", f, (x, k, span), 5, 4)
            tag = "keys_and_positions" if keys else "positions_only"
            row[tag] = dict(exact=bool(np.array_equal(got, want)), device_us=t["device_us_per_step"], top=t["top"])
            print(name, tag, "exact", row[tag]["exact"], "%.1f us" % t["device_us_per_step"],
                  [(r["kernel"], round(r["us_per_step"], 1)) for r in t["top"][:3]], flush=True)
        res["cases"][name] = row
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "ordered_keys.json"), "w"), indent=1)
    assert all(c[t]["exact"] for c in res["cases"].values() for t in ("keys_and_positions", "positions_only"))


if __name__ == "__main__":
    main()

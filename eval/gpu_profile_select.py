"""Per-kernel device time of the long-row top-k selection paths on the GPU (a `jax.profiler` trace of a few
calls), at the Kascade anchor's shape: 64 rows (B 8 x Hkv 8) of 131072 pooled-like scores, k = 10%.

    PYTHONPATH=. python eval/gpu_profile_select.py --out $OUT/profile_select.json

Variants: the "fused" path and the "sample" path at a few sample sizes / band capacities / bracket widths.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from eval.gpu_profile_decode_step import kernel_table
from pallas_kernels.topk_select import gpu, topk_select_reference

VARIANTS = {
    "fused": gpu.SelectConfig(path="fused"),
    "sample": gpu.SelectConfig(path="sample"),
    "sample_s8192_c8192": gpu.SelectConfig(path="sample", sample_size=8192, band_cap=8192),
    "sample_sig3": gpu.SelectConfig(path="sample", sample_sigmas=3.0, band_cap=8192),
    "sample_b1": gpu.SelectConfig(path="sample", row_bits=1),
    "sample_w8": gpu.SelectConfig(path="sample", num_warps=8),
}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "profile_select.json"))
    a = p.parse_args()
    R, N, K = 64, 131072, 13108
    # pooled-softmax-like scores: positive, heavy tailed
    x = jnp.exp(2.0 * jax.random.normal(jax.random.key(0), (R, N), jnp.float32)) / N
    k = jnp.full((R,), K, jnp.int32)
    want = np.asarray(topk_select_reference(x, k, K))
    res = {}
    for name, cfg in VARIANTS.items():
        f = jax.jit(lambda x, k, cfg=cfg: gpu.topk_select_gpu(x, k, K, config=cfg))
        exact = bool(np.array_equal(np.asarray(f(x, k)), want))
        d = f"/tmp/jsparse_profile_select_{name}"
        t = time.perf_counter()
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(a.calls):
                out = f(x, k)
            jax.block_until_ready(out)
        wall = (time.perf_counter() - t) * 1e3 / a.calls
        tab = kernel_table(d, a.calls, 12)
        res[name] = {"exact": exact, "wall_ms": wall, "device_us": tab["device_us_per_step"], "top": tab["top"]}
        print(f"{name}: exact {exact}, device {tab['device_us_per_step']:.1f} us/call", flush=True)
        for r in tab["top"]:
            print(f"   {r['us_per_step']:8.1f} us {r['launches_per_step']:4.1f}x  {r['kernel']}")
    with open(a.out, "w") as fh:
        json.dump({"shape": dict(R=R, N=N, K=K), "variants": res}, fh, indent=1)


if __name__ == "__main__":
    main()

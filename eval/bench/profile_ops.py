"""Per-kernel device time of single ops on the GPU (a `jax.profiler` trace of a few calls of each variant), at
the Kascade anchor's decode shape: Hq 32, Hkv 8, D 128, bf16; by default B 8, N 131072, budget 10%
(--batch, --context, --budget).

    jsparse bench profile_ops --what select,anchor --out /some/dir/profile_ops.json

  select: the long-row top-k paths on B x Hkv rows of pooled-like scores, k = budget: "fused" and "sample"
          at a few sample sizes / band capacities / radix bits (each checked exact against the reference;
          "sample" is the default, its band capacity sized from K, `gpu_sample.band_capacity`).
  anchor: the anchor layer (`anchor_decode_gpu`, stacked cache), the dense-output anchor (layer 0) and a
          reuse layer (stacked gathered decode with a head map).
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench.common import (add_out_argument, check_budget, device_facts, out_path, positive_int, require_gpu,
                               write_json)
from eval.bench.profile_decode_step import kernel_table
from pallas_kernels.topk_select import gpu, topk_select_reference

WHAT = ("select", "anchor")
SELECT = {
    "fused": gpu.SelectConfig(path="fused"),
    "sample": gpu.SelectConfig(path="sample"),
    "sample_s4096": gpu.SelectConfig(path="sample", sample_size=4096),
    "sample_c8192": gpu.SelectConfig(path="sample", band_cap=8192),
    "sample_c16384": gpu.SelectConfig(path="sample", band_cap=16384),
    "sample_rb4": gpu.SelectConfig(path="sample", row_bits=4),
    "sample_cb512": gpu.SelectConfig(path="sample", compact_block_n=512),
    "sample_cb2048_tp2048": gpu.SelectConfig(path="sample", compact_block_n=2048, target_programs=2048),
    "sample_w8": gpu.SelectConfig(path="sample", num_warps=8),
}


def profile(name: str, fn, args, calls: int) -> dict:
    jax.block_until_ready(fn(*args))
    d = f"/tmp/jsparse_profile_{name}"
    t = time.perf_counter()
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
    wall = (time.perf_counter() - t) * 1e3 / calls
    tab = kernel_table(d, calls, 14)
    print(f"{name}: device {tab['device_us_per_step']:.1f} us/call, wall {wall * 1e3:.0f} us/call", flush=True)
    for r in tab["top"]:
        print(f"   {r['us_per_step']:8.1f} us {r['launches_per_step']:4.1f}x  {r['kernel']}")
    return {"wall_ms": wall, "device_us": tab["device_us_per_step"], "top": tab["top"]}


def main(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", default="select,anchor", help=f"comma-separated, some of {WHAT} (default: both)")
    p.add_argument("--calls", type=positive_int, default=5)
    p.add_argument("--batch", type=positive_int, default=8)
    p.add_argument("--context", type=positive_int, default=131072, help="N, the cache length")
    p.add_argument("--budget", type=float, default=0.1, help="k = ceil(budget * N)")
    add_out_argument(p, "profile_ops.json")
    a = p.parse_args(argv)
    what = [w for w in a.what.split(",") if w]
    bad = [w for w in what if w not in WHAT]
    if bad or not what:
        p.error(f"--what {a.what!r}: expected a comma-separated subset of {WHAT}")
    try:
        check_budget(a.budget)
        require_gpu("profile_ops")
        a.out = out_path(a.out, "profile_ops.json")
    except ValueError as e:
        p.error(str(e))
    B, Hq, Hkv, D, N = a.batch, 32, 8, 128, a.context
    K = int(np.ceil(a.budget * N))
    res = {**device_facts(), "shape": dict(B=B, Hq=Hq, Hkv=Hkv, D=D, N=N, K=K)}
    if "select" in what:
        R = B * Hkv
        x = jnp.exp(2.0 * jax.random.normal(jax.random.key(0), (R, N), jnp.float32)) / N  # pooled-like
        k = jnp.full((R,), K, jnp.int32)
        want = np.asarray(topk_select_reference(x, k, K))
        for name, cfg in SELECT.items():
            f = jax.jit(lambda x, k, cfg=cfg: gpu.topk_select_gpu(x, k, K, config=cfg))
            r = profile(f"select_{name}", f, (x, k), a.calls)
            r["exact"] = bool(np.array_equal(np.asarray(f(x, k)), want))
            res[f"select_{name}"] = r
    if "anchor" in what:
        from pallas_kernels.anchor_attention import gpu as anchor_gpu
        from pallas_kernels.sparse_attention.stacked import sparse_decode_stacked_gpu
        ks = jax.random.split(jax.random.key(1), 3)
        q = jax.random.normal(ks[0], (B, 1, Hq, D), jnp.bfloat16)
        kc = jax.random.normal(ks[1], (1, B, Hkv, N, D), jnp.bfloat16)
        vc = jax.random.normal(ks[2], (1, B, Hkv, N, D), jnp.bfloat16)
        lengths = jnp.full((B,), N, jnp.int32)
        lay = jnp.int32(0)
        for dense in (False, True):
            f = jax.jit(lambda q, k, v, l, dense=dense: anchor_gpu.anchor_decode_gpu(
                q, k, v, l, budget=a.budget, K=K, layer=lay, dense_output=dense))
            res[f"anchor_dense{int(dense)}"] = profile(f"anchor_dense{int(dense)}", f, (q, kc, vc, lengths), a.calls)
        _, idx = jax.jit(lambda q, k, v, l: anchor_gpu.anchor_decode_gpu(q, k, v, l, budget=a.budget, K=K, layer=lay))(
            q, kc, vc, lengths)
        hm = jnp.asarray(np.roll(np.arange(Hkv), 1), jnp.int32)
        f = jax.jit(lambda q, k, v, i, l: sparse_decode_stacked_gpu(q, k, v, lay, i, l, head_map=hm))
        res["reuse"] = profile("reuse", f, (q, kc, vc, idx, lengths), a.calls)
    write_json(a.out, res)


if __name__ == "__main__":
    main()

"""H100 micro-benchmark of EvoSparse's per-layer bookkeeping at 100K context, batch 4 (issue 6): the heat update
as a one-hot compare-and-reduce vs the method's scatter-add (`jsparse.heat.heat_update`), the heat top-k with the
"row" selection kernel at 1, 2 and 4 radix bits per pass, 4 and 8 warps, and the whole block selection
(`block_scores.select_blocks`: the one-launch Triton kernel at several bits / warps vs its XLA specification). Each variant runs `--iters` times in
one jitted fori_loop (inputs perturbed by a running checksum), and is checked against the reference.

    jsparse bench evosparse_parts --out /some/dir/evosparse_parts.json
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench.common import add_out_argument, device_facts, out_path, positive_int, require_gpu, table, write_json
from jsparse.heat import heat_step, heat_update
from pallas_kernels.block_scores import gpu as bs_gpu
from pallas_kernels.block_scores import xla as bs_xla
from pallas_kernels.topk_select import topk_select
from pallas_kernels.topk_select.reference import topk_select_reference


def onehot_heat(heat, idx, values, decay):
    """decay * heat + the block sums by a one-hot compare-and-reduce over [.., nb, K] (the earlier layout)."""
    hit = idx[..., None, :] == jnp.arange(heat.shape[-1], dtype=idx.dtype)[:, None]
    return heat_step(heat, jnp.sum(jnp.where(hit, values[..., None, :], 0.0), axis=-1), decay)


def timed(fn, *args, iters):
    @jax.jit
    def loop(*args):
        def body(_, acc):
            return acc + fn(acc, *args)
        return jax.lax.fori_loop(0, iters, body, jnp.float32(0))
    jax.block_until_ready(loop(*args))
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(loop(*args))
        ts.append((time.perf_counter() - t) * 1e3 / iters)
    return float(np.median(ts))


def main(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=positive_int, default=200)
    add_out_argument(p, "evosparse_parts.json")
    a = p.parse_args(argv)
    try:
        require_gpu("evosparse_parts")
        a.out = out_path(a.out, "evosparse_parts.json")
    except ValueError as e:
        p.error(str(e))
    from pallas_kernels.topk_select.gpu import SelectConfig
    B, H, nb, K, k = 4, 8, 6256, 128, 40
    key = jax.random.key(0)
    heat = jax.random.uniform(key, (B, H, nb))
    idx = jnp.sort(jax.random.permutation(jax.random.key(1), nb)[:K])
    idx = jnp.broadcast_to(idx, (B, H, K)).astype(jnp.int32).at[..., -3:].set(-1)
    vals = jax.random.uniform(jax.random.key(2), (B, H, K))
    rows = []
    ref = onehot_heat(heat, idx, vals, 0.5)
    for name, f in (("heat_onehot", onehot_heat), ("heat_scatter", heat_update)):
        got = jax.jit(f, static_argnums=3)(heat, idx, vals, 0.5)
        err = float(jnp.max(jnp.abs(got - ref)))
        ms = timed(lambda acc, h, i, v, f=f: f(h + acc * 1e-9, i, v, 0.5)[0, 0, 0], heat, idx, vals, iters=a.iters)
        rows.append(dict(part=name, ms=ms, max_err=err))
    scores = jax.random.normal(jax.random.key(3), (B, H, nb))
    want = topk_select_reference(scores, k, K)
    for bits in (1, 2, 4):
        for warps in (None, 4, 8):
            cfg = SelectConfig(path="row", row_bits=bits, row_warps=warps)
            try:
                got = topk_select(scores, k, K, config=cfg)
                exact = bool(jnp.all(got == want))
                ms = timed(lambda acc, s, cfg=cfg: topk_select(s + acc * 1e-9, k, K, config=cfg)[0, 0, 0]
                           .astype(jnp.float32), scores, iters=a.iters)
                rows.append(dict(part=f"topk_row_b{bits}_w{warps}", ms=ms, exact=exact))
            except Exception as e:  # noqa: BLE001
                rows.append(dict(part=f"topk_row_b{bits}_w{warps}", error=str(e).splitlines()[0][:200]))
    for path in ("fused", "passes"):
        cfg = SelectConfig(path=path)
        ms = timed(lambda acc, s, cfg=cfg: topk_select(s + acc * 1e-9, k, K, config=cfg)[0, 0, 0]
                   .astype(jnp.float32), scores, iters=a.iters)
        rows.append(dict(part=f"topk_{path}", ms=ms, exact=bool(jnp.all(topk_select(scores, k, K, config=cfg) == want))))
    # The whole selection of a row: sink 8, local 48, 30 retrieval blocks, 82 heat picks of width 72.
    rng = np.random.default_rng(0)
    ret = np.full((B, 40), -1, np.int32)
    for b in range(B):
        ret[b, :30] = np.sort(rng.choice(np.arange(8, nb - 48), 30, replace=False))
    ret = jnp.asarray(ret)
    n_s, hi, nbv = (jnp.full((B,), v, jnp.int32) for v in (8, nb - 48, nb))
    count, full = jnp.full((B,), 82, jnp.int32), jnp.zeros((B,), bool)
    kw = dict(num_kv_heads=H, nb=nb, width=K, heat_width=72)
    for label, hh in (("continuous", heat), ("ties", jnp.round(heat * 4) / 4)):
        want = bs_xla.select_blocks_xla(hh, ret, n_s, hi, nbv, count, full, **kw)
        variants = [("xla", lambda h: bs_xla.select_blocks_xla(h, ret, n_s, hi, nbv, count, full, **kw))]
        for bits, warps in ((1, 8), (2, 4), (2, 8), (2, 16), (4, 8), (4, 16)):
            variants.append((f"kernel_b{bits}_w{warps}", lambda h, bits=bits, warps=warps: bs_gpu.select_blocks_gpu(
                h, ret, n_s, hi, nbv, count, full, bits=bits, num_warps=warps, **kw)))
        for name, f in variants:
            try:
                exact = bool(jnp.all(jax.jit(f)(hh) == want))
                ms = timed(lambda acc, h, f=f: f(h + acc * 1e-30)[0, 0, 0].astype(jnp.float32), hh, iters=a.iters)
                rows.append(dict(part=f"select_{label}_{name}", ms=ms, exact=exact))
            except Exception as e:  # noqa: BLE001
                rows.append(dict(part=f"select_{label}_{name}", error=str(e).splitlines()[0][:200]))
    write_json(a.out, {**device_facts(), "benchmark": "EvoSparse per-layer bookkeeping, B 4, Hkv 8, 100K / 16",
                       "shape": dict(B=B, Hkv=H, nb=nb, K=K, k=k), "iters": a.iters, "rows": rows})
    print(table(rows, ["part", "ms", "max_err", "exact", "error"]))


if __name__ == "__main__":
    main()

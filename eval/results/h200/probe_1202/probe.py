"""Two GPU probes for issue 24 (2026-12-02), device time per call from a profiler trace; writes $OUT/probe.json.

A. Would a contiguous-window decode beat the gathered decode for StreamingLLM? One layer at 100K, batch 4, Llama-3.1-8B
   heads (32 q / 8 KV, D 128), K 10010 keys:
   - `gathered_window`: `sparse_decode_stacked_gpu` over StreamingLLM's indices (4 sinks + the recent window);
   - `gathered_random`: the same over 10010 sorted random positions (Kascade's reuse layers);
   - `dense_10k`: `dense_decode_stacked_gpu` over a cache of 10016 rows (the same bytes, contiguous);
   - `dense_100k`: the dense decode over the whole 100K cache (its bandwidth).
B. Where the ordered top-k's band pass goes (H2O's shape: 1024 rows x 100096 f32, 5% of keys above the bound):
   `band`: the library's `_band_kernel`; `count`: the same loop with only the comparison and a sum (no cumulative
   sum, no stores); `count_split8`: that on a (row, 8 splits) grid; `scan`: the cumulative sum but no stores;
   `carry`: the cumulative sum and the running offset (a sum per chunk carried to the next), no stores; `store`:
   the cumulative sum and the band's stores at offsets that do not depend on the earlier chunks; `store_split8`: that
   on 8 splits. (Round 1 ran the attention probe with one buffer as both K and V: its V reads partly hit L2.)
SMOKE=1: small shapes in interpret mode on the CPU (checks the script, times nothing meaningful).
"""
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

sys.path.insert(0, os.getcwd())
from eval.bench.common import device_facts  # noqa: E402
from eval.bench.profile_decode_step import trace_calls  # noqa: E402
from jsparse.methods.streaming import sink_window  # noqa: E402
from pallas_kernels.dense_decode.gpu import dense_decode_stacked_gpu  # noqa: E402
from pallas_kernels.sparse_attention.stacked import sparse_decode_stacked_gpu  # noqa: E402
from pallas_kernels.topk_select import gpu_fused, gpu_ordered  # noqa: E402
from pallas_kernels.topk_select.common import float_keys  # noqa: E402

SMOKE = bool(os.environ.get("SMOKE"))
INTERP = SMOKE


def attention_probe(res):
    B, Hq, Hkv, D = (1, 4, 2, 64) if SMOKE else (4, 32, 8, 128)
    N, K = (2048, 256) if SMOKE else (100096, 10010)
    n = N - 96  # each row's length
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, 1, Hq, D)), jnp.bfloat16)
    big = jnp.asarray(rng.standard_normal((2, B, Hkv, N, D)), jnp.bfloat16)
    bigv = jnp.asarray(rng.standard_normal((2, B, Hkv, N, D)), jnp.bfloat16)
    small, smallv = big[:, :, :, :K + 6], bigv[:, :, :, :K + 6]
    lengths = jnp.full((B,), n, jnp.int32)
    layer = jnp.int32(1)
    win = sink_window(lengths[:, None], jnp.full((B, 1), K, jnp.int32), 4, K)  # [B, 1, K]
    win = jnp.broadcast_to(win[:, None], (B, Hkv, 1, K))
    rnd = np.sort(np.stack([rng.choice(n, K, replace=False) for _ in range(B * Hkv)]), -1)
    rnd = jnp.asarray(rnd.reshape(B, Hkv, 1, K).astype(np.int32))
    gathered = jax.jit(lambda q, k, v, i: sparse_decode_stacked_gpu(q, k, v, layer, i, lengths, interpret=INTERP))
    dense = jax.jit(lambda q, k, v, ln: dense_decode_stacked_gpu(q, k, v, layer, ln, interpret=INTERP))
    cases = {"gathered_window": (gathered, (q, big, bigv, win), 2 * K),
             "gathered_random": (gathered, (q, big, bigv, rnd), 2 * K),
             "dense_10k": (dense, (q, small, smallv, jnp.full((B,), K, jnp.int32)), 2 * K),
             "dense_100k": (dense, (q, big, bigv, lengths), 2 * n)}
    for name, (f, args, rows) in cases.items():
        t = trace_calls(f"/tmp/probe_{name}", f, args, 10, 6)
        nbytes = rows * B * Hkv * D * 2
        res[name] = dict(device_us=t["device_us_per_step"], bytes=nbytes,
                         tb_s=nbytes / max(t["device_us_per_step"], 1e-9) / 1e6, top=t["top"])
        print(name, "%.1f us, %.2f TB/s" % (res[name]["device_us"], res[name]["tb_s"]), flush=True)


def _probe_kernel(br_ref, x_ref, o_ref, *st, n: int, block_n: int, mode: str, per_split: int, cap: int = 0):
    b_key = br_ref[1]
    if mode.endswith("split8"):
        first, count = gpu_fused._split_chunks(n, block_n, per_split)
    else:
        first, count = jnp.int32(0), jnp.int32(pl.cdiv(n, block_n))

    def body(c, acc):
        _, ok, x = gpu_fused._chunk(x_ref, first + c, block_n, n)
        key = float_keys(x)
        b = ok & (key > b_key)
        band = b.astype(jnp.int32)
        if mode == "scan":
            return acc + jnp.cumsum(band)  # kept live: the sum of every chunk's running offsets
        if mode == "carry":  # the running offset through a sum, no stores
            acc, run = acc
            return acc + run + jnp.cumsum(band) - band, run + jnp.sum(band)
        if mode.startswith("store"):  # stores at offsets that do not depend on the earlier chunks
            dst = ((first + c) * 61 + jnp.cumsum(band) - band) & (cap - 1)
            plgpu.store(st[0].at[jnp.where(b, dst, cap)], key, mask=b)
            plgpu.store(st[1].at[jnp.where(b, dst, cap)], jnp.arange(block_n, dtype=jnp.int32), mask=b)
            return acc + band
        return acc + band

    init = jnp.zeros((block_n,), jnp.int32)
    acc = lax.fori_loop(jnp.int32(0), count, body, (init, jnp.int32(0)) if mode == "carry" else init)
    o_ref[...] = jnp.reshape(jnp.sum(acc[0] if mode == "carry" else acc), (1,))


def band_probe(res):
    R, N, K = (64, 16384, 820) if SMOKE else (1024, 100096, 5005)
    block_n = 1024
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.random((R, N), np.float32))
    bkey = int(np.asarray(float_keys(jnp.float32(0.95))))  # 5% of uniform scores above the bound
    bound = jnp.tile(jnp.asarray([[0, bkey, 0, 0]], jnp.int32), (R, 1))
    cap = gpu_ordered.band_capacity(K, N, 8192, 4.0)
    row = lambda w: pl.BlockSpec((None, w), lambda r, *_: (r, 0))  # noqa: E731

    def band(x, bound):
        return pl.pallas_call(
            functools.partial(gpu_ordered._band_kernel, n=N, block_n=block_n, cap=cap, skip_empty=False),
            grid=(R,), in_specs=[row(4), row(N)], out_specs=(row(1), row(1), row(cap), row(cap)),
            out_shape=(jax.ShapeDtypeStruct((R, 1), jnp.int32), jax.ShapeDtypeStruct((R, 1), jnp.int32),
                       jax.ShapeDtypeStruct((R, cap), jnp.int32), jax.ShapeDtypeStruct((R, cap), jnp.int32)),
            compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2), interpret=INTERP,
            name="probe_band")(bound, x)

    def probe(mode):
        S = 8 if mode.endswith("split8") else 1
        per = pl.cdiv(pl.cdiv(N, block_n), S)
        spec = lambda w: pl.BlockSpec((None, w), lambda r, s: (r, 0))  # noqa: E731
        stores = mode.startswith("store")
        sc = pl.BlockSpec((None, None, cap), lambda r, s: (r, s, 0))
        return lambda x, bound: pl.pallas_call(
            functools.partial(_probe_kernel, n=N, block_n=block_n, mode=mode, per_split=per, cap=cap),
            grid=(R, S), in_specs=[spec(4), spec(N)],
            out_specs=[pl.BlockSpec((None, None, 1), lambda r, s: (r, s, 0))] + [sc, sc] * stores,
            out_shape=[jax.ShapeDtypeStruct((R, S, 1), jnp.int32)]
            + [jax.ShapeDtypeStruct((R, S, cap), jnp.int32)] * (2 * stores),
            compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2), interpret=INTERP,
            name=f"probe_{mode}")(bound, x)

    want = int(np.sum(np.asarray(float_keys(x)) > bkey))
    got = int(np.asarray(jax.jit(band)(x, bound)[0]).sum())
    res["band_check"] = dict(keys_above=want, band_count=got, equal=want == got)
    for name, f in (("band", band), ("count", probe("count")), ("count_split8", probe("count_split8")),
                    ("scan", probe("scan")), ("carry", probe("carry")), ("store", probe("store")),
                    ("store_split8", probe("store_split8"))):
        f = jax.jit(f)
        t = trace_calls(f"/tmp/probe_{name}", f, (x, bound), 5, 4)
        res[name] = dict(device_us=t["device_us_per_step"], tb_s=R * N * 4 / max(t["device_us_per_step"], 1e-9) / 1e6)
        print(name, "%.1f us, %.2f TB/s" % (res[name]["device_us"], res[name]["tb_s"]), flush=True)


def main():
    res = dict(device_facts(), command="python eval/results/h200/probe_1202/probe.py")
    attention_probe(res)
    band_probe(res)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe.json"), "w"), indent=1)
    assert res["band_check"]["equal"], res["band_check"]


if __name__ == "__main__":
    main()

"""Tuning sweep of the STS draft's recording step by blocks at its largest H200 shape (Llama-3.2-1B draft: 16
layers, Hq 32, Hkv 8, head_dim 64; 100K keys, batch 7), 2026-12-01.

1. The record kernel (`dense_decode_record_gpu`: dense decode + the logits written into the record buffer in place +
   block maxima) over the 16 layers in one jitted fori_loop with a traced layer index (as the model's scan), per
   `DenseDecodeConfig`, beside the plain dense decode kernel (default config) in the same run. Every config is
   first checked against the default config's outputs on this shape (out, lse, block maxima equal up to rounding).
2. `select_by_blocks` on the 3,584 rows of the step's record (B x Hq x L) from random logits, block sizes 8 / 16 / 32,
   the two `topk_select` stages with 2 or 4 radix bits per in-register pass; every variant's keys checked equal.
ms: median of 10 calls (the record buffers donated and threaded through them). Writes $OUT/sweep.json, prints a table.
"""
import datetime, functools, itertools, json, os, time
import jax, jax.numpy as jnp
import numpy as np

from eval.bench.common import time_ms
from jsparse.methods.sts import select_by_blocks
from pallas_kernels.dense_decode.gpu import DenseDecodeConfig, dense_decode_record_gpu, dense_decode_stacked_gpu
from pallas_kernels.dense_decode.reference import block_max
from pallas_kernels.topk_select import gpu as tgpu

L, B, Hq, Hkv, D, n, W = 16, 7, 32, 8, 64, 100_000, 520
cap = n + 640
BF = jnp.bfloat16
res = dict(command="python eval/results/h200/record_blocks/sweep.py", device=str(jax.devices()[0].device_kind),
           date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), jax=jax.__version__,
           commit=os.environ.get("GIT_COMMIT", ""), shape=dict(L=L, B=B, Hq=Hq, Hkv=Hkv, D=D, n=n, W=W), kernel=[],
           select=[])
out = os.environ.get("OUT", "/tmp")
ks = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(ks[0], (B, 1, Hq, D), jnp.float32).astype(BF)


@jax.jit
def fill(key):
    put = lambda i, buf: buf.at[i].set(jax.random.normal(jax.random.fold_in(key, i), buf.shape[1:], BF))  # noqa
    return jax.lax.fori_loop(0, L, put, jnp.zeros((L, B, Hkv, cap, D), BF))


k_all, v_all = fill(ks[1]), fill(ks[2])
lens = jnp.full((B,), n, jnp.int32)


def record_loop(config, block=16):
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def f(rec, bm, q, k_all, v_all):  # the caches as arguments: closed over, jit would embed them as constants
        def body(l, c):
            rec, bm, acc = c
            o, lse, rec, bm = dense_decode_record_gpu(q, k_all, v_all, l, lens, rec, bm, l, block=block, config=config)
            return rec, bm, acc + o.astype(jnp.float32) + lse[:, None, :, None]
        return jax.lax.fori_loop(0, L, body, (rec, bm, jnp.zeros(q.shape, jnp.float32)))
    return f


@jax.jit
def dense_loop(q, k_all, v_all):
    def body(l, acc):
        return acc + dense_decode_stacked_gpu(q, k_all, v_all, l, lens).astype(jnp.float32)
    return jax.lax.fori_loop(0, L, body, jnp.zeros(q.shape, jnp.float32))


t_dense = time_ms(dense_loop, q, k_all, v_all, iters=10)
res["dense_loop_ms"] = t_dense
print(f"dense decode loop (default config): {t_dense:.3f} ms", flush=True)
rec = jnp.zeros((B, Hq, L, cap), jnp.float32)
bm = jnp.zeros((B, Hq, L, -(-cap // 16)), jnp.float32)
ref = None
GRID = dict(block_k=(64, 128, 256), num_stages=(2, 3, 4))
configs = [None] + [DenseDecodeConfig(target_programs=1024, **dict(zip(GRID, v))) for v in itertools.product(*GRID.values())]
configs += [DenseDecodeConfig(block_k=128, target_programs=1024, num_warps=8)]
configs += [DenseDecodeConfig(block_k=128, target_programs=p) for p in (512, 2048)]
for c in configs:
    f = record_loop(c)
    try:
        rec, bm, acc = f(rec, bm, q, k_all, v_all)
    except Exception as e:  # noqa: BLE001 - a config the card rejects: skipped, said so
        print("REJECTED", c, str(e).splitlines()[0][:120], flush=True)
        res["kernel"].append(dict(config=str(c), error=str(e).splitlines()[0][:200]))
        continue
    last, bml = rec[:, :, L - 1, :n], bm[:, :, L - 1]
    if ref is None:
        ref = (acc, bml, last)
    err = (float(jnp.max(jnp.abs(acc - ref[0]))), float(jnp.max(jnp.abs(jnp.nan_to_num(bml - ref[1], nan=0.0)))),
           float(jnp.max(jnp.abs(last - ref[2]))))
    ok = err[0] < 0.05 and err[1] < 1e-3 and err[2] < 1e-3 and bool(jnp.all(jnp.isneginf(bml) == jnp.isneginf(ref[1])))

    ms = None
    if ok:  # the buffers donated and threaded through the calls, as in the model's scan
        ts = []
        for i in range(12):
            t = time.perf_counter()
            rec, bm, _ = jax.block_until_ready(f(rec, bm, q, k_all, v_all))
            ts.append((time.perf_counter() - t) * 1e3)
        ms = float(np.median(ts[2:]))
    res["kernel"].append(dict(config=str(c) if c else "default", ms=ms, err=err, ok=ok))
    print(f"{'default' if c is None else c}: {ms} ms, err {err} {'OK' if ok else 'MISMATCH'}", flush=True)
    json.dump(res, open(os.path.join(out, "sweep.json"), "w"), indent=1)
del rec, bm, k_all, v_all

# 2. the selection
R = Hq * L
x = jax.random.normal(jax.random.key(5), (B, R, cap), jnp.float32) * 2.0
lse = jax.nn.logsumexp(x[..., :n], axis=-1)
rng = np.random.default_rng(0)
rec_idx = jnp.asarray(np.sort(rng.choice(n, (B, R, W)), axis=-1), jnp.int32)  # duplicates: harmless for timing
rec_idx = jnp.where(jnp.concatenate([jnp.ones((B, R, 1), bool), rec_idx[..., 1:] != rec_idx[..., :-1]], -1), rec_idx, -1)
rec_idx = jnp.sort(jnp.where(rec_idx < 0, n + 1, rec_idx), axis=-1)
rec_idx = jnp.where(rec_idx > n, -1, rec_idx).astype(jnp.int32)
rec_val = jnp.full((B, R, W), 1e-3, jnp.float32)
lens_s = jnp.full((B,), n, jnp.int32)
want = None
for block in (8, 16, 32):
    bm = jax.jit(block_max, static_argnums=2)(x, lens_s, block)
    for bits in (2, 4):
        cfg = tgpu.SelectConfig(row_bits=bits, row_max=32768)
        f = jax.jit(lambda x, bm, ri, rv, lse, block=block, cfg=cfg: select_by_blocks(
            x, bm, ri, rv, lens_s, 0.5, lse, None, block, cfg))
        val, idx = f(x, bm, rec_idx, rec_val, lse)
        if want is None:
            want = idx
        same = bool(jnp.all(idx == want))
        ms = time_ms(f, x, bm, rec_idx, rec_val, lse, iters=10)
        res["select"].append(dict(block=block, row_bits=bits, ms=ms, same_keys=same))
        print(f"select_by_blocks block {block} row_bits {bits}: {ms:.3f} ms, same keys {same}", flush=True)
json.dump(res, open(os.path.join(out, "sweep.json"), "w"), indent=1)

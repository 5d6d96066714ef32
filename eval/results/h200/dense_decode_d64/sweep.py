"""Tuning sweep of the Pallas GPU dense decode kernel (`pallas_kernels.dense_decode.gpu`) at the draft's attention
shapes in the STS benchmark (Llama-3.2-1B: 16 layers, Hq 32, Hkv 8, head_dim 64), 100K keys, batch 7 (the largest
batch that fits both caches on an H200): plain decoding (T = 1), the round-opening recording step (T = 2 with
`return_probs`) and batch 3; one Llama-3.1-8B-shaped case (D 128, batch 4, 32 layers) as a control.
Why: in `../largest_batch/sts_bench_100000_b7.json` the draft's dense step reads 25.4 GB in 7.71 ms (3.3 TB/s,
69% of the H200's 4.8 TB/s) where the target's reads 108 GB at 4.2 TB/s: with D = 64 a 64-row block of keys is
8 KB, half of what the D = 128 tuning moved per iteration.
Unlike `../dense_decode_t1/sweep.py` (one standalone call per layer, noisy), each timed call runs the kernel over
every layer of a stacked cache in one jitted fori_loop with a traced layer index (as the model's scan does) and sums
the outputs. Every config is first checked against the jnp reference on a small cache. ms is the median of 10 calls
(per whole loop); TB/s counts K and V bytes below each row's length, all layers.
Env: SPLITS (comma-separated split counts: sweep num_splits at block_k 64 / 128 x 3 / 4 stages instead), SMOKE=1
(tiny CPU check in interpret mode), OUT, JSON (default sweep.json), GIT_COMMIT. Writes $OUT/$JSON, prints the best per case.
"""
import datetime, itertools, json, os
import jax, jax.numpy as jnp

from eval.bench.common import time_ms
from pallas_kernels.dense_decode.gpu import DenseDecodeConfig, dense_decode_stacked_gpu, plan
from pallas_kernels.dense_decode.reference import dense_decode_stacked_reference
from pallas_kernels.head_probs.reference import head_probs_stacked_reference

N = 100000
# (label, layers, Hq, Hkv, D, batch, T, return_probs)
CASES = [("draft_b7_t1", 16, 32, 8, 64, 7, 1, False), ("draft_b7_t2_probs", 16, 32, 8, 64, 7, 2, True),
         ("draft_b3_t1", 16, 32, 8, 64, 3, 1, False), ("target_b4_t1", 32, 32, 8, 128, 4, 1, False)]
GRID = dict(block_k=(64, 128, 256), num_warps=(4, 8), num_stages=(3, 4, 5), target_programs=(512, 1024))
if os.environ.get("SPLITS"):  # the split count swept explicitly (SPLITS="8,12,16"), at three tile configs
    GRID = dict(block_k=(64, 128), num_warps=(4,), num_stages=(3, 4),
                num_splits=tuple(int(x) for x in os.environ["SPLITS"].split(",")))
SMOKE = bool(os.environ.get("SMOKE"))
if SMOKE:
    N = 300
    CASES = [("draft_b7_t1", 2, 8, 2, 64, 2, 1, False), ("draft_b7_t2_probs", 2, 8, 2, 64, 2, 2, True)]
    GRID = dict(block_k=(64, 128), num_warps=(4,), num_stages=(2,), target_programs=(512,))
INTERPRET = jax.default_backend() != "gpu"
BF = jnp.bfloat16


def data(L, Hq, Hkv, D, B, T, n, key):
    ks = jax.random.split(key, 3)
    cap = n + 640
    q = jax.random.normal(ks[0], (B, T, Hq, D), jnp.float32).astype(BF)

    @jax.jit
    def fill(key):  # layer by layer: no f32 temporary the size of the cache
        put = lambda i, buf: buf.at[i].set(jax.random.normal(jax.random.fold_in(key, i), buf.shape[1:], BF))
        return jax.lax.fori_loop(0, L, put, jnp.zeros((L, B, Hkv, cap, D), BF))

    return q, fill(ks[1]), fill(ks[2]), jnp.full((B,), n + T, jnp.int32)


def call(q, k, v, layer, lens, c, probs):
    r = dense_decode_stacked_gpu(q, k, v, layer, lens, config=c, return_probs=probs, interpret=INTERPRET)
    return r if probs else (r,)


def main():
    res = dict(command="python eval/results/h200/dense_decode_d64/sweep.py", device=str(jax.devices()[0].device_kind),
           date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               jax=jax.__version__, commit=os.environ.get("GIT_COMMIT", ""), context=N, grid=GRID, rows=[])
    configs = [DenseDecodeConfig(**dict(zip(GRID, vals))) for vals in itertools.product(*GRID.values())]
    default = DenseDecodeConfig()  # the kernel's default when this sweep ran; head_dim 64 has its own since d7008c3
    if default not in configs:
        configs.append(default)
    bad = set()
    for label, L, Hq, Hkv, D, B, T, probs in CASES:  # correctness on a small cache, layer 1 read in place
        q, k, v, lens = data(2, Hq, Hkv, D, 2, T, 200, jax.random.key(T))
        out, lse = dense_decode_stacked_reference(q, k, v, jnp.int32(1), lens, return_lse=True)
        ref = (out, head_probs_stacked_reference(q, k, jnp.int32(1), lens, lse)) if probs else (out,)
        for c in configs:
            try:
                got = call(q, k, v, jnp.int32(1), lens, c, probs)
            except Exception as e:  # noqa: BLE001 - e.g. more shared memory than the card has: skipped, said so
                bad.add((label, c))
                print("REJECTED", label, c, str(e).splitlines()[0][:120], flush=True)
                continue
            err = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - r.astype(jnp.float32)))) for g, r in zip(got, ref))
            if not err < 2e-2:
                bad.add((label, c))
                print("FAILED", label, c, err, flush=True)
    for label, L, Hq, Hkv, D, B, T, probs in CASES:
        q, k, v, lens = data(L, Hq, Hkv, D, B, T, N, jax.random.key(7))
        tb = 2 * L * B * Hkv * (N + T) * D * 2 / 1e12
        for c in configs:
            if (label, c) in bad:
                continue

            @jax.jit
            def loop(q, k, v, lens, c=c):
                def body(i, acc):
                    outs = call(q, k, v, i, lens, c, probs)
                    return acc + sum(jnp.sum(o[..., :1].astype(jnp.float32)) for o in outs)
                return jax.lax.fori_loop(0, L, body, jnp.float32(0))

            try:
                ms = time_ms(loop, q, k, v, lens, warmup=1, iters=3 if INTERPRET else 10)
            except Exception as e:  # noqa: BLE001 - a config the compiler rejects is reported, not hidden
                res["rows"].append(dict(case=label, config=dict(vars(c)), error=str(e).splitlines()[0][:200]))
                continue
            p = plan(B, T, Hq, Hkv, N + 640, c)
            res["rows"].append(dict(case=label, layers=L, head_dim=D, batch=B, T=T, return_probs=probs,
                                    config=dict(vars(c)), ms=ms, tbs=tb / ms * 1e3, splits=p["splits"], Mb=p["Mb"],
                                    default=c == default))
        del q, k, v
        json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), os.environ.get("JSON", "sweep.json")), "w"), indent=1)
    for label, *_ in CASES:
        rows = sorted([r for r in res["rows"] if r["case"] == label and "ms" in r], key=lambda r: r["ms"])
        d = [r for r in rows if r["default"]][0]
        print(f"{label}: default {d['ms']:.3f} ms ({d['tbs']:.2f} TB/s, splits {d['splits']})")
        for r in sorted(rows, key=lambda r: (r["config"]["block_k"], str(r["config"]["num_stages"]), r["splits"])):
            print(f"      bk {r['config']['block_k']} stages {r['config']['num_stages']} splits {r['splits']}: "
                  f"{r['ms']:.3f} ms")
        for r in rows[:6]:
            print(f"   {r['ms']:.3f} ms {r['tbs']:.2f} TB/s splits {r['splits']} {r['config']}")


if __name__ == "__main__":
    main()

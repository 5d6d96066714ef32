"""GPU check of the gathered decode with one index row for all T queries (2026-12-06), before timing it.

1. `sparse_decode_stacked_gpu` compiled for this GPU (not the interpreter) at an STS verification's shape (Llama-3.1-8B
   attention: 32 query heads, 8 KV heads, head_dim 128; batch 3, T = 5 queries, 517 keys per row and KV head, the 5
   newest among them, 100K-key rows of different lengths, 4 layers of the stacked cache): the shared row
   [B, Hkv, 1, K] against the same row broadcast to [B, Hkv, T, K] (the kernel's per-query programs) and against the
   reference; outputs and log-sum-exps.
2. Both launches timed alone (median of 50 calls in one jit of 32 layers' worth, the layer index cycling), and the
   shared launch at other `DecodeConfig`s (block_k, num_splits).
3. The verification's index merge (`jsparse.methods.sts.merge_rows`) at its 100K shape (32 layers x batch 3 rows,
   8 KV heads, 4 x 516 draft entries each, budget 512): the three-operand stable sort (bound None) against the
   packed one-key sort (bound = the capacity): the same keys, and each timed.
Writes $OUT/check_shared.json; exits non-zero when a check fails.
Usage (repo root): PYTHONPATH=. OUT=... GIT_COMMIT=... python eval/results/h100/sts_shared/check_shared.py
(SMOKE=1: tiny shapes, the kernel interpreted: a CPU check of the script).
"""
import dataclasses, datetime, json, os, sys, time
import numpy as np
import jax, jax.numpy as jnp

from jsparse.methods.sts import merge_rows
from pallas_kernels.sparse_attention import gpu, reference as ref
from pallas_kernels.sparse_attention import stacked

SMOKE = bool(os.environ.get("SMOKE"))
L, B, T, Hq, Hkv, D = 4, 3, 5, 32, 8, 128
N, K = (640, 40) if SMOKE else (100_352, 517)
out_dir = os.environ.get("OUT", "/tmp")
res = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, commit=os.environ.get("GIT_COMMIT", ""),
           date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           command="python eval/results/h100/sts_shared/check_shared.py", shape=dict(L=L, B=B, T=T, Hq=Hq, Hkv=Hkv,
                                                                                  D=D, N=N, K=K))
ks = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(ks[0], (B, T, Hq, D), jnp.bfloat16)
k_all = jax.random.normal(ks[1], (L, B, Hkv, N, D), jnp.bfloat16)
v_all = jax.random.normal(ks[2], (L, B, Hkv, N, D), jnp.bfloat16)
lengths = np.array([N - 300, N * 7 // 9, 300], np.int32)
rng = np.random.default_rng(0)
rows = np.full((B, Hkv, 1, K), -1, np.int32)
for b, n in enumerate(lengths):  # K - T keys before the T newest, then the T newest (each query sees its own)
    for h in range(Hkv):
        old = np.sort(rng.choice(n - T, size=min(K - T, n - T), replace=False))
        rows[b, h, 0, :len(old) + T] = np.concatenate([old, np.arange(n - T, n)])
one, lens = jnp.asarray(rows), jnp.asarray(lengths)
every = jnp.broadcast_to(one, (B, Hkv, T, K))
layer = jnp.int32(2)
def launcher(config=gpu.DecodeConfig()):
    """fn(rows, layer, q, k_all, v_all, lengths): every array an argument (a jit closing over 10 GB of cache would
    embed it as constants and take minutes to compile)."""
    return jax.jit(lambda r, lay, q, k_all, v_all, lens: stacked.sparse_decode_stacked_gpu(
        q, k_all, v_all, lay, r, lens, return_lse=True, config=config, interpret=SMOKE))


run = launcher()
got, got_lse = run(one, layer, q, k_all, v_all, lens)
old, old_lse = run(every, layer, q, k_all, v_all, lens)
want, want_lse = ref.sparse_decode_reference(q, k_all[2], v_all[2], every, lens, return_lse=True)
f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))  # noqa: E731
errs = dict(shared_vs_reference=float(np.max(np.abs(f32(got) - f32(want)))),
            shared_lse_vs_reference=float(np.max(np.abs(f32(got_lse) - f32(want_lse)))),
            per_query_vs_reference=float(np.max(np.abs(f32(old) - f32(want)))),
            shared_vs_per_query=float(np.max(np.abs(f32(got) - f32(old)))))
ok = errs["shared_vs_reference"] <= 2e-2 and errs["shared_lse_vs_reference"] <= 1e-3 and \
    errs["shared_vs_per_query"] <= 2e-2 and np.isfinite(f32(got)).all()
res["errors"] = errs
res["ok"] = bool(ok)
print("shared rows vs reference:", errs, "OK" if ok else "FAILED", flush=True)


def timed(r, reps=3 if SMOKE else 50, fn=run):
    """ms per launch: 32 launches (layers cycling) in one jit, median over reps calls."""
    @jax.jit
    def loop(acc, r, q, k_all, v_all, lens):  # the arrays as arguments, not constants
        def body(i, acc):
            return acc + fn(r, i % L, q, k_all, v_all, lens)[0][0, 0, 0, 0].astype(jnp.float32)
        return jax.lax.fori_loop(0, 32, body, acc)
    args = (jnp.float32(0), r, q, k_all, v_all, lens)
    jax.block_until_ready(loop(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(loop(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) / 32 * 1e3


res["ms_per_launch"] = dict(shared=timed(one), per_query=timed(every))
for bk in (32, 64):
    for splits in (None, 2, 3, 5):
        cfg = gpu.DecodeConfig(block_k=bk, num_splits=splits)
        res["ms_per_launch"][f"shared_block_k{bk}_splits{splits}"] = timed(one, fn=launcher(cfg))
print("ms per launch:", res["ms_per_launch"], flush=True)

# 3. the index merge
R, H, C, N_cap, budget = (32 * B, Hkv, 4 * 516, 100_640, 512) if not SMOKE else (6, Hkv, 4 * 20, 640, 16)
limit = jnp.asarray(np.tile(lengths - T, R // B).clip(1, None), jnp.int32)
idx = np.sort(rng.integers(0, int(lengths.min()) - T, (R, H, 4, C // 4)), axis=-1).reshape(R, H, C).astype(np.int32)
idx, val = jnp.asarray(idx), jnp.asarray(rng.random((R, H, C)), jnp.float32)
merge = {b: jax.jit(lambda i, v, lim, b=b: merge_rows(i, v, lim, budget, budget, bound=b)) for b in (None, N_cap)}
keys = {b: np.asarray(m(idx, val, limit)) for b, m in merge.items()}
same = bool(np.array_equal(keys[None], keys[N_cap]))
ok &= same


def timed_merge(m, reps=3 if SMOKE else 50):
    jax.block_until_ready(m(idx, val, limit))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(m(idx, val, limit))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3


res["merge"] = dict(shape=[R, H, C], same_keys=same, ms_stable_sort=timed_merge(merge[None]),
                    ms_packed_sort=timed_merge(merge[N_cap]))
res["ok"] = bool(ok)
print("merge:", res["merge"], flush=True)
json.dump(res, open(os.path.join(out_dir, "check_shared.json"), "w"), indent=1)
sys.exit(0 if ok else 1)

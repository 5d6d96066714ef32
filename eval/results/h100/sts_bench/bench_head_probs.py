"""STS's draft record step on the GPU: the XLA weights (`head_probs` on the layer's slice) against the in-place
kernels (`pallas_kernels.dense_decode` with its log-sum-exp + `pallas_kernels.head_probs`), issue 23.

Llama-3.2-1B-shaped draft layer (32 query / 8 KV heads, d 64, bf16), a stacked cache of 16 layers x N = 100000
rows filled with random normal values, batch 2, every row full (lengths = N), T in {1, 2} new queries (a later
draft step and a round's opening step), the layer index traced. First correctness on small shapes (the compiled
kernels against the jnp references, incl. a row shorter than N and T * G over several query tiles) and at the
full shape (new weights against the XLA ones, and the top-W sets they give), then timings (median of REPS calls,
jax.block_until_ready, all jitted with `models.compile_options.model_jit`, as the model's steps are):

  old_probs     `jsparse.methods.sts.head_probs(q, k_all[layer], positions).sum(2)` (XLA: slice, GEMM, softmax)
  old_step      `sts.attend_and_probs(..., in_place=False)`: old_probs + the in-place dense decode (the draft's
                record step before this change)
  two_kernels   the in-place path before the fused one: dense decode with lse + head_probs_stacked (reads K twice)
  new_step      `sts.attend_and_probs(..., in_place=True)`: the dense decode kernel writing its logits and one
                XLA pass taking the weights from them (`dense_decode_stacked(..., return_probs=True)`; K read once)
  dense         the in-place dense decode alone (what a plain dense draft step does per layer)
  dense_lse     the same kernel returning lse too
  probs_kernel  `head_probs_stacked_gpu` alone (lse given), per `HeadProbsConfig` variant (CONFIGS)

Bytes floor of probs_kernel: K of the visible keys (B * Hkv * N * D * 2) + the output (B * Hq * N * 4).
Writes $OUT/bench_head_probs.json (device, jax version, date, commit from GIT_COMMIT) and prints a table last.

Environment: REPS (default 20), SMOKE=1 (tiny shapes, kernels in the Pallas interpreter: a CPU check of the script).
GPU: `OUT=... GIT_COMMIT=$(git rev-parse --short HEAD) PYTHONPATH=. python eval/results/h100/sts_bench/bench_head_probs.py`.
"""
import datetime, json, os, time, traceback
import numpy as np
import jax, jax.numpy as jnp

from jsparse import selection as sel
from jsparse.methods import sts
from models.attention import LayerKV
from models.compile_options import model_jit
from pallas_kernels.dense_decode import dense_decode_stacked_reference
from pallas_kernels.dense_decode import gpu as dgpu
from pallas_kernels.head_probs import gpu as hgpu
from pallas_kernels.head_probs import head_probs_stacked_reference

COMMAND = ("OUT=... GIT_COMMIT=$(git rev-parse --short HEAD) PYTHONPATH=. "
           "python eval/results/h100/sts_bench/bench_head_probs.py")
SMOKE = bool(os.environ.get("SMOKE"))
REPS = int(os.environ.get("REPS", 3 if SMOKE else 20))
L, B, HQ, HKV, D = (2, 2, 4, 2, 16) if SMOKE else (16, 2, 32, 8, 64)
N = 200 if SMOKE else 100000
W = 24 if SMOKE else 512 + 8  # a draft record's width at budget 512, gamma 4 (+ slack)
LAYER = 1 if SMOKE else 5
BF = jnp.bfloat16
CONFIGS = {"default": hgpu.HeadProbsConfig(), "bk128": hgpu.HeadProbsConfig(block_k=128),
           "bk128_w8": hgpu.HeadProbsConfig(block_k=128, num_warps=8),
           "bk64_p1024": hgpu.HeadProbsConfig(target_programs=1024)}
if SMOKE:
    CONFIGS = {"default": hgpu.HeadProbsConfig(block_k=16)}
    DCFG = dgpu.DenseDecodeConfig(block_k=16)
else:
    DCFG = dgpu.DenseDecodeConfig()


# (L, B, T, Hq, Hkv, D, N, lengths, config): a row shorter than N, T * G over several query tiles (block_q 16), and
# a row whose length is near T.
SMALL_CASES = [(3, 2, 2, 32, 8, 64, 3000, [3000, 1234], hgpu.HeadProbsConfig()),
               (2, 1, 5, 16, 4, 64, 777, [700], hgpu.HeadProbsConfig(block_q=16)),
               (2, 2, 1, 32, 8, 64, 1000, [1000, 3], hgpu.HeadProbsConfig(block_k=128, num_warps=8))]
if SMOKE:
    SMALL_CASES = [(2, 2, 2, 8, 2, 16, 50, [50, 3], hgpu.HeadProbsConfig(block_k=16)),
                   (2, 1, 5, 16, 4, 16, 40, [33], hgpu.HeadProbsConfig(block_k=16, block_q=16))]


def timeit(fn, *args, n=REPS, warm=2):
    """Median ms of n calls of fn(*args) after warm-up."""
    for _ in range(warm):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3


def rel_err(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(1.0, float(np.max(np.abs(want)))))


def patch_interpret():
    """SMOKE on a CPU: sts's kernel entry point runs the Triton kernel in the interpreter."""
    sts.dense_decode_stacked = lambda q, ka, va, layer, lens, return_probs, implementation: \
        dgpu.dense_decode_stacked_gpu(q, ka, va, layer, lens, return_probs=return_probs, config=DCFG, interpret=True)


def small_checks():
    """The compiled kernels against the jnp references on small shapes."""
    out = []
    rng = np.random.default_rng(0)
    for (l, b, t, hq, hkv, d, n, lens, cfg) in SMALL_CASES:
        q = jnp.asarray(rng.standard_normal((b, t, hq, d)), BF)
        ka = jnp.asarray(rng.standard_normal((l, b, hkv, n, d)), BF)
        va = jnp.asarray(rng.standard_normal((l, b, hkv, n, d)), BF)
        lens = jnp.asarray(lens, jnp.int32)
        o, lse = dgpu.dense_decode_stacked_gpu(q, ka, va, jnp.int32(1), lens, return_lse=True, config=DCFG,
                                               interpret=SMOKE)
        ro, rlse = dense_decode_stacked_reference(q, ka, va, jnp.int32(1), lens, return_lse=True)
        p = hgpu.head_probs_stacked_gpu(q, ka, jnp.int32(1), lens, lse, config=cfg, interpret=SMOKE)
        rp = head_probs_stacked_reference(q, ka, jnp.int32(1), lens, rlse)
        xla = sts.head_probs(q, ka[1], sel.decode_positions(lens, t)).sum(axis=2)
        _, fused = dgpu.dense_decode_stacked_gpu(q, ka, va, jnp.int32(1), lens, return_probs=True, config=DCFG,
                                                 interpret=SMOKE)
        past = max(float(jnp.max(jnp.abs(p[i, :, int(lens[i]):]))) if int(lens[i]) < n else 0.0 for i in range(b))
        row = dict(shape=dict(L=l, B=b, T=t, Hq=hq, Hkv=hkv, D=d, N=n, lengths=np.asarray(lens).tolist()),
                   plan=hgpu.plan(b, t, hq, hkv, n, cfg), out_err=rel_err(o, ro), lse_err=rel_err(lse, rlse),
                   probs_err=rel_err(p, rp), probs_vs_xla_err=rel_err(p, xla), max_past_lengths=past,
                   fused_probs_err=rel_err(fused, rp),
                   fused_max_past_lengths=max(float(jnp.max(jnp.abs(fused[i, :, int(lens[i]):])))
                                              if int(lens[i]) < n else 0.0 for i in range(b)))
        row["ok"] = bool(row["out_err"] < 2e-2 and row["lse_err"] < 1e-3 and row["probs_err"] < 1e-3
                         and row["probs_vs_xla_err"] < 1e-2 and past == 0.0 and row["fused_probs_err"] < 1e-3
                         and row["fused_max_past_lengths"] == 0.0)
        out.append(row)
        print("check", json.dumps(row), flush=True)
    return out


def main():
    out_dir = os.environ.get("OUT", "/tmp")
    os.makedirs(out_dir, exist_ok=True)
    if SMOKE:
        patch_interpret()
    res = dict(command=COMMAND + (" (SMOKE=1)" if SMOKE else ""),
               device=str(jax.devices()[0].device_kind), jax=jax.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               commit=os.environ.get("GIT_COMMIT", "unknown"), smoke=SMOKE, reps=REPS,
               shape=dict(L=L, B=B, Hq=HQ, Hkv=HKV, D=D, N=N, lengths=N, layer=LAYER, dtype="bfloat16"),
               compiler_options="models.compile_options.model_jit", configs={k: str(v) for k, v in CONFIGS.items()})
    res["small_checks"] = small_checks()

    shape = (L, B, HKV, N, D)
    k_all = jax.jit(lambda: jax.random.normal(jax.random.key(1), shape, BF))()
    v_all = jax.jit(lambda: jax.random.normal(jax.random.key(2), shape, BF))()
    lens = jnp.full((B,), N, jnp.int32)
    layer = jnp.int32(LAYER)

    def view(ka, va, layer):
        return LayerKV(k=ka[layer], v=va[layer], k_all=ka, v_all=va, layer=layer)

    old_probs = model_jit(lambda q, ka, layer, lens: sts.head_probs(
        q, ka[layer], sel.decode_positions(lens, q.shape[1])).sum(axis=2))
    old_step = model_jit(lambda q, ka, va, layer, lens: sts.attend_and_probs(q, view(ka, va, layer), lens,
                                                                             in_place=False))
    new_step = model_jit(lambda q, ka, va, layer, lens: sts.attend_and_probs(q, view(ka, va, layer), lens,
                                                                             in_place=True))
    def two(q, ka, va, layer, lens):
        out, lse = dgpu.dense_decode_stacked_gpu(q, ka, va, layer, lens, return_lse=True, config=DCFG, interpret=SMOKE)
        return out, hgpu.head_probs_stacked_gpu(q, ka, layer, lens, lse, config=CONFIGS["default"], interpret=SMOKE)
    two_kernels = model_jit(two)
    dense = model_jit(lambda q, ka, va, layer, lens: dgpu.dense_decode_stacked_gpu(q, ka, va, layer, lens,
                                                                                   config=DCFG, interpret=SMOKE))
    dense_lse = model_jit(lambda q, ka, va, layer, lens: dgpu.dense_decode_stacked_gpu(
        q, ka, va, layer, lens, return_lse=True, config=DCFG, interpret=SMOKE))
    topw = jax.jit(lambda p: jax.lax.top_k(p, W)[1])

    rows = []
    for T in (1, 2):
        row = dict(T=T)
        try:
            q = jax.random.normal(jax.random.key(10 + T), (B, T, HQ, D), BF)
            # correctness at the full shape: new weights vs XLA's, and the top-W keys they choose
            p_old = old_probs(q, k_all, layer, lens)
            out_new, p_new = new_step(q, k_all, v_all, layer, lens)
            out_old, _ = old_step(q, k_all, v_all, layer, lens)
            i_old, i_new = np.sort(np.asarray(topw(p_old)), -1), np.sort(np.asarray(topw(p_new)), -1)
            row.update(probs_err=rel_err(p_new, p_old), out_err=rel_err(out_new, out_old),
                       topw_sets_equal=float(np.mean(np.all(i_old == i_new, axis=-1))),
                       topw_overlap=float(np.mean([len(np.intersect1d(a, b)) / W for a, b in
                                                   zip(i_old.reshape(-1, W), i_new.reshape(-1, W))])),
                       row_sums=float(np.mean(np.asarray(p_new).sum(-1))))
            del p_old, p_new, out_new, out_old
            row["old_probs_ms"] = timeit(old_probs, q, k_all, layer, lens)
            row["old_step_ms"] = timeit(old_step, q, k_all, v_all, layer, lens)
            row["new_step_ms"] = timeit(new_step, q, k_all, v_all, layer, lens)
            row["two_kernels_ms"] = timeit(two_kernels, q, k_all, v_all, layer, lens)
            row["dense_ms"] = timeit(dense, q, k_all, v_all, layer, lens)
            row["dense_lse_ms"] = timeit(dense_lse, q, k_all, v_all, layer, lens)
            lse = dense_lse(q, k_all, v_all, layer, lens)[1]
            floor_bytes = B * HKV * N * D * 2 + B * HQ * N * 4
            row["probs_bytes"] = floor_bytes
            row["probs_kernel"] = {}
            for name, cfg in CONFIGS.items():
                f = model_jit(lambda q, ka, layer, lens, lse, cfg=cfg: hgpu.head_probs_stacked_gpu(
                    q, ka, layer, lens, lse, config=cfg, interpret=SMOKE))
                ms = timeit(f, q, k_all, layer, lens, lse)
                row["probs_kernel"][name] = dict(ms=ms, GBps=floor_bytes / ms / 1e6,
                                                 plan=hgpu.plan(B, T, HQ, HKV, N, cfg))
            row["speedup_step"] = row["old_step_ms"] / row["new_step_ms"]
        except Exception:  # keep the other cell
            row["error"] = traceback.format_exc()[-1500:]
            print(row["error"], flush=True)
        rows.append(row)
        print("T", T, json.dumps(row)[:600], flush=True)
    res["rows"] = rows
    path = os.path.join(out_dir, os.environ.get("JSON", "bench_head_probs.json"))
    with open(path, "w") as f:
        json.dump(res, f, indent=1)

    print(f"\n{res['device']}, jax {res['jax']}, commit {res['commit']}; one draft layer, B={B}, N={N}, "
          f"Hq/Hkv/D={HQ}/{HKV}/{D}, bf16; ms per layer (median of {REPS}); small checks ok: "
          f"{all(r['ok'] for r in res['small_checks'])}")
    print("T | old_probs | old_step | two kernels | new_step | speedup | dense | dense+lse | probs kernel (best cfg, "
          "GB/s) | probs err | top-W sets equal")
    for r in rows:
        if "error" in r:
            print(f"{r['T']} | error")
            continue
        best = min(r["probs_kernel"], key=lambda k: r["probs_kernel"][k]["ms"])
        pk = r["probs_kernel"][best]
        print(f"{r['T']} | {r['old_probs_ms']:.3f} | {r['old_step_ms']:.3f} | {r['two_kernels_ms']:.3f} | "
              f"{r['new_step_ms']:.3f} | "
              f"{r['speedup_step']:.2f}x | {r['dense_ms']:.3f} | {r['dense_lse_ms']:.3f} | {pk['ms']:.3f} ({best}, "
              f"{pk['GBps']:.0f}) | {r['probs_err']:.1e} | {r['topw_sets_equal']:.3f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

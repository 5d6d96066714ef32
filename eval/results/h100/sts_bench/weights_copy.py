"""Does the layer scan copy each layer's weights before its GEMMs? Times the Llama-3.1-8B-shaped decode step
(random bf16 weights, context 1K, batch B, T query tokens) in a fresh process per XLA flag set and unroll, and sums
the profile's memcpy kernels. Usage: python weights_copy.py (parent: runs every variant; prints a table and writes
$OUT/weights_copy.json)."""
import json, os, subprocess, sys, time

VARIANTS = [("default", "", 1), ("unroll", "", 0),
            ("dsfusion", "--xla_gpu_enable_dynamic_slice_fusion=true", 1),
            ("no_triton_gemm", "--xla_gpu_enable_triton_gemm=false", 1),
            ("no_triton+dsfusion", "--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_dynamic_slice_fusion=true", 1),
            ("no_triton_gemm+unroll", "--xla_gpu_enable_triton_gemm=false", 0)]
# LOOP=8: each timed call runs 8 decode steps in one jitted fori_loop (as `jsparse bench model` and `generate` do)
if os.environ.get("VARIANTS"):
    VARIANTS = [v for v in VARIANTS if v[0] in os.environ["VARIANTS"].split(",")]


def child(unroll):
    import numpy as np
    import jax, jax.numpy as jnp
    sys.path.insert(0, os.path.dirname(__file__))
    import bench_sts as bs
    from profile_sts import kernel_totals
    from jsparse.methods.base import make_method
    from models import llama
    cfg, B = bs.T_CFG, int(os.environ.get("B", 2))
    tp = bs.random_params(cfg, jax.random.key(0), bs.BF)
    dense = make_method("dense")
    res = {}
    for T in (1, 5):
        steps = int(os.environ.get("LOOP", 0))
        one = lambda p, t, c: llama.decode(p, cfg, dense, t, c, None, unroll=True if unroll == 0 else 1)[:2]  # noqa
        if steps:  # the logits of the last step; every step writes its T tokens at the next positions
            def looped(p, t, c):
                lg, c = jax.lax.fori_loop(0, steps - 1, lambda i, lc: one(p, t, lc[1]), one(p, t, c))
                return lg, c
            dec = jax.jit(looped, donate_argnums=(2,))
        else:
            dec = jax.jit(one, donate_argnums=(2,))
        c = bs.cache(cfg, B, 1664, 1024)
        toks = jnp.ones((B, T), jnp.int32)
        fn = lambda c: dec(tp, toks, c)[1]  # noqa: E731
        t0 = time.perf_counter(); c = jax.block_until_ready(fn(c)); comp = time.perf_counter() - t0
        ref = np.asarray(dec(tp, toks, bs.cache(cfg, B, 1664, 1024))[0][:, -1, :8], np.float32)
        ms, c = bs.timeit(fn, c, n=10, warm=2)
        d = f"/tmp/wc_{os.getpid()}_{T}"
        with jax.profiler.trace(d, create_perfetto_trace=True):
            c = jax.block_until_ready(fn(c))
        tot = kernel_totals(d)
        ms /= max(steps, 1)
        res[f"T{T}"] = dict(ms=ms, steps_per_call=max(steps, 1), compile_s=comp, memcpy_us=sum(v for k, v in tot.items() if "memcpy" in k) / max(steps, 1),
                           gpu_us=sum(tot.values()), logits_head=ref.tolist())
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(int(sys.argv[1]))
        sys.exit()
    out, rows = os.environ.get("OUT", "/tmp"), []
    for name, flags, unroll in VARIANTS:
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
        p = subprocess.run([sys.executable, __file__, str(unroll)], env=env, capture_output=True, text=True)
        line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
        r = json.loads(line[0][7:]) if line else dict(error=p.stderr[-800:])
        rows.append(dict(variant=name, xla_flags=flags, unroll=unroll or "full", **r))
        print(name, json.dumps(r)[:400], flush=True)
    json.dump(dict(command="LOOP=%s python eval/results/h100/sts_bench/weights_copy.py" % os.environ.get("LOOP", 0),
                   commit=os.environ.get("GIT_COMMIT", ""), loop_steps=int(os.environ.get("LOOP", 0)), rows=rows),
              open(os.path.join(out, os.environ.get("JSON", "weights_copy.json")), "w"), indent=1)
    print("\nvariant                 T1 ms  memcpy us |  T5 ms  memcpy us")
    for r in rows:
        if "T1" in r:
            print(f"{r['variant']:22s} {r['T1']['ms']:6.2f} {r['T1']['memcpy_us']:9.0f} | {r['T5']['ms']:6.2f} "
                  f"{r['T5']['memcpy_us']:9.0f}")

"""The fixed cost of a decode step: what a Llama-3.1-8B-shaped forward costs when attention is nearly free.

Issue 23's verification bar (3.0x dense at 100K) and issue 24's 0.85 share of the bytes floor both run into the
part of a step that does not depend on the context: the GEMMs over 16 GB of weights and ~20 small kernels per
layer. This script measures that part on the GPU, random bf16 weights, dense attention over a 512-token cache:

  A. whole decode steps (`models.llama.decode` under `model_jit`, the cache donated) at (B, T) = (3, 5) (the STS
     verification's rows), (4, 1) and (1, 1), for each VARIANT, each in its own process (XLA reads XLA_FLAGS at
     start-up): "base"; "cmdbuf" (CUDA graphs also for while loops and dynamic-slice fusions:
     --xla_gpu_enable_command_buffer=...,WHILE,CONDITIONAL,DYNAMIC_SLICE_FUSION); "unroll2" / "unroll4" (the
     layer scan unrolled); "lt" (cuBLASLt GEMMs); "splitkS" (the down and output projections as S batched GEMMs
     over slices of their contraction, `split_k_dense`, the partial sums added in f32); "fused" (q/k/v and
     gate/up as one weight each, `fused_layers`);
  B. the layer GEMMs alone, each in a scan over the 32 stacked layers, at M = B * T rows, in the current layout and
     in the alternatives (gate and up in one [E, 2F] weight; q, k, v in one; the weights stored transposed; the
     contraction split into S batched GEMMs), as
     ms per forward and TB/s of weight bytes;
  C. the achievable read bandwidth (a reduction over the same 16 GB);
  E. each layer GEMM as `stacked_matmul.py` here (split-K Triton kernel reading the stacked weights in
     place) against cuBLAS, for a few kernel configs, each checked against the jnp reference once.

Writes $OUT/bench_fixed.json (every row; a run cut short keeps what it measured) and prints a table last.
Environment: VARIANTS (default "base,cmdbuf,unroll2,lt"; also "unroll4", "splitk2/4/8"), PARTS (default "A,B,C"),
GEMMS (part B's rows, ";"-separated names; default all), GIT_COMMIT.
Run: `OUT=... PYTHONPATH=. python eval/results/h100/decode_fixed/bench_fixed.py`.
"""
import datetime, json, os, subprocess, sys, time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "sts_bench")]  # stacked_matmul.py (part E); bench_sts.timeit

CMDBUF = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL,"
          "DYNAMIC_SLICE_FUSION --xla_gpu_graph_min_graph_size=1")
VARIANT_FLAGS = {"base": "", "cmdbuf": CMDBUF, "unroll2": "", "unroll4": "", "lt": "--xla_gpu_enable_cublaslt=true",
                 "splitk2": "", "splitk4": "", "splitk8": "", "fused": ""}


def fused_layers(llama, params):
    """The "fused" variant: q, k, v in one [E, (Hq + 2 Hkv) D] weight and gate, up in one [E, 2F] weight per layer
    (held in the wq and w_gate fields, wk, wv and w_up emptied), with `models.llama`'s q/k/v projection and MLP
    patched to read them: one GEMM where the library runs three and two."""
    import jax.numpy as jnp
    lp = params.layers
    L, E = lp.wq.shape[:2]
    hq, hk = lp.wq.shape[2], lp.wk.shape[2]
    qkv = jnp.concatenate([lp.wq.reshape(L, E, -1), lp.wk.reshape(L, E, -1), lp.wv.reshape(L, E, -1)], axis=-1)
    gate_up = jnp.concatenate([lp.w_gate, lp.w_up], axis=-1)
    empty = jnp.zeros((L, 1, 1), lp.wq.dtype)
    params = params.replace(layers=lp.replace(wq=qkv, wk=empty, wv=empty, w_gate=gate_up, w_up=empty))

    def qkv_projection(cfg, lp, h, positions, inv_freq):
        B, T, _ = h.shape
        D = cfg.head_dim
        y = llama._dense(h, lp.wq, "bte,ef->btf")
        q = y[..., :hq * D].reshape(B, T, hq, D)
        k = y[..., hq * D:(hq + hk) * D].reshape(B, T, hk, D)
        v = y[..., (hq + hk) * D:].reshape(B, T, hk, D)
        return llama.apply_rope(q, positions, inv_freq), llama.apply_rope(k, positions, inv_freq), v

    def mlp(cfg, lp, x):
        h = llama.rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
        gu = llama._dense(h, lp.w_gate, "bte,ef->btf")
        F = gu.shape[-1] // 2
        act = (jax.nn.silu(gu[..., :F].astype(jnp.float32)) * gu[..., F:].astype(jnp.float32)).astype(x.dtype)
        return llama._dense(act, lp.w_down, "btf,fe->bte")
    import jax
    llama.qkv_projection, llama.mlp = qkv_projection, mlp
    return params


def split_k_dense(S):
    """`models.llama._dense` with the down and output projections' contraction split into S batched GEMMs (one
    cuBLAS batched call of S times as many tiles; the S partial sums added in f32): those GEMMs have N = E = 4096
    outputs, too few tiles to keep every SM reading weights at M <= 16 rows."""
    import jax.numpy as jnp
    from models import llama
    plain = llama._dense

    def dense(x, w, spec, bias=None):
        if bias is not None or spec not in ("btf,fe->bte", "bthd,hde->bte"):
            return plain(x, w, spec, bias)
        B, T = x.shape[:2]
        if spec == "btf,fe->bte":
            xs, ws, sp = x.reshape(B, T, S, -1), w.reshape(S, -1, w.shape[-1]), "btsf,sfe->sbte"
        else:
            H, D, E = w.shape
            xs, ws, sp = x.reshape(B, T, S, H // S, D), w.reshape(S, H // S, D, E), "btshd,shde->sbte"
        return jnp.einsum(sp, xs, ws, preferred_element_type=jnp.float32).sum(0).astype(x.dtype)
    return dense
SHAPES = [(3, 5), (4, 1), (1, 1)]
ONLY_GEMMS = [x for x in os.environ.get("GEMMS", "").split(";") if x]  # part B: these rows only (default all)
SMOKE = bool(os.environ.get("SMOKE"))  # tiny shapes: a CPU check of the script


def config():
    import dataclasses
    from models.presets import preset
    cfg = preset("llama3-8b")
    if SMOKE:
        cfg = dataclasses.replace(cfg, vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                                  num_heads=4, num_kv_heads=2, head_dim=16)
    return cfg


def timeit(fn, carry):
    """fn(carry) -> carry; median ms of 10 calls after 3 warm-up calls (`bench_sts.timeit`)."""
    from bench_sts import timeit as median_ms
    return median_ms(fn, carry, n=10, warm=3)


def part_a(variant):
    """One process: whole decode steps of this variant. Prints one JSON line per shape."""
    import jax, jax.numpy as jnp
    from eval.bench.model import filled_cache
    from jsparse.methods.base import make_method
    from models import llama
    from models.compile_options import model_jit
    from models.params import random_params
    cfg = config()
    params = random_params(cfg, jax.random.key(0), jnp.bfloat16)
    dense = make_method("dense")
    unroll = int(variant[6:]) if variant.startswith("unroll") else 1
    if variant.startswith("splitk"):
        llama._dense = split_k_dense(int(variant[6:]))
    if variant == "fused":
        params = fused_layers(llama, params)
    for B, T in SHAPES:
        t0 = time.perf_counter()
        dec = model_jit(lambda p, t, c: llama.decode(p, cfg, dense, t, c, None, unroll=unroll)[1],
                        donate_argnums=(2,))
        cache = filled_cache(cfg, B, 512, 1024, jnp.bfloat16)
        toks = jnp.ones((B, T), jnp.int32)
        cache = jax.block_until_ready(dec(params, toks, cache.replace(lengths=cache.lengths * 0 + 512)))
        compile_s = time.perf_counter() - t0

        def step(c):  # the cache rewinds to 512 so the step's work stays the same
            return dec(params, toks, c.replace(lengths=c.lengths * 0 + 512))
        ms, cache = timeit(step, cache)
        print("ROW " + json.dumps(dict(part="A", variant=variant, batch=B, queries=T, step_ms=ms,
                                       compile_s=compile_s)), flush=True)


def part_b(out_rows):
    import jax, jax.numpy as jnp
    from models.compile_options import model_jit
    cfg = config()
    L, E, F, H, K, D = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, \
        cfg.head_dim
    key = jax.random.key(1)

    def w(*shape):
        return (0.02 * jax.random.normal(key, (L,) + shape, jnp.float32)).astype(jnp.bfloat16)

    cases = {  # name: (weights, spec per weight, input width)
        "gate+up [E,F] x2 (current)": ([w(E, F), w(E, F)], "te,ef->tf", E),
        "gate_up [E,2F] one": ([w(E, 2 * F)], "te,ef->tf", E),
        "gate+up [F,E] x2 (transposed)": ([w(F, E), w(F, E)], "te,fe->tf", E),
        "down [F,E] (current)": ([w(F, E)], "tf,fe->te", F),
        "down [E,F] (transposed)": ([w(E, F)], "tf,ef->te", F),
        "q,k,v [E,*] x3 (current)": ([w(E, H * D), w(E, K * D), w(E, K * D)], "te,ef->tf", E),
        "qkv [E,(H+2K)D] one": ([w(E, (H + 2 * K) * D)], "te,ef->tf", E),
        "q,k,v [*,E] x3 (transposed)": ([w(H * D, E), w(K * D, E), w(K * D, E)], "te,fe->tf", E),
        "o [HD,E] (current)": ([w(H * D, E)], "tf,fe->te", H * D),
        "down split 2": ([w(2, F // 2, E)], "tsf,sfe->ste", F),
        "down split 4": ([w(4, F // 4, E)], "tsf,sfe->ste", F),
        "down split 8": ([w(8, F // 8, E)], "tsf,sfe->ste", F),
        "o split 2": ([w(2, H * D // 2, E)], "tsf,sfe->ste", H * D),
        "o split 4": ([w(4, H * D // 4, E)], "tsf,sfe->ste", H * D),
        "o [E,HD] (transposed)": ([w(E, H * D)], "tf,ef->te", H * D),
    }
    for M in (15, 4, 1):
        for name, (ws, spec, width) in cases.items():
            if name not in ONLY_GEMMS and ONLY_GEMMS:
                continue
            x = jnp.ones((M, width), jnp.bfloat16)
            if "split" in name:
                x = x.reshape(M, ws[0].shape[1], -1)

            @model_jit
            def run(ws, x):
                def body(c, lw):
                    pe = jnp.float32 if "split" in name else jnp.bfloat16
                    ys = [jnp.einsum(spec, x + c, wi, preferred_element_type=pe) for wi in lw]
                    return c + sum(y.astype(jnp.float32).sum() for y in ys).astype(x.dtype) * 0, None
                return jax.lax.scan(body, jnp.zeros((), x.dtype), ws)[0]
            ms, _ = timeit(lambda _: run(ws, x), None)
            nbytes = sum(wi.size * 2 for wi in ws)
            row = dict(part="B", gemm=name, rows=M, ms_per_forward=ms, weight_gb=nbytes / 1e9,
                       tb_per_s=nbytes / ms / 1e9)
            print("ROW " + json.dumps(row), flush=True)
            out_rows.append(row)
        del x


KERNEL_CONFIGS = [(64, 128, 4, 4, 264), (256, 64, 8, 3, 264), (64, 256, 4, 3, 528), (128, 128, 4, 3, 528)]  # block_n, block_k, warps, stages, target_programs


def part_e(out_rows):
    """The layer GEMMs as `stacked_matmul.stacked_matmul_gpu` (the weights read in place from the stacked array) against
    cuBLAS (the einsum on the scan's weight slice), per shape, rows and kernel config; checked once per shape."""
    import jax, jax.numpy as jnp
    from models.compile_options import model_jit
    from stacked_matmul import StackedMatmulConfig, stacked_matmul_gpu, stacked_matmul_reference
    cfg = config()
    L, E, F, H, K, D = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, \
        cfg.head_dim
    shapes = {"gate/up": (E, F), "down": (F, E), "q/o": (E, H * D), "k/v": (E, K * D)}
    for name, (kk, nn) in shapes.items():
        w = (0.02 * jax.random.normal(jax.random.key(2), (L, kk, nn), jnp.float32)).astype(jnp.bfloat16)
        for M in (15, 4, 1):
            x = jax.random.normal(jax.random.key(3), (M, kk), jnp.float32).astype(jnp.bfloat16)

            def scan_of(mm):
                @model_jit
                def run(w, x):
                    def body(c, layer):
                        y = mm(x + c, w, layer)
                        return c + y.astype(jnp.float32).sum().astype(x.dtype) * 0, None
                    return jax.lax.scan(body, jnp.zeros((), x.dtype), jnp.arange(L))[0]
                return run

            def cublas(x, w, layer):
                return jnp.dot(x, jax.lax.dynamic_index_in_dim(w, layer, keepdims=False),
                               preferred_element_type=jnp.bfloat16)
            run = scan_of(cublas)  # one compiled function per row, built once (not inside the timed call)
            ms, _ = timeit(lambda _: run(w, x), None)
            row = dict(part="E", gemm=name, rows=M, impl="cublas", ms_per_forward=ms, tb_per_s=w.size * 2 / ms / 1e9)
            print("ROW " + json.dumps(row), flush=True); out_rows.append(row)
            for bn, bk, nw, ns, tp in KERNEL_CONFIGS:
                c = StackedMatmulConfig(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, target_programs=tp)
                mm = lambda x, w, layer, c=c: stacked_matmul_gpu(x, w, layer, config=c)
                try:
                    got = jax.jit(mm)(x, w, jnp.int32(L - 1))
                    want = stacked_matmul_reference(x, w, jnp.int32(L - 1))
                    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
                    run = scan_of(mm)
                    ms, _ = timeit(lambda _: run(w, x), None)
                    row = dict(part="E", gemm=name, rows=M, impl="stacked_matmul", config=[bn, bk, nw, ns, tp],
                               ms_per_forward=ms, tb_per_s=w.size * 2 / ms / 1e9, max_abs_err=err,
                               ok=err <= 0.02 * float(jnp.max(jnp.abs(want.astype(jnp.float32)))) + 1e-3)
                except Exception as e:  # a config the compiler refuses: recorded, not fatal
                    row = dict(part="E", gemm=name, rows=M, impl="stacked_matmul", config=[bn, bk, nw, ns, tp],
                               error=repr(e)[:300])
                print("ROW " + json.dumps(row), flush=True); out_rows.append(row)
        del w


def part_c(out_rows):
    import jax, jax.numpy as jnp
    a = jnp.ones((8, 1024, 8 if SMOKE else 1024 * 1024), jnp.bfloat16)  # 17.2 GB
    f = jax.jit(lambda a: jnp.sum(a, axis=(1, 2), dtype=jnp.float32))
    ms, _ = timeit(lambda _: f(a), None)
    row = dict(part="C", what="sum over %.1f GB bf16" % (a.size * 2 / 1e9), ms=ms, tb_per_s=a.size * 2 / ms / 1e9)
    print("ROW " + json.dumps(row), flush=True)
    out_rows.append(row)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--variant":
        return part_a(sys.argv[2])
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the variants' processes share the GPU
    out = os.environ.get("OUT", "/tmp")
    parts = os.environ.get("PARTS", "A,B,C").split(",")
    rows = []
    meta = dict(commit=os.environ.get("GIT_COMMIT", ""),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command="PARTS=%s VARIANTS=%s python eval/results/h100/decode_fixed/bench_fixed.py" % (
                    os.environ.get("PARTS", ""), os.environ.get("VARIANTS", "")),
                model="llama3-8b shapes, random bf16 weights", cache="512 tokens, capacity 1024, dense attention")

    def dump():
        import jax
        json.dump(dict(meta, device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows),
                  open(os.path.join(out, "bench_fixed.json"), "w"), indent=1)
    if "A" in parts:
        for v in os.environ.get("VARIANTS", "base,cmdbuf,unroll2,lt").split(","):
            env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + VARIANT_FLAGS[v]).strip())
            p = subprocess.run([sys.executable, __file__, "--variant", v], env=env, capture_output=True, text=True)
            got = [json.loads(l[4:]) for l in p.stdout.splitlines() if l.startswith("ROW ")]
            if p.returncode:
                got.append(dict(part="A", variant=v, error=p.stderr[-2000:]))
            rows.extend(got)
            print(v, got, flush=True)
            dump()
    if "B" in parts:
        part_b(rows); dump()
    if "C" in parts:
        part_c(rows); dump()
    if "E" in parts:
        part_e(rows); dump()
    print("\n%-34s %5s %10s %8s" % ("row", "M", "ms", "TB/s"))
    for r in rows:
        if r["part"] == "A":
            print("%-34s %5s %10s" % ("step " + r["variant"] + (" ERROR" if "error" in r else ""),
                                      "%sx%s" % (r.get("batch"), r.get("queries")), "%.3f" % r.get("step_ms", -1)))
        elif r["part"] == "E":
            print("%-34s %5d %10s %8s %s" % ("E " + r["gemm"] + " " + r["impl"], r["rows"],
                                           "%.3f" % r["ms_per_forward"] if "ms_per_forward" in r else "ERR",
                                           "%.2f" % r["tb_per_s"] if "tb_per_s" in r else "",
                                           r.get("config", "") if r.get("ok", True) else "WRONG"))
        elif r["part"] == "B":
            print("%-34s %5d %10.3f %8.2f" % (r["gemm"][:34], r["rows"], r["ms_per_forward"], r["tb_per_s"]))
        else:
            print("%-34s %5s %10.3f %8.2f" % (r["what"], "", r["ms"], r["tb_per_s"]))


if __name__ == "__main__":
    main()

"""Can a Pallas Triton GEMM read a decode step's weights faster than cuBLAS, with the norm / residual / SwiGLU
around it in the same launch? (issue 24: the GEMMs are 3.77 ms of a 100K batch-4 sparse step on the H200, about
4.0 TB/s, and each layer runs small XLA kernels around them.)

Llama-3.1-8B shapes, 32 stacked random bf16 layers, per layer:
  qkv      rms_norm(x) @ w_qkv [4096, 6144]                  (the norm before it)
  o        x + a @ w_o [4096, 4096]                          (the residual add after it)
  gate_up  silu(g) * u, [g u] = rms_norm(x) @ w [4096, 28672] (norm before, SwiGLU after)
  down     x + a @ w_down [14336, 4096]                      (residual after)
The kernel (`layer_gemm.py`, its jnp reference `layer_gemm_reference.py`) lives here, not in the library: it did
not beat cuBLAS with XLA's fusions (NOTES.md).
1. Check: `layer_gemm_gpu` against `layer_gemm_reference` compiled by XLA, M = 16 rows (relative max error and
   the share of output elements that differ).
2. Each op alone: `lax.scan` over the 32 layers (the model's situation: the stack read at the loop counter), the
   next layer's input depending on the output through a one-column add. Device time of the op's own kernels per
   layer from a profiler trace, and the weights' bytes over it. XLA (cuBLAS + its fusions, `model_jit`) at 8 rows
   (the model's batch-4 padding) and 16; the kernel at 16 rows, a list of configs.
3. The four in a chain (a layer without its attention; the "attention output" is the q columns): XLA at 8 rows
   against the kernels at 16 with each op's fastest config of 2. Wall ms per 32 layers and kernels per layer.
Writes $OUT/gemm_variants.json; prints a table last.
"""
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the kernel under test lives beside this script
from eval.bench.common import device_facts, pipelined_ms as wall_ms  # noqa: E402
from eval.bench.profile_decode_step import trace_calls  # noqa: E402
from models.compile_options import model_jit  # noqa: E402
import layer_gemm as gpu  # noqa: E402
from layer_gemm_reference import layer_gemm_reference  # noqa: E402

BF, F32 = jnp.bfloat16, jnp.float32
L, E, F, QKV = 32, 4096, 14336, 6144
OPS = {"qkv": (E, QKV, "none", True), "o": (E, E, "residual", False), "gate_up": (E, 2 * F, "swiglu", True),
       "down": (F, E, "residual", False)}
SMOKE = bool(os.environ.get("SMOKE"))
if SMOKE:  # CPU check of the script: tiny shapes, interpret mode
    L, E, F, QKV = 2, 256, 512, 384
    OPS = {"qkv": (E, QKV, "none", True), "o": (E, E, "residual", False), "gate_up": (E, 2 * F, "swiglu", True),
           "down": (F, E, "residual", False)}
C = gpu.GemmConfig
# Round 1 (`gemm_variants_round1.json`): one shared list; block_k 256 beat 128 everywhere, split_k 2 helped o, q/k/v
# and down. Round 2 (`gemm_variants_round2.json`): per-op lists; without a prologue the kernel matched cuBLAS, and the
# norm's pre-pass cost 6.5 us a layer. Round 3 (this list): the norm scales the result (no pre-pass); o and down
# with round 2's three fastest (`gemm_variants_round3.json`: the per-iteration row sums made q/k/v 30.5 us).
# Round 4: the squares kept per lane, summed once after the loop.
WIDE = [C(bn, bk, s, w, st) for bn in (32, 64) for bk in (256, 512) for s in (1, 2, 4) for w in (4, 8)
        for st in (2, 3) if bn * bk * st * 2 <= 160 * 1024]
SWIGLU = [C(bn, bk, 1, w, st) for bn in (16, 32, 64) for bk in (128, 256, 512) for w in (4, 8) for st in (2, 3, 4)
          if 2 * bn * bk * st * 2 <= 160 * 1024 and bn * bk >= 8192]
CONFIGS = {"qkv": [c for c in WIDE if c.split_k == 1], "o": [C(64, 256, 2, 4, 3), C(64, 256, 4, 4, 3), C(64, 256, 2, 8, 3)],
           "gate_up": SWIGLU, "down": [C(64, 256, 2, 4, 3), C(64, 256, 2, 8, 3), C(64, 256, 4, 4, 3)]}
if SMOKE:
    CONFIGS = {k: [C(32, 64, 1, 4, 2), C(64, 64, 2, 4, 2)] for k in OPS}


def cname(c):
    return f"bn{c.block_n}_bk{c.block_k}_s{c.split_k}_w{c.num_warps}_st{c.num_stages}"


def op_fn(name, impl, config=None):
    K, N, ep, has_norm = OPS[name]

    def f(x, w, i, g, r):
        kw = dict(norm=g if has_norm else None, epilogue=ep, residual=r if ep == "residual" else None)
        if impl == "xla":
            return layer_gemm_reference(x, w, i, **kw)
        return gpu.layer_gemm_gpu(x, w, i, config=config, interpret=SMOKE, **kw)
    return f


def scan_op(f, K):
    def run(x, w, g, r):
        def body(c, _):
            i, x = c
            y = f(x, w, i, g, r)
            return (i + 1, x + y[:, :1].astype(x.dtype)), None
        return jax.lax.scan(body, (jnp.int32(0), x), None, length=L)[0][1]
    return model_jit(run)


def profiled(tag, fn, args, calls=5):
    if SMOKE:
        return {"device_us_per_step": 0.0, "kernels_per_step": 0.0, "top": []}
    return trace_calls(f"/tmp/gemm_variants_{tag}", fn, args, calls, 6)


def inputs(K, N, M, key):
    ks = jax.random.split(key, 4)
    w = (0.02 * jax.random.normal(ks[0], (L, K, N), F32)).astype(BF)
    x = jax.random.normal(ks[1], (M, K), F32).astype(BF)
    g = (1 + 0.1 * jax.random.normal(ks[2], (K,), F32)).astype(BF)
    r = jax.random.normal(ks[3], (M, N), F32).astype(BF)
    return x, w, g, r


CHAIN = ("qkv", "o", "gate_up", "down")


def main():
    res = dict(device_facts(), layers=L, ops={k: dict(K=v[0], N=v[1], epilogue=v[2], norm=v[3])
                                              for k, v in OPS.items()}, check={}, alone={}, chain={})
    out_dir = os.environ.get("OUT", "/tmp")
    best = {}
    for name, (K, N, ep, has_norm) in OPS.items():
        x, w, g, r = inputs(K, N, 16, jax.random.key(hash(name) % 1000))
        Nout = N // 2 if ep == "swiglu" else N
        r = r[:, :Nout]
        want = jax.jit(op_fn(name, "xla"))(x, w, jnp.int32(3), g, r).astype(F32)
        rows = {}
        for c in CONFIGS[name]:
            tag = cname(c)
            if gpu.unsupported_reason(x, w, ep, c) is not None:
                continue
            try:
                got = jax.jit(op_fn(name, "pallas", c))(x, w, jnp.int32(3), g, r).astype(F32)
            except Exception as e:  # noqa: BLE001  (a config that does not compile: say so, go on)
                rows[tag] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                print(f"{name} {tag}: {rows[tag]['error']}", flush=True)
                continue
            err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
            differ = float(jnp.mean((got != want).astype(F32)))
            res["check"][f"{name}/{tag}"] = dict(rel_err=err, share_differ=differ)
            if not err < 2e-2:
                rows[tag] = {"error": f"check failed: rel_err {err}"}
                print(f"{name} {tag}: CHECK FAILED {err}", flush=True)
                continue
            f = scan_op(op_fn(name, "pallas", c), K)
            ms = wall_ms(f, (x, w, g, r))
            prof = profiled(f"{name}_{tag}", f, (x, w, g, r))
            k_us = sum(t["us_per_step"] for t in prof["top"] if "layer_gemm" in t["kernel"]) / L
            rows[tag] = dict(wall_ms=ms, kernel_us_per_layer=k_us, tbs=K * N * 2 / (k_us * 1e-6) / 1e12 if k_us else 0,
                             rel_err=err, top=prof["top"][:4])
            print(f"{name:8s} {tag:26s} {ms:7.3f} ms/32 layers  kernel {k_us:7.2f} us/layer "
                  f"{rows[tag]['tbs']:.2f} TB/s  err {err:.1e}", flush=True)
        for M in (8, 16):
            xm = x[:M] if M <= 16 else x
            rm = r[:M]
            f = scan_op(op_fn(name, "xla"), K)
            ms = wall_ms(f, (xm, w, g, rm))
            prof = profiled(f"{name}_xla{M}", f, (xm, w, g, rm))
            # The op's kernels: everything but the one-column add of the harness (the smallest per launch).
            tops = sorted(prof["top"], key=lambda t: -t["us_per_step"])
            gemm_us = sum(t["us_per_step"] for t in tops if t["kind"] != "xla" or "gemm" in t["kernel"].lower()
                          or "cublas" in t["kernel"].lower()) / L
            rows[f"xla_M{M}"] = dict(wall_ms=ms, device_us_per_layer=prof["device_us_per_step"] / L,
                                     gemm_us_per_layer=gemm_us, kernels_per_layer=prof["kernels_per_step"] / L,
                                     top=prof["top"][:6])
            print(f"{name:8s} xla M={M:2d}                {ms:7.3f} ms/32 layers  device {prof['device_us_per_step']/L:7.2f}"
                  f" us/layer ({prof['kernels_per_step']/L:.1f} kernels)", flush=True)
        res["alone"][name] = rows
        ok = {k: v for k, v in rows.items() if not k.startswith("xla") and "error" not in v}
        best[name] = min(ok, key=lambda k: ok[k]["wall_ms"]) if ok else None
        res["best"] = best
        json.dump(res, open(os.path.join(out_dir, "gemm_variants.json"), "w"), indent=1)
        del w
    res["best"] = best
    json.dump(res, open(os.path.join(out_dir, "gemm_variants.json"), "w"), indent=1)

    # 3. The chain.
    ks = jax.random.split(jax.random.key(7), 8)
    ws = {n: (0.02 * jax.random.normal(ks[j], (L, *OPS[n][:2]), F32)).astype(BF) for j, n in enumerate(CHAIN)}
    gs = [(1 + 0.1 * jax.random.normal(ks[5 + j], (E,), F32)).astype(BF) for j in range(2)]
    by_name = {cname(c): c for cs in CONFIGS.values() for c in cs}

    def chain(impl):
        cf = {n: by_name.get(best[n]) for n in CHAIN}
        gemm = {n: op_fn(n, "xla" if impl == "xla" or cf[n] is None or n not in impl.split(":")[-1].split(",") else "pallas", cf[n])
                for n in CHAIN}

        def run(x, ws, gs):
            def body(c, _):
                i, x = c
                qkv = gemm["qkv"](x, ws["qkv"], i, gs[0], None)
                xa = gemm["o"](qkv[:, :E], ws["o"], i, None, x)
                act = gemm["gate_up"](xa, ws["gate_up"], i, gs[1], None)
                return (i + 1, gemm["down"](act, ws["down"], i, None, xa)), None
            return jax.lax.scan(body, (jnp.int32(0), x), None, length=L)[0][1]
        return model_jit(run)

    weight_bytes = sum(OPS[n][0] * OPS[n][1] * 2 for n in CHAIN) * L
    every = "pallas:" + ",".join(CHAIN)
    wins = "pallas:" + ",".join(n for n in CHAIN if best[n] and res["alone"][n][best[n]]["wall_ms"]
                                < res["alone"][n]["xla_M8"]["wall_ms"])
    for impl, M in (("xla", 8), (every, 16), (wins, 16), ("xla", 8), (every, 16), (wins, 16)):
        x = (0.3 * jax.random.normal(ks[4], (M, E), F32)).astype(BF)
        f = chain(impl)
        ms = wall_ms(f, (x, ws, gs))
        prof = profiled(f"chain_{impl}{M}", f, (x, ws, gs))
        key = f"{impl}_M{M}"
        res["chain"].setdefault(key, []).append(dict(
            wall_ms=ms, tbs=weight_bytes / (ms * 1e-3) / 1e12, device_ms=prof["device_us_per_step"] / 1e3,
            kernels_per_layer=prof["kernels_per_step"] / L, top=prof["top"][:6]))
        print(f"chain {key}: {ms:.3f} ms per 32 layers ({weight_bytes / (ms * 1e-3) / 1e12:.2f} TB/s of weights), "
              f"{prof['kernels_per_step'] / L:.1f} kernels/layer", flush=True)
    xs = (0.3 * jax.random.normal(ks[4], (16, E), F32)).astype(BF)
    a, b = chain("xla")(xs, ws, gs).astype(F32), chain(every)(xs, ws, gs).astype(F32)
    res["chain_check"] = dict(rel_err=float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a))))
    json.dump(res, open(os.path.join(out_dir, "gemm_variants.json"), "w"), indent=1)
    print("\nbest per op:", best, "chain check", res["chain_check"])
    for name, rows in res["alone"].items():
        xla8 = rows["xla_M8"]["wall_ms"]
        b = best[name]
        print(f"{name:8s} xla M8 {xla8:7.3f} ms | best {b}: {rows[b]['wall_ms'] if b else float('nan'):7.3f} ms")


if __name__ == "__main__":
    main()

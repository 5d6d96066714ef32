"""Do the decode step's weight GEMMs (M = 8 padded token rows) read the weights faster from another layout or cuBLAS
path? (issue 24: the GEMMs read at 2.5-2.8 TB/s, the attention kernels at 3.1-3.2 TB/s)

A layer stack shaped as the model's (`models.llama`: fused qkv, o with the residual, fused gate_up, down with the
residual, RMS norms between) in a `lax.scan` over stacked bf16 weights, compiled with `model_jit`'s options, for
Llama-3.1-8B and Qwen3-8B shapes. Variants:
- kn: weights [L, in, out] (the library's layout today), einsum "te,ef->tf";
- nk: weights [L, out, in] (PyTorch's Linear layout), einsum "te,fe->tf";
- each with cuBLASLt on (`xla_gpu_enable_cublaslt`) and with XLA's GEMM autotuning off (`xla_gpu_autotune_level=0`).
Each variant's output is checked against kn's. Then each GEMM alone in its own scan. Writes $OUT/gemm_layout.json.
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench.common import device_facts, pipelined_ms
from models.compile_options import MODEL_COMPILER_OPTIONS

SHAPES = {"llama3-8b": dict(L=32, E=4096, Q=6144, F=14336), "qwen3-8b": dict(L=36, E=4096, Q=6144, F=12288)}
VARIANTS = {"kn": ("kn", {}), "nk": ("nk", {}), "kn_lt": ("kn", {"xla_gpu_enable_cublaslt": True}),
            "nk_lt": ("nk", {"xla_gpu_enable_cublaslt": True}), "kn_at0": ("kn", {"xla_gpu_autotune_level": 0})}
M = int(os.environ.get("ROWS", "8"))
if os.environ.get("SMOKE"):  # a CPU check of the script itself
    SHAPES = {"tiny": dict(L=2, E=64, Q=96, F=128)}


def norm(x):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)).astype(x.dtype)


def dot(x, w, layout):
    spec = "te,ef->tf" if layout == "kn" else "te,fe->tf"
    return jnp.einsum(spec, x, w, preferred_element_type=x.dtype)


def stack_fn(layout, E, options):
    def body(x, w):
        qkv = dot(norm(x), w["qkv"], layout)
        x = x + dot(qkv[:, :E], w["o"], layout)
        gu = dot(norm(x), w["gu"], layout)
        g, u = jnp.split(gu, 2, axis=-1)
        x = x + dot((jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x.dtype), w["d"], layout)
        return x, None
    return jax.jit(lambda x, ws: jax.lax.scan(body, x, ws)[0],
                   compiler_options={**MODEL_COMPILER_OPTIONS, **options})


def single_fn(layout, options):
    def run(x, ws):
        def body(c, w):
            y = dot((x * c).astype(x.dtype), w, layout)
            return c + y[0, 0].astype(jnp.float32) * 1e-9, None
        return jax.lax.scan(body, jnp.float32(1), ws)[0]
    return jax.jit(run, compiler_options={**MODEL_COMPILER_OPTIONS, **options})


def main():
    out = {**device_facts(), "benchmark": "gemm_layout", "rows": M, "shapes": {}}
    table = []
    for shape, s in SHAPES.items():
        L, E, Q, F = s["L"], s["E"], s["Q"], s["F"]
        dims = {"qkv": (E, Q), "o": (E, E), "gu": (E, 2 * F), "d": (F, E)}
        keys = jax.random.split(jax.random.key(0), 4)
        kn = {n: (jax.random.normal(k, (L, *d), jnp.bfloat16) * 0.02) for (n, d), k in zip(dims.items(), keys)}
        nk = {n: jnp.swapaxes(w, 1, 2).copy() for n, w in kn.items()}
        nbytes = sum(w.size * 2 for w in kn.values())
        x = jax.random.normal(jax.random.key(1), (M, E), jnp.bfloat16)
        res = {"weight_bytes": int(nbytes), "stack": {}, "single": {}}
        ref = None
        for name, (layout, options) in VARIANTS.items():
            f = stack_fn(layout, E, options)
            ws = kn if layout == "kn" else nk
            y = np.asarray(f(x, ws), np.float32)
            if ref is None:
                ref = y
            err = float(np.abs(y - ref).max() / (np.abs(ref).max() + 1e-9))
            ms = min(pipelined_ms(f, (x, ws), n=20) for _ in range(3))
            res["stack"][name] = {"ms": ms, "tbs": nbytes / ms / 1e9, "rel_err_vs_kn": err}
            table.append((shape, "stack", name, ms, nbytes / ms / 1e9, err))
            print(f"{shape} stack {name}: {ms:.3f} ms {nbytes / ms / 1e9:.0f} GB/s err {err:.2e}", flush=True)
        for g in dims:
            for name in ("kn", "nk", "kn_lt", "nk_lt"):
                layout, options = VARIANTS[name]
                w = (kn if layout == "kn" else nk)[g]
                xin = jax.random.normal(jax.random.key(2), (M, dims[g][0]), jnp.bfloat16)
                f = single_fn(layout, options)
                ms = min(pipelined_ms(f, (xin, w), n=20) for _ in range(3))
                b = w.size * 2
                res["single"].setdefault(g, {})[name] = {"ms": ms, "tbs": b / ms / 1e9}
                table.append((shape, g, name, ms, b / ms / 1e9, None))
                print(f"{shape} {g} {name}: {ms:.3f} ms {b / ms / 1e9:.0f} GB/s", flush=True)
        out["shapes"][shape] = res
        del kn, nk
    path = os.path.join(os.environ.get("OUT", "."), "gemm_layout.json")
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"\n{out['device']} rows={M}")
    for shape, part, name, ms, tbs, err in table:
        print(f"{shape:10s} {part:6s} {name:7s} {ms:8.3f} ms {tbs:7.0f} GB/s" + (f"  err {err:.1e}" if err is not None
                                                                                 else ""))


if __name__ == "__main__":
    main()

"""Do the decode step's weight GEMMs (M = 8 padded token rows) read the weights faster from another layout or cuBLAS
path? (issue 24: the GEMMs read at 2.5-2.8 TB/s, the attention kernels at 3.1-3.2 TB/s)

A layer stack shaped as the model's (`models.llama`: fused qkv, o with the residual, fused gate_up, down with the
residual, RMS norms between) in a `lax.scan` over stacked bf16 weights, compiled with `model_jit`'s options, for
Llama-3.1-8B and Qwen3-8B shapes. Variants:
- kn: weights [L, in, out] (the library's layout today), einsum "te,ef->tf";
- nk: weights [L, out, in] (PyTorch's Linear layout), einsum "te,fe->tf";
- each with cuBLASLt on (`xla_gpu_enable_cublaslt`) and with XLA's GEMM autotuning off (`xla_gpu_autotune_level=0`).
Each variant's output is checked against kn's. Then each GEMM alone in a loop over the layers (the layer a traced
index): XLA kn / nk (with and without cuBLASLt) against a Pallas Triton kernel on nk weights in which each program
streams BN whole rows of the layer's [out, in] weight (contiguous memory, no split of K), checked against XLA first.
Writes $OUT/gemm_layout.json.
"""
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

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


def _rows_kernel(lay_ref, x_ref, w_ref, o_ref, *, M, BN, BK, K):
    layer = lay_ref[0]
    n0 = pl.program_id(0) * BN
    rows = jnp.minimum(jnp.arange(16, dtype=jnp.int32), M - 1)

    def body(i, acc):
        xt = x_ref[rows, pl.ds(i * BK, BK)]
        wt = w_ref[layer, pl.ds(n0, BN), pl.ds(i * BK, BK)]
        return acc + jax.lax.dot_general(xt, wt, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    acc = jax.lax.fori_loop(0, K // BK, body, jnp.zeros((16, BN), jnp.float32))
    o_ref[:, pl.ds(n0, BN)] = acc.astype(o_ref.dtype)


def rows_gemm(x, w_all, layer, *, BN, BK, warps, stages):
    """x [M, K] @ w_all[layer].T, w_all [L, N, K]: grid N / BN, each program BN whole rows."""
    M, K = x.shape
    N = w_all.shape[1]
    out = pl.pallas_call(
        functools.partial(_rows_kernel, M=M, BN=BN, BK=BK, K=K), grid=(N // BN,),
        out_shape=jax.ShapeDtypeStruct((16, N), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages), interpret=bool(os.environ.get("SMOKE")),
    )(jnp.asarray(layer, jnp.int32).reshape(1), x, w_all)
    return out[:M]


def xla_gemm(layout):
    return lambda x, w_all, l: dot(x, w_all[l], layout)


def single_fn(gemm, L, options):
    """One GEMM a layer over the L layers (fori, the layer a traced index), its input scaled by a carried scalar."""
    def run(x, w_all):
        def body(l, c):
            y = gemm((x * c).astype(x.dtype), w_all, l)
            return c + y[0, 0].astype(jnp.float32) * 1e-9
        return jax.lax.fori_loop(0, L, body, jnp.float32(1))
    return jax.jit(run, compiler_options={**MODEL_COMPILER_OPTIONS, **options})


def time_ms(f, args):
    return min(pipelined_ms(f, args, n=20) for _ in range(3))


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
            b = kn[g].size * 2
            xin = jax.random.normal(jax.random.key(2), (M, dims[g][0]), jnp.bfloat16)
            ref = np.asarray(jax.jit(xla_gemm("kn"), compiler_options=MODEL_COMPILER_OPTIONS)(xin, kn[g], 3),
                             np.float32)
            timed = {}
            for name in ("kn", "nk", "kn_lt", "nk_lt"):
                layout, options = VARIANTS[name]
                timed[name] = time_ms(single_fn(xla_gemm(layout), L, options), (xin, kn[g] if layout == "kn" else nk[g]))
            N, K = dims[g][1], dims[g][0]
            for BN in (16, 32):
                for BK in (256, 512):
                    for warps, stages in ((4, 3), (4, 5)):
                        if N % BN or K % BK:
                            continue
                        name = f"rows_bn{BN}_bk{BK}_w{warps}_s{stages}"
                        gemm = functools.partial(rows_gemm, BN=BN, BK=BK, warps=warps, stages=stages)
                        try:
                            got = np.asarray(jax.jit(gemm)(xin, nk[g], 3), np.float32)
                            err = float(np.abs(got - ref).max() / (np.abs(ref).max() + 1e-9))
                            if err > 2e-2:
                                print(f"{shape} {g} {name}: wrong, err {err:.2e}", flush=True)
                                continue
                            timed[name] = pipelined_ms(single_fn(gemm, L, {}), (xin, nk[g]), n=20)
                        except Exception as e:  # noqa: BLE001
                            print(f"{shape} {g} {name}: failed {repr(e)[:300]}", flush=True)
            for name, ms in timed.items():
                res["single"].setdefault(g, {})[name] = {"ms": ms, "tbs": b / ms / 1e9}
                print(f"{shape} {g} {name}: {ms:.3f} ms {b / ms / 1e9:.0f} GB/s", flush=True)
            best = min((n for n in timed if n.startswith("rows")), key=timed.get, default=None)
            for name in ("kn", "nk", "kn_lt", "nk_lt", best):
                if name:
                    table.append((shape, g, name, timed[name], b / timed[name] / 1e9, None))
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

"""Can a Pallas Triton skinny GEMM beat cuBLAS on the decode step's weight GEMMs (M = 1 or 4 tokens)?

Times x[M, K] @ w_all[layer] (w_all [L, K, N] bf16, the layer a traced index) for Llama-3.1-8B's four layer GEMMs:
XLA (cuBLAS, dynamic-slice fusion on, as `models.compile_options.model_jit`) against a split-N/split-K Pallas kernel
that reads the layer's weight tile in place. Checks each kernel against jnp on the same inputs. Writes JSON to $OUT.
"""
import functools, json, os, sys, time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from models.compile_options import model_jit
from eval.bench.common import pipelined_ms, device_facts


def _kernel(lay_ref, x_ref, w_ref, o_ref, *, M, Mp, BK, KS, L):
    layer = lay_ref[0]
    s = pl.program_id(1)
    rows = jnp.minimum(jnp.arange(Mp, dtype=jnp.int32), M - 1)

    def body(i, acc):
        k0 = s * KS + i * BK
        xt = x_ref[rows, pl.ds(k0, BK)]
        wt = w_ref[layer, pl.ds(k0, BK), :]
        return acc + plgpu.dot(xt, wt)
    acc = jax.lax.fori_loop(0, KS // BK, body, jnp.zeros((Mp, o_ref.shape[-1]), jnp.float32))
    o_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("BN", "BK", "S", "warps", "stages", "interpret"))
def gemv(x, w_all, layer, *, BN, BK, S, warps, stages, interpret=False):
    M, K = x.shape
    L, _, N = w_all.shape
    KS = K // S
    out = pl.pallas_call(
        functools.partial(_kernel, M=M, Mp=16, BK=BK, KS=KS, L=L),
        grid=(N // BN, S),
        in_specs=[pl.BlockSpec((1,), lambda n, s: (0,)), pl.BlockSpec((M, K), lambda n, s: (0, 0)),
                  pl.BlockSpec((L, K, BN), lambda n, s: (0, 0, n))],
        out_specs=pl.BlockSpec((None, 16, BN), lambda n, s: (s, 0, n)),
        out_shape=jax.ShapeDtypeStruct((S, 16, N), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages), interpret=interpret,
    )(jnp.asarray(layer, jnp.int32).reshape(1), x, w_all)
    return (out[:, :M].sum(0) if S > 1 else out[0, :M]).astype(x.dtype)


def xla_dot(x, w_all, layer):
    return jnp.dot(x, w_all[layer])


def loop(fn, reps=32):  # one GEMM per layer, as a decode step: a fori over the layers
    @model_jit
    def run(x, w_all):
        def body(l, acc):
            return acc + fn(x, w_all, l)[:, :1].astype(jnp.float32)
        return jax.lax.fori_loop(0, reps, body, jnp.zeros((x.shape[0], 1), jnp.float32))
    return run


def main():
    shapes = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
    rows = []
    for name, (K, N) in shapes.items():
        w_all = jax.random.normal(jax.random.key(0), (32, K, N), jnp.bfloat16) * 0.02
        for M in (1, 4):
            x = jax.random.normal(jax.random.key(1), (M, K), jnp.bfloat16)
            ref = np.asarray(model_jit(xla_dot)(x, w_all, 5), np.float32)
            nbytes = 32 * K * N * 2
            base = loop(lambda x, w, l: xla_dot(x, w, l))
            t = pipelined_ms(base, (x, w_all), n=10)
            rows.append({"gemm": name, "M": M, "impl": "xla_cublas", "ms_32_layers": t, "tbs": nbytes / t / 1e9})
            print(f"{name} M={M} xla {t:.3f} ms {nbytes / t / 1e9:.0f} GB/s", flush=True)
            for BN in (64, 128):
                for BK in (128, 256):
                    for S in (1, 2, 4, 8):
                        for warps, stages in ((4, 3), (4, 4)):
                            if K // S % BK or N % BN:
                                continue
                            progs = (N // BN) * S
                            if progs < 132 or progs > 4096:
                                continue
                            f = functools.partial(gemv, BN=BN, BK=BK, S=S, warps=warps, stages=stages)
                            try:
                                got = np.asarray(f(x, w_all, 5), np.float32)
                                err = float(np.max(np.abs(got - ref)) / (np.max(np.abs(ref)) + 1e-9))
                                t = pipelined_ms(loop(lambda x, w, l: f(x, w, l)), (x, w_all), n=10)
                            except Exception as e:  # noqa: BLE001
                                print("fail", name, M, BN, BK, S, warps, stages, repr(e)[:200], flush=True)
                                continue
                            rows.append({"gemm": name, "M": M, "impl": "pallas", "BN": BN, "BK": BK, "S": S,
                                         "warps": warps, "stages": stages, "ms_32_layers": t,
                                         "tbs": nbytes / t / 1e9, "rel_err": err})
            best = min((r for r in rows if r["gemm"] == name and r["M"] == M and r["impl"] == "pallas"),
                       key=lambda r: r["ms_32_layers"], default=None)
            print(f"{name} M={M} best pallas {best}", flush=True)
        del w_all
    out = {**device_facts(), "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
           "commit": os.environ.get("GIT_COMMIT"), "command": " ".join(sys.argv), "rows": rows}
    with open(os.path.join(os.environ.get("OUT", "."), "gemv_probe.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

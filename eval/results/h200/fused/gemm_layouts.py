"""Which weight orientation makes cuBLAS read each Llama-3.1-8B layer GEMM fastest at decode's few rows.

For each GEMM of a layer (fused q/k/v: K = 4096 -> N = 6144; o: 4096 -> 4096; fused gate/up: 4096 -> 28672; down:
14336 -> 4096) and each row count M (1: a batch-1 decode, 8: batch 4 padded, 16: a verification of 3 x 5 rows
padded), a `lax.scan` over 32 stacked layers (the model's situation: each layer's weight a dynamic slice of the
stack, read in place by cuBLAS under `model_jit`'s options) runs one GEMM per layer, each layer's input depending on
the last output. Variants of the weight's layout:
  KN   [L, K, N], y = x @ W (the library's)
  NK   [L, N, K], y = x @ W^T (stored transposed)
  cKN  [L, c, K, N / c], c batched GEMMs (c = 2, 4)   (only where N splits)
  cNK  [L, c, N / c, K]
Each variant is checked against a jnp f32 reference of the same math on one layer first. Prints GB/s of weights read
(the bytes of the 32 weights / time) and writes $OUT/gemm_layouts.json.
"""
import json, os, time
import numpy as np
import jax, jax.numpy as jnp

from models.compile_options import model_jit

L = 32
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
BF = jnp.bfloat16
if os.environ.get("SMOKE"):  # a CPU check of the script
    L, SHAPES = 2, {k: (a // 64, b // 64) for k, (a, b) in SHAPES.items()}


def make(layout, K, N, key):
    c = int(layout[0]) if layout[0].isdigit() else 1
    kind = layout[-2:]
    shape = {"KN": (L, c, K, N // c), "NK": (L, c, N // c, K)}[kind]
    w = (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(BF)
    return w, c, kind


def gemm(x, w, kind):
    """x: [M, K]; w: [c, K, N/c] or [c, N/c, K] -> [M, N]."""
    spec = "mk,ckn->mcn" if kind == "KN" else "mk,cnk->mcn"
    y = jnp.einsum(spec, x, w, preferred_element_type=x.dtype)
    return y.reshape(x.shape[0], -1)


def run_scan(x, w, kind, K):
    def body(h, wl):
        y = gemm(h, wl, kind)
        return h + (1e-6 * jnp.sum(y.astype(jnp.float32))).astype(h.dtype), None  # the next GEMM waits
    return jax.lax.scan(body, x, w)[0]


def time_ms(fn, *args, n=20, **kw):
    out = fn(*args, **kw)
    out.block_until_ready()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn(*args, **kw).block_until_ready()
        ts.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(ts))


def main():
    res = dict(command="python eval/results/h200/fused/gemm_layouts.py", device=str(jax.devices()[0].device_kind), jax=jax.__version__, commit=os.environ.get("GIT_COMMIT", ""),
               layers=L, rows={})
    f = model_jit(run_scan, static_argnames=("kind", "K"))
    for name, (K, N) in SHAPES.items():
        layouts = ["KN", "NK"] + ([f"{c}{k}" for c in (2, 4) for k in ("KN", "NK")] if N >= 2 * K else [])
        for layout in layouts:
            w, c, kind = make(layout, K, N, jax.random.key(1))
            x1 = jax.random.normal(jax.random.key(2), (3, K), jnp.float32).astype(BF)
            ref = jnp.einsum("mk,kn->mn", x1.astype(jnp.float32),
                             (w[0].reshape(c * (N // c), K).T if kind == "NK" else
                              jnp.concatenate(list(w[0]), axis=1)).astype(jnp.float32))
            got = jax.jit(gemm, static_argnames="kind")(x1, w[0], kind).astype(jnp.float32)
            err = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
            assert err < 2e-2, (name, layout, err)
            for M in (1, 8, 16):
                x = jax.random.normal(jax.random.key(3), (M, K), jnp.float32).astype(BF)
                ms = time_ms(f, x, w, kind=kind, K=K)
                gbs = L * K * N * 2 / ms / 1e6
                res["rows"][f"{name}/{layout}/M{M}"] = dict(ms=ms, gbs=gbs, rel_err=err)
                print(f"{name:8s} {layout:4s} M={M:2d}: {ms:7.3f} ms  {gbs:7.0f} GB/s", flush=True)
            del w
    out = os.environ.get("OUT", "/tmp")
    json.dump(res, open(os.path.join(out, "gemm_layouts.json"), "w"), indent=1)


if __name__ == "__main__":
    main()

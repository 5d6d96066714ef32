"""Can a Mosaic GPU GEMM (TMA ring + wgmma, swapped operands) read a decode step's weights faster than cuBLAS?
(issue 24: the layer GEMMs are 3.9 ms of a 100K batch-4 sparse step on the H200; cuBLAS reads q/k/v at 3.2 TB/s, o +
down at 3.7, gate/up at 4.06, the LM head at 4.36.)

Llama-3.1-8B shapes, 32 stacked random bf16 layers, M = 8 rows (the model's batch-4 padding):
  qkv [4096, 6144], o [4096, 4096], gate_up [4096, 28672], down [14336, 4096].
1. Check: `mgpu_gemm` (beside this script) against x @ w[3] in f32, every config (relative max error).
2. Each op alone in a `lax.scan` over the 32 layers (the stack read at the loop counter, the next input depending on
   the output through a one-column add): device time per layer of the GEMM's kernels (the kernel plus, with split-K,
   XLA's partial sum) from a profiler trace, against XLA (cuBLAS) in the same harness.
3. (ROUND=2, CHAIN_ONLY=1 for this part alone) the four in a chain, `chain` below.
Writes $OUT/mgpu_gemm.json; prints a table last. SMOKE=1: tiny shapes in the Mosaic GPU interpreter (CPU).
"""
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from eval.bench.common import device_facts, pipelined_ms as wall_ms  # noqa: E402
from eval.bench.profile_decode_step import trace_calls  # noqa: E402
from models.compile_options import model_jit  # noqa: E402
import mgpu_gemm as mg  # noqa: E402

BF, F32 = jnp.bfloat16, jnp.float32
SMOKE = bool(os.environ.get("SMOKE"))
L, M = (2, 8) if SMOKE else (32, 8)
OPS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
C = mg.Config
CONFIGS = {
    "qkv": [C(64, tk, s, st) for tk in (64, 128) for s in (1, 2, 4) for st in (4, 8)],
    "o": [C(64, tk, s, st) for tk in (64, 128) for s in (2, 4) for st in (4, 8)],
    "gate_up": [C(tn, tk, s, st) for tn in (64, 128) for tk in (64, 128) for s in (1, 2) for st in (4, 8)],
    "down": [C(64, tk, s, st) for tk in (64, 128) for s in (2, 4, 8) for st in (4, 8)],
}
ROUND = int(os.environ.get("ROUND", "1"))
if ROUND == 2:  # round 1's fastest two or three per op, each without and with the PDL prologue
    CONFIGS = {
        "qkv": [C(64, 64, 4, 4, p) for p in (0, 1)] + [C(64, 128, 2, 4, p) for p in (0, 1)] + [C(64, 64, 1, 8, p) for p in (0, 1)],
        "o": [C(64, 64, 4, 4, p) for p in (0, 1)] + [C(64, 128, 2, 4, p) for p in (0, 1)],
        "gate_up": [C(128, 64, 1, 4, p) for p in (0, 1)] + [C(64, 64, 1, 4, p) for p in (0, 1)],
        "down": [C(64, 64, 2, 8, p) for p in (0, 1)] + [C(64, 64, 4, 4, p) for p in (0, 1)] + [C(64, 128, 4, 4, p) for p in (0, 1)],
    }
CHAIN_CONFIGS = {"qkv": C(64, 64, 4, 4), "o": C(64, 64, 4, 4), "gate_up": C(128, 64, 1, 4), "down": C(64, 64, 2, 8)}
if SMOKE:
    OPS = {"qkv": (256, 384), "down": (512, 256)}
    CONFIGS = {k: [C(64, 64, 1, 2), C(64, 64, 2, 2)] for k in OPS}
ONLY = os.environ.get("OPS")
if ONLY:
    OPS = {k: v for k, v in OPS.items() if k in ONLY.split(",")}


def cname(c):
    return f"tn{c.tile_n}_tk{c.tile_k}_s{c.split_k}_st{c.stages}" + ("_pdl" if c.pdl else "")


def scan_op(f):
    def run(x, w):
        def body(c, _):
            i, x = c
            y = f(x, w, i)
            return (i + 1, x + y[:, :1].astype(x.dtype)), None
        return jax.lax.scan(body, (jnp.int32(0), x), None, length=L)[0][1]
    return model_jit(run)


def op_us(tag, fn, args):
    """Device us per layer of everything but the harness's one-column add (its smallest kernel)."""
    if SMOKE:
        return 0.0, []
    prof = trace_calls(f"/tmp/mgpu_gemm_{tag}", fn, args, 5, 8)
    tops = prof["top"]
    harness = [t for t in tops if "add" in t["kernel"] and t["launches_per_step"] >= L]
    drop = min(harness, key=lambda t: t["us_per_step"])["us_per_step"] if harness else 0.0
    return (prof["device_us_per_step"] - drop) / L, tops[:5]


def main():
    res = dict(device_facts(), layers=L, rows=M, ops={k: dict(K=v[0], N=v[1]) for k, v in OPS.items()}, alone={})
    out_dir = os.environ.get("OUT", "/tmp")
    table = []
    for name, (K, N) in ({} if os.environ.get("CHAIN_ONLY") else OPS).items():
        ks = jax.random.split(jax.random.key(len(name)), 2)
        w = (0.02 * jax.random.normal(ks[0], (L, K, N), F32)).astype(BF)
        x = jax.random.normal(ks[1], (M, K), F32).astype(BF)
        want = (x.astype(F32) @ w[L - 1].astype(F32))
        rows = {}
        f = scan_op(lambda x, w, i: x @ w[i])
        us, top = op_us(f"{name}_xla", f, (x, w))
        rows["xla"] = dict(wall_ms=wall_ms(f, (x, w)), us_per_layer=us, tbs=K * N * 2 / us / 1e6 if us else 0, top=top)
        table.append((name, "xla (cuBLAS)", rows["xla"]["us_per_layer"], rows["xla"]["tbs"], 0.0))
        print(table[-1], flush=True)
        for c in CONFIGS[name]:
            tag = cname(c)
            try:
                got = jax.jit(lambda x, w: mg.mgpu_gemm(x, w, L - 1, c, interpret=SMOKE))(x, w).astype(F32)
            except Exception as e:  # noqa: BLE001  (a config that does not compile: say so, go on)
                rows[tag] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(f"{name} {tag}: {rows[tag]['error']}", flush=True)
                continue
            err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
            if not err < 1e-2:
                rows[tag] = {"error": f"check failed: rel_err {err}"}
                print(f"{name} {tag}: CHECK FAILED {err}", flush=True)
                continue
            f = scan_op(lambda x, w, i, c=c: mg.mgpu_gemm(x, w, i, c, interpret=SMOKE))
            us, top = op_us(f"{name}_{tag}", f, (x, w))
            rows[tag] = dict(wall_ms=wall_ms(f, (x, w)), us_per_layer=us, tbs=K * N * 2 / us / 1e6 if us else 0,
                             rel_err=err, top=top)
            table.append((name, tag, us, rows[tag]["tbs"], err))
            print(table[-1], flush=True)
        res["alone"][name] = rows
        json.dump(res, open(os.path.join(out_dir, "mgpu_gemm.json"), "w"), indent=1)
        del w
    if (ROUND >= 2 or SMOKE) and not ONLY:
        res["chain"] = chain(table)
        json.dump(res, open(os.path.join(out_dir, "mgpu_gemm.json"), "w"), indent=1)
    print(f"\n{'op':8s} {'variant':22s} {'us/layer':>9s} {'TB/s':>6s} {'rel err':>8s}")
    for name, tag, us, tbs, err in table:
        print(f"{name:8s} {tag:22s} {us:9.2f} {tbs:6.2f} {err:8.1e}")


def chain(table):
    """A layer without its attention, 32 layers: norm, qkv, (q as the attention output) o + residual, norm, gate/up,
    SwiGLU, down + residual. XLA against the Mosaic GEMM (CHAIN_CONFIGS; split-K partials summed by XLA, fused with
    the residual add). Wall ms per 32 layers, best of 3, and the kernels' device time."""
    E, F, QKV = (256, 512, 384) if SMOKE else (4096, 14336, 6144)
    cfgs = {k: C(64, 64, 1, 2) for k in CHAIN_CONFIGS} if SMOKE else CHAIN_CONFIGS
    ks = jax.random.split(jax.random.key(7), 8)
    shapes = {"qkv": (E, QKV), "o": (E, E), "gate_up": (E, 2 * F), "down": (F, E)}
    ws = {n: (0.02 * jax.random.normal(ks[j], (L, *shp), F32)).astype(BF) for j, (n, shp) in enumerate(shapes.items())}
    gs = [(1 + 0.1 * jax.random.normal(ks[5 + j], (E,), F32)).astype(BF) for j in range(2)]
    x0 = jax.random.normal(ks[7], (M, E), F32).astype(BF)

    def rms(x, g):
        xf = x.astype(F32)
        return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-5) * g.astype(F32)).astype(BF)

    def make(impl, layout="nm"):
        def mm(ws, name, h, i):
            if impl == "xla":
                return h @ ws[name][i]
            return mg.mgpu_gemm(h, ws[name], i, dataclasses.replace(cfgs[name], out_layout=layout), interpret=SMOKE)

        def run(x, ws):  # the weights as arguments: closed over, they are 14 GB of constants (round 2 died so)
            def body(c, _):
                i, x = c
                qkv = mm(ws, "qkv", rms(x, gs[0]), i)
                x = x + mm(ws, "o", qkv[:, :E], i)
                gu = mm(ws, "gate_up", rms(x, gs[1]), i)
                x = x + mm(ws, "down", (jax.nn.silu(gu[:, :F].astype(F32)) * gu[:, F:].astype(F32)).astype(BF), i)
                return (i + 1, x), None
            return jax.lax.scan(body, (jnp.int32(0), x), None, length=L)[0][1]
        return model_jit(run)

    out, ref = {}, None
    for tag, f in (("xla", make("xla")), ("mgpu", make("mgpu")), ("mgpu_mn_value", make("mgpu", "mn_value")),
                   ("mgpu_mn_ref", make("mgpu", "mn_ref")), ("xla_again", make("xla"))):
        try:
            y = f(x0, ws).astype(F32)
        except Exception as e:  # noqa: BLE001  (a variant that does not compile: say so, go on)
            out[tag] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(tag, out[tag], flush=True)
            continue
        ref = y if ref is None else ref
        err = float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))
        ms = min(wall_ms(f, (x0, ws)) for _ in range(3))
        prof = {} if SMOKE else trace_calls(f"/tmp/mgpu_chain_{tag}", f, (x0, ws), 5, 8)
        out[tag] = dict(wall_ms=ms, rel_err_vs_xla=err, device_us_per_step=prof.get("device_us_per_step"),
                        kernels_per_step=prof.get("kernels_per_step"), top=prof.get("top", [])[:8])
        table.append(("chain", tag, ms * 1e3 / L, 0.0, err))
        print(table[-1], flush=True)
    return out


if __name__ == "__main__":
    main()

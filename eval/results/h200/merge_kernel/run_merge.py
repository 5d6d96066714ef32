"""The gathered decode's splits merged in the launch (`DecodeConfig(merge="kernel")`: the last split of each row,
found by an atomic ticket, merges the row's partials) against the jnp combine after the launch (merge="xla").

1. Check (GPU): at Llama-3.1-8B decode shapes (100K keys, 10% selected, batch 4 and 1; plain, head-mapped and
   query-head rows), fresh random inputs on every repeat: the merged output against the f32 reference on the sliced
   layer, and against merge="xla" (the same partials), every element written (no NaN; the outputs start
   uninitialised).
2. The op alone: median device time of each merge, back-to-back calls (`eval.bench.common.pipelined_ms`).
3. End to end: `eval.bench.model.method_rows` (the model's own jitted decode loop, dense first) at 100K, batch 4,
   with `pallas_kernels.sparse_attention.api.STACKED_DECODE_CONFIG` set to each merge, alternating xla / kernel
   twice in one process.

    PYTHONPATH=. OUT=... python eval/results/h200/merge_kernel/run_merge.py   (env: METHODS, PARTS=123)

It needs the tree of e027fdc, which held `DecodeConfig.merge`; the option was removed after these runs (NOTES.md).
"""

import json
import os
from datetime import datetime, timezone

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels.sparse_attention.api as sapi
from eval.bench import common as bm
from pallas_kernels.sparse_attention import reference as ref
from pallas_kernels.sparse_attention import stacked
from pallas_kernels.sparse_attention.gpu import DecodeConfig

OUT = os.environ.get("OUT", ".")
PARTS = os.environ.get("PARTS", "123")
METHODS = tuple(os.environ.get("METHODS", "dense,streaming,kascade,quest,butler").split(","))
XLA, KERNEL = DecodeConfig(), DecodeConfig(merge="kernel")


def indices(key, B, H, N, K):
    """i32[B, H, 1, K]: K distinct ascending positions in [0, N) per row."""
    scores = jax.random.uniform(key, (B, H, N))
    idx = jax.lax.top_k(scores, K)[1]
    return jnp.sort(idx, axis=-1)[:, :, None].astype(jnp.int32)


def check_and_time():
    L, Hq, Hkv, D, N = 3, 32, 8, 128, 100_096
    rows = []
    for B in (4, 1):
        kk, kv = jax.random.split(jax.random.key(B))
        k_all = jax.random.normal(kk, (L, B, Hkv, N, D), jnp.bfloat16)
        v_all = jax.random.normal(kv, (L, B, Hkv, N, D), jnp.bfloat16)
        lengths = jnp.full((B,), 100_000, jnp.int32)
        for variant in ("plain", "mapped", "query_heads"):
            H = Hq if variant == "query_heads" else Hkv
            kw = dict(query_heads=True) if variant == "query_heads" else {}
            if variant == "mapped":
                kw["head_map"] = jnp.asarray([3, 3, 0, 1, 7, 6, 5, 2], jnp.int32)
            jitted = {m: jax.jit(lambda q, i, k, v, c=c: stacked.sparse_decode_stacked_gpu(
                q, k, v, jnp.int32(1), i, lengths, return_lse=True, config=c, **kw)) for m, c in
                      (("xla", XLA), ("kernel", KERNEL))}
            fns = {m: (lambda q, i, f=f: f(q, i, k_all, v_all)) for m, f in jitted.items()}  # the cache an argument
            worst = dict(ref=0.0, xla=0.0, lse=0.0)
            for rep in range(3):
                kq, ki = jax.random.split(jax.random.key(100 * rep + B))
                q = jax.random.normal(kq, (B, 1, Hq, D), jnp.bfloat16)
                idx = indices(ki, B, H, 100_000, 10_010)
                out, lse = fns["kernel"](q, idx)
                out_x, lse_x = fns["xla"](q, idx)
                if variant == "query_heads":  # each query head alone over its KV head (the reference per head)
                    G = Hq // Hkv
                    want = jnp.concatenate([ref.sparse_decode_reference(
                        q[:, :, h:h + 1], k_all[1][:, h // G:h // G + 1], v_all[1][:, h // G:h // G + 1],
                        idx[:, h:h + 1], lengths) for h in range(Hq)], axis=2)
                else:
                    ridx = jnp.take(idx, kw["head_map"], axis=1) if variant == "mapped" else idx
                    want = ref.sparse_decode_reference(q, k_all[1], v_all[1], ridx, lengths)
                o, w, ox = (np.asarray(a, np.float32) for a in (out, want, out_x))
                assert np.isfinite(o).all() and np.isfinite(np.asarray(lse)).all(), "unwritten or NaN output"
                worst["ref"] = max(worst["ref"], float(np.linalg.norm(o - w) / np.linalg.norm(w)))
                worst["xla"] = max(worst["xla"], float(np.max(np.abs(o - ox))))
                worst["lse"] = max(worst["lse"], float(np.max(np.abs(np.asarray(lse) - np.asarray(lse_x)))))
            ok = worst["ref"] < 1e-2 and worst["xla"] <= 2 ** -6 and worst["lse"] < 1e-4
            q = jax.random.normal(jax.random.key(7), (B, 1, Hq, D), jnp.bfloat16)
            idx = indices(jax.random.key(8), B, H, 100_000, 10_010)
            times = {m: [bm.pipelined_ms(f, (q, idx), n=50) for _ in range(3)] for m, f in fns.items()}
            times["xla_again"] = [bm.pipelined_ms(fns["xla"], (q, idx), n=50) for _ in range(3)]
            row = dict(batch=B, variant=variant, rel_err_vs_reference=worst["ref"], max_abs_vs_xla_merge=worst["xla"],
                       max_abs_lse_vs_xla_merge=worst["lse"], ok=ok,
                       ms={m: float(np.median(t)) for m, t in times.items()})
            rows.append(row)
            print(json.dumps(row), flush=True)
        del k_all, v_all
    return rows


def end_to_end():
    from eval.bench.model import method_rows
    from models.params import random_params, with_layout
    from models.presets import preset

    cfg = preset("llama3-8b")
    hbm = bm.measure_hbm_gbs()
    params = with_layout(random_params(cfg, jax.random.key(0), jnp.bfloat16), "default", donate=True)
    rows = []
    for rnd, (merge, config) in enumerate((("xla", XLA), ("kernel", KERNEL), ("xla", XLA), ("kernel", KERNEL))):
        sapi.STACKED_DECODE_CONFIG = config
        jax.clear_caches()
        for r in method_rows(cfg, params, METHODS, (100_000,), (4,), 16, hbm, 0.1):
            r.update(merge=merge, round=rnd)
            rows.append(r)
            print(merge, r["method"], round(r.get("step_ms", float("nan")), 3), "ms", r.get("error", ""), flush=True)
    return rows


def main():
    out = {**bm.device_facts(), "date": datetime.now(timezone.utc).isoformat(),
           "commit": os.environ.get("GIT_COMMIT", ""), "command": f"PARTS={PARTS} METHODS={','.join(METHODS)} "
           "PYTHONPATH=. python eval/results/h200/merge_kernel/run_merge.py"}
    if "1" in PARTS or "2" in PARTS:
        try:
            out["op"] = check_and_time()
        except Exception as e:  # recorded; the end-to-end part still runs
            out["op_error"] = f"{type(e).__name__}: {e}"[:2000]
            print(out["op_error"], flush=True)
    if "3" in PARTS:
        out["end_to_end"] = end_to_end()
    with open(os.path.join(OUT, f"merge_{PARTS}.json"), "w") as f:
        json.dump(out, f, indent=1)
    for r in out.get("op", []):
        print(f"b{r['batch']} {r['variant']:12s} ok={r['ok']} err {r['rel_err_vs_reference']:.2e} "
              f"vs xla {r['max_abs_vs_xla_merge']:.1e} ms " + " ".join(f"{k} {v:.4f}" for k, v in r["ms"].items()))
    print("| round | merge | " + " | ".join(METHODS) + " |")
    for rnd in range(4):
        rs = [r for r in out.get("end_to_end", []) if r["round"] == rnd]
        if rs:
            print(f"| {rnd} | {rs[0]['merge']} | " + " | ".join(
                f"{r.get('step_ms', float('nan')):.3f} ({r.get('speedup', 0):.3f}x, {r.get('floor_fraction', 0):.3f})"
                for r in rs) + " |")


if __name__ == "__main__":
    main()

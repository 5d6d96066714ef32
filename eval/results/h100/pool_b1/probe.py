"""Is the anchor scoring's Triton pooling pass (`AnchorConfig.pool="triton"`: the splits' log-sum-exp merged in the
pass, one launch) faster than the default XLA pooling (three small XLA kernels for the log-sum-exp, then the pooling
fusion) at batch 1, in the model's own decode loop? `../../h200/pool_ab/` found no difference at batch 4 (H200); at
batch 1 the oracle on Qwen3-8B shapes is issue 24's cell under the bar (share 0.845, `../e2e_1207c/`), and its
profile (`../profile_qwen3/`) has eight XLA kernels a sparse layer beside its Pallas ones.

Random bf16 weights and cache (`eval.bench.model.method_rows`, 16 timed steps, dense first and last), 100K context;
for each SHAPE: the oracle and Kascade at batch 1 and the oracle at batch 4, each with the library's AnchorConfig, with
pool="xla" and with `POOLS` (`pool_block:pool_warps` of the Triton pass), then "xla" again; each traced afresh.

    GIT_COMMIT=<sha> OUT=... PYTHONPATH=. python3 eval/results/h100/pool_b1/probe.py
    SHAPES="qwen3-8b" CASES="oracle:1" POOLS="2048:4" ...
    SMOKE=1 CONTEXT=1024 JAX_PLATFORMS=cpu ...  (the harness on a CPU, a small model; the pool is GPU-only)

Writes $OUT/pool_<shape>.json and prints a table.
"""

import dataclasses
import functools
import json
import os
from datetime import datetime, timezone

import jax
import jax.numpy as jnp

import pallas_kernels.anchor_attention.gpu as agpu
from eval.bench import common as bm
from eval.bench.model import method_rows
from models.params import random_params, with_layout
from models.presets import preset

CONTEXT = int(os.environ.get("CONTEXT", 100000))
LIBRARY = agpu.anchor_decode_gpu


def set_pool(pool):
    """The anchor layers trace with AnchorConfig(pool="triton", pool_block, pool_warps), with pool="xla" ("xla"), or
    with the library's default (None)."""
    if pool is None:
        agpu.anchor_decode_gpu = LIBRARY
        return
    config = agpu.AnchorConfig(pool="xla") if pool == "xla" else agpu.AnchorConfig(
        pool="triton", pool_block=pool[0], pool_warps=pool[1])
    agpu.anchor_decode_gpu = functools.partial(LIBRARY, config=config)


def main(out_dir):
    pools = [tuple(int(x) for x in w.split(":")) for w in os.environ.get("POOLS", "2048:4 1024:4").split()]
    cases = os.environ.get("CASES", "oracle:1 kascade:1 oracle:4").split()
    table = []
    for shape in os.environ.get("SHAPES", "qwen3-8b llama3-8b").split():
        cfg = preset(shape)
        if os.environ.get("SMOKE"):  # the harness on a CPU: a small model of the shape's kind
            cfg = dataclasses.replace(cfg, num_layers=3, hidden_size=256, intermediate_size=512, num_heads=4,
                                      num_kv_heads=2, head_dim=64, vocab_size=512)
        hbm = bm.measure_hbm_gbs()
        params = with_layout(random_params(cfg, jax.random.key(0), jnp.bfloat16), "default", donate=True)
        rows = []

        def run(name, method, batch, pool):
            set_pool(pool)
            jax.clear_caches()
            row = method_rows(cfg, params, (method,), (CONTEXT,), (batch,), 16, hbm, 0.1)[0]
            row.update(variant=name, batch=batch)
            rows.append(row)
            table.append((shape, method, batch, name, row.get("step_ms", float("nan"))))
            print(f"{shape} {method} b{batch} {name}: {row.get('step_ms', float('nan')):.3f} ms", flush=True)

        for batch in sorted({int(c.split(":")[1]) for c in cases}):
            run("dense", "dense", batch, None)
        for case in cases:
            method, batch = case.split(":")
            variants = ([("library", None), ("xla", "xla")] + [(f"triton {b}:{w}", (b, w)) for b, w in pools]
                        + [("xla (again)", "xla")])
            for name, pool in variants:
                try:
                    run(name, method, int(batch), pool)
                except Exception as e:  # a variant that cannot compile: recorded, the others still run
                    rows.append(dict(variant=name, method=method, batch=int(batch),
                                     error=f"{type(e).__name__}: {e}"[:500]))
                    print(name, "failed", rows[-1]["error"][:200], flush=True)
        for batch in sorted({int(c.split(":")[1]) for c in cases}):
            run("dense (again)", "dense", batch, None)
        set_pool(None)
        out = {**bm.device_facts(), "date": datetime.now(timezone.utc).isoformat(),
               "commit": os.environ.get("GIT_COMMIT", ""),
               "command": f"SHAPES={shape} CASES=\"{' '.join(cases)}\" POOLS=\"{os.environ.get('POOLS', '2048:4 1024:4')}\""
                          " PYTHONPATH=. python3 eval/results/h100/pool_b1/probe.py",
               "shape": shape, "context": CONTEXT, "measured_hbm_gbs": hbm, "rows": rows}
        with open(os.path.join(out_dir, f"pool_{shape}.json"), "w") as f:
            json.dump(out, f, indent=1)
    print("\nshape      method   b  variant          step ms")
    for shape, method, batch, name, ms in table:
        print(f"{shape:10s} {method:8s} {batch:2d} {name:16s} {ms:8.3f}")


if __name__ == "__main__":
    main(os.environ.get("OUT", "."))

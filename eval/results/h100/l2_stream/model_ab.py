"""EvoSparse's decode step with its sparse layers' O-projection weights read on a second stream while their attention
runs (`models.llama.O_PREFETCH`, the hook of this probe; `probe.py` asks the same of one layer's kernels): random
bf16 weights and cache (`eval.bench.model.method_rows`, 16 timed steps, dense first and last), 100K context.
Variants: none (the library), "sparse" (every layer of a "sparse..." run), "inherit" (the layers that inherit a
retrieval set, whose attention reads 17-25 MB; the scoring layers stream their retrieval heads' whole K), none again.

    GIT_COMMIT=<sha> OUT=... PYTHONPATH=. python3 eval/results/h100/l2_stream/model_ab.py
    CASES="llama3-8b:4 qwen3-8b:3" ...;  SMOKE=1 CONTEXT=1024 JAX_PLATFORMS=cpu ...  (the harness, a small model)
"""
import dataclasses
import json
import os
from datetime import datetime, timezone

if not os.environ.get("SMOKE"):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_experimental_stream_annotation=true").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from eval.bench import common as bm  # noqa: E402
from eval.bench.model import method_rows  # noqa: E402
from models import llama  # noqa: E402
from models.params import random_params, with_layout  # noqa: E402
from models.presets import preset  # noqa: E402

CONTEXT = int(os.environ.get("CONTEXT", 100000))
VARIANTS = {"none": None, "sparse": lambda seg: bool(seg) and seg.startswith("sparse"),
            "inherit": lambda seg: bool(seg) and seg.endswith(":inherit")}


def main(out_dir):
    table = []
    for case in os.environ.get("CASES", "llama3-8b:4 qwen3-8b:3").split():
        shape, batch = case.split(":")
        batch = int(batch)
        cfg = preset(shape)
        if os.environ.get("SMOKE"):
            cfg = dataclasses.replace(cfg, num_layers=4, hidden_size=256, intermediate_size=512, num_heads=4,
                                      num_kv_heads=2, head_dim=64, vocab_size=512)
        hbm = bm.measure_hbm_gbs()
        params = with_layout(random_params(cfg, jax.random.key(0), jnp.bfloat16), "default", donate=True)
        rows = []

        def run(name, method, hook):
            llama.O_PREFETCH = hook
            jax.clear_caches()
            row = method_rows(cfg, params, (method,), (CONTEXT,), (batch,), 16, hbm, 0.1)[0]
            row.update(variant=name)
            rows.append(row)
            table.append((shape, batch, method, name, row.get("step_ms", float("nan"))))
            print(f"{shape} b{batch} {method} {name}: {row.get('step_ms', float('nan')):.3f} ms", flush=True)

        run("none", "dense", None)
        for name in ("none", "sparse", "inherit", "none"):
            try:
                run(name, "evosparse", VARIANTS[name])
            except Exception as e:  # recorded, the others still run
                rows.append(dict(variant=name, error=f"{type(e).__name__}: {e}"[:500]))
                print(name, "failed", rows[-1]["error"][:300], flush=True)
        run("none (again)", "dense", None)
        llama.O_PREFETCH = None
        out = {**bm.device_facts(), "date": datetime.now(timezone.utc).isoformat(),
               "commit": os.environ.get("GIT_COMMIT", ""), "xla_flags": os.environ.get("XLA_FLAGS"),
               "command": f"CASES={case} PYTHONPATH=. python3 eval/results/h100/l2_stream/model_ab.py",
               "shape": shape, "context": CONTEXT, "batch": batch, "measured_hbm_gbs": hbm, "rows": rows}
        with open(os.path.join(out_dir, f"model_ab_{shape}_b{batch}.json"), "w") as f:
            json.dump(out, f, indent=1)
    print("\nshape      b  method     variant        step ms")
    for shape, batch, method, name, ms in table:
        print(f"{shape:10s} {batch:2d} {method:10s} {name:14s} {ms:8.3f}")


if __name__ == "__main__":
    main(os.environ.get("OUT", "."))

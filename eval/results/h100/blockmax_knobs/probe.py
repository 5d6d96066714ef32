"""EvoSparse's retrieval scoring (`evosparse_block_max`: 13-14 launches a step, 36-42 us each at 100K, about 2.8 TB/s
of the retrieval heads' K against dense's 3.1, `../profile_1207/`, `../profile_qwen3/`) under other `BlockMaxConfig`s,
in the model's own decode loop: does a config move the step of issue 24's EvoSparse cells under the bar (Llama-3.1-8B
100K batch 4, Qwen3-8B 100K batch 3)?

Random bf16 weights and cache (`eval.bench.model.method_rows`, 16 timed steps, dense first and last), 100K context;
each case's variants: the library's config, then each of `KNOBS` (`field=value[,field=value]` of `BlockMaxConfig` set
on the library's), then the library's again; each traced afresh.

    GIT_COMMIT=<sha> OUT=... PYTHONPATH=. python3 eval/results/h100/blockmax_knobs/probe.py
    CASES="qwen3-8b:3" KNOBS="num_warps=8 blocks_per_program=32" ...
    SMOKE=1 CONTEXT=1024 JAX_PLATFORMS=cpu ...  (the harness on a CPU, a small model; the kernel is GPU-only)

Writes $OUT/blockmax_<shape>_b<batch>.json per case and prints a table.
"""

import dataclasses
import functools
import json
import os
from datetime import datetime, timezone

import jax
import jax.numpy as jnp

import pallas_kernels.block_scores.gpu as bgpu
from eval.bench import common as bm
from eval.bench.model import method_rows
from models.params import random_params, with_layout
from models.presets import preset

CONTEXT = int(os.environ.get("CONTEXT", 100000))
LIBRARY = bgpu.block_max_scores_gpu


def knobs() -> list[tuple[str, dict]]:
    out = []
    for w in os.environ.get("KNOBS", "num_warps=8 blocks_per_program=32 num_stages=4").split():
        fields = {}
        for part in w.split(","):
            field, _, value = part.partition("=")
            if field not in {f.name for f in dataclasses.fields(bgpu.BlockMaxConfig)} or not value.isdigit():
                raise SystemExit(f"KNOBS word {w!r}: expected FIELD=INT[,...] with FIELD a BlockMaxConfig field")
            fields[field] = int(value)
        out.append((w, fields))
    return out


def set_config(config):
    bgpu.block_max_scores_gpu = LIBRARY if config is None else functools.partial(LIBRARY, config=config)


def main(out_dir):
    table = []
    for case in os.environ.get("CASES", "llama3-8b:4 qwen3-8b:3").split():
        shape, batch = case.split(":")
        batch = int(batch)
        cfg = preset(shape)
        if os.environ.get("SMOKE"):
            cfg = dataclasses.replace(cfg, num_layers=3, hidden_size=256, intermediate_size=512, num_heads=4,
                                      num_kv_heads=2, head_dim=64, vocab_size=512)
        hbm = bm.measure_hbm_gbs()
        params = with_layout(random_params(cfg, jax.random.key(0), jnp.bfloat16), "default", donate=True)
        rows = []

        def run(name, method, config):
            set_config(config)
            jax.clear_caches()
            row = method_rows(cfg, params, (method,), (CONTEXT,), (batch,), 16, hbm, 0.1)[0]
            row.update(variant=name, block_max_config=None if config is None else str(config))
            rows.append(row)
            table.append((shape, batch, name, row.get("step_ms", float("nan"))))
            print(f"{shape} b{batch} {name}: {row.get('step_ms', float('nan')):.3f} ms", flush=True)

        run("dense", "dense", None)
        base = bgpu.BlockMaxConfig()
        for name, config in ([("library", None)] + [(w, dataclasses.replace(base, **f)) for w, f in knobs()]
                             + [("library (again)", None)]):
            try:
                run(name, "evosparse", config)
            except Exception as e:  # a config the kernel cannot compile: recorded, the others still run
                rows.append(dict(variant=name, error=f"{type(e).__name__}: {e}"[:500]))
                print(name, "failed", rows[-1]["error"][:200], flush=True)
        run("dense (again)", "dense", None)
        set_config(None)
        out = {**bm.device_facts(), "date": datetime.now(timezone.utc).isoformat(),
               "commit": os.environ.get("GIT_COMMIT", ""),
               "command": f"CASES={case} KNOBS=\"{os.environ.get('KNOBS', 'num_warps=8 blocks_per_program=32 num_stages=4')}\""
                          " PYTHONPATH=. python3 eval/results/h100/blockmax_knobs/probe.py",
               "shape": shape, "context": CONTEXT, "batch": batch, "measured_hbm_gbs": hbm, "rows": rows}
        with open(os.path.join(out_dir, f"blockmax_{shape}_b{batch}.json"), "w") as f:
            json.dump(out, f, indent=1)
    print("\nshape      b  variant                    step ms")
    for shape, batch, name, ms in table:
        print(f"{shape:10s} {batch:2d} {name:26s} {ms:8.3f}")


if __name__ == "__main__":
    main(os.environ.get("OUT", "."))

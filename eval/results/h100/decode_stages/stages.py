"""Variants of the gathered decodes' `DecodeConfig` in the model's own decode loop, on the GPU: first the
software-pipelining depth (`num_stages`; a split of EvoSparse's decode runs 2 iterations at 100K, batch 4 and the
oracle's 3 at batch 1, where three stages of K and V tiles in shared memory may only cost occupancy), then any field
(`KNOBS`, e.g. the split heuristic's `target_programs`: `../decode_waves/`). Random bf16 weights and cache of the
`SHAPE` preset (default llama3-8b), `eval.bench.model.method_rows` (16 timed steps, dense first and again last); each
variant traced afresh.

    CASES="evosparse:4 oracle:1 h2o:4" STAGES="3 2 1" PYTHONPATH=. python eval/results/h100/decode_stages/stages.py
    SHAPE=qwen3-8b CASES="evosparse:3" KNOBS="target_programs=264 target_programs=768" PYTHONPATH=. python ...
    CASES="evosparse:4" KNOBS="block_k=128,target_programs=132" PYTHONPATH=. python ...

Writes $OUT/stages_<method>_b<batch>.json per case (`stages_<shape>_<method>_b<batch>.json` for another SHAPE); a
case's variants: the library's config, then each of STAGES (`num_stages=S`) or, when set, each of KNOBS
(`field=value`, an int field of `DecodeConfig` set on the library's config; several joined by commas,
`block_k=128,target_programs=132`, set together).
"""

import dataclasses
import json
import os
from datetime import datetime, timezone

import jax
import jax.numpy as jnp

import jsparse.methods.evosparse as evo
import jsparse.methods.h2o as h2o
import pallas_kernels.sparse_attention.api as sapi
from eval.bench import common as bm
from eval.bench.model import method_rows
from models.params import random_params, with_layout
from models.presets import preset
from pallas_kernels.sparse_attention.gpu import DecodeConfig

CONTEXT = int(os.environ.get("CONTEXT", 100000))
SHAPE = os.environ.get("SHAPE", "llama3-8b")


def knobs() -> list[tuple[str, dict]]:
    """(name, DecodeConfig fields) of each variant after the library's: KNOBS' `field=value` words, else STAGES'."""
    words = os.environ.get("KNOBS", "").split() or [f"num_stages={s}" for s in os.environ.get("STAGES", "2 1").split()]
    out = []
    for w in words:  # a word sets one field or several, joined by commas: block_k=128,target_programs=132
        fields = {}
        for part in w.split(","):
            field, _, value = part.partition("=")
            if field not in {f.name for f in dataclasses.fields(DecodeConfig)} or not value.lstrip("-").isdigit():
                raise SystemExit(f"KNOBS word {w!r}: expected FIELD=INT[,FIELD=INT...] with FIELD a DecodeConfig field")
            fields[field] = int(value)
        out.append((w, fields))
    return out


def set_config(method: str, config):
    """The gathered decode config `method` traces with (None: the library's)."""
    if method == "evosparse":
        evo.DECODE_CONFIG = config
    elif method == "h2o":
        h2o.DECODE_CONFIG = config
    else:
        sapi.STACKED_DECODE_CONFIG = config


def main(out_dir):
    cfg = preset(SHAPE)
    hbm = bm.measure_hbm_gbs()
    params = with_layout(random_params(cfg, jax.random.key(0), jnp.bfloat16), "default", donate=True)
    library = {"evosparse": evo.DECODE_CONFIG, "h2o": h2o.DECODE_CONFIG, "other": sapi.STACKED_DECODE_CONFIG}
    for case in os.environ.get("CASES", "evosparse:4 oracle:1 h2o:4").split():
        method, batch = case.split(":")
        batch = int(batch)
        base = library.get(method, library["other"]) or DecodeConfig()
        variants = [("library", None)] + [(name, dataclasses.replace(base, **fields)) for name, fields in knobs()]
        rows = []

        def run(name, m, config):
            set_config(m, config)
            jax.clear_caches()
            row = method_rows(cfg, params, (m,), (CONTEXT,), (batch,), 16, hbm, 0.1)[0]
            row.update(variant=name, decode_config=None if config is None else str(config))
            rows.append(row)
            print(f"{method} b{batch} {name}: {row.get('step_ms', float('nan')):.3f} ms", flush=True)

        run("dense", "dense", None)
        for name, config in variants:
            try:
                run(name, method, config)
            except Exception as e:  # a config a kernel cannot compile: recorded, the others still run
                rows.append(dict(variant=name, error=f"{type(e).__name__}: {e}"[:500]))
                print(name, "failed", rows[-1]["error"][:200], flush=True)
        run("dense (again)", "dense", None)
        set_config(method, None if method not in library else library[method])
        out = {**bm.device_facts(), "date": datetime.now(timezone.utc).isoformat(),
               "commit": os.environ.get("GIT_COMMIT", ""),
               "command": f"SHAPE={SHAPE} CASES={case} STAGES=\"{os.environ.get('STAGES', '2 1')}\" "
                          f"KNOBS=\"{os.environ.get('KNOBS', '')}\" PYTHONPATH=. python "
                          "eval/results/h100/decode_stages/stages.py", "shape": SHAPE, "context": CONTEXT,
               "batch": batch, "method": method, "measured_hbm_gbs": hbm, "rows": rows}
        prefix = "stages" if SHAPE == "llama3-8b" else f"stages_{SHAPE}"
        with open(os.path.join(out_dir, f"{prefix}_{method}_b{batch}.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(os.environ.get("OUT", "."))

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
import os


import pallas_kernels.block_scores.gpu as bgpu
from eval.bench import common as bm
from eval.bench.model import probe_model, probe_record, probe_rows

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
    printed = []
    base = bgpu.BlockMaxConfig()
    for case in os.environ.get("CASES", "llama3-8b:4 qwen3-8b:3").split():
        shape, batch = case.split(":")
        batch = int(batch)
        cfg, params = probe_model(shape, bool(os.environ.get("SMOKE")))
        hbm = bm.measure_hbm_gbs()
        runs = ([("dense", "dense", batch, None), ("library", "evosparse", batch, None)]
                + [(w, "evosparse", batch, dataclasses.replace(base, **f)) for w, f in knobs()]
                + [("library (again)", "evosparse", batch, None), ("dense (again)", "dense", batch, None)])
        rows = probe_rows(cfg, params, runs, set_config, CONTEXT, hbm)
        for r, (_, _, _, config) in zip(rows, runs):
            r["block_max_config"] = None if config is None else str(config)
        printed += [dict(r, shape=shape) for r in rows]
        record = probe_record(f"CASES={case} KNOBS=\"{os.environ.get('KNOBS', 'num_warps=8 blocks_per_program=32 num_stages=4')}\""
                           " PYTHONPATH=. python3 eval/results/h100/blockmax_knobs/probe.py", rows,
                           shape=shape, context=CONTEXT, batch=batch, measured_hbm_gbs=hbm)
        bm.write_json(os.path.join(out_dir, f"blockmax_{shape}_b{batch}.json"), record)
    print(bm.table(printed, ["shape", "method", "batch", "variant", "step_ms"]))


if __name__ == "__main__":
    main(os.environ.get("OUT", "."))

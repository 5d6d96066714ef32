"""Tuning knobs of two decode steps in the model's own decode loop (Llama-3.1-8B shapes, random bf16 weights and
cache, `eval.bench.model.method_rows`, dense first): EvoSparse's candidate-rank kernel's warps
(`pallas_kernels.block_scores.gpu.CAND_WARPS`) and the gathered decode-with-mass config of H2O
(`jsparse.methods.h2o.DECODE_CONFIG`) and EvoSparse (`jsparse.methods.evosparse.DECODE_CONFIG`). Each variant is
traced afresh (`jax.clear_caches()`); dense is timed again at the end. Writes $OUT/decode_knobs_roundN.json (env
ROUND=N picks the variants, default 2).

    PYTHONPATH=. python eval/results/h200/tuning/decode_knobs.py   (env: CONTEXT=100000 BATCH=4)
"""

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
from pallas_kernels.block_scores import gpu as bgpu
from pallas_kernels.page_scores import gpu as pgpu
from pallas_kernels.sparse_attention.gpu import DecodeConfig

CONTEXT, BATCH = int(os.environ.get("CONTEXT", 100000)), int(os.environ.get("BATCH", 4))

ROUNDS = {  # (name, method, CAND_WARPS, DecodeConfig or None); env ROUND picks one (decode_knobs_roundN.json)
    "1": [("evosparse", "evosparse", 4, None),
          ("evosparse cand_warps=8", "evosparse", 8, None),
          ("evosparse cand_warps=2", "evosparse", 2, None),
          ("evosparse stages=4", "evosparse", 4, DecodeConfig(num_stages=4)),
          ("h2o", "h2o", 4, None),
          ("h2o stages=4", "h2o", 4, DecodeConfig(num_stages=4)),
          ("h2o block_k=128", "h2o", 4, DecodeConfig(block_k=128)),
          ("h2o block_k=32", "h2o", 4, DecodeConfig(block_k=32)),
          ("h2o warps=8", "h2o", 4, DecodeConfig(num_warps=8))],
    "2": [("evosparse cand_warps=4", "evosparse", 4, None),
          ("evosparse cand_warps=8", "evosparse", 8, None),
          ("evosparse cand_warps=16", "evosparse", 16, None),
          ("evosparse cand_warps=8 block_k=32", "evosparse", 8, DecodeConfig(block_k=32)),
          ("evosparse cand_warps=8 block_k=128", "evosparse", 8, DecodeConfig(block_k=128)),
          ("h2o block_k=64", "h2o", 4, None),
          ("h2o block_k=32", "h2o", 4, DecodeConfig(block_k=32)),
          ("h2o block_k=16", "h2o", 4, DecodeConfig(block_k=16)),
          ("h2o block_k=32 stages=4", "h2o", 4, DecodeConfig(block_k=32, num_stages=4)),
          ("h2o block_k=32 warps=2", "h2o", 4, DecodeConfig(block_k=32, num_warps=2))],
    # Round 3: the plain stacked gathered decode (`sparse_attention.api.STACKED_DECODE_CONFIG`) under Kascade,
    # StreamingLLM and Quest (the library's defaults of round 2 for the others).
    "3": [(f"{m}{tag}", m, 8, cfg) for m in ("kascade", "streaming", "quest")
          for tag, cfg in (("", None), (" block_k=32", DecodeConfig(block_k=32)),
                           (" block_k=32 stages=4", DecodeConfig(block_k=32, num_stages=4)),
                           (" stages=4", DecodeConfig(num_stages=4)))],
    # Round 4: Quest's page-score kernel (`pallas_kernels.page_scores.gpu`: pages per program, warps).
    "4": [(f"quest block_p={bp} warps={w}", "quest", 8, None, {"BLOCK_P": bp, "NUM_WARPS": w})
          for bp, w in ((64, 4), (32, 4), (128, 4), (64, 8), (128, 8), (256, 8))],
    # Round 5 (2026-12-01, `decode_knobs_round5.json`): the gathered decodes' split count (target_programs; 512 by
    # default: 16 splits of 32 rows at batch 4, 2 iterations each for EvoSparse's 128 blocks).
    "5": [(f"{m}{tag}", m, 8, cfg) for m, base in (("kascade", {}), ("streaming", {}), ("h2o", {"block_k": 32}),
                                                   ("evosparse", {}))
          for tag, cfg in (("", DecodeConfig(**base) if base else None),
                           *((f" target_programs={tp}", DecodeConfig(**base, target_programs=tp))
                             for tp in ((128, 256) if m == "evosparse" else (256, 1024) if m == "kascade"
                                        else (256,))))],
}
VARIANTS = ROUNDS[os.environ.get("ROUND", "2")]


def main(out_dir):
    cfg = preset("llama3-8b")
    hbm = bm.measure_hbm_gbs()
    params = with_layout(random_params(cfg, jax.random.key(0), jnp.bfloat16), "default", donate=True)
    rows = []
    evo_default, h2o_default = evo.DECODE_CONFIG, h2o.DECODE_CONFIG

    def run(name, method, warps, config, page_scores=None):
        for attr, value in {"BLOCK_P": 32, "NUM_WARPS": 4, **(page_scores or {})}.items():
            setattr(pgpu, attr, value)
        bgpu.CAND_WARPS = warps
        evo.DECODE_CONFIG = config if method == "evosparse" else evo_default
        h2o.DECODE_CONFIG = config if method == "h2o" else h2o_default
        sapi.STACKED_DECODE_CONFIG = config if method not in ("evosparse", "h2o") else None
        jax.clear_caches()
        row = method_rows(cfg, params, (method,), (CONTEXT,), (BATCH,), 16, hbm, 0.1)[0]
        row.update(variant=name, cand_warps=warps, decode_config=None if config is None else str(config),
                   page_scores=page_scores)
        rows.append(row)
        print(name, round(row.get("step_ms", float("nan")), 3), "ms", flush=True)

    run("dense", "dense", 4, None)
    for v in VARIANTS:
        try:
            run(*v)
        except Exception as e:  # a config a kernel cannot compile: recorded, the others still run
            rows.append(dict(variant=v[0], error=f"{type(e).__name__}: {e}"[:500]))
            print(v[0], "failed", rows[-1]["error"][:200], flush=True)
    run("dense (again)", "dense", 4, None)
    rnd = os.environ.get("ROUND", "2")
    out = {**bm.device_facts(), "date": datetime.now(timezone.utc).isoformat(),
           "commit": os.environ.get("GIT_COMMIT", ""),
           "command": f"ROUND={rnd} PYTHONPATH=. python eval/results/h200/tuning/decode_knobs.py", "shape": "llama3-8b",
           "context": CONTEXT, "batch": BATCH, "measured_hbm_gbs": hbm, "rows": rows}
    with open(os.path.join(out_dir, f"decode_knobs_round{os.environ.get('ROUND', '2')}.json"), "w") as f:
        json.dump(out, f, indent=1)
    dense = [r["step_ms"] for r in rows if r.get("method") == "dense"]
    print("| variant | step ms | speedup vs dense (first / again) |\n|---|---|---|")
    for r in rows:
        if "step_ms" in r:
            ms = r["step_ms"]
            print(f"| {r['variant']} | {ms:.3f} | {dense[0] / ms:.3f} / {dense[-1] / ms:.3f} |")


if __name__ == "__main__":
    main(os.environ.get("OUT", "."))

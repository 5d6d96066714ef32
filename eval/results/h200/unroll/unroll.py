"""The decode step's layer scan unrolled in full against the rolled scan (issue 24): H200 experiment.

One process, Llama-3.1-8B shapes, random bf16 weights and cache, 100K, batch 4, budget 0.1: `method_rows` (the
`jsparse bench model` rows) of METHODS (env, default dense,streaming) with `models.llama.decode`'s `unroll` default
set to 1 and to True in turn (ROUNDS, default "1,T,1,T"), each after `jax.clear_caches()`. Writes
$OUT/unroll.json and prints a table: step ms and share of the bytes floor per method and round.
Usage (GPU): OUT=... python eval/results/h200/unroll/unroll.py
"""
import json
import os
import time

import jax

from eval.bench import common as bm
from eval.bench import model as bmod
from models import llama


def main():
    out = os.environ.get("OUT", "/tmp")
    methods = tuple(os.environ.get("METHODS", "dense,streaming").split(","))
    rounds = os.environ.get("ROUNDS", "1,T,1,T").split(",")
    cfg = bmod.preset("llama3-8b")
    hbm = bm.measure_hbm_gbs()
    params = bmod.bench_params(cfg, "default")
    res = dict(bm.device_facts(), command="OUT=... python eval/results/h200/unroll/unroll.py", methods=methods,
               context=100000, batch=4, budget=0.1, rounds=[])
    for r in rounds:
        unroll = True if r == "T" else int(r)
        llama.decode.__kwdefaults__["unroll"] = unroll
        jax.clear_caches()
        t0 = time.perf_counter()
        rows = bmod.method_rows(cfg, params, methods, [100000], [4], 16, hbm, 0.1)
        res["rounds"].append(dict(unroll=r, seconds=round(time.perf_counter() - t0, 1), rows=rows))
        with open(os.path.join(out, "unroll.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
    print(f"{'round':>6s} " + " ".join(f"{m:>22s}" for m in methods))
    for rd in res["rounds"]:
        cells = []
        for row in rd["rows"]:
            cells.append(f"{row.get('step_ms', float('nan')):8.3f} ms ({row.get('floor_fraction', float('nan')):.3f})"
                         if "error" not in row else row["error"][:22])
        print(f"{rd['unroll']:>6s} " + " ".join(f"{c:>22s}" for c in cells), f"[{rd['seconds']} s]")


if __name__ == "__main__":
    main()

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


def timed_rounds(res: dict, key: str, rounds, setup, cfg, params, hbm, methods, path: str) -> None:
    """For each round r: setup(r) (which clears jax's caches; it may return the decode steps a call, default 16),
    then `method_rows` of methods at 100K, batch 4, budget 0.1, appended to res["rounds"] as {key: r, seconds,
    rows}; res is rewritten to path after every round. Then prints the table (step ms, share of the bytes floor).
    Also ../merge_variadic/run_merge.py's and steps.py's rounds."""
    res["rounds"] = []
    for r in rounds:
        steps = setup(r) or 16
        t0 = time.perf_counter()
        rows = bmod.method_rows(cfg, params, methods, [100000], [4], steps, hbm, 0.1)
        res["rounds"].append({key: r, "seconds": round(time.perf_counter() - t0, 1), "rows": rows})
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=str)
    print(f"{key:>9s} " + " ".join(f"{m:>22s}" for m in methods))
    for rd in res["rounds"]:
        cells = [f"{r['step_ms']:8.3f} ms ({r.get('floor_fraction', float('nan')):.3f})" if "error" not in r
                 else r["error"][:22] for r in rd["rows"]]
        print(f"{rd[key]:>9s} " + " ".join(f"{c:>22s}" for c in cells), f"[{rd['seconds']} s]")


def set_unroll(r: str) -> None:
    """"T": `models.llama.decode` unrolls its layer scan in full by default, else the unroll factor int(r); clears
    jax's caches so that the next calls compile again."""
    llama.decode.__kwdefaults__["unroll"] = True if r == "T" else int(r)
    jax.clear_caches()


def run_rounds(key: str, setup, script: str, name: str, methods: str, rounds: str, **facts) -> None:
    """`timed_rounds` of $METHODS (default `methods`) over $ROUNDS (default `rounds`) on Llama-3.1-8B shapes, random
    bf16 weights, into $OUT/name, the JSON also holding the device facts, `script`'s command and `facts`."""
    out = os.environ.get("OUT", "/tmp")
    methods = tuple(os.environ.get("METHODS", methods).split(","))
    cfg = bmod.preset("llama3-8b")
    hbm = bm.measure_hbm_gbs()
    params = bmod.bench_params(cfg, "default")
    res = dict(bm.device_facts(), **facts, command=f"OUT=... python {script}", methods=methods, context=100000,
               batch=4, budget=0.1)
    timed_rounds(res, key, os.environ.get("ROUNDS", rounds).split(","), setup, cfg, params, hbm, methods,
                 os.path.join(out, name))


def main():
    run_rounds("unroll", set_unroll, "eval/results/h200/unroll/unroll.py", "unroll.json", "dense,streaming",
               "1,T,1,T")


if __name__ == "__main__":
    main()

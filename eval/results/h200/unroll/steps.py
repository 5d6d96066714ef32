"""The rolled and the fully unrolled layer scan, timed over 16 and over 64 decode steps per call (issue 24): H200.

profile_unrolled.py found the unrolled step without idle time at the layer boundaries, but with a lead-in of about
2 ms that each call pays before its first layer (the rolled scan's: about 0.45 ms). `jsparse bench model` times one
call of 16 steps, so that lead-in weighs 0.13 ms a step there, and less in `generate`'s one loop over all tokens.
Here: `method_rows` of METHODS (env, default dense,streaming,kascade) at 100K, batch 4, budget 0.1 for each round
of ROUNDS (env, default "1:16,T:16,1:64,T:64,1:16,T:16,1:64,T:64": unroll:steps), `jax.clear_caches()` between
rounds. The library's XLA flags are set first, as `jsparse bench model` does (`jsparse.xla_flags`); NOFLAGS=1
leaves them out (steps_noflags.json was such a run). Writes $OUT/steps.json and prints a table.
Usage (GPU): OUT=... PYTHONPATH=. python eval/results/h200/unroll/steps.py
"""
import json
import os
import time

import jax

from eval.bench import common as bm
from eval.bench import model as bmod
from models import llama


def main():
    if os.environ.get("NOFLAGS") != "1":
        from jsparse.xla_flags import set_xla_flags
        set_xla_flags()
    out = os.environ.get("OUT", "/tmp")
    methods = tuple(os.environ.get("METHODS", "dense,streaming,kascade").split(","))
    rounds = os.environ.get("ROUNDS", "1:16,T:16,1:64,T:64,1:16,T:16,1:64,T:64").split(",")
    cfg = bmod.preset("llama3-8b")
    hbm = bm.measure_hbm_gbs()
    params = bmod.bench_params(cfg, "default")
    res = dict(bm.device_facts(), xla_flags=os.environ.get("XLA_FLAGS", ""), command="OUT=... python eval/results/h200/unroll/steps.py", methods=methods,
               context=100000, batch=4, budget=0.1, rounds=[])
    for r in rounds:
        unroll, steps = r.split(":")
        llama.decode.__kwdefaults__["unroll"] = True if unroll == "T" else int(unroll)
        jax.clear_caches()
        t0 = time.perf_counter()
        rows = bmod.method_rows(cfg, params, methods, [100000], [4], int(steps), hbm, 0.1)
        res["rounds"].append({"round": r, "seconds": round(time.perf_counter() - t0, 1), "rows": rows})
        with open(os.path.join(out, "steps.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
    print(f"{'unroll:steps':>12s} " + " ".join(f"{m:>22s}" for m in methods))
    for rd in res["rounds"]:
        cells = [f"{x['step_ms']:8.3f} ms ({x.get('floor_fraction', float('nan')):.3f})" if "error" not in x
                 else x["error"][:22] for x in rd["rows"]]
        print(f"{rd['round']:>12s} " + " ".join(f"{c:>22s}" for c in cells), f"[{rd['seconds']} s]")


if __name__ == "__main__":
    main()

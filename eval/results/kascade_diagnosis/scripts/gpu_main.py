"""Runs the probe variants on repo prompts and book prompts; writes JSON per (set, length) to $OUT."""
import os, sys, json, time
sys.path.insert(0, os.path.dirname(__file__))
import numpy as np, jax, jax.numpy as jnp
import run as R
from eval import passkey
import jsparse
from models.cache import init_cache

out = os.environ["OUT"]
N = int(os.environ.get("N", 20))
L = R.L
every2 = list(range(0, L, 2))
t85 = [0, 1, 2, 11, 12, 20, 21, 28]
t90 = [0, 1, 2, 7, 8, 11, 12, 14, 17, 20, 21, 23, 24, 26, 28, 29]
ret = [0, 1, 3, 14, 18, 20, 21, 22, 24]
V = {
    "dense": {"anchors": "all", "dense_layers": tuple(range(L))},
    "oracle": {"anchors": "all"},
    "kascade": {},
    "kascade_r2": {"reuse_scale": 2.0},
    "kascade_r3": {"reuse_scale": 3.0},
    "kascade_r2_tile16": {"reuse_scale": 2.0, "tile": 16},
    "t85": {"anchors_list": t85},
    "t85_r2": {"anchors_list": t85, "reuse_scale": 2.0},
    "t90": {"anchors_list": t90},
    "t90_r2": {"anchors_list": t90, "reuse_scale": 2.0},
    "ret9": {"anchors_list": ret},
    "ret9_r2": {"anchors_list": ret, "reuse_scale": 2.0},
    "every2_r2": {"anchors_list": every2, "reuse_scale": 2.0},
    "oracle_b20": {"anchors": "all", "budget": 0.2},
}
sets = os.environ.get("SETS", "repo,book").split(",")
lengths = [int(x) for x in os.environ.get("LENGTHS", "2048").split(",")]
only = os.environ.get("ONLY")
if only: V = {k: V[k] for k in only.split(",")}
summary = []
for S in sets:
    for T in lengths:
        prompts = passkey.make_prompts(R.tok, T, N, seed=1) if S == "repo" else R.corpus_prompts(N, T, 1, os.environ["BOOK"])
        res = {}
        for name, spec in V.items():
            spec = dict(spec)
            t = time.time()
            a = spec.pop("anchors", "art")
            anch = list(range(L)) if a == "all" else spec.pop("anchors_list", list(R.anchors))
            ok, st = R.run_variant(R.make(anch, **spec), prompts)
            res[name] = {"ok": ok, "stats": {k: np.mean([s[k] for s in st], 0).tolist() for k in st[0]}}
            line = f"{S:5s} {T:5d} {name:26s} {sum(ok):2d}/{len(ok)} used_cov {np.mean(res[name]['stats']['used_cov']):.3f} ({time.time()-t:.0f}s)"
            print(line, flush=True); summary.append(line)
            json.dump(res, open(f"{out}/probe_{S}_{T}.json", "w"))
print("\n".join(summary))

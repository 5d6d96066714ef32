"""The draft's record selection by blocks at its 100K, batch 3 shapes: which `topk_select` path is fastest
(2026-12-06).

A later STS draft step (`jsparse.methods.sts.select_by_blocks`) runs two selections per step over 3 x 512 rows
(batch x draft query heads x draft layers): the top W = 520 of 6,290 block scores, then the top 520 of the 8,320
candidate keys of those blocks. Both take the "row" path by default (rows of at most `SelectConfig.row_max` scores).
Here each path and a few row settings run on rows like those (softmax weights of random normal logits, a tail of
-inf past the row's length), checked to choose exactly the default path's keys, and timed by their kernels' time
(jax.profiler, 10 calls).
Writes $OUT/topk_paths.json. Usage: PYTHONPATH=. OUT=... GIT_COMMIT=... python eval/results/h100/sts_shared/topk_paths.py
(SMOKE=1: small rows, interpreted; a CPU check of the script).
"""
import datetime, glob, gzip, json, os, sys
from collections import defaultdict
import numpy as np
import jax, jax.numpy as jnp

from pallas_kernels.topk_select import gpu

SMOKE = bool(os.environ.get("SMOKE"))
R, W = (8, 16) if SMOKE else (3 * 512, 520)
SHAPES = {"block_scores": 64 if SMOKE else 6290, "candidates": 256 if SMOKE else 16 * 520}
CONFIGS = {"default": gpu.SelectConfig(), "row_bits1": gpu.SelectConfig(path="row", row_bits=1),
           "row_bits4": gpu.SelectConfig(path="row", row_bits=4), "row_bits8": gpu.SelectConfig(path="row", row_bits=8),
           "row_warps4": gpu.SelectConfig(path="row", row_warps=4), "row_warps16": gpu.SelectConfig(path="row", row_warps=16),
           "ordered": gpu.SelectConfig(path="ordered"), "ordered_s2048": gpu.SelectConfig(path="ordered", sample_size=2048),
           "sample": gpu.SelectConfig(path="sample"),
           "fused": gpu.SelectConfig(path="fused")}


def kernel_us(fn, x, reps=10):
    jax.block_until_ready(fn(x))
    d = f"/tmp/topk_paths_{np.random.randint(1 << 30)}"
    with jax.profiler.trace(d):
        for _ in range(reps):
            jax.block_until_ready(fn(x))
    paths = sorted(glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True))
    if not paths:
        return None
    ev = json.load(gzip.open(paths[-1]))
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    pname = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
    tot = defaultdict(float)
    for e in ev:
        if e.get("ph") == "X" and "GPU" in pname.get(e.get("pid"), "") and "dur" in e:
            tot[e["name"]] += e["dur"]
    return {k: v / reps for k, v in sorted(tot.items(), key=lambda kv: -kv[1])}


res = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, commit=os.environ.get("GIT_COMMIT", ""),
           date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           command="python eval/results/h100/sts_shared/topk_paths.py", rows=R, k=W, shapes={})
ok = True
rng = np.random.default_rng(0)
for name, N in SHAPES.items():
    logits = rng.standard_normal((R, N)).astype(np.float32) * 2.0
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w[: R // 3, N - N // 5:] = -np.inf  # a shorter row: its tail cannot be chosen
    x = jnp.asarray(w)
    want = None
    rows = {}
    for label, cfg in CONFIGS.items():
        try:
            fn = jax.jit(lambda s, cfg=cfg: gpu.topk_select_gpu(s, W, W, config=cfg, interpret=SMOKE))
            got = np.asarray(fn(x))
            if want is None:
                want = got
            same = bool(np.array_equal(got, want))
            ok &= same
            k = kernel_us(fn, x)
            rows[label] = dict(path=cfg.pick_path(N, R, W), same_keys=same,
                               us=None if k is None else sum(k.values()), kernels=k)
        except Exception as e:  # a config a path refuses at this shape
            rows[label] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
        print(name, label, {k_: v for k_, v in rows[label].items() if k_ != "kernels"}, flush=True)
    res["shapes"][name] = dict(N=N, configs=rows)
res["ok"] = bool(ok)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "topk_paths.json"), "w"), indent=1)
sys.exit(0 if ok else 1)

"""Where the time of one EvoSparse (or dense) decode step goes on the GPU: a `jax.profiler` trace of a few steps
of Llama-3.1-8B shapes (random bf16 weights, 100K context, batch 4, budget 2048 tokens, as eval/bench/evosparse.py),
written as a Perfetto JSON trace and summarised per kernel name (launches and total device time per step).

    jsparse bench profile_decode_step --method evosparse --out /some/dir/profile_evosparse.json
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import time

import jax
import jax.numpy as jnp

from eval.bench.common import add_out_argument, device_facts, out_path, write_json


def kernel_table(trace_dir: str, steps: int, top: int) -> dict:
    """Aggregates the device ops (events on GPU streams) of the Perfetto trace under trace_dir."""
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))[-1]
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pid_names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu_pids = {p for p, n in pid_names.items() if "/device:GPU" in n or "GPU" in n and "host" not in n.lower()}
    agg = collections.defaultdict(lambda: [0, 0.0])
    total, count = 0.0, 0
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in gpu_pids:
            continue
        name = e.get("name", "?")
        agg[name][0] += 1
        agg[name][1] += float(e.get("dur", 0.0))
        total += float(e.get("dur", 0.0))
        count += 1
    rows = sorted(({"kernel": k[:90], "launches_per_step": v[0] / steps, "us_per_step": v[1] / steps}
                   for k, v in agg.items()), key=lambda r: -r["us_per_step"])
    return {"trace": path, "gpu_processes": [pid_names[p] for p in gpu_pids], "kernels_per_step": count / steps,
            "device_us_per_step": total / steps, "top": rows[:top]}


def main(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="evosparse", choices=["evosparse", "dense"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--top", type=int, default=40)
    add_out_argument(p, "profile_decode_step.json")
    a = p.parse_args(argv)
    a.out = out_path(a.out, "profile_decode_step.json")
    from jsparse.xla_flags import set_xla_flags
    set_xla_flags()
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    from eval.bench import evosparse as be, model as bench_model
    from models.cache import KVCache
    from models.generate import round_up
    from models.params import random_params

    cfg = be.CFG8B
    params = random_params(cfg, jax.random.key(0), jnp.bfloat16)
    m = be.method_for(cfg, be.model_heads(cfg)) if a.method == "evosparse" else bench_model.make_method("dense")
    B, ctx = a.batch, be.CONTEXT_E2E
    cap = round_up(ctx + 2 * a.steps + 1, 256)
    cache = bench_model.filled_cache(cfg, B, ctx, cap, jnp.bfloat16)
    state = m.init_state(cfg, B, cap) if a.method == "evosparse" else None
    tok = jnp.zeros((B, 1), jnp.int32)
    tok, cache, state = be.decode_steps(params, m, tok, cache, state, cfg=cfg, steps=a.steps)
    jax.block_until_ready(tok)
    cache = KVCache(k=cache.k, v=cache.v, lengths=jnp.full((B,), ctx, jnp.int32))
    hlo = be.decode_steps.lower(params, m, tok, cache, state, cfg=cfg, steps=a.steps).compile().as_text()
    with open(os.path.splitext(a.out)[0] + ".hlo.txt", "w") as f:  # to look up what a fusion computes
        f.write(hlo)
    d = f"/tmp/jsparse_profile_{a.method}"
    t = time.perf_counter()
    with jax.profiler.trace(d, create_perfetto_trace=True):
        tok, cache, state = be.decode_steps(params, m, tok, cache, state, cfg=cfg, steps=a.steps)
        jax.block_until_ready(tok)
    wall = (time.perf_counter() - t) * 1e3 / a.steps
    res = {**device_facts(), "method": a.method, "batch": B, "context": ctx, "steps": a.steps, "wall_ms_per_step_traced": wall,
           **kernel_table(d, a.steps, a.top)}
    write_json(a.out, res)
    print(f"{a.method}: {res['kernels_per_step']:.0f} kernels/step, device {res['device_us_per_step'] / 1e3:.2f} ms/step, "
          f"wall (traced) {wall:.2f} ms/step; processes {res['gpu_processes']}")
    for r in res["top"]:
        print(f"{r['us_per_step']:9.1f} us {r['launches_per_step']:7.1f}x  {r['kernel']}")


if __name__ == "__main__":
    main()

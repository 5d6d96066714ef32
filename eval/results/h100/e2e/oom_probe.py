"""Where dense's 24.44 GiB allocation at 100K, batch 4 comes from (H100, `jsparse bench model`'s part a, 2026-12-02):
the steady program needs 35 MB of temporaries (mem_probe.json), so the allocation is elsewhere. Variants, each in
its own process: `fresh` (dense's row alone, as method_rows runs it: cache filled, then the jitted call compiles
and runs), `after` (streaming's 100K, batch 1 row first, as in the run), `compiled` (as `after`, but the program
compiled on abstract shapes before the cache is filled). Prints the allocator's state before each call.
Usage (GPU): PYTHONPATH=. python3 eval/results/h100/e2e/oom_probe.py VARIANT"""
import json
import sys
import time

import jax
import jax.numpy as jnp

from eval.bench import model as M
from models.cache import KVCache
from models.presets import preset

variant = sys.argv[1]
cfg = preset("llama3-8b")
params = M.bench_params(cfg)
steps = 16


def mem():
    s = jax.devices()[0].memory_stats()
    return {k: round(s.get(k, 0) / 2**30, 2) for k in ("bytes_limit", "bytes_in_use", "peak_bytes_in_use",
                                                          "largest_free_block_bytes")}


def row(name, context, batch, compile_first):
    method, _ = M.bench_method(name, cfg, 0.1)
    cap = M.round_up(context + 2 * steps + 1, 256)
    tok = jnp.zeros((batch, 1), jnp.int32)
    cache = state = None
    out = {"method": name, "context": context, "batch": batch, "compile_first": compile_first}
    try:
        fn = lambda *a: M.method_decode_steps(*a, cfg=cfg, steps=steps)  # noqa: E731
        if compile_first:
            shapes = jax.eval_shape(lambda: (M.filled_cache(cfg, batch, context, cap, jnp.bfloat16),
                                             method.init_state(cfg, batch, cap)))
            t0 = time.perf_counter()
            fn = M.method_decode_steps.lower(params, method, tok, *shapes, cfg=cfg, steps=steps).compile()
            out["compile_s"] = time.perf_counter() - t0
            out["mem_after_compile"] = mem()
        cache = M.filled_cache(cfg, batch, context, cap, jnp.bfloat16)
        state = method.init_state(cfg, batch, cap)
        out["mem_before_call"] = mem()
        tok, cache, state = fn(params, method, tok, cache, state)
        jax.block_until_ready(tok)
        cache = KVCache(k=cache.k, v=cache.v, lengths=jnp.full((batch,), context, jnp.int32))
        t0 = time.perf_counter()
        tok, cache, state = fn(params, method, tok, cache, state)
        jax.block_until_ready(tok)
        out["step_ms"] = (time.perf_counter() - t0) * 1e3 / steps
    except Exception as e:  # noqa: BLE001
        out["error"] = str(e).splitlines()[0][:300]
    out["mem_after"] = mem()
    del cache, state
    print(json.dumps(out), flush=True)


print(variant, "weights", mem(), flush=True)
if variant in ("after", "compiled"):
    row("streaming", 100000, 1, variant == "compiled")
row("dense", 100000, 4, variant == "compiled")

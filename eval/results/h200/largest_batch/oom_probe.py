"""Probe of the 128K batch-7 out-of-memory of `jsparse bench model` on the H200 (NOTES.md): builds the benchmark's
weights (BUILD=jit: `bench_params`, one jitted program; BUILD=eager: drawn leaf by leaf, then fused, as before)
and filled cache as `method_rows` does, prints the allocator's bytes in use, its largest free block and the live
arrays at each step, compiles the decode loop's call ahead of time (XLA's memory analysis: whether its inputs alias
its outputs), then calls it and reports the allocator after it or its error.
Env: CTX (131072), B (7), STEPS (2), BUILD (jit), BLOCK (1), AOT (1), OUT. Writes
$OUT/oom_probe_b${B}_${BUILD}_block${BLOCK}_aot${AOT}.json."""
import datetime, json, os
import jax, jax.numpy as jnp
from eval.bench.model import bench_method, bench_params, filled_cache, method_decode_steps
from models.params import random_params, with_layout
from models.presets import preset
from models.generate import round_up

cfg = preset("llama3-8b")
CTX, B, STEPS = int(os.environ.get("CTX", 131072)), int(os.environ.get("B", 7)), int(os.environ.get("STEPS", 2))
GiB = 2**30
dev = jax.devices()[0]
res = dict(device=dev.device_kind, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           jax=jax.__version__, commit=os.environ.get("GIT_COMMIT", ""), context=CTX, batch=B, steps=STEPS,
           events=[])


def note(what, **extra):
    s = dev.memory_stats() or {}
    live = sorted(((a.nbytes, str(a.shape), str(a.dtype)) for a in jax.live_arrays()), reverse=True)
    ev = dict(what=what, in_use_gib=s.get("bytes_in_use", 0) / GiB, peak_gib=s.get("peak_bytes_in_use", 0) / GiB,
              limit_gib=s.get("bytes_limit", 0) / GiB, largest_free_gib=s.get("largest_free_block_bytes", 0) / GiB,
              live_gib=sum(n for n, _, _ in live) / GiB, live_arrays=len(live),
              largest_live=[(round(n / GiB, 2), sh, dt) for n, sh, dt in live[:6]], **extra)
    res["events"].append(ev)
    print(json.dumps(ev), flush=True)


note("start")
BUILD = os.environ.get("BUILD", "jit")  # "jit": `bench_params`; "eager": with_layout(random_params(...)) (before)
BLOCK = os.environ.get("BLOCK", "1") == "1"  # wait for the cache fill before the call (method_rows does not)
AOT = os.environ.get("AOT", "1") == "1"  # compile ahead of time (memory analysis); 0: the jitted call, as method_rows
res["command"] = (f"CTX={CTX} B={B} STEPS={STEPS} BUILD={BUILD} BLOCK={int(BLOCK)} AOT={int(AOT)} "
                  "python eval/results/h200/largest_batch/oom_probe.py")
if BUILD == "jit":
    params = bench_params(cfg)
elif BUILD == "eager":
    params = with_layout(random_params(cfg, jax.random.key(0), jnp.bfloat16), "default", donate=True)
else:
    raise ValueError(f"BUILD={BUILD!r}: expected 'jit' or 'eager'")
jax.block_until_ready(params)
note(f"weights ({BUILD})")
cap = round_up(CTX + 2 * STEPS + 1, 256)
cache = filled_cache(cfg, B, CTX, cap, jnp.bfloat16)
if BLOCK:
    jax.block_until_ready(cache)
note("cache filled" if BLOCK else "cache fill dispatched")
method, _ = bench_method("dense", cfg, 0.1)
state = method.init_state(cfg, B, cap)
tok = jnp.zeros((B, 1), jnp.int32)
if AOT:
    compiled = method_decode_steps.lower(params, method, tok, cache, state, cfg=cfg, steps=STEPS).compile()
    ma = compiled.memory_analysis()
    note("compiled", temp_gib=ma.temp_size_in_bytes / GiB, argument_gib=ma.argument_size_in_bytes / GiB,
         output_gib=ma.output_size_in_bytes / GiB, alias_gib=ma.alias_size_in_bytes / GiB)
else:  # as method_rows calls it
    compiled = lambda *a: method_decode_steps(*a, cfg=cfg, steps=STEPS)  # noqa: E731
try:
    out = compiled(params, method, tok, cache, state)
    jax.block_until_ready(out)
    note("called", ok=True, cache_deleted=bool(cache.k.is_deleted()))
except Exception as e:  # noqa: BLE001
    note("called", ok=False, error=str(e).splitlines()[0][:400], cache_deleted=bool(cache.k.is_deleted()))
name = f"oom_probe_b{B}_{BUILD}_block{int(BLOCK)}_aot{int(AOT)}.json"
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), name), "w"), indent=1)

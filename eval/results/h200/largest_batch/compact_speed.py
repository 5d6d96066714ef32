"""Whether the way weights are moved back to the device changes the decode step (H200, 2026-11-29): Llama-3.1-8B
random weights, dense decode at 4K, batch 1, 16 steps of `method_decode_steps`, timed for the weights as built, after
`jax.device_put(host numpy tree, shardings)` (`eval.bench.model.compacted` at 7b3d6cb), after `jnp.asarray` of the
host copies (`compacted` at 118845a) and after a jitted copy (both since replaced by `bench_params`). Prints ms per
step; the figures are in NOTES.md.
Run: PYTHONPATH=. python eval/results/h200/largest_batch/compact_speed.py"""
import time, jax, jax.numpy as jnp, numpy as np
from eval.bench.model import filled_cache, method_decode_steps, bench_method
from models.params import random_params, with_layout
from models.presets import preset
cfg = preset("llama3-8b")


def timeit(params, tag):
    m, _ = bench_method("dense", cfg, 0.1)
    cache = filled_cache(cfg, 1, 4096, 4352, jnp.bfloat16)
    st, tok = m.init_state(cfg, 1, 4352), jnp.zeros((1, 1), jnp.int32)
    tok, cache, st = method_decode_steps(params, m, tok, cache, st, cfg=cfg, steps=16)
    jax.block_until_ready(tok)
    t = time.perf_counter()
    tok, cache, st = method_decode_steps(params, m, tok, cache, st, cfg=cfg, steps=16)
    jax.block_until_ready(tok)
    print(tag, (time.perf_counter() - t) / 16 * 1e3, "ms", flush=True)


p = with_layout(random_params(cfg, jax.random.key(0), jnp.bfloat16), "default", donate=True)
timeit(p, "built")
host = jax.tree.map(lambda a: np.array(a, copy=True), p)
shardings = jax.tree.map(lambda a: a.sharding, p)
for a in jax.tree.leaves(p):
    a.delete()
p2 = jax.device_put(host, shardings)
timeit(p2, "device_put")
p3 = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), p2)
timeit(p3, "asarray")
p4 = jax.jit(lambda t: jax.tree.map(lambda a: a + 0, t))(p3)
timeit(p4, "jit copy")

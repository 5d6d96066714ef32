"""The oracle's per-layer counter copy (NOTES.md): the layer scan's start index passed through an optimization barrier
(`models.llama.layer_start`), so that XLA cannot fold the index of a run from layer 1 into the scan's next counter,
against the library's scan, alternating in one process. Llama-3.1-8B shapes, random bf16 weights and cache,
`eval.bench.model.method_rows` (16 timed steps), every variant traced afresh:

    PYTHONPATH=. python eval/results/h100/layer_loop/probe.py          # GPU: writes $OUT/probe.json
    SMOKE=1 JAX_PLATFORMS=cpu PYTHONPATH=. python eval/results/h100/layer_loop/probe.py   # CPU: same logits

Cases (CASES, method:batch at 100K): dense and the oracle at batch 1, dense and Kascade at batch 4.
"""

import json
import os
from datetime import datetime, timezone

import jax
import jax.numpy as jnp
import numpy as np

import models.llama as llama

LIBRARY = llama.layer_start


def barrier_start(a: int):
    """A run's start index the compiler cannot see (runs from layer 0 keep the constant: index and counter agree)."""
    return jax.lax.optimization_barrier(jnp.int32(a)) if a else jnp.int32(a)


VARIANTS = {"scan": LIBRARY, "barrier": barrier_start}


def smoke():
    """On a CPU: a tiny model's oracle decode (runs 0..1 and 1..4) gives the same logits with either start."""
    from jsparse.methods.oracle import Oracle
    from models.cache import init_cache
    from models.config import ModelConfig
    from models.params import random_params
    cfg = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    params = random_params(cfg, jax.random.key(0), jnp.float32, scale=0.08)
    method = Oracle.build(budget=0.5)
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, cfg.vocab_size, jnp.int32)
    _, cache, state = llama.prefill(params, cfg, method, tokens, jnp.array([24, 17], jnp.int32),
                                    init_cache(cfg, 2, 64, jnp.float32), method.init_state(cfg, 2, 64))
    out = {}
    for name, fn in VARIANTS.items():
        llama.layer_start = fn
        out[name] = np.asarray(jax.jit(lambda t: llama.decode(params, cfg, method, t, cache, state)[0])(
            jnp.array([[3], [5]], jnp.int32)))
    llama.layer_start = LIBRARY
    np.testing.assert_allclose(out["barrier"], out["scan"], rtol=1e-6, atol=1e-6)
    print("smoke: the same logits", float(np.max(np.abs(out["barrier"] - out["scan"]))))


def main(out_dir, hook="layer_start", variants=None, cases="dense:1 oracle:1 dense:4 kascade:4",
         order="scan barrier scan barrier", command="PYTHONPATH=. python eval/results/h100/layer_loop/probe.py"):
    """Alternates the variants of `models.llama.<hook>` (CASES, ORDER from the environment override the defaults)
    and writes $OUT/probe.json; also `../layer_while/probe.py`'s runner."""
    from eval.bench import common as bm
    from eval.bench.model import method_rows
    from models.params import random_params, with_layout
    from models.presets import preset
    variants = VARIANTS if variants is None else variants
    library = getattr(llama, hook)
    cfg = preset("llama3-8b")
    hbm = bm.measure_hbm_gbs()
    params = with_layout(random_params(cfg, jax.random.key(0), jnp.bfloat16), "default", donate=True)
    rows = []
    for rep, name in enumerate(os.environ.get("ORDER", order).split()):
        setattr(llama, hook, variants[name])
        for m, b in (c.split(":") for c in os.environ.get("CASES", cases).split()):
            jax.clear_caches()
            row = method_rows(cfg, params, (m,), (100000,), (int(b),), 16, hbm, 0.1)[0]
            row.update(variant=name, rep=rep)
            rows.append(row)
            print(f"{rep} {name} {m} b{b}: {row.get('step_ms', float('nan')):.3f} ms", flush=True)
    setattr(llama, hook, library)
    out = {**bm.device_facts(), "date": datetime.now(timezone.utc).isoformat(), "commit": os.environ.get("GIT_COMMIT", ""),
           "command": command, "shape": "llama3-8b", "context": 100000, "measured_hbm_gbs": hbm, "rows": rows}
    with open(os.path.join(out_dir, "probe.json"), "w") as f:
        json.dump(out, f, indent=1)
    return rows


if __name__ == "__main__":
    smoke() if os.environ.get("SMOKE") else main(os.environ.get("OUT", "."))

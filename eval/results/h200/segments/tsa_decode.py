"""TSA's decode step against the dense method's in the model's own decode loop (Llama-3.1-8B shapes, random bf16
weights and cache): since 9f965e8 TSA decodes through `common.decode_dense`, the dense method's function, where it
called `dense_decode` on the layer's slice of the cache. Writes JSON to $OUT (or the folder given).

    PYTHONPATH=. python eval/results/h200/segments/tsa_decode.py OUT_DIR
"""

import json
import os
import sys
import time
from datetime import datetime, timezone

import jax
import jax.numpy as jnp

from eval.bench.model import filled_cache, method_decode_steps
from jsparse.methods import make_method
from jsparse.methods.tsa import TSA
from models.cache import KVCache
from models.generate import round_up
from models.params import random_params, with_layout
from models.presets import preset

CONTEXT, BATCH, STEPS = 32768, 4, 8


def main(out_dir):
    cfg = preset("llama3-8b")
    params = with_layout(random_params(cfg, jax.random.key(0), jnp.bfloat16), "default", donate=True)
    rows = []
    for name, method in (("dense", make_method("dense")), ("tsa", TSA()), ("dense", make_method("dense"))):
        capacity = round_up(CONTEXT + 2 * STEPS + 1, 256)
        cache = filled_cache(cfg, BATCH, CONTEXT, capacity, jnp.bfloat16)
        state = method.init_state(cfg, BATCH, capacity)
        tok = jnp.zeros((BATCH, 1), jnp.int32)
        tok, cache, state = method_decode_steps(params, method, tok, cache, state, cfg=cfg, steps=STEPS)
        jax.block_until_ready(tok)
        cache = KVCache(k=cache.k, v=cache.v, lengths=jnp.full((BATCH,), CONTEXT, jnp.int32))
        t0 = time.perf_counter()
        tok, cache, state = method_decode_steps(params, method, tok, cache, state, cfg=cfg, steps=STEPS)
        jax.block_until_ready(tok)
        rows.append({"method": name, "step_ms": (time.perf_counter() - t0) * 1e3 / STEPS})
        del cache, state
        print(rows[-1], flush=True)
    out = {"device": jax.devices()[0].device_kind, "date": datetime.now(timezone.utc).isoformat(),
           "command": "PYTHONPATH=. python eval/results/h200/segments/tsa_decode.py OUT_DIR", "shape": "llama3-8b",
           "context": CONTEXT, "batch": BATCH, "steps": STEPS, "rows": rows}
    with open(os.path.join(out_dir, "tsa_decode.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "."))

"""Whether dense's decode program itself needs the 24 GiB it failed to allocate at 100K, batch 4 on an H100 (it does
not: 35 MB of temporaries, `probe/mem_probe.json`): each method's compiled `method_decode_steps` memory analysis at
Llama-3.1-8B shapes, and the copies in its optimised HLO whose result is as large as a whole stacked cache (K or V of
every layer).
Usage (GPU): PYTHONPATH=. python3 eval/results/h100/e2e/mem_probe.py CONTEXT BATCH OUT.json [METHODS]"""
import json
import re
import sys

import jax
import jax.numpy as jnp

from eval.bench import model as M
from models.presets import preset

context, batch, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
cfg = preset("llama3-8b")
params = M.bench_params(cfg)
steps = 16
cap = M.round_up(context + 2 * steps + 1, 256)
res = {"device": jax.devices()[0].device_kind,
       "command": "python3 eval/results/h100/e2e/mem_probe.py " + " ".join(sys.argv[1:]),
       "context": context, "batch": batch, "capacity": cap, "methods": {}}
for name in (sys.argv[4] if len(sys.argv) > 4 else "dense,streaming,kascade,evosparse").split(","):
    method, _ = M.bench_method(name, cfg, 0.1)
    cache = jax.eval_shape(lambda: M.filled_cache(cfg, batch, context, cap, jnp.bfloat16))
    state = jax.eval_shape(lambda: method.init_state(cfg, batch, cap))
    tok = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    c = M.method_decode_steps.lower(params, method, tok, cache, state, cfg=cfg, steps=steps).compile()
    ma = c.memory_analysis()
    hlo = c.as_text()
    kshape = ",".join(map(str, cache.k.shape))
    big = [l.strip()[:300] for l in hlo.splitlines()
           if f"[{kshape}]" in l and re.search(r"\b(copy|transpose|fusion)\(", l) and "dynamic-update-slice" not in l]
    row = dict(cache_gib=2 * cache.k.size * 2 / 2**30, temp_gib=ma.temp_size_in_bytes / 2**30,
               alias_gib=ma.alias_size_in_bytes / 2**30, arg_gib=ma.argument_size_in_bytes / 2**30,
               out_gib=ma.output_size_in_bytes / 2**30, cache_sized_ops=big[:12])
    res["methods"][name] = row
    print(name, {k: v for k, v in row.items() if k != "cache_sized_ops"}, flush=True)
    for l in big[:6]:
        print("   ", l, flush=True)
    with open(out.replace(".json", f"_{name}.hlo.txt"), "w") as f:
        f.write(hlo)
json.dump(res, open(out, "w"), indent=1)

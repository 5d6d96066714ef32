"""Keys each layer attends in one decode step of evosparse-noheat and evosparse on the bundled SmolLM2 (the shipped
artifact, budget 0.2, min_tokens 16, a 320-token prompt of eval/data/call_of_the_wild.txt), measured as the cached V
rows the logits depend on (nonzero gradient), beside each method's reported `achieved_sparsity` at that position.

    JAX_PLATFORMS=cpu PYTHONPATH=. python3 eval/results/cpu/evosparse_noheat_sparsity/measure.py OUT.json
"""
import datetime
import json
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jsparse
from models import llama
from models.cache import init_cache

jax.config.update("jax_default_matmul_precision", "highest")
model = jsparse.load("smollm2", "float32")
cfg = model.cfg
T, CAP = 320, 336
text = open("eval/data/call_of_the_wild.txt", encoding="utf-8").read()[5000:12000]
ids = jnp.asarray([jsparse.encode(model, text)[:T]], jnp.int32)
out = {"command": "JAX_PLATFORMS=cpu PYTHONPATH=. python3 " + " ".join(sys.argv),
       "device": f"CPU ({platform.processor() or platform.machine()}), {jax.device_count()} device",
       "jax": jax.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
       "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
       "prompt_tokens": T, "budget": 0.2, "min_tokens": 16, "methods": {}}
for name in ("evosparse-noheat", "evosparse"):
    m = jsparse.build_method(name, model, artifact="artifacts/smollm2/evosparse", budget=0.2, min_tokens=16)

    @jax.jit
    def grad_v(params, m, ids):
        cache = init_cache(cfg, 1, CAP, params.embed.dtype)
        _, cache, st = llama.prefill(params, cfg, m, ids, jnp.asarray([T]), cache, m.init_state(cfg, 1, CAP))
        w = jax.random.normal(jax.random.key(1), (cfg.vocab_size,))

        def f(v):
            logits, _, _ = llama.decode(params, cfg, m, jnp.asarray([[13]], jnp.int32), cache.replace(v=v), st)
            return jnp.sum(logits[0, 0] * w)
        return jax.grad(f)(cache.v)

    g = np.asarray(grad_v(model.params, m, ids))  # [L, B, Hkv, N, D]
    keys = np.any(g[:, 0] != 0, axis=-1)[:, :, :T + 1].sum(-1) + 1  # + the new token itself
    out["methods"][name] = {"retrieval_layers": list(m.retrieval_layers),
                            "keys_per_layer_kv_head0": keys[:, 0].tolist(),
                            "measured_sparsity": float(1 - keys.mean() / (T + 1)),
                            "reported_sparsity": float(m.achieved_sparsity(cfg, [T]))}
    print(name, {k: v for k, v in out["methods"][name].items() if k != "keys_per_layer_kv_head0"})
json.dump(out, open(sys.argv[1], "w"), indent=1)

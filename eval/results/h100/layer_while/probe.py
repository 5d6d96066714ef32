"""The decode's layer runs as `lax.while_loop`s over the layer index against the library's `lax.scan`s
(`models.llama.layer_run`), alternating in one process (NOTES.md). Llama-3.1-8B shapes, random bf16 weights and
cache, `eval.bench.model.method_rows` (16 timed steps), every variant traced afresh:

    PYTHONPATH=. python eval/results/h100/layer_while/probe.py          # GPU: writes $OUT/probe.json
    SMOKE=1 JAX_PLATFORMS=cpu PYTHONPATH=. python eval/results/h100/layer_while/probe.py   # CPU: same logits

Variants: "scan" (the library), "while" (every run a while loop), "while_a" (only the runs that start past layer 0,
where XLA folds the scan's counter and the index i = j + a into one value and copies it before every layer).
Environment: CASES (method:batch at 100K, default "dense:4 evosparse:4 kascade:4"), ORDER (default
"scan while_a while_a scan").
"""

import os

import jax
import jax.numpy as jnp
import numpy as np

import models.llama as llama

LIBRARY = llama.layer_run


def while_run(seg_fn, a, b, carry, unroll=1, only_past_zero=False):
    """Layers a .. b - 1 as a while loop over the layer index itself (no scan counter beside it); no per-layer
    outputs (decode)."""
    if unroll != 1 or (only_past_zero and a == 0):
        return LIBRARY(seg_fn, a, b, carry, unroll)
    _, carry = jax.lax.while_loop(lambda c: c[0] < b, lambda c: seg_fn(c, None)[0], (jnp.int32(a), carry))
    return carry, None


VARIANTS = {"scan": LIBRARY, "while": while_run,
            "while_a": lambda *a, **k: while_run(*a, **k, only_past_zero=True)}


def smoke():
    """On a CPU: a tiny model's EvoSparse, Kascade and oracle decodes give the same logits in every variant."""
    from eval.bench.model import bench_method
    from models.cache import init_cache
    from models.config import ModelConfig
    from models.params import random_params
    cfg = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    params = random_params(cfg, jax.random.key(0), jnp.float32, scale=0.08)
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, cfg.vocab_size, jnp.int32)
    for name in ("evosparse", "kascade", "oracle"):
        method = bench_method(name, cfg, 0.5, evo_budget_tokens=32)[0]
        _, cache, state = llama.prefill(params, cfg, method, tokens, jnp.array([24, 17], jnp.int32),
                                        init_cache(cfg, 2, 64, jnp.float32), method.init_state(cfg, 2, 64))
        out = {}
        for v, fn in VARIANTS.items():
            llama.layer_run = fn
            out[v] = np.asarray(jax.jit(lambda t: llama.decode(params, cfg, method, t, cache, state)[0])(
                jnp.array([[3], [5]], jnp.int32)))
        llama.layer_run = LIBRARY
        for v in VARIANTS:
            np.testing.assert_allclose(out[v], out["scan"], rtol=1e-6, atol=1e-6)
        print(f"smoke {name}: the same logits in every variant")


def main(out_dir):
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "layer_loop_probe", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "layer_loop", "probe.py"))
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)  # its runner, with this probe's hook and variants
    rows = runner.main(out_dir, hook="layer_run", variants=VARIANTS, cases="dense:4 evosparse:4 kascade:4",
                       order="scan while_a while_a scan",
                       command="PYTHONPATH=. python eval/results/h100/layer_while/probe.py")
    print("variant  rep  method  batch  step_ms")
    for r in rows:
        print(r["variant"], r["rep"], r["method"], r["batch"], round(r.get("step_ms", float("nan")), 3))


if __name__ == "__main__":
    if os.environ.get("SMOKE"):
        smoke()
    else:
        main(os.environ.get("OUT", "."))

"""The "sample" top-k's two in-kernel searches (ca6765d) against the searches before it, alternating in one process:
the bracket's two sample thresholds in one loop (`gpu_row.row_threshold_pair`) instead of two loops, and the band's
search started after the common prefix of its bounds (`gpu_row.common_prefix_start`) instead of at pass 0. "before"
puts the earlier searches back by patching the two names `gpu_sample` calls (the same results: tests/
test_topk_select_gpu.py::test_row_threshold_start_and_pair_match_the_plain_search).

    PYTHONPATH=. python eval/results/h100/topk_resolve/probe.py      # GPU: writes $OUT/probe.json
    SMOKE=1 JAX_PLATFORMS=cpu PYTHONPATH=. python eval/results/h100/topk_resolve/probe.py   # CPU: same picks

Per variant: `topk_select` alone on the oracle's rows at 100K, batch 1 (8 rows of 100,000 f32 scores, k = K = 10,000,
normal and log-normal scores), then Llama-3.1-8B shapes' whole decode steps (`eval.bench.model.method_rows`, random
bf16 weights and cache, 16 timed steps) for CASES (method:batch, 100K).
"""

import json
import os
from datetime import datetime, timezone

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.topk_select import gpu, gpu_row, gpu_sample
from pallas_kernels.topk_select.common import INT_MIN

NOW = {"row_threshold_pair": gpu_sample.row_threshold_pair, "common_prefix_start": gpu_sample.common_prefix_start}


def _pair_before(key, kk1, kk2, n, bits):
    return gpu_row.row_threshold(key, kk1, n, bits)[0], gpu_row.row_threshold(key, kk2, n, bits)[0]


BEFORE = {"row_threshold_pair": _pair_before, "common_prefix_start": lambda lower, upper, bits: (
    jnp.int32(INT_MIN), jnp.int32(0))}
VARIANTS = {"before": BEFORE, "now": NOW}


def use(name: str) -> None:
    for attr, fn in VARIANTS[name].items():
        setattr(gpu_sample, attr, fn)
    jax.clear_caches()


def rows(R: int, N: int):
    z = jax.random.normal(jax.random.key(7), (R, N), jnp.float32)
    return {"normal": z, "lognormal": jnp.exp(2.0 * z)}


def smoke():
    """On a CPU (interpreter): both variants pick the same positions on small rows."""
    config = gpu.SelectConfig(path="sample", sample_size=256, band_cap=1024, compact_block_n=128, target_programs=24)
    got = {}
    for name in VARIANTS:
        use(name)
        got[name] = [np.asarray(gpu.topk_select_gpu(x, jnp.full((4,), 300, jnp.int32), 400, config=config,
                                                    interpret=True)) for x in rows(4, 4096).values()]
    for a, b in zip(got["before"], got["now"]):
        np.testing.assert_array_equal(a, b)
    print("smoke: the same picks")


def main(out_dir):
    from eval.bench import common as bm
    from eval.bench.model import method_rows
    from models.params import random_params, with_layout
    from models.presets import preset
    cfg = preset("llama3-8b")
    hbm = bm.measure_hbm_gbs()
    params = with_layout(random_params(cfg, jax.random.key(0), jnp.bfloat16), "default", donate=True)
    cases = [c.split(":") for c in os.environ.get("CASES", "dense:1 oracle:1").split()]
    kernel_rows, step_rows = [], []
    N, K = 100000, 10000
    for rep, name in enumerate(os.environ.get("ORDER", "before now before now").split()):
        use(name)
        for dist, x in rows(8, N).items():
            fn = jax.jit(lambda x: gpu.topk_select_gpu(x, jnp.full((8,), K, jnp.int32), K))
            ms = bm.time_ms(fn, x, warmup=3, iters=50)
            kernel_rows.append(dict(variant=name, rep=rep, scores=dist, rows=8, N=N, K=K, us=1000 * ms))
            print(f"{rep} {name} topk {dist}: {1000 * ms:.1f} us", flush=True)
        for m, b in cases:
            jax.clear_caches()
            row = method_rows(cfg, params, (m,), (N,), (int(b),), 16, hbm, 0.1)[0]
            row.update(variant=name, rep=rep)
            step_rows.append(row)
            print(f"{rep} {name} {m} b{b}: {row.get('step_ms', float('nan')):.3f} ms", flush=True)
    out = {**bm.device_facts(), "date": datetime.now(timezone.utc).isoformat(),
           "commit": os.environ.get("GIT_COMMIT", ""), "command": "PYTHONPATH=. python eval/results/h100/topk_resolve/"
           "probe.py", "shape": "llama3-8b", "context": N, "measured_hbm_gbs": hbm, "topk": kernel_rows,
           "steps": step_rows}
    with open(os.path.join(out_dir, "probe.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    smoke() if os.environ.get("SMOKE") else main(os.environ.get("OUT", "."))

"""The in-register radix search with one count reduction a pass (`gpu_row.row_threshold` of the tree it runs in:
71ae716, the variant since reverted) against the code before it (two packed 16-bit counts a reduction, `OLD`'s
`pallas_kernels/topk_select/gpu_row.py`), on the GPU. Run from a later tree, "new" and "old" are the same search.

For each case, rows shaped as a method's selection at 100K, batch 4 (Llama-3.1-8B's 8 KV heads):
  kascade   32 rows of 100096 pooled-like scores, k 10010: the "sample" path (Kascade's anchors, the oracle);
  ties      32 Kascade-like rows of heavy ties (`testing.kascade_like_rows`): "sample";
  evo32     32 rows of 6256 block heats, k 384: the one-launch "row" path (EvoSparse's retrieval top-k);
  evo1024   1024 rows of 6256, k 384: "row" (every layer's heat candidates at once);
  h2o       1024 rows of 100096, k 5005: the "ordered" path (H2O's every-layer selection);
each variant (old / new at row_bits 2, the default; new at 1 and 4) is checked equal to `topk_select_reference` and
timed from a profiler trace (device us per call). Writes $OUT/topk_counts.json and prints a table.

    OLD=<a tree of the code before> OUT=... PYTHONPATH=. python3 eval/results/h200/topk_counts/bench_counts.py
"""

from __future__ import annotations

import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench.common import device_facts
from eval.bench.profile_ops import profile
from pallas_kernels.topk_select import gpu, gpu_row, gpu_sample, topk_select_reference
from pallas_kernels.topk_select.testing import kascade_like_rows


def load_old_threshold(old_root: str):
    spec = importlib.util.spec_from_file_location("old_gpu_row", os.path.join(old_root, "pallas_kernels",
                                                                               "topk_select", "gpu_row.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.row_threshold


def use(threshold) -> None:
    """Every kernel that runs the in-register search reads it from these two modules when traced."""
    gpu_row.row_threshold = threshold
    gpu_sample.row_threshold = threshold


def cases(rng):
    def pooled(R, N):
        return jnp.exp(2.0 * jax.random.normal(jax.random.key(R + N), (R, N), jnp.float32)) / N

    x, k = kascade_like_rows(rng, 32, 100000, 100096)
    yield "kascade", pooled(32, 100096), jnp.full((32,), 10010, jnp.int32), 10010
    yield "ties", jnp.asarray(x), jnp.asarray(k), 10010
    yield "evo32", pooled(32, 6256), jnp.full((32,), 384, jnp.int32), 384
    yield "evo1024", pooled(1024, 6256), jnp.full((1024,), 384, jnp.int32), 384
    yield "h2o", pooled(1024, 100096), jnp.full((1024,), 5005, jnp.int32), 5005


def main():
    out = os.environ.get("OUT", ".")
    new, old = gpu_row.row_threshold, load_old_threshold(os.environ["OLD"])
    variants = [("old", old, 2), ("new", new, 2), ("new_b1", new, 1), ("new_b4", new, 4), ("old_again", old, 2),
                ("new_again", new, 2)]
    res = {**device_facts(), "cases": {}}
    select = gpu.topk_select_gpu.__wrapped__
    for name, x, k, K in cases(np.random.default_rng(0)):
        want = np.asarray(topk_select_reference(x, k, K))
        path = gpu.SelectConfig().pick_path(x.shape[1], x.shape[0], K)
        row = res["cases"][name] = {"rows": int(x.shape[0]), "N": int(x.shape[1]), "K": K, "path": path}
        for tag, fn, bits in variants:
            use(fn)
            cfg = gpu.SelectConfig(row_bits=bits)
            f = jax.jit(lambda x, k, cfg=cfg: select(x, k, K, config=cfg))  # a fresh trace with this search
            r = profile(f"{name}_{tag}", f, (x, k), 5)
            r["exact"] = bool(np.array_equal(np.asarray(f(x, k)), want))
            row[tag] = r
        use(new)
    with open(os.path.join(out, "topk_counts.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    print("\ncase      path     " + "".join(f"{t:>11}" for t, _, _ in variants)
          + "   (device us per call; * not exact)")
    for name, row in res["cases"].items():
        cells = "".join(f"{row[t]['device_us']:10.1f}{'' if row[t]['exact'] else '*'} " for t, _, _ in variants)
        print(f"{name:9} {row['path']:8} {cells}")


if __name__ == "__main__":
    main()

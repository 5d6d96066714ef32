"""Is the anchor scoring's Triton pooling pass (`AnchorConfig.pool="triton"`: the splits' log-sum-exp merged in the
pass, one launch) faster than the default XLA pooling (three small XLA kernels for the log-sum-exp, then the pooling
fusion) at batch 1, in the model's own decode loop? `../../h200/pool_ab/` found no difference at batch 4 (H200); at
batch 1 the oracle on Qwen3-8B shapes is issue 24's cell under the bar (share 0.845, `../e2e_1207c/`), and its
profile (`../profile_qwen3/`) has eight XLA kernels a sparse layer beside its Pallas ones.

Random bf16 weights and cache (`eval.bench.model.method_rows`, 16 timed steps, dense first and last), 100K context;
for each SHAPE: the oracle and Kascade at batch 1 and the oracle at batch 4, each with the library's AnchorConfig, with
pool="xla" and with `POOLS` (`pool_block:pool_warps` of the Triton pass), then "xla" again; each traced afresh.

    GIT_COMMIT=<sha> OUT=... PYTHONPATH=. python3 eval/results/h100/pool_b1/probe.py
    SHAPES="qwen3-8b" CASES="oracle:1" POOLS="2048:4" ...
    SMOKE=1 CONTEXT=1024 JAX_PLATFORMS=cpu ...  (the harness on a CPU, a small model; the pool is GPU-only)

Writes $OUT/pool_<shape>.json and prints a table.
"""

import functools
import os


import pallas_kernels.anchor_attention.gpu as agpu
from eval.bench import common as bm
from eval.bench.model import probe_model, probe_record, probe_rows

CONTEXT = int(os.environ.get("CONTEXT", 100000))
LIBRARY = agpu.anchor_decode_gpu


def set_pool(pool):
    """The anchor layers trace with AnchorConfig(pool="triton", pool_block, pool_warps), with pool="xla" ("xla"), or
    with the library's default (None)."""
    if pool is None:
        agpu.anchor_decode_gpu = LIBRARY
        return
    config = agpu.AnchorConfig(pool="xla") if pool == "xla" else agpu.AnchorConfig(
        pool="triton", pool_block=pool[0], pool_warps=pool[1])
    agpu.anchor_decode_gpu = functools.partial(LIBRARY, config=config)


def main(out_dir):
    pools = [tuple(int(x) for x in w.split(":")) for w in os.environ.get("POOLS", "2048:4 1024:4").split()]
    cases = os.environ.get("CASES", "oracle:1 kascade:1 oracle:4").split()
    batches = sorted({int(c.split(":")[1]) for c in cases})
    printed = []
    for shape in os.environ.get("SHAPES", "qwen3-8b llama3-8b").split():
        cfg, params = probe_model(shape, bool(os.environ.get("SMOKE")))
        hbm = bm.measure_hbm_gbs()
        runs = [("dense", "dense", b, None) for b in batches]
        for case in cases:
            method, batch = case.split(":")
            runs += [(name, method, int(batch), pool) for name, pool in
                     [("library", None), ("xla", "xla")] + [(f"triton {b}:{w}", (b, w)) for b, w in pools]
                     + [("xla (again)", "xla")]]
        runs += [("dense (again)", "dense", b, None) for b in batches]
        rows = probe_rows(cfg, params, runs, set_pool, CONTEXT, hbm)
        printed += [dict(r, shape=shape) for r in rows]
        record = probe_record(f"SHAPES={shape} CASES=\"{' '.join(cases)}\" POOLS=\"{os.environ.get('POOLS', '2048:4 1024:4')}\""
                           " PYTHONPATH=. python3 eval/results/h100/pool_b1/probe.py", rows,
                           shape=shape, context=CONTEXT, measured_hbm_gbs=hbm)
        bm.write_json(os.path.join(out_dir, f"pool_{shape}.json"), record)
    print(bm.table(printed, ["shape", "method", "batch", "variant", "step_ms"]))


if __name__ == "__main__":
    main(os.environ.get("OUT", "."))

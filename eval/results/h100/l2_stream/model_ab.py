"""EvoSparse's decode step with its sparse layers' O-projection weights read on a second stream while their attention
runs (`models.llama.O_PREFETCH`, the hook of this probe; `probe.py` asks the same of one layer's kernels): random
bf16 weights and cache (`eval.bench.model.method_rows`, 16 timed steps, dense first and last), 100K context.
Variants: none (the library), "sparse" (every layer of a "sparse..." run), "inherit" (the layers that inherit a
retrieval set, whose attention reads 17-25 MB; the scoring layers stream their retrieval heads' whole K), none again.

    GIT_COMMIT=<sha> OUT=... PYTHONPATH=. python3 eval/results/h100/l2_stream/model_ab.py
    CASES="llama3-8b:4 qwen3-8b:3" ...;  SMOKE=1 CONTEXT=1024 JAX_PLATFORMS=cpu ...  (the harness, a small model)
"""
import os

if not os.environ.get("SMOKE"):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_experimental_stream_annotation=true").strip()

from eval.bench import common as bm  # noqa: E402
from eval.bench.model import probe_model, probe_record, probe_rows  # noqa: E402
from models import llama  # noqa: E402

CONTEXT = int(os.environ.get("CONTEXT", 100000))
VARIANTS = {"none": None, "sparse": lambda seg: bool(seg) and seg.startswith("sparse"),
            "inherit": lambda seg: bool(seg) and seg.endswith(":inherit")}


def set_hook(name):
    llama.O_PREFETCH = VARIANTS[name or "none"]


def main(out_dir):
    printed = []
    for case in os.environ.get("CASES", "llama3-8b:4 qwen3-8b:3").split():
        shape, batch = case.split(":")
        batch = int(batch)
        cfg, params = probe_model(shape, bool(os.environ.get("SMOKE")))
        hbm = bm.measure_hbm_gbs()
        runs = ([("none", "dense", batch, None)] + [(v, "evosparse", batch, v) for v in ("none", "sparse", "inherit")]
                + [("none", "evosparse", batch, None), ("none (again)", "dense", batch, None)])
        rows = probe_rows(cfg, params, runs, set_hook, CONTEXT, hbm)
        printed += [dict(r, shape=shape) for r in rows]
        record = probe_record(f"CASES={case} PYTHONPATH=. python3 eval/results/h100/l2_stream/model_ab.py", rows,
                           xla_flags=os.environ.get("XLA_FLAGS"), shape=shape, context=CONTEXT, batch=batch,
                           measured_hbm_gbs=hbm)
        bm.write_json(os.path.join(out_dir, f"model_ab_{shape}_b{batch}.json"), record)
    print(bm.table(printed, ["shape", "method", "batch", "variant", "step_ms"]))


if __name__ == "__main__":
    main(os.environ.get("OUT", "."))

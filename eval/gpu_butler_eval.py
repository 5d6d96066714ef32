"""Re-run the TokenButler evaluation on a (new) predictor checkpoint, on one GPU (issue 7, item 5).

A thin wrapper over `python -m eval.butler_eval` with the GPU run's defaults; every extra argument is passed on
(a later flag overrides a default). Run from the repository root on the GPU machine:

    OUT=/some/dir python eval/gpu_butler_eval.py --artifact /tmp/butler_work --model /tmp/smollm2.gguf

Defaults: --dtype float32, --tasks accuracy,coref,ppl, --sparsities 0.1,0.3,0.5,0.6, --lengths 2048, --samples 8,
--acc-samples 8, --coref-samples 20, --coref-sparsity 0.5, methods butler (the tuned default: sinks + local window,
layers 0-1 dense), butler-paper (the paper's rule: sinks only, layer 0 dense), oracle, quest, streaming, h2o;
results in $OUT/results.json, summary.md, coref_outputs.json. `--artifact` may be the training run's --work folder
(it holds artifact.json + arrays.npz) or a committed artifact folder (artifacts/smollm2/butler).

Expected time on an H100: model load ~35 s; accuracy + co-reference ~1.5 min; perplexity ~10-30 s per method and
sparsity after its compile (25 runs at 4 sparsities): ~5-7 min in all. Split with --tasks / --sparsities to stay
under 10 minutes a command if needed.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULTS = ["--dtype", "float32", "--tasks", "accuracy,coref,ppl", "--sparsities", "0.1,0.3,0.5,0.6",
            "--lengths", "2048", "--samples", "8", "--acc-samples", "8", "--coref-samples", "20",
            "--coref-sparsity", "0.5", "--methods", "butler-paper,oracle,quest,streaming,h2o"]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--artifact" not in argv:
        raise SystemExit("--artifact DIR is required (the predictor: a train-predictor --out/--work folder)")
    if "--model" not in argv:
        argv += ["--model", os.environ.get("SMOLLM2_GGUF", "/tmp/smollm2.gguf")]
    if "--out" not in argv:
        argv += ["--out", os.environ.get("OUT") or "butler_eval_out"]
    from eval import butler_eval

    return butler_eval.main(DEFAULTS + argv)


if __name__ == "__main__":
    sys.exit(main())

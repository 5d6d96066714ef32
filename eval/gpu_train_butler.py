"""Train TokenButler's predictor for the bundled SmolLM2-135M on the books, on one GPU (issue 7, item 6).

Run from the repository root on the GPU machine (the GGUF is carried there; books as a glob):

    SMOLLM2_GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf GIT_COMMIT=$(git rev-parse HEAD) OUT=/some/dir \\
        python eval/gpu_train_butler.py --data '/path/books/*.txt'

Budget: under 8 minutes on an H100 in all (model load and tokenization ~1 min, compilation ~1 min, training
stopped by --max-seconds, default 300 s, whatever --steps says; the cosine schedule is laid out over --steps, so
pick --steps the measured step rate can finish: the log prints steps/s after 20 steps).

Longer recipe (about 6.5 minutes on an H100 at the measured ~27 steps/s of batch 8 x 2048): --steps 8000
--max-seconds 320 --warmup 200 --end-lr-ratio 0.05 --checkpoint-every 1000; then calibrate the dense layers
(eval/gpu_butler_coverage.py --dense-count 3 --artifact WORK) and evaluate (eval/gpu_butler_eval.py).

The frozen model runs in bf16 (the loss kernel's matmuls too); the predictor's parameters and AdamW are f32.
The evaluation corpora never enter training: files whose name matches --exclude (default: the evaluation corpus
"The Call of the Wild" and the development corpus "Alice in Wonderland") are dropped from --data.

Writes to $OUT:
  butler/artifact.json, butler/arrays.npz   the predictor as a "butler" artifact keyed to the model fingerprint
                                            (f32; 5.5 MB for SmolLM2; `--method butler --artifact $OUT/butler`)
  loss_curve.json                           per step: loss, lr, grad norm, tokens/s; plus the run's facts
  loss_curve.png                            the curve (matplotlib, when installed)
  train_butler.json                         device, commit, sizes (predictor params and % of the model, artifact
                                            and orbax checkpoint bytes), data, timing, held-out top-50% accuracy
Checkpoints go to --work (default /tmp/butler_work), not to $OUT; only their size is reported.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_EXCLUDE = "*call_of_the_wild*,*alice*"


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def plot_loss(records: list[dict], path: str) -> bool:
    """Writes the loss curve as a PNG; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = [r["step"] for r in records]
    loss = [r["loss"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, loss, lw=0.8, alpha=0.5, label="loss")
    w = max(1, len(loss) // 50)
    if len(loss) >= w:
        import numpy as np

        smooth = np.convolve(loss, np.ones(w) / w, mode="valid")
        ax.plot(steps[w - 1:], smooth, lw=1.5, label=f"mean of {w}")
    ax.set_xlabel("step")
    ax.set_ylabel("logit MSE (layers >= 1, causal pairs)")
    ax.set_yscale("log")
    ax.set_title("TokenButler predictor on SmolLM2-135M")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, nargs="+", help="book files or quoted globs")
    p.add_argument("--exclude", default=DEFAULT_EXCLUDE,
                   help=f"comma-separated fnmatch patterns of file names to leave out (default {DEFAULT_EXCLUDE})")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--end-lr-ratio", type=float, default=0.1, help="cosine decay ends at this fraction of --lr")
    p.add_argument("--checkpoint-every", type=int, default=250)
    p.add_argument("--max-seconds", type=float, default=300.0, help="wall-time limit of the training loop")
    p.add_argument("--dtype", default=None, help="model dtype (default: bf16 on GPU, f32 on CPU)")
    p.add_argument("--work", default="/tmp/butler_work", help="checkpoint folder (emptied first)")
    p.add_argument("--acc-windows", type=int, default=4, help="held-out windows for the top-50%% accuracy (0: skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loss-impl", choices=["gpu", "tpu", "xla"], default=None,
                   help="logit_mse implementation (default: by backend; 'xla' materialises L x L per head)")
    args = p.parse_args(argv)
    out = os.environ.get("OUT") or "."
    os.makedirs(out, exist_ok=True)
    t_all = time.perf_counter()

    import jax
    import numpy as np

    import jsparse
    from eval.bench.common import device_facts
    from eval.passkey import special_prefix
    from train import data as data_lib
    from train.loop import LOSS_LOG, TrainConfig, train
    from train.predictor import describe, preset_config

    paths = data_lib.expand_paths(args.data)
    patterns = [x.strip() for x in args.exclude.split(",") if x.strip()]
    excluded = [q for q in paths if any(fnmatch.fnmatch(os.path.basename(q).lower(), pat) for pat in patterns)]
    paths = [q for q in paths if q not in excluded]
    if not paths:
        raise SystemExit(f"no training files left after --exclude {args.exclude!r}")
    spec = os.environ.get("SMOLLM2_GGUF") or "smollm2"
    t0 = time.perf_counter()
    model = jsparse.load(spec, args.dtype)
    fingerprint = jsparse.fingerprint(model)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tok = model.tokenizer
    ids = data_lib.tokenize_files(tok, paths, separator=tok.eos_token_id)
    chunks = data_lib.pack_chunks(ids, args.seq_len, special_prefix(tok))
    tokenize_s = time.perf_counter() - t0
    pcfg = preset_config(model.cfg)
    size = describe(pcfg, model.cfg)
    print(json.dumps({"files": len(paths), "excluded": [os.path.basename(x) for x in excluded],
                      "tokens": int(len(ids)), "chunks": int(len(chunks)), "load_s": round(load_s, 1),
                      "tokenize_s": round(tokenize_s, 1), "devices": jax.device_count(),
                      "predictor_params": size["predictor_params"], "fraction": size["fraction"]}), flush=True)

    shutil.rmtree(args.work, ignore_errors=True)
    tc = TrainConfig(seq_len=args.seq_len, steps=args.steps, batch_size=args.batch_size, learning_rate=args.lr,
                     warmup_steps=min(args.warmup, args.steps // 10), end_lr_ratio=args.end_lr_ratio,
                     checkpoint_every=args.checkpoint_every,
                     seed=args.seed, loss_impl=args.loss_impl)
    marks = {}

    def on_step(step, loss):
        now = time.perf_counter()
        marks.setdefault(step, now)
        if step == 1 or step % 100 == 0:
            print(json.dumps({"step": step, "loss": round(loss, 4),
                              "elapsed_s": round(now - t_train, 1)}), flush=True)
        if step == 21:
            rate = 20 / (now - marks[1])
            print(json.dumps({"steps_per_s": round(rate, 2), "tokens_per_s": round(rate * args.batch_size *
                                                                                  args.seq_len)}), flush=True)

    t_train = time.perf_counter()
    result = train(model.cfg, model.params, fingerprint=fingerprint, chunks=chunks, out_dir=args.work, tc=tc,
                   pcfg=pcfg, model_name=model.name, on_step=on_step, progress=False, max_seconds=args.max_seconds)
    train_s = time.perf_counter() - t_train
    with open(os.path.join(args.work, LOSS_LOG)) as f:
        log = [json.loads(line) for line in f]
    art_dir = os.path.join(out, "butler")
    os.makedirs(art_dir, exist_ok=True)
    for name in ("artifact.json", "arrays.npz"):
        shutil.copy(os.path.join(args.work, name), os.path.join(art_dir, name))
    steady = [r["tokens_per_s"] for r in log[min(20, len(log) - 1):]]

    acc = None
    if args.acc_windows > 0:
        from eval import ppl as ppl_task
        from eval.butler_eval import top50_accuracy

        t0 = time.perf_counter()
        butler = jsparse.build_method("butler", model, artifact=art_dir)
        corpus_ids = ppl_task.tokenize_corpus(tok, ppl_task.read_corpus(ppl_task.DEFAULT_CORPUS))
        windows = ppl_task.make_windows(tok, corpus_ids, args.seq_len, args.acc_windows, args.seed)
        acc = top50_accuracy(model, butler, windows, stride=8)
        acc["seconds"] = round(time.perf_counter() - t0, 1)
        acc["corpus"] = os.path.basename(ppl_task.DEFAULT_CORPUS)

    facts = {**device_facts(), "command": " ".join(["python", "eval/gpu_train_butler.py", *(argv or sys.argv[1:])]),
             "model": model.name, "model_fingerprint": fingerprint, "model_dtype": str(model.params.embed.dtype),
             "predictor": size, "train_config": tc.__dict__, "max_seconds": args.max_seconds,
             "data": {"files": [os.path.basename(x) for x in paths], "excluded": [os.path.basename(x) for x in excluded],
                      "tokens": int(len(ids)), "chunks": int(len(chunks)), "seq_len": args.seq_len},
             "steps_done": result.last_step, "stopped_early": result.stopped_early,
             "epochs": result.last_step * args.batch_size / len(chunks),
             "tokens_seen": result.last_step * args.batch_size * args.seq_len,
             "first_loss": log[0]["loss"] if log else None,
             "final_loss": float(np.mean([r["loss"] for r in log[-20:]])) if log else None,
             "tokens_per_s_median": float(np.median(steady)) if steady else None,
             "seconds": {"load": load_s, "tokenize": tokenize_s, "train_loop": train_s,
                         "first_step_incl_compile": log[0]["seconds"] if log else None,
                         "total": time.perf_counter() - t_all},
             "artifact_bytes": os.path.getsize(os.path.join(art_dir, "arrays.npz")),
             "checkpoint_bytes": dir_bytes(os.path.join(args.work, "checkpoints", str(result.last_step))),
             "checkpoint_dir_bytes": dir_bytes(os.path.join(args.work, "checkpoints")),
             "checkpoints_kept": sorted(os.listdir(os.path.join(args.work, "checkpoints"))),
             "top50_accuracy": acc}
    with open(os.path.join(out, "loss_curve.json"), "w") as f:
        json.dump({"records": log, "model": model.name, "device": facts["device"], "commit": facts["commit"],
                   "train_config": tc.__dict__}, f, indent=1)
    facts["loss_curve_png"] = plot_loss(log, os.path.join(out, "loss_curve.png"))
    with open(os.path.join(out, "train_butler.json"), "w") as f:
        json.dump(facts, f, indent=2)
    print(json.dumps({k: facts[k] for k in ("steps_done", "stopped_early", "first_loss", "final_loss",
                                            "tokens_per_s_median", "artifact_bytes", "checkpoint_bytes")}))
    if acc is not None:
        print(json.dumps({"top50_accuracy": acc["accuracy"]}))
    print(json.dumps({"seconds": facts["seconds"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`jsparse train-predictor`: train TokenButler's predictor for a model on text files.

Hooked into `jsparse/cli.py` with

    from train.cli_train import add_train_parser
    add_train_parser(sub)          # sub = parser.add_subparsers(...); sets func=run_train

Example:

    jsparse train-predictor --model smollm2 --data 'books/*.txt' --seq-len 1024 --steps 2000 --out runs/butler

writes runs/butler/{artifact.json, arrays.npz} (use with `--method butler --artifact runs/butler`),
runs/butler/loss.jsonl and runs/butler/checkpoints/. Running the same command again after an interruption
resumes from the latest checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import warnings


# TrainConfig's fields as `train-predictor` sets them (its errors name both).
FLAGS = {"seq_len": "--seq-len", "steps": "--steps", "batch_size": "--batch-size", "learning_rate": "--lr",
         "warmup_steps": "--warmup", "end_lr_ratio": "--end-lr-ratio", "weight_decay": "--weight-decay",
         "clip_norm": "--clip-norm", "checkpoint_every": "--checkpoint-every", "seed": "--seed",
         "loss_impl": "--loss-impl"}


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the `train-predictor` command to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "train-predictor", help="train TokenButler's importance predictor (writes a butler artifact)",
        description="Train TokenButler's ~1% predictor against the frozen model's attention logits (blockwise MSE), "
                    "data-parallel over the devices present. Writes checkpoints, loss.jsonl and a 'butler' artifact "
                    "to --out; rerunning the same command resumes from the latest checkpoint (Ctrl-C or SIGTERM "
                    "saves one of the last completed step first, and exits with 130 or 143).")
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (the bundled SmolLM2-135M-Instruct), a Hugging Face folder or a .gguf file "
                        "(default: smollm2)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="the frozen model's dtype (default: float32 on CPU, bfloat16 on GPU/TPU)")
    p.add_argument("--data", nargs="+", action="extend", required=True, metavar="FILE",
                   help="UTF-8 text files or glob patterns (quoted; ** matches any depth of folders) to train on; "
                        "repeatable")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per training chunk (default 1024)")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps of the whole run")
    p.add_argument("--out", required=True, help="output folder (checkpoints, loss log, artifact)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="chunks per step over all devices, a multiple of the device count (default 8)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW peak learning rate (default 1e-3)")
    p.add_argument("--warmup", type=int, default=None,
                   help="linear warmup steps (default: min(100, steps // 10))")
    p.add_argument("--end-lr-ratio", type=float, default=0.1,
                   help="final learning rate of the cosine decay, as a fraction of --lr (default 0.1)")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (default 0.01)")
    p.add_argument("--clip-norm", type=float, default=1.0, help="global gradient-norm clip (default 1.0)")
    p.add_argument("--checkpoint-every", type=int, default=None,
                   help="steps between checkpoints, at most --steps (default: min(100, steps); the last step is "
                        "always saved)")
    p.add_argument("--seed", type=int, default=0, help="seed of the predictor init and the data shuffle (default 0)")
    p.add_argument("--preset", default=None,
                   help="predictor size preset: smollm2-135m, llama3-8b, qwen3-8b or auto (default: the preset "
                        "matching the model's shape, else auto: ~1%% of the model)")
    p.add_argument("--key-heads", choices=["query", "kv"], default="query",
                   help="predicted keys per query head (the paper) or per KV head (default query)")
    p.add_argument("--head-dim", type=int, default=None, help="override d', the predicted q/k width (even)")
    p.add_argument("--qk-hidden", type=int, default=None, help="override the QK networks' hidden width")
    p.add_argument("--all-pairs", action="store_true",
                   help="average the loss over all L x L query-key pairs (the official code) instead of the causal "
                        "ones")
    p.add_argument("--loss-impl", choices=["gpu", "tpu", "xla"], default=None,
                   help="logit_mse implementation (default: by backend)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop after this much wall time, saving a checkpoint and the artifact")
    p.add_argument("--mesh", default=None, metavar="data=D",
                   help="data-parallel over the first D devices (default: all); the predictor trains data-parallel "
                        "only, so a model axis must be 1")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run_train)
    return p


def run_train(args) -> int:
    """The `train-predictor` command: check the data, the options and --out (all that needs no model), load the
    model, tokenize, train; prints a JSON summary."""

    import jsparse
    from jsparse.artifacts import corpus_meta
    from train import data as data_lib
    from train.loop import (TrainConfig, Terminated, check_resume_config, check_target, last_logged_loss,
                            read_checkpoint_meta, train)
    from train.predictor import check_preset_name, describe, preset_config

    # Everything that needs no model is checked first: loading one can take minutes.
    paths = data_lib.expand_paths(args.data)  # fail on missing files before loading the model
    for path in paths:
        data_lib.read_text(path)
    if args.steps is None or args.steps < 1:
        raise ValueError(f"--steps {args.steps}: expected a positive number of steps")
    if args.max_seconds is not None and not args.max_seconds > 0:
        raise ValueError(f"--max-seconds {args.max_seconds}: expected a positive number of seconds")
    if args.checkpoint_every is not None and args.checkpoint_every > args.steps:
        raise ValueError(f"--checkpoint-every {args.checkpoint_every} is more than --steps {args.steps}: no checkpoint "
                         f"would be saved before the last step; expected at most {args.steps}")
    for flag, value in (("--head-dim", args.head_dim), ("--qk-hidden", args.qk_hidden)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: expected a positive integer")
    if args.head_dim is not None and args.head_dim % 2:
        raise ValueError(f"--head-dim {args.head_dim}: expected an even width (RoPE rotates d' in pairs)")
    check_preset_name(args.preset)
    from eval.cli_eval import out_folder

    with out_folder(args.out, "checkpoints, loss.jsonl and the butler artifact"):  # no empty folder left on a refusal
        warmup = args.warmup if args.warmup is not None else min(100, args.steps // 10)
        devices = train_devices(getattr(args, "mesh", None))
        check_target(args.out, args.loss_impl, devices[0].platform)
        check_writable(args.out)
        tc = TrainConfig(seq_len=args.seq_len, steps=args.steps, batch_size=args.batch_size, learning_rate=args.lr,
                         warmup_steps=warmup, end_lr_ratio=args.end_lr_ratio, weight_decay=args.weight_decay,
                         clip_norm=args.clip_norm, seed=args.seed, causal=not args.all_pairs, loss_impl=args.loss_impl,
                         checkpoint_every=(args.checkpoint_every if args.checkpoint_every is not None
                                           else min(100, args.steps)))
        validate(tc, None, len(devices))  # all but the model's bounds of seq_len
        check_resume_config(args.out, tc)  # a checkpoint there of another training config
        model = jsparse.load(args.model, args.dtype)
        validate(tc, model.cfg, len(devices))
        pcfg = preset_config(model.cfg, args.preset, key_heads=args.key_heads, head_dim=args.head_dim,
                             qk_hidden=args.qk_hidden)
        if model.tokenizer is None:
            raise ValueError(f"model {args.model!r} has no tokenizer: training on text needs one (a Hugging Face "
                             "folder with tokenizer files, a GGUF, or the bundled smollm2)")
        tok = model.tokenizer
        sep = tok.eos_token_id if tok.eos_token_id is not None else None
        ids = data_lib.tokenize_files(tok, paths, separator=sep)
        from eval.passkey import special_prefix

        chunks = data_lib.pack_chunks(ids, args.seq_len, special_prefix(tok), source=data_lib.describe_files(paths))
        size = describe(pcfg, model.cfg)
        print(json.dumps({"files": len(paths), "tokens": int(len(ids)), "chunks": int(chunks.shape[0]),
                          "devices": len(devices), **{k: size[k] for k in ("predictor_params", "model_params",
                                                                                  "fraction")}}))
        if tc.batch_size > chunks.shape[0]:
            warnings.warn(f"--batch-size {tc.batch_size} is more than the data's {chunks.shape[0]} chunks of "
                          f"--seq-len {tc.seq_len} tokens: every step repeats chunks (about "
                          f"{tc.batch_size / chunks.shape[0]:.1f} times each)", stacklevel=2)
        try:
            result = train(model.cfg, model.params, fingerprint=jsparse.fingerprint(model), chunks=chunks,
                           out_dir=args.out, tc=tc, pcfg=pcfg, model_name=model.name, progress=not args.no_progress,
                           max_seconds=args.max_seconds, devices=devices, artifact_meta=corpus_meta(paths))
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (train.loop.Terminated): the last step was checkpointed
            try:
                meta = read_checkpoint_meta(args.out)
            except Exception:  # noqa: BLE001  (a checkpoint the interrupt cut short: the resume moves it aside)
                meta = None
            saved = (f"the checkpoint of step {meta['step']} is in {os.path.join(args.out, 'checkpoints')}"
                     if meta else "no checkpoint was saved")
            print(f"jsparse train-predictor: interrupted ({str(e) or 'Ctrl-C'}); {saved}: run the same command again "
                  "to resume", file=sys.stderr)
            return 143 if isinstance(e, Terminated) else 130
        print(json.dumps({"out": os.path.abspath(args.out), "resumed_from": result.start_step,
                          "steps": result.last_step, "final_loss": last_logged_loss(args.out),
                          "stopped_early": result.stopped_early, "seconds": round(result.seconds, 1),
                          "tokens_seen": int(result.last_step * tc.batch_size * tc.seq_len),
                          "epochs": float(result.last_step * tc.batch_size / chunks.shape[0]),
                          "artifact_bytes": os.path.getsize(os.path.join(args.out, "arrays.npz"))}))
    return 0


def validate(tc, cfg, num_devices: int) -> None:
    """`tc.validate(cfg, num_devices)`, its error naming the flag too ("learning_rate=0.0 (--lr): ...")."""
    from train.loop import TrainError

    try:
        tc.validate(cfg, num_devices)
    except TrainError as e:
        raise TrainError(re.sub(r"^(\w+)(=\S*?)([: ])", lambda m: f"{m[1]}{m[2]} ({FLAGS[m[1]]}){m[3]}"
                                if m[1] in FLAGS else m[0], str(e), count=1)) from None


def check_writable(out: str) -> None:
    """Refuses, before any work, an --out whose checkpoints folder (an earlier run's) this process cannot write in
    (no permission, a read-only file system), or whose loss.jsonl, when there, it cannot open to append: the steps
    would fail at their first write, or orbax's save thread after them. (The --out folder itself is probed by
    `eval.cli_eval.check_out`, through `out_folder`.)"""
    from eval.cli_eval import check_writable as check_folder
    from train.loop import CHECKPOINTS, LOSS_LOG

    checkpoints = os.path.join(out, CHECKPOINTS)
    if os.path.isdir(checkpoints):
        check_folder(out, checkpoints, "the checkpoints")
    log = os.path.join(out, LOSS_LOG)
    if os.path.isfile(log):
        try:
            open(log, "a").close()
        except OSError as e:
            raise ValueError(f"--out {out!r}: cannot append to {log!r} ({e.strerror or e}): expected a file this user "
                             "can write") from None


def train_devices(mesh: str | None) -> list:
    """The devices of `--mesh data=D` (the first D), or all of them; a model axis other than 1 is an error."""
    import jax

    from models.sharding import parse_mesh

    if mesh is None:
        return list(jax.devices())
    sizes = parse_mesh(mesh)
    if sizes["model"] != 1:
        raise ValueError(f"--mesh {mesh}: train-predictor is data-parallel only (the predictor is ~1% of the "
                         "model); expected model=1")
    if sizes["data"] > jax.device_count():
        raise ValueError(f"--mesh {mesh}: data={sizes['data']} devices asked, {jax.device_count()} available")
    return list(jax.devices())[: sizes["data"]]

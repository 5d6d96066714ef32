"""Budget sweeps, generation tasks, resuming an interrupted run, and the report (eval/harness.py, eval/report.py).

Runs on the tiny random Llama and tokenizer of tests/test_eval.py with a test-only generation task registered
for the test ("sweep_test_task": seeded random prompts of two lengths with needle depths); the library's own
tasks are tested in their own files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import numpy as np
import pytest

import jsparse
from eval import cli_eval, harness, report
from eval import tasks as task_registry
from test_eval import corpus, model, tokenizer  # noqa: F401  (fixtures)
from eval import coref

TASK = "sweep_test_task"


def _make_samples(tokenizer, length, samples, seed, *, haystack="repeat", chat=False):
    """Seeded random prompts of `length` or `length - 3` tokens (ragged batches); answers are two token strings."""
    rng = np.random.default_rng([seed, length])
    out = []
    for i in range(samples):
        n = length - 3 * (i % 2)
        tokens = tuple(int(t) for t in rng.integers(2, len(tokenizer), n))
        answers = (tokenizer.decode([tokens[5]]), tokenizer.decode([tokens[7]]))
        out.append(task_registry.Sample(task=TASK, tokens=tokens, answers=answers, depth=(0.25, 0.75)[i % 2],
                                        length=n))
    return out


@pytest.fixture
def test_task(monkeypatch):
    task = task_registry.Task(name=TASK, metric="string_match_all", max_new_tokens=3, make_samples=_make_samples,
                              doc="test-only")
    monkeypatch.setitem(task_registry.TASKS, TASK, task)
    return task


def _parser():
    parser = argparse.ArgumentParser(prog="jsparse")
    cli_eval.add_eval_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def test_generation_of_ragged_batch_equals_one_prompt_at_a_time(model, test_task):
    samples = _make_samples(model.tokenizer, 40, 3, seed=1)
    assert {len(s.tokens) for s in samples} == {40, 37}
    dense = jsparse.build_method("dense", model)
    prompts = [s.tokens for s in samples]
    batched = harness.run_generation(model, dense, prompts, 3, rows=2, width=48, max_new_tokens=5)
    alone = [harness.run_generation(model, dense, [p], 3, rows=1)[0] for p in prompts]
    assert batched == alone and any(batched)
    with pytest.raises(ValueError, match="width=30"):
        harness.run_generation(model, dense, prompts, 3, rows=2, width=30)


def test_generation_tasks_share_generate_calls_and_ppl_has_its_own_window_count(model, corpus, test_task,
                                                                                monkeypatch):
    prompts_per_call = []
    real = harness.run_generation

    def counting(model, method, prompts, *a, **k):
        prompts_per_call.append(len(prompts))
        return real(model, method, prompts, *a, **k)

    monkeypatch.setattr(harness, "run_generation", counting)
    spec = harness.EvalSpec(methods=("dense",), tasks=("passkey", TASK, "ppl"), lengths=(96,), samples=3,
                            ppl_samples=1, corpus=corpus, ppl_variants=("continuation",), continuation=16,
                            new_tokens=2, max_batch_tokens=4 * 96)
    both = harness.evaluate(model, spec, progress=False)
    # One run_generation for passkey's 3 prompts and the task's 3 (2 generate calls of 3 rows: 4 at most).
    assert prompts_per_call == [6] and spec.generation_rows(96, 6) == 3
    rec = {r["task"]: r for r in both.records if r["depth"] is None}
    assert rec["ppl"]["n"] == 1 and rec["passkey"]["n"] == 3 and rec[TASK]["n"] == 3
    assert rec["passkey"]["seconds"] > 0 and rec["passkey"]["seconds"] == pytest.approx(rec[TASK]["seconds"])
    # Each task's completions (cut to its own max_new_tokens) are those of a run of that task alone.
    for task in ("passkey", TASK):
        alone = harness.evaluate(model, dataclasses.replace(spec, tasks=(task,)), progress=False)
        assert [o["completion"] for o in alone.outputs] == [o["completion"] for o in both.outputs if o["task"] == task]
    assert any(o["completion"] for o in both.outputs)
    with pytest.raises(ValueError, match=r"ppl_samples=0: expected a positive integer"):
        dataclasses.replace(spec, ppl_samples=0).validate()


def test_sweep_resumes_where_it_stopped(model, corpus, test_task, tmp_path, monkeypatch):
    monkeypatch.setattr(jsparse, "load", lambda spec, dtype=None, **kw: model)
    out = tmp_path / "run"
    argv = ["eval", "--model", "tiny", "--methods", "dense,oracle", "--tasks", f"{TASK},ppl", "--lengths", "64",
            "--budgets", "0.25,0.5", "--budget-tokens", "16", "--method-option", "oracle.min_tokens=4",
            "--ppl-variants", "prefill", "--samples", "2",
            "--corpus", corpus, "--out", str(out), "--no-progress", "--no-report"]
    units = {(m, b, k, t, 64, v) for m, b, k in (("dense", None, None), ("oracle", 0.25, None),
                                                 ("oracle", 0.5, None), ("oracle", None, 16))
             for t, v in ((TASK, "generate"), ("ppl", "prefill"))}
    calls = []
    real_gen, real_ppl = harness.run_generation, harness.run_ppl

    def counting(real, kind, stop_at=None):
        def run(*a, **k):
            calls.append(kind)
            if stop_at is not None and len(calls) == stop_at:
                raise KeyboardInterrupt  # the user stops the run in its 5th unit
            return real(*a, **k)
        return run

    monkeypatch.setattr(harness, "run_generation", counting(real_gen, "gen", stop_at=5))
    monkeypatch.setattr(harness, "run_ppl", counting(real_ppl, "ppl", stop_at=5))
    args = _parser().parse_args(argv)
    assert args.func(args) == 130  # interrupted (said in one line)
    first = json.loads((out / "results.json").read_text())
    done = {harness.record_key(r) for r in first["records"]}
    first_outputs = json.loads((out / "outputs.json").read_text())  # written with each unit, as results.json is
    assert len(first_outputs) == 2 * sum(1 for u in done if u[3] == TASK)
    assert report.SCHEMA_VERSION == harness.SCHEMA_VERSION
    assert len(done) == 4 and done < units and first["runs"][0]["records"] == len(first["records"])

    # The rerun runs only the 4 missing units and keeps the first run's records as they were.
    calls.clear()
    monkeypatch.setattr(harness, "run_generation", counting(real_gen, "gen"))
    monkeypatch.setattr(harness, "run_ppl", counting(real_ppl, "ppl"))
    args = _parser().parse_args(argv)
    assert args.func(args) == 0
    assert len(calls) == 4
    data = json.loads((out / "results.json").read_text())
    main = [r for r in data["records"] if r["depth"] is None]
    assert sorted(map(harness.record_key, main), key=str) == sorted(units, key=str)  # each unit once
    assert data["records"][:len(first["records"])] == first["records"]
    assert [r["records"] for r in data["runs"]] == [len(first["records"]), len(data["records"]) - len(first["records"])]
    by = {harness.record_key(r)[:3] + (r["task"],): r for r in main}
    assert by[("dense", None, None, "ppl")]["budget"] is None  # dense takes no budget
    assert by[("oracle", 0.25, None, "ppl")]["sparsity"] > by[("oracle", 0.5, None, "ppl")]["sparsity"] > 0.0
    gen = by[("oracle", 0.25, None, TASK)]
    assert gen["metric"] == "string_match_all" and gen["n"] == 2 and 0.0 <= gen["value"] <= 1.0
    depth = [r for r in data["records"] if r["task"] == TASK and r["depth"] is not None]
    assert sorted({r["depth"] for r in depth}) == [0.25, 0.75] and all(r["n"] == 1 for r in depth)
    outputs = json.loads((out / "outputs.json").read_text())  # both runs' completions (2 samples per unit)
    assert outputs[:len(first_outputs)] == first_outputs
    assert len(outputs) == 2 * sum(1 for u in units if u[3] == TASK)
    assert all(o["task"] == TASK and len(o["answers"]) == 2 and o["score"] in (0.0, 0.5, 1.0) for o in outputs)

    # A third run has nothing left to do; another configuration is refused before any work.
    calls.clear()
    args = _parser().parse_args(argv)
    assert args.func(args) == 0 and calls == []
    third = json.loads((out / "results.json").read_text())
    assert third["records"] == data["records"] and third["runs"] == data["runs"]  # a run that added nothing: unlisted
    args = _parser().parse_args(argv + ["--seed", "2"])
    with pytest.raises(ValueError, match=r"was run with seed=0, this run has seed=2: .*--overwrite"):
        args.func(args)
    # An --overwrite run stopped in its first unit, then resumed: outputs.json never holds the earlier
    # configuration's completions beside the new one's records.
    over = argv + ["--overwrite", "--seed", "1"]
    calls.clear()
    monkeypatch.setattr(harness, "run_ppl", real_ppl)
    monkeypatch.setattr(harness, "run_generation", counting(real_gen, "gen", stop_at=2))  # in its second gen unit
    args = _parser().parse_args(over)
    assert args.func(args) == 130
    monkeypatch.setattr(harness, "run_generation", real_gen)
    args = _parser().parse_args(argv + ["--seed", "1"])
    assert args.func(args) == 0
    seeded = json.loads((out / "results.json").read_text())
    assert seeded["meta"]["seed"] == 1
    again = json.loads((out / "outputs.json").read_text())
    assert len(again) == len(outputs) and again != outputs  # seed 1's completions (other prompts), each unit once
    assert len({(o["method"], o["budget"], o["budget_tokens"], o["completion"], tuple(o["answers"])) for o in again}) \
        == len(again)
    args = _parser().parse_args(argv + ["--overwrite", "--tasks", "ppl", "--budgets", "0.25"])
    assert args.func(args) == 0
    assert len(json.loads((out / "results.json").read_text())["records"]) == 3  # dense, oracle 0.25, oracle k=16


@pytest.mark.parametrize("extra, match", [
    (["--budgets", "0"], r"budget '0': expected a fraction of the context in \(0, 1\]"),
    (["--budgets", "0.1,1.5"], r"budget '1.5': expected a fraction"),
    (["--budgets", "256"], r"budget '256': .*token budgets go to --budget-tokens"),
    (["--budgets", "0.1,abc"], r"budget 'abc': expected a fraction"),
    (["--budgets", "0.1,0.1"], r"names a budget twice"),
    (["--budgets", " , "], r"--budgets: expected a comma-separated list"),
    (["--budgets", "0.1", "--budget", "0.2"], r"--budget 0.2 and --budgets 0.1 both given"),
    (["--budget-tokens", "0"], r"budget tokens '0'"),
    (["--tasks", "nosuch_task"], r"unknown task 'nosuch_task'; valid tasks: passkey, ppl"),
    (["--lengths", "160,160"], r"lengths \[160, 160\] name a length twice"),
    (["--budget", "1.5", "--budget-tokens", "64"], r"budget 1.5: expected a fraction"),
])
def test_bad_budgets_fail_before_loading(extra, match, tmp_path, monkeypatch):
    monkeypatch.setattr(jsparse, "load", lambda *a, **k: pytest.fail("the model must not be loaded"))
    args = _parser().parse_args(["eval", "--out", str(tmp_path / "x"), "--no-progress"] + extra)
    with pytest.raises(ValueError, match=match):
        args.func(args)
    assert not os.path.exists(tmp_path / "x")


def test_resume_refuses_a_dropped_method_option_or_ppl_samples(tmp_path):
    """A method this run names must come with the options the folder ran it with (none when none), and an option
    given then and left at its default now (--ppl-samples) is a difference too. Methods this run does not name
    keep the folder's options."""
    def config(*extra):
        args = _parser().parse_args(["eval", "--methods", "dense,streaming", "--tasks", "passkey,ppl", "--samples",
                                     "4", "--out", "x", *extra])
        spec = cli_eval.spec_from_args(args)
        return cli_eval.run_config(spec, "smollm2", "float32"), spec.methods

    first, _ = config("--method-option", "streaming.sink=64", "--ppl-samples", "8")
    report.write_results(str(tmp_path), [_unit("dense"), _unit("streaming")], dict(config=first))
    same, methods = config("--method-option", "streaming.sink=64", "--ppl-samples", "8")
    assert cli_eval.resume_config(str(tmp_path), same, False, methods)[2] == first
    dropped, methods = config("--ppl-samples", "8")
    with pytest.raises(ValueError, match=r"method_options streaming=\{'sink': 64\}, this run has None"):
        cli_eval.resume_config(str(tmp_path), dropped, False, methods)
    # A run of dense alone keeps streaming's options from the folder.
    alone = dict(dropped)
    assert cli_eval.resume_config(str(tmp_path), alone, False, ("dense",))[2]["method_options"] == {
        "streaming": {"sink": 64}}
    no_ppl_samples, methods = config("--method-option", "streaming.sink=64")
    with pytest.raises(ValueError, match=r"was run with ppl_samples=8, this run has ppl_samples=None"):
        cli_eval.resume_config(str(tmp_path), no_ppl_samples, False, methods)
    # A folder written when a plain --artifact DIR went to every method (dense too) resumes the same command.
    report.write_results(str(tmp_path), [_unit("dense"), _unit("streaming")],
                         dict(config={**same, "artifacts": {"dense": "D", "streaming": "D"}}))
    assert cli_eval.resume_config(str(tmp_path), same, False, methods)[2]["artifacts"] == {}


def test_resume_refuses_a_corpus_edited_in_place_and_resumes_a_folder_without_its_digest(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("one text " * 200)

    def config():
        args = _parser().parse_args(["eval", "--methods", "dense", "--tasks", "ppl", "--corpus", str(corpus), "--out",
                                     "x"])
        return cli_eval.run_config(cli_eval.spec_from_args(args), "smollm2", "float32")

    first = config()
    out = tmp_path / "run"
    report.write_results(str(out), [_unit("dense", "ppl")], dict(config=first))
    assert cli_eval.resume_config(str(out), config(), False, ("dense",))[2] == first
    corpus.write_text("another text " * 200)  # the same path, other bytes
    with pytest.raises(ValueError, match="was run with corpus_sha256="):
        cli_eval.resume_config(str(out), config(), False, ("dense",))
    legacy = {k: v for k, v in first.items() if k != "corpus_sha256"}  # written before the digest
    report.write_results(str(out), [_unit("dense", "ppl")], dict(config=legacy))
    assert cli_eval.resume_config(str(out), config(), False, ("dense",))


def test_methods_are_built_at_a_budget_the_run_uses(monkeypatch):
    """The base instance of each method is built at the run's first fraction, or at 1.0 for token budgets only: a
    build at the default 0.1 the run never used failed for the shipped TokenButler artifact (its calibrated dense
    layers need a budget above 3/28) and stopped `--budgets 0.2,0.5` and `--budget-tokens` runs."""
    import jsparse

    seen = []
    monkeypatch.setattr(jsparse, "build_method", lambda name, model, **kw: seen.append(kw["budget"]) or object())
    base = dict(methods=("oracle",), tasks=("passkey",), lengths=(64,))
    for extra, want in ((dict(budgets=(0.2, 0.5)), 0.2), (dict(budget_tokens=(64,)), 1.0), (dict(budget=0.3), 0.3)):
        spec = harness.EvalSpec(**base, **extra)
        assert spec.base_budget() == want
        seen.clear()
        harness.build_methods(None, spec)
        assert seen == [want], extra


def test_min_tokens_option_beside_token_budgets_is_refused_or_named():
    """A token budget N sets min_tokens = N itself: a min_tokens method option under token budgets only would never
    apply (refused); beside fractions it applies to the fraction runs only (a warning says so). A budget given as a
    method option through the Python API is refused as the CLI refuses it."""
    base = dict(methods=("oracle",), tasks=("passkey",), lengths=(64,), method_options={"oracle": {"min_tokens": 4}})
    with pytest.raises(ValueError, match=r"oracle.min_tokens=4 with token budgets \[16\].*sets min_tokens itself.*"
                                         r"no fraction budget"):
        harness.EvalSpec(**base, budget_tokens=(16,)).validate()
    with pytest.warns(UserWarning, match=r"applies to the fraction runs \[0.25\] only"):
        harness.EvalSpec(**base, budget_tokens=(16,), budgets=(0.25,)).validate()
    harness.EvalSpec(**base, budgets=(0.25,)).validate()  # no token budget: nothing to say
    for field in ("budget", "budget_tokens"):
        with pytest.raises(ValueError, match=rf"method option oracle.{field}=.*not by a method option"):
            harness.EvalSpec(**{**base, "method_options": {"oracle": {field: 2}}}).validate()


def _unit(method, task="passkey"):
    return dict(task=task, method=method, length=160, budget=0.1, budget_tokens=None, metric="accuracy", value=1.0,
                sparsity=None, layer_sparsity=None, n=1, variant="generate", depth=None, seconds=0.1)


def test_resume_adds_a_method_with_its_own_artifact_and_refuses_another_draft(tmp_path):
    """Runs of different method subsets add up in one folder (the demo's help says so): a method the folder holds
    no records of brings its own artifact and options; one it holds records of must bring the same. A different
    --draft is a different configuration (every folder recorded the same placeholder, so a run with another draft
    skipped every unit and relabelled the folder)."""
    def config(*extra):
        args = _parser().parse_args(["eval", "--tasks", "passkey", "--out", "x", *extra])
        spec = cli_eval.spec_from_args(args)
        return cli_eval.run_config(spec, "smollm2", "float32"), spec.methods

    first, _ = config("--methods", "dense")
    report.write_results(str(tmp_path), [_unit("dense")], dict(config=first))
    more, methods = config("--methods", "kascade", "--artifact", "kascade=jsparse/shipped/smollm2/kascade",
                           "--method-option", "kascade.min_tokens=8")
    merged = cli_eval.resume_config(str(tmp_path), more, False, methods)[2]
    assert merged["artifacts"] == {"kascade": "jsparse/shipped/smollm2/kascade"}
    report.write_results(str(tmp_path), [_unit("dense"), _unit("kascade")], dict(config=merged))
    other, methods = config("--methods", "kascade", "--artifact", "kascade=elsewhere")
    with pytest.raises(ValueError, match="artifacts kascade='jsparse/shipped/smollm2/kascade', this run has 'elsewhere'"):
        cli_eval.resume_config(str(tmp_path), other, False, methods)

    with_a, _ = config("--methods", "sts", "--draft", "smollm2:layers=0-9")
    assert with_a["draft"] == "smollm2:layers=0-9"
    report.write_results(str(tmp_path / "s"), [_unit("sts")], dict(config=with_a))
    with_b, methods = config("--methods", "sts", "--draft", "smollm2:layers=0-14")
    with pytest.raises(ValueError, match="was run with draft='smollm2:layers=0-9', this run has draft='smollm2:la"):
        cli_eval.resume_config(str(tmp_path / "s"), with_b, False, methods)
    assert cli_eval.resume_config(str(tmp_path / "s"), with_a, False, methods)[2] == with_a


@pytest.mark.parametrize("extra, match", [
    (["--method-option", "streaming.budget=0.9"], r"the budget is set by --budget \(jsparse generate\) or --budgets \(jsparse eval\)"),
    (["--method-option", "streaming.budget_tokens=9"], "the budget is set by --budget-tokens"),
    (["--seed", "-1"], r"seed=-1: expected an integer >= 0"),
    (["--methods", "sts", "--draft", "smollm2:layers=0-9", "--budget-tokens", "1,64", "--tasks", "passkey"],
     "--budget-tokens 1 with method 'sts'"),
])
def test_options_that_would_be_recorded_wrongly_are_refused(extra, match):
    """A budget given as a method option ran at that budget and was recorded at --budget's; --seed -1 failed
    after loading with numpy's message; an STS token budget of 1 is the fraction 1 (every key)."""
    argv = ["eval", "--methods", "dense,streaming", "--out", "x"]
    if "--methods" in extra:
        argv = ["eval", "--out", "x"]
    with pytest.raises(ValueError, match=match):
        cli_eval.spec_from_args(_parser().parse_args(argv + extra))


def test_budget_beside_budget_tokens_runs_both():
    args = _parser().parse_args(["eval", "--methods", "dense,oracle", "--budget", "0.2", "--budget-tokens", "64",
                                 "--out", "x"])
    spec = cli_eval.spec_from_args(args)
    assert spec.fractions() == (0.2,) and spec.budget_tokens == (64,)
    args = _parser().parse_args(["eval", "--methods", "dense,oracle", "--budget-tokens", "64", "--out", "x"])
    assert cli_eval.spec_from_args(args).fractions() == ()  # the default --budget is not run beside them


def test_context_check_takes_the_prompt_length_a_task_makes(model, test_task, monkeypatch):
    """A length whose prompt plus answer fits the model's context (1024 here) passes the check before any work;
    only a task that may pass its length by 1% (exact_length=False) is checked for that much more."""
    class Checked(Exception):
        pass

    def after_the_checks(*a, **k):
        raise Checked

    monkeypatch.setattr(harness, "build_methods", after_the_checks)
    L = 1024 - test_task.max_new_tokens
    spec = harness.EvalSpec(methods=("dense",), tasks=(TASK,), lengths=(L,), samples=1)
    with pytest.raises(Checked):
        harness.evaluate(model, spec, progress=False)
    # A draft reads the whole prompt too: its context is checked before any work as well.
    short = dataclasses.replace(model, cfg=dataclasses.replace(model.cfg, max_position_embeddings=L))
    with pytest.raises(ValueError, match="longer than the draft's context of"):
        harness.evaluate(model, dataclasses.replace(spec, draft=short), progress=False)
    monkeypatch.setitem(task_registry.TASKS, TASK, dataclasses.replace(test_task, exact_length=False))
    with pytest.raises(ValueError, match=rf"length {L} \(--lengths\): prompt .{int(L * 1.01) + 1} tokens.*the run's "
                                         rf"new tokens are the most any of its tasks generates: {TASK} 3"):
        harness.evaluate(model, spec, progress=False)


def test_a_refused_run_leaves_no_empty_out_folder(model, tmp_path, monkeypatch):
    """--out is made before any work (so a bad one fails fast); a run refused later, before it wrote anything, takes
    the empty folder away again. An existing folder stays."""
    monkeypatch.setattr(jsparse, "load", lambda spec, dtype=None, **kw: model)
    out = tmp_path / "run"
    argv = ["eval", "--model", "tiny", "--methods", "dense", "--tasks", "passkey", "--lengths", "100000",
            "--samples", "1", "--out", str(out), "--no-progress", "--no-report"]
    args = _parser().parse_args(argv)
    with pytest.raises(ValueError, match=r"length 100000 \(--lengths\)"):
        args.func(args)
    assert not out.exists()
    out.mkdir()
    with pytest.raises(ValueError, match=r"length 100000"):
        args.func(_parser().parse_args(argv))
    assert out.is_dir()


def test_resume_refuses_a_version_1_results_file(tmp_path):
    (tmp_path / "results.json").write_text("[]")
    with pytest.raises(ValueError, match="schema version 1 .*--overwrite"):
        cli_eval.resume_config(str(tmp_path), {"seed": 0}, overwrite=False)
    assert cli_eval.resume_config(str(tmp_path), {"seed": 0}, overwrite=True) == ([], [], {"seed": 0})
    # Paths inside the repository are recorded relative to it, so committed results resume in another clone.
    root = os.path.dirname(os.path.dirname(os.path.abspath(cli_eval.__file__)))
    inside = os.path.join(root, "jsparse", "shipped", "smollm2", "tsa") + os.pathsep + os.path.join(root, "eval", "data")
    assert cli_eval.portable_path(inside) == os.path.join("jsparse", "shipped", "smollm2", "tsa") + os.pathsep + os.path.join(
        "eval", "data")
    assert cli_eval.portable_path(str(tmp_path)) == str(tmp_path) and cli_eval.portable_path(None) is None


# ------------------------------------------------------------------------------------------------ the report


def _records():
    """A synthetic sweep: dense, oracle at 3 budgets, tsa (no budget), streaming (no sparsity reported)."""
    rec = []

    def add(method, budget, sparsity, acc, ppl, tokens=None):
        common = dict(method=method, budget=budget, budget_tokens=tokens, sparsity=sparsity, seconds=1.0)
        for L in (256, 512):
            for task, metric in (("passkey", "accuracy"), ("niah_single_number", "string_match_all")):
                rec.append(harness.make_record(task=task, length=L, metric=metric, value=acc, n=4,
                                               variant="generate", depth=None, **common))
                for d in (0.25, 0.75):
                    rec.append(harness.make_record(task=task, length=L, metric=metric, value=acc * d, n=2,
                                                   variant="generate", depth=d, **common))
            rec.append(harness.make_record(task="ppl", length=L, metric="perplexity", value=ppl, n=4,
                                           variant="continuation", depth=None, **common))

    add("dense", None, 0.0, 1.0, 10.0)
    for b, s, a, p in ((0.05, 0.9, 0.5, 12.0), (0.1, 0.8, 0.75, 11.0), (0.2, 0.6, 1.0, 10.2)):
        add("oracle", b, s, a, p)
    add("oracle", 64 / 512, 0.85, 0.25, 13.0, tokens=64)
    add("tsa", None, 0.3, 1.0, 10.1)
    add("streaming", 0.1, None, 0.0, 15.0)
    return rec


def test_write_report_makes_leaderboard_and_plots(tmp_path):
    records = _records()
    report.write_results(str(tmp_path), records, {"command": "jsparse eval ...", "model": "m"})
    (tmp_path / "report.md").write_text("stale")
    os.makedirs(tmp_path / "plots")
    (tmp_path / "plots" / "depth_heatmap_quest.png").write_bytes(b"a discarded run's")  # removed: no quest records
    (tmp_path / "plots" / "notes.txt").write_text("the user's")  # kept: not a plot
    written = report.write_report(str(tmp_path))
    assert sorted(p for p in os.listdir(tmp_path / "plots") if not p.endswith(".png")) == ["notes.txt"]
    assert not (tmp_path / "plots" / "depth_heatmap_quest.png").exists()
    pngs = sorted(os.path.relpath(p, tmp_path) for p in written if p.endswith(".png"))
    assert pngs == sorted(["plots/accuracy_vs_sparsity_passkey.png", "plots/accuracy_vs_sparsity_niah_single_number.png",
                           "plots/ppl_vs_sparsity.png"]
                          + [f"plots/depth_heatmap_{m}.png" for m in ("dense", "oracle", "tsa", "streaming")])
    for p in pngs:
        assert (tmp_path / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / p).stat().st_size > 5000
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# Evaluation report") and "jsparse eval ..." in md
    board = md.split("## Leaderboard")[1].split("##")[0]
    rows = [line.split("|")[2].strip() for line in board.splitlines() if line.startswith("| ") and "rank" not in line]
    # accuracy first (dense, tsa and oracle b=0.2 all 1.0: then the perplexity change), streaming last.
    assert rows == ["dense", "tsa", "oracle b=0.2", "oracle b=0.1", "oracle b=0.05", "oracle k=64", "streaming b=0.1"]
    # prefill sparsity (passkey, the needle task), decode sparsity (ppl continuation), then accuracy
    assert "| 3 | oracle b=0.2 | 0.2 | 0.600 | 0.600 | 1.000 | 1.00 | 1.00 | +2.0% | 0 |" in board
    assert "| 1 | dense | none | 0.000 | 0.000 |" in board
    assert "| 6 | oracle k=64 | 64 tokens | 0.850 | 0.850 | 0.250 | 0.25 | 0.25 | +30.0% | 4 |" in board  # 4 below
    assert "| 7 | streaming b=0.1 | 0.1 |  |  | 0.000 |" in board  # no sparsity reported: blank
    for p in pngs:
        assert f"]({p})" in md
    assert "not plotted (no sparsity reported): streaming" in md  # its line is missing
    assert "## Fidelity gate" in md and "- oracle b=0.05 niah_single_number @256" in md
    assert (tmp_path / "summary.md").read_text().startswith("# Evaluation summary")
    # Version 1 files (a bare list) still make a report; unknown versions are refused.
    (tmp_path / "results.json").write_text(json.dumps(records))
    assert report.read_results(str(tmp_path))["schema_version"] == 1 and report.write_report(str(tmp_path))
    (tmp_path / "results.json").write_text(json.dumps({"schema_version": 99, "records": []}))
    with pytest.raises(ValueError, match="schema_version 99, expected 2"):
        report.write_report(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="results.json"):
        report.write_report(str(tmp_path / "nothing"))


# ------------------------------------------------------------------------------------------------ jsparse demo


def test_demo_command_runs_eval_with_every_cpu_method(tmp_path, monkeypatch):
    from eval import demo
    from jsparse import cli

    seen = {}

    def fake_run_eval(args):
        seen["args"] = args
        return 0

    monkeypatch.setattr(cli_eval, "run_eval", fake_run_eval)
    out = str(tmp_path / "demo")
    assert cli.main(["demo", "--out", out, "--no-progress"]) == 0
    args = seen["args"]
    spec = cli_eval.spec_from_args(args)
    assert args.out == out and args.model == "smollm2" and args.no_progress
    assert spec.methods == demo.METHODS and set(spec.methods) >= {"dense", "oracle", "kascade", "tsa", "evosparse"}
    assert spec.fractions() == (0.1,) and spec.budget_tokens is None and spec.lengths == (2048,)
    assert spec.tasks == ("passkey", "niah_single_number", "niah_multikey", "coref", "ppl")
    assert sum(t not in harness.TASKS + ("coref",) for t in spec.tasks) == 2  # two RULER tasks
    assert spec.samples == 2 and spec.ppl_variants == ("continuation",)
    # Perplexity: one 2048-token window whose last 512 tokens are scored (the time budget, see eval/demo.py).
    assert spec.ppl_windows() == 1 and spec.continuation == 512
    for name in ("kascade", "tsa", "evosparse", "butler"):
        assert os.path.isdir(spec.artifacts[name]), spec.artifacts[name]
    assert spec.method_options == {"butler": {"rebalance": False}}
    assert args.command_line == "jsparse demo --out " + out + " --no-progress"
    # Every registered method but sts (a draft) and the ablations runs in the demo.
    from jsparse.methods import method_names

    left_out = set(method_names()) - set(demo.METHODS) - {"eval_test_sparse"}  # test_eval.py registers it
    assert left_out == {"sts", "evosparse-noheat", "evosparse-noretrieval", "sink-local", "butler-local",
                        "butler-paper"}
    assert cli.main(["demo", "--out", out, "--lengths", "2048,4096", "--samples", "3"]) == 0
    spec = cli_eval.spec_from_args(seen["args"])
    assert spec.lengths == (2048, 4096) and spec.samples == 3 and not seen["args"].no_progress
    assert spec.ppl_windows() == 1


def test_token_budget_record_budget_is_a_fraction_for_sts(monkeypatch):
    """STS's builder takes a token budget as budget > 1 (it counts tokens); its records' budget is still the
    fraction N / visible tokens the record docs promise, like every other method's, and its builder gets N."""
    import dataclasses as dc

    from flax import struct

    @struct.dataclass
    class DraftLike:  # what method_runs reads of STS: a budget field and needs_draft
        budget: float = struct.field(pytree_node=False, default=0.1)
        needs_draft = True

    spec = dc.replace(harness.EvalSpec(methods=("sts",), tasks=("ppl",), lengths=(1024,)), budget_tokens=(64, 4096))
    built = []
    runs = harness.method_runs(None, spec, {"sts": DraftLike()}, 1024)
    monkeypatch.setattr(harness, "build_method", lambda model, spec, name, **o: built.append(o))
    for r in runs:
        r.build()
    assert [(r.budget, r.budget_tokens) for r in runs] == [(64 / 1024, 64), (1.0, 4096)]
    assert built == [{"budget": 64.0}, {"budget": 1.0}]


def _rec(method, task, value, *, variant="generate", metric=None, budget=None, tokens=None, sparsity=None, n=10,
         length=64, **extra):
    metric = metric or {"passkey": "accuracy", "ppl": "perplexity"}.get(task, "string_match_all")
    return harness.make_record(task=task, method=method, length=length, budget=budget, budget_tokens=tokens,
                               metric=metric, value=value, sparsity=sparsity, n=n, variant=variant, depth=None,
                               seconds=1.0, **extra)


def test_gate_compares_each_variant_with_dense_of_the_same_variant():
    """A chat result is checked against dense's chat result, not dense's raw-prompt one (the gate's unit is
    (task, variant, length))."""
    t = "niah_single_number"
    recs = [_rec("dense", t, 0.9, variant="chat"), _rec("dense", t, 0.5),
            _rec("oracle", t, 0.7, variant="chat"), _rec("oracle", t, 0.6)]
    gate = [(label, r["variant"], d["value"]) for label, _, r, d in report.below_dense(recs)]
    assert gate == [("oracle niah_single_number chat", "chat", 0.9)]


def test_results_columns_are_passkey_then_generation_tasks_then_ppl():
    recs = [_rec(m, t, v) for m in ("dense", "oracle") for t, v in (("ppl", 10.0), ("niah_single_number", 1.0),
                                                                    ("passkey", 1.0))]
    md = report.summary_markdown(recs, {})
    assert "| method | passkey @64 | niah_single_number @64 | ppl generate @64 |" in md


def test_leaderboard_ranks_missing_accuracy_and_ppl_last():
    """Sorted by accuracy (high first), then perplexity change (low first): a row without accuracy results comes
    after one that scored 0, and at equal accuracy one without a perplexity change after one with it."""
    recs = [_rec("dense", "passkey", 1.0), _rec("dense", "ppl", 10.0),
            _rec("a", "passkey", 1.0),  # no ppl
            _rec("b", "passkey", 1.0), _rec("b", "ppl", 10.5),  # +5%
            _rec("c", "passkey", 0.0),  # no ppl
            _rec("d", "ppl", 10.1)]  # no accuracy, +1%
    board = report.leaderboard(recs)
    assert [e["label"] for e in board] == ["dense", "b", "a", "c", "d"]
    assert [e["ppl_change"] for e in board] == [pytest.approx(0.0), pytest.approx(5.0), None, None,
                                                pytest.approx(1.0)]


def test_layer_sparsity_mean_is_over_each_records_own_layers():
    """The per-layer table's mean is over the layers a record measured, not over every layer of the table."""
    recs = [_rec("tsa", "ppl", 10.0, variant="prefill", layer_sparsity={"1": 0.5, "2": 0.7}),
            _rec("kascade", "ppl", 11.0, variant="prefill", layer_sparsity={"2": 0.4})]
    md = report.summary_markdown(recs, {})
    assert "| tsa | ppl prefill @64 | 0.600 | 0.500 | 0.700 |" in md
    assert "| kascade | ppl prefill @64 | 0.400 |  | 0.400 |" in md


def test_token_budget_records_do_not_make_budget_fractions_appear():
    """One budget fraction beside a token budget (whose record also carries its fraction k / length): the rows are
    `oracle` and `oracle k=16`, with no `b=` label, since the run swept no budget fractions."""
    recs = [_rec("dense", "passkey", 1.0), _rec("oracle", "passkey", 0.9, budget=0.1),
            _rec("oracle", "passkey", 0.8, budget=0.25, tokens=16)]
    assert [e["label"] for e in report.leaderboard(recs)] == ["dense", "oracle", "oracle k=16"]
    assert "| oracle | 0.90 (9/10) **below dense** |" in report.summary_markdown(recs, {})


def test_gate_and_facts_name_what_the_run_lacks():
    """A run whose only dense result is a perplexity has nothing to check passkey against (not a missing length);
    the ppl window count is a fact only when it differs from --samples."""
    recs = [_rec("dense", "ppl", 10.0), _rec("oracle", "ppl", 11.0), _rec("oracle", "passkey", 0.5)]
    md = report.summary_markdown(recs, {"samples": 4, "ppl_samples": 4})
    assert "- not checked: the run has no dense passkey or generation-task result." in md
    assert "no dense result at the same task and length" not in md and "- ppl windows:" not in md
    assert "- ppl windows: 8\n" in report.summary_markdown(recs, {"samples": 4, "ppl_samples": 8})


def test_depth_tables_show_each_length_and_budget_row():
    """Accuracy by needle depth: one table per length, each row a method and budget, each cell that length's
    record (a sweep over budgets keeps its `b=` rows)."""
    recs = []
    for L, hits in ((64, (3, 4)), (128, (7, 8))):
        for b, h in zip((0.1, 0.2), hits):
            recs.append(_rec("oracle", "passkey", h / 10, budget=b, length=L))
            recs.append(dict(_rec("oracle", "passkey", h / 10, budget=b, length=L), depth=0.5))
    md = report.summary_markdown(recs, {}).split("## Accuracy by needle depth")[1]
    t64, t128 = md.split("Length 64:")[1].split("Length 128:")
    assert "| oracle b=0.1 | 0.30 (3/10) |" in t64 and "| oracle b=0.2 | 0.40 (4/10) |" in t64
    assert "| oracle b=0.1 | 0.70 (7/10) |" in t128 and "| oracle b=0.2 | 0.80 (8/10) |" in t128


def test_sparsity_table_has_each_lengths_own_value():
    recs = [_rec("quest", "ppl", 11.0, variant="decode", sparsity=s, length=L) for L, s in ((64, 0.5), (128, 0.75))]
    table = report.summary_markdown(recs, {}).split("## Achieved sparsity")[1].split("##")[0]
    assert "| method | ppl decode @64 | ppl decode @128 |" in table and "| quest | 0.500 | 0.750 |" in table


def test_parse_bounds_are_inclusive_where_documented():
    """--lengths takes 16 tokens (>= 16), --budgets and EvalSpec.budget take 1.0 (in (0, 1]); one below / above is
    refused naming the value."""
    assert harness.parse_lengths("16,17") == (16, 17)
    with pytest.raises(ValueError, match=r"length 15: expected an integer >= 16 tokens"):
        harness.parse_lengths((15,))
    assert harness.parse_budgets("0.5,1") == (0.5, 1.0)
    assert harness.EvalSpec(methods=("dense",), tasks=("passkey",), lengths=(64,), budget=1.0).validate().budget == 1.0
    with pytest.raises(ValueError, match=r"budget=1.0001: expected a fraction in \(0, 1\]"):
        harness.EvalSpec(methods=("dense",), tasks=("passkey",), lengths=(64,), budget=1.0001).validate()


def test_budget_tokens_refuse_a_fractional_count():
    """A token budget given as a float must be a whole number (2.5 was truncated to 2 tokens)."""
    assert harness.parse_budget_tokens((64.0, 128)) == (64, 128)
    with pytest.raises(ValueError, match=r"budget tokens 2.5: expected a positive integer number of tokens"):
        harness.parse_budget_tokens((2.5,))


def test_spec_validate_names_each_bad_field():
    base = dict(methods=("dense",), tasks=("passkey",), lengths=(64,))
    with pytest.raises(ValueError, match=r"seed=True: expected an integer >= 0"):
        harness.EvalSpec(**base, seed=True).validate()
    # An unused continuation is still recorded in the resume config: it must be a count >= 1.
    with pytest.raises(ValueError, match=r"continuation=0 tokens \(--continuation-tokens\): expected an integer >= 1"):
        harness.EvalSpec(**base, continuation=0).validate()
    with pytest.raises(ValueError,
                       match=r"artifact given for method 'kascade', which is not among the methods \['dense'\]"):
        harness.EvalSpec(**base, artifacts={"kascade": "K"}).validate()
    with pytest.raises(ValueError, match=r"method options given for method 'tsa', which is not among the methods"):
        harness.EvalSpec(**base, method_options={"tsa": {"tau": 0.1}}).validate()
    with pytest.raises(ValueError, match=r"method 'sts' runs perplexity as ppl variants \['prefill', 'continuation'\] "
                                         r"only .*got variants \['decode', 'prefill'\]"):
        harness.EvalSpec(methods=("sts",), tasks=("ppl",), lengths=(64,), draft=object(),
                         ppl_variants=("decode", "prefill")).validate()


def test_make_record_refuses_a_key_outside_the_schema():
    fields = dict(task="ppl", method="dense", length=64, budget=None, metric="perplexity", value=1.0, sparsity=0.0,
                  n=1, variant="decode", depth=None, seconds=1.0)
    assert list(harness.make_record(**fields)) == list(harness.RECORD_KEYS)
    with pytest.raises(KeyError, match=r"record keys \['extra'\] do not match"):
        harness.make_record(**fields, extra=1)


def test_generation_stops_at_the_models_stop_ids(model):
    """An eval completion ends where `jsparse generate` ends it: at the model's stop ids (a GGUF's end-of-turn or
    generation_config.json's) as well as the config's EOS, through the library's own `eos_ids`."""
    import dataclasses

    from jsparse.api import generate_ids

    dense = jsparse.build_method("dense", model)
    prompt = list(range(5, 25))
    free = generate_ids(model, [prompt], max_new_tokens=6)[0]
    stop = next(t for t in free[2:] if t not in free[:2])
    cut = free.index(stop)  # the tokens before the stop id (which the completion leaves out)
    stopped = dataclasses.replace(model, stop_ids=(stop,))
    assert harness.run_generation(stopped, dense, [prompt], 6, rows=1) == \
        harness.run_generation(model, dense, [prompt], cut, rows=1)
    assert harness.run_generation(model, dense, [prompt], 6, rows=1) != \
        harness.run_generation(model, dense, [prompt], cut, rows=1)


def test_units_of_a_chat_run_are_chat_for_the_generation_tasks_only():
    spec = harness.EvalSpec(methods=("dense",), tasks=("passkey", "niah_single_number", "ppl"), lengths=(64,),
                            chat=True, ppl_variants=("decode", "prefill"))
    assert harness._units(spec) == [("passkey", "generate"), ("niah_single_number", "chat"), ("ppl", "decode"),
                                    ("ppl", "prefill")]
    assert harness._units(dataclasses.replace(spec, chat=False))[1] == ("niah_single_number", "generate")


def test_token_budgets_cover_the_generated_tokens(model, test_task, monkeypatch):
    """The token budget's fraction is safe up to the prompt plus the most new tokens any task generates (passkey's
    --new-tokens 5 here, the test task's 3), not up to the prompt alone."""
    seen = []

    class Stop(Exception):
        pass

    def stop(model, spec, methods, max_visible):
        seen.append(max_visible)
        raise Stop

    monkeypatch.setattr(harness, "method_runs", stop)
    spec = harness.EvalSpec(methods=("dense",), tasks=("passkey", TASK), lengths=(64,), samples=1, new_tokens=5,
                            budget_tokens=(16,))
    with pytest.raises(Stop):
        harness.evaluate(model, spec, progress=False)
    assert seen == [64 + 5]


def test_method_option_lists_keep_their_commas_and_methods_are_named_once():
    assert harness.parse_method_options(["tsa.sparse_layers=[1, 2],tsa.tau=0.01"], ("dense", "tsa")) == {
        "tsa": {"sparse_layers": [1, 2], "tau": 0.01}}
    with pytest.raises(ValueError, match=r"methods \['dense', 'oracle', 'dense'\] name a method twice"):
        harness.check_methods(("dense", "oracle", "dense"))


def test_gamma_without_a_draft_is_refused():
    with pytest.raises(ValueError, match=r"--gamma 3 needs --draft"):
        cli_eval.spec_from_args(_parser().parse_args(["eval", "--gamma", "3", "--out", "x"]))


def test_resume_records_this_runs_artifact_for_a_method_the_folder_has_no_records_of(tmp_path):
    """A method the folder names in its config but holds no records of brings this run's artifact: the merged
    config (written to the folder) records the one the new records are made with, not the folder's old one."""
    old = {"seed": 0, "artifacts": {"kascade": "A"}, "method_options": {"kascade": {"min_tokens": 4}}}
    report.write_results(str(tmp_path), [_unit("dense")], dict(config=old))
    new = {"seed": 0, "artifacts": {"kascade": "B"}, "method_options": {"kascade": {"min_tokens": 8}}}
    merged = cli_eval.resume_config(str(tmp_path), new, False, ("dense", "kascade"))[2]
    assert merged["artifacts"] == {"kascade": "B"} and merged["method_options"] == {"kascade": {"min_tokens": 8}}


def test_resume_keeps_only_the_outputs_of_the_units_results_json_holds(model, test_task, tmp_path, monkeypatch):
    """outputs.json entries of a unit results.json does not hold (another configuration's, left by an older
    version) are dropped on resume, a token-budget unit being another unit than a fraction one of the same budget."""
    monkeypatch.setattr(jsparse, "load", lambda spec, dtype=None, **kw: model)
    out = tmp_path / "run"
    argv = ["eval", "--model", "tiny", "--methods", "dense", "--tasks", TASK, "--lengths", "64", "--samples", "2",
            "--out", str(out), "--no-progress", "--no-report"]
    args = _parser().parse_args(argv)
    assert args.func(args) == 0
    outputs = json.loads((out / "outputs.json").read_text())
    assert len(outputs) == 2
    stray = [dict(outputs[0], budget_tokens=16), dict(outputs[0], method="oracle")]
    (out / "outputs.json").write_text(json.dumps(outputs + stray))
    args = _parser().parse_args(argv)
    assert args.func(args) == 0  # nothing left to run
    assert json.loads((out / "outputs.json").read_text()) == outputs


def test_portable_path_keeps_a_sibling_of_the_root_that_shares_its_prefix():
    from jsparse.provenance import INSTALL_ROOT

    sibling = INSTALL_ROOT + "_other" + os.sep + "corpus.txt"
    assert cli_eval.portable_path(sibling) == sibling
    assert cli_eval.portable_path(os.path.join(INSTALL_ROOT, "eval", "x.txt")) == os.path.join("eval", "x.txt")


def test_dense_ppl_cell_shows_no_change_against_itself():
    """The perplexity change is a method's against dense: dense's own cell is its perplexity alone (mutation
    `if dense is not None and r["method"] != "dense"` -> `if dense is not None` in report._cell survived)."""
    md = report.summary_markdown([_rec("dense", "ppl", 12.34), _rec("oracle", "ppl", 12.5)], {})
    assert "| dense | 12.340 |" in md and "| oracle | 12.500 (+1.3%) |" in md


def test_gate_says_passkey_only_when_every_accuracy_result_is_passkey():
    """A run with passkey and a generation task, nothing below dense: the gate's 'none' line does not claim the check
    was of passkey alone (mutation `all(` -> `any(` survived); budgets are listed ascending."""
    t = "niah_single_number"
    mixed = [_rec(m, task, 1.0, budget=b) for m, b in (("dense", None), ("oracle", 0.5), ("oracle", 0.05))
             for task in ("passkey", t)]
    md = report.summary_markdown(mixed, {})
    assert "- none: every method scores at least dense's.\n" in md and "dense's passkey" not in md
    assert "- budget: 0.05, 0.5\n" in md
    only_passkey = [r for r in mixed if r["task"] == "passkey"]
    assert "- none: every method scores at least dense's passkey." in report.summary_markdown(only_passkey, {})


def test_acceptance_rate_of_zero_is_shown():
    """A speculative run whose drafts were all rejected has acceptance rate 0.0: a value, not a blank (mutation
    `r.get("acceptance_rate") is not None` -> `r.get("acceptance_rate")` dropped the table)."""
    recs = [_rec("dense", "passkey", 1.0, acceptance_rate=0.0), _rec("oracle", "passkey", 1.0, acceptance_rate=0.25)]
    table = report.summary_markdown(recs, {}).split("## Speculative decoding acceptance rate")[1].split("##")[0]
    assert "| dense | 0.000 |" in table and "| oracle | 0.250 |" in table


def test_depth_tables_list_only_methods_with_depth_results():
    """A method with no needle-depth record (ppl only) has no row in the depth table (mutation dropping
    `if any((m, d) in cell for d in depths)` left an empty row)."""
    recs = [_rec("oracle", "passkey", 0.5), dict(_rec("oracle", "passkey", 0.5), depth=0.5),
            _rec("quest", "ppl", 11.0)]
    table = report.summary_markdown(recs, {}).split("## Accuracy by needle depth")[1]
    assert "| oracle | 0.50 (5/10) |" in table and "| quest |" not in table


def test_read_results_refuses_a_file_without_records_and_reads_version_1_meta(tmp_path):
    """A version-2 file must hold a list of records (ValueError, not a KeyError later); a version-1 file (a bare list)
    takes its meta from run.json beside it (mutations dropping either survived)."""
    (tmp_path / "results.json").write_text(json.dumps({"schema_version": 2, "meta": {}}))
    with pytest.raises(ValueError, match="schema_version 2 without a list of records"):
        report.read_results(str(tmp_path))
    recs = [_rec("dense", "passkey", 1.0)]
    (tmp_path / "results.json").write_text(json.dumps(recs))
    (tmp_path / "run.json").write_text(json.dumps({"model": "m", "command": "jsparse eval x"}))
    data = report.read_results(str(tmp_path))
    assert data == {"schema_version": 1, "meta": {"model": "m", "command": "jsparse eval x"}, "runs": [],
                    "records": recs}


def test_leaderboard_task_columns_put_passkey_first():
    """Leaderboard columns: passkey, then the generation tasks alphabetically (mutation to a plain alphabetical sort
    put niah_multikey first)."""
    recs = [_rec("dense", t, 1.0) for t in ("passkey", "vt", "niah_multikey")]
    header = report.leaderboard_markdown(recs)[0]
    assert "| mean accuracy | passkey | niah_multikey | vt | ppl change |" in header


def test_plots_draw_the_documented_values(tmp_path, monkeypatch):
    """The plots' data: dense's band is +- one binomial standard error, the ppl panel's y is the change against dense
    in percent (a variant without dense gets no panel), a method without sparsity is named in the caption, and a
    depth heatmap cell is the sample-weighted mean over the needle tasks."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    seen = {"span": [], "plot": [], "imshow": []}
    for name, key in (("axhspan", "span"), ("plot", "plot"), ("imshow", "imshow")):
        orig = getattr(Axes, name)
        monkeypatch.setattr(Axes, name, lambda self, *a, _o=orig, _k=key, **kw: (seen[_k].append((a, kw)),
                                                                                 _o(self, *a, **kw))[1])
    (tmp_path / "plots").mkdir()
    acc = [_rec("dense", "passkey", 0.8, n=25), _rec("oracle", "passkey", 0.6, sparsity=0.5, budget=0.5),
           _rec("streaming", "passkey", 0.4, budget=0.5)]
    (_, caption), = report.plot_accuracy_vs_sparsity(acc, str(tmp_path))
    (lo, hi), = [a[:2] for a, _ in seen["span"]]
    assert (lo, hi) == (pytest.approx(0.8 - 0.08), pytest.approx(0.8 + 0.08))  # sqrt(0.8 * 0.2 / 25)
    assert caption.endswith("not plotted (no sparsity reported): streaming")
    seen["plot"].clear()
    ppl = [_rec("dense", "ppl", 10.0, variant="decode"), _rec("quest", "ppl", 12.5, variant="decode", sparsity=0.5),
           _rec("quest", "ppl", 11.0, variant="prefill", sparsity=0.5)]  # no dense prefill: no panel
    assert len(report.plot_ppl_vs_sparsity(ppl, str(tmp_path))) == 1
    (xs, ys), = [a for a, kw in seen["plot"] if kw.get("label") == "quest"]
    assert xs == [0.5] and ys == [pytest.approx(25.0)]
    depth = [dict(_rec("oracle", "passkey", 1.0, n=30), depth=0.5),
             dict(_rec("oracle", "niah_single_number", 0.0, n=10), depth=0.5)]
    report.plot_depth_heatmaps(depth, str(tmp_path))
    (data,), _ = seen["imshow"][-1]
    assert data == [[pytest.approx(0.75)]]  # (30 * 1.0 + 10 * 0.0) / 40


def test_run_coref_under_dense_is_the_greedy_continuation_of_each_prompt(model):  # noqa: F811
    """run_coref (prefill the context, decode the question token by token, then generate) under dense gives each
    prompt's greedy continuation, one completion per prompt (a padded last batch adds none)."""
    dense = jsparse.build_method("dense", model)
    prompts = coref.make_prompts(model.tokenizer, 256, 3, seed=1)
    got = coref.run_coref(model, dense, prompts, new_tokens=3, rows=2)
    want = [harness.run_generation(model, dense, [p.tokens.tolist()], 3, rows=1)[0] for p in prompts]
    assert got == want and any(got)


def test_a_damaged_folder_is_named_before_the_work(model, test_task, tmp_path, monkeypatch, capsys):
    """What a resume meets in a damaged --out: a cut results.json or outputs.json, entries of the wrong shape, a file
    of the run that is a folder (its rewrite failed after the first unit, also with --overwrite), a deleted
    outputs.json (its completions lost without a word): each named, the folder's files before the model loads.
    --overwrite removes the discarded run's report and plots; an interrupt ends in one line (exit status 130)."""
    loads = []
    monkeypatch.setattr(jsparse, "load", lambda spec, dtype=None, **kw: loads.append(spec) or model)
    out = tmp_path / "run"
    argv = ["eval", "--model", "tiny", "--methods", "dense", "--tasks", f"{TASK},ppl", "--lengths", "64",
            "--samples", "2", "--ppl-variants", "prefill", "--out", str(out), "--no-progress", "--no-report"]

    def run(*extra):
        args = _parser().parse_args(argv + list(extra))
        return args.func(args)
    assert run() == 0
    good = {name: (out / name).read_text() for name in ("results.json", "outputs.json")}

    def damaged(name, text, match):
        for n, t in good.items():
            (out / n).write_text(t)
        (out / name).write_text(text)
        with pytest.raises(ValueError, match=match):
            run()
    cut = good["results.json"][:len(good["results.json"]) // 2]
    damaged("results.json", cut, r"results.json is not valid JSON \(.*\): a damaged file; pass --overwrite")
    data = json.loads(good["results.json"])
    damaged("results.json", json.dumps(dict(data, records=data["records"] + [1])),
            rf"results.json entry {len(data['records'])} is 1: expected an object with the keys method, budget, task, length, variant")
    no_variant = [{k: v for k, v in r.items() if k != "variant"} for r in data["records"]]
    damaged("results.json", json.dumps(dict(data, records=no_variant)), r"entry 0 .* \(missing \['variant'\]\)")
    damaged("outputs.json", "not json", r"outputs.json is not valid JSON .*; pass --overwrite or another --out")
    damaged("outputs.json", '{"a": 1}', r"outputs.json holds a dict where a list of entries was expected")
    (out / "outputs.json").write_text(good["outputs.json"])
    for name in ("outputs.json", "run.json", "results.json"):
        moved = out / f"{name}.aside"
        os.replace(out / name, moved)
        (out / name).mkdir()
        loads.clear()
        for extra in ((), ("--overwrite",)):
            with pytest.raises(ValueError, match=f"{name} is a folder, where the run writes its {name} file"):
                run(*extra)
        assert loads == []  # before the model loads
        (out / name).rmdir()
        os.replace(moved, out / name)
    os.remove(out / "outputs.json")
    with pytest.warns(UserWarning, match=r"outputs.json holds no completions of 1 unit\(s\) whose records "
                                         r"results.json keeps .*--overwrite reruns them"):
        assert run() == 0
    (out / "report.md").write_text("the discarded run's")
    (out / "plots").mkdir()
    (out / "plots" / "depth_heatmap_quest.png").write_bytes(b"png")
    assert run("--overwrite") == 0
    assert not (out / "report.md").exists() and not (out / "plots").exists()
    assert len(json.loads((out / "outputs.json").read_text())) == 2

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(harness, "evaluate", interrupted)
    capsys.readouterr()
    assert run("--overwrite") == 130
    assert (f"jsparse eval: interrupted; the finished units' records are in {out / 'results.json'}: run the same "
            "command again to resume") in capsys.readouterr().err


def test_demo_refuses_lengths_its_perplexity_cannot_score():
    """The demo scores the last 512 tokens of each perplexity window: a shorter length was refused by eval with a
    message about a continuation option the demo does not have."""
    from eval.demo import demo_argv

    with pytest.raises(ValueError, match=r"--lengths 2048,256: 256 tokens is too short for the demo, whose perplexity "
                                         r"scores the last 512 tokens .*expected lengths >= 514"):
        demo_argv("out", "2048,256")
    assert "514" in demo_argv("out", "514")

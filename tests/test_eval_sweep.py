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


def test_sweep_resumes_where_it_stopped(model, corpus, test_task, tmp_path, monkeypatch):
    monkeypatch.setattr(jsparse, "load", lambda spec, dtype=None: model)
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
    with pytest.raises(KeyboardInterrupt):
        args.func(args)
    first = json.loads((out / "results.json").read_text())
    done = {harness.record_key(r) for r in first["records"]}
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
    outputs = json.loads((out / "outputs.json").read_text())  # the rerun's completions (2 samples per unit)
    assert len(outputs) == 2 * sum(1 for u in units - done if u[3] == TASK)
    assert all(o["task"] == TASK and len(o["answers"]) == 2 and o["score"] in (0.0, 0.5, 1.0) for o in outputs)

    # A third run has nothing left to do; another configuration is refused before any work.
    calls.clear()
    args = _parser().parse_args(argv)
    assert args.func(args) == 0 and calls == []
    assert json.loads((out / "results.json").read_text())["records"] == data["records"]
    args = _parser().parse_args(argv + ["--seed", "2"])
    with pytest.raises(ValueError, match=r"was run with seed=0, this run has seed=2: .*--overwrite"):
        args.func(args)
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
])
def test_bad_budgets_fail_before_loading(extra, match, tmp_path, monkeypatch):
    monkeypatch.setattr(jsparse, "load", lambda *a, **k: pytest.fail("the model must not be loaded"))
    args = _parser().parse_args(["eval", "--out", str(tmp_path / "x"), "--no-progress"] + extra)
    with pytest.raises(ValueError, match=match):
        args.func(args)
    assert not os.path.exists(tmp_path / "x")


def test_resume_refuses_a_version_1_results_file(tmp_path):
    (tmp_path / "results.json").write_text("[]")
    with pytest.raises(ValueError, match="schema version 1 .*--overwrite"):
        cli_eval.resume_config(str(tmp_path), {"seed": 0}, overwrite=False)
    assert cli_eval.resume_config(str(tmp_path), {"seed": 0}, overwrite=True) == ([], [], {"seed": 0})

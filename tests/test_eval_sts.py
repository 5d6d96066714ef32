"""`jsparse eval` with a draft: passkey and the generation tasks by speculative decoding (acceptance rate in the
records, each prompt stopping at its own token count), STS next to dense on identical prompts (full budget: the
answers of dense without a draft, the same perplexity), the command with a draft and RULER tasks, and the spec's
errors."""

import argparse
import dataclasses
import json

import numpy as np
import pytest

import jsparse
from eval import cli_eval, harness
from eval.report import summary_markdown
from jsparse.api import keep_layers
from test_eval import corpus, model, tokenizer  # noqa: F401  (fixtures)
from test_eval_sweep import TASK, test_task  # noqa: F401  (fixture)


def test_eval_sts_full_budget_matches_dense(model, corpus):  # noqa: F811
    draft = keep_layers(model, [0])
    cfg = model.cfg
    head_map = np.stack(np.meshgrid(np.zeros(cfg.num_layers, int), np.arange(cfg.num_heads), indexing="ij"), -1)
    spec = harness.EvalSpec(methods=("dense", "sts"), tasks=("passkey", "ppl"), lengths=(160,), samples=2,
                            corpus=corpus, ppl_variants=("prefill", "continuation"), continuation=37, new_tokens=6,
                            draft=draft, gamma=2, budget=1.0,
                            method_options={"sts": {"head_map": head_map, "tile": 16}})
    run = harness.evaluate(model, spec, progress=False)
    main = {(r["method"], r["task"], r["variant"]): r for r in run.records if r["depth"] is None}
    for m in ("dense", "sts"):
        rate = main[(m, "passkey", "generate")]["acceptance_rate"]
        assert rate is not None and 0.0 <= rate <= 1.0
        assert main[(m, "ppl", "prefill")]["acceptance_rate"] is None
    for variant in ("prefill", "continuation"):  # STS-P; STS-D as teacher-forced rounds (37 = 12 rounds of 3, + 1)
        np.testing.assert_allclose(main[("sts", "ppl", variant)]["value"], main[("dense", "ppl", variant)]["value"],
                                   rtol=1e-4)
    answers = {m: [o["completion"] for o in run.outputs if o["method"] == m] for m in ("dense", "sts")}
    assert answers["sts"] == answers["dense"]
    assert "acceptance rate" in summary_markdown(run.records)


def test_eval_sts_spec_errors(model):  # noqa: F811
    with pytest.raises(ValueError, match="needs a draft model"):
        harness.EvalSpec(methods=("sts",), tasks=("passkey",)).validate()
    with pytest.raises(ValueError, match="ppl variants \\['prefill', 'continuation'\\] only"):
        harness.EvalSpec(methods=("sts",), tasks=("ppl",), draft=model).validate()
    with pytest.raises(ValueError, match="gamma=0"):
        harness.EvalSpec(methods=("dense",), gamma=0).validate()


def _sts_options(model):
    cfg = model.cfg
    head_map = np.stack(np.meshgrid(np.zeros(cfg.num_layers, int), np.arange(cfg.num_heads), indexing="ij"), -1)
    return {"sts": {"head_map": head_map, "tile": 16}}  # at the run's budget=1.0 (a budget option is refused)


def test_eval_generation_tasks_with_draft_equal_dense_without(model, test_task):  # noqa: F811
    """A RULER task (niah_single_number, 12 tokens), the ragged test task (3 tokens) and passkey (6 tokens) in shared
    speculative generate calls: full-budget STS and dense answer exactly as dense without a draft, and every
    generation record carries its acceptance rate."""
    tasks = ("passkey", "niah_single_number", TASK)
    spec = harness.EvalSpec(methods=("dense", "sts"), tasks=tasks, lengths=(320,), samples=2, new_tokens=6,
                            draft=keep_layers(model, [0]), gamma=2, budget=1.0, method_options=_sts_options(model))
    run = harness.evaluate(model, spec, progress=False)
    plain = harness.evaluate(model, dataclasses.replace(spec, methods=("dense",), draft=None, method_options={}),
                             progress=False)
    completions = lambda r, m, t: [o["completion"] for o in r.outputs if o["method"] == m and o["task"] == t]  # noqa: E731
    for task in tasks:
        reference = completions(plain, "dense", task)
        assert len(reference) == 2
        assert completions(run, "sts", task) == completions(run, "dense", task) == reference, task
    assert any(completions(plain, "dense", t) != [""] * 2 for t in tasks)
    main = {(r["method"], r["task"]): r for r in run.records if r["depth"] is None}
    ref = {(r["method"], r["task"]): r for r in plain.records if r["depth"] is None}
    for task in tasks:
        assert ref[("dense", task)]["acceptance_rate"] is None
        for m in ("dense", "sts"):
            rate = main[(m, task)]["acceptance_rate"]
            assert rate is not None and 0.0 <= rate <= 1.0, (m, task)
            assert main[(m, task)]["value"] == ref[("dense", task)]["value"]
    table = summary_markdown(run.records).split("## Speculative decoding acceptance rate")[1]
    assert "niah_single_number @320" in table and f"{TASK} @320" in table and "passkey @320" in table


def test_speculative_generation_stops_each_row_at_its_own_count(model):  # noqa: F811
    """run_generation with a draft: ragged prompts with their own token counts in one batch give the completions
    of plain greedy decoding, and a row's rounds count its own tokens only (1 token: the prefill's, no round)."""
    rng = np.random.default_rng(3)
    prompts = [tuple(int(t) for t in rng.integers(2, len(model.tokenizer), n)) for n in (40, 37, 33)]
    new = [1, 4, 7]
    dense = jsparse.build_method("dense", model)
    stats = {}
    spec = harness.run_generation(model, dense, prompts, new, rows=3, width=48, max_new_tokens=9,
                                  draft=keep_layers(model, [0]), gamma=2, stats=stats)
    assert spec == harness.run_generation(model, dense, prompts, new, rows=3, width=48, max_new_tokens=9)
    assert stats["gamma"] == 2 and len(stats["rounds"]) == len(stats["accepted"]) == 3
    assert stats["rounds"][0] == stats["accepted"][0] == 0
    for n, r, a in zip(new[1:], stats["rounds"][1:], stats["accepted"][1:]):  # each round emits 1 .. gamma + 1
        assert -(-(n - 1) // 3) <= r <= n - 1 and 0 <= a <= 2 * r
    assert harness.acceptance_rate(stats) == sum(stats["accepted"]) / (2 * sum(stats["rounds"]))
    assert harness.acceptance_rate({}) is None


def test_eval_command_accepts_draft_with_ruler_tasks(model, tmp_path, monkeypatch):  # noqa: F811
    draft = keep_layers(model, [0])
    monkeypatch.setattr(jsparse, "load", lambda spec, dtype=None, **kw: draft if spec == "tiny:draft" else model)
    parser = argparse.ArgumentParser(prog="jsparse")
    cli_eval.add_eval_parser(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "run"
    args = parser.parse_args(["eval", "--model", "tiny", "--draft", "tiny:draft", "--gamma", "3", "--methods", "dense",
                              "--tasks", "coref", "--lengths", "256", "--samples", "1", "--out", str(out),
                              "--no-progress", "--no-report"])
    spec = cli_eval.spec_from_args(args)
    assert spec.tasks == ("coref",) and spec.draft is not None and spec.gamma == 3
    every = "passkey,niah_single_number,niah_multikey,niah_multivalue,niah_multiquery,vt,cwe,fwe,coref,ppl"
    assert cli_eval.spec_from_args(argparse.Namespace(**{**vars(args), "tasks": every})).tasks == tuple(every.split(","))
    assert cli_eval.spec_from_args(argparse.Namespace(**{**vars(args), "gamma": None})).gamma == 4
    with pytest.raises(ValueError, match="--gamma 3 needs --draft"):
        cli_eval.spec_from_args(argparse.Namespace(**{**vars(args), "draft": None}))
    assert args.func(args) == 0
    records = json.loads((out / "results.json").read_text())["records"]
    assert [(r["task"], r["n"]) for r in records if r["depth"] is None] == [("coref", 1)]
    assert 0.0 <= records[0]["acceptance_rate"] <= 1.0


def test_eval_command_records_gamma_only_with_a_draft(model, tmp_path, monkeypatch):  # noqa: F811
    """--gamma is what ran, recorded only where a draft ran: results.json's meta and its resume config carry the
    given gamma with --draft (so a resume with another gamma is refused) and gamma None without one (a run without
    a draft decodes no speculative rounds; its default 4 in the spec is not a configuration, and folders written
    without a draft must keep resuming). (--gamma without --draft is refused: test above.)"""
    draft = keep_layers(model, [0])
    monkeypatch.setattr(jsparse, "load", lambda spec, dtype=None, **kw: draft if spec == "tiny:draft" else model)
    parser = argparse.ArgumentParser(prog="jsparse")
    cli_eval.add_eval_parser(parser.add_subparsers(dest="command", required=True))
    base = ["eval", "--model", "tiny", "--methods", "dense", "--tasks", "passkey", "--lengths", "160", "--samples",
            "1", "--new-tokens", "4", "--no-progress", "--no-report"]
    with_draft = ["--draft", "tiny:draft", "--gamma", "3"]

    def config(*extra):
        return cli_eval.run_config(cli_eval.spec_from_args(parser.parse_args(base + ["--out", "x", *extra])), "m",
                                   None)

    assert config()["gamma"] is None and config()["draft"] is None
    assert config(*with_draft)["gamma"] == 3 and config("--draft", "tiny:draft")["gamma"] == 4
    for extra, gamma in ((with_draft, 3), ([], None)):
        out = tmp_path / f"gamma{gamma}"
        args = parser.parse_args(base + ["--out", str(out), *extra])
        assert args.func(args) == 0
        meta = json.loads((out / "results.json").read_text())["meta"]
        assert meta["gamma"] == meta["config"]["gamma"] == gamma
        assert (meta["draft"] is None) == (gamma is None)
    first = json.loads((tmp_path / "gamma3" / "results.json").read_text())["meta"]["config"]
    with pytest.raises(ValueError, match="was run with gamma=3, this run has gamma=5"):
        cli_eval.resume_config(str(tmp_path / "gamma3"), {**first, "gamma": 5}, False, ("dense",))

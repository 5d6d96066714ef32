"""The eval harness's "continuation" perplexity, fixed token budgets, measured per-layer sparsity (TSA),
method options and composed-method artifacts.

Runs on the tiny random Llama (2 layers) and tokenizer of tests/test_eval.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from eval import cli_eval, harness, ppl, report
from jsparse import selection as sel
from jsparse.artifacts import Artifact, save_artifact
from jsparse.methods.kascade import Kascade, roles_from_anchors
from jsparse.methods.tsa import TSA
from models import llama
from models.cache import init_cache
from test_eval import _direct_nll, corpus, model, tokenizer  # noqa: F401  (fixtures)

# A TSA that drops tokens at T = 96 on the tiny model: layer 1 sparse (layer 0 is dense).
TSA_OPTIONS = dict(tau=0.3, window=8, min_tokens=8, pool_kernel=3)


def _windows(model, corpus, length=96, samples=3, seed=3):
    ids = ppl.tokenize_corpus(model.tokenizer, ppl.read_corpus(corpus))
    return ppl.make_windows(model.tokenizer, ids, length, samples, seed=seed)


def test_continuation_of_dense_equals_decode_and_prefill(model, corpus):
    w = _windows(model, corpus)
    T, C = w.shape[1], 20
    dense = jsparse.build_method("dense", model)
    # chunks of 8 over the 20 continuation tokens: 8, 8, 4
    got = ppl.continuation_nll(model.params, model.cfg, dense, w, C, chunk=8)
    assert got.shape == (3, C)
    full = _direct_nll(model, w)  # f64[B, T - 1]: NLL of tokens 1..T-1
    np.testing.assert_allclose(got, full[:, T - C - 1:], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got, ppl.decode_nll(model.params, model.cfg, dense, w, chunk=32)[:, T - C - 1:],
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got, ppl.prefill_nll(model.params, dense, jnp.asarray(w), cfg=model.cfg)[:, T - C - 1:],
                               rtol=1e-4, atol=1e-4)
    for bad in (0, T - 1, 2.5):
        with pytest.raises(ValueError, match=r"continuation=.* expected an integer in \[1, 94\]"):
            ppl.continuation_nll(model.params, model.cfg, dense, w, bad)


def test_continuation_of_tsa_is_its_prefill_then_its_decode(model, corpus):
    w = _windows(model, corpus)
    B, T = w.shape
    C, P = 20, w.shape[1] - 20
    tsa = TSA(**TSA_OPTIONS)
    cfg, params = model.cfg, model.params
    got, state = ppl.continuation_nll(params, cfg, tsa, w, C, chunk=8, return_state=True)
    # By hand: one prefill of the first P tokens into a cache of T, then one decode call of the last C tokens.
    cache = init_cache(cfg, B, T, jnp.float32)
    logits0, cache, st = llama.prefill(params, cfg, tsa, jnp.asarray(w[:, :P]), jnp.full((B,), P, jnp.int32), cache,
                                       tsa.init_state(cfg, B, T))
    logits1, _, _ = llama.decode(params, cfg, tsa, jnp.asarray(w[:, P:]), cache, st)
    logits = np.concatenate([np.asarray(logits0)[:, None], np.asarray(logits1)[:, :-1]], axis=1)  # [B, C, V]
    logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    want = -np.take_along_axis(np.asarray(logp), w[:, P:, None], axis=-1)[..., 0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # chunk >= C: the prefill and the decode as one compiled function (continuation_one_nll), the same numbers.
    one, one_state = ppl.continuation_nll(params, cfg, tsa, w, C, chunk=C, return_state=True)
    np.testing.assert_allclose(one, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(one_state.kept), np.asarray(state.kept))
    # TSA really dropped tokens in layer 1 (so this is not dense by accident) and its prefill changed the NLLs.
    kept = np.asarray(state.kept)
    assert (kept[0] == P).all() and (kept[1] < P).all()
    measured = tsa.prefill_layer_sparsity(cfg, state, np.full((B,), P))
    assert list(measured) == [1]
    fill = np.asarray([sum(min(tsa.local_window + tsa.local_sinks, j) for j in range(K + 1, P + 1)) for K in kept[1]])
    np.testing.assert_allclose(measured[1], 1 - (kept[1] * (kept[1] + 1.0) / 2 + fill) / (P * (P + 1.0) / 2))
    dense = ppl.continuation_nll(params, cfg, jsparse.build_method("dense", model), w, C, chunk=8)
    assert np.abs(got - dense).max() > 1e-3


def test_harness_continuation_records_and_layer_sparsity(model, corpus, tmp_path):
    spec = harness.EvalSpec(methods=("dense", "tsa"), tasks=("passkey", "ppl"), lengths=(96,), samples=3,
                            seed=3, corpus=corpus, ppl_variants=("continuation", "prefill", "decode"),
                            continuation=20, chunk=8, max_batch_tokens=192, new_tokens=2,
                            method_options={"tsa": TSA_OPTIONS})
    run = harness.evaluate(model, spec, progress=False)
    rec = {(r["method"], r["task"], r["variant"]): r for r in run.records if r["depth"] is None}
    w = _windows(model, corpus)
    tsa = TSA(**TSA_OPTIONS)
    nll, state = ppl.continuation_nll(model.params, model.cfg, tsa, w, 20, chunk=8, return_state=True)
    r = rec[("tsa", "ppl", "continuation")]
    assert r["n"] == 3 and r["budget_tokens"] is None
    np.testing.assert_allclose(r["value"], ppl.perplexity(nll), rtol=1e-5)
    # Sparsity measured on the prefill of the first 76 tokens, per row, averaged over the 3 windows.
    want = float(np.mean(tsa.prefill_layer_sparsity(model.cfg, state, np.full((3,), 76))[1]))
    assert set(r["layer_sparsity"]) == {"1"} and want > 0.01  # a lower bound: fill="local" rows counted at most
    np.testing.assert_allclose(r["layer_sparsity"]["1"], want, rtol=1e-9)
    np.testing.assert_allclose(r["sparsity"], want / 2)  # over both layers, layer 0 dense
    # The prefill variant measures the whole window (96 tokens: more to drop), the passkey its prompts.
    for key in (("tsa", "ppl", "prefill"), ("tsa", "passkey", "generate")):
        assert set(rec[key]["layer_sparsity"]) == {"1"} and rec[key]["layer_sparsity"]["1"] > 0.0
    # The passkey's comes from the generate call's own prefill: the same as a standalone prefill of its prompts.
    from eval import passkey
    from jsparse.methods.common import prefill_state

    prompts = np.stack([p.tokens for p in passkey.make_prompts(model.tokenizer, 96, 3, 3, spec.depths)])
    alone = prefill_state(model.params, model.cfg, tsa, prompts, np.full((3,), 96))
    want = float(np.mean(tsa.prefill_layer_sparsity(model.cfg, alone, np.full((3,), 96))[1]))
    np.testing.assert_allclose(rec[("tsa", "passkey", "generate")]["layer_sparsity"]["1"], want, rtol=1e-9)
    assert rec[("tsa", "ppl", "decode")]["layer_sparsity"] is None  # no prefill in the decode variant
    assert all(rec[("dense",) + k[1:]]["layer_sparsity"] is None for k in rec if k[0] == "tsa")
    # Dense: continuation perplexity of the last 20 tokens from the full-window NLLs.
    np.testing.assert_allclose(rec[("dense", "ppl", "continuation")]["value"],
                               np.exp(_direct_nll(model, w)[:, -20:].mean()), rtol=1e-4)
    md = report.summary_markdown(run.records, {"ppl_variants": ["continuation"], "continuation": 20})
    assert "ppl continuation @96" in md and "## Prefill attention-map sparsity per sparse layer" in md
    assert "| tsa | ppl continuation @96 |" in md and "continuation tokens: 20" in md
    report.write_results(str(tmp_path), run.records)
    assert json.loads((tmp_path / "results.json").read_text())["records"][0]["layer_sparsity"] is None
    # With a draft the prefill's state is not handed back: TSA's passkey sparsity is not reported (it was its
    # decode rule, 0.0, though the prefill stayed sparse).
    from jsparse.api import keep_layers

    drafted = harness.evaluate(model, dataclasses.replace(spec, tasks=("passkey",), draft=keep_layers(model, [0]),
                                                          gamma=2), progress=False)
    (tsa_passkey,) = [r for r in drafted.records if r["method"] == "tsa" and r["depth"] is None]
    assert tsa_passkey["sparsity"] is None and tsa_passkey["layer_sparsity"] is None
    assert tsa_passkey["acceptance_rate"] is not None


def test_a_per_depth_record_carries_its_own_acceptance_rate():
    """Each record's acceptance rate is over its own prompts' rounds: a depth's, not every depth's."""
    recs = harness._score_records("passkey", "accuracy", [1.0, 0.0, 1.0, 1.0], [0.2, 0.8, 0.2, 0.8], 1.0, "generate",
                                  lambda idx: float(sum(idx)), method="m", length=64, budget=None, sparsity=0.5,
                                  layer_sparsity={"1": 0.5})
    got = {r["depth"]: (r["acceptance_rate"], r["value"], r["sparsity"], r["layer_sparsity"]) for r in recs}
    assert got == {None: (6.0, 0.75, 0.5, {"1": 0.5}), 0.2: (2.0, 1.0, 0.5, None), 0.8: (4.0, 0.5, 0.5, None)}


# ------------------------------------------------------------------------------------------------ token budgets


def test_token_budget_options_give_k_min_n_p(model):
    oracle = jsparse.build_method("oracle", model)
    for tokens, max_visible in ((16, 72), (512, 4104), (1000, 4104), (100, 4096 + 8), (300, 301)):
        opts = harness.token_budget_options(oracle, tokens, max_visible)
        assert set(opts) == {"budget", "min_tokens"} and opts["min_tokens"] == tokens
        n = np.arange(1, max_visible + 1)
        want = np.minimum(tokens, n)
        assert [sel.budget_tokens(opts["budget"], int(i), tokens) for i in n] == want.tolist()
        np.testing.assert_array_equal(sel.budget_tokens(opts["budget"], jnp.asarray(n, jnp.int32), tokens), want)
    assert harness.token_budget_options(oracle, 600, 500) == {"budget": 1.0, "min_tokens": 600}
    evo = jsparse.build_method("sink-local", model)
    assert harness.token_budget_options(evo, 512, 4104) == {"budget_tokens": 512}
    assert harness.token_budget_options(jsparse.build_method("dense", model), 512, 4104) == {}
    assert harness.token_budget_options(TSA(), 512, 4104) == {}
    # Kascade's reuse layers keep N too (reuse_scale 2 kept up to 2N at the longest lengths): reuse_scale 1
    for kascade in (Kascade(), Kascade, TSA(inner=Kascade(), selection="kv_head")):
        opts = harness.token_budget_options(kascade, 512, 4104)
        assert set(opts) == {"budget", "min_tokens", "reuse_scale"} and opts["reuse_scale"] == 1.0
        built = Kascade(budget=opts["budget"], min_tokens=512, reuse_scale=opts["reuse_scale"])
        assert built.k_reuse(4104) == 512 and Kascade(budget=opts["budget"], min_tokens=512,
                                                        reuse_scale=2.0).k_reuse(4104) > 512


def _parser():
    parser = argparse.ArgumentParser(prog="jsparse")
    cli_eval.add_eval_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def test_eval_command_budget_tokens(model, corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(jsparse, "load", lambda spec, dtype=None, **kwargs: model)
    out = tmp_path / "run"
    args = _parser().parse_args(
        ["eval", "--model", "tiny", "--methods", "dense,oracle,sink-local", "--tasks", "ppl", "--lengths", "64",
         "--budget-tokens", "16,32", "--samples", "1", "--corpus", corpus, "--ppl-variants", "decode",
         "--chunk", "64", "--out", str(out), "--no-progress"])
    assert args.func(args) == 0
    records = json.loads((out / "results.json").read_text())["records"]
    got = sorted((r["method"], r["budget_tokens"]) for r in records)
    assert got == [("dense", None), ("oracle", 16), ("oracle", 32), ("sink-local", 16), ("sink-local", 32)]
    by = {(r["method"], r["budget_tokens"]): r for r in records}
    assert by[("oracle", 16)]["sparsity"] > by[("oracle", 32)]["sparsity"] > 0.0  # a smaller budget skips more
    assert by[("oracle", 16)]["value"] != by[("oracle", 32)]["value"]
    assert by[("sink-local", 16)]["budget"] == 16 / 64  # evosparse: budget_tokens = 16 of the 64 visible keys
    assert by[("dense", None)]["budget"] is None  # dense takes no budget
    assert 0.0 < by[("oracle", 16)]["budget"] <= 16 / 64
    summary = (out / "summary.md").read_text()
    assert "| oracle k=16 |" in summary and "| sink-local k=32 |" in summary and "budget tokens: 16, 32" in summary
    assert json.loads((out / "run.json").read_text())["budget_tokens"] == [16, 32]
    for bad, match in (("0", "budget tokens '0'"), ("16,abc", "budget tokens 'abc'"), ("16,16", "twice"),
                       (" ", "--budget-tokens ' ': expected token budgets")):
        with pytest.raises(ValueError, match=match):
            harness.parse_budget_tokens(bad)
    with pytest.raises(ValueError, match="--budgets '': expected budget fractions"):
        harness.parse_budgets("")
    assert harness.parse_budgets(None) is None and harness.parse_budget_tokens(None) is None


# ------------------------------------------------------------------------------------------------ options, artifacts


def test_method_options(model):
    methods = ("dense", "tsa")
    assert harness.parse_method_options(["tsa.tau=0.01", "tsa.window=16,tsa.selection=kv_head"], methods) == {
        "tsa": {"tau": 0.01, "window": 16, "selection": "kv_head"}}
    with pytest.raises(ValueError, match="expected METHOD.OPTION=VALUE"):
        harness.parse_method_options(["tau=0.01"], methods)
    with pytest.raises(ValueError, match="names method 'quest', which is not in --methods"):
        harness.parse_method_options(["quest.page_size=8"], methods)
    spec = harness.EvalSpec(methods=methods, method_options={"tsa": {"tau": 0.01}})
    assert harness.build_methods(model, spec)["tsa"].tau == 0.01
    with pytest.raises(ValueError, match="method 'tsa' has no option 'nosuch'"):
        harness.build_methods(model, harness.EvalSpec(methods=methods, method_options={"tsa": {"nosuch": 1}}))
    with pytest.raises(ValueError, match=r"tau=1\.5"):
        harness.build_methods(model, harness.EvalSpec(methods=methods, method_options={"tsa": {"tau": 1.5}}))


def test_component_artifacts_of_a_composed_method(model, tmp_path):
    both = ("tsa+kascade",)
    # Joined in the order of the components in the name (the builder routes each folder by its kind).
    assert harness.parse_artifacts(["kascade=K", "tsa=T"], both) == {"tsa+kascade": f"T{os.pathsep}K"}
    assert harness.parse_artifacts(["tsa=T,kascade=K"], both) == {"tsa+kascade": f"T{os.pathsep}K"}
    assert harness.parse_artifacts(["kascade=K", "tsa+kascade=X"], both) == {"tsa+kascade": "X"}
    assert harness.parse_artifacts(["kascade=K"], ("tsa", "tsa+kascade")) == {"tsa+kascade": "K"}
    assert harness.parse_artifacts(["kascade=K", "tsa=T"], ("tsa", "tsa+kascade")) == {
        "tsa": "T", "tsa+kascade": f"T{os.pathsep}K"}
    with pytest.raises(ValueError, match="names method 'quest', which is not in --methods"):
        harness.parse_artifacts(["quest=Q"], both)
    # A plain DIR goes to every method that reads an artifact, not to dense or quest.
    assert harness.parse_artifacts(["D"], ("dense", "quest", "kascade")) == {"kascade": "D"}
    # ... and is refused where none does; one method, one folder.
    with pytest.raises(ValueError, match="'D': no method of --methods dense,oracle reads an artifact"):
        harness.parse_artifacts(["D"], ("dense", "oracle"))
    with pytest.raises(ValueError, match="method 'kascade' two folders \\('A' and 'B'\\)"):
        harness.parse_artifacts(["kascade=A", "kascade=B"], ("kascade",))
    with pytest.raises(ValueError, match="method 'kascade' two folders"):
        harness.parse_artifacts(["kascade=A,kascade=B"], both)
    assert harness.parse_artifacts(["kascade=A", "kascade=A"], ("kascade",)) == {"kascade": "A"}
    # Built through the harness from two real folders, each routed by its kind.
    fp = jsparse.fingerprint(model)
    kdir, tdir = str(tmp_path / "k"), str(tmp_path / "t")
    save_artifact(kdir, Artifact(kind="kascade", fingerprint=fp, arrays={
        "anchors": np.asarray([0, 1], np.int32),
        "head_map": np.tile(np.arange(model.cfg.num_kv_heads, dtype=np.int32), (2, 1))}))
    save_artifact(tdir, Artifact(kind="tsa", fingerprint=fp, arrays={"sparse_layers": np.asarray([1])}))
    spec = harness.EvalSpec(methods=both, artifacts=harness.parse_artifacts([f"kascade={kdir}", f"tsa={tdir}"],
                                                                            both))
    m = harness.build_methods(model, spec)["tsa+kascade"]
    assert isinstance(m, TSA) and isinstance(m.inner, Kascade) and m.sparse_layers == (1,)
    np.testing.assert_array_equal(m.inner.roles, roles_from_anchors(2, [0, 1]))
    with pytest.raises(ValueError, match="kascade needs a calibration artifact"):
        harness.build_methods(model, harness.EvalSpec(methods=both, artifacts=harness.parse_artifacts(
            [f"tsa={tdir}"], both)))


def test_layer_sparsity_table_names_each_task():
    """The per-layer sparsity table labels a generation task by its name (not as a ppl variant)."""
    common = dict(method="tsa", length=96, budget=None, sparsity=0.1, n=2, depth=None, seconds=1.0)
    records = [harness.make_record(task="niah_single_number", metric="string_match_all", value=1.0,
                                   variant="generate", layer_sparsity={"1": 0.25}, **common),
               harness.make_record(task="ppl", metric="perplexity", value=30.0, variant="continuation",
                                   layer_sparsity={"1": 0.5}, **common),
               harness.make_record(task="passkey", metric="accuracy", value=1.0, variant="generate",
                                   layer_sparsity={"1": 0.75}, **common)]
    md = report.summary_markdown(records, {"ppl_variants": ["continuation"], "continuation": 20})
    assert "| tsa | niah_single_number @96 | 0.250 | 0.250 |" in md
    assert "| tsa | ppl continuation @96 | 0.500 | 0.500 |" in md and "| tsa | passkey @96 | 0.750 | 0.750 |" in md
    assert "ppl generate" not in md


def test_acceptance_rate_is_accepted_over_gamma_per_round():
    stats = {"rounds": [2, 3, 5], "accepted": [4, 6, 1], "gamma": 4}
    assert harness.acceptance_rate(stats) == pytest.approx(11 / (10 * 4))
    assert harness.acceptance_rate(stats, [0, 1]) == pytest.approx(10 / (5 * 4))
    assert harness.acceptance_rate({}) is None


def test_generation_gives_each_prompts_prefill_to_its_own_tracker_across_batches(model):
    """Prompts of two tasks in one run_generation, 2 rows per call: each accumulator receives exactly its own
    prompts' measured prefill rows, also in the second batch (a wrong row offset gave task A a row of task B)."""
    from jsparse.methods.common import prefill_state

    tsa = TSA(**TSA_OPTIONS)
    rng = np.random.default_rng(0)
    prompts = [tuple(int(t) for t in rng.integers(2, len(model.tokenizer), 96)) for _ in range(4)]
    a, b = harness.LayerSparsity(tsa, model.cfg), harness.LayerSparsity(tsa, model.cfg)
    harness.run_generation(model, tsa, prompts, 1, rows=2, layer_sparsity=[a, a, b, b])
    state = prefill_state(model.params, model.cfg, tsa, np.asarray(prompts, np.int32), np.full((4,), 96))
    want = {int(k): np.asarray(v, np.float64) for k, v in
            tsa.prefill_layer_sparsity(model.cfg, state, np.full((4,), 96)).items()}
    assert set(a.rows) == set(want) and want
    for layer, values in want.items():
        np.testing.assert_allclose(a.rows[layer], values[:2], rtol=1e-6)
        np.testing.assert_allclose(b.rows[layer], values[2:], rtol=1e-6)


def test_a_composed_method_runs_at_every_budget_and_tsa_alone_once():
    """tsa+kascade has no budget field of its own, but its Kascade takes one: it runs once per fraction and per
    token budget (TSA alone takes none: once, budget None)."""
    both, alone = TSA(inner=Kascade(), selection="kv_head"), TSA()
    spec = harness.EvalSpec(methods=("tsa+kascade", "tsa"), tasks=("ppl",), lengths=(64,), budgets=(0.2,),
                            budget_tokens=(16,))
    runs = harness.method_runs(None, spec, {"tsa+kascade": both, "tsa": alone}, 64)
    assert [(r.name, r.budget, r.budget_tokens) for r in runs] == [
        ("tsa+kascade", 0.2, None), ("tsa+kascade", 0.25, 16), ("tsa", None, None)]


def test_a_token_budget_run_keeps_its_min_tokens_over_a_method_option(monkeypatch):
    """A min_tokens method option applies to the fraction runs only: the token budget N's own min_tokens = N (and
    its budget) win over the option in the build of a token-budget run."""
    from jsparse.methods import make_method

    built = []
    monkeypatch.setattr(jsparse, "build_method", lambda name, model, **kw: built.append(kw) or object())
    spec = harness.EvalSpec(methods=("oracle",), tasks=("ppl",), lengths=(64,), budgets=(0.25,), budget_tokens=(16,),
                            method_options={"oracle": {"min_tokens": 4}})
    runs = harness.method_runs(None, spec, {"oracle": make_method("oracle", budget=0.25)}, 64)
    for r in runs:
        r.build()
    assert [(r.budget, r.budget_tokens) for r in runs] == [(0.25, None), (0.25, 16)]
    assert built == [{"budget": 0.25, "min_tokens": 16}]  # (the fraction run reuses the base instance)

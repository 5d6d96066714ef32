"""The eval harness (eval/): passkey prompts, perplexity, records, summary and the `eval` command's errors.

Runs on a tiny random Llama (2 layers) with a tiny byte-level BPE tokenizer trained in the test, so nothing
is downloaded; a test-only method ("eval_test_sparse", dense attention that reports a sparsity of 0.5 and
remembers the artifact it was given) stands in for the sparse methods.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

import jsparse
from eval import cli_eval, harness, passkey, ppl, report
from jsparse.methods import register
from models import llama
from models.bundled import LoadedModel
from models.cache import init_cache
from models.config import ModelConfig
from models.params import expected_shapes
from pallas_kernels.dense import dense_decode, dense_prefill

SEEN_ARTIFACTS: list = []


@register("eval_test_sparse")
@struct.dataclass
class _TestSparse:
    """Dense attention that reports achieved sparsity 0.5 (a stand-in for a sparse method with a budget)."""

    budget: float = struct.field(pytree_node=False, default=0.1)

    @classmethod
    def build(cls, budget=None, artifact=None, **unused):
        SEEN_ARTIFACTS.append(artifact)
        return cls(budget=0.1 if budget is None else budget)

    def init_state(self, cfg, batch, max_len):
        return None

    def layer_info(self, cfg):
        return None

    def prefill(self, ctx, q, k, v, state):
        return dense_prefill(q, k, v), state

    def decode(self, ctx, q, cache, state):
        return dense_decode(q, cache.k, cache.v, ctx.lengths), state

    def achieved_sparsity(self, cfg, positions):
        assert positions.ndim == 1
        return 0.5


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(passkey.FILLER_SENTENCES) + [passkey.INTRO, passkey.NEEDLE, passkey.QUESTION],
                            trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def model(tokenizer):
    cfg = ModelConfig(architecture="llama", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=1024,
                      bos_token_id=0, eos_token_ids=(1,))
    # numpy draws (eager jax.random per leaf costs a compilation each); norms stay ones as in random_params.
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map(
        lambda shape: jnp.asarray(rng.normal(0.0, 0.2, shape), jnp.float32), expected_shapes(cfg),
        is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x))
    params = params.replace(final_norm=jnp.ones_like(params.final_norm), layers=params.layers.replace(
        attn_norm=jnp.ones_like(params.layers.attn_norm), mlp_norm=jnp.ones_like(params.layers.mlp_norm)))
    return LoadedModel(cfg=cfg, params=params, tokenizer=tokenizer, name="tiny-random")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("corpus") / "eval_corpus.txt"
    rng = np.random.default_rng(0)
    paragraphs = [" ".join(rng.choice(passkey.FILLER_SENTENCES, 12)) for _ in range(60)]
    path.write_text("\n\n".join(paragraphs), encoding="utf-8")
    return str(path)


# ------------------------------------------------------------------------------------------------ passkey


@pytest.mark.parametrize("length", [160, 301])
def test_passkey_prompt_length_and_needle_depth(tokenizer, length):
    longest = max(len(tokenizer(" " + s, add_special_tokens=False)["input_ids"])
                  for s in passkey.FILLER_SENTENCES)
    for i, depth in enumerate(passkey.DEFAULT_DEPTHS):
        key = str(10000 + 7919 * i)
        p = passkey.make_prompt(tokenizer, length, depth, key, np.random.default_rng(i))
        assert p.tokens.shape == (length,) and p.tokens.dtype == np.int32
        assert p.tokens[0] == tokenizer.bos_token_id
        needle = tokenizer(" " + passkey.NEEDLE.format(key=key), add_special_tokens=False)["input_ids"]
        assert list(p.tokens[p.needle_start:p.needle_start + p.needle_len]) == needle
        # Needle on a sentence boundary at most one sentence before the requested depth.
        target = depth * p.filler_tokens
        assert target - longest < p.needle_start - p.filler_start <= target + 0.5
        text = tokenizer.decode(p.tokens, skip_special_tokens=True)
        assert passkey.NEEDLE.format(key=key) in text
        assert text.startswith(passkey.INTRO) and text.endswith(passkey.QUESTION)
        assert text.count(key) == 2  # the needle names the key twice and nothing else holds a digit


def test_passkey_prompts_are_seeded_and_cycle_depths(tokenizer):
    a = passkey.make_prompts(tokenizer, 200, 7, seed=3)
    b = passkey.make_prompts(tokenizer, 200, 7, seed=3)
    c = passkey.make_prompts(tokenizer, 200, 7, seed=4)
    assert [p.key for p in a] == [p.key for p in b]
    assert all(np.array_equal(p.tokens, q.tokens) for p, q in zip(a, b))
    assert [p.key for p in a] != [p.key for p in c]
    assert all(len(p.key) == 5 and p.key.isdigit() for p in a)
    assert [p.depth for p in a] == [0.1, 0.3, 0.5, 0.7, 0.9, 0.1, 0.3]


def test_passkey_errors(tokenizer):
    with pytest.raises(ValueError, match="too short"):
        passkey.make_prompt(tokenizer, 40, 0.5, "12345", np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"depth 1.5: expected a fraction in \[0, 1\]"):
        passkey.make_prompt(tokenizer, 200, 1.5, "12345", np.random.default_rng(0))


def _filler(p) -> np.ndarray:
    """A passkey prompt's filler tokens: the text before the needle, then the text after it."""
    end = p.needle_start + p.needle_len
    return np.concatenate([p.tokens[p.filler_start:p.needle_start],
                           p.tokens[end:end + p.filler_tokens - (p.needle_start - p.filler_start)]])


def test_passkey_corpus_haystack(tokenizer, corpus):
    """The "corpus" haystack: exact length, the needle at the requested depth of a seeded stretch of the corpus."""
    ids = ppl.tokenize_corpus(tokenizer, ppl.read_corpus(corpus))
    a = passkey.make_prompts(tokenizer, 200, 5, seed=3, corpus_ids=ids)
    b = passkey.make_prompts(tokenizer, 200, 5, seed=3, corpus_ids=ids)
    assert all(np.array_equal(p.tokens, q.tokens) for p, q in zip(a, b))
    text = ",".join(map(str, ids))
    for p in a:
        assert p.tokens.shape == (200,)
        needle = tokenizer(" " + passkey.NEEDLE.format(key=p.key), add_special_tokens=False)["input_ids"]
        assert list(p.tokens[p.needle_start:p.needle_start + p.needle_len]) == needle
        assert abs(p.achieved_depth - p.depth) <= 1.0 / p.filler_tokens
        filler = _filler(p)
        assert len(filler) == p.filler_tokens and ",".join(map(str, filler)) in text  # one stretch of the corpus
    classic = passkey.make_prompts(tokenizer, 200, 5, seed=3)
    assert not any(np.array_equal(p.tokens, q.tokens) for p, q in zip(a, classic))
    with pytest.raises(ValueError, match="the corpus has 50 tokens"):
        passkey.make_prompt(tokenizer, 200, 0.5, "12345", np.random.default_rng(0), ids[:50])
    with pytest.raises(ValueError, match="haystack='books'"):
        passkey.check_haystack("books")


def test_passkey_corpus_stretch_is_a_contiguous_run_at_a_seeded_legal_offset(tokenizer):
    """The "corpus" filler is corpus[start:start + F] with start drawn by rng.integers(0, N - F): a fake corpus of
    distinct ids shows the start. With N = F + 3 samples must use every start 0, 1, 2 and no other (mutants the
    bound N - F + 1 and the stretch one past the offset survived before); N = F + 1 allows only start 0. The
    stretch never holds the corpus's last token (as the error asks for F + 1 tokens)."""
    F = passkey.make_prompt(tokenizer, 200, 0.5, "12345", np.random.default_rng(0)).filler_tokens
    for extra, allowed in ((3, {0, 1, 2}), (1, {0})):
        corpus_ids = np.arange(2, 2 + F + extra, dtype=np.int32)  # distinct, non-special ids: the value is the place
        starts = set()
        for p in passkey.make_prompts(tokenizer, 200, 40, seed=7, corpus_ids=corpus_ids):
            filler = _filler(p)
            start = int(filler[0]) - 2
            assert filler.tolist() == corpus_ids[start:start + F].tolist()  # one contiguous run, F long
            starts.add(start)
        assert starts == allowed, (extra, sorted(starts))


def test_the_corpus_needle_never_splits_a_word(tokenizer):
    """The needle goes in at a word's start, the depth's token moved back while it continues a word ("a por The
    pass key is ... pass key.cupine" before). Words the tokenizer never saw take several tokens each."""
    rng = np.random.default_rng(0)
    rare = ["porcupine", "Skookum", "quixotically", "zymurgy", "Buckminster", "xylophonic"]
    text = " ".join(f"{rng.choice(passkey.FILLER_SENTENCES)} {rng.choice(rare)}." for _ in range(300))
    ids = ppl.tokenize_corpus(tokenizer, text)

    def splits(tokens, i):
        left, pair = tokenizer.decode([tokens[i - 1]]), tokenizer.decode([tokens[i - 1], tokens[i]])
        return left[-1:].isalnum() and pair[len(left):][:1].isalnum()

    inside = [i for i in range(1, 400) if splits(ids, i)]
    assert inside, "the corpus must hold words of several tokens for this test"
    for i in inside[:20]:
        cut = passkey.word_start(tokenizer, ids, i)
        assert cut < i and not splits(ids, cut) and all(splits(ids, j) for j in range(cut + 1, i + 1))
        assert passkey.word_start(tokenizer, ids, cut) == cut
    moved = 0
    for p in passkey.make_prompts(tokenizer, 301, 40, seed=5, corpus_ids=ids):
        t = p.tokens.tolist()
        end = p.needle_start + p.needle_len
        left, pair = tokenizer.decode([t[p.needle_start - 1]]), tokenizer.decode([t[p.needle_start - 1], t[end]])
        assert not (left[-1:].isalnum() and pair[len(left):][:1].isalnum())  # the two filler tokens around it
        assert -1.0 / p.filler_tokens <= p.depth - p.achieved_depth < 0.1  # round(depth * F), then back
        moved += p.achieved_depth < p.depth - 1.0 / p.filler_tokens
    assert moved, "some needle should have moved back to its word's start"


def test_fidelity_gate_marks_methods_below_dense():
    def rec(method, length, hits, depth=None):
        return harness.make_record(task="passkey", method=method, length=length, budget=0.1, metric="accuracy",
                                   value=hits / 10, sparsity=0.0, n=10, variant="generate", depth=depth,
                                   seconds=1.0)

    recs = [rec("dense", 64, 7), rec("kascade", 64, 6), rec("oracle", 64, 7), rec("tsa", 64, 9),
            rec("dense", 128, 5), rec("kascade", 128, 5), rec("kascade", 128, 0, depth=0.5)]
    gate = report.below_dense(recs)
    assert [(m, L) for m, L, _, _ in gate] == [("kascade", 64)]
    md = report.summary_markdown(recs, {})
    assert "0.60 (6/10) " + report.BELOW_DENSE in md and "- kascade @64: 6/10 against dense's 7/10" in md
    assert "0.90 (9/10) |" in md and md.count(report.BELOW_DENSE) == 2  # the cell and the gate's heading
    clean = report.summary_markdown([r for r in recs if r["method"] != "kascade"], {})
    assert "- none: every method scores at least dense's passkey." in clean
    # A generation task's metric is a mean of fractions: the gate shows it as such, not as made-up hit counts.
    multi = [harness.make_record(task="niah_multivalue", method=m, length=64, budget=0.1, metric="string_match_all",
                                 value=v, sparsity=0.0, n=10, variant="generate", depth=None, seconds=1.0)
             for m, v in (("dense", 0.78), ("quest", 0.76))]
    assert "- quest niah_multivalue @64: 0.76 against dense's 0.78" in report.summary_markdown(multi, {})
    # A folder that gathered runs: oracle at 256 has no dense result to check against. The gate names it instead of
    # saying "none", and the leaderboard counts it.
    gathered = [r for r in recs if r["method"] != "kascade"] + [rec("oracle", 256, 1)]
    assert [(m, L) for m, L, _ in report.unchecked(gathered)] == [("oracle", 256)]
    md = report.summary_markdown(gathered, {})
    assert "- not checked, no dense result at the same task and length: oracle @256" in md
    assert "- none:" not in md
    board = {e["method"]: e for e in report.leaderboard(gathered)}
    assert (board["oracle"]["unchecked"], board["tsa"]["unchecked"], board["dense"]["unchecked"]) == (1, 0, 0)
    assert "not checked against dense |" in "\n".join(report.leaderboard_markdown(gathered))
    assert "not checked against dense" not in "\n".join(report.leaderboard_markdown(recs))


def test_sparsity_is_shown_per_task_and_phase_not_the_first_records():
    """A dense-prefill method (Quest) reports 0 on the prompt's prefill (passkey) and its page rule in decode (ppl
    decode): the summary shows each in its own column, and the leaderboard keeps the two phases apart instead of
    showing whichever record came first or a mean of both."""
    def rec(task, variant, sparsity, value):
        return harness.make_record(task=task, method="quest", length=512, budget=0.1, metric="accuracy" if task ==
                                   "passkey" else "perplexity", value=value, sparsity=sparsity, n=4, variant=variant,
                                   depth=None, seconds=1.0)
    recs = [rec("passkey", "generate", 0.0, 1.0), rec("ppl", "decode", 0.861, 20.0)]
    md = report.summary_markdown(recs, {})
    table = md.split("## Achieved sparsity")[1].split("##")[0]
    assert "| method | passkey @512 | ppl decode @512 |" in table and "| quest | 0.000 | 0.861 |" in table
    (board,) = report.leaderboard(recs)
    assert (board["sparsity"], board["decode_sparsity"]) == (0.0, 0.861)


def test_passkey_scoring():
    assert passkey.is_correct(" 71432. Remember", "71432")
    assert passkey.is_correct("71432", "71432")
    assert not passkey.is_correct(" 7143", "71432")
    assert not passkey.is_correct(" 714321", "71432")
    assert not passkey.is_correct(" the key", "71432")
    assert not passkey.is_correct(" 1 71432", "71432")


# ------------------------------------------------------------------------------------------------ ppl


def test_corpus_tokens_are_the_whole_texts(tokenizer):
    """The corpus is encoded whole, as the model meets text: paragraph breaks, longer breaks and indentation keep
    their tokens and the ids decode to the text (paragraph by paragraph, "\n\n\n" shrank to "\n\n" and a "\n\n"
    was added at the end)."""
    text = " ".join(passkey.FILLER_SENTENCES[:3]) + "\n\n\n  " + passkey.FILLER_SENTENCES[3] + "\n\n" + \
        passkey.FILLER_SENTENCES[4]
    ids = ppl.tokenize_corpus(tokenizer, text)
    assert ids.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids.tolist()) == text


def test_windows(tokenizer, corpus):
    ids = ppl.tokenize_corpus(tokenizer, ppl.read_corpus(corpus))
    w = ppl.make_windows(tokenizer, ids, 100, 5, seed=1)
    assert w.shape == (5, 100) and w.dtype == np.int32
    assert (w[:, 0] == tokenizer.bos_token_id).all()
    corpus_str = ",".join(map(str, ids))
    for row in w:
        assert ",".join(map(str, row[1:])) in corpus_str  # consecutive corpus tokens
    np.testing.assert_array_equal(w, ppl.make_windows(tokenizer, ids, 100, 5, seed=1))
    assert not np.array_equal(w, ppl.make_windows(tokenizer, ids, 100, 5, seed=2))
    with pytest.raises(ValueError, match="corpus has .* fewer than"):
        ppl.make_windows(tokenizer, ids[:50], 100, 1, seed=0)


def _direct_nll(model, windows: np.ndarray) -> np.ndarray:
    """NLL of tokens 1..T-1 straight from llama.prefill's logits, in numpy (f64)."""
    cfg, B, T = model.cfg, windows.shape[0], windows.shape[1]
    method = jsparse.build_method("dense", model)
    logits, _, _ = llama.prefill(model.params, cfg, method, jnp.asarray(windows), jnp.full((B,), T, jnp.int32),
                                 init_cache(cfg, B, T, jnp.float32), None, all_logits=True)
    logits = np.asarray(logits, np.float64)[:, :-1]
    m = logits.max(-1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, windows[:, 1:, None], axis=-1)[..., 0]


def test_ppl_of_dense_is_exp_mean_nll_of_prefill_logits(model, corpus):
    # 3 windows in batches of 2 (the last padded) and chunks of 48 over 128 tokens (48, 48, 32).
    spec = harness.EvalSpec(methods=("dense",), tasks=("ppl",), lengths=(128,), samples=3, seed=5, corpus=corpus,
                            chunk=48, max_batch_tokens=256)
    run = harness.evaluate(model, spec, progress=False)
    ids = ppl.tokenize_corpus(model.tokenizer, ppl.read_corpus(corpus))
    windows = ppl.make_windows(model.tokenizer, ids, 128, 3, seed=5)
    nll = _direct_nll(model, windows)
    want = float(np.exp(nll.mean()))
    assert np.isfinite(want) and want > 1.0 and nll.std() > 0.1  # not a degenerate model
    got = {r["variant"]: r for r in run.records}
    assert set(got) == {"decode", "prefill"}
    for r in got.values():
        assert r["task"] == "ppl" and r["metric"] == "perplexity" and r["n"] == 3 and r["sparsity"] == 0.0
        np.testing.assert_allclose(r["value"], want, rtol=2e-5)
    # The per-token NLLs themselves agree (not only their mean).
    np.testing.assert_allclose(ppl.decode_nll(model.params, model.cfg, jsparse.build_method("dense", model),
                                              windows, chunk=48), nll, rtol=1e-4, atol=1e-4)
    assert run.ppl_overlap == {}  # the corpus holds 3 windows apart


def test_overlapping_ppl_windows_are_said(model, corpus, tmp_path):
    """More windows than the corpus holds apart share text: the run says so (meta and summary.md), where before
    only a Python warning did and the records' n counted every window alike."""
    short = tmp_path / "short.txt"
    short.write_text(open(corpus, encoding="utf-8").read()[:1500], encoding="utf-8")
    ids = ppl.tokenize_corpus(model.tokenizer, ppl.read_corpus(str(short)))
    slots = ppl.check_windows(model.tokenizer, ids, 128, 4)
    assert slots < 4
    spec = harness.EvalSpec(methods=("dense",), tasks=("ppl",), lengths=(128,), samples=4, seed=5,
                            corpus=str(short), ppl_variants=("prefill",))
    with pytest.warns(UserWarning, match="the windows overlap"):
        run = harness.evaluate(model, spec, progress=False)
    assert run.ppl_overlap == {128: (4, slots)}
    md = report.summary_markdown(run.records, {"ppl_overlap": {"128": {"windows": 4, "non_overlapping": slots}}})
    assert f"- ppl windows overlapping (the corpus holds fewer without overlap: they share text): 4 windows at 128 " \
           f"tokens, {slots} without overlap" in md


# ------------------------------------------------------------------------------------------------ the command


def _parser():
    parser = argparse.ArgumentParser(prog="jsparse")
    cli_eval.add_eval_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def test_eval_command_writes_records_and_summary(model, corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(jsparse, "load", lambda spec, dtype=None, **kwargs: model)
    SEEN_ARTIFACTS.clear()
    out = tmp_path / "run"
    from models.generate import generate_tokens

    jitted = (ppl.prefill_nll_state, ppl.decode_chunk_nll, generate_tokens)
    for f in jitted:  # what earlier tests of this process compiled (other files share these functions) must not count
        f.clear_cache()
    before = [f._cache_size() for f in jitted]
    argv = ["eval", "--model", "tiny", "--methods", "dense,eval_test_sparse", "--tasks", "passkey,ppl",
            "--lengths", "128,192", "--budget", "0.25", "--samples", "2", "--corpus", corpus, "--artifact",
            "eval_test_sparse=some/artifact", "--seed", "1", "--depths", "0.2,0.8", "--chunk", "64",
            "--new-tokens", "6", "--max-batch-tokens", "200", "--out", str(out), "--no-progress"]
    monkeypatch.setattr(sys, "argv", ["jsparse", *argv])  # the command line the run records
    args = _parser().parse_args(argv)
    assert args.func(args) == 0
    # One batch of 1 sample at a time (2 batches per length), decode chunks of 64: still one compilation per
    # (method, length) for each jitted function.
    assert [f._cache_size() - b for f, b in zip(jitted, before)] == [4, 4, 4]
    assert SEEN_ARTIFACTS == ["some/artifact"]

    data = json.loads((out / "results.json").read_text())
    assert data["schema_version"] == report.SCHEMA_VERSION == 2
    assert data["meta"]["command"] == shlex.join(["jsparse", *argv]) and len(data["runs"]) == 1
    records = data["records"]
    assert data["runs"][0]["records"] == len(records)
    for r in records:
        assert tuple(r) == harness.RECORD_KEYS
        assert {"task", "method", "length", "budget", "metric", "value", "sparsity", "n"} <= set(r)
        assert r["budget"] == {"dense": None, "eval_test_sparse": 0.25}[r["method"]]  # dense takes no budget
        assert r["sparsity"] == {"dense": 0.0, "eval_test_sparse": 0.5}[r["method"]]
    main = [r for r in records if r["depth"] is None]
    assert sorted((r["method"], r["task"], r["variant"], r["length"]) for r in main) == sorted(
        (m, t, v, L) for m in ("dense", "eval_test_sparse") for L in (128, 192)
        for t, v in (("passkey", "generate"), ("ppl", "decode"), ("ppl", "prefill")))
    for r in main:
        assert r["n"] == 2 and r["seconds"] > 0
        if r["task"] == "passkey":
            assert r["metric"] == "accuracy" and 0.0 <= r["value"] <= 1.0
        else:
            assert r["metric"] == "perplexity" and r["value"] > 1.0
    by_depth = [r for r in records if r["depth"] is not None]
    assert sorted((r["method"], r["length"], r["depth"], r["n"]) for r in by_depth) == sorted(
        (m, L, d, 1) for m in ("dense", "eval_test_sparse") for L in (128, 192) for d in (0.2, 0.8))
    # The same dense attention under two names gives the same numbers.
    val = {(r["method"], r["task"], r["variant"], r["length"]): r["value"] for r in main}
    for (m, t, v, L), x in val.items():
        np.testing.assert_allclose(x, val[("dense", t, v, L)], rtol=1e-5)

    summary = (out / "summary.md").read_text()
    table = summary.split("## Results")[1].split("##")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    assert [row.split("|")[1].strip() for row in rows] == ["dense", "eval_test_sparse"]
    assert "passkey @128" in table and "ppl decode @192" in table and "ppl prefill @128" in table
    assert re.search(r"\([+-]0\.0%\)", table)  # relative to dense
    outputs = json.loads((out / "outputs.json").read_text())
    assert len(outputs) == 2 * 2 * 2 and all(o["task"] == "passkey" and len(o["answers"]) == 1 for o in outputs)
    assert all("completion" in o and o["score"] in (0.0, 1.0) for o in outputs)
    assert (out / "report.md").is_file() and "## Leaderboard" in (out / "report.md").read_text()
    meta = json.loads((out / "run.json").read_text())
    assert meta["model"] == "tiny-random" and meta["command"] == shlex.join(["jsparse", *argv])


@pytest.mark.parametrize("argv, error, match", [
    (["--methods", "dense,nosuch"], ValueError, r"unknown method 'nosuch'; valid methods: .*dense"),
    (["--tasks", "passkey,mmlu"], ValueError, r"unknown task 'mmlu'; valid tasks: passkey, ppl"),
    (["--corpus", "/nonexistent/eval_corpus.txt"], FileNotFoundError, r"corpus '/nonexistent/eval_corpus.txt' "
     "does not exist"),
    (["--budget", "0"], ValueError, r"budget=0.0: expected a fraction in \(0, 1\]"),
    (["--budget", "1.5"], ValueError, r"budget=1.5: expected a fraction in \(0, 1\]"),
    (["--lengths", "2048,abc"], ValueError, r"length 'abc': expected a positive integer"),
    (["--samples", "0"], ValueError, r"samples=0: expected a positive integer"),
    (["--ppl-variants", "decode,beam"], ValueError, r"unknown perplexity variant 'beam'"),
    (["--artifact", "nosuch=some/dir"], ValueError, r"unknown method 'nosuch'"),
    (["--methods", "dense", "--artifact", "eval_test_sparse=some/dir"], ValueError, r"not in --methods"),
])
def test_eval_command_errors(argv, error, match, tmp_path, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model must not be loaded when the arguments are invalid")

    monkeypatch.setattr(jsparse, "load", no_load)
    args = _parser().parse_args(["eval", "--out", str(tmp_path / "x"), "--no-progress"] + argv)
    with pytest.raises(error, match=match):
        args.func(args)
    assert not os.path.exists(tmp_path / "x")


def test_eval_refuses_an_artifacts_calibration_text(tmp_path, monkeypatch):
    """An artifact records the digest of the text it was calibrated on; scoring its method on that text (under any
    path) is refused before the model loads, unless --allow-calibration-corpus; other text, or tasks that do not
    read --corpus, run."""
    from jsparse.artifacts import Artifact, corpus_meta, save_artifact

    dev, copy, other = tmp_path / "dev.txt", tmp_path / "copy_of_dev.txt", tmp_path / "other.txt"
    dev.write_text("The calibration text, one line of it.\n" * 40)
    copy.write_bytes(dev.read_bytes())
    other.write_text("Some other text, for the evaluation.\n" * 40)
    art = tmp_path / "kascade_art"
    save_artifact(str(art), Artifact(kind="kascade", fingerprint="f", arrays={"a": np.zeros(1)},
                                     meta=corpus_meta([str(dev)])))
    assert json.loads((art / "artifact.json").read_text())["meta"]["corpus"] == [str(dev)]

    def no_load(*a, **k):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr(jsparse, "load", no_load)
    base = ["eval", "--out", str(tmp_path / "x"), "--no-progress", "--methods", "dense,kascade", "--artifact",
            f"kascade={art}"]

    def spec(*argv):
        return cli_eval.spec_from_args(_parser().parse_args(base + list(argv)))

    refused = r"--corpus '.*copy_of_dev.txt' holds the text that the 'kascade' artifact at .* was calibrated or trained on"
    for argv in (["--tasks", "ppl"], ["--tasks", "passkey", "--haystack", "corpus"]):
        with pytest.raises(ValueError, match=refused):
            spec("--corpus", str(copy), *argv)
        args = _parser().parse_args(base + ["--corpus", str(copy), *argv])
        with pytest.raises(ValueError, match=refused):  # the command itself, before any work
            args.func(args)
        assert not os.path.exists(tmp_path / "x")
        assert spec("--corpus", str(copy), "--allow-calibration-corpus", *argv).allow_calibration_corpus
        assert spec("--corpus", str(other), *argv).corpus == str(other)
    assert spec("--corpus", str(copy), "--tasks", "passkey").haystack == "repeat"  # the corpus is not read
    # An artifact recorded before digests: the same file (by path) is refused, a copy is not recognised.
    legacy = json.loads((art / "artifact.json").read_text())
    del legacy["meta"]["corpus_sha256"]
    (art / "artifact.json").write_text(json.dumps(legacy))
    with pytest.raises(ValueError, match=r"--corpus '.*dev.txt' holds the text"):
        spec("--corpus", str(dev), "--tasks", "ppl")
    assert spec("--corpus", str(copy), "--tasks", "ppl").corpus == str(copy)
    # The run config records the override (only when given, so earlier folders still resume).
    allowed = spec("--corpus", str(copy), "--tasks", "ppl", "--allow-calibration-corpus")
    assert cli_eval.run_config(allowed, "m", None)["allow_calibration_corpus"] is True
    assert "allow_calibration_corpus" not in cli_eval.run_config(spec("--tasks", "ppl"), "m", None)


def test_empty_corpus_and_missing_tokenizer_errors(model, tmp_path):
    empty = tmp_path / "eval_empty.txt"
    empty.write_text("  \n\n ")
    with pytest.raises(ValueError, match="is empty"):
        ppl.read_corpus(str(empty))
    with pytest.raises(ValueError, match="needs a corpus"):
        ppl.read_corpus(None)
    bare = LoadedModel(cfg=model.cfg, params=model.params, tokenizer=None, name="bare")
    with pytest.raises(ValueError, match="has no tokenizer"):
        harness.evaluate(bare, harness.EvalSpec(methods=("dense",), lengths=(96,)), progress=False)


def test_summary_of_records():
    recs = [harness.make_record(task="ppl", method=m, length=64, budget=0.1, metric="perplexity", value=v,
                                sparsity=s, n=2, variant="decode", depth=None, seconds=1.0)
            for m, v, s in (("dense", 10.0, 0.0), ("oracle", 10.5, 0.8), ("quest", 12.0, None))]
    md = report.summary_markdown(recs, {"model": "m"})
    assert "| oracle | 10.500 (+5.0%) |" in md and "| quest | 12.000 (+20.0%) |" in md
    assert "| quest |  |" in md  # unreported sparsity is blank
    with pytest.raises(KeyError):
        harness.make_record(task="ppl")


def test_jsparse_main_reports_eval_errors(tmp_path, capsys, monkeypatch):
    from jsparse import cli

    monkeypatch.setattr(jsparse, "load", lambda *a, **k: pytest.fail("the model must not be loaded"))
    rc = cli.main(["eval", "--methods", "dense,nosuch", "--out", str(tmp_path / "x"), "--no-progress"])
    assert rc == 2
    assert "unknown method 'nosuch'; valid methods:" in capsys.readouterr().err


def test_record_sparsity_follows_the_phase_that_computes_it():
    """A record's sparsity is of the positions it scores, by the rule of the phase that computes them: the decode
    methods' dense prefill gives their prefill, passkey and task records 0 (not the decode rule), a continuation
    record is the rule over its last C positions, and a sparse-prefill method keeps its rule over the prompt."""
    from jsparse.methods import make_method

    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=4096)
    L, C = 2048, 256
    for name in ("quest", "h2o", "evosparse-noretrieval"):  # (EvoSparse without its calibrated retrieval heads)
        m = make_method(name, budget=0.1, cfg=cfg)
        decode = harness.achieved_sparsity(m, name, cfg, L, "decode")
        assert decode > 0.3
        assert [harness.achieved_sparsity(m, name, cfg, L, v) for v in ("prefill", "generate", "chat")] == [0.0] * 3
        assert decode == pytest.approx(float(m.achieved_sparsity(cfg, np.arange(L - 1))))  # rows 0..L-2 scored
        tail = harness.achieved_sparsity(m, name, cfg, L, "continuation", continuation=C)
        # Rows L-C-1..L-2: the prefill's last row (dense here), then C - 1 decoded rows.
        assert tail == pytest.approx((C - 1) * float(m.achieved_sparsity(cfg, np.arange(L - C, L - 1))) / C)
        assert tail > decode  # late positions see more keys than the budget's floor
        # One scored token: it comes from the dense prefill, so nothing was skipped (it was the decode rule).
        assert harness.achieved_sparsity(m, name, cfg, L, "continuation", continuation=1) == 0.0
    oracle = make_method("oracle", budget=0.1)
    prefill = harness.achieved_sparsity(oracle, "oracle", cfg, L, "prefill")
    assert prefill == pytest.approx(harness.achieved_sparsity(oracle, "oracle", cfg, L, "decode")) and prefill > 0.3
    assert harness.achieved_sparsity(make_method("dense"), "dense", cfg, L, "prefill") == 0.0
    with pytest.raises(ValueError, match="continuation"):
        harness.achieved_sparsity(oracle, "oracle", cfg, L, "continuation")


@pytest.mark.parametrize("name", ["corpus", "repeat"])
def test_a_corpus_file_named_like_a_builtin_haystack_is_read(tokenizer, tmp_path, monkeypatch, name):
    """--corpus corpus (a file of that name) with --haystack corpus: the niah tasks read the file (they took the
    shipped default corpus, or RULER's noise sentences for "repeat", while passkey and ppl read the file)."""
    from eval import harness
    from eval.tasks import get_task

    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text("The zebra crossed the meadow at dawn. " * 400, encoding="utf-8")
    spec = dataclasses.replace(harness.EvalSpec(methods=("dense",), tasks=("niah_single_number",)),
                               corpus=name, haystack="corpus")
    haystack = harness.generation_haystack(spec)
    assert haystack == str(tmp_path / name)
    sample = get_task("niah_single_number").make_samples(tokenizer, 300, 1, 0, haystack=haystack)[0]
    assert "zebra crossed the meadow" in tokenizer.decode(sample.tokens)


def _rec(value, n, method="oracle"):
    return dict(task="passkey", metric="accuracy", variant="generate", method=method, value=value, n=n, length=1024,
                depth=None, budget=None, budget_tokens=None, sparsity=None)


def test_passkey_cell_counts_hits_exactly():
    """The summary's passkey cell shows hits/n rounded from the mean, not truncated (mutation
    `hits = round(r["value"] * r["n"])` -> `int(...)` in eval/report.py survived the suite: 29 hits of 100 are a
    mean of 0.29, and 0.29 * 100 = 28.999999999999996, shown as 28/100)."""
    for hits, n in ((29, 100), (57, 100), (7, 25), (3, 10)):
        value = float(np.mean([1.0] * hits + [0.0] * (n - hits)))
        cell = report._cell(_rec(value, n), None)
        assert f"({hits}/{n})" in cell, (hits, n, cell)
        assert report._score(_rec(value, n)) == f"{hits}/{n}"


def test_ppl_argument_checks_name_the_bad_value(model):
    with pytest.raises(ValueError, match=r"no perplexity variant given: expected some of \['decode'"):
        ppl.check_variants(())
    for bad in (True, 0, 9, 2.0):  # a bool is not a token count; C in [1, length - 2]
        with pytest.raises(ValueError, match=rf"continuation={bad!r} tokens with length 10: expected an integer in "
                                             r"\[1, 8\]"):
            ppl.check_continuation(bad, 10)
    assert ppl.check_continuation(8, 10) == 8 and ppl.check_continuation(1, 10) == 1
    tokens = np.zeros((1, 12), np.int32)
    dense = jsparse.build_method("dense", model)
    with pytest.raises(ValueError, match="chunk=0: expected >= 1 tokens per decode call"):
        ppl.decode_nll(model.params, model.cfg, dense, tokens, chunk=0)
    with pytest.raises(ValueError, match="chunk=0: expected >= 1 tokens per decode call"):
        ppl.continuation_nll(model.params, model.cfg, dense, tokens, 4, chunk=0)


def test_check_windows_bounds(tokenizer):
    """BOS + body: a window needs a body of >= 2 corpus tokens; a corpus of exactly one body holds one window; the
    corpus's n - body + 1 distinct offsets are the most samples allowed."""
    ids = np.arange(100, 100 + 60, dtype=np.int32)
    with pytest.raises(ValueError, match="ppl length=2: expected at least 3 tokens"):
        ppl.check_windows(tokenizer, ids, 2, 1)
    assert ppl.check_windows(tokenizer, ids, 3, 1) == 30  # body 2
    assert ppl.check_windows(tokenizer, ids[:20], 21, 1) == 1  # exactly one window's body
    with pytest.raises(ValueError, match="the corpus has 19 tokens, fewer than the 20 needed"):
        ppl.check_windows(tokenizer, ids[:19], 21, 1)
    assert ppl.check_windows(tokenizer, ids, 21, 41) == 3  # 60 - 20 + 1 = 41 distinct offsets
    with pytest.raises(ValueError, match="--samples 42: the corpus .60 tokens. has only 41 distinct windows"):
        ppl.check_windows(tokenizer, ids, 21, 42)
    with pytest.raises(ValueError, match="samples=0: expected >= 1"):
        ppl.make_windows(tokenizer, ids, 21, 0, seed=0)


def test_windows_tile_a_corpus_that_holds_exactly_the_samples(tokenizer):
    """As many samples as the corpus holds apart: the windows are its consecutive blocks, in order, with no
    warning (for every seed: there is no room to shift the grid)."""
    ids = np.arange(100, 100 + 60, dtype=np.int32)
    bos = tokenizer.bos_token_id
    want = np.stack([np.concatenate([[bos], ids[i * 20:(i + 1) * 20]]) for i in range(3)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed in range(8):
            np.testing.assert_array_equal(ppl.make_windows(tokenizer, ids, 21, 3, seed=seed), want)


def test_overlapping_windows_are_whole_stretches_of_the_corpus(tokenizer):
    """A corpus of body + 1 tokens holds 2 distinct windows and 1 apart: 2 samples overlap, each still a full
    window at offset 0 or 1."""
    ids = np.arange(100, 100 + 21, dtype=np.int32)
    bos = tokenizer.bos_token_id
    allowed = [np.concatenate([[bos], ids[s:s + 20]]) for s in (0, 1)]
    for seed in range(20):
        with pytest.warns(UserWarning, match="the windows overlap"):
            w = ppl.make_windows(tokenizer, ids, 21, 2, seed=seed)
        assert w.shape == (2, 21)
        assert all(any(np.array_equal(row, a) for a in allowed) for row in w)


def test_decode_nll_with_a_chunk_that_leaves_one_token(model, corpus):
    """T - 1 a multiple of the chunk (T = 16, chunk 5 and 1): the last token is still fed and all T - 1 NLLs
    equal the prefill logits' (every chunk size gives the same NLLs)."""
    ids = ppl.tokenize_corpus(model.tokenizer, ppl.read_corpus(corpus))
    windows = ppl.make_windows(model.tokenizer, ids, 16, 2, seed=0)
    want = _direct_nll(model, windows)
    dense = jsparse.build_method("dense", model)
    for chunk in (5, 1):
        got = ppl.decode_nll(model.params, model.cfg, dense, windows, chunk=chunk)
        assert got.shape == (2, 15)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_passkey_answer_is_the_first_digit_run_anywhere():
    assert passkey.extract_answer("The pass key is 71432.") == "71432"
    assert passkey.is_correct(" is 71432. Remember it.", "71432")
    assert passkey.extract_answer("\nno digits") is None


def test_passkey_depth_and_length_bounds(tokenizer, corpus):
    """Depths 0 and 1 are valid (the needle right after the intro / right before the question); no depth is an
    error; the shortest length is the one the error names, with a single filler token."""
    assert passkey.check_depths([0.0, 1.0]) == (0.0, 1.0)
    for d in (0.0, 1.0):
        p = passkey.make_prompt(tokenizer, 200, d, "12345", np.random.default_rng(0))
        assert p.achieved_depth <= 1.0 and abs(p.achieved_depth - d) < 0.1
    with pytest.raises(ValueError, match=r"no passkey depths given: expected at least one fraction in \[0, 1\]"):
        passkey.make_prompts(tokenizer, 200, 2, seed=0, depths=())
    with pytest.raises(ValueError, match="too short") as e:
        passkey.make_prompt(tokenizer, 40, 0.5, "12345", np.random.default_rng(0))
    shortest = int(re.search(r"expected a length >= (\d+)", str(e.value)).group(1))
    assert passkey.make_prompt(tokenizer, shortest, 0.5, "12345", np.random.default_rng(0)).filler_tokens == 1
    with pytest.raises(ValueError, match=f"expected a length >= {shortest}"):
        passkey.make_prompt(tokenizer, shortest - 1, 0.5, "12345", np.random.default_rng(0))
    ids = ppl.tokenize_corpus(tokenizer, ppl.read_corpus(corpus))
    F = passkey.make_prompt(tokenizer, 200, 0.5, "12345", np.random.default_rng(0)).filler_tokens
    with pytest.raises(ValueError, match=f"the corpus has {F} tokens: .* needs at least {F + 1} of filler"):
        passkey.make_prompt(tokenizer, 200, 0.5, "12345", np.random.default_rng(0), ids[:F])
    fits = passkey.make_prompt(tokenizer, 200, 0.5, "12345", np.random.default_rng(0), ids[:F + 1])
    assert fits.tokens.shape == (200,)


def test_passkey_needle_position_follows_its_rule(tokenizer, corpus):
    """"repeat": the text before the needle is as many whole sentences as fit in round(depth * F) tokens (the next
    sentence, which follows the needle, would not fit); "corpus": the needle goes in at word_start(round(depth * F))."""
    sentences = [tokenizer(" " + s, add_special_tokens=False)["input_ids"] for s in passkey.FILLER_SENTENCES]
    ids = ppl.tokenize_corpus(tokenizer, ppl.read_corpus(corpus))
    differs = 0
    for i, depth in enumerate(np.linspace(0.0, 1.0, 41)):
        p = passkey.make_prompt(tokenizer, 160, depth, "12345", np.random.default_rng(i))
        before, end = p.needle_start - p.filler_start, p.needle_start + p.needle_len
        target = round(depth * p.filler_tokens)
        avail = p.filler_tokens - before  # the text after the needle, cut to fill the length
        nxt = {len(s) for s in sentences if p.tokens[end:end + min(len(s), avail)].tolist() == s[:avail]}
        assert before <= target and (avail == 0 or before + min(nxt) > target), (depth, before, target)
        c = passkey.make_prompt(tokenizer, 160, depth, "12345", np.random.default_rng(i), ids)
        filler = _filler(c).tolist()
        cut = round(depth * c.filler_tokens)
        assert c.needle_start - c.filler_start == passkey.word_start(tokenizer, filler, cut)
        differs += cut != int(depth * c.filler_tokens)
    assert differs  # some depth rounds up


def test_passkey_prompts_draw_their_own_filler_and_ask_on_a_new_line(tokenizer, corpus):
    """Each sample's filler depends on (seed, length, i): samples at the same depth differ; the question is on its
    own line; no samples is an error."""
    ids = ppl.tokenize_corpus(tokenizer, ppl.read_corpus(corpus))
    for corpus_ids in (None, ids):
        ps = passkey.make_prompts(tokenizer, 200, 6, seed=1, corpus_ids=corpus_ids)
        a, b = ps[0], ps[5]  # both at depth 0.1
        assert a.depth == b.depth and a.tokens[:a.filler_start].tolist() == b.tokens[:b.filler_start].tolist()
        filler = [_filler(p) for p in (a, b)]
        assert not np.array_equal(*filler)
        assert tokenizer.decode(a.tokens, skip_special_tokens=True).endswith("\n" + passkey.QUESTION)
    with pytest.raises(ValueError, match="samples=0: expected >= 1"):
        passkey.make_prompts(tokenizer, 200, 0, seed=1)


def test_ppl_windows_that_just_fit_the_corpus_are_not_said_to_overlap(model, corpus, tmp_path):
    """As many windows as the corpus holds apart do not overlap: ppl_overlap stays empty (one more would)."""
    short = tmp_path / "short.txt"
    short.write_text(open(corpus, encoding="utf-8").read()[:1500], encoding="utf-8")
    ids = ppl.tokenize_corpus(model.tokenizer, ppl.read_corpus(str(short)))
    slots = ppl.check_windows(model.tokenizer, ids, 128, 1)
    assert 1 <= slots < 4
    spec = harness.EvalSpec(methods=("dense",), tasks=("ppl",), lengths=(128,), samples=slots, seed=5,
                            corpus=str(short), ppl_variants=("prefill",))
    assert harness.evaluate(model, spec, progress=False).ppl_overlap == {}


def test_word_start_moves_back_from_the_last_token_too(tokenizer):
    """word_start backs out of a word wherever the cut is, the sequence's last token included (mutation
    `0 < cut < len(ids)` -> `0 < cut < len(ids) - 1` survived: a needle at depth ~1 then split the last word)."""
    rng = np.random.default_rng(0)
    rare = ["porcupine", "Skookum", "quixotically", "zymurgy", "Buckminster", "xylophonic"]
    text = " ".join(f"{rng.choice(passkey.FILLER_SENTENCES)} {rng.choice(rare)}." for _ in range(100))
    ids = ppl.tokenize_corpus(tokenizer, text)
    inside = [i for i in range(1, 300) if passkey.word_start(tokenizer, ids, i) < i]
    assert len(inside) >= 5
    for i in inside[:10]:  # the same cut with the token at i the last one
        assert passkey.word_start(tokenizer, ids[:i + 1], i) == passkey.word_start(tokenizer, ids, i) < i


def test_eval_says_which_passkey_depths_fewer_samples_leave_out(tmp_path):
    """Depths cycle over the samples: with fewer samples than depths the run says which depths it leaves out."""
    def note(*argv):
        args = _parser().parse_args(["eval", "--out", str(tmp_path / "x"), "--methods", "dense", *argv])
        return cli_eval.depth_note(cli_eval.spec_from_args(args))

    said = note("--tasks", "passkey", "--samples", "2", "--depths", "0.1,0.5,0.9")
    assert "depths 0.1,0.5 only, not at 0.9" in said and "--samples 3 or more" in said
    assert note("--tasks", "passkey", "--samples", "3", "--depths", "0.1,0.5,0.9") is None
    assert note("--tasks", "ppl", "--samples", "1") is None  # no needles
    with pytest.raises(ValueError, match="--ppl-samples 4: the ppl task's windows, but --tasks passkey has no ppl"):
        note("--tasks", "passkey", "--ppl-samples", "4")

"""Method options and generate arguments that were accepted and ignored (or crashed without naming the value):
each is now refused by name, before any model work where the value alone shows it."""

from __future__ import annotations

import os
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from eval.harness import parse_method_options
from jsparse.cli import main
from jsparse.methods import make_method
from jsparse.retrieval_heads import top_heads
from models import bundled
from models.config import ModelConfig
from models.params import random_params
from pallas_kernels.anchor_attention.common import check_block_size

CFG = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256, eos_token_ids=(3,))


@pytest.fixture(scope="module")
def tiny():
    return bundled.LoadedModel(cfg=CFG, params=random_params(CFG, jax.random.key(0), jnp.float32, scale=0.3),
                               tokenizer=None, name="tiny")


def test_build_method_with_a_model_takes_cfg_and_fingerprint_from_it(tiny):
    """fingerprint=None (or a copied fingerprint) passed an artifact made for another model."""
    for bad in ({"fingerprint": None}, {"fingerprint": "895e25527a780fcb"}, {"cfg": CFG}):
        with pytest.raises(ValueError, match=r"come from the model; leave them out"):
            jsparse.build_method("kascade", tiny, artifact="jsparse/shipped/smollm2/kascade", **bad)
    with pytest.raises(Exception, match="fingerprint"):  # the check itself still runs
        jsparse.build_method("kascade", tiny, artifact="jsparse/shipped/smollm2/kascade")


def test_generate_names_a_bad_stats_and_max_new_tokens(tiny):
    with pytest.raises(ValueError, match=r"stats=5: expected a dict"):
        jsparse.generate_ids(tiny, [[5, 6, 7]], max_new_tokens=2, stats=5)
    with pytest.raises(ValueError, match=r"max_new_tokens=None: expected an integer"):
        jsparse.generate_ids(tiny, [[5, 6, 7]], max_new_tokens=None)


@pytest.mark.parametrize("budget", [float("nan"), "abc", -1.0, float("inf"), True])
def test_a_budget_no_method_could_take_is_refused_even_where_ignored(budget):
    with pytest.raises(ValueError, match=r"method 'dense' budget=.*expected a fraction of the context in \(0, 1\]"):
        make_method("dense", budget=budget)


def test_a_method_without_a_budget_still_ignores_a_valid_one():
    # the CLI and eval hand every method of a run its budget: dense takes it and is dense still
    assert make_method("dense", budget=0.5) == make_method("dense")


def test_method_option_given_twice_and_a_bare_list_are_named():
    with pytest.raises(ValueError, match=r"oracle.tile given twice \(16, then 64\)"):
        parse_method_options(["oracle.tile=16", "oracle.tile=64"], ["oracle"])
    with pytest.raises(ValueError, match=r"oracle.tile given twice"):
        parse_method_options(["oracle.tile=16,oracle.tile=64"], ["oracle"])
    with pytest.raises(ValueError, match=r"a list value in brackets: tsa.sparse_layers=\[1,2\]"):
        parse_method_options(["tsa.sparse_layers=1,2"], ["tsa"])


def test_evosparse_options_the_retrieval_split_leaves_unused():
    split = dict(retrieval_fraction=0.0, sink_fraction=0.25, local_fraction=0.25, heat_fraction=0.5)
    with pytest.raises(ValueError, match=r"retrieval_fraction='abc': expected a fraction"):
        make_method("evosparse", cfg=CFG, retrieval_fraction="abc")
    with pytest.raises(ValueError, match=r"evosparse artifact='/nonexistent' with retrieval_fraction=0"):
        make_method("evosparse", cfg=CFG, artifact="/nonexistent", **split)
    with pytest.raises(ValueError, match=r"evosparse num_retrieval_heads=5 with retrieval_fraction=0"):
        make_method("evosparse", cfg=CFG, num_retrieval_heads=5, **split)
    make_method("evosparse", cfg=CFG, **split)  # without them: builds


def test_evosparse_ablations_refuse_what_they_drop():
    with pytest.raises(ValueError, match=r"heat_fraction=False: this ablation drops the heat"):
        make_method("evosparse-noheat", cfg=CFG, artifact="x", heat_fraction=False)
    for name in ("evosparse-noheat", "sink-local"):
        with pytest.raises(ValueError, match=rf"{name} option decay=0.5 has no effect: this ablation keeps no heat"):
            make_method(name, cfg=CFG, decay=0.5)
        with pytest.raises(ValueError, match=r"heat_window=8 has no effect"):
            make_method(name, cfg=CFG, heat_window=8)
    make_method("sink-local", cfg=CFG)


@pytest.mark.parametrize("name, key", [("kascade", "roles"), ("kascade", "head_map"), ("butler", "params"),
                                       ("butler", "pcfg")])
def test_what_an_artifact_sets_is_refused_as_an_option(name, key):
    """These were TypeErrors ("got multiple values for keyword argument") after the artifact loaded."""
    with pytest.raises(ValueError, match=rf"{name} option {key}=1: {key} is set by its artifact"):
        make_method(name, cfg=CFG, artifact="/nonexistent", **{key: 1})


@pytest.mark.parametrize("name", ["quest", "h2o"])
def test_a_query_tile_of_a_dense_prefill_is_refused(name):
    with pytest.raises(ValueError, match=rf"{name} option tile=64 has no effect: its prefill is dense"):
        make_method(name, tile=64)
    make_method(name)


def test_butler_refuses_a_tile_before_reading_its_artifact():
    with pytest.raises(ValueError, match=r"butler option tile=64 has no effect"):
        make_method("butler", cfg=CFG, artifact="/nonexistent", tile=64)


def test_tsa_refuses_options_its_other_options_make_unused():
    with pytest.raises(ValueError, match=r"tsa option tau=0.9 has no effect: kept_fraction=0.5 keeps a fixed share"):
        make_method("tsa", cfg=CFG, kept_fraction=0.5, tau=0.9)
    for key in ("local_window", "local_sinks"):
        with pytest.raises(ValueError, match=rf"tsa option {key}=8 has no effect: fill='zeros'"):
            make_method("tsa", cfg=CFG, fill="zeros", **{key: 8})
    make_method("tsa", cfg=CFG, kept_fraction=0.5)
    make_method("tsa", cfg=CFG, fill="zeros")


def test_sts_names_a_bad_draft_two_head_map_sources_and_a_bad_dense_layers():
    draft = types.SimpleNamespace(cfg=CFG, params=None)
    head_map = np.zeros((CFG.num_layers, CFG.num_heads, 2), np.int32)
    with pytest.raises(ValueError, match=r"draft='x': expected a loaded model"):
        make_method("sts", cfg=CFG, draft="x", head_map=head_map)
    with pytest.raises(ValueError, match=r"artifact='/nonexistent' and a head_map given: expected one of them"):
        make_method("sts", cfg=CFG, draft=draft, artifact="/nonexistent", head_map=head_map)
    for bad in ("1", None):
        with pytest.raises(ValueError, match=r"dense_layers=.*: expected an integer >= 0"):
            make_method("sts", cfg=CFG, draft=draft, head_map=head_map, dense_layers=bad)
    assert make_method("sts", cfg=CFG, draft=draft, head_map=head_map, dense_layers=np.int64(1)).dense_layers == 1


def test_numpy_integers_are_integers_and_strings_are_quoted():
    assert check_block_size(np.int64(2), 32) == 2
    with pytest.raises(ValueError, match=r"num_retrieval_heads='3': expected between 1"):
        top_heads(np.zeros((2, 3)), "3")


def test_generate_cli_checks_options_and_budget_before_loading_the_model(capsys):
    """A typo should not cost a model load: the missing model file is never reached."""
    base = ["generate", "--model", "/nonexistent/model.gguf", "--prompt", "Hi"]
    assert main(base + ["--method", "oracle", "--method-option", "oracle.bogus=1"]) == 2
    assert "has no option 'bogus'" in capsys.readouterr().err
    assert main(base + ["--method", "dense", "--budget", "0.5"]) == 2
    assert "--budget 0.5: method 'dense' takes no budget" in capsys.readouterr().err
    assert main(base + ["--method", "oracle"]) == 2  # a valid request reaches the load, which names the file
    assert "/nonexistent/model.gguf" in capsys.readouterr().err


def test_sts_refuses_the_options_of_a_path_that_is_off():
    """mask_pool / mask_attention shape first_step_mask's pool, record_selection record_after_scan's buffer."""
    draft = types.SimpleNamespace(cfg=CFG, params=None)
    head_map = np.zeros((CFG.num_layers, CFG.num_heads, 2), np.int32)
    for key, value in (("mask_pool", 4), ("mask_attention", False)):
        with pytest.raises(ValueError, match=rf"sts option {key}={value} has no effect: .*first_step_mask, which is "
                                             "off"):
            make_method("sts", cfg=CFG, draft=draft, head_map=head_map, **{key: value})
    with pytest.raises(ValueError, match=r"sts option record_selection='rows' has no effect: .*record_after_scan"):
        make_method("sts", cfg=CFG, draft=draft, head_map=head_map, record_after_scan=False, record_selection="rows")
    sts = make_method("sts", cfg=CFG, draft=draft, head_map=head_map, first_step_mask=np.bool_(True), mask_pool=4)
    assert (sts.mask_pool, sts.mask_attention, sts.record_selection) == (4, True, "auto")
    sts = make_method("sts", cfg=CFG, draft=draft, head_map=head_map)  # the defaults
    assert (sts.mask_pool, sts.mask_attention, sts.record_selection) == (1, True, "auto")


def test_a_composed_method_takes_its_artifacts_as_a_list():
    """tsa+kascade's folders as a list (an AttributeError on list.split before) or joined by os.pathsep."""
    import os

    from jsparse.artifacts import ArtifactError, split_artifacts

    folders = ["jsparse/shipped/smollm2/kascade", "jsparse/shipped/smollm2/tsa"]
    want = {"kascade": folders[0], "tsa": folders[1]}
    assert split_artifacts(folders, ("kascade", "tsa")) == want
    assert split_artifacts(tuple(folders), ("kascade", "tsa")) == want
    assert split_artifacts(os.pathsep.join(folders), ("kascade", "tsa")) == want
    with pytest.raises(ArtifactError, match=r"artifact=5: expected a folder, folders joined by"):
        split_artifacts(5, ("kascade", "tsa"))
    with pytest.raises(ArtifactError, match=r"artifact list entry 5: expected a folder path"):
        split_artifacts([folders[0], 5], ("kascade", "tsa"))


def test_split_artifacts_skips_empty_entries_and_refuses_a_wrong_or_repeated_kind():
    """None or "" is no artifact (tsa+kascade given its folders one by one); an empty entry (a trailing separator)
    is skipped; an artifact of another kind, or two of one kind, are refused naming both."""
    from jsparse.artifacts import ArtifactError, split_artifacts

    kascade, tsa, butler = (f"jsparse/shipped/smollm2/{k}" for k in ("kascade", "tsa", "butler"))
    kinds = ("kascade", "tsa")
    assert split_artifacts(None, kinds) == {} == split_artifacts("", kinds)
    assert split_artifacts(kascade + os.pathsep, kinds) == {"kascade": kascade}
    with pytest.raises(ArtifactError, match=rf"artifact at '{butler}' is a 'butler' artifact: expected one of "
                                            r"\['kascade', 'tsa'\]"):
        split_artifacts([kascade, butler], kinds)
    with pytest.raises(ArtifactError, match=rf"two 'kascade' artifacts given: '{kascade}' and '{kascade}'"):
        split_artifacts([kascade, tsa, kascade], kinds)


def test_generate_cli_budget_bounds_and_token_budget_checks_come_before_the_load(capsys):
    """--budget 1 (every key) and an STS budget above 1 (a token count) are valid and reach the load (which names
    the missing file); --budget 0, an STS token budget of 1, and a --method-option the token budget would
    overwrite are refused before it."""
    base = ["generate", "--model", "/nonexistent/model.gguf", "--prompt", "Hi"]
    for extra in (["--method", "oracle", "--budget", "1"], ["--method", "sts", "--budget", "64"]):
        assert main(base + extra) == 2
        assert "'/nonexistent/model.gguf' does not exist" in capsys.readouterr().err, extra
    for extra, message in ((["--method", "oracle", "--budget", "0"], "--budget 0: expected a fraction of the context "
                                                                     "in (0, 1]"),
                           (["--method", "sts", "--budget-tokens", "1"], "--budget-tokens 1 with method 'sts'"),
                           (["--method", "quest", "--budget-tokens", "200", "--method-option", "quest.min_tokens=5"],
                            "--method-option quest.min_tokens with --budget-tokens 200: a token budget sets "
                            "min_tokens itself")):
        assert main(base + extra) == 2
        assert message in capsys.readouterr().err, extra


@pytest.mark.parametrize("bs", [0, -2, 4])
def test_tsa_kascade_refuses_any_prefill_block_size_but_one(bs):
    """Kascade inside TSA selects single tokens: every prefill_block_size other than 1 is refused by name, before
    any artifact is read."""
    from jsparse.methods.tsa_kascade import split_options

    with pytest.raises(ValueError, match=rf"tsa\+kascade does not take prefill_block_size={bs}:"):
        split_options({"prefill_block_size": bs})
    assert split_options({"prefill_block_size": 1, "tau": 0.2}) == ({"prefill_block_size": 1}, {"tau": 0.2})


@pytest.mark.parametrize("budget", [0, 0.0])
def test_a_budget_of_zero_is_refused_even_where_ignored(budget):
    """0 keeps no key: refused for every method, those that ignore the budget (dense) included."""
    for name in ("dense", "oracle"):
        with pytest.raises(ValueError, match=rf"method '{name}' budget={budget!r}: expected a fraction of the "
                                             r"context in \(0, 1\]"):
            make_method(name, budget=budget)


def test_token_counted_options_above_the_context_are_refused_by_name(tiny):
    """Quest with a page wider than the context, or STS with more sink keys than the context, ran as dense attention
    (every key kept) without a word; every option counted in tokens is now checked against the model's context
    where the model is known, and dense_layers against its layers (more than L ran as L)."""
    from jsparse.methods.base import TOKEN_OPTIONS, check_extents, method_options
    n = CFG.max_position_embeddings
    pairs = [(m, key) for m in jsparse.methods.method_names() for key in TOKEN_OPTIONS if key in method_options(m)]
    assert {("quest", "page_size"), ("sts", "sink"), ("sts", "local"), ("streaming", "sink")} <= set(pairs)
    for method, key in pairs:
        with pytest.raises(ValueError, match=re.escape(f"method '{method}' option {key}={n + 1}: more than the model's "
                                             f"context of {n} tokens; expected at most {n}")):
            check_extents(method, {"cfg": CFG, key: n + 1})
        check_extents(method, {"cfg": CFG, key: n})  # the context itself passes
    with pytest.raises(ValueError, match=r"method 'quest' option page_size=257: more than the model's context"):
        jsparse.build_method("quest", tiny, page_size=n + 1)
    with pytest.raises(ValueError, match=r"option dense_layers=4: expected 0..3 \(the model's 3 layers; 3: every"):
        jsparse.build_method("oracle", tiny, dense_layers=4)
    assert jsparse.build_method("oracle", tiny, dense_layers=3).dense_layers == 3
    assert jsparse.build_method("quest", tiny, page_size=n).page_size == n
    assert make_method("quest", page_size=n + 1).page_size == n + 1  # no model: no context to check against


def test_generate_cli_refuses_a_page_wider_than_the_context(tiny, monkeypatch, capsys):
    monkeypatch.setattr(jsparse, "load", lambda *a, **k: tiny)
    code = main(["generate", "--method", "quest", "--method-option", "quest.page_size=1000000", "--prompt", "x",
                 "--max-new-tokens", "1"])
    err = capsys.readouterr().err
    assert code != 0 and "option page_size=1000000: more than the model's context of 256 tokens" in err, err

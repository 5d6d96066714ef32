"""The edges a new user meets first (issue 17, item 5): each is a clear error or the right behaviour.

1. a misspelled method option is an error naming it and the valid options;
2. `build_method("kascade", None, artifact=...)` is a clear error, not an AttributeError;
3. `generate(m, "hi")` is one prompt and returns a str;
4. `jsparse eval --out EXISTING_FILE` fails before the model is loaded;
5. `--samples` beyond what the corpus holds is a clear error, before any work;
6. the converted-GGUF cache is keyed by the file's content, not its path (test_convert.py checks copies and
   changed files; here: two paths of the bundled GGUF share one cache entry).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import types
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse.methods import make_method, method_names
from jsparse.methods.base import method_options
from models import bundled
from models.config import ModelConfig

KASCADE_ARTIFACT = os.path.join(os.path.dirname(__file__), "..", "jsparse", "shipped", "smollm2", "kascade")


@pytest.fixture(scope="module")
def smollm2():
    return jsparse.load("smollm2")


# 1 ------------------------------------------------------------------------------------- misspelled options


@pytest.mark.parametrize("name, typo", [("oracle", "budgett"), ("streaming", "sinks"), ("quest", "page"),
                                        ("dense", "budget_tokens"), ("tsa", "taus"), ("evosparse", "decay_rate")])
def test_misspelled_option_is_named_with_the_valid_ones(name, typo):
    with pytest.raises(ValueError, match=rf"method '{name}' takes no option '{typo}'; its options are .*budget"):
        make_method(name, **{typo: 0.1})


def test_valid_options_still_build():
    assert make_method("oracle", budget=0.2, tile=16).budget == 0.2
    assert make_method("streaming", budget=0.3, sink=8).sink == 8
    assert make_method("dense", budget=0.1) is not None  # budget: given to every method of an eval run
    assert "sink" in method_options("streaming") and "tau" in method_options("tsa")
    for name in method_names():  # every registered builder has introspectable options
        assert {"budget", "artifact"} <= set(method_options(name))


@pytest.mark.parametrize("name, key, extra", [("h2o", "gathered", {}), ("quest", "gathered", {}),
                                             ("evosparse", "branchless", dict(retrieval_fraction=0.0,
                                                                              heat_fraction=0.5625)),
                                             ("sts", "first_step_mask", {})])
def test_bool_option_given_a_string_is_refused(name, key, extra):
    """`--method-option h2o.gathered=False` gives the string 'False' (not JSON), which is truthy: refused."""
    with pytest.raises(ValueError, match=rf"method '{name}' option {key}='False': expected true or false"):
        make_method(name, **{key: "False"}, **extra)
    from jsparse.methods.base import check_options

    with pytest.raises(ValueError, match=rf"option {key}='False': expected true or false"):
        check_options(name, {key: "False"})  # what builders outside make_method check (jsparse bench model)
    if name != "sts":  # (sts needs a draft to build)
        assert getattr(make_method(name, **{key: False}, **extra), key) is False
        make_method(name, **{key: None}, **extra)  # Optional[bool]: None is the default


def test_options_a_builder_sets_itself_are_refused_not_dropped():
    from jsparse.methods.evosparse import EvoSparse
    from jsparse.methods.kascade import Kascade

    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match=r"kascade option dense_layers=3: dense_layers is set by Kascade itself"):
        Kascade.from_anchors(cfg, [0, 2], dense_layers=3)
    with pytest.raises(ValueError, match=r"kascade option anchor_layers=\(0, 1\): .* the anchors of its artifact"):
        Kascade.from_anchors(cfg, [0, 2], anchor_layers=(0, 1))
    assert Kascade.from_anchors(cfg, [0, 2], dense_layers=1).anchor_layers == (0, 2)  # its own value: accepted
    with pytest.raises(ValueError, match=r"evosparse option retrieval_layers=\(1,\): .* retrieval heads"):
        EvoSparse.build(cfg=cfg, retrieval_fraction=0.0, heat_fraction=0.5625, retrieval_layers=(1,))


def test_an_artifact_for_a_method_that_reads_none_is_refused():
    from jsparse.methods.base import takes_artifact

    with pytest.raises(ValueError, match=r"method 'quest' takes no artifact \(artifact='run1'\); the methods that "
                                         r"read one: butler, .*kascade"):
        make_method("quest", artifact="run1")
    assert not takes_artifact("sink-local") and not takes_artifact("evosparse-noretrieval")  # no retrieval heads
    assert takes_artifact("evosparse-noheat") and takes_artifact("tsa+kascade")
    make_method("quest", artifact=None)  # none given: nothing to refuse


def test_generate_without_a_tokenizer_says_so():
    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    model = bundled.LoadedModel(cfg=cfg, params=None, tokenizer=None, name="no-tokenizer")
    with pytest.raises(ValueError, match="'no-tokenizer' has no tokenizer .*generate_ids"):
        jsparse.generate(model, "Hi")


def test_misspelled_option_through_build_method(smollm2):
    with pytest.raises(ValueError, match=r"'budgett'.*its options are artifact, budget, dense_layers"):
        jsparse.build_method("oracle", smollm2, budgett=0.1)


# 2 --------------------------------------------------------------------------------------- method w/o model


def test_kascade_without_model_is_a_clear_error():
    with pytest.raises(ValueError, match=r"kascade needs the model.*build_method\('kascade', model"):
        jsparse.build_method("kascade", None, budget=0.1, artifact=KASCADE_ARTIFACT)


def test_kascade_without_artifact_names_the_calibration_command():
    with pytest.raises(ValueError, match="jsparse calibrate kascade"):
        jsparse.build_method("kascade", None, budget=0.1)


# 3 ----------------------------------------------------------------------------------------- str prompts


def test_generate_one_string_is_one_prompt(smollm2):
    one = jsparse.generate(smollm2, "What is the capital of France?", chat=True, max_new_tokens=8)
    assert isinstance(one, str) and "Paris" in one
    batch = jsparse.generate(smollm2, ["What is the capital of France?", "hi"], chat=True, max_new_tokens=8)
    assert isinstance(batch, list) and len(batch) == 2 and batch[0] == one
    ids = jsparse.encode(smollm2, "hi")
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert jsparse.encode(smollm2, ["hi"]) == [ids]


def test_generate_ids_refuses_a_flat_list_and_non_integer_counts(smollm2):
    """A flat id list (one prompt without its outer list) failed with "object of type 'int' has no len()", a
    float max_new_tokens deep in a shape error, a float in Session.send_ids likewise."""
    from jsparse.api import generate_ids
    from jsparse.session import Session

    with pytest.raises(ValueError, match=r"ids: expected a list of prompts, each a list of token ids"):
        generate_ids(smollm2, [5, 6, 7], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens=2.5: expected an integer"):
        generate_ids(smollm2, [[5, 6, 7]], max_new_tokens=2.5)
    with pytest.raises(ValueError, match="max_new_tokens=2.5: expected an integer >= 1"):
        Session(smollm2, smollm2, gamma=2, capacity=64).send_ids([5, 6], max_new_tokens=2.5)


def _tiny(layers=3, heads=4, kv_heads=2, seed=0):
    import jax

    from models.params import random_params

    cfg = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=16,
                      max_position_embeddings=256, eos_token_ids=(3,))
    return bundled.LoadedModel(cfg=cfg, params=random_params(cfg, jax.random.key(seed), jnp.float32, scale=0.3),
                               tokenizer=None, name="tiny")


@pytest.mark.parametrize("kwargs, message", [
    (dict(ids=[[True, 5]]), "prompt 0 holds a bool among its token ids"),
    (dict(ids=[[5, 6], None]), "prompt 1 is None: expected a sequence of integer token ids"),
    (dict(ids=[[[5, 6]]]), r"prompt 0 is nested \(\[\[5, 6\]\]\): expected a flat sequence"),
    (dict(method=5), "method=5: expected a method name"),
    (dict(method=None), "method=None: expected a method name"),
    (dict(draft="smollm2"), r"draft='smollm2': expected a loaded model \(`jsparse.load\(SPEC\)`"),
    (dict(temperature="1"), "temperature='1': expected a number"),
    (dict(temperature=True), "temperature=True: expected a number"),
    (dict(top_p=None), "top_p=None: expected a number"),
    (dict(seed=1.5), r"seed=1.5: expected an integer in \[-2\*\*63, 2\*\*63\)"),
    (dict(seed=2 ** 64), "seed=18446744073709551616: expected an integer"),
    (dict(ids=None), "ids: expected a list of prompts"),
    (dict(gamma=-5), "gamma=-5"),  # checked without a draft too
    (dict(gamma="x"), "gamma='x'"),
])
def test_generate_ids_refuses_bad_arguments_by_name(kwargs, message):
    """Each of these was read as something else (a bool as token 1) or failed deep inside (an AttributeError on
    a tracer, numpy's ragged-array error, a raw JAX or overflow error)."""
    from jsparse.api import generate_ids

    kwargs = {"ids": [[5, 6]], "max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        generate_ids(_tiny(), kwargs.pop("ids"), **kwargs)


def test_generate_ids_reads_an_iterator_of_prompts_once_and_warns_of_top_p_when_greedy():
    from jsparse.api import generate_ids

    model = _tiny()
    want = generate_ids(model, [[5, 6, 7]], max_new_tokens=2)
    assert generate_ids(model, (p for p in [[5, 6, 7]]), max_new_tokens=2) == want
    with pytest.warns(UserWarning, match="top_p=0.5 has no effect at temperature 0") as caught:
        assert generate_ids(model, [[5, 6, 7]], max_new_tokens=2, top_p=0.5) == want
    assert [w.filename for w in caught] == [__file__]  # the caller's line (it named jsparse/api.py before)
    from jsparse.api import sampling_of
    from models.generate import Sampling

    with pytest.warns(UserWarning):  # and it runs as top_p=1: the compiled greedy loop, not a second one
        assert sampling_of(0.0, 0.5) == Sampling(0.0, 1.0)


def test_an_explicit_capacity_past_a_window_is_refused_by_name():
    """A method that does not honour a sliding window runs while the request fits it; an explicit capacity past the
    window is refused naming it (as Session refuses one), not by a count of the padding the library added."""
    import dataclasses

    from jsparse.api import generate_ids

    model = _tiny()
    model = dataclasses.replace(model, cfg=dataclasses.replace(model.cfg, sliding_window=16))
    assert len(generate_ids(model, [[5, 6, 7]], method="oracle", max_new_tokens=3)[0]) >= 1
    with pytest.raises(ValueError, match=r"capacity=64, more than tiny's sliding_window=16; use one of .*or keep a "
                                         r"value <= 16"):
        generate_ids(model, [[5, 6, 7]], method="oracle", max_new_tokens=3, capacity=64)


def test_named_errors_for_no_model_no_prompts_and_a_gamma_past_the_capacity():
    from jsparse.api import pad_batch
    from jsparse.session import Session

    with pytest.raises(ValueError, match="model None: expected 'smollm2', a Hugging Face folder or a .gguf path"):
        jsparse.load(None)
    with pytest.raises(ValueError, match="no prompts given"):
        pad_batch([])
    with pytest.raises(ValueError, match=r"gamma=62: .* need 65 cache rows, more than the session's capacity of 64"):
        Session(_tiny(), _tiny(layers=2, seed=1), gamma=62, capacity=64)
    assert Session(_tiny(), _tiny(layers=2, seed=1), gamma=61, capacity=64).capacity == 64
    # The default at a context 128 does not divide: rounded up, so EvoSparse's blocks divide it (at 200 it decoded
    # nothing: "cache capacity N=200 is not a multiple of block_size=16"); the conversation still stops at 200.
    odd = dataclasses.replace(_tiny(), cfg=dataclasses.replace(_tiny().cfg, max_position_embeddings=200))
    from jsparse.methods.evosparse import EvoSparse

    evo = EvoSparse.from_heads(odd.cfg, [(1, 0)], budget_tokens=32)
    session = Session(odd, odd, method=evo, gamma=2)
    assert session.capacity == 256 and len(session.send_ids([5 + i % 100 for i in range(180)], max_new_tokens=4)) >= 1


def test_session_and_mesh_arguments_are_refused_by_name():
    from jsparse.session import Session

    model, draft = _tiny(), _tiny(layers=2, seed=1)
    for bad in ("64", 2.5, True):  # int() read 2.5 as 2 and True as 1
        with pytest.raises(ValueError, match=rf"capacity={bad!r}: expected an integer >= 1"):
            Session(model, draft, capacity=bad)
    with pytest.raises(ValueError, match="draft=None: expected a loaded model"):
        Session(model, None)
    session = Session(model, draft, gamma=2, capacity=64)
    for bad, message in ((None, "the message is None"), (5, "the message is 5"), ([[5, 6]], "the message is nested"),
                         ([True, 5], "the message holds a bool")):
        with pytest.raises(ValueError, match=message):
            session.send_ids(bad, max_new_tokens=2)
    assert len(session.send_ids([5, 6], max_new_tokens=2)) == 2  # the refusals left the session usable
    for bad in (None, 5):
        with pytest.raises(ValueError, match=f"mesh={bad!r}: expected a jax.sharding.Mesh or a spec"):
            jsparse.on_mesh(model, bad)
    import jax

    # A Mesh of other axis names was taken (every weight copied whole) and generation failed inside JAX.
    other = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("batch", "tp"))
    with pytest.raises(ValueError, match=r"a mesh with axes \('batch', 'tp'\): expected the axes \('data', 'model'\)"):
        jsparse.on_mesh(model, other)
    with pytest.raises(ValueError, match="fuse='False': expected True, False or None"):
        jsparse.load("smollm2", fuse="False")
    with pytest.raises(ValueError, match="'foo=1' is not an option of a model spec: expected smollm2:layers=RANGES"):
        jsparse.load("smollm2:foo=1")
    with pytest.raises(ValueError, match="layers='1..3' is not a list of layers: expected smollm2:layers=RANGES"):
        jsparse.load("smollm2:layers=1..3")


def test_a_method_built_for_another_model_is_refused_before_it_runs(smollm2):
    """A method carrying another model's per-layer arrays (Kascade's roles and head maps, STS's head map, an
    EvoSparse layout, a TokenButler predictor) failed with a shape error deep in a kernel, or not at all; a
    dense_layers beyond the model's layers was clamped, leaving the budget unused."""
    from jsparse.api import generate_ids
    from jsparse.methods.evosparse import EvoSparse

    tiny = _tiny()
    kascade = jsparse.build_method("kascade", smollm2, budget=0.1, artifact=KASCADE_ARTIFACT)
    with pytest.raises(ValueError, match=r"Kascade holds per-layer arrays of shape \(30,\), but the model has 3 "
                                         "layers: it was built or calibrated for another model"):
        generate_ids(tiny, [[5, 6, 7]], method=kascade, max_new_tokens=2)
    from jsparse.methods.kascade import Kascade
    from jsparse.methods.tsa import TSA

    inner = Kascade.from_anchors(_tiny(layers=4).cfg, [0, 2], tile=16, budget=0.3, min_tokens=8)
    wrapped = TSA(tau=0.05, window=8, min_tokens=4, inner=inner, selection="kv_head", capacity_buckets=1,
                  sparse_layers=(1, 2))
    with pytest.raises(ValueError, match=r"Kascade holds per-layer arrays of shape \(4,\)"):  # named, not TSA
        generate_ids(tiny, [[5, 6, 7]], method=wrapped, max_new_tokens=2)
    for heads, kv_heads in ((6, 2), (8, 4)):  # the same layers; other groups, or the same group size over more heads
        other = EvoSparse.from_heads(_tiny(heads=heads, kv_heads=kv_heads).cfg, [(1, heads - 1)], budget_tokens=8,
                                     block_size=4, min_tokens=4)
        with pytest.raises(ValueError, match=rf"retrieval heads were placed for a model of Hq, Hkv = \({heads}, "
                                             rf"{kv_heads}\), but this model has Hq, Hkv = \(4, 2\)"):
            generate_ids(tiny, [[5, 6, 7]], method=other, max_new_tokens=2)
    own = EvoSparse.from_heads(tiny.cfg, [(1, 3)], budget_tokens=8, block_size=4, min_tokens=4)
    assert len(generate_ids(tiny, [[5, 6, 7]], method=own, max_new_tokens=2)[0]) == 2
    for given in (10, np.int64(4)):  # refused where the method is built for the model, and where it runs
        with pytest.raises(ValueError, match=rf"option dense_layers={given}: expected 0..3 \(the model's 3 layers"):
            jsparse.build_method("oracle", tiny, dense_layers=given)
        with pytest.raises(ValueError, match=rf"Oracle: dense_layers={given}: expected 0..3 \(the model's 3 layers\)"):
            generate_ids(tiny, [[5, 6]], method=jsparse.make_method("oracle", dense_layers=given), max_new_tokens=2)
    one = _tiny(layers=1)  # a default beyond a small model's layers (Quest's 2) still means all of them
    assert len(generate_ids(one, [[5, 6]], method="quest", max_new_tokens=2)[0]) == 2


@pytest.mark.parametrize("bad", [[], ["ok", 3], None])
def test_generate_rejects_non_prompts(smollm2, bad):
    with pytest.raises(ValueError, match="expected a str or a non-empty list of str"):
        jsparse.generate(smollm2, bad)


# 4 ------------------------------------------------------------------------------------ eval --out a file


def test_eval_out_existing_file_fails_before_loading(tmp_path, monkeypatch, capsys):
    from jsparse.cli import main

    def no_load(*a, **k):
        raise AssertionError("the model was loaded although --out is unusable")

    monkeypatch.setattr(jsparse, "load", no_load)
    existing = tmp_path / "results.txt"
    existing.write_text("keep me")
    rc = main(["eval", "--methods", "dense", "--tasks", "passkey", "--lengths", "256", "--out", str(existing),
               "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"--out '{existing}' is an existing file: expected a folder" in err
    assert existing.read_text() == "keep me"
    under_file = existing / "run"
    rc = main(["eval", "--methods", "dense", "--tasks", "passkey", "--lengths", "256", "--out", str(under_file),
               "--no-progress"])
    assert rc == 2 and "cannot make the folder" in capsys.readouterr().err


# 5 ------------------------------------------------------------------------------------ --samples too big


def test_samples_beyond_the_corpus_is_an_error_before_any_work(smollm2, tmp_path, monkeypatch, capsys):
    from eval import harness
    from jsparse.cli import main

    corpus = tmp_path / "short.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog. " * 40)  # ~400 tokens
    monkeypatch.setattr(jsparse, "load", lambda *a, **k: smollm2)

    def no_work(*a, **k):
        raise AssertionError("methods were built although --samples cannot be met")

    monkeypatch.setattr(harness, "build_methods", no_work)
    rc = main(["eval", "--methods", "dense", "--tasks", "ppl", "--lengths", "256", "--samples", "100000",
               "--corpus", str(corpus), "--out", str(tmp_path / "run"), "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--samples 100000: the corpus" in err and "distinct windows of length 256" in err


def test_overlapping_windows_warn(smollm2):
    from eval import ppl

    ids = np.arange(1000, dtype=np.int32) % 500 + 100
    assert ppl.check_windows(smollm2.tokenizer, ids, 256, 3) == 3
    with pytest.warns(UserWarning, match="the windows overlap"):
        rows = ppl.make_windows(smollm2.tokenizer, ids, 256, 5, seed=0)
    assert rows.shape == (5, 256)
    with pytest.raises(ValueError, match="--samples 746"):
        ppl.check_windows(smollm2.tokenizer, ids, 256, 746)


# 6 ------------------------------------------------------------------------------- cache keyed by content


def test_bundled_gguf_cache_is_shared_by_two_paths(tmp_path, monkeypatch):
    monkeypatch.setenv(bundled.CACHE_ENV, str(tmp_path / "cache"))
    src = bundled.resolve_model("smollm2").path
    link = tmp_path / "models" / "another-name.gguf"
    link.parent.mkdir()
    os.symlink(src, link)
    copy = tmp_path / "models" / "copy.gguf"
    shutil.copy(src, copy)
    keys = {bundled.cache_key(p, jnp.float32) for p in (src, link, copy)}
    assert len(keys) == 1
    assert bundled.cache_key(src, jnp.bfloat16) not in keys
    digests = (tmp_path / "cache" / bundled.DIGESTS).read_text()
    assert str(copy.resolve()) in digests  # each path's sha256 is remembered, so a second load does not rehash


def test_prompts_of_one_bucket_share_the_capacity_and_the_compilation():
    """20 and 60 tokens pad to 64; with 100 new tokens the default capacity came from the unpadded prompt (128 and
    256 rows), so the second compiled the loop again."""
    from jsparse.api import generate_ids
    from models.generate import _generate_tokens

    model = _tiny()
    generate_ids(model, [list(range(5, 25))], max_new_tokens=100)
    size = _generate_tokens._cache_size()
    out = generate_ids(model, [list(range(5, 65))], max_new_tokens=100)
    assert _generate_tokens._cache_size() == size and 1 <= len(out[0]) <= 100


def test_session_replies_of_one_bucket_share_the_compiled_loop():
    """A Session turn's max_new_tokens was static: 6, 7 and 8 new tokens compiled the speculative loop three times.
    Each reply still stops at its own count."""
    from jsparse.session import Session
    from models.speculative import loop_step

    from models.speculative import append_step

    model, draft = _tiny(), _tiny(layers=1, seed=1)
    session = Session(model, draft, gamma=2, capacity=256)
    session.send_ids([5, 6, 7, 8], max_new_tokens=6)
    session.send_ids([9, 10], max_new_tokens=6)
    size, appends = loop_step._cache_size(), append_step._cache_size()
    for n, msg in ((7, [11, 12, 13]), (8, list(range(20, 37)))):  # later messages of one bucket: no compile either
        reply = session.send_ids(msg, max_new_tokens=n)
        assert 1 <= len(reply) <= n
    assert loop_step._cache_size() == size and append_step._cache_size() == appends


def test_session_first_messages_of_one_bucket_share_the_compiled_prefill():
    """The first message is right-padded to its 64-token bucket (its length compiled the prefill each time); the
    replies equal generate's over the same prompt."""
    from jsparse.api import generate_ids
    from jsparse.session import Session
    from models.speculative import prefill_step

    model, draft = _tiny(), _tiny(layers=1, seed=1)
    Session(model, draft, gamma=2, capacity=256).send_ids(list(range(5, 15)), max_new_tokens=4)
    size = prefill_step._cache_size()
    for n in (20, 33):
        prompt = list(range(5, 5 + n))
        reply = Session(model, draft, gamma=2, capacity=256).send_ids(prompt, max_new_tokens=4)
        assert reply == generate_ids(model, [prompt], max_new_tokens=4)[0]
    assert prefill_step._cache_size() == size


STS_OPTIONS = {"sts": {}, "sts-per-layer": {"record_after_scan": False},
               "sts-first-step-mask": {"first_step_mask": True, "mask_pool": 2}}


@pytest.mark.parametrize("method", ["dense", "h2o", "quest", *STS_OPTIONS])
def test_a_padded_message_appends_as_the_message_alone(method):
    """spec_append with a message right-padded to its bucket (lengths traced) leaves the conversation where the
    unpadded message does: the same state, next token, cache lengths and following reply, the padding rows rolled
    back (H2O's accumulated scores through end_verify; Quest's page bounds) or, for an STS draft, left out of the
    record its target selects by (a Session compiled its STS appends per message length before)."""
    import jax

    from jsparse.methods import make_method
    from models.generate import Sampling
    from models.speculative import append_step, loop_step, prefill_step

    model, draft = _tiny(), _tiny(layers=1, seed=1)
    if method in STS_OPTIONS:
        rng = np.random.default_rng(3)
        hm = np.stack([np.zeros((3, 4), np.int32), rng.integers(0, 4, (3, 4))], -1).astype(np.int32)
        m, d = make_method("sts", cfg=model.cfg, draft=draft, head_map=hm, budget=0.2, min_tokens=4, tile=16,
                           **STS_OPTIONS[method]).for_round(draft.cfg, 2)
    else:
        m = make_method(method, **({} if method == "dense" else {"budget": 0.3, "min_tokens": 4}))
        d = make_method("dense")
    common = dict(t_cfg=model.cfg, d_cfg=draft.cfg, sampling=Sampling())
    prompt, msg = jnp.asarray([list(range(5, 65))], jnp.int32), [7, 8, 9, 10, 11, 40, 41, 42, 43]
    states, replies = [], []
    for padded in (False, True):
        s = prefill_step(model.params, draft.params, m, d, prompt, jnp.asarray([60]), jax.random.key(0),
                         capacity=256, **common)
        if padded:
            s = append_step(model.params, draft.params, m, d, s, jnp.asarray([msg + [0] * 55], jnp.int32),
                            jax.random.key(1), jnp.asarray([9], jnp.int32), **common)
        else:
            s = append_step(model.params, draft.params, m, d, s, jnp.asarray([msg], jnp.int32), jax.random.key(1),
                            **common)
        assert int(s.target.lengths[0]) == int(s.draft.lengths[0]) == 70  # the prompt, its reply's token, msg
        states.append(jax.tree.map(np.asarray, (s.d_state, s.t_state, s.tok, s.prev)))
        out, num, _, _, s = loop_step(model.params, draft.params, m, d, s, jax.random.key(2), gamma=2,
                                      max_new_tokens=8, eos_ids=(), **common)
        replies.append(np.asarray(out)[0, :int(num[0])].tolist())
    if method == "quest":  # the bounds of the page the padding reached hold it until a write there refreshes them
        states = [(d_s, jax.tree.map(lambda x: x[:, :, :, :70 // m.page_size], t_s), *rest)
                  for d_s, t_s, *rest in states]
    for got, want in zip(jax.tree.leaves(states[1]), jax.tree.leaves(states[0]), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert replies[0] == replies[1] and len(replies[0]) == 8


def test_speculative_max_new_tokens_of_one_bucket_share_the_compiled_rounds():
    """Speculative generate_ids: 5, 9 and 30 new tokens run one compilation (each compiled its own), each row
    stopping at its own count."""
    from jsparse.api import generate_ids
    from models.speculative import speculative_generate

    model, draft = _tiny(), _tiny(layers=1, seed=1)
    prompt = [list(range(5, 25))]
    longest = generate_ids(model, prompt, max_new_tokens=30, draft=draft, gamma=2)[0]
    size = speculative_generate._cache_size()
    for n in (5, 9):
        assert generate_ids(model, prompt, max_new_tokens=n, draft=draft, gamma=2)[0] == longest[:n]  # greedy
    assert speculative_generate._cache_size() == size


def test_load_names_an_unknown_dtype():
    """An unknown dtype is refused by name with the valid ones (a KeyError from the table before)."""
    with pytest.raises(ValueError, match=r"dtype='float16': expected one of \['bf16', 'bfloat16', 'f32', 'float32'\]"):
        jsparse.load("smollm2", dtype="float16")


class _CharTokenizer:
    """One character per token id (chr(id + 40)), `size` ids, eos_token_id as given, and with `bos` that id first
    when asked for special tokens."""

    def __init__(self, eos_token_id=None, size=128, bos=None):
        self.eos_token_id, self.size, self.bos = eos_token_id, size, bos

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [self.bos] * (add_special_tokens and self.bos is not None) + [ord(c) - 40 for c in text]}

    def __len__(self):
        return self.size

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i + 40) for i in ids)


def test_the_tokenizers_eos_ends_a_row():
    """eos_ids adds the tokenizer's eos (and the model's stop_ids) to the config's, once each, and generation stops
    at it: the row is the greedy row up to and including that token."""
    from jsparse.api import eos_ids, generate_ids

    model = _tiny()
    free = generate_ids(model, [[5, 6, 7]], max_new_tokens=6)[0]
    stop = free[2]
    assert 3 not in free and stop not in free[:2]  # the row reaches `stop` at its third token
    with_tok = dataclasses.replace(model, tokenizer=_CharTokenizer(eos_token_id=stop))
    assert eos_ids(with_tok) == (3, stop)
    assert eos_ids(dataclasses.replace(with_tok, stop_ids=(9, 3, stop))) == (3, 9, stop)
    assert generate_ids(with_tok, [[5, 6, 7]], max_new_tokens=6)[0] == free[:3]


def test_a_method_object_missing_decode_is_refused_by_name():
    from jsparse.api import generate_ids

    partial = types.SimpleNamespace(init_state=lambda *a, **k: None, prefill=lambda *a, **k: None)
    with pytest.raises(ValueError, match=r"method=namespace\(.*\): expected a method name"):
        generate_ids(_tiny(), [[5, 6]], method=partial, max_new_tokens=2)


def test_session_refuses_a_bad_gamma_by_name():
    from jsparse.session import Session

    for bad in (0, -1):
        with pytest.raises(ValueError, match=rf"gamma={bad}: expected an integer >= 1"):
            Session(_tiny(), _tiny(layers=2, seed=1), gamma=bad, capacity=64)


def test_a_draft_with_another_tokenizer_is_refused():
    """Same vocab_size in both configs, different tokenizers: refused naming both sizes."""
    from jsparse.api import generate_ids

    model = dataclasses.replace(_tiny(), tokenizer=_CharTokenizer(size=128))
    draft = dataclasses.replace(_tiny(layers=2, seed=1), tokenizer=_CharTokenizer(size=100))
    with pytest.raises(ValueError, match="draft tokenizer has 100 tokens, the target's 128: a draft must share"):
        generate_ids(model, [[5, 6]], max_new_tokens=2, draft=draft, gamma=2)


class _VocabTokenizer(_CharTokenizer):
    """A _CharTokenizer whose vocabulary (`get_vocab`) maps its characters from `offset` on."""

    def __init__(self, offset=40, **kw):
        super().__init__(**kw)
        self.offset = offset

    def get_vocab(self):
        return {chr(i + self.offset): i for i in range(self.size)}


def test_a_draft_with_another_vocabulary_of_the_same_size_is_refused():
    """Two tokenizers of 128 tokens each with other tokens at the same ids: the size alone passed (the draft proposed
    tokens of its own vocabulary, each rejected); now the first id that differs is named. The same vocabulary in two
    tokenizer objects (a target and a draft loaded apart) passes, and so does one object shared."""
    from jsparse.api import generate_ids

    model = dataclasses.replace(_tiny(), tokenizer=_VocabTokenizer(offset=40))
    other = dataclasses.replace(_tiny(layers=2, seed=1), tokenizer=_VocabTokenizer(offset=41))
    with pytest.raises(ValueError, match=r"draft tokenizer's token 0 is '\)', the target's '\(': a draft must share "
                                         r"the target's tokenizer \(the same number of tokens is not enough\)"):
        generate_ids(model, [[5, 6]], max_new_tokens=2, draft=other, gamma=2)
    same = dataclasses.replace(_tiny(layers=2, seed=1), tokenizer=_VocabTokenizer(offset=40))
    want = generate_ids(model, [[5, 6]], max_new_tokens=2)
    assert generate_ids(model, [[5, 6]], max_new_tokens=2, draft=same, gamma=2) == want
    shared = dataclasses.replace(_tiny(layers=2, seed=1), tokenizer=model.tokenizer)
    assert generate_ids(model, [[5, 6]], max_new_tokens=2, draft=shared, gamma=2) == want


def test_a_seed_at_temperature_0_warns_in_the_api_as_on_the_command_line():
    """`--seed` at temperature 0 warned on the command line only: generate and Session warn too."""
    from jsparse.api import generate_ids
    from jsparse.session import Session

    with pytest.warns(UserWarning, match="seed=5 has no effect at temperature 0") as caught:
        generate_ids(_tiny(), [[5, 6, 7]], max_new_tokens=2, seed=5)
    assert [w.filename for w in caught] == [__file__]
    with pytest.warns(UserWarning, match="seed=5 has no effect at temperature 0"):
        Session(_tiny(), _tiny(layers=2, seed=1), seed=5, capacity=64)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generate_ids(_tiny(), [[5, 6, 7]], max_new_tokens=2, seed=5, temperature=0.5)


def test_a_draft_off_the_targets_mesh_is_refused():
    from jsparse.api import generate_ids
    from jsparse.session import Session

    model, draft = _tiny(), _tiny(layers=2, seed=1)
    meshed = jsparse.on_mesh(model, "data=1,model=1")
    message = r"the target is on a mesh data=1,model=1 and the draft on one device \(no mesh\)"
    with pytest.raises(ValueError, match=message):
        generate_ids(meshed, [[5, 6]], max_new_tokens=2, draft=draft, gamma=2)
    with pytest.raises(ValueError, match=message):
        Session(meshed, draft, gamma=2, capacity=64)


def test_a_request_that_fills_the_drafts_context_exactly_runs():
    """prompt + max_new_tokens equal to the draft's context fits it (one more token is refused): greedy speculative
    output equals the target's own."""
    from jsparse.api import generate_ids

    model, draft = _tiny(), _tiny(layers=2, seed=1)
    short = dataclasses.replace(draft, cfg=dataclasses.replace(draft.cfg, max_position_embeddings=16))
    ids = [[5, 6, 7, 8]]
    assert generate_ids(model, ids, max_new_tokens=12, draft=short, gamma=2) == \
        generate_ids(model, ids, max_new_tokens=12)
    with pytest.raises(ValueError, match="is 17 tokens, longer than the draft's context of 16"):
        generate_ids(model, ids, max_new_tokens=13, draft=short, gamma=2)


def test_greedy_sampling_without_top_p_does_not_warn():
    from jsparse.api import sampling_of
    from models.generate import Sampling

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sampling_of(0.0, 1.0) == Sampling(0.0, 1.0)
        assert sampling_of(0.7, 0.5) == Sampling(0.7, 0.5)


def test_generate_text_leaves_out_the_eos():
    """generate's text is the row's tokens before the EOS: the EOS itself is not decoded into it."""
    from jsparse.api import generate_ids

    model = _tiny()
    free = generate_ids(model, [[ord(c) - 40 for c in "abc"]], max_new_tokens=6)[0]
    stop = free[2]
    assert 3 not in free and stop not in free[:2]
    text = jsparse.generate(dataclasses.replace(model, tokenizer=_CharTokenizer(stop)), "abc", max_new_tokens=6)
    assert text == "".join(chr(t + 40) for t in free[:2])


def test_a_capacity_that_holds_the_bucket_shares_the_compiled_rounds():
    """capacity = padded prompt (64) + the new-token bucket (NEW_TOKENS_BUCKET = 64) + gamma + 1 (3) = 131 rows
    holds the bucket's width exactly: 5 and 30 new tokens run one compilation, each row stopping at its own count."""
    from jsparse.api import generate_ids
    from models.generate import NEW_TOKENS_BUCKET
    from models.speculative import speculative_generate

    assert 64 + NEW_TOKENS_BUCKET + 3 == 131
    model, draft = _tiny(), _tiny(layers=1, seed=1)
    prompt = [list(range(5, 25))]
    longest = generate_ids(model, prompt, max_new_tokens=30, draft=draft, gamma=2, capacity=131)[0]
    size = speculative_generate._cache_size()
    assert generate_ids(model, prompt, max_new_tokens=5, draft=draft, gamma=2, capacity=131)[0] == longest[:5]
    assert speculative_generate._cache_size() == size


def test_session_text_reply_leaves_out_the_eos():
    from jsparse.api import generate_ids
    from jsparse.session import Session

    model = _tiny()
    free = generate_ids(model, [[ord(c) - 40 for c in "abc"]], max_new_tokens=4)[0]
    stop = free[1]
    assert 3 not in free[:2] and stop != free[0]
    chat = dataclasses.replace(model, tokenizer=_CharTokenizer(stop))
    assert Session(chat, chat, gamma=2, capacity=64).send("abc", max_new_tokens=4) == chr(free[0] + 40)


def test_session_text_adds_special_tokens_to_the_first_message_only():
    from jsparse.session import Session

    model = dataclasses.replace(_tiny(), tokenizer=_CharTokenizer(bos=1))
    s = Session(model, model, gamma=2, capacity=64)
    s.send("ab", max_new_tokens=2)
    assert s.tokens[:3] == [1, ord("a") - 40, ord("b") - 40]
    n = len(s.tokens)
    s.send("cd", max_new_tokens=2)
    assert s.tokens[n:n + 2] == [ord("c") - 40, ord("d") - 40]


def test_bool_option_of_a_wrapper_builder_is_refused_as_a_string():
    """A builder that is a function (the evosparse ablations): the bool options of the method it builds are checked
    after building, so 'False' (truthy) is refused, not silently read as True."""
    with pytest.raises(ValueError, match=r"method 'sink-local' option branchless='False': expected true or false"):
        make_method("sink-local", branchless="False")
    assert make_method("sink-local", branchless=False).branchless is False


def test_plain_bool_option_refuses_none():
    """None is allowed only for Optional[bool] options: a plain `bool` (sts.first_step_mask) given None is refused."""
    from jsparse.methods.base import check_options

    with pytest.raises(ValueError, match=r"method 'sts' option first_step_mask=None: expected true or false"):
        check_options("sts", {"first_step_mask": None})
    check_options("sts", {"first_step_mask": False})


def test_a_builders_catch_all_parameter_is_no_option():
    """method_options lists named parameters only: a builder's `**options` / `**unused` is not an option name."""
    assert "unused" not in method_options("dense") and "options" not in method_options("streaming")
    with pytest.raises(ValueError, match=r"method 'dense' takes no option 'unused'"):
        make_method("dense", unused=1)


def test_api_refuses_what_is_not_a_model_a_method_or_a_path():
    """A model's name where the loaded model goes, a method class, an artifact that is no path, a chat flag that is
    a string, a capacity no request can fill: each refused by name (they were attribute and type errors from deep
    inside, a chat template applied for chat="False", an out-of-memory error)."""
    from jsparse.artifacts import fingerprint
    from jsparse.methods.quest import Quest
    from jsparse.session import Session

    for call in (lambda: jsparse.generate("smollm2", "hi"), lambda: jsparse.build_method("quest", "smollm2"),
                 lambda: jsparse.generate_ids("smollm2", [[5, 6]])):
        with pytest.raises(ValueError, match=r"model='smollm2': expected a loaded model \(`jsparse.load"):
            call()
    with pytest.raises(ValueError, match=r"model='smollm2': expected a loaded model"):
        fingerprint("smollm2")
    model = _tiny()
    with pytest.raises(ValueError, match=r"method=<class .*Quest'>: expected a method name"):
        jsparse.generate_ids(model, [[5, 6, 7]], method=Quest, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"artifact=5: expected the path of an artifact folder"):
        jsparse.make_method("kascade", cfg=model.cfg, artifact=5)
    with pytest.raises(ValueError, match=r"method 'kascade' cfg='smollm2': expected a models.config.ModelConfig"):
        jsparse.make_method("kascade", cfg="smollm2", artifact="x")
    with pytest.raises(ValueError, match=r"method 'tsa' artifact='': expected an artifact folder's path, or "
                                         r"artifact=None"):
        jsparse.make_method("tsa", cfg=model.cfg, artifact="")
    with pytest.raises(ValueError, match=r"chat='False': expected True or False"):
        jsparse.encode(model, ["hi"], chat="False")
    with pytest.raises(ValueError, match=r"capacity=1000000: more KV cache rows than the model's context of 256 "
                                         r"tokens can fill; expected at most 256"):
        jsparse.generate_ids(model, [[5, 6, 7]], max_new_tokens=2, capacity=10 ** 6)
    assert len(jsparse.generate_ids(model, [[5, 6, 7]], max_new_tokens=2, capacity=256)[0]) <= 2
    with pytest.raises(ValueError, match=r"capacity=200000: more KV cache rows than the model's context of 256 tokens "
                                         r"can fill; expected at most 384"):
        Session(model, _tiny(layers=2, seed=1), gamma=2, capacity=200000)


def test_a_method_runs_only_on_the_model_its_artifact_was_calibrated_for(tmp_path):
    """A method built from an artifact remembers the fingerprint the artifact records: on another model of the same
    shape (a fine-tune, or make_method with cfg and no fingerprint) generate refuses it, naming both fingerprints."""
    from jsparse.artifacts import Artifact, ArtifactError, fingerprint, save_artifact
    from jsparse.session import Session

    model, other = _tiny(), _tiny(seed=1)
    L, Hkv = model.cfg.num_layers, model.cfg.num_kv_heads
    path = str(tmp_path / "k")
    save_artifact(path, Artifact(kind="kascade", fingerprint=fingerprint(model), arrays={
        "anchors": np.array([0, 1], np.int32), "head_map": np.tile(np.arange(Hkv, dtype=np.int32), (L, 1))}))
    built = jsparse.build_method("kascade", model, artifact=path)
    assert len(jsparse.generate_ids(model, [[5, 6, 7]], method=built, max_new_tokens=2)[0]) <= 2
    unchecked = jsparse.make_method("kascade", cfg=other.cfg, artifact=path)  # no fingerprint: built all the same
    for method in (built, unchecked):
        with pytest.raises(ArtifactError, match=rf"artifact at '{path}' was calibrated for model fingerprint "
                                                rf"'{fingerprint(model)}', but this model \(tiny\) has fingerprint "
                                                rf"'{fingerprint(other)}'"):
            jsparse.generate_ids(other, [[5, 6, 7]], method=method, max_new_tokens=2)
    with pytest.raises(ArtifactError, match="was calibrated for model fingerprint"):
        Session(other, _tiny(layers=2, seed=2), method=built, gamma=2, capacity=128)


def test_session_send_refuses_what_is_not_text(smollm2):
    from jsparse.session import Session

    session = Session(smollm2, smollm2, gamma=2, capacity=64)
    for bad in (None, "", [5, 6]):
        with pytest.raises(ValueError, match=r"text=.*: expected a non-empty str \(token ids go to `send_ids`\)"):
            session.send(bad)
    assert session.tokens == []  # nothing of the conversation changed

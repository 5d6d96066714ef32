"""`jsparse generate` and the generation API on bad input (audit 1208): each bad value is refused by name, and before
the model loads where the check needs no model (a typo should not cost an 8B load)."""

from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
import pytest

import jsparse
from jsparse.cli import main
from models import bundled
from models.config import ModelConfig
from models.generate import Sampling

SHIPPED = os.path.join(os.path.dirname(__file__), "..", "jsparse", "shipped", "smollm2")
BASE = ["generate", "--model", "smollm2", "--prompt", "Hello", "--max-new-tokens", "2"]


class _Loaded(Exception):
    """Raised by the stand-in for jsparse.load: the command got as far as loading the model."""


@pytest.fixture
def no_load(monkeypatch):
    def load(*args, **kwargs):
        raise _Loaded(args)

    monkeypatch.setattr(jsparse, "load", load)


def _tiny(layers=2, seed=0):
    from models.params import random_params

    cfg = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                      eos_token_ids=(3,))
    return bundled.LoadedModel(cfg=cfg, params=random_params(cfg, jax.random.key(seed), jnp.float32, scale=0.3),
                               tokenizer=None, name="tiny")


@pytest.mark.parametrize("extra, message", [
    # an artifact for a method that reads none; an empty or missing folder (each refused after the load before)
    (["--method", "dense", "--artifact", SHIPPED + "/tsa"], "--artifact .*/tsa: method 'dense' takes no artifact; "
                                                            "the methods that read one: butler"),
    (["--method", "oracle", "--artifact", "x"], "--artifact x: method 'oracle' takes no artifact"),
    (["--method", "kascade", "--artifact", ""], "--artifact '': expected an artifact folder's path"),
    (["--method", "kascade", "--artifact", "/nonexistent/k"], "--artifact /nonexistent/k: no artifact at "
                                                              "'/nonexistent/k': artifact.json is missing"),
    (["--method", "tsa+kascade", "--artifact", SHIPPED + "/kascade", "--artifact", "/nonexistent/t"],
     "--artifact /nonexistent/t: no artifact at"),
    # sts: a draft and its budget (a fraction in (0, 1] or a whole number of keys above 1)
    (["--method", "sts"], "--method sts takes its selection from a draft model: expected --draft SPEC"),
    (["--method", "sts", "--budget", "0", "--draft", "smollm2:layers=0-3"],
     r"--budget 0 with method 'sts': budget=0.0: expected a fraction of the context in \(0, 1\]"),
    (["--method", "sts", "--budget", "nan", "--draft", "smollm2:layers=0-3"], "--budget nan with method 'sts'"),
    (["--method", "sts", "--budget", "2.5", "--draft", "smollm2:layers=0-3"],
     "--budget 2.5 with method 'sts': budget=2.5: a budget above 1 counts tokens and must be a whole number"),
    # a wrapper that builds without the model shows it takes no budget; a plain builder's option values
    (["--method", "tsa", "--budget", "0.5"], "--budget 0.5: method 'tsa' takes no budget"),
    (["--method", "oracle", "--method-option", "oracle.tile=-3"], "tile=-3: expected an integer >= 1"),
    (["--method", "streaming", "--method-option", "streaming.sink=-1"], "sink=-1: expected an integer >= 0"),
    # the draft's spec (an empty one ran without speculative decoding; a missing one cost the target's load)
    (["--draft", ""], "--draft '': expected a model spec"),
    (["--draft", "/nonexistent/d.gguf", "--gamma", "2"], "--draft /nonexistent/d.gguf: GGUF file .* does not exist"),
    (["--draft", "bogus:layers=0-3"], "--draft bogus:layers=0-3: model 'bogus' not found"),
    (["--draft", "smollm2:layers=abc"], "--draft smollm2:layers=abc: .*layers='abc' is not a list of layers"),
    # a top-p that float32 holds as 0 (speculative sampling's probabilities came out NaN: token 0 every step)
    (["--temperature", "1", "--top-p", "1e-50"], r"top_p=1e-50: expected a value in \(0, 1\] of at least 1.18e-38"),
])
def test_generate_refuses_before_the_model_loads(no_load, capsys, extra, message):
    import re

    assert main(BASE + extra) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


@pytest.mark.parametrize("extra", [
    ["--method", "quest", "--budget", "0.3", "--method-option", "quest.page_size=16"],
    ["--method", "sts", "--budget", "2", "--draft", "smollm2:layers=0-3"],
    ["--method", "tsa", "--artifact", SHIPPED + "/tsa"],
    ["--method", "tsa+kascade", "--artifact", SHIPPED + "/kascade" + os.pathsep + SHIPPED + "/tsa"],
    ["--method", "sink-local", "--budget", "0.5"],
    ["--method", "oracle", "--budget-tokens", "5"],
    ["--temperature", "1", "--top-p", "1.2e-38"],
])
def test_valid_requests_reach_the_model_load(no_load, extra):
    """The checks moved before the load refuse nothing that loads and runs."""
    with pytest.raises(_Loaded):
        main(BASE + extra)


def test_top_p_at_temperature_0_is_warned_by_its_flag_before_the_load(monkeypatch, capsys):
    """It was the API's warning after the load, attributed to `<frozen runpy>` (or the console script) and naming
    top_p=0.5 rather than --top-p; now printed as --seed's is, and the API's is not repeated."""
    from jsparse.api import sampling_of

    order = []
    monkeypatch.setattr(jsparse, "load", lambda *a, **k: order.append("load") or _tiny())

    def generate(model, prompts, *, temperature, top_p, seed, **kwargs):
        sampling_of(temperature, top_p, seed)  # (warns of top_p and seed at temperature 0)
        return ["done"]

    monkeypatch.setattr(jsparse, "generate", generate)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(BASE + ["--top-p", "0.5", "--seed", "123456789012"]) == 0
    assert [str(w.message) for w in caught if "no effect at temperature 0" in str(w.message)] == []
    out = capsys.readouterr()
    assert out.out.strip() == "done" and order == ["load"]
    assert out.err.count("warning: --top-p 0.5 has no effect at temperature 0 (greedy decoding)") == 1
    assert "warning: --seed 123456789012 has no effect" in out.err  # (not 1.23457e+11)


def test_a_top_p_that_float32_holds_as_0_is_refused_in_speculative_decoding_too():
    """generate_ids(draft=..., temperature=1, top_p=1e-50) generated token 0 at every step after the first (the
    nucleus of NaN probabilities); the smallest normal float32 still samples the argmax (greedy's tokens)."""
    from jsparse.api import generate_ids

    for tiny in (1e-50, 1e-39, 0.0):
        with pytest.raises(ValueError, match=rf"top_p={tiny}: expected a value in \(0, 1\]"):
            Sampling(1.0, tiny)
    model, draft = _tiny(), _tiny(layers=1, seed=1)
    with pytest.raises(ValueError, match=r"top_p=1e-50: expected a value in \(0, 1\] of at least 1.18e-38"):
        generate_ids(model, [[5, 6, 7]], max_new_tokens=4, temperature=1.0, top_p=1e-50, draft=draft, gamma=2)
    greedy = generate_ids(model, [[5, 6, 7]], max_new_tokens=4, draft=draft, gamma=2)
    assert generate_ids(model, [[5, 6, 7]], max_new_tokens=4, temperature=1.0, top_p=1.2e-38, draft=draft,
                        gamma=2) == greedy
    assert 0 not in greedy[0][1:]  # (what the NaN nucleus drew)

"""Sliding-window attention: windows from HF configs, dense and Quest under a window, refusal of the methods that
do not honour one, and the request limits the low-level entry points (prefill, decode, their jitted steps) check.

Parity of windowed Mistral / Qwen2 / Qwen3 models with transformers is in test_parity_hf.py; here tiny random
models (models.params.random_params) with windows of 16 tokens over sequences of 40-48.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

import jsparse
from jsparse.artifacts import model_fingerprint
from jsparse.methods import make_method, method_names, window_methods
from jsparse.methods.quest import page_mask
from models import llama
from models.attention import LayerContext, LayerKV
from models.bundled import LoadedModel
from models.cache import init_cache
from models.config import ConfigError, ModelConfig
from models.generate import decode_step, prefill_step
from models.params import expected_shapes
from pallas_kernels.dense import dense_decode
from pallas_kernels.sparse_attention.reference import masked_attention_reference

# Jitted once here: eager calls of these compile every primitive on its own (slow on a loaded CPU).
page_mask = jax.jit(page_mask, static_argnums=(3, 4, 5))
masked_attention_reference = jax.jit(masked_attention_reference)

W = 16
BASE = dict(architecture="mistral", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
            num_kv_heads=2, head_dim=16, max_position_embeddings=96)
MIXED = ModelConfig(**{**BASE, "architecture": "qwen2"}, qkv_bias=True, sliding_window=W, layer_windows=(W, 0, W))
ALL = ModelConfig(**BASE, sliding_window=W)
FULL = ModelConfig(**BASE)


def _normal(seed, *shape, scale=1.0):
    """f32 normal samples from numpy (jax.random compiles per shape: seconds on a loaded CPU)."""
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.fixture(scope="module")
def params():
    """Random weights for MIXED (norms near 1); its qkv biases serve ALL and FULL too: one pytree for all three."""
    shapes = expected_shapes(MIXED)
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    named = jax.tree_util.tree_leaves_with_path(shapes, is_leaf=is_shape)
    leaves = [1.0 + _normal(i, *shape, scale=0.1) if "norm" in jax.tree_util.keystr(path)
              else _normal(i, *shape, scale=0.3) for i, (path, shape) in enumerate(named)]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes, is_leaf=is_shape), leaves)


def _tokens(B, T, seed=1):
    return jnp.asarray(np.random.default_rng(seed).integers(0, BASE["vocab_size"], (B, T)), jnp.int32)


def _prefill_logits(cfg, params, method, tokens, capacity=None):
    """(f32[B, T, V] logits at every position, cache, state) of a jitted prefill of the whole of tokens."""
    B, T = tokens.shape
    cache = init_cache(cfg, B, capacity or T, jnp.float32)
    logits, cache, state = prefill_step(params, method, tokens, jnp.full((B,), T, jnp.int32), cache,
                                        method.init_state(cfg, B, cache.capacity), cfg=cfg, all_logits=True)
    return np.asarray(logits), cache, state


# ----------------------------------------------------------------------------------------------- configs


def _hf_windows(config) -> tuple[int, ...]:
    """transformers' own per-layer windows (0 = full) from a config object's `layer_types`."""
    W_hf = config.sliding_window
    return tuple(W_hf if t == "sliding_attention" and W_hf is not None else 0 for t in config.layer_types)


@pytest.mark.parametrize("cls,kwargs", [
    (transformers.Qwen2Config, dict(use_sliding_window=True, sliding_window=32, max_window_layers=2)),
    (transformers.Qwen2Config, dict(use_sliding_window=False, sliding_window=32, max_window_layers=0)),
    (transformers.Qwen2Config, dict(use_sliding_window=True, sliding_window=32, max_window_layers=4)),
    (transformers.Qwen3Config, dict(use_sliding_window=True, sliding_window=24,
                                    layer_types=["full_attention", "sliding_attention"] * 2)),
    (transformers.Qwen3Config, dict(use_sliding_window=True, sliding_window=24, max_window_layers=1)),
])
def test_qwen_windows_follow_transformers(cls, kwargs):
    """Our per-layer windows equal the layer types transformers derives, from its saved config.json dict and from
    an older config.json without `layer_types` (then `max_window_layers` decides)."""
    hf = cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
             num_key_value_heads=1, **kwargs)
    expect = _hf_windows(hf)
    d = hf.to_dict()
    assert ModelConfig.from_hf(d).windows.tolist() == list(expect)
    if "max_window_layers" in kwargs:
        d.pop("layer_types")
        assert ModelConfig.from_hf(d).windows.tolist() == list(expect)
    cfg = ModelConfig.from_hf(d)
    assert cfg.window_size == (max(expect) or None)
    assert cfg.every_layer_windowed == (min(expect) > 0)


def test_mistral_and_llama_windows():
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                  num_key_value_heads=1)
    cfg = ModelConfig.from_hf(transformers.MistralConfig(sliding_window=40, **common).to_dict())
    assert cfg.layer_windows == (40, 40, 40) and cfg.every_layer_windowed and cfg.window_size == 40
    cfg = ModelConfig.from_hf(transformers.MistralConfig(sliding_window=None, **common).to_dict())
    assert cfg.layer_windows == () and cfg.window_size is None and cfg.windows.tolist() == [0, 0, 0]
    llama_dict = {**transformers.LlamaConfig(**common).to_dict(), "sliding_window": 8}  # Llama has no window
    assert ModelConfig.from_hf(llama_dict).window_size is None


def test_window_config_errors():
    qwen = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, use_sliding_window=True, sliding_window=8).to_dict()
    with pytest.raises(ConfigError, match="layer_types has 3 entries"):
        ModelConfig.from_hf({**qwen, "layer_types": ["full_attention"] * 3})
    with pytest.raises(ConfigError, match="chunked_attention"):
        ModelConfig.from_hf({**qwen, "layer_types": ["full_attention", "chunked_attention"]})
    with pytest.raises(ConfigError, match="sliding_window=0"):
        ModelConfig.from_hf({**qwen, "sliding_window": 0})
    with pytest.raises(ConfigError, match="expected 0 .full attention. or sliding_window=16"):
        ModelConfig(**BASE, sliding_window=W, layer_windows=(W, 8, 0))
    with pytest.raises(ConfigError, match="one per layer"):
        ModelConfig(**BASE, sliding_window=W, layer_windows=(W, 0))
    with pytest.raises(ConfigError, match="without a sliding_window"):
        ModelConfig(**BASE, layer_windows=(W, 0, 0))


def test_config_dict_round_trip_and_unchanged_fingerprints(params):
    for cfg in (MIXED, ALL, FULL):
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert "layer_windows" not in FULL.to_dict()  # models without a window keep their artifacts' fingerprints
    assert model_fingerprint(FULL, params) != model_fingerprint(ALL, params)


def test_layer_skipped_copy_keeps_each_layers_window(params):
    """`keep_layers` (the `SPEC:layers=` draft) keeps the windows of the layers it keeps."""
    from models.bundled import keep_layers

    model = LoadedModel(cfg=MIXED, params=params, tokenizer=None, name="mixed")
    assert keep_layers(model, [1, 2]).cfg.layer_windows == (0, W)
    assert keep_layers(model, [0, 2]).cfg.layer_windows == (W, W)
    one = keep_layers(model, [1]).cfg  # no kept layer is windowed: a model without a window
    assert one.sliding_window is None and one.layer_windows == ()
    assert keep_layers(LoadedModel(cfg=FULL, params=params, tokenizer=None, name="full"), [0]).cfg.layer_windows == ()


# ----------------------------------------------------------------------------------------------- attention


@pytest.mark.parametrize("T", [1, 3])
def test_dense_decode_window_matches_masked_reference(T):
    B, Hq, Hkv, N, D = 2, 4, 2, 40, 16
    q, k, v = _normal(3, B, T, Hq, D), _normal(4, B, Hkv, N, D), _normal(5, B, Hkv, N, D)
    lengths = jnp.array([37, 12])
    pos = np.asarray(lengths)[:, None] - T + np.arange(T)[None]  # [B, T]
    j = np.arange(N)
    windowed = jax.jit(lambda w: dense_decode(q, k, v, lengths, window=w))  # the window as data: one compile
    for window in (0, 5, 16):
        out = windowed(jnp.int32(window))
        mask = (j[None, None] <= pos[..., None]) & ((window == 0) | (j[None, None] > pos[..., None] - window))
        mask = np.broadcast_to(mask[:, None], (B, Hq, T, N))
        np.testing.assert_allclose(out, masked_attention_reference(q, k, v, jnp.asarray(mask)), atol=2e-5)
    np.testing.assert_allclose(windowed(jnp.int32(0)), jax.jit(dense_decode)(q, k, v, lengths), atol=2e-5)
    with pytest.raises(ValueError, match="window=-1"):
        dense_decode(q, k, v, lengths, window=-1)


def test_mixed_windows_prefill_equals_decode_and_differs_from_full(params):
    """Windowed and full layers mixed: all-position prefill logits equal teacher-forced decode logits (prefill 8,
    then steps of 1 and 3 tokens), and differ from the unwindowed model past the window."""
    T = 40
    tokens = _tokens(2, T)
    dense = make_method("dense")
    full_logits, _, _ = _prefill_logits(MIXED, params, dense, tokens)
    plain, _, _ = _prefill_logits(dataclasses.replace(MIXED, sliding_window=None, layer_windows=()), params, dense,
                                  tokens)
    np.testing.assert_allclose(plain[:, :W], full_logits[:, :W], atol=1e-4)
    assert np.abs(plain[:, W:] - full_logits[:, W:]).max() > 1e-2
    _, cache, _ = _prefill_logits(MIXED, params, dense, tokens[:, :8], capacity=48)
    pos = 8
    while pos < T:
        n = 1 if pos % 2 else 3
        logits, cache, _ = decode_step(params, dense, tokens[:, pos:pos + n], cache, None, cfg=MIXED)
        np.testing.assert_allclose(logits, full_logits[:, pos:pos + n], atol=1e-4)
        pos += n


def test_quest_selection_stays_in_the_window():
    """Quest's per-head page mask on a windowed layer is a subset of the window, a window of 0 changes nothing, and
    with the whole budget it is exactly the window."""
    B, T, Hq, Hkv, N, D = 2, 2, 4, 2, 96, 16
    q, k = _normal(6, B, T, Hq, D), _normal(7, B, Hkv, N, D)
    pos = jnp.array([[70, 71], [40, 41]])
    j = np.arange(N)
    in_window = (j[None, None] <= np.asarray(pos)[..., None]) & (j[None, None] > np.asarray(pos)[..., None] - 33)
    mask = np.asarray(page_mask(q, k, pos, 0.25, 0, 8, window=jnp.int32(33)))  # [B, Hq, T, N]
    assert not (mask & ~in_window[:, None]).any()
    assert mask.sum(-1).min() >= 8 and (mask.sum(-1) < in_window.sum(-1)[:, None]).all()  # selective, not empty
    np.testing.assert_array_equal(page_mask(q, k, pos, 0.25, 0, 8, window=jnp.int32(0)),
                                  page_mask(q, k, pos, 0.25, 0, 8))
    whole = np.asarray(page_mask(q, k, pos, 1.0, 0, 8, window=jnp.int32(33)))
    np.testing.assert_array_equal(whole, np.broadcast_to(in_window[:, None], whole.shape))


def test_quest_on_a_windowed_model_matches_its_masked_reference(params):
    """Quest's decode on a windowed layer equals dense attention over its own selection intersected with the
    window; on a windowed model with the whole budget its logits equal dense's (prefill is dense for both)."""
    k, v = _normal(8, 2, 1, 2, 48, 16), _normal(9, 2, 1, 2, 48, 16)
    q = _normal(10, 1, 1, 4, 16)  # the query at position 40 (after the write: lengths 41)
    quest = make_method("quest", budget=0.5, min_tokens=0, page_size=4, dense_layers=1)
    ctx = LayerContext(layer=jnp.int32(1), lengths=jnp.array([41]), window=jnp.int32(W), window_size=W,
                       every_layer_windowed=True)
    out, _ = jax.jit(quest.decode)(ctx, q, LayerKV(k=k[1], v=v[1], k_all=k, v_all=v, layer=jnp.int32(1)), None)
    mask = np.asarray(page_mask(q, k[1], jnp.array([[40]]), 0.5, 0, 4, window=jnp.int32(W)))  # [1, Hq, 1, N]
    j = np.arange(48)
    assert not (mask & ~((j <= 40) & (j > 40 - W))).any()
    # 8 of the 16 keys 25..40 from page 6's start (24): 3 pages, its own holding only key 40, page 6 keys 25-27.
    assert ((mask.sum(-1) >= 7) & (mask.sum(-1) <= 9)).all()
    np.testing.assert_allclose(out, masked_attention_reference(q, k[1], v[1], jnp.asarray(mask)), atol=1e-6)
    # Whole budget: Quest == dense on the windowed model (one dense prefill's cache serves both decodes).
    tokens = _tokens(1, 44, seed=5)
    dense = make_method("dense")
    _, cache, _ = _prefill_logits(ALL, params, dense, tokens[:, :40], capacity=48)
    quest_all = make_method("quest", budget=1.0, min_tokens=0, page_size=4)
    outs = [np.asarray(decode_step(params, m, tokens[:, 40:44], jax.tree_util.tree_map(jnp.copy, cache), None,
                                   cfg=ALL)[0]) for m in (quest_all, dense)]
    np.testing.assert_allclose(outs[0], outs[1], atol=2e-5)


def test_methods_without_window_support_are_refused(params):
    assert window_methods() == ["dense", "quest"]
    tokens = _tokens(1, 24)
    refused = [n for n in ("oracle", "streaming", "h2o") if n in method_names()]
    assert len(refused) >= 3
    past = init_cache(ALL, 1, 32, jnp.float32).replace(lengths=jnp.array([12]))
    for name in refused:
        m = make_method(name)
        with pytest.raises(ValueError, match=r"does not support sliding-window attention.*sliding_window=16 binds "
                                             r"here \(24 keys.*dense, quest"):
            _prefill_logits(ALL, params, m, tokens)
        with pytest.raises(ValueError, match="does not support sliding-window.*32 keys"):  # capacity 32 > W
            llama.decode(params, ALL, m, tokens[:, 12:13], past, m.init_state(ALL, 1, 32))
    # Within the window (prompt and cache capacity <= W) the window never binds: the method runs, exactly.
    m = make_method("oracle")
    logits, _, _ = _prefill_logits(ALL, params, m, tokens[:, :12], capacity=W)
    ref, _, _ = _prefill_logits(FULL, params, m, tokens[:, :12], capacity=W)
    np.testing.assert_allclose(logits, ref, atol=1e-6)


class _ByteTokenizer:
    """A stand-in tokenizer for `jsparse.generate`: one token per character (codes below the vocabulary)."""

    eos_token_id = None

    def __call__(self, text):
        return {"input_ids": [ord(c) % 100 + 4 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_generate_refuses_a_binding_window_for_other_methods(params):
    model = LoadedModel(cfg=ALL, params=params, tokenizer=_ByteTokenizer(), name="tiny-windowed")
    with pytest.raises(ValueError, match=r"Oracle does not support sliding-window.*20 tokens.*sliding_window=16.*"
                                         r"\['dense', 'quest'\]"):
        jsparse.generate(model, ["abcdefghijkl"], method="oracle", max_new_tokens=8)
    # Within the window the default capacity is capped at W (the window never binds) and the method runs.
    assert len(jsparse.generate(model, ["abcdefgh"], method="oracle", max_new_tokens=8)[0]) == 8


def test_capped_capacity_is_whole_blocks(params):
    """A window that is no multiple of EvoSparse's blocks of 16 (here 40): the default capacity was cut to 40, which
    EvoSparse then refused ("not a multiple of block_size=16") for a request the library had accepted. It is cut to
    the largest multiple of 16 that still holds the request (`window_capacity`), and the method runs."""
    from jsparse.api import window_capacity

    assert [window_capacity(40, n) for n in (0, 12, 32, 33, 40)] == [32, 32, 32, 40, 40]
    assert window_capacity(300, 100) == 256 and window_capacity(300, 260) == 288
    cfg = ModelConfig(**BASE, sliding_window=40)
    model = LoadedModel(cfg=cfg, params=params, tokenizer=None, name="tiny-window-40")
    method = jsparse.build_method("evosparse-noretrieval", model, budget=0.5)
    ids = [list(range(5, 25)), list(range(7, 12))]
    out = jsparse.generate_ids(model, ids, method=method, max_new_tokens=4)
    assert [len(row) for row in out] == [4, 4]
    session = jsparse.Session(model, model, method=method, gamma=2)
    assert session.capacity == 32
    assert len(session.send_ids(ids[1], max_new_tokens=4)) == 4


# ----------------------------------------------------------------------------------------------- request limits


def test_prefill_request_limits(params):
    dense = make_method("dense")
    tok = _tokens(2, 8)
    cache = init_cache(FULL, 2, 16, jnp.float32)
    cases = [
        (dict(tokens=tok, lengths=jnp.array([8]), cache=cache), r"lengths \(1,\): expected i32\[2\]"),
        (dict(tokens=tok, lengths=jnp.array([8, 8]), cache=init_cache(FULL, 3, 16, jnp.float32)),
         "cache batch 3 .* tokens batch 2"),
        (dict(tokens=_tokens(2, 20), lengths=jnp.array([20, 20]), cache=cache),
         "prompt of 20 tokens .* capacity of 16"),
        (dict(tokens=tok, lengths=jnp.array([8, 0]), cache=cache), r"lengths \[8, 0\]: expected every row in \[1, 8\]"),
        (dict(tokens=tok, lengths=jnp.array([9, 8]), cache=cache), r"lengths \[9, 8\]: expected every row in \[1, 8\]"),
        (dict(tokens=_tokens(1, 100), lengths=jnp.array([97]), cache=init_cache(FULL, 1, 128, jnp.float32)),
         r"\[1, 96\].*max_position_embeddings=96"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            llama.prefill(params, FULL, dense, kw["tokens"], kw["lengths"], kw["cache"], None)
    with pytest.raises(ValueError, match=r"lengths \[8, 0\]"):  # the jitted step checks before it runs
        prefill_step(params, dense, tok, jnp.array([8, 0]), init_cache(FULL, 2, 16, jnp.float32), None, cfg=FULL)
    # Under a trace the lengths cannot raise: the bad row gets NaN logits, the good row its logits.
    fn = jax.jit(lambda lengths: llama.prefill(params, FULL, dense, tok, lengths, cache, None)[0])
    good = np.asarray(fn(jnp.array([8, 5])))
    bad = np.asarray(fn(jnp.array([8, 0])))
    assert np.isfinite(good).all() and np.isnan(bad[1]).all()
    np.testing.assert_array_equal(bad[0], good[0])


def test_decode_request_limits(params):
    dense = make_method("dense")
    _, cache, _ = llama.prefill(params, FULL, dense, _tokens(2, 14), jnp.array([14, 10]),
                                init_cache(FULL, 2, 16, jnp.float32), None)
    with pytest.raises(ValueError, match="cache batch 2 .* tokens batch 1"):
        llama.decode(params, FULL, dense, _tokens(1, 1), cache, None)
    with pytest.raises(ValueError, match=r"cache lengths \[14, 10\] plus 3 new tokens.*within 16 tokens"):
        llama.decode(params, FULL, dense, _tokens(2, 3), cache, None)
    with pytest.raises(ValueError, match="20 new tokens exceed the limit of 16"):
        llama.decode(params, FULL, dense, _tokens(2, 20), cache, None)
    with pytest.raises(ValueError, match=r"cache lengths \[14, 10\] plus 3"):
        decode_step(params, dense, _tokens(2, 3), cache, None, cfg=FULL)
    big = init_cache(FULL, 1, 128, jnp.float32)
    big = dataclasses.replace(big, lengths=jnp.array([95]))
    with pytest.raises(ValueError, match="max_position_embeddings=96"):
        llama.decode(params, FULL, dense, _tokens(1, 2), big, None)
    logits, _, _ = llama.decode(params, FULL, dense, _tokens(2, 2), cache, None)  # 14 + 2 = 16 fits
    assert np.isfinite(np.asarray(logits)).all()
    # Traced: the queries whose writes fall past the cache (row 0: positions 14, 15 fit, 16 does not) get NaN.
    logits = np.asarray(jax.jit(lambda c: llama.decode(params, FULL, dense, _tokens(2, 3), c, None)[0])(cache))
    assert np.isnan(logits[0, 2]).all() and np.isfinite(logits[0, :2]).all() and np.isfinite(logits[1]).all()


def test_session_caps_its_capacity_at_the_window_as_generate_does(params):
    """A Session whose method does not honour windows got the default capacity (the context) and failed on every
    message, however short; its default is now cut to W as generate's, and a larger capacity is refused."""
    model = LoadedModel(cfg=ALL, params=params, tokenizer=None, name="tiny-windowed")
    session = jsparse.Session(model, model, method="h2o", gamma=2)
    assert session.capacity == W
    ids = [5, 6, 7, 8]
    assert session.send_ids(ids, max_new_tokens=4) == jsparse.generate_ids(model, [ids], method="h2o", draft=model,
                                                                           gamma=2, max_new_tokens=4)[0]
    assert jsparse.Session(model, model, gamma=2).capacity == 128  # dense honours the window: the context, to 128
    with pytest.raises(ValueError, match=r"H2O does not support sliding-window attention and capacity=64, more than "
                                         r"tiny-windowed's sliding_window=16; .*keep a value <= 16"):
        jsparse.Session(model, model, method="h2o", gamma=2, capacity=64)
    # 8 + 6 = 14 tokens fit the window; the gamma + 1 = 3 verification rows make 17: the refusal names them
    with pytest.raises(ValueError, match=r"needs 17 tokens \(prompt plus max_new_tokens plus gamma \+ 1 = 3 "
                                         r"verification rows\).*within 16 tokens \(a smaller gamma"):
        jsparse.generate_ids(model, [list(range(5, 13))], method="h2o", draft=model, gamma=2, max_new_tokens=6)


def test_session_default_capacity_is_the_smaller_of_the_context_and_the_window(params):
    """A window longer than the context (W=300, context 96) does not raise the default capacity past the context's
    128 rows: the window's whole blocks (256) are a cap, not a size."""
    model = LoadedModel(cfg=ModelConfig(**BASE, sliding_window=300), params=params, tokenizer=None, name="w300")
    assert jsparse.Session(model, model, method="h2o", gamma=2).capacity == 128
    assert jsparse.Session(model, model, method="h2o", gamma=2, capacity=64).capacity == 64


class _Ran(Exception):
    pass


def test_an_explicit_capacity_within_the_window_is_used_as_given(params, monkeypatch):
    """capacity=40 on a model with W=40 runs with a cache of 40 rows: only the default capacity is cut to the
    window's whole blocks (32 here), a user's capacity is not silently changed."""
    from jsparse import api

    seen = []

    def spy(*args, **kwargs):  # the capacity generate_ids runs with; nothing is compiled
        seen.append(kwargs["capacity"])
        raise _Ran

    monkeypatch.setattr(api, "generate_tokens", spy)
    model = LoadedModel(cfg=ModelConfig(**BASE, sliding_window=40), params=params, tokenizer=None, name="w40")
    for capacity in (40, 33, None):
        with pytest.raises(_Ran):
            jsparse.generate_ids(model, [list(range(5, 25))], method="oracle", max_new_tokens=4, capacity=capacity)
    assert seen == [40, 33, 32]


def test_prefill_within_the_window_runs_any_method_whatever_the_cache_capacity(params):
    """A prefill's queries see at most T keys, so a window W >= T never binds in it (`llama.binding_window(cfg,
    method, T)`), however large the cache: a method without window support prefills 12 tokens of a W = 16 model
    into a 32-row cache, with the logits of the same model without a window. (Its decode into that cache, whose
    queries may see 32 keys, is refused: test_methods_without_window_support_are_refused.)"""
    m = make_method("oracle")
    tokens = _tokens(1, 12)
    logits, _, _ = _prefill_logits(ALL, params, m, tokens, capacity=32)
    ref, _, _ = _prefill_logits(FULL, params, m, tokens, capacity=32)
    np.testing.assert_allclose(logits, ref, atol=1e-6)

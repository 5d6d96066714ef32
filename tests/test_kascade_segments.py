"""Kascade's decode scans each run of layers of one role apart (`Kascade.segments`): no `lax.switch` in the decode
program, and the same logits, cache and anchor indices as the one scan with the per-layer switch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsparse.methods.kascade import Kascade
from models import llama
from models.cache import init_cache
from models.config import ModelConfig
from models.params import random_params

B, N = 2, 128
CFG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=8,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, eos_token_ids=(3,))
ANCHORS = [0, 1, 2, 5]
HEAD_MAP = np.array([[0, 1], [1, 0], [0, 1], [1, 1], [1, 0], [0, 0], [1, 0], [0, 1]], np.int32)


def test_segments_are_the_runs_of_one_role():
    m = Kascade.from_anchors(CFG, ANCHORS, HEAD_MAP, budget=0.25, min_tokens=8, tile=16)
    assert m.anchor_layers == (0, 1, 2, 5)
    assert m.segments(CFG, "decode") == ((0, 1, "dense_anchor"), (1, 3, "anchor"), (3, 5, "reuse"),
                                         (5, 6, "anchor"), (6, 8, "reuse"))
    assert m.segments(CFG, "prefill") is None
    assert m.replace(anchor_layers=None).segments(CFG, "decode") is None
    assert Kascade.from_anchors(CFG, [0], anchor_layers=(0, 3)).anchor_layers == (0,)  # from the anchors given


def _decode(method, T):
    params = random_params(CFG, jax.random.key(0), jnp.float32, scale=0.3)
    toks = jax.random.randint(jax.random.key(1), (B, 96), 0, CFG.vocab_size)
    lengths = jnp.array([96, 71], jnp.int32)
    _, cache, _ = jax.jit(lambda p, t, l: llama.prefill(p, CFG, method, t, l, init_cache(CFG, B, N, jnp.float32),
                                                         None))(params, toks, lengths)
    new = jax.random.randint(jax.random.key(2), (B, T), 0, CFG.vocab_size)
    step = jax.jit(lambda p, t, c: llama.decode(p, CFG, method, t, c, None))
    text = step.lower(params, new, cache).as_text()
    logits, cache, _ = step(params, new, cache)
    return text, logits, cache


@pytest.mark.parametrize("T,reuse_scale", [(1, 1.0), (3, 1.0), (1, 2.0)])
def test_segmented_decode_equals_the_switch_in_every_layer(T, reuse_scale):
    seg = Kascade.from_anchors(CFG, ANCHORS, HEAD_MAP, budget=0.25, min_tokens=8, tile=16, reuse_scale=reuse_scale)
    text_s, logits_s, cache_s = _decode(seg, T)
    text_w, logits_w, cache_w = _decode(seg.replace(anchor_layers=None), T)
    assert "stablehlo.case" in text_w and "stablehlo.case" not in text_s
    assert text_s.count("stablehlo.while") == text_w.count("stablehlo.while") + 4  # 5 runs of layers, not 1
    np.testing.assert_allclose(np.asarray(logits_s), np.asarray(logits_w), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache_s.k), np.asarray(cache_w.k))
    np.testing.assert_array_equal(np.asarray(cache_s.lengths), np.asarray(cache_w.lengths))

"""Kascade's decode scans each run of layers of one role apart (`Kascade.segments`): no `lax.switch` in the decode
program, and the same logits, cache and anchor indices as the one scan with the per-layer switch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from host_rounding import assert_same_or_close
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
    with pytest.raises(ValueError, match=r"anchor_layers=\(0, 3\): .*set by the anchors"):  # not dropped silently
        Kascade.from_anchors(CFG, [0], anchor_layers=(0, 3))


def _decode(method, T):
    params = random_params(CFG, jax.random.key(0), jnp.float32, scale=0.3)
    toks = jax.random.randint(jax.random.key(1), (B, 96), 0, CFG.vocab_size)
    lengths = jnp.array([96, 71], jnp.int32)
    state = method.init_state(CFG, B, N) if hasattr(method, "init_state") else None
    _, cache, state = jax.jit(lambda p, t, l, s: llama.prefill(p, CFG, method, t, l,
                                                                init_cache(CFG, B, N, jnp.float32), s))(
        params, toks, lengths, state)
    new = jax.random.randint(jax.random.key(2), (B, T), 0, CFG.vocab_size)
    step = jax.jit(lambda p, t, c, s: llama.decode(p, CFG, method, t, c, s))
    text = step.lower(params, new, cache, state).as_text()
    logits, cache, _ = step(params, new, cache, state)
    return text, logits, cache


@pytest.mark.parametrize("T,reuse_scale", [(1, 1.0), (3, 1.0), (1, 2.0)])
def test_segmented_decode_equals_the_switch_in_every_layer(T, reuse_scale):
    seg = Kascade.from_anchors(CFG, ANCHORS, HEAD_MAP, budget=0.25, min_tokens=8, tile=16, reuse_scale=reuse_scale)
    text_s, logits_s, cache_s = _decode(seg, T)
    text_w, logits_w, cache_w = _decode(seg.replace(anchor_layers=None), T)
    assert "stablehlo.case" in text_w and "stablehlo.case" not in text_s
    assert text_s.count("stablehlo.while") == text_w.count("stablehlo.while") + 4  # 5 runs of layers, not 1
    # On the CPU the two programs round alike; a GPU's kernels fuse them differently (an H200: logits 3e-5 apart,
    # the written keys of later layers up to 2e-5).
    tol = 1e-5 if jax.default_backend() == "cpu" else 1e-4
    np.testing.assert_allclose(np.asarray(logits_s), np.asarray(logits_w), rtol=tol, atol=tol)
    assert_same_or_close(cache_s.k, cache_w.k, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(cache_s.lengths), np.asarray(cache_w.lengths))


def test_tsa_kascade_decodes_in_kascades_runs():
    """`tsa+kascade` decodes as Kascade: TSA hands on the inner method's runs of layers (no per-layer switch),
    with the logits of the same composition decoding in one scan with the switch (its inner Kascade without
    static anchors)."""
    from jsparse.methods.tsa import TSA

    kas = Kascade.from_anchors(CFG, ANCHORS, HEAD_MAP, budget=0.25, min_tokens=8, tile=16)
    both = TSA(inner=kas, selection="kv_head", min_tokens=8, window=16)
    assert both.segments(CFG, "decode") == kas.segments(CFG, "decode")
    assert both.segments(CFG, "prefill") is None and TSA().segments(CFG, "decode") is None
    text_t, logits_t, _ = _decode(both, 1)
    text_w, logits_w, _ = _decode(both.replace(inner=kas.replace(anchor_layers=None)), 1)
    assert "stablehlo.case" not in text_t and "stablehlo.case" in text_w
    assert text_t.count("stablehlo.while") == text_w.count("stablehlo.while") + 4
    np.testing.assert_allclose(np.asarray(logits_t), np.asarray(logits_w), rtol=1e-5, atol=1e-5)


def test_reuse_layers_hand_the_gathered_kernel_every_layers_head_map(monkeypatch):
    """Inside the layer scan a reuse layer gives the stacked gathered decode the whole head-map table [L, Hkv] (the
    kernel reads the layer's row itself), not its own row: the row's slice was an XLA kernel in every reuse layer of
    every GPU step (`eval/results/h100/headmap_ab/`). The GPU path is forced here (the kernel in interpret mode), and
    the logits equal the CPU path's."""
    from pallas_kernels.sparse_attention import api, stacked

    m = Kascade.from_anchors(CFG, ANCHORS, HEAD_MAP, budget=0.25, min_tokens=8, tile=16)
    _, want, _ = _decode(m, 1)
    seen = []
    kernel, pick = stacked.sparse_decode_stacked_gpu, api._pick

    def recording(*args, head_map=None, **kw):  # traced: the map's shape says whether it is the table or a row
        seen.append(None if head_map is None else tuple(head_map.shape))
        return kernel(*args, head_map=head_map, interpret=True, **kw)

    monkeypatch.setattr(stacked, "sparse_decode_stacked_gpu", recording)
    monkeypatch.setattr(api, "_pick", lambda impl, q, bs, tile, group=None: (
        "pallas_gpu" if tile is None and impl is None else pick(impl, q, bs, tile, group)))
    _, got, _ = _decode(m, 1)
    maps = [s for s in seen if s is not None]
    assert maps and all(s == (CFG.num_layers, CFG.num_kv_heads) for s in maps), seen  # the table, never a row
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)

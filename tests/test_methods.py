"""Every method equals a plain dense-masked reference over the keys it selects, and selects the right keys."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsparse.methods import make_method
from jsparse.methods.kascade import Kascade, KascadeState
from models.attention import LayerContext, LayerKV
from models.config import ModelConfig
from pallas_kernels.dense import dense_decode, dense_prefill
from pallas_kernels.sparse_attention.reference import masked_attention_reference
from jsparse.methods.quest import QuestState, finite_bounds, page_bounds, update_bounds

B, HQ, HKV, D = 2, 4, 2, 16
G = HQ // HKV
CFG = ModelConfig(architecture="llama", vocab_size=32, hidden_size=64, intermediate_size=64, num_layers=4,
                  num_heads=HQ, num_kv_heads=HKV, head_dim=D, max_position_embeddings=4096)


def _inputs(seed, N=96, T=1, lengths=(61, 96)):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, T, HQ, D), jnp.float32)
    k = jax.random.normal(ks[1], (B, HKV, N, D), jnp.float32)
    v = jax.random.normal(ks[2], (B, HKV, N, D), jnp.float32)
    return q, LayerKV(k=k, v=v), jnp.asarray(lengths, jnp.int32)


def _pooled_np(q, k, pos):
    """numpy: post-softmax weights summed over the GQA group, f64[B, Hkv, T, N]."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    Bq, T = q.shape[:2]
    N = k.shape[2]
    out = np.zeros((Bq, HKV, T, N))
    for b in range(Bq):
        for t in range(T):
            for h in range(HQ):
                s = k[b, h // G, : pos[b, t] + 1] @ q[b, t, h] / math.sqrt(D)
                p = np.exp(s - s.max())
                out[b, h // G, t, : pos[b, t] + 1] += p / p.sum()
    return out


def _topk_mask_np(scores, pos, budget, min_tokens, tile=32):
    """Top-k with the query's diagonal tile (keys tile_start(pos)..pos) first among the k, its most recent keys
    first when k is smaller (the query always attends itself)."""
    Bq, H, T, N = scores.shape
    mask = np.zeros(scores.shape, bool)
    for b in range(Bq):
        for t in range(T):
            n = pos[b, t] + 1
            kk = min(max(math.ceil(budget * n), min_tokens), n)
            for h in range(H):
                s = scores[b, h, t, :n].copy()
                start = (pos[b, t] // tile) * tile
                s[start:] = 1e9 + np.arange(start, n)
                order = np.argsort(-s, kind="stable")
                mask[b, h, t, order[:kk]] = True
    return mask


def _ctx(layer, lengths, info=None):
    return LayerContext(layer=jnp.int32(layer), lengths=lengths, info=info)


@pytest.mark.parametrize("T", [1, 3])
def test_oracle_decode_equals_masked_reference(T):
    q, cache, lengths = _inputs(0, T=T)
    m = make_method("oracle", budget=0.2, min_tokens=8)
    out, _ = m.decode(_ctx(1, lengths), q, cache, None)
    pos = np.asarray(lengths)[:, None] - T + np.arange(T)
    mask = _topk_mask_np(_pooled_np(q, cache.k, pos), pos, 0.2, 8)
    assert mask.sum(-1).min() < (pos % 32 + 1).max()  # some row's budget is smaller than its diagonal tile
    assert all(mask[b, :, t, pos[b, t]].all() for b in range(B) for t in range(T))  # ... and it attends itself
    want = masked_attention_reference(q, cache.k, cache.v, jnp.asarray(mask))
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)


def test_oracle_full_budget_equals_dense():
    q, cache, lengths = _inputs(1)
    m = make_method("oracle", budget=1.0, min_tokens=8)
    out, _ = m.decode(_ctx(2, lengths), q, cache, None)
    np.testing.assert_allclose(out, dense_decode(q, cache.k, cache.v, lengths), rtol=2e-5, atol=2e-5)
    T = 64
    ks = jax.random.split(jax.random.key(5), 3)
    qp = jax.random.normal(ks[0], (B, T, HQ, D))
    kp = jax.random.normal(ks[1], (B, T, HKV, D))
    vp = jax.random.normal(ks[2], (B, T, HKV, D))
    out, _ = m.prefill(_ctx(2, jnp.array([T, 50])), qp, kp, vp, None)
    np.testing.assert_allclose(out[0], dense_prefill(qp, kp, vp)[0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(out[1, :50], dense_prefill(qp, kp, vp)[1, :50], rtol=2e-5, atol=2e-5)


def test_dense_layers_are_dense():
    q, cache, lengths = _inputs(2)
    m = make_method("quest", budget=0.1, min_tokens=8)
    out, _ = m.decode(_ctx(1, lengths), q, cache, None)  # quest: layers 0-1 dense
    np.testing.assert_allclose(out, dense_decode(q, cache.k, cache.v, lengths), rtol=2e-5, atol=2e-5)


def test_streaming_decode_sink_and_window():
    q, cache, lengths = _inputs(3)
    m = make_method("streaming", budget=0.25, min_tokens=16, sink=4)
    out, _ = m.decode(_ctx(0, lengths), q, cache, None)
    mask = np.zeros((B, HKV, 1, 96), bool)
    for b, n in enumerate(np.asarray(lengths)):
        kk = min(max(math.ceil(0.25 * n), 16), n)
        mask[b, :, 0, :4] = True
        mask[b, :, 0, n - (kk - 4): n] = True
    want = masked_attention_reference(q, cache.k, cache.v, jnp.asarray(mask))
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("T", [1, 3])
def test_streaming_model_decode_builds_its_keys_once(monkeypatch, T):
    """Through the model, StreamingLLM's keys come from `start_rows` (built once per forward, the same in every
    layer) and equal those each layer would build; the state is None again after the forward."""
    from jsparse.methods.streaming import Streaming
    from models import llama
    from models.cache import init_cache
    from models.params import random_params

    params = random_params(CFG, jax.random.key(4), jnp.float32, scale=1.0)
    cache = init_cache(CFG, B, 96, jnp.float32)
    ks = jax.random.split(jax.random.key(6))
    cache = cache.replace(k=jax.random.normal(ks[0], cache.k.shape), v=jax.random.normal(ks[1], cache.v.shape),
                          lengths=jnp.array([50, 81], jnp.int32))
    m = make_method("streaming", budget=0.25, min_tokens=16, sink=4)
    tok = jnp.ones((B, T), jnp.int32)
    step = lambda: jax.jit(lambda p, t, c: llama.decode(p, CFG, m, t, c, None))(params, tok, cache)  # noqa: E731
    hoisted = step()
    assert hoisted[2] is None
    seen = []
    real = Streaming.sparse_decode

    def recorded(self, ctx, q, cache, state):
        seen.append(type(state).__name__)
        return real(self, ctx, q, cache, state)
    monkeypatch.setattr(Streaming, "sparse_decode", recorded)
    step()
    assert seen == ["StreamingState"]  # the layers read the forward's keys from the state
    monkeypatch.setattr(Streaming, "start_rows", lambda self, cfg, state, *a: state)  # each layer builds them
    per_layer = step()
    assert seen[-1] == "NoneType"
    np.testing.assert_array_equal(np.asarray(hoisted[0]), np.asarray(per_layer[0]))


@pytest.mark.parametrize("gathered", [False, True])
def test_quest_decode_pages(gathered):
    """Both decode paths against numpy: the mask (`page_mask`) and the gathered kernel in pages (one call per
    query head of each group, over `page_indices`)."""
    q, cache, lengths = _inputs(4, N=96)
    m = make_method("quest", budget=0.2, min_tokens=16, page_size=16, gathered=gathered)
    assert m.is_gathered(96) is gathered
    out, _ = m.decode(_ctx(3, lengths), q, cache, None)
    qn, kn = np.asarray(q, np.float64), np.asarray(cache.k, np.float64)
    mask = np.zeros((B, HQ, 1, 96), bool)
    for b, n in enumerate(np.asarray(lengths)):
        pos = n - 1
        kk = min(max(math.ceil(0.2 * n), 16), n)
        n_pages = -(-kk // 16)
        for h in range(HQ):
            scores = []
            for p in range(-(-n // 16)):
                kp = kn[b, h // G, p * 16: min(p * 16 + 16, n)]
                scores.append(np.sum(np.maximum(qn[b, 0, h] * kp.max(0), qn[b, 0, h] * kp.min(0))))
            scores = np.array(scores)
            scores[pos // 16] = np.inf
            for p in np.argsort(-scores, kind="stable")[:n_pages]:
                mask[b, h, 0, p * 16: min(p * 16 + 16, n)] = True
    want = masked_attention_reference(q, cache.k, cache.v, jnp.asarray(mask))
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)


def test_quest_sparsity_counts_the_keys_of_its_pages():
    """Quest's reported sparsity is the share of visible keys outside the pages `page_mask` keeps at each position
    (whole pages, its own partial), not the token rule's, which differs by up to a page either way."""
    from jsparse import selection as sel
    from jsparse.methods.quest import page_mask

    L, budget, min_tokens = 300, 0.1, 16
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, L, HQ, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, HKV, L, D)), jnp.float32)
    mask = np.asarray(page_mask(q, k, jnp.arange(L)[None], budget, min_tokens, 16))  # [1, Hq, T, N]
    kept = mask[0].sum(-1)  # [Hq, T]: the same count for every head
    assert (kept == kept[:1]).all()
    measured = np.mean(1.0 - kept[0] / np.arange(1, L + 1))
    m = make_method("quest", budget=budget, min_tokens=min_tokens, page_size=16)
    share = (CFG.num_layers - m.dense_layers) / CFG.num_layers
    assert m.achieved_sparsity(CFG, np.arange(L)) == pytest.approx(share * measured, rel=1e-9)
    assert abs(share * sel.topk_sparsity(budget, np.arange(L), min_tokens) - share * measured) > 1e-3


def test_quest_gathered_model_decode_equals_the_mask():
    """Through the model, step after step: the gathered decode (pages chosen from the state's page bounds, read
    from the stacked cache in place) equals the mask (bounds from the cache, no state), also after a T = 3 step
    (the mask path keeps the state), a rollback of 2 tokens (a rejected speculative round) and steps that enter
    new pages; the state's bounds equal the cache's on every written page of every sparse layer."""
    from jsparse.methods.quest import page_bounds
    from models import llama
    from models.cache import init_cache
    from models.params import random_params

    params = random_params(CFG, jax.random.key(4), jnp.float32, scale=1.0)
    T, N = 150, 192
    toks = jax.random.randint(jax.random.key(5), (B, T), 0, CFG.vocab_size)
    lengths = jnp.array([T, 97], jnp.int32)
    new, old = (make_method("quest", budget=0.2, min_tokens=16, gathered=g) for g in (True, False))
    fresh = new.init_state(CFG, B, N)  # two buffers: a step that donates its state donates each once
    assert fresh.kmin.unsafe_buffer_pointer() != fresh.kmax.unsafe_buffer_pointer()
    _, cache, state = jax.jit(lambda p, t, l: llama.prefill(p, CFG, new, t, l, init_cache(CFG, B, N, jnp.float32),
                                                            new.init_state(CFG, B, N)))(params, toks, lengths)
    step_new = jax.jit(lambda p, t, c, s: llama.decode(p, CFG, new, t, c, s), donate_argnums=(2, 3))
    step_old = jax.jit(lambda p, t, c: llama.decode(p, CFG, old, t, c, None)[0])

    def bounds_match(cache, state):
        for layer in range(new.dense_layers, CFG.num_layers):
            want = page_bounds(cache.k[layer], cache.lengths, 16)
            for b, n in enumerate(np.asarray(cache.lengths)):
                P = -(-int(n) // 16)
                for got_, want_ in zip((state.kmin, state.kmax), want):
                    np.testing.assert_array_equal(got_[layer, b, :, :P], want_[b, :, :P], err_msg=f"layer {layer}")

    bounds_match(cache, state)
    for i, (n_new, rollback) in enumerate([(1, 0), (3, 0), (1, 2), (1, 0), (3, 0), (1, 0)]):
        if rollback:  # a rejected round: the rows' lengths move back, the keys written past them stay
            cache = cache.replace(lengths=cache.lengths - rollback)
        tok = jax.random.randint(jax.random.key(20 + i), (B, n_new), 0, CFG.vocab_size)
        want = step_old(params, tok, cache)
        got, cache, state = step_new(params, tok, cache, state)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"step {i}")
        bounds_match(cache, state)


def test_quest_gathered_needs_whole_pages():
    m = make_method("quest", budget=0.2, min_tokens=16, page_size=16, gathered=True)
    with pytest.raises(ValueError, match="capacity N=100 is not a multiple of page_size=16"):
        m.is_gathered(100)
    q, cache, lengths = _inputs(4, N=96)
    with pytest.raises(ValueError, match="Quest state of 4 pages for a cache of 96 keys.*must be the cache capacity"):
        m.sparse_decode(_ctx(3, lengths), q, cache, m.init_state(CFG, B, 64))
    assert make_method("quest", gathered=None).is_gathered(100) is False  # on the CPU, and not whole pages


def test_quest_gathered_default_on_a_gpu_needs_whole_pages(monkeypatch):
    """gathered=None: the gathered kernel on a GPU only where page_size divides the cache (it reads whole pages);
    the mask elsewhere."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    m = make_method("quest", page_size=16)
    assert m.is_gathered(96) is True
    assert m.is_gathered(100) is False


def test_quest_prefill_refuses_a_state_smaller_than_the_prompt():
    T = 40  # 3 pages of 16; a state of max_len 32 holds 2
    q = jnp.zeros((1, T, HQ, D), jnp.float32)
    k = jnp.zeros((1, T, HKV, D), jnp.float32)
    m = make_method("quest", page_size=16)
    with pytest.raises(ValueError, match=r"a prefill of 40 tokens fills 3 pages of 16; the Quest state holds 2: "
                                         r"init_state\(max_len\) must be the cache capacity"):
        m.prefill(_ctx(1, jnp.asarray([T], jnp.int32)), q, k, k, m.init_state(CFG, 1, 32))


def test_quest_decode_refuses_a_state_of_another_capacity():
    """A state made for 112 keys (7 pages) read beside a cache of 96 (6 pages): refused by name, not run on the
    mask path with bounds of other pages."""
    q, cache, lengths = _inputs(4, N=96)
    m = make_method("quest", budget=0.2, min_tokens=16, page_size=16, gathered=False)
    with pytest.raises(ValueError, match=r"Quest state of 7 pages for a cache of 96 keys in pages of 16: "
                                         r"init_state\(max_len\) must be the cache capacity"):
        m.decode(_ctx(3, lengths), q, cache, m.init_state(CFG, B, 112))


def test_quest_prefill_bounds_are_of_the_keys_the_cache_holds():
    """With a bf16 cache (ctx.kv_dtype) the prefill's page bounds are those of the keys rounded to bf16, as the
    cache holds them and as the decode recomputes them (numpy reference over each page's valid keys)."""
    T, lengths = 40, jnp.asarray([40, 27], jnp.int32)
    k = jax.random.normal(jax.random.key(3), (B, T, HKV, D), jnp.float32) * 3.0
    q = jax.random.normal(jax.random.key(4), (B, T, HQ, D), jnp.float32)
    m = make_method("quest", budget=0.2, min_tokens=16, page_size=16)
    ctx = LayerContext(layer=jnp.int32(1), lengths=lengths, kv_dtype=jnp.bfloat16)
    _, st = m.prefill(ctx, q, k, k, m.init_state(CFG, B, 48))
    kb = np.asarray(k.astype(jnp.bfloat16).astype(jnp.float32))
    assert not np.array_equal(kb, np.asarray(k))  # the rounding changes the keys
    for b, n in enumerate(np.asarray(lengths)):
        for p in range(3):
            keys = kb[b, p * 16: min(p * 16 + 16, n)]  # [*, Hkv, D]; none: bounds 0 (QuestState)
            want_min, want_max = (keys.min(0), keys.max(0)) if len(keys) else (np.zeros((HKV, D)),) * 2
            np.testing.assert_array_equal(st.kmin[1, b, :, p], want_min, err_msg=f"row {b} page {p}")
            np.testing.assert_array_equal(st.kmax[1, b, :, p], want_max, err_msg=f"row {b} page {p}")


def test_page_bounds_take_only_the_keys_below_the_length():
    """Per-page min / max over the keys below the row's length only; +inf / -inf for a page holding none."""
    rng = np.random.default_rng(0)
    k = rng.uniform(1.0, 2.0, size=(2, 1, 20, 3)).astype(np.float32)  # all positive: a 0 fill would show
    k[:, :, 18:] = 100.0  # past row 0's length
    lengths = np.array([18, 8])
    kmin, kmax = (np.asarray(a) for a in page_bounds(jnp.asarray(k), jnp.asarray(lengths), 8))
    for b, n in enumerate(lengths):
        for p in range(3):
            keys = k[b, 0, p * 8: min(p * 8 + 8, n)]
            want_min = keys.min(0) if len(keys) else np.full(3, np.inf)
            want_max = keys.max(0) if len(keys) else np.full(3, -np.inf)
            np.testing.assert_array_equal(kmin[b, 0, p], want_min, err_msg=f"row {b} page {p}")
            np.testing.assert_array_equal(kmax[b, 0, p], want_max, err_msg=f"row {b} page {p}")


def test_kascade_decode_anchor_and_reuse():
    q, cache, lengths = _inputs(6)
    head_map = np.array([[0, 1], [1, 0], [0, 1], [1, 1]], np.int32)
    m = Kascade.from_anchors(CFG, [0, 2], head_map, budget=0.2, min_tokens=8)
    info = m.layer_info(CFG)
    state = m.start(CFG, m.init_state(CFG, B, 96), "decode", B, 1, 96)
    pos = np.asarray(lengths)[:, None] - 1
    outs = []
    for layer in range(4):
        layer_info = jax.tree_util.tree_map(lambda x: x[layer], info)
        out, state = m.decode(_ctx(layer, lengths, layer_info), q, cache, state)
        outs.append(out)
    anchor_mask = _topk_mask_np(_pooled_np(q, cache.k, pos), pos, 0.2, 8)  # same q and cache in every layer
    np.testing.assert_allclose(outs[0], dense_decode(q, cache.k, cache.v, lengths), rtol=2e-5, atol=2e-5)
    for layer, src_layer in [(1, 0), (2, 2), (3, 2)]:
        hm = head_map[layer] if layer != src_layer else np.arange(HKV)
        want = masked_attention_reference(q, cache.k, cache.v, jnp.asarray(anchor_mask[:, hm]))
        np.testing.assert_allclose(outs[layer], want, rtol=2e-5, atol=2e-5, err_msg=f"layer {layer}")
    assert isinstance(m.finish(state, "decode"), KascadeState)


def test_kascade_prefill_anchor_equals_masked_reference():
    T, tile = 128, 32
    ks = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(ks[0], (B, T, HQ, D))
    k = jax.random.normal(ks[1], (B, T, HKV, D))
    v = jax.random.normal(ks[2], (B, T, HKV, D))
    lengths = jnp.array([T, 100])
    m = Kascade.from_anchors(CFG, [0, 1], None, budget=0.25, min_tokens=8, tile=tile)
    info = jax.tree_util.tree_map(lambda x: x[1], m.layer_info(CFG))
    state = m.start(CFG, m.init_state(CFG, B, T), "prefill", B, T, T)
    out, state = m.prefill(_ctx(1, lengths, info), q, k, v, state)
    # numpy: pooled over group and tile (the rows below the row's length), keys before the tile, rolling budget,
    # plus the diagonal tile.
    probs = _pooled_np(q, jnp.swapaxes(k, 1, 2), np.tile(np.arange(T), (B, 1)))  # [B, Hkv, T, T]
    probs = np.where((np.arange(T)[None, :] < np.asarray(lengths)[:, None])[:, None, :, None], probs, 0.0)
    mask = np.zeros((B, HKV, T, T), bool)
    for i in range(T // tile):
        s = i * tile
        pooled = probs[:, :, s: s + tile].sum(2)  # [B, Hkv, T]
        kk = min(max(math.ceil(0.25 * s), 8), s)
        for b in range(B):
            for h in range(HKV):
                chosen = np.argsort(-pooled[b, h, :s], kind="stable")[:kk]
                for r in range(s, s + tile):
                    mask[b, h, r, chosen] = True
                    mask[b, h, r, s: r + 1] = True
    want = masked_attention_reference(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), jnp.asarray(mask))
    np.testing.assert_allclose(out[0], want[0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(out[1, :100], want[1, :100], rtol=2e-5, atol=2e-5)


def test_method_argument_errors():
    with pytest.raises(ValueError, match="budget=1.5"):
        make_method("oracle", budget=1.5)
    with pytest.raises(ValueError, match="budget=0"):
        make_method("kascade_unknown" if False else "oracle", budget=0.0)
    with pytest.raises(ValueError, match="tile=48"):
        make_method("oracle", tile=48)
    with pytest.raises(ValueError, match="unknown attention method 'nope'"):
        make_method("nope")
    with pytest.raises(ValueError, match="layer 0 must be an anchor"):
        Kascade.from_anchors(CFG, [1, 2])
    for anchors in ([0.4, 2], [0, True]):  # read as anchors (0, 2) and (0, 1) before
        with pytest.raises(ValueError, match="expected integer layer indices"):
            Kascade.from_anchors(CFG, anchors)
    for scale in (0.5, float("nan"), "2"):  # 0.5 ran with reuse layers keeping fewer keys; "2" failed later
        with pytest.raises(ValueError, match="reuse_scale=.*expected a finite number >= 1"):
            Kascade.from_anchors(CFG, [0, 1], reuse_scale=scale)
    assert Kascade.from_anchors(CFG, np.array([0, 2]), reuse_scale=2).reuse_scale == 2.0
    with pytest.raises(ValueError, match="calibration artifact"):
        make_method("kascade", cfg=CFG)
    # a head map value of Hkv (one past the last head) was accepted; the gather clamped it to head Hkv - 1
    with pytest.raises(ValueError, match=r"head_map values span \[0, 2\]: expected \[0, 2\)"):
        Kascade.from_anchors(CFG, [0, 2], np.array([[0, 1], [0, 2], [0, 1], [1, 0]]))
    for bad in (0.0, 0):  # recent=0 ran as a window of one key (row_budget's floor of 1)
        with pytest.raises(ValueError, match=rf"recent={bad!r}: expected the recent window's share of the budget "
                                             r"in \(0, 1\]"):
            make_method("h2o", recent=bad)
    for name in ("quest", "h2o", "oracle"):  # dense_layers=-1 ran every layer sparse without a word
        with pytest.raises(ValueError, match=r"dense_layers=-1: expected an integer >= 0"):
            make_method(name, dense_layers=-1)
    with pytest.raises(ValueError, match=r"sink=-1: expected an integer >= 0"):
        make_method("streaming", budget=0.25, min_tokens=16, sink=-1)


def test_options_given_as_none_take_the_defaults():
    """An option given as None means "not given" (a CLI flag left out): the method's default applies."""
    m = make_method("quest", page_size=None, min_tokens=None, budget=None, dense_layers=None)
    assert (m.page_size, m.min_tokens, m.budget, m.dense_layers) == (16, 128, 0.1, 2)
    assert make_method("h2o", recent=None, gathered=None).recent == 0.5


def test_real_options_take_numpy_scalars():
    """A numpy float (np.float32 from a config array) is a number like any other: refused before as 'out of range'
    by h2o's recent, EvoSparse's decay and its budget fractions."""
    f = np.float32
    assert make_method("h2o", recent=f(0.5)).recent == 0.5
    evo = make_method("evosparse-noretrieval", decay=f(0.5), sink_fraction=f(0.25), local_fraction=0.25,
                      heat_fraction=0.5)
    assert evo.decay == 0.5 and type(evo.decay) is float
    assert make_method("tsa", tau=f(0.25)).tau == 0.25
    assert Kascade.from_anchors(CFG, [0, 1], reuse_scale=f(2)).reuse_scale == 2.0
    for bad in (np.bool_(True), f("nan"), f(1.5)):
        with pytest.raises(ValueError, match="recent=.*expected the recent window's share"):
            make_method("h2o", recent=bad)


@pytest.mark.parametrize("B,T,Hq,Hkv,tile", [(2, 1, 4, 2, None), (2, 37, 4, 2, 8), (1, 300, 9, 3, None),
                                            (1, 64, 4, 4, 64), (2, 129, 6, 2, 128)])
def test_tiled_causal_attention_matches_full_causal_attention(B, T, Hq, Hkv, tile):
    """The CPU prefill path (query tiles against the keys up to each tile's end) equals XLA's full masked causal
    attention, with tiles dividing T or not, one tile, GQA groups of 1-3; bf16 stays bf16."""
    from pallas_kernels.dense import tiled_causal_attention

    ks = jax.random.split(jax.random.key(T), 3)
    q = jax.random.normal(ks[0], (B, T, Hq, D), jnp.float32)
    k = jax.random.normal(ks[1], (B, T, Hkv, D), jnp.float32)
    v = jax.random.normal(ks[2], (B, T, Hkv, D), jnp.float32)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    np.testing.assert_allclose(tiled_causal_attention(q, k, v, tile=tile), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dense_prefill(q, k, v), want, rtol=1e-5, atol=1e-5)
    if jax.default_backend() == "cpu":  # the CPU's prefill is the tiled path, bit for bit
        np.testing.assert_array_equal(dense_prefill(q, k, v), tiled_causal_attention(q, k, v))
    low = tiled_causal_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), tile=tile)
    assert low.dtype == jnp.bfloat16
    np.testing.assert_allclose(low.astype(jnp.float32), want, rtol=0, atol=5e-2)


def test_tiled_causal_attention_tiles_and_errors():
    from pallas_kernels.dense import CAUSAL_TILE, MAX_CAUSAL_TILES, causal_tile, tiled_causal_attention

    assert causal_tile(2069) == CAUSAL_TILE and causal_tile(CAUSAL_TILE * MAX_CAUSAL_TILES) == CAUSAL_TILE
    big = causal_tile(131072)
    assert big % 128 == 0 and -(-131072 // big) <= MAX_CAUSAL_TILES
    q = jnp.zeros((1, 8, 3, D))
    with pytest.raises(ValueError, match="3 heads, not a multiple of the 2 KV heads"):
        tiled_causal_attention(q, jnp.zeros((1, 8, 2, D)), jnp.zeros((1, 8, 2, D)))
    with pytest.raises(ValueError, match="tile=0: expected >= 1"):
        tiled_causal_attention(q, q, q, tile=0)


def test_prefill_exact_scores_in_chunks_equal_the_full_map():
    """Oracle's tile-pooled prefill scores and H2O's prefill column sums, computed chunk by chunk of query rows
    (T = 300: two chunks of 256 rows, the second short), equal the full [T, T] probabilities' (padding rows of a
    short prompt excluded from H2O's sums)."""
    from jsparse import selection as sel

    T, tile = 300, 32
    assert sel.PROB_CHUNK_ROWS < T
    ks = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(ks[0], (B, T, HQ, D), jnp.float32)
    k = jax.random.normal(ks[1], (B, T, HKV, D), jnp.float32)
    v = jax.random.normal(ks[2], (B, T, HKV, D), jnp.float32)
    full = sel.pooled_probs(q, jnp.swapaxes(k, 1, 2), jnp.broadcast_to(jnp.arange(T), (B, T)))  # [B, Hkv, T, T]
    padded = jnp.pad(full, ((0, 0), (0, 0), (0, -T % tile), (0, 0)))
    want = padded.reshape(B, HKV, -1, tile, T).sum(axis=3)
    np.testing.assert_allclose(sel.prefill_tile_probs(q, k, tile), want, rtol=1e-5, atol=1e-6)
    lengths = jnp.asarray([T, 211], jnp.int32)
    h2o = make_method("h2o", budget=0.1)
    ctx = LayerContext(layer=jnp.int32(2), lengths=lengths)
    out, state = h2o.prefill(ctx, q, k, v, h2o.init_state(CFG, B, 384))
    rows = (jnp.arange(T)[None, :] < lengths[:, None])[:, None, :, None]
    want = jnp.sum(jnp.where(rows, full, 0.0), axis=2) / G  # [B, Hkv, T], the mean over the GQA group
    np.testing.assert_allclose(state.score[2, :, :, :T], want, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(state.score[2, :, :, T:]).max()) == 0.0 and float(jnp.abs(state.score[1]).max()) == 0.0
    np.testing.assert_allclose(out, dense_prefill(q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,bands", [(32, 3), (64, 8), (256, 8), (512, 2)])
def test_causal_prob_fold_equals_the_full_map(rows, bands):
    """selection.causal_prob_fold: chunks of query rows in `bands` scans (T = 300 padded up to whole chunks, a
    band's keys cut at its last chunk's end) visit every row's exact weights once: their column sums and row
    sums equal the full map's, and the padding rows past T are visited too (for fn to drop)."""
    from jsparse import selection as sel

    T = 300
    ks = jax.random.split(jax.random.key(5), 2)
    q = jax.random.normal(ks[0], (B, T, HQ, D), jnp.float32)
    k = jax.random.normal(ks[1], (B, T, HKV, D), jnp.float32)
    full = sel.pooled_probs(q, jnp.swapaxes(k, 1, 2), jnp.broadcast_to(jnp.arange(T), (B, T)))  # [B, Hkv, T, T]
    n = -(-T // rows)

    def fn(c, s, probs):  # probs: [B, Hkv, rows, W]
        colsum, rowsum = c
        W = probs.shape[3]
        real = (s + jnp.arange(rows) < T)[None, None, :, None]
        colsum = colsum + jnp.pad(jnp.where(real, probs, 0.0).sum(axis=2), ((0, 0), (0, 0), (0, T - W)))
        rowsum = jax.lax.dynamic_update_slice_in_dim(rowsum, probs.sum(axis=3), s, axis=2)
        return colsum, rowsum

    init = (jnp.zeros((B, HKV, T), jnp.float32), jnp.zeros((B, HKV, n * rows), jnp.float32))
    colsum, rowsum = jax.jit(lambda q, k: sel.causal_prob_fold(q, k, fn, init, rows=rows, bands=bands))(q, k)
    np.testing.assert_allclose(colsum, full.sum(axis=2), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rowsum, np.full((B, HKV, n * rows), float(G)), rtol=1e-5)  # every row, G each
    with pytest.raises(ValueError, match="bands=0"):
        sel.causal_prob_fold(q, k, fn, init, bands=0)


def _causal_prob_chunks_unrolled(q, k, rows=256):
    """The prefill's exact causal pooled weights as H2O and the oracle computed them before causal_prob_fold
    (selection.causal_prob_chunks, removed): chunks of query rows in an unrolled Python loop, rows s..e-1 against
    the keys 0..e-1. Yields (s, e, probs f32[B, Hkv, e - s, e])."""
    from jsparse import selection as sel

    Bq, T = q.shape[:2]
    kh = jnp.swapaxes(k, 1, 2)
    for s in range(0, T, rows):
        e = min(s + rows, T)
        positions = jnp.broadcast_to(jnp.arange(s, e, dtype=jnp.int32), (Bq, e - s))
        yield s, e, sel.pooled_probs(q[:, s:e], kh[:, :, :e], positions)


def _prefill_tile_probs_unrolled(q, k, tile):
    """selection.prefill_tile_probs as it was before causal_prob_fold: f32[B, Hkv, ceil(T / tile), T]."""
    Bq, T = q.shape[:2]
    out = []
    for s, e, probs in _causal_prob_chunks_unrolled(q, k, max(1, 256 // tile) * tile):
        n = -(-(e - s) // tile)
        probs = jnp.pad(probs, ((0, 0), (0, 0), (0, n * tile - (e - s)), (0, T - e)))
        out.append(probs.reshape(Bq, probs.shape[1], n, tile, T).sum(axis=3))
    return jnp.concatenate(out, axis=2)


def _h2o_prefill_score_unrolled(q, k, lengths):
    """H2O's prefill column sums as computed before causal_prob_fold: the unrolled chunks (f32[B, Hkv, T])."""
    T = q.shape[1]
    colsum = jnp.zeros((q.shape[0], k.shape[2], T), jnp.float32)
    for s, e, probs in _causal_prob_chunks_unrolled(q, k):
        valid_rows = jnp.arange(s, e)[None, :] < lengths[:, None]
        part = jnp.sum(jnp.where(valid_rows[:, None, :, None], probs, 0.0), axis=2)
        colsum = colsum + jnp.pad(part, ((0, 0), (0, 0), (0, T - e)))
    return colsum / G  # the mean over the GQA group


def test_h2o_long_prefill_equals_the_unrolled_chunks():
    """T = 2100: 9 chunks of 256 rows in 8 scans (one of two chunks, the last chunk short): H2O's prefill score
    equals the unrolled chunks' (its implementation before) and its output dense attention."""
    T = 2100
    ks = jax.random.split(jax.random.key(4), 3)
    q = jax.random.normal(ks[0], (B, T, HQ, D), jnp.float32)
    k = jax.random.normal(ks[1], (B, T, HKV, D), jnp.float32)
    v = jax.random.normal(ks[2], (B, T, HKV, D), jnp.float32)
    lengths = jnp.asarray([T, 1777], jnp.int32)
    h2o = make_method("h2o", budget=0.1)
    out, state = jax.jit(lambda q, k, v: h2o.prefill(_ctx(1, lengths), q, k, v, h2o.init_state(CFG, B, T + 4)))(
        q, k, v)
    want = jax.jit(_h2o_prefill_score_unrolled)(q, k, lengths)
    np.testing.assert_allclose(state.score[1, :, :, :T], want, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(state.score[1, :, :, T:]).max()) == 0.0 and float(jnp.abs(state.score[0]).max()) == 0.0
    np.testing.assert_allclose(out, dense_prefill(q, k, v), rtol=1e-5, atol=1e-5)


def test_h2o_prefill_score_memory_is_a_chunk_not_the_map():
    """The compiled prefill score of H2O at T = 8192 (lowered and compiled on the CPU, not run) holds a few chunks
    of weights, not the [B, Hq, T, T] f32 map (nor the half of it that the unrolled chunks kept live)."""
    from jsparse import selection as sel

    T = 8192
    q = jax.ShapeDtypeStruct((B, T, HQ, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((B, T, HKV, D), jnp.bfloat16)
    lengths = jnp.full((B,), T, jnp.int32)
    h2o = make_method("h2o", budget=0.1)
    state = h2o.init_state(CFG, B, T)
    temp = jax.jit(lambda q, k: h2o.prefill(_ctx(1, lengths), q, k, k, state)[1]).lower(q, k).compile() \
        .memory_analysis().temp_size_in_bytes
    full_map = B * HQ * T * T * 4
    chunk = B * HQ * sel.PROB_CHUNK_ROWS * T * 4  # one chunk's f32 weights at the widest band
    assert temp < 4 * chunk <= full_map / 8, (temp, chunk, full_map)


@pytest.mark.parametrize("tile", [16, 32, 512])
def test_prefill_tile_probs_equal_the_unrolled_chunks(tile):
    """T = 2100 (tile 16, 32: 9 chunks of 256 rows in 8 scans, the last chunk 52 rows and its last tile short;
    tile 512: 5 chunks of one tile, the last 52 rows): prefill_tile_probs through causal_prob_fold equals the
    unrolled chunks (its implementation before), and so do the oracle's prefill indices (select_prefill)."""
    from jsparse import selection as sel
    from jsparse.methods.oracle import select_prefill

    T = 2100
    ks = jax.random.split(jax.random.key(6), 2)
    q = jax.random.normal(ks[0], (B, T, HQ, D), jnp.float32)
    k = jax.random.normal(ks[1], (B, T, HKV, D), jnp.float32)
    got = jax.jit(lambda q, k: sel.prefill_tile_probs(q, k, tile))(q, k)
    want = jax.jit(lambda q, k: _prefill_tile_probs_unrolled(q, k, tile))(q, k)
    assert got.shape == want.shape == (B, HKV, -(-T // tile), T)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(got.sum(axis=3) - jnp.minimum(tile, T - jnp.arange(got.shape[2]) * tile) * G).max()) < 1e-3
    tile_budget = sel.budget_tokens(0.1, sel.tile_starts(T, tile), 16)
    K = int(sel.budget_tokens(0.1, T, 16))
    idx = jax.jit(lambda q, k: select_prefill(q, k, tile, tile_budget, K))(q, k)
    scores = sel.before_tile_scores(want, tile)
    want_idx = sel.topk_indices(scores, tile_budget[None, None, :], K)
    np.testing.assert_array_equal(idx, want_idx)
    assert int((idx >= 0).sum(axis=-1).max()) > 0


def test_oracle_prefill_scores_memory_is_a_chunk_not_the_map():
    """The compiled prefill selection of the oracle (select_prefill, tile 32) at T = 8192, lowered and compiled on
    the CPU, not run, holds the [B, Hkv, nT, T] result and a few chunks of weights, not the [B, Hq, T, T] f32 map
    (nor the 60% of it that the unrolled chunks kept live: 1.30 GB here)."""
    from jsparse import selection as sel
    from jsparse.methods.oracle import select_prefill

    T, tile = 8192, 32
    q = jax.ShapeDtypeStruct((B, T, HQ, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((B, T, HKV, D), jnp.bfloat16)
    tile_budget = sel.budget_tokens(0.1, sel.tile_starts(T, tile), 128)
    K = int(sel.budget_tokens(0.1, T, 128))
    temp = jax.jit(lambda q, k: select_prefill(q, k, tile, tile_budget, K)).lower(q, k).compile() \
        .memory_analysis().temp_size_in_bytes
    full_map = B * HQ * T * T * 4
    chunk = B * HQ * sel.PROB_CHUNK_ROWS * T * 4  # one chunk's f32 weights at the widest band
    result = B * HKV * (T // tile) * T * 4
    assert temp < 4 * chunk + result <= full_map / 6, (temp, chunk, result, full_map)


@pytest.mark.parametrize("sink, min_tokens", [(16, 16), (1, 0), (1, 1)])
def test_streaming_refuses_a_sink_of_min_tokens_or_more(sink, min_tokens):
    """A sink as large as min_tokens would leave a row at min_tokens keys no recent window, not even its own key."""
    with pytest.raises(ValueError, match="expected fewer sink tokens than min_tokens"):
        make_method("streaming", budget=0.25, min_tokens=min_tokens, sink=sink)


def test_streaming_accepts_a_sink_below_min_tokens():
    assert make_method("streaming", budget=0.25, min_tokens=16, sink=15).sink == 15


@pytest.mark.parametrize("start, T", [(15, 2), (14, 5), (8, 17), (30, 3)])
def test_update_bounds_refreshes_every_page_the_new_tokens_touch(start, T):
    """A forward of T new tokens (a speculative verification) that straddles a page boundary refreshes the bounds of
    every page its tokens fall in."""
    B, Hkv, N, D, ps, L = 2, 2, 64, 8, 16, 3
    k = jax.random.normal(jax.random.key(0), (B, Hkv, N, D), jnp.float32)
    lengths = jnp.full((B,), start + T, jnp.int32)
    P = N // ps
    state = QuestState(kmin=jnp.zeros((L, B, Hkv, P, D)), kmax=jnp.zeros((L, B, Hkv, P, D)))
    new = update_bounds(state, jnp.int32(1), k, lengths, T, ps)
    want_min, want_max = finite_bounds(*page_bounds(k, lengths, ps))
    for p in range(start // ps, (start + T - 1) // ps + 1):  # every page holding a new token
        np.testing.assert_array_equal(new.kmin[1, :, :, p], want_min[:, :, p])
        np.testing.assert_array_equal(new.kmax[1, :, :, p], want_max[:, :, p])
    np.testing.assert_array_equal(new.kmin[0], 0.0)  # other layers untouched


def _kept_share_np(budget, positions, min_tokens):
    """numpy: mean over the rows at `positions` of the share of visible keys a top-k row skips (k from the
    docstring rule min(max(ceil(budget * n), min_tokens), n), budgets exact in binary)."""
    n = np.asarray(positions) + 1
    k = np.minimum(np.maximum(np.ceil(budget * n), min_tokens), n)
    return float(np.mean(1.0 - k / n))


def test_oracle_prefill_is_sparse_from_layer_dense_layers_on():
    """TokenBudget.prefill: layers 0 .. dense_layers - 1 dense, layer dense_layers already sparse."""
    T, lengths = 64, jnp.asarray([64, 50], jnp.int32)
    ks = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(ks[0], (B, T, HQ, D), jnp.float32)
    k = jax.random.normal(ks[1], (B, T, HKV, D), jnp.float32)
    v = jax.random.normal(ks[2], (B, T, HKV, D), jnp.float32)
    m = make_method("oracle", budget=0.125, min_tokens=4, tile=16, dense_layers=1)
    dense = dense_prefill(q, k, v)
    sparse, _ = m.sparse_prefill(_ctx(1, lengths), q, k, v, None)
    assert float(jnp.abs(sparse[0] - dense[0]).max()) > 1e-2  # the budget binds: the two differ
    out0, _ = jax.jit(m.prefill)(_ctx(0, lengths), q, k, v, None)
    out1, _ = jax.jit(m.prefill)(_ctx(1, lengths), q, k, v, None)
    np.testing.assert_allclose(out0, dense, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(out1, sparse, rtol=2e-5, atol=2e-5)


def test_oracle_sparsity_counts_only_its_sparse_layers():
    """achieved_sparsity averages over all layers, the dense_layers first ones skipping nothing."""
    pos = np.arange(100)
    for dense_layers in (0, 1, 3):
        m = make_method("oracle", budget=0.125, min_tokens=4, dense_layers=dense_layers)
        want = (CFG.num_layers - dense_layers) / CFG.num_layers * _kept_share_np(0.125, pos, 4)
        assert m.achieved_sparsity(CFG, pos) == pytest.approx(want, rel=1e-9)


def test_kascade_sparsity_counts_anchors_at_budget_and_reuse_layers_at_r_budget():
    """Layer 0 dense, the anchor (layer 2) at budget, the reuse layers (1, 3) at min(r * budget, 1)."""
    pos = np.arange(200)
    m = Kascade.from_anchors(CFG, [0, 2], budget=0.125, min_tokens=4, reuse_scale=2.0)
    want = (_kept_share_np(0.125, pos, 4) + 2 * _kept_share_np(0.25, pos, 4)) / 4
    assert m.achieved_sparsity(CFG, pos) == pytest.approx(want, rel=1e-9)
    m = Kascade.from_anchors(CFG, [0, 2], budget=0.625, reuse_scale=2.0)  # r * budget is capped at 1
    assert m.reuse_budget == 1.0
    assert m.layer_budgets() == [None, 1.0, 0.625, 1.0]


def test_streaming_prefill_sink_and_window_before_each_tile():
    """Prefill: every query attends to the sinks and the k - sink keys just before its tile (k by the budget rule
    over the tile's start), plus its own tile causally; numpy mask against the masked reference."""
    T, tile = 96, 32
    ks = jax.random.split(jax.random.key(8), 3)
    q = jax.random.normal(ks[0], (B, T, HQ, D))
    k = jax.random.normal(ks[1], (B, T, HKV, D))
    v = jax.random.normal(ks[2], (B, T, HKV, D))
    m = make_method("streaming", budget=0.25, min_tokens=8, sink=4, tile=tile)
    out, _ = m.prefill(_ctx(0, jnp.array([T, T])), q, k, v, None)
    mask = np.zeros((B, HKV, T, T), bool)
    for p in range(T):
        s = (p // tile) * tile
        kk = min(max(math.ceil(0.25 * s), 8), s)  # keys before the tile
        if kk >= s:
            mask[:, :, p, :s] = True
        else:
            mask[:, :, p, :4] = True
            mask[:, :, p, s - (kk - 4): s] = True
        mask[:, :, p, s: p + 1] = True  # the diagonal tile, causal
    assert mask[0, 0, 64].sum() < 64  # the last tile's window is sparse: keys 4..47 are skipped
    want = masked_attention_reference(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), jnp.asarray(mask))
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("seed, lengths, options, kept", [
    (3, (61, 96), dict(min_tokens=16), [16, 24]),  # no `sink` option: the default 4 (README)
    (5, (65, 89), dict(min_tokens=8, sink=4), [17, 23])])  # 16 and 22 if the query were not counted
def test_streaming_decode_keeps_the_sinks_and_the_recent_keys(seed, lengths, options, kept):
    """Decode keeps keys 0..3 and the k - 4 most recent, k = min(max(ceil(budget * n), min_tokens), n) over the
    n = position + 1 visible keys (the new token's own included)."""
    q, cache, lengths = _inputs(seed, lengths=lengths)
    m = make_method("streaming", budget=0.25, **options)
    out, _ = m.decode(_ctx(0, lengths), q, cache, None)
    mask = np.zeros((B, HKV, 1, 96), bool)
    for b, n in enumerate(np.asarray(lengths)):
        kk = min(max(math.ceil(0.25 * n), options["min_tokens"]), n)
        mask[b, :, 0, :4] = True
        mask[b, :, 0, n - (kk - 4): n] = True
    assert mask[:, 0, 0].sum(-1).tolist() == kept
    want = masked_attention_reference(q, cache.k, cache.v, jnp.asarray(mask))
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)

"""EvoSparse's fast decode path: the sort-free merge and the scatter-add heat step against NumPy, the branchless
layer (the GPU default) equal to the lax.cond layer in dense, inheriting and retrieval layers (T = 1 and 3,
outputs and state), and a branchless model decode with no conditional in its program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsparse.methods.evosparse import EvoSparse, heat_update
from pallas_kernels.block_scores.xla import merge_disjoint
from models import llama
from models.attention import LayerContext, LayerKV
from models.cache import init_cache
from models.config import ModelConfig
from models.params import random_params

B, HQ, HKV, D, N = 2, 4, 2, 16, 128
CFG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=5,
                  num_heads=HQ, num_kv_heads=HKV, head_dim=D, max_position_embeddings=512, eos_token_ids=(3,))
HEADS = [(1, 0), (3, 2), (3, 3)]  # layer 1 (dense) computes a set, 2 inherits, 3 computes, 4 inherits


def test_merge_disjoint_and_heat_update_match_numpy():
    rng = np.random.default_rng(0)
    rows, W, width, nb = 16, 12, 10, 40
    cand = np.full((rows, W), -1, np.int32)
    for r in range(rows):
        n = rng.integers(0, width + 1)
        vals = rng.choice(nb, n, replace=False)
        slots = rng.choice(W, n, replace=False)
        cand[r, slots] = vals
    got = np.asarray(merge_disjoint(jnp.asarray(cand), width))
    for r in range(rows):
        want = sorted(cand[r][cand[r] >= 0])
        np.testing.assert_array_equal(got[r], want + [-1] * (width - len(want)))
    # The heat step over the merged (ascending, -1 padded) blocks: decay * heat + the values in their blocks.
    vals = rng.normal(size=(rows, width)).astype(np.float32)
    heat = rng.random((rows, nb)).astype(np.float32)
    new = np.asarray(heat_update(jnp.asarray(heat), jnp.asarray(got), jnp.asarray(vals), 0.5))
    want = 0.5 * heat
    for r in range(rows):
        for c, x in zip(got[r], vals[r]):
            if c >= 0:
                want[r, c] += x
    np.testing.assert_allclose(new, want, rtol=1e-6, atol=1e-6)


@jax.jit
def _layer(m, layer, lengths, q, k, v, state):
    info = jax.tree_util.tree_map(lambda x: x[layer], m.layer_info(CFG))
    ctx = LayerContext(layer=jnp.int32(layer), lengths=lengths, info=info)
    return m.decode(ctx, q, LayerKV(k=k[layer], v=v[layer], k_all=k, v_all=v, layer=jnp.int32(layer)), state)


@pytest.mark.parametrize("T", [1, 3])
def test_branchless_layer_equals_cond_layer(T):
    ks = jax.random.split(jax.random.key(T), 4)
    q = jax.random.normal(ks[0], (B, T, HQ, D))
    k = jax.random.normal(ks[1], (CFG.num_layers, B, HKV, N, D))
    v = jax.random.normal(ks[2], (CFG.num_layers, B, HKV, N, D))
    lengths = jnp.array([77, 128], jnp.int32)
    kw = dict(budget_tokens=40, block_size=8)
    cond, flat = EvoSparse.from_heads(CFG, HEADS, branchless=False, **kw), EvoSparse.from_heads(CFG, HEADS, **kw)
    flat = flat.replace(branchless=True)
    assert flat.is_branchless and not cond.is_branchless
    heat = jax.random.uniform(ks[3], cond.init_state(CFG, B, N).heat.shape)
    state = cond.start(CFG, cond.init_state(CFG, B, N).replace(heat=heat), "decode", B, T, N)
    for layer in range(CFG.num_layers):  # dense (0, 1: 1 computes a set), inherit (2, 4), compute (3)
        o1, s1 = _layer(cond, layer, lengths, q, k, v, state)
        o2, s2 = _layer(flat, layer, lengths, q, k, v, state)
        np.testing.assert_allclose(o2, o1, rtol=1e-5, atol=1e-5, err_msg=f"layer {layer}")
        np.testing.assert_allclose(s2.heat, s1.heat, rtol=1e-5, atol=1e-7, err_msg=f"layer {layer}")
        np.testing.assert_array_equal(s2.retrieval, s1.retrieval, err_msg=f"layer {layer}")
        changed = np.flatnonzero(np.any(np.asarray(s1.heat) != np.asarray(state.heat), axis=(1, 2, 3)))
        assert list(changed) == ([] if layer < 2 else [layer])  # dense layers keep their heat
        state = s1


def _program(m):
    """(lowered text, (logits, cache, state)) of one model decode step on a filled cache (real selections)."""
    params = random_params(CFG, jax.random.key(0), jnp.float32, scale=0.4)
    cache = init_cache(CFG, B, N, jnp.float32)
    ks = jax.random.split(jax.random.key(1))
    cache = cache.replace(k=jax.random.normal(ks[0], cache.k.shape), v=jax.random.normal(ks[1], cache.v.shape),
                          lengths=jnp.array([90, 100], jnp.int32))
    state = m.init_state(CFG, B, N)
    f = jax.jit(lambda p, m, t, c, s: llama.decode(p, CFG, m, t, c, s))
    tok = jnp.zeros((B, 1), jnp.int32)
    return f.lower(params, m, tok, cache, state).as_text(), f(params, m, tok, cache, state)


KW = dict(budget_tokens=40, block_size=8)


def test_branchless_model_decode_has_no_conditional():
    """Without static retrieval layers a layer selects its retrieval set by has_retrieval, branchless or by
    lax.cond; with them (the default of `from_heads`) each run of layers scores or inherits: no conditional."""
    text_c, (lc, _, sc) = _program(EvoSparse.from_heads(CFG, HEADS, branchless=False, **KW).replace(
        retrieval_layers=None))
    text_f, (lf, _, sf) = _program(EvoSparse.from_heads(CFG, HEADS, branchless=True, **KW).replace(
        retrieval_layers=None))
    text_r, (lr, _, sr) = _program(EvoSparse.from_heads(CFG, HEADS, branchless=False, **KW))
    assert "stablehlo.case" in text_c and "stablehlo.case" not in text_f and "stablehlo.case" not in text_r
    for logits, st in ((lf, sf), (lr, sr)):
        np.testing.assert_allclose(logits, lc, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(st.heat, sc.heat, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("static_layers", [False, True])
@pytest.mark.parametrize("branchless", [True, False])
def test_segmented_decode_equals_one_scan(monkeypatch, branchless, static_layers):
    """The dense first layers and the sparse ones scanned apart (`EvoSparse.segments`), and with static
    `retrieval_layers` also the scoring and the inheriting layers, = one scan over all."""
    m = EvoSparse.from_heads(CFG, HEADS, branchless=branchless, **KW)
    assert m.retrieval_layers == (1, 3)
    if static_layers:  # HEADS: layer 1 (dense) and layer 3 score
        assert m.segments(CFG, "decode") == ((0, 1, "dense:inherit"), (1, 2, "dense:score"),
                                             (2, 3, "sparse:inherit"), (3, 4, "sparse:score"),
                                             (4, 5, "sparse:inherit"))
    else:
        m = m.replace(retrieval_layers=None)
        assert m.segments(CFG, "decode") == ((0, m.dense_layers, "dense"), (m.dense_layers, CFG.num_layers,
                                                                            "sparse"))
    runs = len(m.segments(CFG, "decode"))
    text_s, (ls, cs, ss) = _program(m)
    monkeypatch.setattr(EvoSparse, "segments", lambda self, cfg, phase: None)
    text_o, (lo, co, so) = _program(m)
    assert text_s.count("stablehlo.while") == text_o.count("stablehlo.while") + runs - 1
    np.testing.assert_allclose(ls, lo, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ss.heat, so.heat, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(ss.retrieval), np.asarray(so.retrieval))
    # The CPU's two programs round alike; a GPU's fuse differently (an H200: later layers' keys 8e-6 apart).
    np.testing.assert_allclose(cs.k, co.k, **({} if jax.default_backend() == "cpu" else dict(rtol=1e-5, atol=1e-5)))


def test_segments_must_cover_the_layers():
    from models.attention import segments

    class M:
        def __init__(self, segs):
            self.segs = segs

        def segments(self, cfg, phase):
            return self.segs

    assert segments(M(None), CFG, "decode") == ((0, CFG.num_layers, None),)
    for bad in (((0, 2, "a"), (3, 5, "b")), ((0, 2, "a"), (2, 4, "b")), ((1, 5, "a"),), ((0, 0, "a"), (0, 5, "b"))):
        with pytest.raises(ValueError, match="expected consecutive non-empty runs covering layers 0..5"):
            segments(M(bad), CFG, "decode")


def test_retrieval_layers_must_match_the_layout():
    m = EvoSparse.from_heads(CFG, HEADS, **KW)
    with pytest.raises(ValueError, match=r"retrieval_layers=\(1, 2\): the layout's retrieval heads are in layers"
                                         r" \(1, 3\)"):
        m.replace(retrieval_layers=(1, 2))
    with pytest.raises(ValueError, match="expected ascending distinct layer indices"):
        m.replace(retrieval_layers=(3, 1))
    with pytest.raises(ValueError, match="the model has 5 layers"):
        EvoSparse(retrieval_layers=(7,)).segments(CFG, "decode")


@pytest.mark.parametrize("heads,kw,lead,groups", [
    # layer 1 (dense) scores: it selects layer 2; layer 3 scores and selects 3 and 4
    (HEADS, {}, (0, 0), ((0, 0), (2, 1), (0, 0), (3, 2), (0, 0))),
    # layer 2 inherits the empty set: selected before any layer runs; layer 3 selects 3 and 4
    ([(3, 1)], {}, (2, 1), ((0, 0), (0, 0), (0, 0), (3, 2), (0, 0))),
    # without retrieval every sparse layer is selected before any layer runs
    ([(3, 1)], dict(retrieval_fraction=0.0, heat_fraction=0.5625), (2, 3), ((0, 0),) * 5)])
def test_grouped_selection_equals_per_layer(heads, kw, lead, groups):
    """`group_select` (the default): the sparse layers that inherit one retrieval set are selected at once, where
    the set is computed (`selection_groups`), and decode steps give the same logits, heat and cache as each layer
    selecting for itself; the groups are dropped at the end of the forward."""
    m = EvoSparse.from_heads(CFG, heads, **KW)
    if kw:
        m = EvoSparse(**KW, **kw)
    assert m.selection_groups(CFG.num_layers) == (lead, groups)
    assert m.replace(group_select=False).selection_groups(CFG.num_layers) is None
    params = random_params(CFG, jax.random.key(0), jnp.float32, scale=0.4)
    ks = jax.random.split(jax.random.key(2), 3)
    cache = init_cache(CFG, B, N, jnp.float32)
    cache = cache.replace(k=jax.random.normal(ks[0], cache.k.shape), v=jax.random.normal(ks[1], cache.v.shape),
                          lengths=jnp.array([90, 100], jnp.int32))
    heat = jax.random.uniform(ks[2], m.init_state(CFG, B, N).heat.shape)
    step = jax.jit(lambda p, m, t, c, s: llama.decode(p, CFG, m, t, c, s))
    runs = []
    for method in (m, m.replace(group_select=False)):
        tok, c, s, logits = jnp.zeros((B, 1), jnp.int32), cache, method.init_state(CFG, B, N).replace(heat=heat), []
        for _ in range(3):
            out, c, s = step(params, method, tok, c, s)
            logits.append(out)
            tok = jnp.argmax(out, -1).astype(jnp.int32)
        assert s.sel is None and s.heat_cand is None
        runs.append((jnp.stack(logits), c, s))
    (lg, cg, sg), (lp, cp, sp) = runs
    np.testing.assert_allclose(lg, lp, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(sg.heat, sp.heat, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(cg.k), np.asarray(cp.k))
    assert not np.allclose(sg.heat, heat)  # the steps attended and moved the heat


def test_layer_benchmark_carries_the_step_state():
    """`jsparse bench evosparse`'s layer loop (`eval.bench.evosparse.evo_layers`) runs the model's per-step work
    (`start`, `start_rows`) in every iteration and drops what belongs to one forward (candidates, plan, groups), so
    its loop carry keeps one structure: an inheriting and a scoring layer 2 run on a CPU."""
    from eval.bench import evosparse as be
    cfg = be.layer_cfg()
    Bq, Nq = 1, 2048
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (Bq, 1, cfg.num_heads, cfg.head_dim), jnp.float32)
    k = jax.random.normal(ks[1], (Bq, cfg.num_kv_heads, Nq, cfg.head_dim), jnp.float32)
    v = jax.random.normal(ks[2], k.shape, jnp.float32)
    lengths = jnp.full((Bq,), Nq - 5, jnp.int32)
    for heads in ([(1, 0)], [(2, 0), (2, 9)]):
        m = be.method_for(cfg, heads)
        got = be.evo_layers(m, q, k, v, lengths, be._state(m, cfg, Bq, Nq, ks[3]), jnp.int32(2), iters=2)
        assert np.isfinite(float(got))

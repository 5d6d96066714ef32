"""Token Sparse Attention: coverage rule vs numpy, the layer vs a masked dense reference, tau = 0 is dense, drift
calibration artifacts, composition with Kascade, argument errors."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsparse.artifacts import Artifact, ArtifactError, save_artifact
from jsparse.methods import make_method
from jsparse.methods import tsa_calibration as tcal
from jsparse.methods.common import prefill_state
from jsparse.methods.kascade import Kascade
from jsparse.methods.tsa import (TSA, TSALayerInfo, attend_compressed, capacities, coverage_counts, fixed_counts,
                                 masked_reference_mask, prefill_sparsity, select_tokens, translate_anchor_indices)
from models import llama
from models.attention import LayerContext
from models.cache import init_cache
from models.config import ModelConfig
from models.generate import Sampling, generate_tokens
from models.params import random_params
from pallas_kernels.dense import dense_prefill
from pallas_kernels.local_attention import banded_mask
from pallas_kernels.sparse_attention.reference import masked_attention_reference

HQ, HKV, D = 4, 2, 16
CFG = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3,
                  num_heads=HQ, num_kv_heads=HKV, head_dim=D, max_position_embeddings=512, eos_token_ids=(3,))
SMALL = dict(window=16, min_tokens=32)  # so that a 192-256 token prompt is long enough to compress


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, jax.random.key(0), jnp.float32, scale=0.3)


def _qkv(seed, B=2, T=256, scale=2.0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = scale * jax.random.normal(ks[0], (B, T, HQ, D), jnp.float32)
    k = scale * jax.random.normal(ks[1], (B, T, HKV, D), jnp.float32)
    v = jax.random.normal(ks[2], (B, T, HKV, D), jnp.float32)
    return q, k, v


def _ctx(lengths, layer=1, sparse=1):
    return LayerContext(layer=jnp.int32(layer), lengths=jnp.asarray(lengths, jnp.int32),
                        info=TSALayerInfo(sparse=jnp.int32(sparse)))


# ----------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("tau", [-0.01, 1.0, 1.5, "0.1", True])
def test_tau_outside_range_is_an_error(tau):
    with pytest.raises(ValueError, match="tau"):
        TSA(tau=tau)
    with pytest.raises(ValueError, match="tau"):
        make_method("tsa", tau=tau)


@pytest.mark.parametrize("window", [0, -3, 2.0])
def test_window_not_positive_is_an_error(window):
    with pytest.raises(ValueError, match="window"):
        TSA(window=window)


@pytest.mark.parametrize("pool_kernel", [0, -7])
def test_pool_kernel_not_positive_is_an_error(pool_kernel):
    with pytest.raises(ValueError, match="pool_kernel"):
        TSA(pool_kernel=pool_kernel)


@pytest.mark.parametrize("delta", [0.0, -0.5, 1.01, 2])
def test_delta_outside_range_is_an_error(delta, params):
    with pytest.raises(ValueError, match="delta"):
        tcal.check_delta(delta)
    with pytest.raises(ValueError, match="delta"):
        tcal.sparse_layers_from_drift([0.1, 0.2, 0.3], delta)
    with pytest.raises(ValueError, match="delta"):
        tcal.calibrate(params, CFG, [np.zeros((1, 16), np.int32)], delta=delta)


def test_calibration_drift_is_a_token_mean_and_refuses_an_empty_selection(params):
    """The drift is one mean over every valid token of all prompts (a longer prompt weighs more; not a mean of
    per-prompt or per-batch means) however they are batched and padded, and a delta below 1/L, which selects no
    layer, is refused (an artifact with no sparse layer was written). Prompts of two lengths: with one length a
    weighting by rows agrees with one by tokens."""
    short = np.asarray(jax.random.randint(jax.random.key(1), (1, 8), 4, CFG.vocab_size), np.int32)
    long = np.asarray(jax.random.randint(jax.random.key(2), (1, 56), 4, CFG.vocab_size), np.int32)
    d_short = tcal.calibrate(params, CFG, [short], delta=1.0).arrays["drift"].astype(np.float64)
    d_long = tcal.calibrate(params, CFG, [long], delta=1.0).arrays["drift"].astype(np.float64)
    assert not np.allclose(d_short, d_long, rtol=1e-2)  # the weighting matters for these prompts
    want = (8 * d_short + 56 * d_long) / 64  # every token counts once
    separate = tcal.calibrate(params, CFG, [short, long], delta=1.0).arrays["drift"]
    np.testing.assert_allclose(separate, want, rtol=1e-5)
    # One right-padded batch of both rows (lengths 8 and 56) gives the same token mean.
    padded = np.concatenate([np.pad(short, ((0, 0), (0, 48)), constant_values=5), long])
    batched = tcal.calibrate(params, CFG, [(padded, np.asarray([8, 56], np.int32))], delta=1.0).arrays["drift"]
    np.testing.assert_allclose(batched, want, rtol=1e-5)
    with pytest.raises(ValueError, match=rf"delta=0.1: selects none of the {CFG.num_layers} layers"):
        tcal.calibrate(params, CFG, [short, long], delta=0.1)


def test_other_argument_errors():
    with pytest.raises(ValueError, match="min_tokens"):
        TSA(min_tokens=-1)
    with pytest.raises(ValueError, match="selection"):
        TSA(selection="block")
    with pytest.raises(ValueError, match="sparse_layers"):
        TSA(sparse_layers=(1, 1))
    with pytest.raises(ValueError, match="sparse_layers"):
        TSA(sparse_layers=3)
    assert TSA(sparse_layers=[2, 1]).sparse_layers == (1, 2)
    kascade = Kascade.from_anchors(CFG, [0, 1], tile=16, min_tokens=16, budget=0.3)
    with pytest.raises(ValueError, match="kv_head"):
        TSA(inner=kascade, selection="query_head")
    with pytest.raises(ValueError, match="fill='window'"):
        TSA(fill="window")
    with pytest.raises(ValueError, match="local_window=0"):
        TSA(fill="local", local_window=0)
    with pytest.raises(ValueError, match="local_sinks=-1"):
        TSA(fill="local", local_sinks=-1)
    assert TSA().fill == "local"  # the default keeps dense's passkey; the paper's behaviour is fill="zeros"
    m = TSA(fill="local", local_window=np.int64(8), local_sinks=np.int32(2))
    assert (type(m.local_window), type(m.local_sinks)) == (int, int)
    q, k, v = _qkv(0, T=64)
    _, sel = jax.jit(TSA(tau=0.3, window=16, min_tokens=16).select)(q, k, jnp.asarray([64, 64], jnp.int32))
    with pytest.raises(ValueError, match=r"fill_rows has shape \(2, 64, 4, 8\): expected \(2, 64, 4, 16\)"):
        attend_compressed(q, k, v, sel, fill_rows=q[..., :8])


# ----------------------------------------------------------------------------------------------- coverage


def _coverage_np(scores, lengths, tau, window, min_tokens):
    """numpy spec: (counts[B], keep bool[B, H, T])."""
    B, H, T = scores.shape
    counts = np.zeros(B, np.int64)
    keep = np.zeros(scores.shape, bool)
    for b in range(B):
        n = int(lengths[b])
        P = max(n - window, 0)
        if n <= min_tokens + window:
            counts[b] = n
            keep[b, :, :n] = True
            continue
        g = scores[b, :, :P].astype(np.float64).sum(0)
        p = np.sort(g / g.sum())
        n_drop = int(np.sum(np.cumsum(p) < tau))
        K = max(P - n_drop, min_tokens)
        counts[b] = K + window
        for h in range(H):
            order = np.argsort(-scores[b, h, :P], kind="stable")  # ties: the lower position first
            keep[b, h, order[:K]] = True
            keep[b, h, P:n] = True
    return counts, keep


@jax.jit
def _coverage_and_selection(scores, lengths, tau):
    counts = coverage_counts(scores, lengths, tau=tau, window=16, min_tokens=20)
    return counts, select_tokens(scores, lengths, counts, window=16, capacity=scores.shape[-1])


def test_coverage_and_selection_match_numpy():
    B, H, T, W, M = 4, 3, 300, 16, 20
    rng = np.random.default_rng(0)
    scores = rng.gamma(0.3, size=(B, H, T)).astype(np.float32)
    scores[:, :, ::7] = np.round(scores[:, :, ::7], 1)  # ties at several values
    scores[1, :, 40:60] = 0.0  # a block of zero scores (ties at zero)
    lengths = np.array([300, 251, 30, 37])  # row 2: shorter than min_tokens + W (dense); row 3: just longer
    scores = np.where(np.arange(T)[None, None, :] >= lengths[:, None, None], 0.0, scores).astype(np.float32)
    for tau in (0.0, 0.07, 0.3, 0.9):
        counts_np, keep_np = _coverage_np(scores, lengths, tau, W, M)
        # No cumulative sum sits within rounding of tau (so f32 and f64 agree on the count).
        for b in (0, 1, 3):
            P = lengths[b] - W
            g = scores[b, :, :P].astype(np.float64).sum(0)
            assert np.min(np.abs(np.cumsum(np.sort(g / g.sum())) - tau)) > 1e-5 or tau == 0.0
        counts, sel = _coverage_and_selection(jnp.asarray(scores), jnp.asarray(lengths), jnp.float32(tau))
        np.testing.assert_array_equal(counts, counts_np)
        np.testing.assert_array_equal(sel.keep, keep_np)
        idx = np.asarray(sel.indices)
        for b in range(B):
            for h in range(H):
                want = np.nonzero(keep_np[b, h])[0]
                np.testing.assert_array_equal(idx[b, h, :len(want)], want)  # ascending
                assert np.all(idx[b, h, len(want):] == -1)
                np.testing.assert_array_equal(np.asarray(sel.slot)[b, h, want], np.arange(len(want)))
        if tau == 0.0:
            np.testing.assert_array_equal(counts, lengths)
    assert counts_np[0] < lengths[0] - W  # the large tau really dropped tokens


@pytest.mark.parametrize("fraction", [0.0, -0.2, 1.01, "0.5", True])
def test_kept_fraction_outside_range_is_an_error(fraction):
    with pytest.raises(ValueError, match="kept_fraction"):
        TSA(kept_fraction=fraction)
    with pytest.raises(ValueError, match="kept_fraction"):
        make_method("tsa", kept_fraction=fraction)


def test_fixed_counts_keep_the_share_window_and_min_tokens():
    """round(f * n) tokens, window included; at least min_tokens prefix tokens, at most n; short rows dense."""
    lengths = jnp.asarray([1000, 300, 40, 48, 600], jnp.int32)
    got = np.asarray(fixed_counts(lengths, fraction=0.3, window=16, min_tokens=32))
    # 300 of 1000; 90 of 300; 40 <= 32 + 16: dense; 48: dense; 180 of 600
    np.testing.assert_array_equal(got, [300, 90, 40, 48, 180])
    got = np.asarray(fixed_counts(lengths, fraction=0.01, window=16, min_tokens=32))
    np.testing.assert_array_equal(got, [48, 48, 40, 48, 48])  # min_tokens + W
    np.testing.assert_array_equal(fixed_counts(lengths, fraction=1.0, window=16, min_tokens=32), lengths)
    n = np.arange(1, 200_000, 37)  # numpy (static lengths, `TSA.capacities`) counts as jnp does
    for f in (0.68, 0.3, 0.013):
        np.testing.assert_array_equal(fixed_counts(n, fraction=f, window=128, min_tokens=1024, xp=np),
                                      fixed_counts(jnp.asarray(n), fraction=f, window=128, min_tokens=1024))


def test_kept_fraction_layer_keeps_that_share_and_equals_the_masked_reference():
    """TSA(kept_fraction=f): tau unused, the top-scored round(f * n) tokens of each row kept (the count recorded),
    the output the masked dense reference over them."""
    q, k, v = _qkv(3)
    lengths = jnp.asarray([256, 203], jnp.int32)
    m = TSA(kept_fraction=0.4, tau=0.0, fill="zeros", **SMALL)  # tau unused: 0 runs sparse too
    out, state = jax.jit(m.prefill)(_ctx(lengths), q, k, v, m.init_state(CFG, 2, 256))
    counts, sel = jax.jit(m.select)(q, k, lengths)
    np.testing.assert_array_equal(counts, [102, 81])  # round(0.4 * n)
    np.testing.assert_array_equal(state.kept[1], counts)
    np.testing.assert_array_equal(np.asarray(sel.keep).sum(-1), np.broadcast_to(np.asarray(counts)[:, None], (2, HQ)))
    # the kept tokens are the selection TSA's own scoring makes at that count
    want_sel = select_tokens(m._coverage(q, k, lengths)[0], lengths, counts, window=16, capacity=256)
    np.testing.assert_array_equal(sel.keep, want_sel.keep)
    want = masked_attention_reference(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                                      masked_reference_mask(sel, HQ))
    for b, n in enumerate(np.asarray(lengths)):
        np.testing.assert_allclose(out[b, :n], want[b, :n], rtol=1e-5, atol=1e-5)


def test_capacities_are_static_buckets():
    assert capacities(1000, 4) == (256, 512, 768, 1000)
    assert capacities(200, 8) == (128, 200)
    assert capacities(1000, 1) == (1000,)


# ----------------------------------------------------------------------------------------------- the layer


@pytest.mark.parametrize("selection,buckets", [("query_head", 4), ("kv_head", 1), ("kv_union", 4)])
def test_layer_equals_masked_dense_reference(selection, buckets):
    q, k, v = _qkv(1)
    lengths = jnp.asarray([256, 203], jnp.int32)
    m = TSA(tau=0.3, selection=selection, capacity_buckets=buckets, fill="zeros", **SMALL)  # the paper's rows
    state = m.init_state(CFG, 2, 256)
    out, state = jax.jit(m.prefill)(_ctx(lengths), q, k, v, state)
    counts, sel = jax.jit(m.select)(q, k, lengths)  # the selection, fixed
    assert np.all(np.asarray(counts) < np.asarray(lengths))  # tokens really dropped in both rows
    if selection == "kv_union":  # each KV head keeps the union of its group's query-head selections
        _, per_head = jax.jit(m.replace(selection="query_head").select)(q, k, lengths)
        keep_q = np.asarray(per_head.keep).reshape(2, HKV, HQ // HKV, -1)
        np.testing.assert_array_equal(np.asarray(sel.keep), keep_q.any(axis=2))
        sizes = np.asarray(sel.keep).sum(-1)
        assert np.all(sizes >= np.asarray(counts)[:, None]) and np.any(sizes > np.asarray(counts)[:, None])
        np.testing.assert_array_equal(state.kept[1], np.round(sizes.mean(1)).astype(np.int32))
    else:
        np.testing.assert_array_equal(state.kept[1], counts)
    mask = masked_reference_mask(sel, HQ)
    want = masked_attention_reference(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask)
    for b, n in enumerate(np.asarray(lengths)):
        np.testing.assert_allclose(out[b, :n], want[b, :n], rtol=1e-5, atol=1e-5)
    assert np.any(np.all(np.asarray(out[0]) == 0, axis=-1))  # dropped rows are zeros


@pytest.mark.parametrize("selection", ["query_head", "kv_head", "kv_union"])
def test_local_fill_gives_dropped_rows_a_sliding_window(selection):
    """fill="local": kept rows as the masked dense reference, dropped rows as a banded (window + sinks) one."""
    q, k, v = _qkv(6)
    lengths = jnp.asarray([256, 211], jnp.int32)
    m = TSA(tau=0.3, selection=selection, fill="local", local_window=8, local_sinks=3, **SMALL)
    out, _ = jax.jit(m.prefill)(_ctx(lengths), q, k, v, m.init_state(CFG, 2, 256))
    _, sel = jax.jit(m.select)(q, k, lengths)
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    sparse = masked_attention_reference(q, kt, vt, masked_reference_mask(sel, HQ))
    local = masked_attention_reference(q, kt, vt, jnp.broadcast_to(banded_mask(256, 8, 3), (2, HQ, 256, 256)))
    keep = np.asarray(sel.keep)
    keep = np.repeat(keep, HQ // keep.shape[1], axis=1).transpose(0, 2, 1)[..., None]  # [B, T, Hq, 1]
    want = np.where(keep, sparse, local)
    assert not keep[0].all()  # some rows really take the fill
    for b, n in enumerate(np.asarray(lengths)):
        np.testing.assert_allclose(out[b, :n], want[b, :n], rtol=1e-5, atol=1e-5)


def test_compressed_path_keeping_everything_equals_dense():
    q, k, v = _qkv(2)
    lengths = jnp.asarray([256, 190], jnp.int32)
    scores = jax.random.uniform(jax.random.key(3), (2, HQ, 256))
    out = jax.jit(lambda s, l: attend_compressed(q, k, v, select_tokens(s, l, l, window=16, capacity=256)))(
        scores, lengths)
    want = dense_prefill(q, k, v)
    for b, n in enumerate(np.asarray(lengths)):
        np.testing.assert_allclose(out[b, :n], want[b, :n], rtol=1e-5, atol=1e-5)


def _prefill(params, method, tokens, lengths):
    B, T = tokens.shape
    fn = jax.jit(lambda p, t, l: llama.prefill(p, CFG, method, t, l, init_cache(CFG, B, T, jnp.float32),
                                               method.init_state(CFG, B, T), all_logits=True))
    logits, cache, state = fn(params, tokens, lengths)
    return np.asarray(logits), state, cache


def test_tau_zero_equals_dense_exactly(params):
    tokens = jax.random.randint(jax.random.key(4), (2, 192), 4, CFG.vocab_size)
    lengths = jnp.asarray([192, 150], jnp.int32)
    dense = _prefill(params, make_method("dense"), tokens, lengths)[0]
    got, state, _ = _prefill(params, TSA(tau=0.0, **SMALL), tokens, lengths)
    np.testing.assert_array_equal(got, dense)
    np.testing.assert_array_equal(state.kept, np.tile(lengths, (3, 1)))
    # A prompt no longer than min_tokens + W stays dense too, whatever tau.
    short = _prefill(params, TSA(tau=0.5, window=16, min_tokens=200), tokens, lengths)[0]
    np.testing.assert_array_equal(short, dense)


def test_model_prefill_sparse_layers_and_generation(params):
    tokens = jax.random.randint(jax.random.key(5), (2, 192), 4, CFG.vocab_size)
    lengths = jnp.asarray([192, 161], jnp.int32)
    m = TSA(tau=0.2, sparse_layers=(2,), **SMALL)
    rep = prefill_sparsity(params, CFG, m, tokens, lengths)
    kept = rep["kept"]
    np.testing.assert_array_equal(kept[:2], np.tile(lengths, (2, 1)))  # layers 0, 1 dense
    assert np.all(kept[2] < np.asarray(lengths))
    n = np.asarray(lengths, np.float64)
    np.testing.assert_allclose(rep["attention_map_sparsity"][2],
                               np.mean(1 - kept[2] * (kept[2] + 1.0) / (n * (n + 1))))
    assert rep["attention_map_sparsity"][0] == 0.0
    out, num = generate_tokens(params, m, tokens, lengths, jax.random.key(0), cfg=CFG, max_new_tokens=4,
                               capacity=256, sampling=Sampling())
    assert out.shape == (2, 4) and np.all(np.asarray(num) >= 1)


# ----------------------------------------------------------------------------------------------- calibration


def test_drift_rank_rule():
    drift = [0.9, 0.1, 0.5, 0.2, 0.3, 0.8]
    assert tcal.sparse_layers_from_drift(drift, 0.5) == [1, 3, 4]
    assert tcal.sparse_layers_from_drift(drift, 1.0) == list(range(6))
    assert tcal.sparse_layers_from_drift(drift, 0.2) == [1]
    np.testing.assert_allclose(tcal.normalized_rank(drift), np.array([6, 1, 4, 2, 3, 5]) / 6)


def test_calibration_writes_an_artifact_that_loads(params, tmp_path):
    tokens = np.asarray(jax.random.randint(jax.random.key(6), (2, 64), 4, CFG.vocab_size))
    art = tcal.calibrate(params, CFG, [tokens], delta=0.67, fingerprint="fp-tiny")
    # Drift by hand: the layer inputs, then the last layer's output.
    hidden = jax.jit(lambda p, t: llama.prefill(p, CFG, make_method("dense"), t, jnp.full((2,), 64, jnp.int32),
                                                init_cache(CFG, 2, 64, jnp.float32), None,
                                                return_hidden=True)[3])
    x_in, x_attn = hidden(params, jnp.asarray(tokens))
    last = jax.tree_util.tree_map(lambda a: a[-1], params.layers)
    h_out = np.asarray(x_attn[-1] + llama.mlp(CFG, last, x_attn[-1]), np.float64)
    h = np.concatenate([np.asarray(x_in, np.float64), h_out[None]])
    want = np.mean(np.linalg.norm(h[1:] - h[:-1], axis=-1) / (np.linalg.norm(h[:-1], axis=-1) + 1e-6),
                   axis=(1, 2))
    np.testing.assert_allclose(art.arrays["drift"], want, rtol=1e-4)
    assert art.meta["sparse_layers"] == tcal.sparse_layers_from_drift(want, 0.67)
    assert len(art.arrays["sparse_layers"]) == 2  # rank / 3 <= 0.67: two of three layers
    path = str(tmp_path / "tsa_art")
    save_artifact(path, art)
    m = make_method("tsa", cfg=CFG, artifact=path, fingerprint="fp-tiny", budget=0.1)
    assert m.sparse_layers == tuple(int(l) for l in art.arrays["sparse_layers"])
    with pytest.raises(ArtifactError):
        make_method("tsa", cfg=CFG, artifact=path, fingerprint="another-model")


# ----------------------------------------------------------------------------------------------- composition


def test_translate_anchor_indices():
    B, H, T, tile = 1, 1, 8, 2
    anchor_idx = jnp.asarray([[[[-1, -1], [0, -1], [0, 2], [1, 3]]]], jnp.int32)  # [1, 1, 4, 2]
    ident = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, H, T))
    hm = jnp.zeros((H,), jnp.int32)
    # Identical coordinates: the identity (the anchor tile's own slots all lie in the query tile itself).
    got = np.asarray(translate_anchor_indices(anchor_idx, ident, hm, ident, ident, tile))
    assert got.shape == (B, H, 4, 2 + tile)
    np.testing.assert_array_equal(got[..., :2], anchor_idx)
    assert np.all(got[..., 2:] == -1)
    # The anchor kept original positions (0, 2, 3, 5, 6, 7); this layer keeps (0, 1, 3, 5, 7).
    a_map = jnp.asarray([[[0, 2, 3, 5, 6, 7, 8, 8]]], jnp.int32)
    cur_map = jnp.asarray([[[0, 1, 3, 5, 7, 8, 8, 8]]], jnp.int32)
    cur_slot = jnp.asarray([[[0, 1, -1, 2, -1, 3, -1, 4]]], jnp.int32)
    got = np.asarray(translate_anchor_indices(anchor_idx, a_map, hm, cur_map, cur_slot, tile))[0, 0]
    # Tile 0 (queries at 0, 1): first query 0 -> anchor slot 0, row 0 (nothing); slot 0 is the query itself.
    # Tile 1 (queries at 3, 5): 3 -> anchor slot 2, row 1: anchor slot 0 = pos 0 -> slot 0; tile 1's own slot 2
    #   is pos 3, the query itself.
    # Tile 2 (query at 7): 7 -> anchor slot 5, row 2: anchor slots 0, 2 = pos 0, 3 -> slots 0, 2; the anchor
    #   tile's slot 4 (pos 6) was dropped here, slot 5 is the query.
    # (Tile 3 holds only empty slots; its row is never read.)
    np.testing.assert_array_equal(got[:3], [[-1, -1, -1, -1], [0, -1, -1, -1], [0, 2, -1, -1]])
    # A query tile that starts in the middle of an anchor tile gets the anchor tile's slots before it: tile 4,
    # the anchor dense (identity), this layer dropped position 3. Query tile 1 = slots 4..7 = positions 5, 6, 7;
    # 5 lies in anchor tile 1 (positions 4..7), whose row holds the keys before 4 (0..3: here slots 0, 1, 2);
    # position 4 (slot 3), just before the tile, comes from the anchor tile's own slots.
    tile = 4
    anchor_idx = jnp.asarray([[[[-1, -1, -1, -1], [0, 1, 2, 3]]]], jnp.int32)
    cur_map = jnp.asarray([[[0, 1, 2, 4, 5, 6, 7, 8]]], jnp.int32)
    cur_slot = jnp.asarray([[[0, 1, 2, -1, 3, 4, 5, 6]]], jnp.int32)
    got = np.asarray(translate_anchor_indices(anchor_idx, ident, hm, cur_map, cur_slot, tile))[0, 0]
    np.testing.assert_array_equal(got[1], [0, 1, 2, 3, -1, -1, -1, -1])



def test_reuse_head_reads_the_mapped_anchor_heads_coordinates():
    """A reuse layer's KV head h reads anchor head head_map[h]'s indices and that head's slot -> position map
    (per-KV-head compression gives each anchor head its own coordinates): mapping heads equals permuting the
    anchor's heads, indices and coordinates together."""
    B, H, T, tile, K = 1, 2, 16, 4, 3
    nT = T // tile
    # anchor head 0 kept every position; anchor head 1 only the even ones (slot s = position 2 s; T = empty slot)
    amap = np.full((B, H, T), T, np.int32)
    amap[0, 0] = np.arange(T)
    amap[0, 1, :T // 2] = np.arange(0, T, 2)
    # the anchor's selection per tile row (its compressed slots), -1 padded
    aidx = np.full((B, H, nT, K), -1, np.int32)
    aidx[0, 0] = [[0, -1, -1], [1, 2, -1], [0, 3, 5], [2, 6, 9]]
    aidx[0, 1] = [[0, -1, -1], [0, 1, -1], [1, 3, 4], [2, 5, 6]]
    # this layer kept every position, in both heads (identity coordinates)
    cur_map = np.broadcast_to(np.arange(T, dtype=np.int32), (B, H, T)).copy()
    cur_slot = cur_map.copy()
    args = [jnp.asarray(x) for x in (aidx, amap)]
    both_one = np.asarray(translate_anchor_indices(*args, jnp.asarray([1, 1], jnp.int32), jnp.asarray(cur_map),
                                                   jnp.asarray(cur_slot), tile))
    # both heads reuse anchor head 1 in the same coordinates: the same keys
    np.testing.assert_array_equal(both_one[:, 0], both_one[:, 1])
    assert (both_one >= 0).sum() > 0
    # head mapping == permuting the anchor's heads (indices and coordinates) under the identity map
    hm = np.asarray([1, 0], np.int32)
    swapped = np.asarray(translate_anchor_indices(*args, jnp.asarray(hm), jnp.asarray(cur_map), jnp.asarray(cur_slot),
                                                  tile))
    ident = np.asarray(translate_anchor_indices(jnp.asarray(aidx[:, hm]), jnp.asarray(amap[:, hm]),
                                                jnp.asarray([0, 1], jnp.int32), jnp.asarray(cur_map),
                                                jnp.asarray(cur_slot), tile))
    np.testing.assert_array_equal(swapped, ident)
    # tile 1 of head 0 (reusing anchor head 1): anchor tile 0's row (slot 0 = position 0) and its diagonal slots
    # 0..2 (positions 0, 2, 4), those before the tile's first query (position 4): {0, 2} (slot 0 in both; the
    # row is not deduplicated)
    row = swapped[0, 0, 1]
    assert sorted(set(row[row >= 0].tolist())) == [0, 2]


def _kascade():
    return Kascade.from_anchors(CFG, [0, 1], tile=16, min_tokens=16, budget=0.3)


def test_tsa_kascade_full_budget_is_tsa(params):
    """Kascade at budget 1 inside TSA is TSA (kv_head): every reuse layer, TSA-sparse here and reusing the dense
    layer-0 anchor, attends exactly to the keys it kept, the tokens just before each compressed tile included
    (they lie in the anchor's diagonal tile, not in its row; losing them cost +12% perplexity on SmolLM2)."""
    tokens = jax.random.randint(jax.random.key(8), (2, 256), 4, CFG.vocab_size)
    lengths = jnp.asarray([256, 230], jnp.int32)
    opts = dict(tau=0.2, selection="kv_head", capacity_buckets=1, sparse_layers=(1, 2), **SMALL)
    tsa = _prefill(params, TSA(**opts), tokens, lengths)
    full = Kascade.from_anchors(CFG, [0], tile=16, min_tokens=16, budget=1.0)
    comp = _prefill(params, TSA(inner=full, **opts), tokens, lengths)
    assert np.all(np.asarray(tsa[1].kept)[1:] < np.asarray(lengths))  # the reuse layers did compress
    np.testing.assert_array_equal(np.asarray(comp[1].kept), np.asarray(tsa[1].kept))
    np.testing.assert_allclose(comp[0], tsa[0], atol=2e-5, rtol=2e-5)


def test_capacities_add_the_fixed_share_of_a_full_row():
    assert TSA().capacities(131072) == capacities(131072, 8)
    assert TSA(kept_fraction=0.68).capacities(131072) == tuple(sorted(capacities(131072, 8) + (89216,)))  # 89129
    assert TSA(kept_fraction=0.2, capacity_buckets=1, **SMALL).capacities(512) == (128, 512)  # 102 kept
    assert TSA(kept_fraction=0.2).capacities(1100) == capacities(1100, 8)  # a dense row (n <= 1024 + 128)


@pytest.mark.parametrize("anchors,reuse_scale,fraction,buckets,kept", [
    ([0, 2], 2.0, 0.4, 4, [205, 172]),  # capacities (128, 256, 384, 512): 205 kept -> 256
    ([0, 1], 1.0, 0.2, 1, [102, 86]),  # (128, 512): the fixed share's own capacity
])
def test_tsa_kascade_at_capacity_buckets_equals_capacity_t(params, monkeypatch, anchors, reuse_scale, fraction,
                                                           buckets, kept):
    """Kascade inside TSA runs at the smallest capacity holding the kept tokens (its anchors and reuse layers over
    C < T slots, its state padded back to T's shape): the same logits, kept counts, Kascade state and decode step
    as at capacity T."""
    tokens = jax.random.randint(jax.random.key(9), (2, 512), 4, CFG.vocab_size)
    lengths = jnp.asarray([512, 430], jnp.int32)
    kas = Kascade.from_anchors(CFG, anchors, tile=16, min_tokens=16, budget=0.3, reuse_scale=reuse_scale)
    opts = dict(inner=kas, selection="kv_head", kept_fraction=fraction, **SMALL)
    at_c = TSA(capacity_buckets=buckets, **opts)
    got, got_state, _ = _prefill(params, at_c, tokens, lengths)
    at_t = TSA(capacity_buckets=1, **opts)
    monkeypatch.setattr(TSA, "capacities", lambda self, T: (T,))  # the reference: always capacity T
    want, want_state, cache = _prefill(params, at_t, tokens, lengths)
    np.testing.assert_array_equal(np.asarray(got_state.kept)[1:], [kept] * 2)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(got_state.inner.indices, want_state.inner.indices)
    np.testing.assert_array_equal(got_state.anchor_map, want_state.anchor_map)
    step = jnp.asarray(np.argmax(want[np.arange(2), np.asarray(lengths) - 1], -1)[:, None], jnp.int32)
    cache = cache.replace(k=jnp.pad(cache.k, ((0, 0),) * 3 + ((0, 8), (0, 0))),
                          v=jnp.pad(cache.v, ((0, 0),) * 3 + ((0, 8), (0, 0))))
    dec = lambda m, s: jax.jit(lambda p, t, c: llama.decode(p, CFG, m, t, c, s))(params, step, cache)[0]  # noqa
    np.testing.assert_array_equal(dec(at_c, got_state), dec(at_t, want_state))


def test_tsa_kascade_keeps_anchors_of_dense_reuse_layers_dense():
    """An anchor read by a TSA-dense reuse layer is not compressed (the reuse layer would lose what it dropped);
    one read only by TSA-sparse reuse layers is."""
    from jsparse.methods.kascade import anchors_read_by
    cfg = dataclasses.replace(CFG, num_layers=8)
    kas = Kascade.from_anchors(cfg, [0, 1, 3, 6], tile=16, min_tokens=16, budget=0.3)  # reuse: 2, 4, 5, 7
    np.testing.assert_array_equal(anchors_read_by(kas.roles, jnp.asarray([0, 0, 1, 0, 0, 1, 0, 1])),
                                  [0, 1, 0, 1, 0, 0, 1, 0])
    m = TSA(inner=kas, selection="kv_head", sparse_layers=(1, 2, 3, 4, 6, 7), **SMALL)
    assert m.layers(8) == (1, 2, 4, 6, 7)  # 3 is read by dense reuse layer 5; 1 and 6 only by sparse 2 and 7
    np.testing.assert_array_equal(m.layer_info(cfg).sparse, [0, 1, 1, 0, 1, 0, 1, 1])
    assert TSA(sparse_layers=(1, 2, 3, 4, 6, 7), **SMALL).layers(8) == (1, 2, 3, 4, 6, 7)


def test_tsa_kascade_reports_the_sparsity_of_both(params):
    """tsa+kascade's measured prefill sparsity counts Kascade's top-k among the tokens TSA kept (anchors at the
    budget, reuse layers at r x budget, the dense anchor only where TSA compresses it), checked entry by entry;
    it skips more of the map than TSA alone, and its decode rule is Kascade's (TSA alone decodes densely: 0)."""
    from eval.harness import LayerSparsity

    tokens = jax.random.randint(jax.random.key(5), (2, 256), 4, CFG.vocab_size)
    lengths = np.asarray([256, 200], np.int32)
    kas = Kascade.from_anchors(CFG, [0, 1], tile=16, min_tokens=16, budget=0.1, reuse_scale=2)
    opts = dict(tau=0.2, selection="kv_head", **SMALL)
    both, alone = TSA(inner=kas, **opts), TSA(**opts)
    state = prefill_state(params, CFG, both, tokens, jnp.asarray(lengths))
    got = both.prefill_layer_sparsity(CFG, state, lengths)
    kept = np.asarray(state.kept)
    assert sorted(got) == [1, 2] and both.layers(3) == (1, 2) and (kept[1:] < lengths).all()
    for layer, budget in ((1, 0.1), (2, 0.2)):  # layer 1 an anchor, layer 2 reuses it at 2 x 0.1
        for row, n in enumerate(lengths):
            K = int(kept[layer, row])
            entries = sum(min(max(int(np.ceil(np.float32(budget) * np.float32(i + 1))), 16), i + 1) for i in range(K))
            C = both.local_window + both.local_sinks  # fill="local": the most the dropped rows' windows can hold
            fill = sum(min(C, j) for j in range(K + 1, n + 1))
            assert got[layer][row] == pytest.approx(1.0 - (entries + fill) / (n * (n + 1) / 2))
    tsa_only = alone.prefill_layer_sparsity(CFG, state, lengths)
    assert all((got[layer] > tsa_only[layer]).all() for layer in (1, 2))
    tracker = LayerSparsity(both, CFG)
    tracker.add(state, lengths, 2)
    assert tracker.result()[1] == pytest.approx(sum(float(np.mean(v)) for v in got.values()) / 3)
    positions = np.arange(256)
    assert both.achieved_sparsity(CFG, positions) == kas.achieved_sparsity(CFG, positions) > 0.3
    assert alone.achieved_sparsity(CFG, positions) == 0.0


def test_tsa_kascade(params, tmp_path):
    tokens = jax.random.randint(jax.random.key(7), (2, 192), 4, CFG.vocab_size)
    lengths = jnp.asarray([192, 170], jnp.int32)
    kas = _prefill(params, _kascade(), tokens, lengths)[0]
    # tau = 0: exactly Kascade.
    comp = TSA(tau=0.0, inner=_kascade(), selection="kv_head", capacity_buckets=1, **SMALL)
    np.testing.assert_array_equal(_prefill(params, comp, tokens, lengths)[0], kas)
    # Built from both artifacts (one --artifact value, folders separated by os.pathsep): TSA-sparse layers 1, 2.
    kdir, tdir = str(tmp_path / "k"), str(tmp_path / "t")
    save_artifact(kdir, Artifact(kind="kascade", fingerprint="fp", arrays={
        "anchors": np.asarray([0, 1], np.int32), "head_map": np.tile(np.arange(HKV, dtype=np.int32), (3, 1))}))
    save_artifact(tdir, Artifact(kind="tsa", fingerprint="fp", arrays={"sparse_layers": np.asarray([1, 2])}))
    m = make_method("tsa+kascade", cfg=CFG, artifact=f"{kdir}{os.pathsep}{tdir}", fingerprint="fp", budget=0.3,
                    tile=16, min_tokens=16, tau=0.2, window=16, tsa_min_tokens=32)
    assert isinstance(m, TSA) and isinstance(m.inner, Kascade) and m.sparse_layers == (1, 2)
    assert m.selection == "kv_head" and m.inner.budget == 0.3 and m.min_tokens == 32 and m.tau == 0.2
    assert m.capacity_buckets == 4 and m.kept_fraction is None  # the builder's default buckets (not TSA's 8)
    m2 = make_method("tsa+kascade", cfg=CFG, artifact=f"{kdir}{os.pathsep}{tdir}", fingerprint="fp",
                     capacity_buckets=2, kept_fraction=0.5)
    assert (m2.capacity_buckets, m2.kept_fraction) == (2, 0.5)
    logits, state, cache = _prefill(params, m, tokens, lengths)
    assert np.isfinite(logits).all() and np.abs(logits - kas).max() > 1e-4
    assert np.all(np.asarray(state.kept)[1:] < np.asarray(lengths))
    # fill="local" reaches the composition: dropped rows get the window instead of zeros.
    m_local = make_method("tsa+kascade", cfg=CFG, artifact=f"{kdir}{os.pathsep}{tdir}", fingerprint="fp",
                          budget=0.3, tile=16, min_tokens=16, tau=0.2, window=16, tsa_min_tokens=32, fill="local",
                          local_window=8, local_sinks=2)
    assert (m_local.fill, m_local.local_window, m_local.local_sinks) == ("local", 8, 2)
    local_logits = _prefill(params, m_local, tokens, lengths)[0]
    assert np.isfinite(local_logits).all() and np.abs(local_logits - logits).max() > 1e-4
    # Decode is Kascade's: one step on the cache the composed prefill wrote.
    step = jnp.asarray(np.argmax(logits[np.arange(2), np.asarray(lengths) - 1], -1)[:, None], jnp.int32)
    cache = cache.replace(k=jnp.pad(cache.k, ((0, 0),) * 3 + ((0, 8), (0, 0))),
                          v=jnp.pad(cache.v, ((0, 0),) * 3 + ((0, 8), (0, 0))))
    got, _, _ = jax.jit(lambda p, t, c, s: llama.decode(p, CFG, m, t, c, s))(params, step, cache, state)
    want, _, _ = jax.jit(lambda p, t, c: llama.decode(p, CFG, m.inner, t, c, None))(params, step, cache)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="kascade needs a calibration artifact"):
        make_method("tsa+kascade", cfg=CFG, artifact=tdir, fingerprint="fp")
    # Options the composition sets itself are refused, not dropped (selection='query_head' built kv_head).
    both = f"{kdir}{os.pathsep}{tdir}"
    with pytest.raises(ValueError, match="option selection='query_head': selection is set by tsa\\+kascade"):
        make_method("tsa+kascade", cfg=CFG, artifact=both, fingerprint="fp", selection="query_head")
    with pytest.raises(ValueError, match="(?s)option inner=.*inner is set by tsa\\+kascade"):
        make_method("tsa+kascade", cfg=CFG, artifact=both, fingerprint="fp", inner=_kascade())
    assert make_method("tsa+kascade", cfg=CFG, artifact=both, fingerprint="fp", selection="kv_head").selection == \
        "kv_head"
    # An explicit sparse_layers wins over the artifact's (it was replaced by them without a word).
    assert make_method("tsa", cfg=CFG, artifact=tdir, fingerprint="fp", sparse_layers=[2]).sparse_layers == (2,)
    assert make_method("tsa", cfg=CFG, artifact=tdir, fingerprint="fp").sparse_layers == (1, 2)


def test_tsa_refuses_an_inner_method_without_coordinates_and_bad_calibration_lengths(params):
    """Only Kascade maps its state back from compressed slots to positions: H2O inside TSA kept its scores in
    slots [0, kept) and read them as positions (or failed with an XLA shape error). Calibration lengths outside
    [1, T] ran inside jit unchecked (T + 500 acted as T, 0 dropped the row)."""
    from jsparse.methods.h2o import H2O

    with pytest.raises(ValueError, match="inner=H2O: TSA runs an inner method in compressed coordinates"):
        TSA(inner=H2O())
    tokens = np.zeros((2, 16), np.int32)
    for bad in ([16 + 500, 16], [0, 16], [16]):
        with pytest.raises(ValueError, match=r"lengths=\[.*expected one integer in \[1, T=16\]"):
            tcal.calibrate(params, CFG, [(tokens, np.asarray(bad, np.int32))])


def test_kv_union_with_an_inner_method_is_an_error():
    with pytest.raises(ValueError, match="kv_union"):
        TSA(selection="kv_union", inner=_kascade(), **SMALL)


def test_kv_union_capacity_holds_the_largest_union():
    """The compressed capacity is chosen by the largest union, not by the per-head count: here every count
    fits the 128 bucket but a union does not, and the layer still equals the masked reference of the unions."""
    q, k, v = _qkv(1)
    lengths = jnp.asarray([256, 203], jnp.int32)
    m = TSA(tau=0.5, selection="kv_union", capacity_buckets=4, fill="zeros", **SMALL)  # capacities (128, 256)
    counts, sel = jax.jit(m.select)(q, k, lengths)
    sizes = np.asarray(sel.keep).sum(-1)
    assert int(np.max(counts)) <= 128 < int(sizes.max())
    out, _ = jax.jit(m.prefill)(_ctx(lengths), q, k, v, m.init_state(CFG, 2, 256))
    want = masked_attention_reference(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                                      masked_reference_mask(sel, HQ))
    for b, n in enumerate(np.asarray(lengths)):
        np.testing.assert_allclose(out[b, :n], want[b, :n], rtol=1e-5, atol=1e-5)


def test_tsa_decode_is_the_dense_methods_decode():
    """TSA is a prefill method: its decode is the dense method's (`common.decode_dense`, which on a GPU reads the
    stacked cache in place, where `dense_decode` on the layer slice made XLA copy the layer; the same masking of
    positions outside a window, which the model gives TSA only where no window binds)."""
    from jsparse.methods.dense import Dense
    from models.attention import LayerKV

    B, N, Hq, Hkv, D = 2, 40, 4, 2, 16
    ks = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(ks[0], (B, 1, Hq, D))
    k_all, v_all = (jax.random.normal(x, (2, B, Hkv, N, D)) for x in ks[1:])
    lengths = jnp.array([40, 23], jnp.int32)
    view = LayerKV(k=k_all[1], v=v_all[1], k_all=k_all, v_all=v_all, layer=jnp.int32(1))
    out = {}
    for window in (None, 8):
        extra = {} if window is None else dict(window=jnp.int32(window), window_size=window)
        got, _ = TSA().decode(LayerContext(layer=jnp.int32(1), lengths=lengths, info=TSALayerInfo(
            sparse=jnp.int32(1)), **extra), q, view, None)
        want, _ = Dense().decode(LayerContext(layer=jnp.int32(1), lengths=lengths, **extra), q, view, None)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        out[window] = np.asarray(got)
    assert not np.allclose(out[None], out[8], atol=1e-4)  # the window of 8 binds (rows at positions 39, 22)


def test_layer_drift_ignores_the_padding_of_a_row():
    """A right-padded row's padding does not count in TSA's calibration drift (full rows never showed it)."""
    params = random_params(CFG, jax.random.key(0), jnp.float32, scale=0.3)
    row = np.asarray(jax.random.randint(jax.random.key(1), (1, 20), 4, CFG.vocab_size), np.int32)
    padded = np.concatenate([row, np.asarray(jax.random.randint(jax.random.key(2), (1, 12), 4, CFG.vocab_size),
                                             np.int32)], axis=1)  # 12 junk tokens past the row's length
    want = tcal.layer_drift(params, CFG, jnp.asarray(row), jnp.asarray([20], jnp.int32))
    got = tcal.layer_drift(params, CFG, jnp.asarray(padded), jnp.asarray([20], jnp.int32))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)


def test_translate_anchor_indices_keeps_the_anchor_slot_just_before_a_dropped_first_query():
    """The anchor layer dropped position 4, the first query of this layer's tile 1 (tile = 4, this layer keeps
    every position): p0 = 4 maps to anchor slot 3 (position 3, the last at or before it), whose tile 0 the anchor
    attended densely; all of that tile's slots up to and including slot 3 (positions 0..3) lie before the query
    tile and are kept."""
    tile, T = 4, 8
    anchor_idx = jnp.asarray([[[[-1, -1, -1, -1], [0, 1, 2, 3]]]], jnp.int32)  # rows: anchor tiles 0, 1
    a_map = jnp.asarray([[[0, 1, 2, 3, 5, 6, 7, 8]]], jnp.int32)  # anchor dropped position 4
    ident = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (1, 1, T))
    got = np.asarray(translate_anchor_indices(anchor_idx, a_map, jnp.zeros((1,), jnp.int32), ident, ident, tile))
    np.testing.assert_array_equal(got[0, 0, 1], [0, 1, 2, 3, -1, -1, -1, -1])


def test_batch_with_one_dense_row_still_compresses_the_long_row():
    """A batch where one row is too short to compress (n <= min_tokens + W: dense) and another drops tokens: the
    long row is still compressed (only a batch where no row drops anything takes the dense path)."""
    q, k, v = _qkv(1)
    lengths = jnp.asarray([256, 40], jnp.int32)  # 40 <= min_tokens + window = 48: row 1 is dense
    m = TSA(tau=0.3, fill="zeros", **SMALL)
    out, state = jax.jit(m.prefill)(_ctx(lengths), q, k, v, m.init_state(CFG, 2, 256))
    counts, sel = jax.jit(m.select)(q, k, lengths)
    assert int(counts[0]) < 256 and int(counts[1]) == 40
    np.testing.assert_array_equal(state.kept[1], counts)
    want = masked_attention_reference(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                                      masked_reference_mask(sel, HQ))
    for b, n in enumerate(np.asarray(lengths)):
        np.testing.assert_allclose(out[b, :n], want[b, :n], rtol=1e-5, atol=1e-5)
    assert np.any(np.all(np.asarray(out[0]) == 0, axis=-1))  # row 0's dropped rows are zeros (not dense rows)


def test_prefill_layer_sparsity_counts_the_local_fill_at_the_ramps_edge():
    """fill="local": the n - K dropped rows are counted as attending sum_{j=K+1}^{n} min(C, j) keys (C =
    local_window + local_sinks), also where the first such row j = K + 1 is exactly C (or n) keys long."""
    from jsparse.methods.tsa import TSAState

    m = TSA(fill="local", local_window=8, local_sinks=2, **SMALL)  # C = 10
    C = 10
    lengths = np.asarray([100, 6, 200, 100], np.int32)
    kept = np.asarray([[100, 6, 200, 100], [9, 5, 120, 40], [100, 6, 10, 99]], np.int32)  # K = C - 1, K = n - 1
    got = m.prefill_layer_sparsity(CFG, TSAState(kept=jnp.asarray(kept)), lengths)
    assert sorted(got) == [1, 2]
    for layer in (1, 2):
        for row, n in enumerate(lengths):
            K = int(kept[layer, row])
            entries = K * (K + 1) / 2 + sum(min(C, j) for j in range(K + 1, n + 1))
            assert got[layer][row] == pytest.approx(1.0 - entries / (n * (n + 1) / 2), abs=1e-12)


def test_drift_rank_ties_put_the_lower_layer_first():
    """normalized_rank: rank 1 for the smallest drift, ties broken by the lower layer first (its docstring), so
    with delta = 0.5 and equal drifts the lower half of the tied layers is sparse."""
    np.testing.assert_allclose(tcal.normalized_rank([0.5, 0.5, 0.2, 0.5]), np.array([2, 3, 1, 4]) / 4)
    assert tcal.sparse_layers_from_drift([0.3, 0.3, 0.3, 0.3], 0.5) == [0, 1]

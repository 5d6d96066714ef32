"""The anchor dynamic program against brute force, the head map, and calibration on a tiny random model."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsparse.methods.kascade_calibration import (anchors_for_share, brute_force_anchors, calibrate, head_map_for,
                                                 layer_similarity, per_layer_share, report, select_anchors,
                                                 share_matrix)
from models.config import ModelConfig
from models.params import random_params
from types import SimpleNamespace
from jsparse.methods.kascade_calibration import RecorderState, _similarity, check_cli
from jsparse.methods import make_method
from models import llama
from models.cache import init_cache

TINY = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=5,
                   num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=512)
KW = dict(budget=0.1, tile=16, min_tokens=8)


@pytest.fixture(scope="module")
def tiny_params():
    return random_params(TINY, jax.random.key(0), jnp.float32, scale=0.5)


def _prompts(n, T):
    return [np.asarray(jax.random.randint(jax.random.key(i), (1, T), 0, 64)) for i in range(n)]


@pytest.mark.parametrize("L", [1, 2, 3, 5, 7, 10])
def test_dp_matches_brute_force(L):
    rng = np.random.default_rng(L)
    for trial in range(6):
        sim = rng.uniform(0, 1, size=(L, L, 3, 3))
        S = layer_similarity(sim)
        np.fill_diagonal(S, 1.0)
        w = rng.uniform(0, 1, size=L)
        for M in range(1, L + 1):
            got, got_score = select_anchors(S, w, M)
            want, want_score = brute_force_anchors(S, w, M)
            assert got[0] == 0 and len(got) == M and got == sorted(set(got))
            np.testing.assert_allclose(got_score, want_score, rtol=1e-12)
            owner = [max(a for a in got if a <= l) for l in range(L)]
            np.testing.assert_allclose(np.sum(w * S[owner, np.arange(L)]), got_score, rtol=1e-12)


def test_dp_rejects_bad_anchor_count():
    S, w = np.ones((4, 4)), np.ones(4)
    with pytest.raises(ValueError, match="num_anchors=5"):
        select_anchors(S, w, 5)
    with pytest.raises(ValueError, match="num_anchors=0"):
        select_anchors(S, w, 0)


def test_head_map_picks_best_anchor_head():
    """Layer l's KV head h2 reuses the head h1 of its anchor a (the last anchor at or before l) with the largest
    sim[a, l, h1, h2]: the argmax over the anchor's heads, per reusing head, from that anchor's own row."""
    L, H = 4, 3
    sim = np.zeros((L, L, H, H))
    sim[0, 1] = np.array([[0.1, 0.9, 0.2], [0.8, 0.0, 0.1], [0.0, 0.0, 0.7]])  # [h1, h2]
    sim[0, 1, 2, 0] = 0.95  # the argmax over h1 (axis 0) differs from the one over h2 now: [2, 0, 2] vs [1, 0, 2]
    sim[2, 3] = np.array([[0.0, 0.0, 0.6], [0.5, 0.0, 0.0], [0.0, 0.4, 0.0]])
    sim[0, 3] = 1.0  # layer 3 is served by anchor 2, not by layer 0's (higher) similarities
    hm = head_map_for(sim, [0, 2])
    np.testing.assert_array_equal(hm[0], [0, 1, 2])
    np.testing.assert_array_equal(hm[1], [2, 0, 2])
    np.testing.assert_array_equal(hm[2], [0, 1, 2])
    np.testing.assert_array_equal(hm[3], [1, 2, 0])
    rng = np.random.default_rng(0)
    L, H = 7, 5
    sim = rng.uniform(0, 1, size=(L, L, H, H))
    anchors = [0, 3, 4]
    hm = head_map_for(sim, anchors)
    for layer in range(L):
        a = max(x for x in anchors if x <= layer)
        for h2 in range(H):
            want = h2 if a == layer else max(range(H), key=lambda h1: sim[a, layer, h1, h2])
            assert hm[layer, h2] == want, (layer, h2)


def test_layer_similarity_is_the_best_anchor_head_averaged_over_reusing_heads():
    """S[a, l] = mean over l's heads h2 of max over a's heads h1 of sim[a, l, h1, h2] (the DP's input)."""
    rng = np.random.default_rng(1)
    L, H = 5, 4
    sim = rng.uniform(0, 1, size=(L, L, H, H))
    S = layer_similarity(sim)
    for a in range(L):
        for layer in range(L):
            want = sum(max(sim[a, layer, h1, h2] for h1 in range(H)) for h2 in range(H)) / H
            assert S[a, layer] == pytest.approx(want, rel=1e-12)


def test_share_anchors_keep_every_reuse_layer_above_target():
    rng = np.random.default_rng(0)
    L = 12
    S = rng.uniform(0.3, 0.9, size=(L, L))
    np.fill_diagonal(S, rng.uniform(0.8, 1.0, size=L))
    share = share_matrix(S)
    np.testing.assert_allclose(np.diag(share), 1.0)
    for target in (0.5, 0.8, 0.95, 1.0):
        anchors = anchors_for_share(share, target)
        reached = per_layer_share(share, anchors)
        assert anchors[0] == 0 and anchors == sorted(set(anchors))
        assert np.all(reached >= target) and np.all(reached[anchors] == 1.0)
    assert anchors_for_share(share, 1e-9) == [0]
    assert anchors_for_share(share, 1.0) == list(range(L))
    with pytest.raises(ValueError, match="target_share=0"):
        anchors_for_share(share, 0.0)
    # a wider reuse set recovers more: its share is measured against the same own top-k mass
    wide = np.minimum(S * 1.2, 1.0)
    assert np.all(share_matrix(S, wide) >= share)


def test_share_anchors_are_the_fewest_brute_force():
    """The fewest anchors that keep every reuse layer at the target, against every anchor set of small L (scanning
    in order took more in about 1 case in 8: a layer the current anchor serves badly can start a run whose anchor
    serves it and its successors well, where the scan made both an anchor); among equally few, the largest total
    share."""
    rng = np.random.default_rng(1)
    scan_took_more = 0
    for trial in range(300):
        L = int(rng.integers(2, 8))
        share = rng.uniform(0.6, 1.0, size=(L, L))
        np.fill_diagonal(share, 1.0)
        target = float(rng.choice([0.7, 0.8, 0.9]))
        got = anchors_for_share(share, target)
        feasible = [[0, *rest] for m in range(L) for rest in itertools.combinations(range(1, L), m)
                    if np.all(per_layer_share(share, [0, *rest]) >= target)]
        fewest = min(len(a) for a in feasible)
        top = max(per_layer_share(share, a).sum() for a in feasible if len(a) == fewest)
        assert len(got) == fewest and np.isclose(per_layer_share(share, got).sum(), top), (trial, got)
        scan = [0]
        for l in range(1, L):
            if share[scan[-1], l] < target:
                scan.append(l)
        scan_took_more += len(scan) > fewest
    assert scan_took_more > 0  # the case the dynamic program is for occurs on such matrices


def test_calibrate_by_share_on_a_tiny_model(tiny_params):
    """End to end on a tiny random model: anchors, head map and the per-layer shares in the artifact's meta."""
    prompts = _prompts(2, 256)
    art = calibrate(tiny_params, TINY, prompts, target_share=0.97, reuse_scale=2.0, **KW)
    m = art.meta
    assert m["target_share"] == 0.97 and m["reuse_scale"] == 2.0 and m["anchors"][0] == 0
    assert len(m["share"]) == len(m["share_wide"]) == 5
    for l in range(5):
        assert (m["share"][l] == 1.0) if l in m["anchors"] else (0.97 <= m["share"][l] <= m["share_wide"][l] + 1e-9)
    assert art.arrays["head_map"].shape == (5, 2) and art.arrays["similarity_wide"].shape == (5, 5, 2, 2)
    assert "anchors" in report(art) and f"{len(m['anchors'])} anchors" in report(art)
    # sim[l1, l2, h1, h2] is a share of layer l2's tile-pooled attention mass, normalised over the keys before each
    # tile (the module docstring), so every similarity, plain or wide, lies in [0, 1] (up to ~17 unnormalised).
    for name in ("similarity", "similarity_wide"):
        s = art.arrays[name]
        assert s.min() >= 0.0 and s.max() <= 1.0 + 1e-5, (name, s.min(), s.max())
    # The wider sets (reuse_scale * k keys, a superset per tile) recover at least as much.
    assert np.all(art.arrays["similarity_wide"] >= art.arrays["similarity"] - 1e-5)
    fixed = calibrate(tiny_params, TINY, prompts, num_anchors=2, **KW)
    assert len(fixed.meta["anchors"]) == 2 and fixed.meta["target_share"] is None
    with pytest.raises(ValueError, match="reuse_scale=0.5"):
        calibrate(tiny_params, TINY, prompts, reuse_scale=0.5, **KW)
    # Prompts too short for any tile's top-k to leave a key out: every similarity was 1, anchors [0], a collapsed
    # head map, written without a word.
    with pytest.raises(ValueError, match=r"prompts of 16 tokens: no query tile's top-k leaves a key out .*at least "
                                         r"17 tokens"):
        calibrate(tiny_params, TINY, [p[:, :16] for p in prompts], **KW)


def test_calibration_counts_every_prompt_once_in_batches_of_unequal_size(tiny_params):
    """similarity, similarity_wide and importance are means over the prompts, each counting once however they are
    batched (batches of one size cannot tell a per-row weighting from weighting only the first batch by its rows)."""
    rows = _prompts(3, 128)
    kw = dict(KW, target_share=0.97, reuse_scale=2.0)
    names = ("similarity", "similarity_wide", "importance")
    each = [calibrate(tiny_params, TINY, [r], **kw) for r in rows]
    want = {n: np.mean([a.arrays[n].astype(np.float64) for a in each], axis=0) for n in names}
    assert not np.allclose(each[0].arrays["similarity"], each[1].arrays["similarity"], atol=1e-3)
    for batches in ([rows[0], np.concatenate(rows[1:])], [np.concatenate(rows[:2]), rows[2]], rows,
                    [np.concatenate(rows)]):
        art = calibrate(tiny_params, TINY, batches, **kw)
        assert art.meta["prompts"] == 3
        for n in names:
            np.testing.assert_allclose(art.arrays[n], want[n], rtol=1e-5, atol=1e-6)


def test_share_equal_to_target_is_served():
    """A reuse layer whose share equals the target exactly is served ('at least `target`')."""
    L = 5
    # A perfect recovery (share 1.0 everywhere) meets target 1.0: one anchor, layer 0.
    assert anchors_for_share(np.ones((L, L)), 1.0) == [0]
    # Shares of exactly 0.5 (a binary fraction, so no rounding) meet target 0.5.
    share = np.full((L, L), 0.5)
    np.fill_diagonal(share, 1.0)
    anchors = anchors_for_share(share, 0.5)
    assert anchors == [0]
    assert per_layer_share(share, anchors).min() >= 0.5
    # ... and a target a hair above the shares is met by no anchor but the layer itself.
    assert anchors_for_share(share, np.nextafter(0.5, 1.0)) == list(range(L))


def test_similarity_is_the_min_over_eligible_tiles_of_the_recovered_mass_averaged_over_the_batch():
    """`_similarity` against its definition, in float64 loops: sim[l1, l2, h1, h2] = mean over the batch of the min
    over the tiles where top-k leaves keys out (n_before > k) of sum_j P[l2, h2, i, I[l1, h1, i, j]], the -1
    padding of a tile's shorter set counting nothing (the source's indices, the destination's weights)."""
    rng = np.random.default_rng(0)
    L, B, H, tile, nT, K = 3, 2, 2, 4, 4, 3
    T = tile * nT
    tile_budget = np.array([1, 1, 2, 3])  # eligible: tiles 1, 2, 3 (4, 8, 12 keys before them)
    probs = np.zeros((L, B, H, nT, T))
    idx = np.full((L, B, H, nT, K), -1, np.int64)
    for l, b, h, i in np.ndindex(L, B, H, nT):
        n = i * tile
        if n:
            p = rng.uniform(0.0, 1.0, n) ** 3
            probs[l, b, h, i, :n] = p / p.sum()
            kk = min(int(tile_budget[i]), n)
            idx[l, b, h, i, :kk] = rng.choice(n, kk, replace=False)  # fewer than K: -1 padded
    state = RecorderState(probs=jnp.asarray(probs, jnp.float32), indices=jnp.asarray(idx, jnp.int32),
                          wide=jnp.asarray(idx, jnp.int32))
    got = np.asarray(_similarity(state, jnp.asarray(tile_budget), tile))
    want = np.zeros((L, L, H, H))
    for l1, l2, h1, h2 in np.ndindex(L, L, H, H):
        per_b = []
        for b in range(B):
            rec = [sum(probs[l2, b, h2, i, j] for j in idx[l1, b, h1, i] if j >= 0)
                   for i in range(nT) if i * tile > tile_budget[i]]
            per_b.append(min(rec))
        want[l1, l2, h1, h2] = np.mean(per_b)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(want, want.transpose(1, 0, 3, 2), atol=1e-3)  # the source/destination order matters


def test_importance_is_one_minus_the_cosine_of_each_layers_input_and_after_attention_residual(tiny_params):
    """importance w[l] = mean over tokens of 1 - cos(x_l, x_l + attn_l(x_l)) (the module docstring), by hand from
    the dense prefill's hidden states."""
    tokens = _prompts(1, 64)[0]
    art = calibrate(tiny_params, TINY, [tokens], num_anchors=2, **KW)
    _, _, _, (x_in, x_attn) = llama.prefill(tiny_params, TINY, make_method("dense"), jnp.asarray(tokens),
                                            jnp.full((1,), 64, jnp.int32), init_cache(TINY, 1, 64, jnp.float32),
                                            None, return_hidden=True)
    xi, xa = np.asarray(x_in, np.float64), np.asarray(x_attn, np.float64)
    cos = np.sum(xi * xa, -1) / (np.linalg.norm(xi, axis=-1) * np.linalg.norm(xa, axis=-1))
    np.testing.assert_allclose(art.arrays["importance"], np.mean(1.0 - cos, axis=(1, 2)), rtol=1e-4, atol=1e-6)


def test_fixed_anchor_count_maximises_the_importance_weighted_layer_similarity(tiny_params):
    """With `num_anchors`, the anchors and the objective are the dynamic program's on S = layer_similarity(sim)
    and the importance (sum_l w[l] * S[a(l), l]), checked by brute force on the artifact's own arrays."""
    art = calibrate(tiny_params, TINY, _prompts(2, 128), num_anchors=3, **KW)
    S = layer_similarity(art.arrays["similarity"].astype(np.float64))
    w = art.arrays["importance"].astype(np.float64)
    want, want_score = brute_force_anchors(S, w, 3)
    assert art.meta["anchors"] == want
    np.testing.assert_allclose(art.meta["objective"], want_score, rtol=1e-5)


def test_wide_sets_of_every_key_recover_all_the_mass(tiny_params):
    """reuse_scale * budget >= 1: an anchor hands every key before the tile to its reuse layers, so every wide
    similarity is 1 and a reuse layer's share_wide, the wide mass over its own top-k mass S[l, l], is 1 / S[l, l];
    the plain top-k sets recover less."""
    art = calibrate(tiny_params, TINY, _prompts(1, 128), target_share=0.01, reuse_scale=10.0, **KW)
    np.testing.assert_allclose(art.arrays["similarity_wide"], 1.0, atol=1e-5)
    assert art.meta["anchors"] == [0]  # every layer reuses layer 0's sets
    own = np.diag(layer_similarity(art.arrays["similarity"].astype(np.float64)))
    np.testing.assert_allclose(art.meta["share_wide"], [1.0, *(1.0 / own[1:])], atol=2e-4)
    assert max(art.meta["share"][1:]) < 0.99 and art.arrays["similarity"].min() < 0.99


def test_calibrate_checks_its_arguments_before_any_prompt():
    """An anchor count past the model's layers and a target share outside (0, 1] are named before the work (here
    with no prompts at all, which would otherwise be the error)."""
    with pytest.raises(ValueError, match="anchors=6: expected between 1 and the model's 5 layers"):
        calibrate(None, TINY, [], num_anchors=6, **KW)
    with pytest.raises(ValueError, match=r"target_share=0.0: expected a fraction in \(0, 1\]"):
        calibrate(None, TINY, [], num_anchors=2, target_share=0.0, **KW)


def test_check_cli_refuses_a_zero_anchor_count():
    args = SimpleNamespace(anchors=0, target_share=None, reuse_scale=2.0, budget=0.1, tile=32)
    with pytest.raises(ValueError, match="--anchors 0: expected at least 1"):
        check_cli(args)


def test_a_budget_under_the_floor_at_the_prompts_length_warns(tiny_params):
    """k = max(ceil(budget * n), min_tokens): on prompts no longer than min_tokens / budget every budget keeps
    min_tokens keys, so the calibration is that of any of them (`calibrate kascade --budget` had no effect at a short
    --length, silently); said, and a longer prompt does not warn."""
    import warnings

    from jsparse.methods.kascade_calibration import calibrate

    short = np.asarray(jax.random.randint(jax.random.key(1), (1, 64), 0, TINY.vocab_size), np.int32)
    with pytest.warns(UserWarning, match=r"prompts of 64 tokens at budget 0.1: k = max\(ceil\(0.1 \* n\), "
                                         r"min_tokens=8\) is 8 at every position \(the budget sets k only past 80"):
        calibrate(tiny_params, TINY, [short], num_anchors=2, **KW)
    longer = np.asarray(jax.random.randint(jax.random.key(1), (1, 96), 0, TINY.vocab_size), np.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        calibrate(tiny_params, TINY, [longer], num_anchors=2, **KW)

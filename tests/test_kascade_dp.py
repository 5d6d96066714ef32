"""The anchor dynamic program against brute force, and the head map."""

import numpy as np
import pytest

from jsparse.methods.kascade_calibration import brute_force_anchors, head_map_for, layer_similarity, select_anchors


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
    L, H = 4, 3
    sim = np.zeros((L, L, H, H))
    sim[0, 1] = np.array([[0.1, 0.9, 0.2], [0.8, 0.0, 0.1], [0.0, 0.0, 0.7]])  # [h1, h2]
    hm = head_map_for(sim, [0, 2])
    np.testing.assert_array_equal(hm[0], [0, 1, 2])
    np.testing.assert_array_equal(hm[1], [1, 0, 2])
    np.testing.assert_array_equal(hm[2], [0, 1, 2])

"""The shared selection machinery the methods use, against plain numpy: top-k by threshold, coverage, GQA pooling,
budgets and their split, heat bookkeeping, token compression's capacities, retrieval heads."""

from __future__ import annotations

import itertools
import math
import types
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsparse import budget_split, compression, heat, retrieval_heads
from jsparse import selection as sel
from jsparse.artifacts import Artifact, save_artifact
from jsparse.methods.common import stacked_cache
from models.attention import LayerKV


def _np_topk_mask(scores, k, eligible):
    """Reference: the k largest eligible scores (negative as 0), ties to the lower position."""
    out = np.zeros(scores.shape, bool)
    for idx in np.ndindex(scores.shape[:-1]):
        s = np.where(scores[idx] > 0, scores[idx], 0.0)
        cand = [j for j in range(s.shape[0]) if eligible[idx][j]]
        cand.sort(key=lambda j: (-s[j], j))
        out[idx][cand[:int(k[idx])]] = True
    return out


def test_topk_mask_matches_sorting_with_ties_to_the_lower_position():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, size=(3, 2, 40)).astype(np.float32) / 4  # many ties
    scores[0, 0, :5] = -1.0  # negative counts as 0
    eligible = rng.random((3, 1, 40)) < 0.7
    n_elig = eligible.sum(-1)  # [3, 1]
    k = np.minimum(rng.integers(0, 30, size=(3, 1)), n_elig)
    got = np.asarray(sel.topk_mask(jnp.asarray(scores), jnp.asarray(k, jnp.int32), jnp.asarray(eligible)))
    want = _np_topk_mask(scores, np.broadcast_to(k, (3, 2)), np.broadcast_to(eligible, scores.shape))
    np.testing.assert_array_equal(got, want)
    assert (got.sum(-1) == np.broadcast_to(k, (3, 2))).all()
    scores = jnp.array([[0.0, 0.0, 1.0, 0.0, 0.0]])
    eligible = jnp.array([[False, True, True, False, True]])
    got = np.asarray(sel.topk_mask(scores, jnp.array([2], jnp.int32), eligible))
    np.testing.assert_array_equal(got, [[False, True, True, False, False]])  # the zero tie: lowest eligible position
    got = np.asarray(sel.topk_mask(scores, jnp.array([3], jnp.int32), eligible))
    np.testing.assert_array_equal(got, [[False, True, True, False, True]])


def test_coverage_drop_count_is_the_light_tail_below_tau():
    rng = np.random.default_rng(1)
    scores = rng.random((4, 30)).astype(np.float32) ** 4
    eligible = np.arange(30)[None] < np.array([30, 20, 5, 0])[:, None]
    for tau in (0.0, 0.05, 0.3):
        got = np.asarray(sel.coverage_drop_count(jnp.asarray(scores), jnp.asarray(eligible), tau))
        for b in range(4):
            s = np.sort(scores[b, eligible[b]].astype(np.float64))
            p = s / s.sum() if s.size else s
            assert got[b] == int(np.sum(np.cumsum(p) < tau)), (b, tau)
    assert np.asarray(sel.coverage_drop_count(jnp.asarray(scores), jnp.asarray(eligible), 0.0)).max() == 0
    scores = jnp.array([[1.0, 1.0, 2.0, 0.0], [0.0, 0.0, 3.0, 1.0]])
    eligible = jnp.ones((2, 4), bool)
    # row 0: p = (.25, .25, .5, 0) sorted (0, .25, .25, .5), cumsum (0, .25, .5, 1): below 0.5 are 2, not 3
    np.testing.assert_array_equal(sel.coverage_drop_count(scores, eligible, 0.5), [2, 3])
    # tau = 0 drops nothing, even keys of zero mass (0 < 0 is false)
    np.testing.assert_array_equal(sel.coverage_drop_count(scores, eligible, 0.0), [0, 0])


def test_group_probs_pool_to_pooled_probs_and_group_sum():
    ks = jax.random.split(jax.random.key(0), 2)
    B, T, Hq, Hkv, D, N = 2, 3, 6, 2, 8, 10
    q = jax.random.normal(ks[0], (B, T, Hq, D))
    k = jax.random.normal(ks[1], (B, Hkv, N, D))
    pos = jnp.array([[4, 5, 6], [7, 8, 9]])
    gp = sel.group_probs(q, k, pos)
    assert gp.shape == (B, Hkv, Hq // Hkv, T, N)
    qn, kn = np.asarray(q, np.float64), np.asarray(k, np.float64)  # float64 softmax, one head at a time
    for b, h, t in itertools.product(range(B), range(Hq), range(T)):
        n = int(pos[b, t]) + 1
        z = kn[b, h // (Hq // Hkv), :n] @ qn[b, t, h] / np.sqrt(D)
        want = np.zeros(N)
        want[:n] = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        np.testing.assert_allclose(gp[b, h // (Hq // Hkv), h % (Hq // Hkv), t], want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(gp.sum(-1), 1.0, rtol=1e-5)
    assert float(jnp.abs(jnp.where(jnp.arange(N)[None, None, None, None] > pos[:, None, None, :, None], gp, 0)).max()) == 0
    np.testing.assert_allclose(sel.pooled_probs(q, k, pos), gp.sum(axis=2), rtol=1e-6)
    per_head = gp.reshape(B, Hq, T, N)
    np.testing.assert_allclose(sel.group_sum(per_head, Hkv), gp.sum(axis=2), rtol=1e-6)
    with pytest.raises(ValueError, match="do not split into 4"):
        sel.group_sum(per_head, 4)


def test_keys_to_keep_token_count_or_fraction():
    assert sel.keys_to_keep(1000, 0.1, 128) == 128
    assert sel.keys_to_keep(1000, 0.5, 128) == 500
    assert sel.keys_to_keep(1000, 0.1, 128, tokens=300) == 300
    assert sel.keys_to_keep(200, 0.1, 128, tokens=300) == 200
    n = jnp.array([1, 100, 1000])
    np.testing.assert_array_equal(sel.keys_to_keep(n, 0.5, 10, tokens=64), [1, 64, 64])
    np.testing.assert_array_equal(sel.keys_to_keep(n, 0.5, 10), [1, 50, 500])


def test_check_layers_and_positive_int():
    assert sel.check_layers("x", [3, 1, np.int64(2)], 4) == (1, 2, 3)
    for bad in ([1, 1], [4], [-1]):
        with pytest.raises(ValueError, match=r"expected distinct layers in \[0, 4\)"):
            sel.check_layers("sparse_layers", bad, 4)
    with pytest.raises(ValueError, match="expected a sequence of layer indices"):
        sel.check_layers("sparse_layers", "12", 4)
    assert sel.check_positive_int("n", np.int32(3)) == 3 and type(sel.check_positive_int("n", np.int32(3))) is int
    for bad in (0, True, 1.5, "2"):
        with pytest.raises(ValueError, match="expected an integer >= 1"):
            sel.check_positive_int("n", bad)
    assert sel.integer_array("head_map", np.array([[0, 2]], np.int16)).dtype == np.int16
    np.testing.assert_array_equal(sel.integer_array("head_map", [3, 1]), [3, 1])
    for bad, dtype in (([0.0, 1.7], "float64"), ([True, False], "bool"), (np.array([1.0], np.float32), "float32")):
        with pytest.raises(ValueError, match=rf"head_map has dtype {dtype}: expected integers \(indices\)"):
            sel.integer_array("head_map", bad)


def test_budget_tokens_of_an_int_equal_a_traced_rows():
    """The static width from an int n holds the k a traced row of n computes (both f32 products): in f64,
    ceil(0.3 * 3200) = 960 while the f32 row's is 961, and the window lost its newest key, the query's own."""
    n = np.arange(1, 6001)
    for budget in (0.1, 0.15, 0.3, 0.33, 0.6, 0.66):
        rows = np.asarray(sel.budget_tokens(budget, jnp.asarray(n, jnp.int32), 16))
        assert [sel.budget_tokens(budget, int(i), 16) for i in n] == rows.tolist(), budget
    assert sel.budget_tokens(0.3, 3200, 16) == 961
    from pallas_kernels.anchor_attention.common import budget_count  # the kernels' copy of the rule
    assert budget_count(0.3, 3200, 16) == 961 == int(budget_count(0.3, jnp.asarray([3200]), 16)[0])
    with pytest.raises(ValueError, match="budget=True"):
        sel.check_budget(True)
    n = np.arange(3150, 3250)
    np.testing.assert_array_equal(sel.topk_kept(0.3, n, 16), [sel.budget_tokens(0.3, int(i), 16) for i in n])
    assert sel.topk_kept(0.3, 3200, 16) == 961.0
    np.testing.assert_array_equal(sel.topk_map_entries(None, np.array([0, 1, 4])), [0.0, 1.0, 10.0])
    # min_tokens 1, budget 0.5: queries 0..3 keep 1, 1, 2, 2 of their 1, 2, 3, 4 keys
    np.testing.assert_array_equal(sel.topk_map_entries(0.5, np.array([0, 1, 3, 4]), 1), [0.0, 1.0, 4.0, 6.0])
    assert sel.check_budget(1) == 1.0 and sel.check_budget(np.float32(0.5)) == 0.5
    assert sel.check_budget(1e-9) == 1e-9
    for bad in (0, 0.0, -0.1, 1.0000001, float("nan")):
        with pytest.raises(ValueError, match=rf"budget={bad!r}: expected a fraction of the context in \(0, 1\]"):
            sel.check_budget(bad)


def test_budget_split_counts_sum_to_the_budget_and_favour_the_first_components():
    fr = (1 / 16, 3 / 8, 5 / 16, 1 / 4)
    cum = budget_split.cumulative_fixed(fr)
    assert cum[-1] == 1 and cum[1] == Fraction(7, 16)
    for kb in range(0, 200):
        counts = budget_split.split_counts(kb, cum)
        assert sum(counts) == kb and min(counts) >= 0
    assert budget_split.split_counts(1, cum)[0] == 1  # one block: the sink
    # With a component ensured (EvoSparse's local window): it has a block at every budget, the sum unchanged.
    for kb in range(0, 200):
        counts = budget_split.split_counts(kb, cum, ensure=1)
        assert sum(counts) == kb and min(counts) >= 0 and (counts[1] >= 1) == (kb >= 1)
        if budget_split.split_counts(kb, cum)[1] > 0:
            assert counts == budget_split.split_counts(kb, cum)  # only budgets that left it none change
    assert budget_split.split_counts(1, cum, ensure=1) == (0, 1, 0, 0)
    assert budget_split.split_counts(2, cum, ensure=1) == (0, 1, 1, 0)
    kb = np.arange(0, 9)
    assert [tuple(c) for c in zip(*budget_split.split_counts(kb, cum, ensure=1))] == [
        budget_split.split_counts(int(i), cum, ensure=1) for i in kb]  # arrays as ints
    widths = budget_split.max_counts(40, cum)
    kb = np.arange(1, 41)
    assert widths == tuple(int(c.max()) for c in budget_split.split_counts(kb, cum))
    assert budget_split.drop_components(fr, ("a", "b", "c", "d"), ("c",)) == pytest.approx((1 / 11, 6 / 11, 0, 4 / 11))
    # Fractions that are not 4096ths split as their exact values: equal thirds evenly (their nearest 4096ths, 1365 and
    # 2731, split 3 blocks as 1, 2, 0), 0.1 of 10 blocks as one block (410/4096 gave two), and the no-retrieval
    # ablation's 1/11, 6/11, 4/11 of 11 blocks as 1, 6, 4 (2607/4096 for 7/11 gave 1, 7, 3).
    thirds = budget_split.cumulative_fixed((1 / 3, 1 / 3, 1 / 3))
    assert thirds == (Fraction(1, 3), Fraction(2, 3), Fraction(1))
    for kb in range(0, 40):
        one, two = -(-kb // 3), -(-2 * kb // 3)  # ceil(kb / 3), ceil(2 kb / 3)
        assert budget_split.split_counts(kb, thirds) == (one, two - one, kb - two)
    assert budget_split.split_counts(10, budget_split.cumulative_fixed((0.1, 0.9))) == (1, 9)
    assert budget_split.split_counts(11, budget_split.cumulative_fixed((1 / 11, 6 / 11, 0.0, 4 / 11))) == (1, 6, 0, 4)
    assert budget_split.split_counts(jnp.arange(9, 12), thirds)[1].tolist() == [3, 3, 4]  # in jnp as in Python
    with pytest.raises(ValueError, match="leave nothing"):
        budget_split.drop_components((0, 0, 1, 0), "abcd", ("c",))
    with pytest.raises(ValueError, match="sum to 0.9"):
        budget_split.check_fractions((0.5, 0.4), ("x_fraction", "y_fraction"))
    # Ensuring a component of fraction 0 ensures it nothing (the split is the plain one).
    cum = budget_split.cumulative_fixed((0.5, 0.0, 0.5))
    for kb in range(0, 40):
        assert budget_split.split_counts(kb, cum, ensure=1) == budget_split.split_counts(kb, cum)
    # the first component has fraction 0: the ensured block comes from the first component that has one
    cum = budget_split.cumulative_fixed((0.0, 0.5, 0.5))
    assert budget_split.split_counts(1, cum) == (0, 1, 0)
    assert budget_split.split_counts(1, cum, ensure=2) == (0, 0, 1)
    kb = np.arange(0, 40)
    counts = budget_split.split_counts(kb, cum, ensure=2)
    assert min(int(c.min()) for c in counts) == 0 and (sum(counts) == kb).all()
    assert ((counts[2] >= 1) == (kb >= 1)).all()
    names = ("x_fraction", "y_fraction")
    for bad in ((1.5, -0.5), (float("nan"), 1.0), (float("inf"), 1.0), (True, 0.0)):
        with pytest.raises(ValueError, match=r"expected numbers >= 0 that sum to 1"):
            budget_split.check_fractions(bad, names)
    assert budget_split.check_fractions((np.float32(0.25), 0.75), names) == (0.25, 0.75)


def test_block_budget_attended_fraction_counts_whole_blocks():
    bb = budget_split.BlockBudget(budget=0.25, min_tokens=8, block_size=4, fractions=(0.5, 0.5))
    for p in range(0, 60):
        n = p + 1
        k = min(max(int(np.ceil(0.25 * n)), 8), n)
        kb = -(-k // 4)
        own = p % 4 + 1  # keys of the own, partial, block
        assert bb.attended_fraction(p) == pytest.approx(min((kb - 1) * 4 + own, n) / n)
        kb_arr, nbv, counts = bb.row(jnp.int32(p))
        assert int(kb_arr) == kb and int(nbv) == p // 4 + 1 and sum(int(c) for c in counts) == kb
    nb, Kb, widths = bb.widths(64)
    assert (nb, Kb) == (16, 4) and len(widths) == 2
    tok = budget_split.BlockBudget(budget=0.25, min_tokens=8, block_size=4, fractions=(1.0,), tokens=6)
    assert tok.widths(64)[1] == 2
    # attended_fraction takes the blocks `row` (the kernels' f32 rule) gives: at budget 0.3 and n = 3200 the f32
    # product keeps 961 keys (61 blocks of 16), the f64 one 960 (60 blocks).
    bb = budget_split.BlockBudget(budget=0.3, min_tokens=16, block_size=16, fractions=(0.5, 0.5))
    p = np.arange(3100, 3300)
    kb, _, _ = bb.row(jnp.asarray(p, jnp.int32))
    want = budget_split.blocks_fraction(np.asarray(kb), p, 16)
    np.testing.assert_array_equal(bb.attended_fraction(p), want)
    assert bb.attended_fraction(3199) == pytest.approx(61 * 16 / 3200)  # its own block complete


def test_heat_update_decay_and_pool_against_numpy():
    rng = np.random.default_rng(2)
    h = rng.random((2, 3, 10)).astype(np.float32)
    idx = np.array([[[0, 4, 9, -1]] * 3] * 2, np.int32)
    vals = rng.random((2, 3, 4)).astype(np.float32)
    want = 0.5 * h.copy()
    for b in range(2):
        for hh in range(3):
            for j in range(3):
                want[b, hh, idx[b, hh, j]] += vals[b, hh, j]
    np.testing.assert_allclose(heat.heat_update(jnp.asarray(h), jnp.asarray(idx), jnp.asarray(vals), 0.5), want,
                               rtol=1e-6)
    stacked = jnp.asarray(rng.random((4, 2, 3)).astype(np.float32))
    d = np.asarray(heat.decay_heat(stacked, 2, 0.5))
    np.testing.assert_allclose(d[:2], stacked[:2])
    np.testing.assert_allclose(d[2:], 0.5 * np.asarray(stacked[2:]))
    x = jnp.arange(10, dtype=jnp.float32)[None]
    np.testing.assert_allclose(heat.pool_blocks(x, 4, 5), [[6, 22, 17, 0, 0]])
    with pytest.raises(ValueError, match="need 3 blocks of 4, more than the 2"):
        heat.pool_blocks(x, 4, 2)
    rng = np.random.default_rng(5)
    h = rng.random((2, 3, 6)).astype(np.float32)
    mass = rng.random((2, 3, 6)).astype(np.float32)
    want = 0.25 * h.astype(np.float64) + mass
    np.testing.assert_allclose(heat.heat_step(jnp.asarray(h), jnp.asarray(mass), 0.25), want, rtol=1e-6)
    np.testing.assert_allclose(heat.heat_step(jnp.asarray(h), jnp.asarray(mass), 1.0), h + mass, rtol=1e-6)  # H2O


def test_scan_rows_runs_rows_in_order_on_one_layer():
    stack = jnp.zeros((3, 2, 1, 5))  # [L, B, Hkv, NB]
    xs = jnp.arange(2 * 4, dtype=jnp.float32).reshape(2, 4)  # [B, T]

    def step(h, x_t):  # h: [B, Hkv, NB]; each row adds x_t to block 0 and returns the running total seen
        h = h.at[:, 0, 0].add(x_t)
        return h, h[:, 0, 0]

    out, new, none = heat.scan_rows(stack, jnp.int32(1), step, xs)
    assert none is None
    running = np.cumsum(np.asarray(xs), axis=1)
    np.testing.assert_allclose(out, running)
    np.testing.assert_allclose(new[1, :, 0, 0], np.asarray(xs).sum(1))
    assert float(jnp.abs(new[0]).max()) == 0 and float(jnp.abs(new[2]).max()) == 0
    out, none, rows = heat.scan_rows(None, jnp.int32(0), lambda h, x: (h, 2 * x), xs)
    assert none is None and rows is None
    np.testing.assert_allclose(out, 2 * np.asarray(xs))

    # with a rows buffer: slot t + 1 of this layer holds the heat after row t, other layers keep the heat before
    start = stack.at[:, :, 0, 1].set(7.0)
    rows = heat.begin_rows(start, 4)
    assert rows.shape == (3, 2, 1, 5, 5)
    _, new, rows = heat.scan_rows(start, jnp.int32(1), step, xs, rows=rows)
    np.testing.assert_allclose(rows[1, :, 0, 1:, 0], running)
    np.testing.assert_allclose(rows[1, :, 0, 0, 0], 0.0)
    np.testing.assert_allclose(rows[:, :, 0, :, 1], 7.0)
    np.testing.assert_allclose(rows[0, :, 0, :, 0], 0.0)
    kept = heat.keep_rows(rows, jnp.array([0, 3]))
    np.testing.assert_allclose(kept[1, :, 0, 0], [0.0, running[1, 2]])
    np.testing.assert_allclose(heat.keep_rows(rows, jnp.array([4, 4])), new)


def test_capacities_and_the_bucket_switch():
    assert compression.capacities(1000, 4) == (256, 512, 768, 1000)
    assert compression.capacities(300, 8) == (128, 256, 300)
    assert compression.capacities(300, 1) == (300,)
    caps = compression.capacities(1000, 4)
    pick = jax.jit(lambda largest, none: compression.attend_at_capacity(
        largest, caps, lambda c: jnp.float32(c), lambda: jnp.float32(-1), none))
    for largest, want in ((1, 256), (256, 256), (257, 512), (999, 1000), (1000, 1000)):
        assert float(pick(jnp.int32(largest), jnp.bool_(False))) == want
    assert float(pick(jnp.int32(10), jnp.bool_(True))) == -1
    assert compression.capacities(1000, 4, exact=0) == (128, 256, 512, 768, 1000)  # never a capacity of 0
    assert compression.capacities(1000, 4, exact=1) == (128, 256, 512, 768, 1000)
    assert compression.capacities(1000, 4, exact=600) == (256, 512, 640, 768, 1000)
    assert compression.capacities(100, 2, exact=0) == (100,)  # capped at T


def test_map_sparsity_and_kept_summary():
    kept = np.array([[10, 4], [5, 4]])
    lengths = np.array([10, 4])
    np.testing.assert_allclose(compression.causal_map_sparsity(kept, lengths[None]),
                               [[0, 0], [1 - 30 / 110, 0]])
    s = compression.kept_summary(kept, lengths)
    np.testing.assert_allclose(s["kept_fraction"], [1.0, 0.75])
    np.testing.assert_allclose(s["attention_map_sparsity"], [0, (1 - 30 / 110) / 2])
    got = compression.causal_map_sparsity(np.array([0, 0, 1]), np.array([0, -3, 1]))
    np.testing.assert_array_equal(got, [1.0, 1.0, 0.0])  # n < 1 counts as 1: k = 0 skips all of it
    s = compression.kept_summary(np.array([[0, 4]]), np.array([0, 4]))
    np.testing.assert_array_equal(s["kept_fraction"], [0.5])
    np.testing.assert_array_equal(s["attention_map_sparsity"], [0.5])


def test_retrieval_layout_and_top_heads():
    cfg = types.SimpleNamespace(num_layers=3, num_heads=4, num_kv_heads=2)
    lay = retrieval_heads.retrieval_layout(cfg, [(1, 3), (1, 0), (2, 2)])
    np.testing.assert_array_equal(lay.has_retrieval, [False, True, True])
    np.testing.assert_array_equal(lay.kv_heads[1], [0, 1])
    np.testing.assert_array_equal(lay.head_mask[1], [[True, False], [False, True]])
    np.testing.assert_array_equal(lay.head_mask[2, 0], [True, False])
    assert lay.kv_heads[2, 0] == 1
    with pytest.raises(ValueError, match=r"head=4\): expected layer in \[0, 3\) and head in \[0, 4\)"):
        retrieval_heads.retrieval_layout(cfg, [(0, 4)])
    scores = np.array([[0, 5, 1, 1], [2, 0, 0, 5], [0, 0, 0, 0]], float)
    assert retrieval_heads.top_heads(scores, 3) == [(0, 1), (1, 3), (1, 0)]
    # Ties (hit fractions tie often) go to the lower layer, then head, on a grid of a real model's size too, where
    # an unstable sort orders equal scores otherwise.
    grid = np.random.default_rng(0).integers(0, 20, (30, 9)) / 20
    flat = grid.ravel()
    for num in (1, 4, 17):
        want = sorted(range(flat.size), key=lambda i: (-flat[i], i))[:num]
        assert retrieval_heads.top_heads(grid, num) == [(i // 9, i % 9) for i in want]
    assert retrieval_heads.default_num_heads(cfg) == 1
    for L, Hq in ((32, 32), (28, 28), (24, 14), (2, 4)):
        cfg = types.SimpleNamespace(num_layers=L, num_heads=Hq, num_kv_heads=2)
        assert retrieval_heads.default_num_heads(cfg) == max(1, round(0.015 * L * Hq)), (L, Hq)
    cfg = types.SimpleNamespace(num_layers=28, num_heads=28, num_kv_heads=4)
    assert retrieval_heads.default_num_heads(cfg) == 12  # 11.76 rounds up
    assert retrieval_heads.default_num_heads(types.SimpleNamespace(num_layers=32, num_heads=32)) == 15  # 15.36
    assert retrieval_heads.default_num_heads(cfg, fraction=0.1) == 78  # 78.4
    scores = np.array([[0, 5, 1, 1], [2, 0, 0, 5], [0, 0, 0, 0]], float)
    flat = scores.ravel()
    want = [(i // 4, i % 4) for i in sorted(range(12), key=lambda i: (-flat[i], i))]
    assert retrieval_heads.top_heads(scores, 12) == want  # num = L * Hq: every head, best first
    for bad in (13, 0, 2.0, True):
        with pytest.raises(ValueError, match=rf"num_retrieval_heads={bad!r}: expected between 1 and the model's 12"):
            retrieval_heads.top_heads(scores, bad)
    cfg = types.SimpleNamespace(num_layers=3, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"\(layer=3, head=0\): expected layer in \[0, 3\) and head in \[0, 4\)"):
        retrieval_heads.retrieval_layout(cfg, [(3, 0)])
    with pytest.raises(ValueError, match=r"\(layer=-1, head=0\): expected layer in \[0, 3\)"):
        retrieval_heads.retrieval_layout(cfg, [(-1, 0)])
    for layer, head in ((1.7, 0), (True, 0), (1, np.float32(2.0))):
        with pytest.raises(ValueError, match="expected integer indices"):
            retrieval_heads.retrieval_layout(cfg, [(layer, head)])
    lay = retrieval_heads.retrieval_layout(cfg, [(np.int64(0), np.int32(3))])  # numpy integers are integers
    np.testing.assert_array_equal(lay.has_retrieval, [True, False, False])
    assert int(lay.kv_heads[0, 0]) == 1
    np.testing.assert_array_equal(lay.head_mask[0, 0], [False, True])


def test_load_retrieval_heads_refuses_zero_heads(tmp_path):
    from jsparse.artifacts import Artifact, save_artifact

    cfg = types.SimpleNamespace(num_layers=3, num_heads=4, num_kv_heads=2)
    scores = np.array([[0, 5, 1, 1], [2, 0, 0, 5], [0, 0, 0, 0]], np.float32)
    save_artifact(str(tmp_path), Artifact(kind="evosparse", fingerprint="fp", arrays={"scores": scores}))
    assert retrieval_heads.load_retrieval_heads(str(tmp_path), "evosparse", "fp", cfg) == [(0, 1)]  # the default
    with pytest.raises(ValueError, match="num_retrieval_heads=0: expected between 1 and"):
        retrieval_heads.load_retrieval_heads(str(tmp_path), "evosparse", "fp", cfg, 0)


def test_stacked_cache_of_a_bare_view_is_a_stack_of_one():
    k = jnp.ones((2, 3, 8, 4))
    k_all, v_all, layer = stacked_cache(LayerKV(k=k, v=2 * k))
    assert k_all.shape == (1, 2, 3, 8, 4) and int(layer) == 0 and float(v_all[0, 0, 0, 0, 0]) == 2.0


def test_prefill_heat_of_a_prompt_shorter_than_the_window():
    """A right-padded batch whose short row has fewer tokens than the heat window: that row's heat comes from its
    own rows only (it was NaN: the rows before its start see no key), the long row's is unchanged."""
    B, T, Hq, Hkv, D, W = 2, 24, 4, 2, 8, 8
    ks = jax.random.split(jax.random.key(3), 2)
    q = jax.random.normal(ks[0], (B, T, Hq, D))
    k = jax.random.normal(ks[1], (B, T, Hkv, D))
    lengths = jnp.array([T, 5])
    h = np.asarray(heat.prefill_heat(q, k, lengths, W, 0.5, 4, 8))
    assert np.isfinite(h).all()
    qn, kn = np.asarray(q, np.float64), np.asarray(k, np.float64)
    for b in range(B):
        n = int(lengths[b])
        want = np.zeros((Hkv, 8))
        for r in range(max(n - W, 0), n):
            for hq in range(Hq):
                s = kn[b, : r + 1, hq // 2] @ qn[b, r, hq] / np.sqrt(D)
                p = np.exp(s - s.max())
                p /= p.sum()
                for t in range(r + 1):
                    want[hq // 2, t // 4] += 0.5 ** (n - 1 - r) * p[t] / 2
        np.testing.assert_allclose(h[b], want, rtol=1e-5, atol=1e-6)


def test_scratch_is_uninitialised_without_a_mesh_and_zeros_under_one():
    """`scratch` (a per-forward buffer written whole before any read): `lax.empty` (no fill kernel on an
    accelerator) with no mesh; a zero fill under a mesh, which sharding propagation sees through."""
    from jax.sharding import AbstractMesh

    from jsparse.methods.common import scratch

    def prims(fn):
        return [e.primitive.name for e in jax.make_jaxpr(fn)().jaxpr.eqns]

    assert prims(lambda: scratch((2, 3), jnp.float32)) == ["empty"]
    with jax.sharding.use_abstract_mesh(AbstractMesh((2,), ("data",))):
        assert prims(lambda: scratch((2, 3), jnp.float32)) == ["broadcast_in_dim"]
        assert jax.eval_shape(lambda: scratch((2, 3), jnp.int32)).dtype == jnp.int32


def test_prefill_tile_probs_ignores_lengths_past_the_prompt():
    """lengths >= T count T rows (`row_limits`): the padding rows that fill the last tile past T add nothing."""
    np.testing.assert_array_equal(sel.row_limits(jnp.array([3, 10, 5]), 3, 5), [3, 5, 5])
    np.testing.assert_array_equal(sel.row_limits(None, 2, 7), [7, 7])
    B, T, Hq, Hkv, D = 2, 10, 4, 2, 8
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((B, T, Hq, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, T, Hkv, D)), jnp.float32)
    want = np.asarray(sel.prefill_tile_probs(q, k, 4))  # [B, Hkv, 3, T]
    got = np.asarray(sel.prefill_tile_probs(q, k, 4, jnp.array([T + 3, T])))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(want[:, :, 2].sum(-1), 2 * (Hq // Hkv), rtol=1e-5)  # 2 real rows in the last tile


def test_check_fractions_refuses_a_sum_off_by_more_than_1e_6():
    names = ("x_fraction", "y_fraction")
    with pytest.raises(ValueError, match=r"budget fractions sum to 0.9995 \(x_fraction=0.5, y_fraction=0.4995\): "
                                         r"expected x_fraction \+ y_fraction = 1"):
        budget_split.check_fractions((0.5, 0.4995), names)
    assert budget_split.check_fractions((0.5, 0.5 + 1e-7), names) == (0.5, 0.5 + 1e-7)  # within 1e-6


def test_cumulative_fixed_takes_the_nearest_fraction_of_denominator_at_most_fix():
    # the floats' sums 0.1 + 0.3 = 0.4 and 0.15 + 0.35 + 0.2 = 0.7000000000000001 are 2/5 and 7/10; the last exactly 1
    assert budget_split.cumulative_fixed((0.1, 0.3, 0.6)) == (Fraction(1, 10), Fraction(2, 5), 1)
    want = (Fraction(3, 20), Fraction(1, 2), Fraction(7, 10), 1)
    assert budget_split.cumulative_fixed((0.15, 0.35, 0.2, 0.3)) == want
    # a hair off a simple fraction is that fraction; otherwise the nearest of denominator <= 4096 (not 4096ths)
    assert budget_split.cumulative_fixed((0.3, 0.2 + 1e-7, 0.5 - 1e-7))[1] == Fraction(1, 2)
    assert budget_split.cumulative_fixed((0.123, 0.877)) == (Fraction(123, 1000), 1)


def test_blocks_fraction_is_at_most_the_visible_keys():
    """More blocks than a query sees (its own, partial, block and all before it) attend all n = p + 1 keys: 1."""
    p = np.array([2, 2, 2, 9, 9, 9, 9])
    blocks = np.array([1, 2, 5, 1, 2, 3, 4])
    n = p + 1
    own = p % 4 + 1  # keys of the own, partial, block
    want = np.minimum((blocks - 1) * 4 + own, n) / n
    np.testing.assert_allclose(budget_split.blocks_fraction(blocks, p, 4), want, rtol=0, atol=0)
    np.testing.assert_allclose(want, [1.0, 1.0, 1.0, 0.2, 0.6, 1.0, 1.0])


def test_heat_update_drops_the_padding_even_of_an_empty_row():
    """-1 padding adds nothing, whatever its value, also where a row selected no block (all -1)."""
    h = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], np.float32)
    idx = np.array([[-1, -1], [2, -1]], np.int32)
    vals = np.array([[5.0, 7.0], [0.25, 9.0]], np.float32)
    want = 0.5 * h.astype(np.float64)
    want[1, 2] += 0.25
    np.testing.assert_allclose(heat.heat_update(jnp.asarray(h), jnp.asarray(idx), jnp.asarray(vals), 0.5), want,
                               rtol=1e-6)


def test_pool_blocks_with_exactly_the_blocks_it_needs():
    x = np.arange(8, dtype=np.float32)[None]
    np.testing.assert_allclose(heat.pool_blocks(jnp.asarray(x), 4, 2), x.reshape(1, 2, 4).sum(-1))  # [[6, 22]]
    np.testing.assert_allclose(heat.pool_blocks(jnp.asarray(x[:, :7]), 4, 2), [[6, 15]])  # the last block partial


def test_load_retrieval_heads_refuses_scores_of_another_shape(tmp_path):
    cfg = types.SimpleNamespace(num_layers=3, num_heads=4, num_kv_heads=2)
    scores = np.array([[0, 5, 1, 1], [2, 0, 0, 5]], np.float32)  # 2 layers, the model has 3
    save_artifact(str(tmp_path), Artifact(kind="evosparse", fingerprint="fp", arrays={"scores": scores}))
    with pytest.raises(ValueError, match=r"scores \(2, 4\) heads: expected \(L, Hq\) = \(3, 4\)"):
        retrieval_heads.load_retrieval_heads(str(tmp_path), "evosparse", "fp", cfg)


def test_capacities_round_the_bucket_up_before_aligning():
    """ceil(i * T / buckets), then up to a multiple of 128, capped at T: T = 1025 in 8 buckets has 128.125 tokens
    per bucket, so the smallest capacity is 256, not 128."""
    T, buckets = 1025, 8
    per = [math.ceil(Fraction(i * T, buckets)) for i in range(1, buckets + 1)]  # exact ceil(i * T / buckets)
    want = sorted({min(T, math.ceil(Fraction(c, 128)) * 128) for c in per} | {T})
    assert compression.capacities(T, buckets) == tuple(want) == (256, 384, 512, 640, 768, 896, 1024, 1025)


def test_check_layers_accepts_no_layers():
    assert sel.check_layers("dense_layers", [], 4) == ()
    assert sel.check_layers("dense_layers", (), 0) == ()


def test_topk_sparsity_is_the_mean_skipped_share_of_the_visible_keys():
    # min_tokens 1, budget 0.5: queries 0..3 see 1, 2, 3, 4 keys and keep 1, 1, 2, 2 of them
    assert sel.topk_sparsity(0.5, np.arange(4), 1) == pytest.approx(np.mean([0, 1 / 2, 1 / 3, 1 / 2]), abs=1e-12)
    assert sel.topk_sparsity(0.5, [0], 1) == 0.0  # query 0 sees only itself

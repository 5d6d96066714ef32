"""H2O's carried candidates (`jsparse.methods.h2o`, the gathered decode): the keys each step keeps are exactly those
of ranking every score (`H2O.kept_indices`), step after step, while the step ranks only the W carried candidates and
the key that left the window; and a state whose candidates are stale (a prefill, a mask-path forward, a position
that moved by more than one key) ranks every score again."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsparse.methods import make_method
from jsparse.methods.h2o import candidate_scores, carry_candidates, heavy_from_candidates
from models.config import ModelConfig
from pallas_kernels.block_scores import heat_candidates

CFG = ModelConfig(architecture="llama", vocab_size=32, hidden_size=64, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
N = 160


def _method(**kw):
    return make_method("h2o", budget=0.25, min_tokens=8, recent=0.5, gathered=True, **kw)


def _step(m, state, lengths, rng, coarse):
    """One gathered step's selection (`start_rows`), checked against ranking every score, then the step's mass added
    at the kept keys (what the gathered kernel does), the forward finished. coarse: masses on a grid of 1/8, so
    that scores tie often (ties go to the lower position)."""
    K = m.k_static(N)
    want = np.asarray(m.kept_indices(state.score, lengths - 1, K))
    st = jax.jit(lambda s, n: m.start_rows(CFG, s, "decode", n, 1, N))(state, lengths)
    np.testing.assert_array_equal(np.asarray(st.kept), want)
    kept = np.asarray(st.kept)
    mass = rng.integers(0, 3, kept.shape) / 8.0 if coarse else rng.random(kept.shape)
    score = np.asarray(st.score).copy()
    L, B, H = np.indices(kept.shape[:3])
    for j in range(kept.shape[-1]):
        ok = kept[..., j] >= 0
        score[L[ok], B[ok], H[ok], kept[..., j][ok]] += mass[..., j][ok]
    return m.finish(st.replace(score=jnp.asarray(score, jnp.float32)), "decode")


def _state(m, rng, lengths, coarse):
    state = m.init_state(CFG, len(lengths), N)
    n = np.arange(N)[None, None, None, :]
    score = (rng.integers(0, 6, state.score.shape) / 4.0) if coarse else rng.random(state.score.shape)
    score = np.where(n < np.asarray(lengths)[None, :, None, None], score, 0.0)
    return state.replace(score=jnp.asarray(score, jnp.float32))


def test_carried_candidates_keep_exactly_the_keys_of_ranking_every_score():
    """40 steps of two rows at different positions, continuous and tied scores: every step keeps `kept_indices`'
    keys. The budget grows by a key every few steps (k - r too), the window moves by one, a row stays put for a step
    (a finished row of a batch), and a row jumps by three keys (the candidates are stale for that step only)."""
    m = _method()
    for coarse in (False, True):
        rng = np.random.default_rng(3 + coarse)
        lengths = np.array([40, 71], np.int32)
        state = _state(m, rng, lengths, coarse)
        assert state.cand is not None and int(np.asarray(state.cand_end).max()) == -1  # stale: first ranked in full
        ends = []
        for t in range(40):
            state = _step(m, state, jnp.asarray(lengths), rng, coarse)
            ends.append(np.asarray(state.cand_end).copy())
            lengths = lengths + np.array([0 if t == 7 else 1, 3 if t == 20 else 1], np.int32)
        k_t, r = m.row_budget(jnp.asarray(lengths - 1))
        assert np.all(ends[-1] >= 0) and int(np.min(np.asarray(k_t - r))) < m.kept_width(m.k_static(N))


def test_carried_candidates_are_the_top_w_of_the_keys_below_the_window():
    """After each step the candidates are the W highest-scoring keys below the window start (ties to the lower
    position), ascending: what ranking every such key gives, which the next step's heavy keys are drawn from."""
    m = _method()
    rng = np.random.default_rng(5)
    lengths = np.array([90, 120], np.int32)
    state = _state(m, rng, lengths, coarse=True)
    W = m.kept_width(m.k_static(N))
    for t in range(12):
        state = _step(m, state, jnp.asarray(lengths), rng, coarse=True)
        end = np.asarray(state.cand_end)
        want = heat_candidates(state.score, jnp.zeros(2, jnp.int32), jnp.asarray(end), jnp.full(2, W, jnp.int32), W)
        np.testing.assert_array_equal(np.asarray(state.cand), np.asarray(want))
        lengths = lengths + 1


def test_carry_and_heavy_on_hand_made_rows():
    """carry_candidates drops the lowest of W + 1 keys (of equal scores the higher position), keeps W or fewer
    whole, and takes no extra key where there is none; heavy_from_candidates ranks them, ties to the lower position."""
    score = jnp.asarray([[[[5.0, 1.0, 3.0, 1.0, 2.0, 1.0, 9.0, 0.0]]]])  # [L=1, B=1, Hkv=1, N=8]
    cand = jnp.asarray([[[[0, 1, 3, 4]]]], jnp.int32)  # scores 5, 1, 1, 2
    def carry(c, extra):
        keys, x = carry_candidates(score, c, jnp.asarray([extra], jnp.int32))
        np.testing.assert_array_equal(np.asarray(x), np.asarray(candidate_scores(score, keys)))  # their own scores
        return np.asarray(keys)[0, 0, 0]
    np.testing.assert_array_equal(carry(cand, 5), [0, 1, 3, 4])  # + key 5 (score 1): drop the last 1, key 5
    np.testing.assert_array_equal(carry(cand, 6), [0, 1, 4, 6])  # + key 6 (score 9): drop key 3 (1 at 3 > 1)
    short = jnp.asarray([[[[0, 2, -1, -1]]]], jnp.int32)
    np.testing.assert_array_equal(carry(short, 5), [0, 2, 5, -1])
    np.testing.assert_array_equal(carry(short, -1), [0, 2, -1, -1])
    four = jnp.asarray([[[[0, 1, 3, 5]]]], jnp.int32)
    heavy = heavy_from_candidates(candidate_scores(score, four), four, jnp.asarray([2], jnp.int32))
    np.testing.assert_array_equal(np.asarray(heavy)[0, 0, 0], [0, 1, -1, -1])  # 5, then the first of the three 1s


def test_a_prefill_and_a_mask_path_forward_leave_the_candidates_stale():
    """The prefill and a multi-token decode (the mask path) mark the candidates stale (cand_end -1), so the next
    gathered step ranks every score; a method that does not decode gathered carries none."""
    from models import llama
    from models.cache import init_cache
    from models.params import random_params

    m = _method()
    params = random_params(CFG, jax.random.key(0))
    B, T = 2, 24
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, CFG.vocab_size)
    lengths = jnp.asarray([T, 17], jnp.int32)
    cache = init_cache(CFG, B, 64, params.embed.dtype)
    _, cache, state = llama.prefill(params, CFG, m, tokens, lengths, cache, m.init_state(CFG, B, 64))
    assert np.all(np.asarray(state.cand_end) == -1)
    _, cache, state = llama.decode(params, CFG, m, tokens[:, :1], cache, state)
    assert np.all(np.asarray(state.cand_end) >= 0)  # ranked in full, then carried
    _, cache, state = llama.decode(params, CFG, m, tokens[:, :3], cache, state)  # T = 3: the mask path
    assert np.all(np.asarray(state.cand_end) == -1)
    assert make_method("h2o", gathered=False).init_state(CFG, B, 64).cand is None


def test_gathered_steps_check_against_the_masked_reference():
    """`jsparse bench model`'s check with H2O decoding gathered (as on a GPU; here its XLA kernels): two steps after
    the prefill, the first ranking every score (the candidates stale), the second its carried candidates; at every
    layer the output equals a dense softmax over the keys `H2O.kept_keys` picks from the state before the step."""
    from eval.bench import model as bench_model
    from eval.bench import model_check
    from models.presets import preset

    def build(name, cfg):
        return bench_model.bench_method(name, cfg, 0.1, options={"gathered": True})[0]
    c = model_check.run_checks(preset("llama3-8b"), ["h2o"], build, jnp.float32)["h2o"]
    assert c["passed"] and c["shape"]["decode_steps"] == 2, c
    assert max(c["kept_fraction_per_layer"]) < 0.5


def test_a_state_for_another_cache_size_ranks_every_score():
    """Candidates sized for another cache (init_state's max_len unlike the decode's) are not read: the step ranks
    every score, the keys of `kept_indices`, and leaves the state's candidates as they were."""
    m = _method()
    rng = np.random.default_rng(9)
    lengths = jnp.asarray([40, 71], jnp.int32)
    state = _state(m, rng, np.asarray(lengths), coarse=False)
    other = state.replace(cand=jnp.full(state.cand.shape[:-1] + (state.cand.shape[-1] + 3,), -1, jnp.int32))
    st = m.start_rows(CFG, other, "decode", lengths, 1, N)
    np.testing.assert_array_equal(np.asarray(st.kept), np.asarray(m.kept_indices(state.score, lengths - 1,
                                                                                 m.k_static(N))))
    assert st.cand.shape == other.cand.shape and np.all(np.asarray(st.cand_end) == -1)


def test_carry_false_ranks_every_score_as_before():
    """`carry=False` (`--method-option h2o.carry=false`): no candidates in the state, every step ranks every score
    (the keys of `kept_indices`, as before the candidates); a carry that is not a bool is named."""
    m = _method(carry=False)
    rng = np.random.default_rng(13)
    lengths = jnp.asarray([40, 71], jnp.int32)
    state = _state(m, rng, np.asarray(lengths), coarse=True)
    assert state.cand is None and state.cand_end is None
    st = m.start_rows(CFG, state, "decode", lengths, 1, N)
    np.testing.assert_array_equal(np.asarray(st.kept), np.asarray(m.kept_indices(state.score, lengths - 1,
                                                                                 m.k_static(N))))
    with pytest.raises(ValueError, match="carry='no': expected true or false"):
        _method(carry="no")


@pytest.mark.parametrize("dense_layers", [0, 1])
def test_mass_at_end_decodes_as_the_two_launches(monkeypatch, dense_layers):
    """`mass_at_end` (on a GPU: one launch a layer that keeps its entry sums, one launch at the forward's end for every
    layer's mass), run here by its Triton kernels in interpret mode: four gathered steps of a small model give the
    logits, scores and candidates of `mass_at_end=False` (the per-layer heat step); the state that crosses steps
    holds no buffer of it. Layers below dense_layers keep their scores, and so does every layer of a forward that ran
    no gathered launch."""
    import functools

    from jsparse.methods import h2o as h2o_mod
    from models import llama
    from models.cache import init_cache
    from models.params import random_params
    from pallas_kernels.block_scores import gpu as bgpu

    cfg = CFG
    params = random_params(cfg, jax.random.key(1), jnp.float32)
    tokens = jax.random.randint(jax.random.key(2), (2, 70), 0, cfg.vocab_size)
    lengths = jnp.array([70, 51], jnp.int32)

    def run(mass_at_end):
        m = _method(mass_at_end=mass_at_end, dense_layers=dense_layers)
        cache = init_cache(cfg, 2, N, jnp.float32)
        logits, cache, state = llama.prefill(params, cfg, m, tokens, lengths, cache, m.init_state(cfg, 2, N))
        out, tok = [], jnp.argmax(logits, -1).astype(jnp.int32)[:, None]
        for _ in range(4):
            logits, cache, state = llama.decode(params, cfg, m, tok, cache, state)
            assert state.pending is None and state.tickets is None and state.kept is None
            out.append(logits)
            tok = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None]
        return jnp.stack(out), state

    want, want_state = run(False)
    monkeypatch.setattr(h2o_mod, "pending_available", lambda head_dim: True)
    monkeypatch.setattr(h2o_mod, "sparse_decode_pending", functools.partial(bgpu.sparse_decode_pending_gpu,
                                                                            interpret=True))
    calls = []

    def add(*a, **kw):
        calls.append(kw["first"])
        return bgpu.add_pending_mass_gpu(*a, **kw, interpret=True)
    monkeypatch.setattr(h2o_mod, "add_pending_mass", add)
    # Uninitialised buffers hold anything: here NaN and counts of 7 wherever nothing is written before a read.
    monkeypatch.setattr(h2o_mod, "scratch", lambda shape, dtype: jnp.full(shape, 7 if dtype == jnp.int32 else jnp.nan,
                                                                          dtype))
    got, state = run(True)
    assert calls == [dense_layers] * 4
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(state.score, want_state.score, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(state.cand, want_state.cand)
    if dense_layers:
        assert not np.asarray(state.score[0, :, :, 70:]).any()  # the dense layer's scores: the prefill's only
    # A forward whose layers ran no gathered launch (start_rows, then finish: the buffers as made, their written
    # counts zero) adds no mass: the scores stay.
    m = _method(mass_at_end=True, dense_layers=dense_layers)
    st = m.start_rows(cfg, state, "decode", lengths + 4, 1, N)
    assert st.pending is not None and not np.asarray(st.pending[-1]).any()
    np.testing.assert_array_equal(m.finish(st, "decode").score, state.score)
    with pytest.raises(ValueError, match="mass_at_end=1: expected true or false"):
        _method(mass_at_end=1)

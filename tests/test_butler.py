"""TokenButler decode and the H2O baseline: each equals a masked dense reference over the keys it should select."""

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsparse.methods import make_method
from jsparse.methods.butler import Butler, ButlerState
from jsparse.methods.butler_predictor import Predictor, init_params
from jsparse.methods.h2o import H2OState
from models import llama
from models.attention import LayerContext, LayerKV
from models.cache import init_cache
from models.config import ModelConfig
from models.params import random_params
from pallas_kernels.dense import dense_decode
from pallas_kernels.sparse_attention.reference import masked_attention_reference
from train.loop import predictor_qk, record_qk
from train.predictor import preset_config

B, HQ, HKV, D = 2, 4, 2, 16
G = HQ // HKV
CFG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=3,
                  num_heads=HQ, num_kv_heads=HKV, head_dim=D, max_position_embeddings=512)
N = 48
LENGTHS = (37, 48)


def _ctx(layer, lengths):
    return LayerContext(layer=jnp.int32(layer), lengths=jnp.asarray(lengths, jnp.int32))


def _normal(seed, shape):
    """f32 normal samples from numpy (eager jax.random compiles per call, slow on a busy CPU)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _cache_and_q(seed, T):
    q = _normal([seed, 0], (B, T, HQ, D))
    k = _normal([seed, 1], (B, HKV, N, D))
    v = _normal([seed, 2], (B, HKV, N, D))
    return q, LayerKV(k=k, v=v)


def _budget(n, budget, min_tokens):
    return min(max(math.ceil(budget * n), min_tokens), n)


def _butler_mask_np(qp, kp, pos, budget, min_tokens, sink, group, local=0):
    """numpy: bool[B, H, T, N] kept keys; H = Hq (per head) or Hkv (group-pooled)."""
    qp, kp = np.asarray(qp, np.float64), np.asarray(kp, np.float64)
    Hk = kp.shape[1]
    T = qp.shape[2]
    mask = np.zeros((B, HKV if group else HQ, T, N), bool)
    for b in range(B):
        for t in range(T):
            n = pos[b, t] + 1
            kk = _budget(n, budget, min_tokens)
            logits = np.stack([kp[b, h // (HQ // Hk), :n] @ qp[b, h, t] / math.sqrt(qp.shape[-1])
                               for h in range(HQ)])  # [Hq, n]
            if group:
                p = np.exp(logits - logits.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                scores = p.reshape(HKV, G, n).sum(1)
            else:
                scores = logits
            window = max(min(local, kk - sink), 0)
            for h in range(scores.shape[0]):
                s = scores[h].copy()
                s[: min(sink, n)] = np.inf
                if window:
                    s[n - window:] = np.inf
                mask[b, h, t, np.argsort(-s, kind="stable")[:kk]] = True
    return mask


@pytest.fixture(scope="module")
def pcfg():
    return preset_config(CFG, "auto")


@pytest.mark.parametrize("selection,T,key_heads,local", [("head", 1, "query", 0), ("head", 3, "kv", 5),
                                                         ("group", 1, "query", 0), ("group", 3, "query", 5)])
def test_butler_decode_equals_masked_reference(selection, T, key_heads, local):
    pc = preset_config(CFG, "auto", key_heads=key_heads)
    m = Butler.from_params(CFG, pc, None, budget=0.3, min_tokens=6, sink=4, selection=selection, local=local)
    q, cache = _cache_and_q(0, T)
    Lp = CFG.num_layers - 1
    state = m.init_state(CFG, B, N)
    state = state.replace(keys=_normal(1, state.keys.shape), queries=_normal(2, (Lp, B, HQ, T, pc.head_dim)))
    layer = 2
    out, _ = jax.jit(m.sparse_decode)(_ctx(layer, LENGTHS), q, cache, state)
    pos = np.asarray(LENGTHS)[:, None] - T + np.arange(T)
    mask = _butler_mask_np(state.queries[layer - 1], state.keys[layer - 1], pos, 0.3, 6, 4, selection == "group",
                           local)
    assert mask[..., :4].all()  # the sinks are always kept
    if local:  # and the local window: here k = 15 or 16 >= sink + local, so the whole window
        for b in range(B):
            for t in range(T):
                assert mask[b, :, t, pos[b, t] - local + 1: pos[b, t] + 1].all()
    want = masked_attention_reference(q, cache.k, cache.v, jnp.asarray(mask))
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    # ... and the selection is real: a different budget changes the output.
    assert np.abs(np.asarray(out) - np.asarray(masked_attention_reference(
        q, cache.k, cache.v, jnp.asarray(_butler_mask_np(state.queries[layer - 1], state.keys[layer - 1], pos,
                                                         0.6, 6, 4, selection == "group", local))))).max() > 1e-3


def test_local_window_shrinks_to_the_budget():
    """k = 10 < sink + local = 24: the sinks and the 6 most recent keys (the query's own included) fill the budget."""
    from jsparse.methods.butler import head_mask

    logits = _normal(3, (1, 1, 1, 40))
    pos = jnp.asarray([[39]], jnp.int32)
    mask = np.asarray(head_mask(logits, pos, jnp.asarray([40]), 0.25, 8, 10, 4, 20))[0, 0, 0]
    assert mask.sum() == 10 and mask[:4].all() and mask[34:].all()


@pytest.fixture(scope="module")
def model():
    return jax.jit(random_params, static_argnums=(0, 2, 3))(CFG, jax.random.key(7), jnp.float32, 0.2)


@jax.jit
def _run(params, method, tokens, lengths, new_tokens):
    """Prefill of the prompts, then one decode call with the 4 new tokens of every row."""
    capacity = 32
    cache = init_cache(CFG, B, capacity, jnp.float32)
    state = method.init_state(CFG, B, capacity)
    lg0, cache, state = llama.prefill(params, CFG, method, tokens, lengths, cache, state)
    lg1, cache, state = llama.decode(params, CFG, method, new_tokens, cache, state)
    return lg0, lg1, state


def test_butler_in_the_model(model, pcfg):
    """Prefill + decode through the model: the predictor's key cache equals the full-sequence predictor, budget 1
    equals dense, and a small budget does not."""
    pp = init_params(pcfg, jax.random.key(3))
    T0 = 20
    lengths = jnp.asarray((20, 17), jnp.int32)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, T0)), jnp.int32)
    new = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, 4)), jnp.int32)
    full = Butler.from_params(CFG, pcfg, pp, budget=1.0, min_tokens=1)
    d0, d1, _ = _run(model, make_method("dense"), tokens, lengths, new)
    f0, f1, state = _run(model, full, tokens, lengths, new)
    np.testing.assert_allclose(f0, d0, rtol=1e-4, atol=1e-4)  # prefill is dense
    np.testing.assert_allclose(f1, d1, rtol=1e-4, atol=1e-4)  # budget 1 keeps every key
    # The state holds k' of every position: compare row 1 (prompt of 17, then 4 decoded tokens) with the
    # predictor run once over its 21 tokens.
    seq = jnp.concatenate([tokens[1:, :17], new[1:]], axis=1)  # [1, 21]

    @jax.jit
    def predict(model, pp, seq):
        h0, _, _ = record_qk(model, CFG, seq)
        return Predictor(pcfg).apply({"params": pp}, h0, jnp.arange(21)[None])[1]  # [1, 21, L', Hk', d']

    kp = predict(model, pp, seq)
    got = np.asarray(state.keys[:, 1, :, :21])  # [L', Hk', 21, d']
    np.testing.assert_allclose(got, np.asarray(kp[0]).transpose(1, 2, 0, 3), rtol=1e-4, atol=1e-4)
    assert state.queries is None  # dropped by finish
    small = Butler.from_params(CFG, pcfg, pp, budget=0.2, min_tokens=4)
    assert small.achieved_sparsity(CFG, np.arange(64)) > 0.2


class _OneScan(Butler):
    """Butler decoding in one layer scan with its `lax.switch` per layer (as before `segments`)."""

    def segments(self, cfg, phase):
        return None


def _prefilled(model, method, rng, cap: int = 40):
    """(cache, state) after prefilling B rows of 24 and 19 random tokens (drawn from rng) into a cache of cap."""
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, 24)), jnp.int32)
    lengths = jnp.asarray((24, 19), jnp.int32)
    _, cache, state = jax.jit(lambda p, m, t, l: llama.prefill(p, CFG, m, t, l, init_cache(CFG, B, cap, jnp.float32),
                                                               m.init_state(CFG, B, cap)))(model, method, tokens,
                                                                                           lengths)
    return cache, state


@pytest.mark.parametrize("dense_set", [(), (2,)])
def test_butler_gathered_and_segmented_decode_equal_the_mask(model, pcfg, dense_set):
    """Through the model, step after step: the gathered one-token decode (every layer's keys chosen in layer 0,
    each query head's keys attended through the gathered kernel) and the mask path, both scanning runs of layers
    apart (`segments`), equal the one-scan `lax.switch` decode in logits and in the predictor's state, around a
    T = 3 step (mask path for all); the runs split where the calibrated dense layer lies."""
    pp = init_params(pcfg, jax.random.key(3))
    opts = dict(budget=0.3, min_tokens=4, local=2, dense_layers=1, dense_set=dense_set, rebalance=False)
    new, seg, old, one = (Butler.from_params(CFG, pcfg, pp, gathered=True, **opts),
                          Butler.from_params(CFG, pcfg, pp, gathered=False, **opts),
                          _OneScan.from_params(CFG, pcfg, pp, gathered=False, **opts),
                          # gathered in one scan: layer 0's switch branch fills `kept` too
                          _OneScan.from_params(CFG, pcfg, pp, gathered=True, **opts))
    want_runs = ((0, 1, "first"), (1, 3, "sparse")) if not dense_set else \
        ((0, 1, "first"), (1, 2, "sparse"), (2, 3, "dense"))
    assert new.segments(CFG, "decode") == want_runs and new.segments(CFG, "prefill") is None
    rng = np.random.default_rng(1)
    cache, state = _prefilled(model, seg, rng)  # prefill is one run for all three
    runs = {m: (cache, state) for m in ("new", "seg", "old", "one")}
    step = {name: jax.jit(lambda p, t, c, s, m=m: llama.decode(p, CFG, m, t, c, s))  # compiled once per method
            for name, m in (("new", new), ("seg", seg), ("old", old), ("one", one))}
    for i, n_new in enumerate([1, 1, 3, 1]):
        tok = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, n_new)), jnp.int32)
        out = {}
        for name in step:
            out[name], c, st = step[name](model, tok, *runs[name])
            runs[name] = (c, st)
            assert st.kept is None and st.queries is None  # dropped at the end of the forward
        for name in ("new", "seg", "one"):
            np.testing.assert_allclose(out[name], out["old"], rtol=1e-4, atol=1e-4, err_msg=f"{name} step {i}")
            np.testing.assert_allclose(runs[name][1].keys, runs["old"][1].keys, rtol=1e-5, atol=1e-5)
    # The selection is real: budget 1 (every key) decodes differently.
    full = Butler.from_params(CFG, pcfg, pp, gathered=True, **{**opts, "budget": 1.0})
    tok = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, 1)), jnp.int32)
    a = jax.jit(lambda p, t, c, s: llama.decode(p, CFG, full, t, c, s)[0])(model, tok, *runs["new"])
    b = step["new"](model, tok, *runs["new"])[0]
    assert float(jnp.abs(a - b).max()) > 1e-3


def test_butler_bf16_keys(model, pcfg):
    """key_dtype="bfloat16": the state holds the predicted keys rounded to bf16 (those of the f32 state, rounded),
    and the gathered one-token decode still equals the mask path over those keys, step after step."""
    pp = init_params(pcfg, jax.random.key(3))
    opts = dict(budget=0.3, min_tokens=4, local=2, dense_layers=1)
    f32, new, seg = (Butler.from_params(CFG, pcfg, pp, gathered=False, **opts),
                     Butler.from_params(CFG, pcfg, pp, gathered=True, key_dtype="bfloat16", **opts),
                     Butler.from_params(CFG, pcfg, pp, gathered=False, key_dtype="bfloat16", **opts))
    _, state32 = _prefilled(model, f32, np.random.default_rng(2))
    rng = np.random.default_rng(2)
    cache, state = _prefilled(model, seg, rng)
    assert state32.keys.dtype == jnp.float32 and state.keys.dtype == jnp.bfloat16
    np.testing.assert_array_equal(state.keys, state32.keys.astype(jnp.bfloat16))
    runs = {"new": (cache, state), "seg": (cache, state)}
    step = {name: jax.jit(lambda p, t, c, s, m=m: llama.decode(p, CFG, m, t, c, s)) for name, m in (("new", new),
                                                                                                   ("seg", seg))}
    for i in range(3):
        tok = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, 1)), jnp.int32)
        out = {}
        for name in step:
            out[name], c, st = step[name](model, tok, *runs[name])
            runs[name] = (c, st)
        np.testing.assert_allclose(out["new"], out["seg"], rtol=1e-4, atol=1e-4, err_msg=f"step {i}")
        assert runs["new"][1].keys.dtype == jnp.bfloat16


def test_butler_kept_indices_are_the_head_mask(pcfg):
    """`kept_indices` (all predicted layers at once) holds exactly `head_mask`'s keys of each layer."""
    from jsparse.methods.butler import head_mask, predicted_logits

    m = Butler.from_params(CFG, pcfg, None, budget=0.3, min_tokens=6, local=3, dense_layers=1)
    Lp, Hk, d = pcfg.predicted_layers, pcfg.key_heads, pcfg.head_dim
    keys = _normal(11, (Lp, B, Hk, N, d))
    queries = _normal(12, (Lp, B, HQ, 1, d))
    state = ButlerState(attn_k=None, attn_v=None, keys=keys, queries=queries)
    pos = jnp.asarray([[36], [47]], jnp.int32)
    idx = np.asarray(m.kept_indices(state, pos, N))
    K = m.key_width(N)
    assert idx.shape == (Lp, B, HQ, 1, K)
    for layer in range(Lp):
        mask = np.asarray(head_mask(predicted_logits(queries[layer], keys[layer], pos), pos, pos[:, 0] + 1, 0.3, 6,
                                    K, m.sink, m.local))  # [B, Hq, 1, N]
        for b in range(B):
            for h in range(HQ):
                row = idx[layer, b, h, 0]
                np.testing.assert_array_equal(row[row >= 0], np.flatnonzero(mask[b, h, 0]), err_msg=f"{layer} {b} {h}")


def test_butler_options_errors(pcfg):
    with pytest.raises(ValueError, match="selection='tile'"):
        Butler.from_params(CFG, pcfg, None, selection="tile")
    with pytest.raises(ValueError, match=r"key_dtype='float16': expected one of \('float32', 'bfloat16'\)"):
        Butler.from_params(CFG, pcfg, None, key_dtype="float16")
    with pytest.raises(ValueError, match="dense_layers=0"):
        Butler.from_params(CFG, pcfg, None, dense_layers=0)
    other = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=4,
                        num_heads=HQ, num_kv_heads=HKV, head_dim=D)
    with pytest.raises(ValueError, match="made for a model with"):
        Butler.from_params(other, pcfg, None)
    with pytest.raises(ValueError, match="recent=True: expected the recent window's share"):  # read as 1.0 before
        make_method("h2o", recent=True)


# ----------------------------------------------------------------------------------------------- H2O


def _h2o_np(q, k, v, score, lengths, budget, min_tokens, recent):
    """numpy sequential H2O over the T new rows: (out f64[B, T, Hq, D], score f64[B, Hkv, N])."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    score = np.asarray(score, np.float64).copy()
    T = q.shape[1]
    out = np.zeros(q.shape)
    for t in range(T):
        for b in range(B):
            p = lengths[b] - T + t
            kk = _budget(p + 1, budget, min_tokens)
            r = max(math.ceil(recent * kk), 1)
            for h in range(HKV):
                keep = np.zeros(N, bool)
                keep[max(p - r + 1, 0): p + 1] = True
                older = np.arange(0, max(p - r + 1, 0))
                heavy = older[np.argsort(-score[b, h, older], kind="stable")[: kk - r]]
                keep[heavy] = True
                for g in range(G):
                    hq = h * G + g
                    s = k[b, h] @ q[b, t, hq] / math.sqrt(D)
                    s = np.where(keep, s, -np.inf)
                    w = np.exp(s - s.max())
                    w /= w.sum()
                    out[b, t, hq] = w @ v[b, h]
                    score[b, h] += w / G  # the mean over the GQA group
    return out, score


@pytest.mark.parametrize("T", [1, 4])
def test_h2o_decode_equals_sequential_reference(T):
    m = make_method("h2o", budget=0.3, min_tokens=6, recent=0.5)
    q, cache = _cache_and_q(5, T)
    score0 = jnp.asarray(np.random.default_rng(6).uniform(size=(CFG.num_layers, B, HKV, N)), jnp.float32)
    out, st = jax.jit(m.sparse_decode)(_ctx(1, LENGTHS), q, cache, H2OState(score=score0))
    want, want_score = _h2o_np(q, cache.k, cache.v, score0[1], LENGTHS, 0.3, 6, 0.5)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(st.score[1], want_score, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(st.score[0], score0[0])  # other layers untouched


def test_h2o_prefill_accumulates_column_sums():
    m = make_method("h2o", budget=0.3, min_tokens=6)
    T, lengths = 12, (12, 9)
    q, k, v = _normal(80, (B, T, HQ, D)), _normal(81, (B, T, HKV, D)), _normal(82, (B, T, HKV, D))
    state = m.init_state(CFG, B, N)
    out, st = jax.jit(m.prefill)(_ctx(2, lengths), q, k, v, state)
    qn, kn = np.asarray(q, np.float64), np.asarray(k, np.float64)
    want = np.zeros((B, HKV, N))
    for b in range(B):
        for i in range(lengths[b]):
            for hq in range(HQ):
                s = kn[b, : i + 1, hq // G] @ qn[b, i, hq] / math.sqrt(D)
                w = np.exp(s - s.max())
                want[b, hq // G, : i + 1] += w / w.sum() / G  # the mean over the GQA group
    np.testing.assert_allclose(st.score[2], want, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(st.score[1]).max()) == 0.0
    # H2O at budget 1 decodes densely.
    qd, cache = _cache_and_q(9, 1)
    full = make_method("h2o", budget=1.0, min_tokens=1)
    out, _ = jax.jit(full.sparse_decode)(_ctx(1, LENGTHS), qd, cache, full.init_state(CFG, B, N))
    np.testing.assert_allclose(out, dense_decode(qd, cache.k, cache.v, jnp.asarray(LENGTHS)), rtol=2e-5, atol=2e-5)


def test_h2o_kept_indices_equal_kept_keys():
    """`kept_indices` (every layer's rows at once, the gathered decode's) hold exactly `kept_keys`' keys, ascending,
    for rows early in the cache (k = p + 1: every key) and late, with ties in the score (they go to the lower
    position in both)."""
    m = make_method("h2o", budget=0.3, min_tokens=6, recent=0.5)
    L = CFG.num_layers
    rng = np.random.default_rng(3)
    score = rng.integers(0, 5, size=(L, B, HKV, N)).astype(np.float32) / 4  # many ties
    score = jnp.asarray(score)
    K = m.k_static(N)
    for pos in ([0, 47], [5, 20], [36, 11]):
        p = jnp.asarray(pos, jnp.int32)
        idx = np.asarray(m.kept_indices(score, p, K))
        for layer in range(L):
            want = np.asarray(m.kept_keys(score[layer], p, K))
            for b in range(B):
                for h in range(HKV):
                    row = idx[layer, b, h]
                    valid = row[row >= 0]
                    assert (row[len(valid):] == -1).all() and (np.diff(valid) > 0).all(), row
                    np.testing.assert_array_equal(np.flatnonzero(want[b, h]), valid, err_msg=f"{pos} {layer}")


def test_h2o_gathered_model_decode_equals_the_mask():
    """Through the model, step after step: the gathered decode (every layer's keys chosen at the start of the
    forward, the mass scattered into the score) equals the mask path in logits and in the accumulated score, also
    around T = 3 steps (both take the mask path there) and a rollback of 2 tokens (a rejected speculative round)."""
    params = random_params(CFG, jax.random.key(4), jnp.float32, scale=1.0)
    T, cap = 40, 64
    toks = jax.random.randint(jax.random.key(5), (B, T), 0, CFG.vocab_size)
    lengths = jnp.array([T, 29], jnp.int32)
    new, old = (make_method("h2o", budget=0.3, min_tokens=6, gathered=g) for g in (True, False))
    _, cache, state = jax.jit(lambda p, t, l: llama.prefill(p, CFG, new, t, l, init_cache(CFG, B, cap, jnp.float32),
                                                            new.init_state(CFG, B, cap)))(params, toks, lengths)
    state_old = state
    step_new = jax.jit(lambda p, t, c, s: llama.decode(p, CFG, new, t, c, s))
    step_old = jax.jit(lambda p, t, c, s: llama.decode(p, CFG, old, t, c, s))
    for i, (n_new, rollback) in enumerate([(1, 0), (1, 0), (3, 0), (1, 2), (1, 0), (1, 0)]):
        if rollback:  # a rejected round: the rows' lengths move back, the keys written past them stay
            cache = cache.replace(lengths=cache.lengths - rollback)
        tok = jax.random.randint(jax.random.key(20 + i), (B, n_new), 0, CFG.vocab_size)
        want, _, state_old = step_old(params, tok, cache, state_old)
        got, cache, state = step_new(params, tok, cache, state)
        assert state.kept is None  # dropped at the end of the forward
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"step {i}")
        np.testing.assert_allclose(state.score, state_old.score, rtol=1e-5, atol=2e-5, err_msg=f"step {i}")


def test_butler_state_type():
    pc = preset_config(CFG, "auto")
    st = Butler.from_params(CFG, pc, None).init_state(CFG, B, N)
    assert isinstance(st, ButlerState)
    assert st.keys.shape == (CFG.num_layers - 1, B, pc.key_heads, N, pc.head_dim)
    assert st.attn_k.shape == (B, N, pc.attn_heads, pc.attn_head_dim)


# ------------------------------------------------------------------------------------- calibrated dense layers


def test_dense_set_rebalances_the_budget_and_attends_densely():
    """Layer 2 calibrated dense: it equals dense decode; layer 1 keeps the rebalanced budget
    b' = (2 * 0.75 - 1) / 1 = 0.5, so the layers >= dense_layers keep as many keys as budget 0.75 on both."""
    pc = preset_config(CFG, "auto")
    pp = init_params(pc, jax.random.key(5))  # decode traces the predictor's branch too
    m = Butler.from_params(CFG, pc, pp, budget=0.75, min_tokens=6, dense_layers=1, dense_set=(2,), local=0)
    assert m.extra_dense(CFG.num_layers) == (2,) and m.sparse_budget(CFG.num_layers) == pytest.approx(0.5)
    pos = np.arange(48)
    from jsparse import selection as sel
    assert m.achieved_sparsity(CFG, pos) == pytest.approx(sel.topk_sparsity(0.5, pos, 6) / 3)
    no_re = Butler.from_params(CFG, pc, None, budget=0.75, min_tokens=6, dense_layers=1, dense_set=(2,),
                               rebalance=False)
    assert no_re.sparse_budget(CFG.num_layers) == 0.75
    q, cache = _cache_and_q(11, 3)
    Lp = CFG.num_layers - 1
    state = m.init_state(CFG, B, N)
    state = state.replace(keys=_normal(12, state.keys.shape), queries=_normal(13, (Lp, B, HQ, 3, pc.head_dim)))
    hid = jnp.zeros((B, 3, CFG.hidden_size), jnp.float32)
    ctx = lambda layer: LayerContext(layer=jnp.int32(layer), lengths=jnp.asarray(LENGTHS, jnp.int32),  # noqa: E731
                                     hidden=hid)
    out2, _ = jax.jit(m.decode)(ctx(2), q, cache, state)
    np.testing.assert_allclose(out2, dense_decode(q, cache.k, cache.v, jnp.asarray(LENGTHS)), rtol=2e-5, atol=2e-5)
    out1, _ = jax.jit(m.decode)(ctx(1), q, cache, state)
    pos3 = np.asarray(LENGTHS)[:, None] - 3 + np.arange(3)
    mask = _butler_mask_np(state.queries[0], state.keys[0], pos3, 0.5, 6, 4, False)
    np.testing.assert_allclose(out1, masked_attention_reference(q, cache.k, cache.v, jnp.asarray(mask)),
                               rtol=2e-5, atol=2e-5)


def test_dense_set_errors(pcfg):
    with pytest.raises(ValueError, match=r"dense_set=\[5\]"):
        Butler.from_params(CFG, pcfg, None, dense_set=(5,))
    # Read as other layers before: "17" as (1, 7), 17.6 as 17, True as 1; a bare 17 raised a TypeError.
    for bad in ("12", [1.6], [True], 2):
        with pytest.raises(ValueError, match="dense_set="):
            Butler.from_params(CFG, pcfg, None, dense_set=bad)
    from jsparse.methods.butler_predictor import PredictorConfig, PredictorConfigError
    with pytest.raises(PredictorConfigError, match=r"head_dim=16.9: expected a whole number"):
        PredictorConfig.from_dict({**pcfg.to_dict(), "head_dim": 16.9})  # an artifact's config was truncated
    assert PredictorConfig.from_dict({**pcfg.to_dict(), "head_dim": float(pcfg.head_dim)}) == pcfg
    with pytest.raises(ValueError, match=r"budget=0.5 is below .*supported budgets: \(0.5000, 1\]"):
        Butler.from_params(CFG, pcfg, None, budget=0.5, dense_layers=1, dense_set=(2,))  # refused at build time
    m = Butler.from_params(CFG, pcfg, None, budget=0.5, dense_layers=1, dense_set=(2,), rebalance=False)
    assert m.sparse_budget(CFG.num_layers) == 0.5 and m.min_budget(CFG.num_layers) == 0.0


def test_artifact_dense_set_and_variants(tmp_path, pcfg):
    """`butler` reads the calibrated dense_set from the artifact; butler-paper and butler-local drop it."""
    from jsparse.artifacts import Artifact, save_artifact
    from jsparse.methods.butler_predictor import flatten_params

    pp = init_params(pcfg, jax.random.key(4))
    save_artifact(str(tmp_path), Artifact(kind="butler", fingerprint="f", arrays=flatten_params(pp),
                                          meta={"predictor_config": pcfg.to_dict(), "dense_set": [2]}))
    with pytest.raises(ValueError, match="supported budgets"):  # its one sparse layer is calibrated dense
        make_method("butler", cfg=CFG, artifact=str(tmp_path), budget=0.75)
    b = make_method("butler", cfg=CFG, artifact=str(tmp_path), budget=0.75, rebalance=False)
    assert b.dense_set == (2,) and b.local == 32 and b.dense_layers == 2
    paper = make_method("butler-paper", cfg=CFG, artifact=str(tmp_path), budget=0.75)
    assert paper.dense_set == () and paper.local == 0 and paper.dense_layers == 1
    loc = make_method("butler-local", cfg=CFG, artifact=str(tmp_path), budget=0.75)
    assert loc.dense_set == () and loc.local == 32 and loc.dense_layers == 1  # the earlier variant's (2 after bc62cbf)
    # An option given as None (`local=null` on the command line) takes the variant's default, not butler's.
    paper = make_method("butler-paper", cfg=CFG, artifact=str(tmp_path), budget=0.75, local=None, dense_layers=None)
    assert paper.local == 0 and paper.dense_layers == 1


def test_shipped_artifact_states_its_supported_budgets():
    """The shipped predictor's calibrated dense layers (3 of 28) need a budget above 3/28 with rebalance: the
    error names the supported range and the two ways to go lower, which both work."""
    import jsparse

    m = jsparse.load("smollm2")
    art = "jsparse/shipped/smollm2/butler"
    with pytest.raises(ValueError, match=r"budget=0\.1 .*supported budgets: \(0\.1071, 1\].*dense_set=\(\)"):
        jsparse.build_method("butler", m, artifact=art, budget=0.1)
    assert jsparse.build_method("butler", m, artifact=art, budget=0.1, dense_set=()).dense_set == ()
    assert jsparse.build_method("butler", m, artifact=art, budget=0.1, rebalance=False).sparse_budget(30) == 0.1
    ok = jsparse.build_method("butler", m, artifact=art, budget=0.2)
    assert ok.min_budget(30) == pytest.approx(3 / 28) and 0 < ok.sparse_budget(30) < 0.2


def test_butler_eval_refuses_the_predictors_training_text(tmp_path, monkeypatch):
    """eval.butler_eval scores the predictor's accuracy and perplexity on --corpus: a text the predictor was trained
    on (by the digests its artifact records) is refused before the model loads; the shipped predictor records its 18
    training books, which leave out the default eval text."""
    import json

    import jsparse
    from eval import butler_eval
    from jsparse.artifacts import Artifact, corpus_meta, save_artifact

    def no_load(*a, **k):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr(jsparse, "load", no_load)
    with open("jsparse/shipped/smollm2/butler/artifact.json") as f:
        meta = json.load(f)["meta"]
    assert len(meta["corpus_sha256"]) == 18 and "london_the_call_of_the_wild.txt" not in meta["corpus"]
    trained = tmp_path / "book.txt"
    trained.write_text("A training book.\n" * 30)
    art = tmp_path / "butler_art"
    save_artifact(str(art), Artifact(kind="butler", fingerprint="f", arrays={"a": np.zeros(1)},
                                     meta=corpus_meta([str(trained)])))
    with pytest.raises(ValueError, match=r"holds the text that the 'butler' artifact .* was calibrated or trained on"):
        butler_eval.main(["--artifact", str(art), "--corpus", str(trained), "--tasks", "accuracy",
                          "--out", str(tmp_path / "out")])
    with pytest.raises(AssertionError, match="must not be loaded"):  # the default corpus is not a training text
        butler_eval.main(["--artifact", "jsparse/shipped/smollm2/butler", "--tasks", "ppl", "--out", str(tmp_path / "o")])


def _top50_np(q, k, qp, kp, rows, hq, hkv, hk):
    """numpy f64: per layer (agreeing, visible) (row, key) pairs of the top-ceil(n/2) labels by true and by
    predicted logits, over query heads and the given rows (keys j <= i visible)."""
    q, k, qp, kp = (np.asarray(a, np.float64) for a in (q, k, qp, kp))
    Bn, T = q.shape[0], q.shape[2]
    Lp = q.shape[1] // hq
    out = np.zeros((Lp, 2))
    for l in range(Lp):
        for b in range(Bn):
            for h in range(hq):
                for i in rows:
                    n = i + 1
                    top = math.ceil(n / 2)
                    s = k[b, l * hkv + h // (hq // hkv), :n] @ q[b, l * hq + h, i] / math.sqrt(q.shape[-1])
                    p = kp[b, l * hk + h // (hq // hk), :n] @ qp[b, l * hq + h, i] / math.sqrt(qp.shape[-1])
                    ls = np.zeros(n, bool)
                    ls[np.argsort(-s, kind="stable")[:top]] = True
                    lp = np.zeros(n, bool)
                    lp[np.argsort(-p, kind="stable")[:top]] = True
                    out[l] += (np.sum(ls == lp), n)
    return out


def test_butler_eval_top50_accuracy_equals_numpy_reference(model, pcfg):
    """top50_accuracy: the fraction of visible (row, key) pairs whose top-ceil(n/2) labels by the true logits and by
    the predictor's agree, over rows min_row, min_row + stride, ... <= T - 1, pooled and per layer 1..L-1."""
    from eval import butler_eval

    pp = init_params(pcfg, jax.random.key(11))
    T, stride, min_row = 24, 3, 2
    windows = np.random.default_rng(5).integers(0, CFG.vocab_size, (2, T)).astype(np.int32)
    acc = butler_eval.top50_accuracy(types.SimpleNamespace(params=model, cfg=CFG),
                                     types.SimpleNamespace(params=pp, pcfg=pcfg), windows, stride=stride,
                                     min_row=min_row, batch=1)
    rows = list(range(min_row, T, stride))  # 2, 5, ..., 23 (the last position included)
    h0, q, k = record_qk(model, CFG, jnp.asarray(windows))
    qp, kp = predictor_qk(pp, pcfg, h0)
    want = _top50_np(q, k, qp, kp, rows, HQ, HKV, pcfg.key_heads)
    assert acc["rows"] == len(rows) and acc["windows"] == 2
    # within one pair of the 864 per layer
    np.testing.assert_allclose(acc["per_layer"], want[:, 0] / want[:, 1], atol=5e-4)
    np.testing.assert_allclose(acc["accuracy"], want[:, 0].sum() / want[:, 1].sum(), atol=5e-4)  # 1728 pairs in all
    assert 0.3 < acc["accuracy"] < 0.95  # an untrained predictor: neither all nor none of the labels agree


def test_butler_eval_ppl_sweep_runs_dense_once_then_each_sparsity(monkeypatch):
    """run_ppl_sweep: dense once (target sparsity 0, budget 1), then every method at every target sparsity s with
    budget 1 - s, the butler variants given the artifact."""
    from eval import butler_eval, harness

    seen = []

    def fake_evaluate(model, spec, progress=False):
        seen.append((spec.methods, spec.budget, dict(spec.artifacts), spec.ppl_variants))
        rec = dict(task="ppl", method=spec.methods[0], length=spec.lengths[0], value=10.0, sparsity=None)
        return types.SimpleNamespace(records=[rec])

    monkeypatch.setattr(harness, "evaluate", fake_evaluate)
    recs = butler_eval.run_ppl_sweep(None, "ART", ["butler", "quest"], [0.3, 0.6], [64], 2, 0, "c.txt", 32)
    assert seen == [(("dense",), 1.0, {}, ("decode",)),
                    (("butler",), 0.7, {"butler": "ART"}, ("decode",)), (("quest",), 0.7, {}, ("decode",)),
                    (("butler",), 0.4, {"butler": "ART"}, ("decode",)), (("quest",), 0.4, {}, ("decode",))]
    assert [(r["method"], r["target_sparsity"]) for r in recs] == [
        ("dense", 0.0), ("butler", 0.3), ("quest", 0.3), ("butler", 0.6), ("quest", 0.6)]


def test_butler_eval_summary_tables():
    """summary.md: dense's perplexity heads each length, a method's cell shows its perplexity and achieved sparsity
    under its target sparsity, and coref accuracy shows hits/n rounded from the mean (0.29 * 100 -> 29/100)."""
    from eval import butler_eval

    recs = [dict(task="ppl", method="dense", length=64, value=10.0, sparsity=0.0, target_sparsity=0.0),
            dict(task="ppl", method="butler", length=64, value=12.5, sparsity=0.48, target_sparsity=0.5),
            dict(task="ppl", method="quest", length=64, value=11.25, sparsity=None, target_sparsity=0.5),
            dict(task="ppl", method="butler", length=64, value=11.0, sparsity=0.28, target_sparsity=0.3),
            dict(task="coref", method="butler", length=64, value=float(np.mean([1.0] * 29 + [0.0] * 71)), n=100,
                 budget=0.5, coverage=0.75)]
    md = butler_eval.summary_markdown(recs, {"command": "python -m eval.butler_eval"})
    assert "Length 64; dense: 10.000" in md
    assert "| method | sparsity 0.3 | sparsity 0.5 |" in md
    assert "| butler | 11.000 (achieved 0.28) | 12.500 (achieved 0.48) |" in md
    assert "| quest |  | 11.250 |" in md
    assert "| butler | 64 | 0.5 | 0.29 (29/100) | 0.750 |" in md


def test_butler_eval_token_coverage_of_streaming_by_its_rule(model):
    """token_coverage: mean over prompts, layers 1..L-1 and query heads of the fraction of the span kept at the last
    position P. Streaming at budget 0.25 of n = 40 keys keeps k = 10: the 4 sinks and keys 34..39; its layer 1 is
    dense here (dense_layers=2), keeping every key <= P."""
    from eval import butler_eval

    T = 40
    m = make_method("streaming", cfg=CFG, budget=0.25, min_tokens=8, sink=4, dense_layers=2)
    tokens = np.random.default_rng(2).integers(0, CFG.vocab_size, (2, T)).astype(np.int32)
    prompts = [types.SimpleNamespace(tokens=tokens[0], span=(2, 6)),  # layer 2 keeps 2, 3: 2/4
               types.SimpleNamespace(tokens=tokens[1], span=(30, 40))]  # layer 2 keeps 34..39: 6/10
    cov = butler_eval.token_coverage(types.SimpleNamespace(params=model, cfg=CFG), {"streaming": m}, prompts)
    assert cov["streaming"] == pytest.approx(((1.0 + 2 / 4) / 2 + (1.0 + 6 / 10) / 2) / 2)


def test_butler_eval_selection_mask_keeps_every_key_of_a_dense_layer(pcfg):
    """A layer the method keeps dense (below dense_layers or in its calibrated dense_set) covers every key <= P."""
    from eval import butler_eval

    m = Butler.from_params(CFG, pcfg, None, budget=0.75, min_tokens=6, dense_layers=1, dense_set=(2,))
    P, T = 20, 32
    q_row, k = _normal(21, (B, 1, HQ, D)), _normal(22, (B, HKV, T, D))
    want = np.broadcast_to(np.arange(T) <= P, (B, HQ, T))
    for layer in (0, 2):
        np.testing.assert_array_equal(butler_eval.selection_mask("butler", m, CFG, layer, q_row, k, P), want)


def test_butler_eval_refuses_a_sparsity_of_one(tmp_path, monkeypatch):
    """--sparsities must be fractions in [0, 1): sparsity 1 is budget 0, which run_ppl_sweep's `budget or 1.0` would
    silently run as dense."""
    import jsparse
    from eval import butler_eval

    monkeypatch.setattr(jsparse, "load", lambda *a, **k: pytest.fail("the model must not be loaded"))
    with pytest.raises(SystemExit, match=r"sparsity 1.0: expected a fraction in \[0, 1\)"):
        butler_eval.main(["--artifact", "jsparse/shipped/smollm2/butler", "--tasks", "ppl", "--sparsities", "0.5,1",
                          "--out", str(tmp_path / "o")])


def test_butler_segments_keep_the_first_dense_layers_dense(pcfg):
    """dense_layers=2 (butler's default): decode scans layer 0 ("first"), layer 1 dense, layer 2 sparse."""
    m = Butler.from_params(CFG, pcfg, None, dense_layers=2)
    assert m.segments(CFG, "decode") == ((0, 1, "first"), (1, 2, "dense"), (2, 3, "sparse"))
    assert Butler.from_params(CFG, pcfg, None, dense_layers=3).segments(CFG, "decode") == ((0, 1, "first"),
                                                                                         (1, 3, "dense"))


def test_butler_kept_indices_use_the_rebalanced_budget(pcfg):
    """With a calibrated dense layer and rebalance, the gathered path's keys (`kept_indices`) are `head_mask`'s at
    the rebalanced budget b' = (2 * 0.75 - 1) / 1 = 0.5, as the mask path's (`sparse_decode`)."""
    from jsparse.methods.butler import head_mask, predicted_logits

    m = Butler.from_params(CFG, pcfg, None, budget=0.75, min_tokens=6, local=3, dense_layers=1, dense_set=(2,))
    assert m.sparse_budget(CFG.num_layers) == pytest.approx(0.5)
    Lp, Hk, d = pcfg.predicted_layers, pcfg.key_heads, pcfg.head_dim
    keys = _normal(21, (Lp, B, Hk, N, d))
    queries = _normal(22, (Lp, B, HQ, 1, d))
    state = ButlerState(attn_k=None, attn_v=None, keys=keys, queries=queries)
    pos = jnp.asarray([[36], [47]], jnp.int32)
    idx = np.asarray(m.kept_indices(state, pos, N))[0]  # layer 1, the sparse one
    mask = np.asarray(head_mask(predicted_logits(queries[0], keys[0], pos), pos, pos[:, 0] + 1, 0.5, 6, N, m.sink,
                                m.local))  # [B, Hq, 1, N]
    for b in range(B):
        assert mask[b].sum(-1).max() == _budget(int(pos[b, 0]) + 1, 0.5, 6)
        for h in range(HQ):
            row = idx[b, h, 0]
            np.testing.assert_array_equal(row[row >= 0], np.flatnonzero(mask[b, h, 0]), err_msg=f"{b} {h}")


def test_butler_group_selection_ignores_gathered(model, pcfg):
    """`gathered` is for selection "head" only: with selection "group", gathered=True decodes as gathered=False
    (the group's pooled top-k, not each query head's keys)."""
    pp = init_params(pcfg, jax.random.key(3))
    opts = dict(budget=0.3, min_tokens=4, local=2, dense_layers=1, selection="group")
    on, off = (Butler.from_params(CFG, pcfg, pp, gathered=g, **opts) for g in (True, False))
    assert not on.is_gathered()
    cache, state = _prefilled(model, off, np.random.default_rng(4))
    tok = jnp.asarray(np.random.default_rng(5).integers(0, CFG.vocab_size, (B, 1)), jnp.int32)
    step = jax.jit(lambda p, m, t, c, s: llama.decode(p, CFG, m, t, c, s)[0])
    np.testing.assert_allclose(step(model, on, tok, cache, state), step(model, off, tok, cache, state), rtol=1e-5,
                               atol=1e-5)


def test_butler_refuses_a_negative_local_window(pcfg):
    with pytest.raises(ValueError, match=r"local=-1: expected an integer >= 0"):
        Butler.from_params(CFG, pcfg, None, local=-1)
    with pytest.raises(ValueError, match=r"sink=-2: expected an integer >= 0"):
        Butler.from_params(CFG, pcfg, None, sink=-2)


def test_butler_run_predictor_queries_are_the_predictors_in_state_layout(pcfg):
    """A decode forward's predicted queries in the state, f32[L', B, Hq, T, d']: entry [l, b, h, t] is the
    whole-sequence predictor's q'[b, t, l, h] (from an empty predictor cache, positions 0..T-1)."""
    pp = init_params(pcfg, jax.random.key(6))
    m = Butler.from_params(CFG, pcfg, pp, budget=0.5, min_tokens=4, dense_layers=1)
    T = 5
    hidden = _normal(31, (B, T, CFG.hidden_size))
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    state = m.start(CFG, m.init_state(CFG, B, 16), "decode", B, T, 16)
    got = np.asarray(jax.jit(m.run_predictor)(hidden, positions, state).queries)
    qp = np.asarray(Predictor(pcfg).apply({"params": pp}, hidden, positions)[0])  # [B, T, L', Hq, d']
    assert got.shape == (pcfg.predicted_layers, B, HQ, T, pcfg.head_dim)
    for layer in range(pcfg.predicted_layers):
        for h in range(HQ):
            np.testing.assert_allclose(got[layer, :, h], qp[:, :, layer, h], rtol=1e-4, atol=1e-5,
                                       err_msg=f"layer {layer} head {h}")


def _h2o_keep_np(score, P, budget, min_tokens, recent):
    """numpy H2O selection of the row at P: bool[B, Hq, T] (query head h uses KV head h // G), as in `_h2o_np`."""
    Bs, Hkv, T = score.shape
    kk = _budget(P + 1, budget, min_tokens)
    r = max(math.ceil(recent * kk), 1)
    keep = np.zeros((Bs, Hkv * G, T), bool)
    for b in range(Bs):
        for h in range(Hkv):
            row = np.zeros(T, bool)
            row[max(P - r + 1, 0): P + 1] = True
            older = np.arange(0, max(P - r + 1, 0))
            row[older[np.argsort(-score[b, h, older], kind="stable")[: kk - r]]] = True
            keep[b, h * G:(h + 1) * G] = row
    return keep


def test_butler_eval_selection_mask_of_h2o_equals_numpy_reference():
    """selection_mask("h2o"): the r = ceil(recent * k) most recent keys <= P and the k - r older ones with the largest
    accumulated score, per KV head, for its query heads h * G .. h * G + G - 1 (recent=0.3, k=12: r=4, not floor's
    3)."""
    from eval import butler_eval

    m = make_method("h2o", budget=0.3, min_tokens=6, recent=0.3)
    P = 36
    score = jnp.asarray(np.random.default_rng(4).uniform(size=(B, HKV, N)), jnp.float32)
    q_row, k = _normal(31, (B, 1, HQ, D)), _normal(32, (B, HKV, N, D))
    got = np.asarray(butler_eval.selection_mask("h2o", m, CFG, 1, q_row, k, P, h2o_score=score))
    want = _h2o_keep_np(np.asarray(score), P, 0.3, 6, 0.3)
    assert want.sum(-1).max() == _budget(P + 1, 0.3, 6) == 12
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("recent, r", [(0.2, 3), (1e-46, 1)])
def test_butler_eval_selection_mask_of_h2o_rounds_the_recent_window_up_to_at_least_one(recent, r):
    """H2O's recent window in the coverage is its decode's (`H2O.kept_keys`): r = max(ceil(recent * k), 1) keys.
    At k = 12 (P = 36, budget 0.3), recent=0.2 gives r = ceil(2.4) = 3, not round's 2; recent=1e-46 (valid, > 0)
    is 0 as an f32 product, and r = 1 still keeps the query's own key P. Scores fall with the position, so the
    heavy keys are 0 .. k - r - 1 and the window's size shows: keys 0..8 and 34..36 (r=3), 0..10 and 36 (r=1)."""
    from eval import butler_eval

    m = make_method("h2o", budget=0.3, min_tokens=6, recent=recent)
    P, k = 36, 12
    assert _budget(P + 1, 0.3, 6) == k
    score = jnp.broadcast_to(-jnp.arange(N, dtype=jnp.float32), (B, HKV, N))
    q_row, kc = _normal(33, (B, 1, HQ, D)), _normal(34, (B, HKV, N, D))
    got = np.asarray(butler_eval.selection_mask("h2o", m, CFG, 1, q_row, kc, P, h2o_score=score))
    want = np.zeros(N, bool)
    want[:k - r] = want[P - r + 1:P + 1] = True
    np.testing.assert_array_equal(got, np.broadcast_to(want, (B, HQ, N)))
    decode = np.asarray(m.kept_keys(score, jnp.full((B,), P, jnp.int32), N))  # [B, Hkv, N]
    np.testing.assert_array_equal(got, np.repeat(decode, G, axis=1))


def test_butler_eval_token_coverage_of_h2o_scores_the_rows_before_p(model):
    """token_coverage("h2o"): the accumulated score at the last position P is the attention the rows 0..P-1 paid
    (pooled over each GQA group), not including row P's own."""
    from eval import butler_eval

    T = 40
    m = make_method("h2o", budget=0.25, min_tokens=6, recent=0.5)
    tokens = np.random.default_rng(8).integers(0, CFG.vocab_size, (2, T)).astype(np.int32)
    prompts = [types.SimpleNamespace(tokens=tokens[0], span=(3, 8)),  # row P's own attention would swap in key 10
               types.SimpleNamespace(tokens=tokens[1], span=(10, 30))]
    cov = butler_eval.token_coverage(types.SimpleNamespace(params=model, cfg=CFG), {"h2o": m}, prompts)
    _, q, k = record_qk(model, CFG, jnp.asarray(tokens))
    Lp, P = CFG.num_layers - 1, T - 1
    q = np.asarray(q, np.float64).reshape(2, Lp, HQ, T, D)
    k = np.asarray(k, np.float64).reshape(2, Lp, HKV, T, D)
    fracs = []
    for l in range(Lp):
        score = np.zeros((2, HKV, T))
        for b in range(2):
            for i in range(P):  # rows before P
                for h in range(HQ):
                    s = k[b, l, h // G, :i + 1] @ q[b, l, h, i] / math.sqrt(D)
                    w = np.exp(s - s.max())
                    score[b, h // G, :i + 1] += w / w.sum()
        keep = _h2o_keep_np(score, P, 0.25, 6, 0.5)
        for b, p in enumerate(prompts):
            fracs.append(keep[b, :, p.span[0]:p.span[1]].mean(-1))
    assert cov["h2o"] == pytest.approx(float(np.mean(fracs)), abs=1e-6)


def test_butler_eval_selection_mask_of_butler_uses_the_rebalanced_budget(pcfg):
    """With a calibrated dense layer and rebalance, butler's coverage uses the budget its sparse layers run at,
    b' = (2 * 0.75 - 1) / 1 = 0.5 (as its decode), not the nominal 0.75."""
    from eval import butler_eval
    from jsparse.methods.butler import predicted_logits

    m = Butler.from_params(CFG, pcfg, None, budget=0.75, min_tokens=6, dense_layers=1, dense_set=(2,))
    assert m.sparse_budget(CFG.num_layers) == pytest.approx(0.5) and m.selection == "head"
    P, d = 36, pcfg.head_dim
    qp, kp = _normal(41, (B, HQ, 1, d)), _normal(42, (B, pcfg.key_heads, N, d))
    logits = predicted_logits(qp, kp, jnp.full((B, 1), P, jnp.int32))
    q_row, k = _normal(43, (B, 1, HQ, D)), _normal(44, (B, HKV, N, D))
    got = np.asarray(butler_eval.selection_mask("butler", m, CFG, 1, q_row, k, P, butler_logits=logits))
    want = _butler_mask_np(qp, kp, np.full((B, 1), P), 0.5, 6, m.sink, False, m.local)[:, :, 0]
    np.testing.assert_array_equal(got, want)


def test_butler_eval_coref_coverage_is_weighted_by_prompts_and_dense_covers_all(monkeypatch):
    """run_coref_task: a method's coverage is the mean over prompts (batches of `rows` weighted by their prompt
    count), dense's is 1.0; accuracy is the fraction of completions that start with the answer."""
    from eval import butler_eval, coref

    prompts = [types.SimpleNamespace(answer=a) for a in ("attic", "barn", "cellar", "garden", "tower")]
    monkeypatch.setattr(coref, "make_prompts", lambda tok, length, samples, seed: prompts[:samples])
    batches = iter([{"quest": 0.5}, {"quest": 1.0}])  # rows=4: prompts 0..3, then prompt 4
    monkeypatch.setattr(butler_eval, "token_coverage", lambda model, methods, part: next(batches))
    answers = {"dense": [" attic", " barn", " Cellar.", " garden", " tower"],
               "quest": [" attic", " the barn", " cellar", " x", " tower"]}
    monkeypatch.setattr(coref, "run_coref", lambda model, method, ps, new_tokens, rows: answers[method.name])
    methods = {"dense": types.SimpleNamespace(name="dense"),
               "quest": types.SimpleNamespace(name="quest", budget=0.5)}
    recs, outs = butler_eval.run_coref_task(types.SimpleNamespace(tokenizer=None), methods, 64, 5, 0, rows=4)
    got = {r["method"]: (r["value"], r["n"], r["coverage"], r["budget"]) for r in recs}
    assert got == {"dense": (1.0, 5, 1.0, 1.0), "quest": (pytest.approx(0.6), 5, pytest.approx(0.6), 0.5)}
    assert [o["correct"] for o in outs if o["method"] == "quest"] == [True, False, True, False, True]


def test_butler_eval_summary_shows_a_coverage_of_zero():
    """A coverage of 0.0 (the method kept none of the location) is a value in the coref table, not a blank."""
    from eval import butler_eval

    recs = [dict(task="coref", method="streaming", length=64, value=0.25, n=4, budget=0.5, coverage=0.0),
            dict(task="coref", method="h2o", length=64, value=0.5, n=4, budget=0.5, coverage=None)]
    md = butler_eval.summary_markdown(recs, {"command": "python -m eval.butler_eval"})
    assert "| streaming | 64 | 0.5 | 0.25 (1/4) | 0.000 |" in md and "| h2o | 64 | 0.5 | 0.50 (2/4) |  |" in md


def test_butler_eval_accepts_a_sparsity_of_zero(tmp_path, monkeypatch):
    """--sparsities takes fractions in [0, 1): 0 (the dense budget 1) passes the check and the model is loaded."""
    import jsparse
    from eval import butler_eval

    class Loaded(Exception):
        pass

    def load(*a, **k):
        raise Loaded

    monkeypatch.setattr(jsparse, "load", load)
    with pytest.raises(Loaded):
        butler_eval.main(["--artifact", "jsparse/shipped/smollm2/butler", "--tasks", "ppl", "--sparsities", "0,0.5",
                          "--out", str(tmp_path / "o")])


def test_butler_eval_refuses_an_unknown_task(tmp_path, monkeypatch):
    """--tasks names tasks of TASKS; another is refused naming it, before the model is loaded."""
    import jsparse
    from eval import butler_eval

    monkeypatch.setattr(jsparse, "load", lambda *a, **k: pytest.fail("the model must not be loaded"))
    with pytest.raises(SystemExit, match=r"unknown task 'acc'; expected some of \('accuracy', 'ppl', 'coref'\)"):
        butler_eval.main(["--artifact", "jsparse/shipped/smollm2/butler", "--tasks", "acc", "--out", str(tmp_path)])

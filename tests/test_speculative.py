"""Speculative decoding: greedy equality with target-only decoding, rejection sampling's distribution, rollback,
batch rows with their own acceptance lengths, errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

from jsparse.api import generate_ids, keep_layers, parse_layers
from jsparse.session import Session
from jsparse.methods import make_method
from models import llama
from models.bundled import LoadedModel
from models.cache import init_cache
from models.config import ModelConfig
from models.generate import Sampling, check_seed, generate_tokens
from models.params import random_params
from models.speculative import (SpecState, loop_step, sampling_probs, spec_append, spec_prefill, spec_round,
                               speculative_generate)

CFG = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256, eos_token_ids=(3,))
DRAFT_CFG = dataclasses.replace(CFG, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32)
DENSE = make_method("dense")


@pytest.fixture(scope="module")
def models():
    target = random_params(CFG, jax.random.key(0), jnp.float32, scale=0.3)
    draft = random_params(DRAFT_CFG, jax.random.key(1), jnp.float32, scale=0.3)
    return target, draft


def _target_only(params, tokens, lengths, max_new):
    out, num = generate_tokens(params, DENSE, tokens, lengths, jax.random.key(0), cfg=CFG, max_new_tokens=max_new,
                               capacity=128)
    return np.asarray(out), np.asarray(num)


@pytest.mark.parametrize("gamma", [1, 3])
def test_greedy_equals_target_only_batch2(models, gamma):
    """Batch 2, different prompt lengths, a weak random draft (rows accept different numbers of tokens)."""
    target, draft = models
    tokens = jax.random.randint(jax.random.key(5), (2, 12), 4, CFG.vocab_size)
    lengths = jnp.array([12, 7])
    ref_out, ref_num = _target_only(target, tokens, lengths, 20)
    out, num, rounds, accepted = speculative_generate(
        target, draft, DENSE, DENSE, tokens, lengths, jax.random.key(0), t_cfg=CFG, d_cfg=DRAFT_CFG, gamma=gamma,
        max_new_tokens=20, capacity=128)
    np.testing.assert_array_equal(np.asarray(num), ref_num)
    np.testing.assert_array_equal(np.asarray(out), ref_out)
    assert np.all(np.asarray(rounds) >= 1) and np.all(np.asarray(accepted) <= gamma * np.asarray(rounds))


def test_eager_prefill_state_can_be_donated_to_the_steps(models):
    """spec_prefill called outside jit: each cache holds its own lengths, not the caller's array, so the donating
    loop_step neither meets one buffer twice nor deletes the caller's lengths."""
    target, draft = models
    tokens = jax.random.randint(jax.random.key(5), (2, 12), 4, CFG.vocab_size)
    lengths = jnp.array([12, 7], jnp.int32)
    s = spec_prefill(target, draft, DENSE, DENSE, tokens, lengths, jax.random.key(0), t_cfg=CFG, d_cfg=DRAFT_CFG,
                     capacity=64)
    assert s.target.lengths is not lengths and s.draft.lengths is not s.target.lengths
    out = loop_step(target, draft, DENSE, DENSE, s, jax.random.key(1), t_cfg=CFG, d_cfg=DRAFT_CFG, gamma=2,
                    max_new_tokens=5)
    jax.block_until_ready(out)
    assert not lengths.is_deleted() and lengths.tolist() == [12, 7]


def test_draft_equal_to_target_accepts_everything(models):
    target, _ = models
    tokens = jax.random.randint(jax.random.key(6), (2, 10), 4, CFG.vocab_size)
    lengths = jnp.array([10, 6])
    gamma, max_new = 3, 13  # 1 from the prefill + 3 full rounds of gamma + 1
    ref_out, ref_num = _target_only(target, tokens, lengths, max_new)
    out, num, rounds, accepted = speculative_generate(
        target, target, DENSE, DENSE, tokens, lengths, jax.random.key(0), t_cfg=CFG, d_cfg=CFG, gamma=gamma,
        max_new_tokens=max_new, capacity=128)
    np.testing.assert_array_equal(np.asarray(out), ref_out)
    full = ref_num == max_new  # rows without an early EOS
    np.testing.assert_array_equal(np.asarray(rounds)[full], 3)
    np.testing.assert_array_equal(np.asarray(accepted)[full], 9)


def test_round_rolls_back_by_lengths_and_rows_accept_independently(models):
    """One round by hand: the caches' lengths move by each row's count; the target cache's accepted rows equal a
    fresh prefill of the accepted text (the rejected rows past lengths are never read)."""
    target, draft = models
    tokens = jax.random.randint(jax.random.key(7), (3, 9), 4, CFG.vocab_size)
    lengths = jnp.array([9, 5, 8])
    s = jax.jit(spec_prefill, static_argnames=("t_cfg", "d_cfg", "capacity"))(target, draft, DENSE, DENSE, tokens, lengths, jax.random.key(0), t_cfg=CFG, d_cfg=DRAFT_CFG,
                     capacity=64)
    limit = jnp.array([10, 10, 2])
    s2, emitted, count, acc = jax.jit(spec_round, static_argnames=("t_cfg", "d_cfg", "gamma"))(target, draft, DENSE, DENSE, s, jax.random.key(1), limit, t_cfg=CFG,
                                               d_cfg=DRAFT_CFG, gamma=4)
    count = np.asarray(count)
    assert count[2] <= 2
    np.testing.assert_array_equal(np.asarray(s2.target.lengths), np.asarray(lengths) + count)
    for b in range(3):
        em = [int(t) for t in np.asarray(emitted[b]) if t >= 0]
        assert len(em) == count[b] and int(s2.tok[b]) == em[-1]
        seq = list(np.asarray(tokens[b, : int(lengths[b])])) + [int(s.tok[b])] + em
        padded = jnp.asarray([seq + [0] * (24 - len(seq))])
        logits, ref_cache, _ = llama.prefill(target, CFG, DENSE, padded, jnp.asarray([len(seq)]),
                                             init_cache(CFG, 1, 24, jnp.float32), None, all_logits=True)
        # Greedy: each emitted token is the target's argmax after the text before it.
        n0 = int(lengths[b])
        np.testing.assert_array_equal(np.argmax(np.asarray(logits[0, n0: n0 + len(em)]), -1), em)
        # The cache rows below the new length hold the accepted text's keys (rows past it are never read).
        n = int(s2.target.lengths[b])
        np.testing.assert_allclose(s2.target.k[:, b, :, :n], ref_cache.k[:, 0, :, :n], atol=1e-4)


@pytest.mark.parametrize("own_draft", [False, True])
def test_rejection_sampling_matches_the_target_distribution(own_draft):
    """Chi-square: the first three sampled tokens (x1 from the prefill, x2, x3 from speculative rounds) over 4000
    rows follow the target's exact joint distribution p(x1) p(x2|x1) p(x3|x1,x2). A different draft at gamma 2:
    both acceptance and rejection happen; the target as its own draft at gamma 1: every draft is accepted, so x3 is
    always the bonus token drawn from p after the round's last draft (q there is 0)."""
    V = 5
    cfg = dataclasses.replace(CFG, vocab_size=V, eos_token_ids=())
    dcfg = cfg if own_draft else dataclasses.replace(DRAFT_CFG, vocab_size=V, eos_token_ids=())
    target = random_params(cfg, jax.random.key(10), jnp.float32, scale=0.5)
    draft = target if own_draft else random_params(dcfg, jax.random.key(11), jnp.float32, scale=0.5)
    gamma = 1 if own_draft else 2
    B = 4000
    prompt = jnp.broadcast_to(jnp.array([1, 4, 2, 0], jnp.int32), (B, 4))
    lengths = jnp.full((B,), 4, jnp.int32)
    sampling = Sampling(temperature=1.0)
    out, num, rounds, accepted = speculative_generate(
        target, draft, DENSE, DENSE, prompt, lengths, jax.random.key(3), t_cfg=cfg, d_cfg=dcfg, gamma=gamma,
        max_new_tokens=3, capacity=16, sampling=sampling)
    out = np.asarray(out)
    assert np.all(np.asarray(num) == 3)
    acc = np.asarray(accepted).sum() / (np.asarray(rounds).sum() * gamma)
    if own_draft:
        assert acc == 1.0 and np.all(np.asarray(rounds) == 1)  # x2 accepted, x3 the bonus token of one round
    else:
        assert 0.05 < acc < 0.95  # the draft differs from the target: both acceptance and rejection happen
    # Exact joint from the target: all V^2 continuations in one batch.
    pairs = np.array([[a, b] for a in range(V) for b in range(V)], np.int32)
    seqs = np.concatenate([np.tile([1, 4, 2, 0], (V * V, 1)), pairs], axis=1)
    logits, _, _ = llama.prefill(target, cfg, DENSE, jnp.asarray(seqs), jnp.full((V * V,), 6),
                                 init_cache(cfg, V * V, 8, jnp.float32), None, all_logits=True)
    probs = np.asarray(sampling_probs(logits, sampling))  # [V*V, 6, V]
    p1 = probs[0, 3]
    p2 = probs[np.arange(0, V * V, V), 4]  # rows (a, 0): p(x2 | x1 = a)
    p3 = probs[:, 5]  # p(x3 | x1, x2)
    joint = (p1[:, None, None] * p2[:, :, None] * p3.reshape(V, V, V)).ravel()
    counts = np.bincount(out[:, 0] * V * V + out[:, 1] * V + out[:, 2], minlength=V ** 3)
    expected = joint.astype(np.float64) / joint.sum() * B
    big = expected >= 5  # pool the sparse cells
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    stat = float(np.sum((obs - exp) ** 2 / exp))
    pval = scipy_stats.chi2.sf(stat, len(obs) - 1)
    assert pval > 1e-3, pval


@pytest.mark.timeout(300)  # a row whose round starts with its EOS once emitted nothing and looped for ever
@pytest.mark.parametrize("at", [0, 1, 3])
def test_speculative_eos_equals_target_only(models, at):
    """An EOS at the `at`-th new token (the prefill's, the first of a round, inside a round) ends the row there,
    counted, as in target-only generation with the same eos_ids."""
    target, draft = models
    tokens = jax.random.randint(jax.random.key(3), (2, 10), 4, CFG.vocab_size)
    lengths = jnp.array([10, 7])
    free, _ = _target_only(target, tokens, lengths, 8)
    eos = (int(free[0, at]),)
    assert eos[0] not in free[0, :at]
    ref_out, ref_num = [np.asarray(x) for x in generate_tokens(target, DENSE, tokens, lengths, jax.random.key(0),
                                                               cfg=CFG, max_new_tokens=8, capacity=128, eos_ids=eos)]
    assert ref_num[0] == at + 1 and np.all(ref_out[0, at + 1:] == -1)
    out, num, _, _ = speculative_generate(target, draft, DENSE, DENSE, tokens, lengths, jax.random.key(0), t_cfg=CFG,
                                          d_cfg=DRAFT_CFG, gamma=3, max_new_tokens=8, capacity=128, eos_ids=eos)
    np.testing.assert_array_equal(np.asarray(out), ref_out)
    np.testing.assert_array_equal(np.asarray(num), ref_num)


def _nucleus_reference(logits, temperature, top_p):
    """float64 numpy: softmax(logits / temperature) kept on the smallest prefix (by descending probability) whose mass
    reaches top_p (a token is kept when the mass strictly above it is < top_p), renormalised, in vocab order."""
    z = np.asarray(logits, np.float64) / temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.zeros_like(p)
    for b in range(p.shape[0]):
        order = np.argsort(-p[b], kind="stable")
        above = np.cumsum(p[b, order]) - p[b, order]
        keep = order[above < top_p]
        out[b, keep] = p[b, keep] / p[b, keep].sum()
    return out


def test_sampling_probs_nucleus():
    """The target's and the draft's distributions: the nucleus in vocab order (the inverse of the sort's permutation)
    against a float64 reference, and no token whose mass above equals top_p (4 equal tokens: top_p 0.5 keeps 2, 0.75
    keeps 3, as `sample` does in test_generate), or speculative sampling's output is not the target's."""
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    p = np.asarray(sampling_probs(logits, Sampling(temperature=1.0, top_p=0.7)))
    np.testing.assert_allclose(p[0], [0.625, 0.375, 0, 0], atol=1e-6)
    logits = jnp.log(jnp.array([[0.15, 0.5, 0.05, 0.3]]))
    p = np.asarray(sampling_probs(logits, Sampling(temperature=1.0, top_p=0.7)))
    np.testing.assert_allclose(p[0], [0, 0.625, 0, 0.375], atol=1e-6)
    rand = jax.random.normal(jax.random.key(0), (16, 11)) * 2.0
    for temperature, top_p in ((1.0, 0.6), (0.7, 0.9)):
        got = np.asarray(sampling_probs(rand, Sampling(temperature=temperature, top_p=top_p)))
        np.testing.assert_allclose(got, _nucleus_reference(rand, temperature, top_p), atol=1e-5)
    for top_p, kept in ((0.5, 2), (0.75, 3)):
        p = np.asarray(sampling_probs(jnp.zeros((1, 4)), Sampling(temperature=1.0, top_p=top_p)))[0]
        assert np.count_nonzero(p) == kept, (top_p, p)
        np.testing.assert_allclose(p[p > 0], 1 / kept, atol=1e-6)


def test_layer_skipped_draft_and_errors(models):
    target, draft = models
    tgt = LoadedModel(cfg=CFG, params=target, tokenizer=None, name="t")
    assert parse_layers("0-1,2", 3) == [0, 1, 2] == parse_layers(" 0 - 1 , 2 ", 3)
    with pytest.raises(ValueError, match="expected comma-separated layers"):
        parse_layers("0 2", 3)  # read as layer 2 before: spaces were deleted
    with pytest.raises(ValueError, match="between 0 and 2"):
        parse_layers("0-5", 3)
    assert parse_layers("2", 3) == [2] == parse_layers("2-2", 3)
    with pytest.raises(ValueError, match=r"layers='2-1': range 2-1 runs backwards"):
        parse_layers("2-1", 3)
    with pytest.raises(ValueError, match=r"layers='0-3': expected layers between 0 and 2 \(the model has 3 layers\)"):
        parse_layers("0-3", 3)
    with pytest.raises(ValueError, match=r"layers='0-99999999999': expected layers between 0 and 2"):
        parse_layers("0-99999999999", 3)  # refused before the range is built (10**11 ints)
    for text in ("0,1,1", "1,0"):
        with pytest.raises(ValueError, match=rf"layers='{text}': expected each layer once, in ascending order"):
            parse_layers(text, 3)
    # keep_layers itself (public, beside parse_layers): a layer past the model read the last one (a clamped gather)
    for bad, match in (([0, 3], r"layers=\[0, 3\]: expected layers between 0 and 2"),
                       ([2, 0], "expected each layer once, in ascending order"),
                       ([], "expected a non-empty list of integer layer indices"),
                       ([0, 1.0], "expected a non-empty list of integer layer indices")):
        with pytest.raises(ValueError, match=match):
            keep_layers(tgt, bad)
    skipped = keep_layers(tgt, [0, 2])
    assert skipped.cfg.num_layers == 2 and skipped.params.layers.wq.shape[0] == 2
    np.testing.assert_array_equal(skipped.params.layers.wq[1], target.layers.wq[2])
    ids = [[5, 6, 7, 8, 9], [10, 11, 12]]
    ref = generate_ids(tgt, ids, max_new_tokens=10)
    stats = {}
    assert generate_ids(tgt, ids, max_new_tokens=10, draft=skipped, gamma=2, stats=stats) == ref
    assert 0.0 <= stats["acceptance_rate"] <= 1.0 and stats["rounds"] >= 1
    other = LoadedModel(cfg=dataclasses.replace(DRAFT_CFG, vocab_size=100),
                        params=random_params(dataclasses.replace(DRAFT_CFG, vocab_size=100), jax.random.key(2),
                                             jnp.float32), tokenizer=None, name="d")
    with pytest.raises(ValueError, match="draft vocabulary of 100 tokens differs from the target's 128"):
        generate_ids(tgt, ids, max_new_tokens=4, draft=other)
    with pytest.raises(ValueError, match="gamma=0: expected an integer >= 1"):
        generate_ids(tgt, ids, max_new_tokens=4, draft=skipped, gamma=0)
    short = dataclasses.replace(skipped, cfg=dataclasses.replace(skipped.cfg, max_position_embeddings=16))
    with pytest.raises(ValueError, match="is 17 tokens, longer than the draft's context of 16"):
        generate_ids(tgt, ids, max_new_tokens=12, draft=short)
    with pytest.raises(ValueError, match=r"prompt 1 has token id -1: expected ids in \[0, 128\)"):
        generate_ids(tgt, [[5, 6], [7, -1]], max_new_tokens=4, draft=skipped)
    # A session checks each message against both contexts (its capacity may be larger) and the vocabulary.
    session = Session(tgt, short, gamma=2, capacity=64)
    with pytest.raises(ValueError, match="is 20 tokens, longer than the draft's context of 16"):
        session.send_ids(list(range(4, 14)), max_new_tokens=10)
    with pytest.raises(ValueError, match=r"the message has token id 128: expected ids in \[0, 128\)"):
        session.send_ids([5, 128], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"capacity=-8: expected an integer >= 1 \(cache rows"):
        Session(tgt, skipped, gamma=2, capacity=-8)


def test_speculative_generate_is_one_computation(models):
    target, draft = models
    tokens = jax.random.randint(jax.random.key(2), (2, 8), 4, CFG.vocab_size)
    lowered = speculative_generate.lower(target, draft, DENSE, DENSE, tokens, jnp.array([8, 5]), jax.random.key(0),
                                         t_cfg=CFG, d_cfg=DRAFT_CFG, gamma=2, max_new_tokens=6, capacity=32)
    assert "stablehlo.while" in lowered.as_text()
    assert isinstance(SpecState, type)


def test_forced_accept_sets_the_round_length(models):
    """The benchmark knob: forced_accept fixes each row's accepted count; lengths move by it + 1."""
    target, draft = models
    tokens = jax.random.randint(jax.random.key(8), (2, 9), 4, CFG.vocab_size)
    s = spec_prefill(target, draft, DENSE, DENSE, tokens, jnp.array([9, 6]), jax.random.key(0), t_cfg=CFG,
                     d_cfg=DRAFT_CFG, capacity=32)
    s2, emitted, count, acc = jax.jit(spec_round, static_argnames=("t_cfg", "d_cfg", "gamma"))(
        target, draft, DENSE, DENSE, s, jax.random.key(1), jnp.array([10, 10]), t_cfg=CFG, d_cfg=DRAFT_CFG, gamma=3,
        forced_accept=jnp.array([3, 1]))
    np.testing.assert_array_equal(np.asarray(acc), [3, 1])
    np.testing.assert_array_equal(np.asarray(s2.target.lengths), [9 + 4, 6 + 2])


def test_inputs_a_caller_can_get_wrong(models):
    """Too small a cache for speculative_generate is an error (its NaN logits read as token 0 before); numpy
    integer counts are integers; float or bool token ids are refused (not truncated); a tiny temperature samples the
    largest logit (logits / T overflowed to inf, the draw took the first token, its probabilities NaN) and a subnormal
    one (0 on the device) is refused; a Session's
    text message on a model without a tokenizer says so."""
    target, draft = models
    tokens = jax.random.randint(jax.random.key(5), (2, 12), 4, CFG.vocab_size)
    with pytest.raises(ValueError, match=r"width 12 plus max_new_tokens=8 and gamma \+ 1 = 3 verification rows is "
                                         r"23 tokens, more than the capacity=20"):
        speculative_generate(target, draft, DENSE, DENSE, tokens, jnp.array([12, 7]), jax.random.key(0), t_cfg=CFG,
                             d_cfg=DRAFT_CFG, gamma=2, max_new_tokens=8, capacity=20)
    tgt = LoadedModel(cfg=CFG, params=target, tokenizer=None, name="t")
    drf = LoadedModel(cfg=DRAFT_CFG, params=draft, tokenizer=None, name="d")
    ids = [[5, 6, 7, 8, 9]]
    ref = generate_ids(tgt, ids, max_new_tokens=5)
    assert generate_ids(tgt, ids, max_new_tokens=np.int64(5), draft=drf, gamma=np.int64(2)) == ref
    session = Session(tgt, drf, gamma=2, capacity=64)
    assert session.send_ids(np.asarray(ids[0]), max_new_tokens=np.int32(5)) == ref[0]
    for bad, dtype in (([[5.7, 6.2, 9.9]], "float64"), ([[True, False]], "bool")):
        with pytest.raises(ValueError, match=f"prompt 0 has token ids of dtype {dtype}.*expected integer token ids"):
            generate_ids(tgt, bad, max_new_tokens=2)
    with pytest.raises(ValueError, match="the message has token ids of dtype float64"):
        Session(tgt, drf, gamma=2, capacity=64).send_ids([5.7, 6.0], max_new_tokens=2)
    with pytest.raises(ValueError, match="'t' has no tokenizer .*send_ids"):
        Session(tgt, drf, gamma=2, capacity=64).send("Hi")
    from models.generate import sample

    logits = jnp.array([[5.0, 20.0, 10.0, -30.0], [39.0, -10.0, 40.0, 0.0]])  # / 2e-38: past f32's max
    with pytest.raises(ValueError, match=r"temperature=1e-39: expected 0 \(greedy\) or at least 1.18e-38"):
        Sampling(temperature=1e-39)
    tiny = Sampling(temperature=2e-38)
    np.testing.assert_array_equal(sample(logits, jax.random.key(0), tiny), [1, 2])
    np.testing.assert_array_equal(sampling_probs(logits, tiny), jax.nn.one_hot(jnp.array([1, 2]), 4))
    np.testing.assert_allclose(sampling_probs(logits, Sampling(temperature=7.0)), jax.nn.softmax(logits / 7.0),
                               rtol=1e-5, atol=1e-7)


def test_heat_methods_roll_back_with_the_caches(models):
    """H2O's score and EvoSparse's heat accumulate over decode steps: the verification's rejected rows are not
    counted (`begin_verify` / `end_verify`), so greedy speculative decoding with them as the target's method
    emits exactly their own greedy decoding (before, rejected rows' attention steered later selections and the
    outputs differed), with a draft that is always rejected and with one accepted part of the time."""
    from jsparse.methods.evosparse import EvoSparse

    target, draft = models
    tgt = LoadedModel(cfg=CFG, params=target, tokenizer=None, name="t")
    drafts = (LoadedModel(cfg=DRAFT_CFG, params=draft, tokenizer=None, name="d"), tgt)  # the target runs dense
    rng = np.random.default_rng(0)
    ids = [[int(t) for t in rng.integers(4, 128, 60)], [int(t) for t in rng.integers(4, 128, 41)]]
    rates = []
    for method in (make_method("h2o", budget=0.15, min_tokens=4),
                   EvoSparse.from_heads(CFG, [(1, 0), (2, 1)], budget_tokens=24, block_size=4, dense_layers=1,
                                        heat_window=8, decay=0.8)):
        ref = generate_ids(tgt, ids, method=method, max_new_tokens=40)
        for drf in drafts:
            stats = {}
            assert generate_ids(tgt, ids, method=method, max_new_tokens=40, draft=drf, gamma=3, stats=stats) == ref
            rates.append(stats["acceptance_rate"])
    assert min(rates) == 0.0 and any(0.0 < r < 1.0 for r in rates)


def test_session_changes_only_when_a_step_succeeds(models, monkeypatch):
    """A step that fails before anything runs leaves the session as it was (its state was set before the decode
    loop, so every later message went down the append path and failed); one that fails after the state was
    donated marks the session lost and the next message says so."""
    import jsparse.session as session_mod

    target, draft = models
    tgt = LoadedModel(cfg=CFG, params=target, tokenizer=None, name="t")
    drf = LoadedModel(cfg=DRAFT_CFG, params=draft, tokenizer=None, name="d")
    ids = [5, 6, 7, 8, 9]
    real = session_mod.loop_step
    session = Session(tgt, drf, gamma=2, capacity=64)

    def refused(*args, **kwargs):
        raise ValueError("refused while traced")
    monkeypatch.setattr(session_mod, "loop_step", refused)
    with pytest.raises(ValueError, match="refused while traced"):
        session.send_ids(ids, max_new_tokens=4)
    assert session.state is None and session.tokens == [] and session.rounds == 0
    monkeypatch.setattr(session_mod, "loop_step", real)
    first = session.send_ids(ids, max_new_tokens=4)
    assert first == generate_ids(tgt, [ids], max_new_tokens=4)[0]
    state, tokens = session.state, list(session.tokens)
    monkeypatch.setattr(session_mod, "loop_step", refused)
    with pytest.raises(ValueError, match="refused while traced"):  # append_step ran and donated the old state
        session.send_ids([10, 11], max_new_tokens=2)
    monkeypatch.setattr(session_mod, "loop_step", real)
    if any(x.is_deleted() for x in jax.tree_util.tree_leaves(state)):  # donation honoured (not on every backend)
        assert session.state is None and session.lost == "ValueError: refused while traced"
        with pytest.raises(RuntimeError, match=r"cache was lost when an earlier step failed \(ValueError: refused"):
            session.send_ids([10, 11], max_new_tokens=2)
    else:
        assert session.state is state and session.tokens == tokens and session.lost is None
        assert session.send_ids([10, 11], max_new_tokens=2) == generate_ids(tgt, [tokens + [10, 11]],
                                                                             max_new_tokens=2)[0]


def test_seeds_use_all_their_bits(models):
    """Without x64, jax.random.key keeps a seed's low 32 bits: 5 and 2**32 + 5 sampled alike."""
    from models.generate import seed_key

    same = lambda a, b: bool(jnp.all(jax.random.key_data(a) == jax.random.key_data(b)))  # noqa: E731
    assert same(seed_key(5), jax.random.key(5)) and same(seed_key(2 ** 32 - 1), jax.random.key(2 ** 32 - 1))
    seeds = [0, 5, 2 ** 32 + 5, -1, 2 ** 63 - 1, -(2 ** 63), 2 ** 32, -(2 ** 32)]
    data = [tuple(np.asarray(jax.random.key_data(seed_key(s))).tolist()) for s in seeds]
    assert len(set(data)) == len(seeds), dict(zip(seeds, data))
    # Outside 64 bits refused by name (2**63 would alias -2**63: both fold in the high word 2**31).
    for seed in (2 ** 63, -(2 ** 63) - 1):
        with pytest.raises(ValueError, match=rf"seed={seed}: expected an integer in \[-2\*\*63, 2\*\*63\)"):
            check_seed(seed)
    assert check_seed(2 ** 63 - 1) == 2 ** 63 - 1 and check_seed(-(2 ** 63)) == -(2 ** 63)
    target, _ = models
    tgt = LoadedModel(cfg=CFG, params=target, tokenizer=None, name="t")
    ids = [[5, 6, 7, 8, 9]]
    outs = {s: generate_ids(tgt, ids, max_new_tokens=6, temperature=2.0, seed=s)[0] for s in (5, 2 ** 32 + 5)}
    assert outs[5] == generate_ids(tgt, ids, max_new_tokens=6, temperature=2.0, seed=np.int64(5))[0]
    assert outs[5] != outs[2 ** 32 + 5]


def test_bad_lengths_and_limits_end_rows_instead_of_corrupting_them(models):
    """A prompt length of 0 or past the prompt's width gives NaN logits: speculative_generate ends that row with no
    token, as generate_tokens does (it decoded argmax's token 0 and went on). A negative round limit emits nothing
    (count went negative and both caches shrank under tok and prev); gamma < 1 is refused in a round."""
    from models.speculative import round_step

    target, draft = models
    tokens = jax.random.randint(jax.random.key(5), (3, 8), 4, CFG.vocab_size)
    lengths = jnp.array([8, 0, 12])
    out_g, num_g = generate_tokens(target, DENSE, tokens, lengths, jax.random.key(0), cfg=CFG, max_new_tokens=6,
                                   capacity=64)
    out, num, rounds, _ = speculative_generate(target, draft, DENSE, DENSE, tokens, lengths, jax.random.key(0),
                                               t_cfg=CFG, d_cfg=DRAFT_CFG, gamma=2, max_new_tokens=6, capacity=64)
    np.testing.assert_array_equal(np.asarray(num), [6, 0, 0])
    np.testing.assert_array_equal(np.asarray(num), np.asarray(num_g))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out_g))  # greedy: row 0 equal, rows 1-2 all -1
    assert int(rounds[1]) == int(rounds[2]) == 0
    s = spec_prefill(target, draft, DENSE, DENSE, tokens[:2], jnp.array([8, 6]), jax.random.key(0), t_cfg=CFG,
                     d_cfg=DRAFT_CFG, capacity=32)
    s2, emitted, count, acc = jax.jit(spec_round, static_argnames=("t_cfg", "d_cfg", "gamma"))(
        target, draft, DENSE, DENSE, s, jax.random.key(1), jnp.array([-3, 2]), t_cfg=CFG, d_cfg=DRAFT_CFG, gamma=3)
    assert int(count[0]) == 0 and 1 <= int(count[1]) <= 2
    np.testing.assert_array_equal(np.asarray(s2.target.lengths), [8, 6 + int(count[1])])
    assert int(s2.tok[0]) == int(s.tok[0]) and int(s2.prev[0]) == int(s.prev[0]) and int(acc[0]) == 0
    assert np.all(np.asarray(emitted[0]) == -1)
    for gamma in (0, -1):
        with pytest.raises(ValueError, match=f"gamma={gamma}: expected an integer >= 1"):
            round_step(target, draft, DENSE, DENSE, s, jax.random.key(1), jnp.array([4, 4]), t_cfg=CFG,
                       d_cfg=DRAFT_CFG, gamma=gamma)


def test_a_padded_message_keeps_the_heat_of_every_message_row(models):
    """spec_append with `lengths` (a Session's message padded to its bucket) leaves a heat-keeping target (H2O) in
    the state of the unpadded append: the pending token's and every message row's attention mass, not the padding's."""
    target, draft = models
    h2o = make_method("h2o", budget=0.5, min_tokens=4)
    tokens = jax.random.randint(jax.random.key(7), (2, 12), 4, CFG.vocab_size)
    kw = dict(t_cfg=CFG, d_cfg=DRAFT_CFG)
    s = spec_prefill(target, draft, h2o, DENSE, tokens, jnp.array([12, 9]), jax.random.key(0), capacity=64, **kw)
    msg = jax.random.randint(jax.random.key(8), (2, 3), 4, CFG.vocab_size)
    ref = spec_append(target, draft, h2o, DENSE, s, msg, jax.random.key(1), **kw)
    padded = jnp.concatenate([msg, jnp.zeros((2, 2), msg.dtype)], axis=1)
    got = spec_append(target, draft, h2o, DENSE, s, padded, jax.random.key(1), jnp.array([3, 3]), **kw)
    np.testing.assert_array_equal(np.asarray(got.target.lengths), np.asarray(ref.target.lengths))
    np.testing.assert_array_equal(np.asarray(got.tok), np.asarray(ref.tok))
    np.testing.assert_array_equal(np.asarray(got.prev), np.asarray(ref.prev))
    np.testing.assert_allclose(np.asarray(got.t_state.score), np.asarray(ref.t_state.score), atol=1e-5)


def test_session_counts_every_turns_rounds(models):
    """With the target as its own draft every draft token is accepted: over two turns the session's rounds and
    accepted counts add up (gamma accepted a round: acceptance_rate 1.0), not the last turn's alone."""
    target, _ = models
    tgt = LoadedModel(cfg=CFG, params=target, tokenizer=None, name="t")
    session = Session(tgt, tgt, gamma=2, capacity=64)
    session.send_ids([5, 6, 7, 8, 9], max_new_tokens=7)
    first = session.rounds
    assert first >= 1 and session.accepted == 2 * first
    session.send_ids([10, 11], max_new_tokens=7)
    assert session.rounds > first and session.accepted == 2 * session.rounds
    assert session.acceptance_rate == 1.0


def test_session_samples_with_its_top_p(models):
    target, draft = models
    tgt = LoadedModel(cfg=CFG, params=target, tokenizer=None, name="t")
    drf = LoadedModel(cfg=DRAFT_CFG, params=draft, tokenizer=None, name="d")
    assert Session(tgt, drf, gamma=2, capacity=64, temperature=0.7, top_p=0.5).sampling == Sampling(0.7, 0.5)
    with pytest.warns(UserWarning, match="top_p=0.5 has no effect at temperature 0"):
        assert Session(tgt, drf, gamma=2, capacity=64, top_p=0.5).sampling == Sampling(0.0, 1.0)


def test_session_default_capacity_is_at_most_4096_rows(models):
    """None: the smaller of the model's context and 4096, rounded up to 128 (a context of 10000 is not 10112 rows
    of cache per model)."""
    target, draft = models
    long = dataclasses.replace(CFG, max_position_embeddings=10000)
    tgt = LoadedModel(cfg=long, params=target, tokenizer=None, name="t")
    drf = LoadedModel(cfg=dataclasses.replace(DRAFT_CFG, max_position_embeddings=10000), params=draft,
                      tokenizer=None, name="d")
    assert Session(tgt, drf, gamma=2).capacity == 4096
    assert Session(LoadedModel(cfg=dataclasses.replace(CFG, max_position_embeddings=200), params=target,
                               tokenizer=None, name="t"), drf, gamma=2).capacity == 256


def test_generate_stats_sum_the_rows_and_rate_per_proposed_token(models):
    """stats over a batch are the sums of each row's rounds and accepted tokens (every row, not the first), and
    acceptance_rate is accepted / (rounds * gamma): 1.0 with the target as its own draft."""
    target, _ = models
    tgt = LoadedModel(cfg=CFG, params=target, tokenizer=None, name="t")
    ids = [[5, 6, 7, 8, 9], [10, 11, 12]]
    alone = []
    for row in ids:
        s = {}
        generate_ids(tgt, [row], max_new_tokens=10, draft=tgt, gamma=2, stats=s)
        alone.append(s)
    both = {}
    generate_ids(tgt, ids, max_new_tokens=10, draft=tgt, gamma=2, stats=both)
    assert both["rounds"] == alone[0]["rounds"] + alone[1]["rounds"] >= 2
    assert both["accepted"] == 2 * both["rounds"] and both["acceptance_rate"] == 1.0


def test_speculative_rounds_sample_with_fresh_keys(models):
    """At a high temperature (near-uniform over 128 ids) the target as its own draft accepts every draft; 33 tokens
    (the prefill's + 8 rounds of gamma + 1 = 4) are mostly distinct and adjacent repeats rare (~1/128 each). A key
    reused across rounds repeats the rounds' tokens; one reused across a round's draft steps repeats d_1 as d_2."""
    target, _ = models
    tokens, lengths = jnp.asarray([[5, 6, 7, 8]], jnp.int32), jnp.asarray([4], jnp.int32)
    out, num, rounds, accepted = speculative_generate(
        target, target, DENSE, DENSE, tokens, lengths, jax.random.key(1), t_cfg=CFG, d_cfg=CFG, gamma=3,
        max_new_tokens=33, capacity=64, sampling=Sampling(temperature=100.0))
    out = np.asarray(out[0])
    assert int(num[0]) == 33
    assert len(set(out.tolist())) > 20, out
    assert int(np.sum(out[1:] == out[:-1])) <= 2, out


def test_a_one_token_round_leaves_the_draft_cache_right(models):
    """A round that emits one token (limit 1) sets prev to the round's pending token: with the target as its own
    draft (greedy), the next round accepts all gamma drafts. A wrong prev rewrites position n - 1 of the draft's
    cache with another token, and the draft's proposals stop matching the target."""
    target, _ = models
    tokens = jax.random.randint(jax.random.key(9), (2, 10), 4, CFG.vocab_size)
    lengths = jnp.array([10, 7])
    kw = dict(t_cfg=CFG, d_cfg=CFG, gamma=4)
    rnd = jax.jit(spec_round, static_argnames=("t_cfg", "d_cfg", "gamma"))
    s = spec_prefill(target, target, DENSE, DENSE, tokens, lengths, jax.random.key(0), t_cfg=CFG, d_cfg=CFG,
                     capacity=64)
    s1, _, count, _ = rnd(target, target, DENSE, DENSE, s, jax.random.key(1), jnp.array([1, 1]), **kw)
    np.testing.assert_array_equal(np.asarray(count), [1, 1])
    np.testing.assert_array_equal(np.asarray(s1.prev), np.asarray(s.tok))
    s2, emitted, count, acc = rnd(target, target, DENSE, DENSE, s1, jax.random.key(2), jnp.array([10, 10]), **kw)
    np.testing.assert_array_equal(np.asarray(acc), [4, 4])
    np.testing.assert_array_equal(np.asarray(count), [5, 5])


@pytest.mark.parametrize("seed, T, lengths, gamma, row_new, num, rounds, accepted", [
    (6, 10, [10, 6], 1, None, [7, 7], [3, 3], [3, 3]),
    (11, 9, [9, 6], 2, [3, 12], [3, 12], [1, 4], [2, 8])])
def test_the_target_as_its_own_draft_accepts_everything(models, seed, T, lengths, gamma, row_new, num, rounds,
                                                         accepted):
    """The target as its own draft (greedy) accepts every draft; each row's tokens are the target's own greedy
    tokens, -1 after its last.
    - gamma 1: every round emits 2 tokens (a draft and the bonus), so `prev` after a round is the round's first
      token; a wrong one corrupts the draft's cache and its acceptance, not the output (7 tokens: the prefill's + 3
      rounds of 2).
    - gamma 2, row_new_tokens [3, 12]: row 0 stops at 3 tokens (the prefill's + one round limited to 2) and row 1
      at 12 (1 + 3 + 3 + 3 + 2); rounds count only the rounds a row took part in (1 and 4), and accepted only
      theirs (2 a round: 2 and 8), not the rounds run for the other row after it finished."""
    target, _ = models
    tokens = jax.random.randint(jax.random.key(seed), (2, T), 4, CFG.vocab_size)
    steps = max(num)
    ref_out, _ = _target_only(target, tokens, jnp.array(lengths), steps)
    out, got_num, got_rounds, got_accepted = speculative_generate(
        target, target, DENSE, DENSE, tokens, jnp.array(lengths), jax.random.key(0), t_cfg=CFG, d_cfg=CFG,
        gamma=gamma, max_new_tokens=steps, capacity=64,
        row_new_tokens=None if row_new is None else jnp.array(row_new))
    out = np.asarray(out)
    np.testing.assert_array_equal(np.asarray(got_num), num)
    for b, n in enumerate(num):
        np.testing.assert_array_equal(out[b, :n], ref_out[b, :n])
        assert np.all(out[b, n:] == -1), out[b]
    np.testing.assert_array_equal(np.asarray(got_rounds), rounds)
    np.testing.assert_array_equal(np.asarray(got_accepted), accepted)


def test_every_prng_key_is_used_once(models, monkeypatch):
    """Deterministic key bookkeeping of a sampled speculative_generate (a weak draft, gamma 3, at least 2 rounds):
    every key jax.random.split, categorical or uniform receives is recorded (jax.debug.callback inside the jit), and
    each key is consumed exactly once, by one split or one draw. A key used twice correlates two random draws: the
    acceptance uniforms' key reused for the residual draw, the first proposal's key reused in the draft's scan, or
    the loop's carried key handed to a round (the round splits it, and so does the next loop step). The counts pin
    that the recording saw the whole computation: splits 1 + 2 a round, draws 1 + (gamma + 2) a round."""
    target, draft = models
    log = []

    def recorded(kind, real):
        def wrapped(key, *args, **kwargs):
            data = jax.random.key_data(key) if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key
            jax.debug.callback(lambda d: log.append((kind, tuple(np.asarray(d).ravel().tolist()))), data)
            return real(key, *args, **kwargs)
        return wrapped

    for name in ("split", "categorical", "uniform"):
        monkeypatch.setattr(jax.random, name, recorded(name, getattr(jax.random, name)))
    tokens = jax.random.randint(jax.random.key(5), (2, 8), 4, CFG.vocab_size)
    gamma = 3
    # A fresh jit of the unjitted function: a cached trace of speculative_generate would record nothing.
    run = jax.jit(lambda key: speculative_generate.__wrapped__(
        target, draft, DENSE, DENSE, tokens, jnp.array([8, 5]), key, t_cfg=CFG, d_cfg=DRAFT_CFG, gamma=gamma,
        max_new_tokens=7, capacity=32, sampling=Sampling(temperature=1.0)))
    out, num, rounds, _ = run(jax.random.key(4))
    jax.block_until_ready(out)
    jax.effects_barrier()
    R = int(np.max(np.asarray(rounds)))  # loop iterations: each has an active row
    assert R >= 2, rounds  # 1 + at most gamma + 1 tokens a round < 7
    splits = [k for kind, k in log if kind == "split"]
    draws = [k for kind, k in log if kind != "split"]
    assert len(splits) == 1 + 2 * R and len(draws) == 1 + (gamma + 2) * R, (R, log)
    assert sum(kind == "uniform" for kind, _ in log) == R
    keys = splits + draws
    reused = {k for k in keys if keys.count(k) > 1}
    assert not reused, [(kind, k) for kind, k in log if k in reused]

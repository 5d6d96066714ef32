"""The model's entry points check their inputs by name (audit /tmp/audit_api items 3, 12 and 13).

1. `llama.prefill` / `decode` (and `prefill_step` / `decode_step` / `generate_tokens`) refuse concrete token ids
   outside [0, vocab_size) and token arrays of a non-integer dtype; under a trace the ids are not read (no error,
   no host transfer), as before;
2. `llama.prefill`'s lengths as a list or of a float dtype, and `generate_tokens`' capacity as a float or a bool,
   are refused by name;
3. `llama.decode` with T = 0 new tokens is refused.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsparse.methods import make_method
from models import llama
from models.cache import init_cache
from models.config import ModelConfig
from models.generate import decode_step, generate_tokens, prefill_step
from models.params import random_params
from models import bundled

CFG = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256, eos_token_ids=(3,))
DENSE = make_method("dense")
RANGE = r"expected ids in \[0, 128\)"


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, jax.random.key(0), jnp.float32, scale=0.3)


def _cache(B=1, capacity=16):
    return init_cache(CFG, B, capacity, jnp.float32)


@pytest.fixture(scope="module")
def prefilled(params):
    """A batch-1 cache holding 2 tokens (concrete lengths)."""
    _, cache, _ = llama.prefill(params, CFG, DENSE, jnp.array([[5, 6]]), jnp.array([2]), _cache(), None)
    return cache


def _prefill(params, tokens, lengths):
    return llama.prefill(params, CFG, DENSE, tokens, lengths, _cache(), None)


def _prefill_step(params, tokens, lengths):
    return prefill_step(params, DENSE, tokens, lengths, _cache(), None, cfg=CFG)


# 1 ------------------------------------------------------------------------------------------- token ids


@pytest.mark.parametrize("run", [_prefill, _prefill_step], ids=["prefill", "prefill_step"])
@pytest.mark.parametrize("bad", [-1, 128, 10 ** 6])
def test_prefill_refuses_out_of_vocab_ids(params, run, bad):
    """-1 read the last embedding row (the logits of id 127), 128 gave NaN logits: now both are refused."""
    with pytest.raises(ValueError, match=rf"token id {bad} \(row 1, position 2\): {RANGE}"):
        run(params, jnp.array([[5, 6, 7], [5, 6, bad]]), jnp.array([3, 3]))


def test_prefill_refuses_out_of_vocab_padding(params):
    """The padding past a row's length is embedded and written to the cache too: its ids are checked as well."""
    with pytest.raises(ValueError, match=rf"token id -1 \(row 0, position 2\): {RANGE}"):
        _prefill(params, jnp.array([[5, 6, -1]]), jnp.array([2]))


@pytest.mark.parametrize("step", [False, True], ids=["decode", "decode_step"])
@pytest.mark.parametrize("bad", [-1, 999])
def test_decode_refuses_out_of_vocab_ids(params, prefilled, step, bad):
    tokens = jnp.array([[7, bad]])
    with pytest.raises(ValueError, match=rf"token id {bad} \(row 0, position 1\): {RANGE}"):
        if step:
            decode_step(params, DENSE, tokens, prefilled, None, cfg=CFG)
        else:
            llama.decode(params, CFG, DENSE, tokens, prefilled, None)


def test_generate_tokens_refuses_out_of_vocab_ids(params):
    with pytest.raises(ValueError, match=rf"token id -1 \(row 0, position 1\): {RANGE}"):
        generate_tokens(params, DENSE, jnp.array([[5, -1]]), jnp.array([2]), jax.random.key(0), cfg=CFG,
                        max_new_tokens=2, capacity=16)


@pytest.mark.parametrize("tokens", [jnp.array([[5.0, 6.0]]), np.array([[True, False]]), [[5, 6]]],
                         ids=["float", "bool", "list"])
def test_token_arrays_of_another_type_are_refused_by_name(params, prefilled, tokens):
    match = r"tokens (of dtype|is a list).*expected an (integer )?array i32\[B, T\]"
    with pytest.raises(ValueError, match=match):
        _prefill(params, tokens, jnp.array([2]))
    with pytest.raises(ValueError, match=match):
        llama.decode(params, CFG, DENSE, tokens, prefilled, None)
    with pytest.raises(ValueError, match=match):
        generate_tokens(params, DENSE, tokens, jnp.array([2]), jax.random.key(0), cfg=CFG, max_new_tokens=2,
                        capacity=16)


def test_traced_ids_are_not_read(params, prefilled):
    """Under a jit the ids are unknown: nothing raises and nothing is copied to the host (as before the checks)."""
    # The params are arguments: closed over, a device's arrays become constants, read back to embed them (on a GPU).
    prefill = jax.jit(lambda p, t: llama.prefill(p, CFG, DENSE, t, jnp.array([2]), _cache(), None)[0])
    decode = jax.jit(lambda p, t, c: llama.decode(p, CFG, DENSE, t, c, None)[0])
    tokens = jnp.array([[5, -1]])
    with jax.transfer_guard_device_to_host("disallow"):
        assert prefill(params, tokens).shape == (1, CFG.vocab_size)
        assert decode(params, tokens, prefilled).shape == (1, 2, CFG.vocab_size)


# 2 ------------------------------------------------------------------------------------ lengths, capacity


@pytest.mark.parametrize("run", [_prefill, _prefill_step], ids=["prefill", "prefill_step"])
@pytest.mark.parametrize("lengths, match", [([2], r"lengths is a list \(\[2\]\): expected an array i32\[1\]"),
                                            (jnp.array([2.0]), r"lengths of dtype float32: expected an integer "
                                                               r"array i32\[1\]"),
                                            (np.array([True]), r"lengths of dtype bool")])
def test_prefill_lengths_of_another_type_are_refused_by_name(params, run, lengths, match):
    """A list was an AttributeError ('list' object has no attribute 'shape'), a float array a TypeError from
    take_along_axis. The contract is an i32[B] array: a list is refused, not converted."""
    with pytest.raises(ValueError, match=match):
        run(params, jnp.array([[5, 6]]), lengths)


@pytest.mark.parametrize("value", [16.0, True, 0])
def test_generate_tokens_refuses_a_capacity_that_is_not_a_count(params, value):
    """capacity=True ran as capacity 1 and 16.0 failed inside JAX's shape code (a TypeError); checked by name now,
    as max_new_tokens is."""
    with pytest.raises(ValueError, match=rf"capacity={value!r}: expected an integer >= 1 \(KV cache rows\)"):
        generate_tokens(params, DENSE, jnp.array([[5]]), jnp.array([1]), jax.random.key(0), cfg=CFG,
                        max_new_tokens=2, capacity=value)


@pytest.mark.parametrize("value", [0, -5])
def test_check_request_names_a_capacity_that_is_not_a_count(value):
    """generate_ids' capacity=-5 read "6 tokens, longer than the KV cache capacity of -5"; named as a bad value now,
    as the Session names it."""
    from models.generate import check_request

    with pytest.raises(ValueError, match=rf"capacity={value}: expected an integer >= 1 \(KV cache rows\)"):
        check_request(CFG, [3], 3, capacity=value)


# 3 ------------------------------------------------------------------------------------- T = 0 new tokens


@pytest.mark.parametrize("how", ["eager", "decode_step", "jit"])
def test_decode_refuses_zero_new_tokens(params, prefilled, how):
    """T >= 1 is the contract: T = 0 returned a (B, 0, V) array. A shape: refused under a trace too."""
    tokens = jnp.zeros((1, 0), jnp.int32)
    with pytest.raises(ValueError, match=r"tokens \(1, 0\): expected at least one new token per row"):
        if how == "eager":
            llama.decode(params, CFG, DENSE, tokens, prefilled, None)
        elif how == "decode_step":
            decode_step(params, DENSE, tokens, prefilled, None, cfg=CFG)
        else:
            jax.jit(lambda t, c: llama.decode(params, CFG, DENSE, t, c, None))(tokens, prefilled)


def _tiny(layers=3, seed=0):
    from models.params import random_params

    cfg = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=16,
                      max_position_embeddings=256, eos_token_ids=(3,))
    return bundled.LoadedModel(cfg=cfg, params=random_params(cfg, jax.random.key(seed), jnp.float32, scale=0.3),
                               tokenizer=None, name="tiny")


def test_session_refuses_a_message_one_row_past_the_capacity():
    """A message whose conversation, message, max_new_tokens and gamma + 1 verification rows exceed the capacity by
    one row is refused before anything runs."""
    from jsparse.session import Session

    s = Session(_tiny(), _tiny(layers=2, seed=1), gamma=4, capacity=64)
    # 10 + 49 + gamma + 1 = 64 rows fit; 10 + 50 + 5 = 65 do not.
    with pytest.raises(ValueError, match=r"\(\+ gamma \+ 1 = 5 verification rows\) need 65 cache rows, more than "
                                         r"the session's capacity of 64"):
        s.send_ids([5] * 10, max_new_tokens=50)
    assert s.tokens == [] and s.state is None  # refused before anything ran


def test_prefill_refuses_a_prompt_one_token_past_the_capacity(params):
    tokens = jnp.full((1, 17), 5, jnp.int32)
    with pytest.raises(ValueError, match=r"prompt of 17 tokens \(padded\) is longer than the KV cache capacity of 16"):
        llama.prefill(params, CFG, DENSE, tokens, jnp.array([3]), _cache(capacity=16), None)


def test_decode_refuses_a_negative_cache_length(params, prefilled):
    """A negative length would write the new token nowhere (dropped) and attend to nothing: refused by name."""
    cache = prefilled.replace(lengths=jnp.array([-1], jnp.int32))
    with pytest.raises(ValueError, match=r"cache lengths \[-1\] plus 1 new tokens: expected every row to end within "
                                         "16 tokens"):
        llama.decode(params, CFG, DENSE, jnp.array([[7]]), cache, None)


def test_session_refuses_an_empty_message_and_runs_one_that_fills_the_capacity_exactly():
    """An empty message is refused by name; 10 + 49 + gamma + 1 = 64 rows fit a capacity of 64 (the 65-row case
    is refused above): the reply equals generate's over the same prompt."""
    from jsparse.api import generate_ids
    from jsparse.session import Session

    model = _tiny()
    s = Session(model, _tiny(layers=2, seed=1), gamma=4, capacity=64)
    with pytest.raises(ValueError, match="empty message: expected at least one token"):
        s.send_ids([], max_new_tokens=2)
    ids = list(range(5, 15))
    assert s.send_ids(ids, max_new_tokens=49) == generate_ids(model, [ids], max_new_tokens=49)[0]


def test_session_message_that_fills_the_drafts_context_exactly_runs():
    """conversation + message + max_new_tokens equal to the draft's context (16) fits it; one more is refused."""
    from jsparse.api import generate_ids
    from jsparse.session import Session

    model, draft = _tiny(), _tiny(layers=2, seed=1)
    short = dataclasses.replace(draft, cfg=dataclasses.replace(draft.cfg, max_position_embeddings=16))
    with pytest.raises(ValueError, match="is 17 tokens, longer than the draft's context of 16"):
        Session(model, short, gamma=2, capacity=64).send_ids([5, 6, 7, 8, 9], max_new_tokens=12)
    assert Session(model, short, gamma=2, capacity=64).send_ids([5, 6, 7, 8], max_new_tokens=12) == \
        generate_ids(model, [[5, 6, 7, 8]], max_new_tokens=12)[0]


@pytest.mark.parametrize("shape", [(5,), (1, 2, 3)])
def test_token_arrays_of_another_rank_are_refused_by_shape(params, prefilled, shape):
    """tokens must be i32[B, T]: a 1-D or 3-D integer array is refused naming its shape (not a bare unpacking error
    from `B, T = tokens.shape`), by prefill and decode alike."""
    tokens = jnp.full(shape, 5, jnp.int32)
    msg = rf"tokens {re.escape(str(shape))}: expected i32\[B, T\]"
    with pytest.raises(ValueError, match=msg):
        _prefill(params, tokens, jnp.array([2]))
    with pytest.raises(ValueError, match=msg):
        llama.decode(params, CFG, DENSE, tokens, prefilled, None)


def test_traced_negative_cache_length_gets_nan_logits(params, prefilled):
    """Under a trace a negative cache length cannot raise (`check_decode_request`): its queries would write nowhere
    and attend to nothing, so they get NaN logits, while the same step from the real length (2) is finite."""
    step = jax.jit(lambda c: llama.decode(params, CFG, DENSE, jnp.array([[7, 8]]), c, None)[0])
    bad = np.asarray(step(prefilled.replace(lengths=jnp.array([-1], jnp.int32))))
    good = np.asarray(step(prefilled))
    assert np.isnan(bad).all()
    assert np.isfinite(good).all()


def test_sampled_session_draws_fresh_keys_every_turn(monkeypatch):
    """With sampling (temperature > 0) every step of every turn draws with a key of its own: each turn splits the
    session's key into the key kept for the next turn and the turn's two step keys (its message step, prefill or
    append, and its decoding loop). The audit found this untested: a key not stored back (every turn sampling as
    the first did), a turn's step key kept as the next turn's key, or one key shared by both steps of a turn all
    passed. Pinned on the keys the steps receive: the four step keys of two turns are distinct, the key kept after
    a turn is none of them, the same seed gives the same keys and another seed other ones."""
    import jsparse.session as session_mod

    used = []

    def recording(name, step):
        def run(*args, **kwargs):
            keys = [a for a in (*args, *kwargs.values())
                    if isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jax.dtypes.prng_key)]
            assert len(keys) == 1, f"{name} received {len(keys)} PRNG keys"
            used.append((name, _key_bytes(keys[0])))
            return step(*args, **kwargs)
        return run

    for name in ("prefill_step", "append_step", "loop_step"):
        monkeypatch.setattr(session_mod, name, recording(name, getattr(session_mod, name)))
    model, draft = _tiny(), _tiny(layers=2, seed=1)

    def session(seed):
        return session_mod.Session(model, draft, gamma=2, capacity=64, temperature=1.0, seed=seed)

    s = session(7)
    s.send_ids([5, 6, 7], max_new_tokens=4)
    kept = [_key_bytes(s.key)]
    s.send_ids([8, 9], max_new_tokens=4)
    kept.append(_key_bytes(s.key))
    assert [n for n, _ in used] == ["prefill_step", "loop_step", "append_step", "loop_step"]
    keys = [k for _, k in used]
    assert len(set(keys)) == 4, "two steps (of one turn or of two turns) sampled with the same key"
    assert not set(kept) & set(keys) and kept[0] != kept[1], "a used key was kept as the next turn's key"
    del used[:]
    session(7).send_ids([5, 6, 7], max_new_tokens=4)
    session(8).send_ids([5, 6, 7], max_new_tokens=4)
    assert [k for _, k in used[:2]] == keys[:2]  # the same seed: the same keys (reproducible)
    assert not {k for _, k in used[2:]} & set(keys)  # another seed: other keys


def _key_bytes(key):
    return np.asarray(jax.random.key_data(key)).tobytes()


def test_a_failed_turn_leaves_the_sampling_key_as_it_was(monkeypatch):
    """"The session changes only once the whole step has succeeded" holds for its PRNG key too: a turn whose step is
    refused before anything runs (here the decoding loop raising) leaves the key unchanged, so the retried turn samples
    as if the failure had never happened (the key was split before the step and stored at once until 2026-12-05)."""
    import jsparse.session as session_mod

    model, draft = _tiny(), _tiny(layers=2, seed=1)
    clean = session_mod.Session(model, draft, gamma=2, capacity=64, temperature=1.0, seed=3)
    want = clean.send_ids([5, 6, 7], max_new_tokens=4)
    s = session_mod.Session(model, draft, gamma=2, capacity=64, temperature=1.0, seed=3)
    before = _key_bytes(s.key)
    real = session_mod.loop_step

    def refused(*args, **kwargs):
        raise ValueError("refused while traced")

    monkeypatch.setattr(session_mod, "loop_step", refused)
    with pytest.raises(ValueError, match="refused while traced"):
        s.send_ids([5, 6, 7], max_new_tokens=4)
    assert _key_bytes(s.key) == before and s.state is None and s.lost is None and s.tokens == []
    monkeypatch.setattr(session_mod, "loop_step", real)
    assert s.send_ids([5, 6, 7], max_new_tokens=4) == want
    assert _key_bytes(s.key) == _key_bytes(clean.key)

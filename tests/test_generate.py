"""Generation on the layer-scan model: cache consistency, one compiled computation, sampling, request errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsparse.methods import make_method
from models import llama
from models.cache import init_cache
from models.config import ModelConfig
from models.generate import Sampling, check_request, check_token_ids, generate_tokens, sample
from models.params import random_params

CFG = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256, eos_token_ids=(3,))
DENSE = make_method("dense")


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, jax.random.key(0), jnp.float32, scale=0.3)


def test_prefill_then_decode_equals_full_forward_batch2(params):
    """Batch 2 with different lengths: prefill a prefix, decode the rest one token (and 3 tokens) at a time."""
    T = 40
    tokens = jax.random.randint(jax.random.key(1), (2, T), 0, CFG.vocab_size)
    full, _, _ = llama.prefill(params, CFG, DENSE, tokens, jnp.array([T, T]), init_cache(CFG, 2, 64, jnp.float32),
                               None, all_logits=True)
    prefix = np.array([17, 9])
    logits, cache, _ = llama.prefill(params, CFG, DENSE, tokens[:, :20], jnp.asarray(prefix),
                                     init_cache(CFG, 2, 64, jnp.float32), None)
    np.testing.assert_allclose(logits, full[np.arange(2), prefix - 1], atol=1e-4)
    pos = prefix.copy()
    for step in range(6):
        T_new = 1 if step % 2 == 0 else 3
        new = np.stack([np.asarray(tokens[b, pos[b]: pos[b] + T_new]) for b in range(2)])
        logits, cache, _ = llama.decode(params, CFG, DENSE, jnp.asarray(new), cache, None)
        for b in range(2):
            np.testing.assert_allclose(logits[b], full[b, pos[b]: pos[b] + T_new], atol=1e-4)
        pos += T_new
    np.testing.assert_array_equal(cache.lengths, pos)


def test_generate_is_one_compiled_computation(params):
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 4, CFG.vocab_size)
    lengths = jnp.array([16, 11])
    kwargs = dict(cfg=CFG, max_new_tokens=12, capacity=64)
    generate_tokens._clear_cache()
    with jax.log_compiles():
        out1, _ = generate_tokens(params, DENSE, tokens, lengths, jax.random.key(0), **kwargs)
    assert generate_tokens._cache_size() == 1
    out2, _ = generate_tokens(params, DENSE, tokens + 1, lengths, jax.random.key(1), **kwargs)
    assert generate_tokens._cache_size() == 1  # new prompts of the same bucket: no retrace
    # The whole loop is inside one XLA computation: a while loop in the lowered HLO, no per-token dispatch.
    hlo = generate_tokens.lower(params, DENSE, tokens, lengths, jax.random.key(0), **kwargs).as_text()
    assert "stablehlo.while" in hlo
    assert out1.shape == (2, 12)


def test_greedy_generation_matches_step_by_step(params):
    tokens = jax.random.randint(jax.random.key(3), (2, 10), 4, CFG.vocab_size)
    lengths = np.array([10, 7])
    out, num = generate_tokens(params, DENSE, tokens, jnp.asarray(lengths), jax.random.key(0), cfg=CFG,
                               max_new_tokens=8, capacity=64)
    for b in range(2):
        seq = list(np.asarray(tokens[b, : lengths[b]]))
        for i in range(int(num[b])):
            logits, _, _ = llama.prefill(params, CFG, DENSE, jnp.asarray([seq]), jnp.asarray([len(seq)]),
                                         init_cache(CFG, 1, 64, jnp.float32), None)
            nxt = int(jnp.argmax(logits[0]))
            assert int(out[b, i]) == nxt
            seq.append(nxt)
            if nxt in CFG.eos_token_ids:
                break


def test_greedy_sample_is_the_argmax():
    logits = jnp.zeros((2, CFG.vocab_size)).at[0, 3].set(10.0).at[1, 5].set(10.0)
    assert list(np.asarray(sample(logits, jax.random.key(0), Sampling()))) == [3, 5]


@pytest.mark.parametrize("at", [0, 2])
def test_eos_ends_the_row_and_is_counted(params, at):
    """A row stops at its first EOS (the prefill's token too, at=0), which is counted in `num` and kept in `out`,
    -1 after it; the other row runs on as without the EOS."""
    tokens = jax.random.randint(jax.random.key(3), (2, 10), 4, CFG.vocab_size)
    lengths = jnp.asarray([10, 7])

    def run(eos):
        return [np.asarray(x) for x in generate_tokens(params, DENSE, tokens, lengths, jax.random.key(0), cfg=CFG,
                                                       max_new_tokens=8, capacity=64, eos_ids=eos)]

    free, free_num = run(())
    e = int(free[0, at])
    assert e not in free[0, :at] and free_num[0] == 8
    out, num = run((e,))
    assert num[0] == at + 1
    np.testing.assert_array_equal(out[0, :at + 1], free[0, :at + 1])
    assert np.all(out[0, at + 1:] == -1)
    if e not in free[1]:
        np.testing.assert_array_equal(out[1], free[1])
        assert num[1] == 8


def test_top_p_sampling_stays_in_nucleus():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 4000))
    draws = np.asarray(sample(logits, jax.random.key(0), Sampling(temperature=1.0, top_p=0.7)))
    assert set(draws) <= {0, 1}
    assert 0.55 < np.mean(draws == 0) < 0.70  # 0.5 / 0.8 renormalised
    # Unsorted: the nucleus is found in sorted order but the draw is a vocab id (ids 3 and 1, not positions 0 and 1)
    logits = jnp.log(jnp.array([[0.05, 0.3, 0.15, 0.5]] * 4000))
    draws = np.asarray(sample(logits, jax.random.key(0), Sampling(temperature=1.0, top_p=0.7)))
    assert set(draws.tolist()) == {1, 3}, np.bincount(draws, minlength=4)
    assert abs(np.mean(draws == 3) - 0.625) < 0.03, np.mean(draws == 3)
    with pytest.raises(ValueError, match="top_p=0"):
        Sampling(temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="temperature=-1"):
        Sampling(temperature=-1)
    with pytest.raises(ValueError, match="temperature=nan: expected a finite value"):
        Sampling(temperature=float("nan"))


def test_temperature_and_top_p_values_are_traced_not_compiled_in(params):
    """A new temperature or top_p value reuses the compiled loop (they were static: one compilation each); greedy and
    top_p < 1 still choose their own programs, and the values still reach the sampler."""
    from models.speculative import speculative_generate

    tokens, lengths = jnp.asarray([[5, 6, 7, 8]], jnp.int32), jnp.asarray([4], jnp.int32)

    def run(temperature, top_p=1.0, draft=False):
        kw = dict(max_new_tokens=6, capacity=16, sampling=Sampling(temperature, top_p))
        if draft:
            return speculative_generate(params, params, DENSE, DENSE, tokens, lengths, jax.random.key(1), t_cfg=CFG,
                                        d_cfg=CFG, gamma=2, **kw)[0]
        return generate_tokens(params, DENSE, tokens, lengths, jax.random.key(1), cfg=CFG, **kw)[0]

    for draft, fn in ((False, generate_tokens), (True, speculative_generate)):
        outs = [run(0.5, draft=draft)]
        size = fn._cache_size()
        outs += [run(t, draft=draft) for t in (5.0, 50.0)]
        assert fn._cache_size() == size
        assert len({tuple(np.asarray(o).ravel()) for o in outs}) > 1  # the values are used
        run(5.0, 0.5, draft=draft)
        size = fn._cache_size()
        run(2.0, 0.9, draft=draft)
        assert fn._cache_size() == size
    with pytest.raises(ValueError, match=r"greedy=True: it follows from temperature and top_p \(False\)"):
        Sampling(1.0, 1.0, greedy=True)


def test_max_new_tokens_of_one_bucket_share_the_compiled_loop(params):
    """The loop's width is max_new_tokens rounded up to NEW_TOKENS_BUCKET and its stop traced: 3, 5 and 40 new
    tokens run one compilation (each compiled its own before), and each returns exactly its count."""
    from models.generate import _generate_tokens

    tokens, lengths = jnp.asarray([[5, 6, 7, 8]], jnp.int32), jnp.asarray([4], jnp.int32)

    def run(n):
        return generate_tokens(params, DENSE, tokens, lengths, jax.random.key(0), cfg=CFG, max_new_tokens=n,
                               capacity=128)

    want = run(40)
    size = _generate_tokens._cache_size()
    for n in (3, 5, 40):
        out, num = run(n)
        assert out.shape == (1, n) and int(num[0]) <= n
        np.testing.assert_array_equal(out, want[0][:, :n])  # greedy: a prefix of the longer run
    assert _generate_tokens._cache_size() == size


def test_request_errors():
    with pytest.raises(ValueError, match="empty prompt"):
        check_request(CFG, [5, 0], 4)
    with pytest.raises(ValueError, match="longer than the KV cache capacity of 64"):
        check_request(CFG, [60], 8, capacity=64)
    with pytest.raises(ValueError, match="longer than the model's context of 256"):
        check_request(CFG, [250], 8)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        check_request(CFG, [5], 0)
    assert check_request(CFG, [100], 20) == 128
    # at a context that 128 does not divide, the default still rounds to 128 (EvoSparse's blocks and Quest's pages
    # must divide the capacity: a cap at a context of 1000 refused them for a request dense ran)
    assert check_request(dataclasses.replace(CFG, max_position_embeddings=1000), [990], 4) == 1024
    # Speculative decoding's gamma + 1 verification rows need cache rows, not context: named apart.
    with pytest.raises(ValueError, match=r"max_new_tokens=8 and gamma \+ 1 = 5 verification rows is 73 tokens, "
                                         "longer than the KV cache capacity of 72"):
        check_request(CFG, [60], 8, capacity=72, verify_rows=5)
    assert check_request(CFG, [240], 16, capacity=261, verify_rows=5) == 261  # fits the context of 256
    assert check_request(CFG, [240], 16, verify_rows=5) == 384
    with pytest.raises(ValueError, match=r"prompt 1 has token id 128: expected ids in \[0, 128\)"):
        check_token_ids(CFG, [[1, 2], [3, 128]])
    with pytest.raises(ValueError, match="prompt 0 has token id -1"):
        check_token_ids(CFG, [[1, -1]])


def test_generate_tokens_ends_a_row_at_garbage_and_checks_its_static_arguments(params):
    """Called directly (no `check_request`), a cache too small for the request gave NaN logits that argmax read as
    token 0, counted in `num`: the row now ends there (-1, not counted); the shorter row fills the cache it has.
    Non-integer or < 1 max_new_tokens and capacity are refused by name, in `generate_tokens` and `check_request`."""
    dense = make_method("dense")
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 4, CFG.vocab_size)
    lengths = jnp.array([16, 10])
    full, _ = generate_tokens(params, dense, tokens, lengths, jax.random.key(0), cfg=CFG, max_new_tokens=12,
                              capacity=64)
    out, num = generate_tokens(params, dense, tokens, lengths, jax.random.key(0), cfg=CFG, max_new_tokens=12,
                               capacity=16)
    out, num, full = np.asarray(out), np.asarray(num), np.asarray(full)
    np.testing.assert_array_equal(num, [1, 7])  # row 0: its first token only; row 1: the 6 slots 10..15 as well
    np.testing.assert_array_equal(out[0], [full[0, 0]] + [-1] * 11)
    np.testing.assert_array_equal(out[1, :7], full[1, :7])
    assert np.all(out[1, 7:] == -1)
    with pytest.raises(ValueError, match="max_new_tokens=0: expected an integer >= 1"):
        generate_tokens(params, dense, tokens, lengths, jax.random.key(0), cfg=CFG, max_new_tokens=0, capacity=64)
    with pytest.raises(ValueError, match="max_new_tokens=2.5: expected an integer"):
        check_request(CFG, [5], 2.5)
    with pytest.raises(ValueError, match="capacity=100.0: expected an integer"):
        check_request(CFG, [5], 4, capacity=100.0)


def test_generate_returns_the_state_of_its_own_prefill(params):
    """return_prefill_state: the same tokens, and the method's state equal to a standalone prefill's (TSA's kept
    counts, what the eval harness measures its sparsity from, with tokens dropped in layers 1-2)."""
    from jsparse.methods.tsa import TSA

    tsa = TSA(tau=0.3, window=8, min_tokens=8, pool_kernel=3)
    tokens = jax.random.randint(jax.random.key(5), (2, 64), 4, CFG.vocab_size)
    lengths = jnp.array([64, 50])
    kwargs = dict(cfg=CFG, max_new_tokens=6, capacity=128)
    out, num = generate_tokens(params, tsa, tokens, lengths, jax.random.key(0), **kwargs)
    out2, num2, state = generate_tokens(params, tsa, tokens, lengths, jax.random.key(0), return_prefill_state=True,
                                        **kwargs)
    np.testing.assert_array_equal(out2, out)
    np.testing.assert_array_equal(num2, num)
    _, _, want = llama.prefill(params, CFG, tsa, tokens, lengths, init_cache(CFG, 2, 64, jnp.float32),
                               tsa.init_state(CFG, 2, 64))
    np.testing.assert_array_equal(state.kept, want.kept)
    assert (np.asarray(state.kept)[1:] < np.asarray(lengths)[None]).all()  # really dropped, not dense by accident


@pytest.mark.parametrize("method", ["dense", "h2o"])
def test_gemm_row_padding_leaves_every_output_unchanged(params, monkeypatch, method):
    """The forward's rows padded to a multiple of 8 once (`llama.gemm_row_padding`, on by default only for bf16 /
    f16 on GPUs; forced here on the CPU) give the same logits, cache, method state and hidden states as unpadded."""
    m = make_method(method, **({"budget": 0.3, "min_tokens": 6} if method == "h2o" else {}))
    tokens = jax.random.randint(jax.random.key(3), (3, 13), 0, CFG.vocab_size)
    lengths = jnp.array([13, 11, 7])

    def run():
        st = m.init_state(CFG, 3, 32)
        logits, cache, st, hidden = llama.prefill(params, CFG, m, tokens, lengths, init_cache(CFG, 3, 32, jnp.float32),
                                                  st, all_logits=True, return_hidden=True)
        dec = [llama.decode(params, CFG, m, tokens[:, :5], cache, st)]  # 3 x 5 = 15 rows
        dec.append(llama.decode(params, CFG, m, tokens[:, 5:6], dec[0][1], dec[0][2]))  # 3 rows
        return logits, cache, hidden, dec

    plain = run()
    # On by default only for bf16 / f16 on a GPU host: a CPU host pads nothing unless forced.
    assert llama.gemm_row_padding(15, jnp.bfloat16) == (1 if jax.default_backend() == "gpu" else 0)
    assert llama.gemm_row_padding(15, jnp.float32) == 0
    seen = []

    def forced(rows, dtype):
        seen.append(rows)
        return -rows % 8 if rows > 1 else 0
    monkeypatch.setattr(llama, "gemm_row_padding", forced)
    padded = run()
    assert 39 in seen and 15 in seen and 3 in seen  # prefill 3 x 13, verification-like 3 x 5, decode 3 x 1
    # A GPU's GEMMs of 15 and 16 rows sum in another order (an H200: hidden states up to 6e-5 apart).
    tol = 1e-5 if jax.default_backend() == "cpu" else 3e-4
    for a, b in zip(jax.tree_util.tree_leaves(plain), jax.tree_util.tree_leaves(padded)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def test_a_method_may_answer_in_the_gemm_rows(params, monkeypatch):
    """`LayerContext.rows_out`: with the forward's rows padded (forced on the CPU), a method may return its decode
    attention as [1, R, Hq, D] (token rows first, zeros after), which the model takes as is: the same logits as
    the [B, T, Hq, D] answer. Unpadded forwards tell the method None."""
    dense, seen = make_method("dense"), []

    class Padded:  # dense, answering in the GEMMs' rows when told them
        def __getattr__(self, name):
            return getattr(dense, name)

        def decode(self, ctx, q, cache, state):
            out, state = dense.decode(ctx, q, cache, state)
            seen.append(ctx.rows_out)
            if ctx.rows_out is None:
                return out, state
            B, T = out.shape[:2]
            rows = out.reshape((1, B * T) + out.shape[2:])
            return jnp.pad(rows, [(0, 0), (0, ctx.rows_out - B * T), (0, 0), (0, 0)]), state

    tokens = jax.random.randint(jax.random.key(5), (3, 9), 0, CFG.vocab_size)
    _, cache, st = llama.prefill(params, CFG, dense, tokens, jnp.array([9, 6, 8]), init_cache(CFG, 3, 32, jnp.float32),
                                 dense.init_state(CFG, 3, 32))
    want = llama.decode(params, CFG, dense, tokens[:, :2], cache, st)[0]
    llama.decode(params, CFG, Padded(), tokens[:, :2], cache, st)
    assert set(seen) == {None}
    monkeypatch.setattr(llama, "gemm_row_padding", lambda rows, dtype: -rows % 8 if rows > 1 else 0)
    got = llama.decode(params, CFG, Padded(), tokens[:, :2], cache, st)[0]
    assert seen[-1] == 8  # 3 x 2 token rows as 8
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_top_p_keeps_the_smallest_set_that_reaches_top_p():
    """The nucleus is the smallest set of tokens whose mass reaches top_p: with 4 equal tokens (mass 0.25 each,
    exact in f32), top_p = 0.5 keeps 2 of them and top_p = 0.75 keeps 3, never the token whose mass above is
    exactly top_p."""
    logits = jnp.zeros((4000, 4))
    for top_p, kept in ((0.5, 2), (0.75, 3)):
        draws = np.asarray(sample(logits, jax.random.key(0), Sampling(temperature=1.0, top_p=top_p)))
        counts = np.bincount(draws, minlength=4)
        assert np.count_nonzero(counts) == kept, (top_p, counts)
        assert np.all(np.abs(counts[counts > 0] / 4000 - 1 / kept) < 0.04), (top_p, counts)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_divides_the_logits(temperature):
    """softmax(logits / temperature): p = [0.8, 0.2] becomes p_i^(1/t) renormalised (0.941 at t = 0.5, 0.667 at t = 2),
    not softmax(logits * t)."""
    p = np.array([0.8, 0.2])
    logits = jnp.log(jnp.asarray(np.tile(p, (4000, 1)), jnp.float32))
    draws = np.asarray(sample(logits, jax.random.key(0), Sampling(temperature=temperature)))
    want = p[0] ** (1 / temperature) / np.sum(p ** (1 / temperature))
    assert abs(np.mean(draws == 0) - want) < 0.03, (np.mean(draws == 0), want)


def test_a_tiny_temperature_samples_the_argmax_and_a_subnormal_one_is_refused():
    """A temperature as small as 1e-37 sends every logit but the largest to -inf (the row max subtracted first),
    rather than overflowing them all to +inf; a subnormal temperature (flushed to 0 on a device) is refused by name."""
    logits = jnp.array([[100.0, 200.0, 150.0], [3.0, -1.0, 2.0]])
    got = np.asarray(sample(logits, jax.random.key(0), Sampling(temperature=1e-37)))
    np.testing.assert_array_equal(got, [1, 0])
    with pytest.raises(ValueError, match=r"temperature=1e-40: expected 0 \(greedy\) or at least 1.18e-38"):
        Sampling(temperature=1e-40)


def test_each_decode_step_samples_with_a_fresh_key(params):
    """The loop splits its key every step: at a high temperature (near-uniform over 128 ids) 32 sampled tokens are
    mostly distinct; one key reused every step draws the same Gumbel noise and repeats the same few ids."""
    tokens, lengths = jnp.asarray([[5, 6, 7, 8]], jnp.int32), jnp.asarray([4], jnp.int32)
    out, num = generate_tokens(params, DENSE, tokens, lengths, jax.random.key(1), cfg=CFG, max_new_tokens=32,
                               capacity=64, sampling=Sampling(temperature=100.0))
    assert int(num[0]) == 32
    assert len(set(np.asarray(out[0]).tolist())) > 16, np.asarray(out[0])


def test_a_garbage_prefill_row_generates_and_counts_nothing(params):
    """A row of length 0 (traced, not checked) has NaN prefill logits: it gets no token and num 0, while the other row
    generates as it does alone."""
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 4, CFG.vocab_size)
    kw = dict(cfg=CFG, max_new_tokens=5, capacity=64)
    out, num = generate_tokens(params, DENSE, tokens, jnp.asarray([8, 0]), jax.random.key(0), **kw)
    alone, alone_num = generate_tokens(params, DENSE, tokens[:1], jnp.asarray([8]), jax.random.key(0), **kw)
    np.testing.assert_array_equal(num, [int(alone_num[0]), 0])
    np.testing.assert_array_equal(out[0], alone[0])
    assert np.all(np.asarray(out[1]) == -1)


def test_check_request_refuses_more_verification_rows_than_the_context():
    with pytest.raises(ValueError, match=r"gamma \+ 1 = 300 verification rows in one forward: expected at most the "
                                         "model's context of 256"):
        check_request(CFG, [5], 4, verify_rows=300)
    assert check_request(CFG, [5], 4, verify_rows=256) == 384  # the context itself is allowed


def test_prefill_into_a_cache_of_another_dtype_stores_k_and_v_rounded_to_it(params):
    """init_cache's default dtype is bf16: f32 params prefilled into a bf16 cache store each layer's k and v rounded
    to bf16, exactly the f32 cache's values cast to bf16 (prefill attends to k and v, not the cache, so nothing
    else changes), and the last-token logits equal the f32 cache's."""
    tokens = jax.random.randint(jax.random.key(5), (2, 9), 0, CFG.vocab_size)
    lengths = jnp.array([9, 6])
    ref_logits, ref, _ = llama.prefill(params, CFG, DENSE, tokens, lengths, init_cache(CFG, 2, 16, jnp.float32), None)
    logits, cache, _ = llama.prefill(params, CFG, DENSE, tokens, lengths, init_cache(CFG, 2, 16), None)
    assert cache.k.dtype == cache.v.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(cache.k, np.float32), np.asarray(ref.k.astype(jnp.bfloat16), np.float32))
    np.testing.assert_array_equal(np.asarray(cache.v, np.float32), np.asarray(ref.v.astype(jnp.bfloat16), np.float32))
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(ref_logits))


def test_gemm_row_padding_on_a_gpu_pads_bf16_and_f16_only_and_never_a_single_row(monkeypatch):
    """`llama.gemm_row_padding` as its docstring defines it on a GPU host (the backend faked: the function only asks
    which it is): rows up to the next multiple of 8 for bf16 / f16, none for one row (a GEMV), a multiple of 8 or
    another dtype."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for dtype in (jnp.bfloat16, jnp.float16):
        assert [llama.gemm_row_padding(r, dtype) for r in (1, 2, 3, 8, 15, 16, 39)] == [0, 6, 5, 0, 1, 0, 1]
    assert [llama.gemm_row_padding(r, jnp.float32) for r in (1, 2, 15)] == [0, 0, 0]


@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_pads_a_single_bf16_row_to_a_gemm_on_a_gpu(params, monkeypatch, tied):
    """`llama.lm_logits` of one bf16 row on a GPU host (the backend faked: the padding only asks which it is) runs its
    dot on 8 rows, the row and 7 of zeros (`lm_head_row_padding`: XLA would convert the whole weight to f32 for a
    one-row product), and returns the logits of the unpadded dot (to f32 rounding); two rows, f32 and other backends
    are not padded."""
    p = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), params)
    if tied:
        p = dataclasses.replace(p, lm_head=None)
    x = jax.random.normal(jax.random.key(5), (1, 1, CFG.hidden_size), jnp.bfloat16)

    def dot_rows(x):
        eqns = jax.make_jaxpr(lambda x: llama.lm_logits(CFG, p, x))(x).jaxpr.eqns
        return [e.invars[0].aval.shape[:2] for e in eqns if e.primitive.name == "dot_general"]

    assert llama.lm_head_row_padding(1, jnp.bfloat16) == (7 if jax.default_backend() == "gpu" else 0)
    with monkeypatch.context() as m:  # the unpadded product, whatever the backend
        m.setattr(llama, "lm_head_row_padding", lambda rows, dtype: 0)
        want = llama.lm_logits(CFG, p, x)
        assert dot_rows(x) == [(1, 1)]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert [llama.lm_head_row_padding(r, jnp.bfloat16) for r in (1, 2, 8)] == [7, 0, 0]
    assert llama.lm_head_row_padding(1, jnp.float16) == 7 and llama.lm_head_row_padding(1, jnp.float32) == 0
    got = llama.lm_logits(CFG, p, x)
    assert got.shape == (1, 1, CFG.vocab_size) and got.dtype == jnp.float32
    # the same products in f32, summed in another order by the CPU's matrix-matrix and matrix-vector paths
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert dot_rows(x) == [(1, 8)]
    x2 = jnp.concatenate([x, x], axis=0)  # two rows: XLA's own GEMM path, left alone
    assert dot_rows(x2) == [(2, 1)]

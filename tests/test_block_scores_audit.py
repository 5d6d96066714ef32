"""Gaps a mutation audit of `pallas_kernels.block_scores.gpu` found (Pallas Triton kernels in interpret mode): the
block-max kernel's layer index wrapped (negative layers) and its last visible token clamped to the cache (positions
and middle ranges past the cache read no key row past N), and the rank kernel's `count_less_ret` counting a
retrieval entry of block 0 among the set's valid entries."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.block_scores import gpu, reference, xla
from pallas_bounds import checked_memory

L, B, HQ, HKV, D, BS = 3, 2, 8, 2, 16, 8
N = 200  # 25 blocks of 8: with 16 blocks a program, the second program holds 9 blocks and 7 lanes past the row


def _block_max_case(seed):
    ks = jax.random.split(jax.random.key(seed), 2)
    q = jax.random.normal(ks[0], (B, 1, HQ, D))
    k = jax.random.normal(ks[1], (L, B, HKV, N, D))
    kvh = jnp.array([1, 0], jnp.int32)
    hm = jnp.array([[True, False, True, True], [False, True, False, False]])
    return q, k, kvh, hm


@pytest.mark.parametrize("layer", [-1, -2])
def test_block_max_kernel_wraps_a_negative_layer(layer):
    """A negative layer reads layer L + layer of the stacked keys (as `k_all[layer]`, the reference's contract): the
    kernel's loads stay inside its K block (`checked_memory`: the interpreter would wrap a raw negative index as
    numpy does, where a GPU's pointer offset reads memory before the block, so the in-kernel wrap is checked
    there), it equals the reference and the call on that layer's keys alone (layer 0 of a one-layer view), and
    the layer's scores differ from layer 0's."""
    q, k, kvh, hm = _block_max_case(41)
    pos = jnp.array([[199], [120]], jnp.int32)
    lo, hi = jnp.array([[1], [0]], jnp.int32), jnp.array([[24], [25]], jnp.int32)
    cfg = gpu.BlockMaxConfig(blocks_per_program=16)
    args = (q, k, jnp.int32(layer), kvh, hm, pos, lo, hi)
    want = reference.block_max_scores_reference(*args, block_size=BS)
    with checked_memory():
        got = gpu.block_max_scores_gpu.__wrapped__(*args, block_size=BS, interpret=True, config=cfg)  # unjitted
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    alone = gpu.block_max_scores_gpu(q, k[layer % L][None], jnp.int32(0), kvh, hm, pos, lo, hi, block_size=BS,
                                     interpret=True, config=cfg)
    np.testing.assert_allclose(got, alone, rtol=1e-5, atol=1e-5)
    first = reference.block_max_scores_reference(q, k, jnp.int32(0), kvh, hm, pos, lo, hi, block_size=BS)
    assert not np.allclose(np.asarray(first), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_block_max_kernel_reads_no_key_past_the_cache():
    """Positions at and past the cache's end (N - 1, N + 50) with middle ranges past the last block (hi = 32 > nb =
    25; the values are masked, not trusted): the kernel's loads stay inside its K block (`checked_memory`: the last
    program's 7 lanes past the row must not read rows >= N, which the clamp of the last visible token to N - 1
    keeps out), and the scores equal the reference's (every block of the row in [lo, nb) scored)."""
    q, k, kvh, hm = _block_max_case(43)
    pos = jnp.array([[N + 50], [N - 1]], jnp.int32)
    lo, hi = jnp.array([[3], [0]], jnp.int32), jnp.array([[32], [40]], jnp.int32)
    args = (q, k, jnp.int32(1), kvh, hm, pos, lo, hi)
    want = reference.block_max_scores_reference(*args, block_size=BS)
    np.testing.assert_array_equal(np.isfinite(np.asarray(want)).sum(-1), [[25 - 3], [25]])
    with checked_memory():
        got = gpu.block_max_scores_gpu.__wrapped__(*args, block_size=BS, interpret=True,  # unjitted: traced here
                                                   config=gpu.BlockMaxConfig(blocks_per_program=16))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_plan_with_count_less_ret_counts_a_retrieval_block_zero():
    """`select_from_plan_gpu` with count_less_ret subtracts every valid entry of the retrieval set (ret >= 0), block
    0 included: row 0 has no sink and block 0 in its set's middle, row 1 has block 0 in its sink. The blocks equal
    `select_from_candidates_xla` given the subtracted count, and differ from those of a count one larger in both
    rows (so an entry of value 0 left out of the subtraction shows)."""
    from pallas_kernels.block_scores.xla import heat_candidates, select_from_candidates_xla
    rng = np.random.default_rng(44)
    n_s, hi, nbv = np.array([0, 3]), np.array([30, 30]), np.array([36, 40])
    ret = jnp.asarray(np.array([[0, 7, 12, 20, -1], [0, 3, 9, 29, 33]], np.int32))
    heat = jnp.asarray(np.round(rng.random((2, 2, 40)) * 4).astype(np.float32) / 4)
    count, full = jnp.asarray([3, 2]), jnp.zeros(2, bool)
    n_s, hi, nbv = (jnp.asarray(x) for x in (n_s, hi, nbv))
    kw = dict(num_kv_heads=2, width=24, heat_width=6)
    n_mid = jnp.sum((ret >= n_s[:, None]) & (ret < hi[:, None]), axis=-1)
    cand = heat_candidates(heat, n_s, hi, jnp.minimum(count + 1, 6) + n_mid + 2, width=16)
    want = np.asarray(select_from_candidates_xla(heat, cand, ret, n_s, hi, nbv, count, full, **kw))
    one_more = np.asarray(select_from_candidates_xla(heat, cand, ret, n_s, hi, nbv, count + 1, full, **kw))
    assert all(not np.array_equal(one_more[b], want[b]) for b in range(2))
    before = count + jnp.sum(ret >= 0, axis=-1)  # [7, 6]: the count before the set, as the plan holds it
    plan = gpu.make_plan(n_s, hi, nbv, before, full)
    got = np.asarray(gpu.select_from_plan_gpu(heat, cand, ret, plan, count_less_ret=True, interpret=True, **kw))
    np.testing.assert_array_equal(got, want)

"""The GPU top-k selection paths "row" (single launch), "fused" (no XLA glue) and "sample" (a sampled bracket,
with its streaming fallback) in interpret mode against the reference, on adversarial rows (ties, -0.0, -inf, NaNs of every payload, k = 0 and k above the valid count),
their dispatch and config errors, and their CUDA lowerings (launch counts)."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.topk_select import gpu, gpu_row, topk_select_reference
from pallas_kernels.topk_select.common import float_keys
from pallas_kernels.topk_select.testing import adversarial, kascade_like_rows
from lowering import H100, abstract_device
from pallas_bounds import checked_memory

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def row_k(rng, R: int, K: int) -> np.ndarray:
    k = rng.integers(-2, K + 3, R).astype(np.int32)  # below 0 and above K included
    k[:3] = [0, K, K + 5]
    return k


def _check(fn, rng, R, N, K, trials=2):
    for _ in range(trials):
        x = adversarial(rng, R, N)
        rng.shuffle(x)  # the row kinds meet different k
        k = row_k(rng, R, min(K, N))
        want = np.asarray(topk_select_reference(jnp.asarray(x), jnp.asarray(k), K))
        got = np.asarray(fn(jnp.asarray(x), jnp.asarray(k)))
        assert got.shape == want.shape and np.array_equal(got, want), (N, K, k, np.nonzero(got != want))


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_row_kernel_matches_reference(bits):
    rng = np.random.default_rng(bits)
    config = gpu.SelectConfig(path="row", row_bits=bits)
    R, N, K = 12, 300, 40  # N: padded to 512 in the program
    fn = jax.jit(lambda x, k: gpu.topk_select_gpu(x, k, K, config=config, interpret=True))
    _check(fn, rng, R, N, K)


def test_row_kernel_odd_shapes():
    # K > N (width N: every valid score is chosen for large k), N = 1, leading dims with a broadcast k.
    rng = np.random.default_rng(11)
    fn = jax.jit(lambda x, k: gpu.topk_select_gpu(x, k, 50, interpret=True))
    _check(fn, rng, 6, 33, 50, trials=1)
    x = jnp.asarray(adversarial(rng, 6, 1)).reshape(2, 3, 1)
    k = jnp.array([[1], [0]], jnp.int32)
    got = gpu.topk_select_gpu(x, k, 4, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(topk_select_reference(x, k, 4)))


@pytest.mark.parametrize("config", [
    gpu.SelectConfig(path="fused", bits_per_pass=4, block_n=64, compact_block_n=32, target_programs=40),
    gpu.SelectConfig(path="fused", bits_per_pass=8, block_n=32, compact_block_n=128, target_programs=1),
])
def test_fused_matches_reference(config):
    rng = np.random.default_rng(config.bits_per_pass)
    R, N, K = 7, 300, 40  # splits of 64 / 32 scores, the last one partial (and empty splits at 4 bits)
    fn = jax.jit(lambda x, k: gpu.topk_select_gpu(x, k, K, config=config, interpret=True))
    _check(fn, rng, R, N, K)


SAMPLE = dict(path="sample", sample_size=256, band_cap=512, compact_block_n=128, target_programs=24)


# cap 32: every band overflows, so every row takes the fallback; target_programs 1: one split per row (the band
# counted in a register, `gpu_sample._band_kernel(whole_row=True)`), 24: two splits sharing each row's band.
@pytest.mark.parametrize("cap,programs", [(512, 24), (32, 24), (512, 1), (32, 1)])
def test_sample_matches_reference(cap, programs):
    rng = np.random.default_rng(cap + programs)
    config = gpu.SelectConfig(**{**SAMPLE, "band_cap": cap, "target_programs": programs})
    R, N, K = 12, 2048, 300
    fn = jax.jit(lambda x, k: gpu.topk_select_gpu(x, k, K, config=config, interpret=True))
    _check(fn, rng, R, N, K)
    x = rng.standard_normal((R, N)).astype(np.float32)  # continuous rows, k from 0 to K
    k = np.linspace(0, K, R).astype(np.int32)
    want = np.asarray(topk_select_reference(jnp.asarray(x), jnp.asarray(k), K))
    np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(x), jnp.asarray(k))), want)


ORDERED = dict(path="ordered", sample_size=256, compact_block_n=128)


@pytest.mark.parametrize("cap", [None, 32])  # 32: every band with more than 32 keys overflows (the stream)
def test_ordered_matches_reference(cap):
    """The ordered-band path: adversarial rows (ties, specials, all equal: t at the bound, so the row streams),
    k from below 0 to above K, and continuous rows at every k from 0 to K (the band decides)."""
    rng = np.random.default_rng(7 if cap is None else cap)
    config = gpu.SelectConfig(**ORDERED, ordered_cap=cap)
    R, N, K = 12, 2048, 300
    fn = jax.jit(lambda x, k: gpu.topk_select_gpu(x, k, K, config=config, interpret=True))
    _check(fn, rng, R, N, K)
    x = rng.standard_normal((R, N)).astype(np.float32)
    k = np.linspace(0, K, R).astype(np.int32)
    want = np.asarray(topk_select_reference(jnp.asarray(x), jnp.asarray(k), K))
    np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(x), jnp.asarray(k))), want)


@pytest.mark.parametrize("config", [dict(path="row"), dict(ORDERED), dict(ORDERED, ordered_cap=32),
                                    dict(SAMPLE), dict(path="fused", target_programs=24)],
                         ids=["row", "ordered", "ordered_stream", "sample", "fused"])
def test_span_chooses_as_the_masked_scores(config):
    """`span=(lo, hi)`: exactly the selection of the scores with every position outside [lo, hi) set to -inf, on
    adversarial and continuous rows, spans empty, whole, inside and past the row. The "row", "ordered" and "sample"
    kernels (and the ordered path's streaming fallback, cap 32) read the scores in place; "fused" masks a copy."""
    from pallas_kernels.topk_select.common import mask_span

    rng = np.random.default_rng(11)
    R, N, K = 12, 2048, 300
    x = adversarial(rng, R, N)
    x[R // 2:] = rng.standard_normal((R - R // 2, N)).astype(np.float32)
    k = row_k(rng, R, K)
    lo = rng.integers(0, N // 2, R).astype(np.int32)
    hi = (lo + rng.integers(0, N, R)).astype(np.int32)  # past N in some rows
    lo[:3], hi[:3] = [0, 5, 0], [N, 5, 40]  # whole, empty, short
    span = (jnp.asarray(lo), jnp.asarray(hi))
    want = np.asarray(topk_select_reference(mask_span(jnp.asarray(x), span), jnp.asarray(k), K))
    cfg = gpu.SelectConfig(**config)
    got = gpu.topk_select_gpu(jnp.asarray(x), jnp.asarray(k), K, span=span, config=cfg, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), want)
    # Leading dims and a span broadcast over them: rows [2, 6], lo / hi per leading row.
    x3, k3 = jnp.asarray(x).reshape(2, 6, N), jnp.asarray(k).reshape(2, 6)
    span3 = (jnp.asarray(lo[:2])[:, None], jnp.asarray(hi[:2])[:, None])
    want3 = topk_select_reference(mask_span(x3, span3), k3, K)
    got3 = gpu.topk_select_gpu(x3, k3, K, span=span3, config=cfg, interpret=True)
    np.testing.assert_array_equal(np.asarray(got3), np.asarray(want3))


@pytest.mark.parametrize("config", [dict(path="row"), dict(ORDERED), dict(SAMPLE)], ids=["row", "ordered", "sample"])
def test_span_with_k_near_the_row(config):
    """k at or near N with a short span: the sampled bound falls to the lowest key, so every position enters the
    ordered band; the selection must still be the span's alone (the ordered path chose positions outside it before
    the select kernel masked the band's scores to the span), also on rows of -NaN scores."""
    from pallas_kernels.topk_select.common import mask_span

    rng = np.random.default_rng(13)
    R, N = 4, 2048
    x = rng.standard_normal((R, N)).astype(np.float32)
    x[3, ::3] = -np.nan
    lo, hi = np.array([0, 1000, 7, 0], np.int32), np.array([100, 1010, 1900, 2048], np.int32)
    span = (jnp.asarray(lo), jnp.asarray(hi))
    for K, k in [(N, [N] * R), (N, [N, 1843, 1900, 2000]), (1843, [1843] * R)]:
        k = jnp.asarray(k, jnp.int32)
        want = np.asarray(topk_select_reference(mask_span(jnp.asarray(x), span), k, K))
        got = np.asarray(gpu.topk_select_gpu(jnp.asarray(x), k, K, span=span, config=gpu.SelectConfig(**config),
                                             interpret=True))
        np.testing.assert_array_equal(got, want)
        picked = got >= 0
        assert not (picked & ((got < lo[:, None]) | (got >= hi[:, None]))).any()


def test_ordered_band_capacity_is_capped():
    """An explicit "ordered" path with K past 32K sizes its band at the kernels' limit (a row whose band overflows it
    streams) instead of failing on a capacity the caller never chose."""
    from pallas_kernels.topk_select import gpu_ordered
    from pallas_kernels.topk_select.gpu_row import ROW_LIMIT

    assert gpu_ordered.band_capacity(65536, 131072, 4096, 4.0) == ROW_LIMIT
    assert gpu_ordered.band_capacity(2080, 131072, 4096, 4.0) < ROW_LIMIT


def test_span_on_every_implementation_and_its_errors():
    """The entry point takes a span on every implementation (the reference, "xla"): the masked scores' selection;
    a span that is not a pair names what it got."""
    from pallas_kernels.topk_select import topk_select
    from pallas_kernels.topk_select.common import mask_span

    rng = np.random.default_rng(12)
    x = jnp.asarray(rng.standard_normal((3, 4, 500)).astype(np.float32))
    k = jnp.asarray(rng.integers(0, 60, (3, 4)).astype(np.int32))
    span = (jnp.asarray([0, 100, 250])[:, None], jnp.asarray([500, 300, 260])[:, None])
    want = np.asarray(topk_select_reference(mask_span(x, span), k, 50))
    for impl in ("top_k", "xla"):
        np.testing.assert_array_equal(np.asarray(topk_select(x, k, 50, span=span, implementation=impl)), want)
    assert (np.asarray(want)[2] < 260).all() and ((np.asarray(want)[1] >= 100) | (np.asarray(want)[1] < 0)).all()
    with pytest.raises(ValueError, match=r"span: got an array of shape \(3, 4\); expected a pair \(lo, hi\)"):
        topk_select(x, k, 50, span=jnp.zeros((3, 4)), implementation="top_k")


def test_ordered_errors_name_the_value():
    from pallas_kernels.topk_select import gpu_ordered

    x, k = jnp.zeros((2, 4096), jnp.float32), jnp.ones((2,), jnp.int32)
    for bad, match in [(dict(cap=100), "cap=100: expected a power of two"), (dict(sample=8192), "N=4096 scores"),
                       (dict(block_n=48), "block_n=48")]:
        with pytest.raises(ValueError, match=match):
            gpu_ordered.topk_select_ordered(x, k, 8, **{"sample": 1024, **bad}, interpret=True)


def test_ordered_band_holds_the_threshold_on_continuous_rows():
    """White box: on continuous scores the band above the sampled bound holds every key >= the threshold and
    fits its capacity (so the in-register selection decides, not the stream), in ascending position order; on
    Kascade-like rows (~N / 256 ties per value) every row is exact."""
    from pallas_kernels.topk_select import gpu_ordered
    from pallas_kernels.topk_select.gpu_sample import sample_bracket

    rng = np.random.default_rng(4)
    R, N, K = 8, 8192, 600
    x = jnp.asarray(rng.standard_normal((R, N)).astype(np.float32))
    k = jnp.asarray([1, 10, 100, 300, 409, 500, 600, 2], jnp.int32)
    cap = gpu_ordered.band_capacity(K, N, 1024, 4.0)
    bound = sample_bracket(x, k[:, None], K, sample=1024, sigmas=4.0, bits=2, upper=False, interpret=True)
    b = np.asarray(bound)[:, 1]
    keys = np.asarray(float_keys(x))
    n_above = (keys > b[:, None]).sum(axis=1)
    assert (np.asarray(k) <= n_above).all() and (n_above <= cap).all(), (n_above, cap)
    got = gpu.topk_select_gpu(x, k, K, interpret=True, config=gpu.SelectConfig(path="ordered", sample_size=1024))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(topk_select_reference(x, k, K)))
    skip = gpu_ordered.topk_select_ordered(x, k, K, sample=1024, block_n=256, skip_empty=True, interpret=True)
    np.testing.assert_array_equal(np.asarray(skip), np.asarray(got))  # chunks without band keys skipped
    xk, kk = kascade_like_rows(rng, 6, context=12500, capacity=12544)
    Kk = int(kk.max())
    got = gpu.topk_select_gpu(jnp.asarray(xk), jnp.asarray(kk), Kk, interpret=True,
                              config=gpu.SelectConfig(path="ordered", sample_size=1024))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(topk_select_reference(jnp.asarray(xk), jnp.asarray(kk), Kk)))


def _sample_resolution(x, k, K, *, sample, cap):
    """White box: how `gpu_sample`'s resolve kernel decides each row: 'a' (t is the bracket's A), 'band' (the
    in-register search over the band), 'b' (t is B) or 'fallback' (the streaming search over the row)."""
    from pallas_kernels.topk_select import gpu_sample
    _, counts, n_band, _ = gpu_sample.sample_band(
        jnp.asarray(x), jnp.asarray(k)[:, None], K, sample=sample, sigmas=4.0, cap=cap, bits=2, block_n=128,
        target_programs=24, params=None, interpret=True)
    c, nb = np.asarray(counts).sum(1), np.asarray(n_band)[:, 0]
    kk = np.clip(k, 0, K)
    gt_a, ge_a = c[:, 0], c[:, 0] + c[:, 1]
    ge_b = ge_a + nb + c[:, 2]
    return np.where((gt_a < kk) & (kk <= ge_a), "a", np.where(
        (ge_a < kk) & (kk <= ge_a + nb) & (nb <= cap), "band",
        np.where((ge_a + nb < kk) & (kk <= ge_b), "b", "fallback"))), nb


def _sample_exact(x, k, K, **config):
    """The "sample" path equals the reference with splits sharing each row and with one program per row (its tie
    quota from the resolve kernel's counts in each of the decisions 'a', 'band', 'b', no rule-count launch)."""
    want = np.asarray(topk_select_reference(jnp.asarray(x), jnp.asarray(k), K))
    for programs in (SAMPLE["target_programs"], 1):
        got = gpu.topk_select_gpu(jnp.asarray(x), jnp.asarray(k), K, interpret=True,
                                  config=gpu.SelectConfig(**{**SAMPLE, "target_programs": programs, **config}))
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"target_programs={programs}")


def test_sample_bracket_holds_on_continuous_and_periodic_rows():
    """White box: on continuous scores the sampled bracket holds the threshold and the band fits, so the exact
    in-register search (not the fallback) decides; so it does on a periodic row whose period divides a fixed
    stride (the sample's hashed offsets do not alias with it)."""
    rng = np.random.default_rng(3)
    R, N, K = 8, 8192, 600
    x = rng.standard_normal((R, N)).astype(np.float32)
    x[-1] = np.where(np.arange(N) % 8 == 0, 5.0, rng.random(N)).astype(np.float32)  # stride 8 would see only 5.0
    k = np.array([1, 10, 100, 300, 409, 500, 600, 300], np.int32)
    how, nb = _sample_resolution(x, k, K, sample=1024, cap=2048)
    assert (how[:-1] == "band").all() and how[-1] == "a", (how, nb)  # the last: t = 5.0, tied 1024 times
    assert (nb < N // 8).all()  # the band is a small part of the row
    _sample_exact(x, k, K, sample_size=1024, band_cap=2048)


def test_sample_resolves_kascade_like_rows_without_fallback():
    """Rows of ~N / 256 exact ties per value (Kascade's anchor scores in the decode benchmark, at 1/8 of its
    100K context): every row is resolved from the bracket, and the selection is exactly the reference's. A
    sample at the fixed stride 12 sees 64 of the 256 values; with it most such rows took the fallback."""
    rng = np.random.default_rng(24)
    x, k = kascade_like_rows(rng, 8, context=12500, capacity=12544)
    K = int(k.max())
    how, _ = _sample_resolution(x, k, K, sample=1024, cap=2048)
    assert (how != "fallback").all(), how
    _sample_exact(x, k, K, sample_size=1024, band_cap=2048)


def test_sample_band_taken_whole_keeps_nothing_at_or_below_b():
    """k takes every band key and no more (kk = #(key > B)): the band's search is done at its start, below B, and
    the row's rule must still be the keys > B. Rows of 3000 ties at 5.0 (the bracket's A), 20 distinct scores (the
    band) and 1.0 everywhere else (B): before the fix this row kept every position (all 4000 slots filled)."""
    rng = np.random.default_rng(3)
    N, K = 8192, 4000
    x = np.full((5, N), 1.0, np.float32)
    for r in range(5):
        p = rng.permutation(N)
        x[r, p[:3000]] = 5.0
        x[r, p[3000:3020]] = rng.uniform(1.5, 4.5, 20)
    k = np.array([3020, 3010, 3001, 3000, 3021], np.int32)  # the whole band, most, one key; every A; one B more
    how, nb = _sample_resolution(x, k, K, sample=1024, cap=2048)
    assert list(how) == ["band"] * 3 + ["a", "b"] and (nb == 20).all(), (how, nb)
    _sample_exact(x, k, K, sample_size=1024, band_cap=2048)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_row_threshold_start_and_pair_match_the_plain_search(bits):
    """`gpu_row.row_threshold` started from `common_prefix_start` of bounds that hold every key gives the plain
    search's count, done and choice (t itself when not done), in fewer passes; `row_threshold_pair` gives the two
    plain searches' thresholds. Keys of continuous, narrow (a shared exponent), tied and sign-crossing rows, k from
    0 to n, padding INT_MIN."""
    from pallas_kernels.topk_select.common import INT_MIN
    rng = np.random.default_rng(bits)
    P = 256
    rows = [rng.standard_normal(200), 1.0 + rng.random(200) * 1e-3, rng.integers(0, 4, 200).astype(float),
            rng.standard_normal(200) * 1e-30, np.full(200, 2.5)]
    plain = jax.jit(functools.partial(gpu_row.row_threshold, bits=bits))
    started = jax.jit(lambda key, kk, n, lower, upper: gpu_row.row_threshold(
        key, kk, n, bits, start=gpu_row.common_prefix_start(lower, upper, bits)))
    pair = jax.jit(functools.partial(gpu_row.row_threshold_pair, bits=bits))
    passes_saved = 0
    for row in rows:
        n = len(row)
        key = np.full(P, INT_MIN, np.int32)
        key[:n] = np.asarray(float_keys(jnp.asarray(row, jnp.float32)))
        lower, upper = key[:n].min(), key[:n].max()
        _, p0 = gpu_row.common_prefix_start(jnp.int32(lower), jnp.int32(upper), bits)
        passes_saved += int(p0)
        for kk in (0, 1, 7, n // 2, n - 1, n):
            want = plain(jnp.asarray(key), jnp.int32(kk), n)
            got = started(jnp.asarray(key), jnp.int32(kk), n, jnp.int32(lower), jnp.int32(upper))
            assert (int(got[1]), bool(got[2])) == (int(want[1]), bool(want[2])), (bits, kk, got, want)
            if bool(want[2]):  # done: the same keys chosen (lo itself may differ below the smallest one chosen)
                np.testing.assert_array_equal(key[:n] >= int(got[0]), key[:n] >= int(want[0]))
            else:  # lo = t, the kk-th largest key
                assert int(got[0]) == int(want[0]), (bits, kk, got, want)
        for k1, k2 in ((1, n // 2), (n // 3, n), (0, 5), (n, n)):
            lo1, lo2 = pair(jnp.asarray(key), jnp.int32(k1), jnp.int32(k2), n)
            assert (int(lo1), int(lo2)) == (int(plain(jnp.asarray(key), jnp.int32(k1), n)[0]),
                                            int(plain(jnp.asarray(key), jnp.int32(k2), n)[0])), (bits, k1, k2)
    assert passes_saved >= 24 // bits  # the narrow, tied and constant rows share long prefixes


def test_sample_band_capacity_fits_the_band_it_sizes():
    """The "sample" path's default capacity (`gpu_sample.band_capacity`, band_cap=None) holds the band of
    continuous and pooled-like rows at every k <= K (no row takes the fallback), is not loose by more than 4x at
    k = K, and is 4096 for Kascade's anchors at 100K, budget 0.1 (the capacity the resolve kernel searches)."""
    from pallas_kernels.topk_select.gpu_sample import band_capacity

    assert band_capacity(9991, 100096, 8192, 4.0) == 4096
    assert band_capacity(100096, 100096, 8192, 4.0) == band_capacity(50048, 100096, 8192, 4.0)  # widest at k = N/2
    assert band_capacity(100, 10**6, 8192, 4.0) >= 1024 and band_capacity(10**6, 10**7, 8192, 4.0) == 32768
    rng = np.random.default_rng(9)
    R, N, K, S = 6, 16384, 1638, 512
    cap = band_capacity(K, N, S, 4.0)
    x = rng.standard_normal((R, N)).astype(np.float32)
    x[R // 2:] = np.exp(2.0 * x[R // 2:]) / N  # pooled-like: heavy right tail
    k = np.array([K, K, 700, K, 1200, 130], np.int32)
    how, nb = _sample_resolution(x, k, K, sample=S, cap=cap)
    assert (how != "fallback").all() and (nb <= cap).all(), (how, nb, cap)
    assert nb[k == K].min() > cap // 4, (nb, cap)
    got = gpu.topk_select_gpu(jnp.asarray(x), jnp.asarray(k), K, interpret=True,
                              config=gpu.SelectConfig(**{**SAMPLE, "sample_size": S, "band_cap": None}))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(topk_select_reference(jnp.asarray(x), jnp.asarray(k), K)))


def test_sample_ties_at_the_bracket_ends_do_not_fill_the_band():
    """The threshold inside a tie group far larger than the band's capacity, at either end of the bracket: the
    group is counted, not stored, so the row resolves without the fallback (cap 64 here)."""
    rng = np.random.default_rng(5)
    N = 4096
    x = np.zeros((4, N), np.float32)
    x[0] = np.where(rng.random(N) < 0.7, 0.0, rng.random(N) + 1.0)  # ~1200 values above ~2900 zeros
    x[1] = x[0]
    x[2] = np.where(rng.random(N) < 0.6, 0.25, rng.standard_normal(N))  # a tie group in the middle
    x[3] = 0.75  # all equal
    k = np.array([1600, 3000, 2000, 700], np.int32)
    K = 3000
    how, nb = _sample_resolution(x, k, K, sample=512, cap=64)
    assert set(how) <= {"a", "b"} and "fallback" not in how, (how, nb)
    assert (nb <= 64).all(), nb
    _sample_exact(x, k, K, sample_size=512, band_cap=64)


# Negative rows, N = 1000 not a multiple of any chunk (64, 128) nor of the row program's 1024 lanes.
TAIL_CONFIGS = [dict(path="row"), dict(path="fused", block_n=64, compact_block_n=128, target_programs=24),
                dict(path="passes", block_n=64, compact_block_n=128, target_programs=24),
                dict(SAMPLE, band_cap=32), dict(ORDERED, ordered_cap=32)]


@pytest.mark.parametrize("config", TAIL_CONFIGS, ids=["row", "fused", "passes", "sample_fallback", "ordered_stream"])
def test_masked_tail_is_never_counted(config):
    """Every score below +0.0, the value a masked load gives past the row's end: the positions past N (the last
    chunk's tail, the row program's padding) are never counted, so the threshold is the row's own (the streaming
    fallbacks of "sample" and "ordered" included, cap 32)."""
    rng = np.random.default_rng(17)
    R, N, K = 6, 1000, 300
    x = -(np.abs(rng.standard_normal((R, N))) + 0.5).astype(np.float32)
    x[1] = -rng.integers(1, 5, N).astype(np.float32) / 2  # negative ties
    x[2] = -0.0  # just below +0.0
    x[3, rng.random(N) < 0.3] = -np.inf
    k = np.array([1, 10, 100, 300, 250, 37], np.int32)
    want = np.asarray(topk_select_reference(jnp.asarray(x), jnp.asarray(k), K))
    got = gpu.topk_select_gpu(jnp.asarray(x), jnp.asarray(k), K, config=gpu.SelectConfig(**config), interpret=True)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("config", TAIL_CONFIGS + [dict(SAMPLE, target_programs=1)],
                         ids=["row", "fused", "passes", "sample_fallback", "ordered_stream", "sample_whole_rows"])
def test_nan_above_the_threshold_takes_no_tie_quota(config):
    """A few +NaNs above a tie group: they are ranked (they use up k) but never output, so the ties taken are
    k - (keys above the ties, NaNs included), not k - (outputs above them)."""
    rng = np.random.default_rng(19)
    R, N, K = 4, 1000, 300
    nan = np.array([0x7FC00000, 0x7FFFFFFF, 0x7F800001], np.uint32).view(np.float32)
    x = rng.standard_normal((R, N)).astype(np.float32) - 3.0
    x[:, rng.random(N) < 0.4] = 1.0  # the tie group, about 400 positions
    for r in range(R):
        x[r, rng.choice(N, 3 + r, replace=False)] = nan[rng.integers(0, 3, 3 + r)]
    x[3, :20] = np.inf  # output above the ties, beside the NaNs
    k = np.array([5, 40, 300, 40], np.int32)
    want = np.asarray(topk_select_reference(jnp.asarray(x), jnp.asarray(k), K))
    assert ((want >= 0).sum(axis=1) < k).all()  # the NaNs took ranks and no slot
    got = gpu.topk_select_gpu(jnp.asarray(x), jnp.asarray(k), K, config=gpu.SelectConfig(**config), interpret=True)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("path", ["sample", "ordered"])
def test_sample_of_one_tie_group_the_row_mostly_lacks(path):
    """Every sampled position holds 1.0 and no other position does: the bracket (A = B = 1.0, or the ordered
    bound B = 1.0) lies above the threshold for k past the 256 ones, and its tie group must not be counted twice
    (as == A and == B, or in the band and == B), so such rows take the exact fallback."""
    from pallas_kernels.topk_select.gpu_sample import sample_positions

    rng = np.random.default_rng(23)
    R, N, K = 5, 2048, 400
    x = (rng.standard_normal((R, N)) * 0.1 - 1.0).astype(np.float32)
    x[:, np.asarray(sample_positions(N, SAMPLE["sample_size"]))] = 1.0
    k = np.array([100, 256, 257, 300, 400], np.int32)
    if path == "sample":
        _sample_exact(x, k, K)
    else:
        want = np.asarray(topk_select_reference(jnp.asarray(x), jnp.asarray(k), K))
        got = gpu.topk_select_gpu(jnp.asarray(x), jnp.asarray(k), K, config=gpu.SelectConfig(**ORDERED),
                                  interpret=True)
        np.testing.assert_array_equal(np.asarray(got), want)


def test_row_pick_mask_matches_reference():
    """`gpu_row.row_pick_mask` (the in-register top-k of `block_scores`): exactly the reference's picks among the
    candidates (non-candidates as -inf), heavy ties taken by position, k from 0 to every candidate."""
    rng = np.random.default_rng(29)
    R, P = 8, 256
    x = (rng.integers(-6, 6, (R, P)) / 4).astype(np.float32)  # ties galore
    cand = rng.random((R, P)) < 0.7
    cand[0] = True
    n = cand.sum(axis=1).astype(np.int32)
    kk = np.array([0, 1, 5, 40, 100, 150, int(n[6]), int(n[7]) - 1], np.int32)
    key = jnp.where(jnp.asarray(cand), float_keys(jnp.asarray(x)), np.int32(-2 ** 31))
    got = np.asarray(jax.vmap(lambda kr, c, k_, n_: gpu_row.row_pick_mask(kr, c, k_, n_, 2))(
        key, jnp.asarray(cand), jnp.asarray(kk), jnp.asarray(n)))
    ref = np.asarray(topk_select_reference(jnp.where(jnp.asarray(cand), jnp.asarray(x), -jnp.inf), jnp.asarray(kk), P))
    want = np.zeros((R, P), bool)
    for r in range(R):
        want[r, ref[r][ref[r] >= 0]] = True
    np.testing.assert_array_equal(got, want)


def test_sample_positions_stratified():
    from pallas_kernels.topk_select.gpu_sample import sample_positions
    for n, ns in [(8192, 8192), (100096, 8192), (12345, 1024), (2 ** 24 + 3, 32768)]:
        pos = np.asarray(sample_positions(n, ns)).astype(np.int64)
        i = np.arange(ns, dtype=np.int64)
        assert ((pos >= i * n // ns) & (pos < (i + 1) * n // ns)).all(), (n, ns)  # one per stratum, in order
    pos = np.asarray(sample_positions(100096, 8192))
    assert np.unique(pos % 256).size == 256  # every residue of a period of 256 (a stride of 12 sees 64)


def test_dispatch_and_config_errors():
    assert gpu.SelectConfig().pick_path(16384) == "row"
    assert gpu.SelectConfig().pick_path(16385) == "sample"
    assert gpu.SelectConfig(row_max=1000).pick_path(6256) == "sample"
    assert gpu.SelectConfig(row_max=1000).pick_path(1023) == "fused"  # shorter than the sample (1024 at N <= 32K)
    assert gpu.SelectConfig(row_max=1000).pick_path(2047) == "sample"
    assert gpu.SelectConfig(path="passes").pick_path(10) == "passes"
    assert gpu.SelectConfig(path="sample").pick_path(1023) == "fused"  # shorter than the sample
    assert gpu.SelectConfig(path="sample").pick_path(1024) == "sample"
    assert gpu.SelectConfig(path="ordered").pick_path(4095) == "fused"  # the "ordered" path samples 4096
    assert gpu.SelectConfig(path="ordered").pick_path(4096) == "ordered"
    set_ = gpu.SelectConfig(path="sample", sample_size=8192)  # a sample set: both paths take it
    assert (set_.pick_path(8191), set_.sample_for("sample"), set_.sample_for("ordered")) == ("fused", 8192, 8192)
    assert (gpu.SelectConfig().sample_for("sample"), gpu.SelectConfig().sample_for("ordered")) == (2048, 4096)
    # rows of at most 32K scores sample 1024 on the "sample" path (not "ordered", nor a set sample_size)
    cases = [("sample", 32768), ("sample", 32769), ("ordered", 32768)]
    assert [gpu.SelectConfig().sample_for(p, n) for p, n in cases] == [1024, 2048, 4096]
    assert set_.sample_for("sample", 1000) == 8192
    # "ordered" for many rows of a small K only (its band must fit ordered_max_cap)
    assert gpu.SelectConfig().pick_path(100000, 1536, 2080) == "ordered"
    assert gpu.SelectConfig().pick_path(100000, 96, 520) == "sample"
    assert gpu.SelectConfig().pick_path(100000, 1536, 10010) == "sample"
    assert gpu.SelectConfig().pick_path(8192, 1536, 520) == "row"
    assert gpu.SelectConfig().pick_path(8320, 1536, 520) == "ordered"  # many rows just past ordered_row_above
    assert gpu.SelectConfig().pick_path(8320, 96, 520) == "row"  # few rows: "row"
    assert gpu.SelectConfig(ordered_row_above=16384).pick_path(8320, 1536, 520) == "row"
    assert gpu.SelectConfig(ordered_row_above=100).pick_path(1000, 1536, 20) == "row"  # shorter than its sample
    x = jnp.zeros((2, 40), jnp.float32)
    for bad, match in [(dict(path="tree"), "path='tree'"), (dict(row_max=1 << 16), "row_max=65536"),
                       (dict(row_bits=3), "row_bits=3"), (dict(row_warps=6), "row_warps=6"),
                       (dict(sample_size=1000), "sample_size=1000"), (dict(band_cap=65536), "band_cap=65536"),
                       (dict(sample_sigmas=0.0), "sample_sigmas=0.0")]:
        with pytest.raises(ValueError, match=match):
            gpu.topk_select_gpu(x, 1, 4, config=gpu.SelectConfig(**bad), interpret=True)
    with pytest.raises(ValueError, match="N=40000"):
        gpu_row.topk_select_rows(jnp.zeros((1, 40000), jnp.float32), jnp.zeros((1,), jnp.int32), 8)


def test_sample_positions_offsets_span_each_stratum():
    """The hashed offset ranges over a stratum's whole width: with strata of 1 or 2 positions (n = 1.5 ns) both
    offsets of the 2-wide strata occur (not always the stratum's start, a fixed stride)."""
    from pallas_kernels.topk_select.gpu_sample import sample_positions
    n, ns = 1536, 1024
    i = np.arange(ns)
    start, end = i * n // ns, (i + 1) * n // ns
    off = np.asarray(sample_positions(n, ns)) - start
    assert set(off[end - start == 2]) == {0, 1} and (off[end - start == 1] == 0).all()


def test_auto_takes_ordered_at_exactly_its_bounds():
    """"auto" takes "ordered" from exactly `ordered_min_rows` rows and for a band of exactly `ordered_max_cap`
    ("at least this many rows whose band fits this capacity"), "sample" just below / above them."""
    from pallas_kernels.topk_select import gpu_ordered

    N, K = 100000, 2080
    cap = gpu_ordered.band_capacity(K, N, gpu.SelectConfig().sample_for("ordered"), 4.0)
    exact = gpu.SelectConfig(ordered_min_rows=512, ordered_max_cap=cap)
    assert exact.pick_path(N, 512, K) == "ordered" and exact.pick_path(N, 511, K) == "sample"
    assert gpu.SelectConfig(ordered_max_cap=cap // 2).pick_path(N, 512, K) == "sample"


# Every path in 6 rows of N = 300 scores (no multiple of any chunk: 64, 128, the row program's 512 lanes), a sample of
# 32. fused / passes: counting splits of 2 chunks of 64 (the last split partial, fused's fourth one empty), compaction
# splits of 128; band_cap 32: every band of more than 32 keys overflows (sample: the streaming fallback; ordered:
# the stream); target_programs 1: one program per row (sample's band counted in a register, `compact_rows`). The
# sample path runs with its fallback only: the same sample, band, count and compaction kernels, and the fallback's
# stream besides (the resolve kernel's in-band search reads only inside its band buffer, whatever its mask).
BOUNDS_CONFIGS = {
    "row": dict(path="row"),
    "fused": dict(path="fused", block_n=64, compact_block_n=128, target_programs=24),
    "passes": dict(path="passes", block_n=64, compact_block_n=128, target_programs=24),
    "sample_fallback": dict(path="sample", sample_size=32, band_cap=32, compact_block_n=128, target_programs=24),
    "sample_whole_rows_fallback": dict(path="sample", sample_size=32, band_cap=32, compact_block_n=128,
                                       target_programs=1),
    "ordered": dict(path="ordered", sample_size=32, compact_block_n=128),
    "ordered_stream": dict(path="ordered", sample_size=32, ordered_cap=32, compact_block_n=128),
}


@pytest.mark.parametrize("name", list(BOUNDS_CONFIGS))
def test_gpu_kernels_stay_in_their_blocks(name):
    """Every load and store of every path's kernels stays inside its block (`pallas_bounds.checked_memory`: the
    interpreter pads stray loads and drops stray stores, where a GPU reads another row's scores or overwrites its
    output): N = 300 (a partial last chunk, the row program's padded lanes), adversarial rows with k below 0, 0,
    K and above K; then K = 296 (near N: output slots up to the padded width's edge) with spans whole, empty,
    short and past the row's end (mutations: the mask of the row kernel's load, scatter or padding store, of
    `gpu_fused._chunk`'s load, of the compaction's scatter or padding store, of the sample and ordered band stores or
    of the ordered select store, dropped). The wrapper unjitted, so that it is traced under the check."""
    from pallas_kernels.topk_select.common import mask_span

    rng = np.random.default_rng(31)
    R, N = 6, 300
    config = gpu.SelectConfig(**BOUNDS_CONFIGS[name])
    x = adversarial(rng, R, N)
    x2 = np.concatenate([x[:3], rng.standard_normal((R - 3, N)).astype(np.float32)])
    lo = np.array([0, 5, 0, 200, 17, 0], np.int32)
    hi = np.array([N, 5, 40, N + 9, 290, N], np.int32)  # whole, empty, short, past the end
    cases = [(x, row_k(rng, R, 40), 40, None), (x2, np.array([296, 290, 0, 296, 301, 150], np.int32), 296, (lo, hi))]
    for x, k, K, span in cases:
        x, k = jnp.asarray(x), jnp.asarray(k)
        span = None if span is None else tuple(jnp.asarray(a) for a in span)
        want = np.asarray(topk_select_reference(mask_span(x, span), k, K))
        with checked_memory():
            got = gpu.topk_select_gpu.__wrapped__(x, k, K, span=span, config=config, interpret=True)
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"K = {K}, span {span is not None}")


@pytest.mark.parametrize("path,shape,K,launches", [
    ("row", (32, 6256), 64, 1), ("fused", (64, 131072), 13108, 10), ("sample", (64, 131072), 13108, 5),
    # TokenButler's rows: one split per row, the band counted in a register, and no rule-count launch (the resolve
    # kernel gives each row its tie quota and one program compacts the whole row)
    ("sample", (3840, 100096), 10010, 4),
    ("ordered", (64, 131072), 2080, 3)])
def test_lowers_for_cuda_with_few_launches(path, shape, K, launches):
    sds = jax.ShapeDtypeStruct
    check = jax.export.DisabledSafetyCheck.custom_call(plgpu.CUSTOM_CALL_TARGET_NAME)
    f = functools.partial(gpu.topk_select_gpu, K=K, config=gpu.SelectConfig(path=path))
    with abstract_device(*H100):
        exp = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[check])(
            sds(shape, jnp.float32), sds(shape[:1], jnp.int32))
    text = exp.mlir_module()
    assert text.count("stablehlo.custom_call") == launches
    # Nothing but the kernels and free reshapes between them (no XLA fusions: no compares, adds, reduces).
    ops = set(re.findall(r"= stablehlo\.(\w+)", text)) - {"custom_call", "reshape", "broadcast_in_dim", "constant"}
    assert not ops, ops


@pytest.mark.parametrize("path,shape,K,launches", [
    ("row", (32, 6256), 64, 1), ("ordered", (64, 131072), 2080, 3),
    # H2O's every-layer rows at batch 1 (256 rows: below the ordered path's 512) and the whole-row variant
    ("sample", (256, 100096), 5005, 5), ("sample", (3840, 100096), 10010, 4)])
def test_spanned_kernels_lower_for_cuda_reading_the_scores_in_place(path, shape, K, launches):
    """With a span the "row", "ordered" and "sample" kernels lower for CUDA with the same launches and no XLA op over
    the scores: the only ops outside the kernels build the [R, 2] span rows (no select, no compare over the scores;
    the sample path masked a copy of the rows in XLA before, 63 us for H2O's at batch 1 on an H100)."""
    sds = jax.ShapeDtypeStruct
    check = jax.export.DisabledSafetyCheck.custom_call(plgpu.CUSTOM_CALL_TARGET_NAME)
    config = gpu.SelectConfig(path=path)

    def f(x, k, lo, hi):
        return gpu.topk_select_gpu(x, k, K, span=(lo, hi), config=config)
    with abstract_device(*H100):
        exp = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[check])(
            sds(shape, jnp.float32), sds(shape[:1], jnp.int32), sds(shape[:1], jnp.int32), sds(shape[:1], jnp.int32))
    text = exp.mlir_module()
    assert text.count("stablehlo.custom_call") == launches
    ops = set(re.findall(r"= stablehlo\.(\w+)", text)) - {"custom_call", "reshape", "broadcast_in_dim", "constant",
                                                            "concatenate"}
    assert not ops, ops



def test_distinct_counts_keep_one_count_per_leading_row():
    """k varies over a prefix of the row dims: only that prefix is kept, row r reads entry r // rep."""
    from pallas_kernels.topk_select.common import count_spec, distinct_counts
    B, H, T = 3, 4, 2
    k = jnp.arange(B, dtype=jnp.int32) + 5
    assert distinct_counts(k[:, None, None], (B, H, 1)).tolist() == [5, 6, 7]  # a decode's [B, 1, 1]
    assert distinct_counts(7, (B, H)).tolist() == [7]
    assert distinct_counts(k[:, None, None], (B, H, T)).shape == (B,)
    per_head = jnp.arange(H, dtype=jnp.int32)[None, :]  # varies inside: every (b, h) kept
    assert distinct_counts(per_head, (B, H)).tolist() == np.tile(np.arange(H), B).tolist()
    want = np.repeat(np.asarray(k), H * T)
    rows = distinct_counts(k[:, None, None], (B, H, T))
    spec = count_spec(rows.reshape(-1, 1), B * H * T)
    assert [int(rows[spec.index_map(r)[0]]) for r in range(B * H * T)] == want.tolist()
    with pytest.raises(ValueError, match="3 counts for 8 rows"):
        count_spec(jnp.zeros((3, 1), jnp.int32), 8)


@pytest.mark.parametrize("config", [dict(path="row"), dict(ORDERED), dict(SAMPLE), dict(SAMPLE, target_programs=1),
                                    dict(path="fused", target_programs=24)],
                         ids=["row", "ordered", "sample", "sample_whole_rows", "fused"])
def test_k_per_leading_row_reads_its_rows(config):
    """k [B, 1] over rows [B, H, N] (a decode's budget per batch row): every path picks each row's k, as the
    reference with k broadcast."""
    rng = np.random.default_rng(5)
    B, H, N, K = 3, 4, 2048, 300
    x = jnp.asarray(rng.standard_normal((B, H, N)).astype(np.float32))
    k = jnp.asarray([[0], [K // 3], [K]], jnp.int32)
    got = gpu.topk_select_gpu(x, k, K, config=gpu.SelectConfig(**config), interpret=True)
    want = topk_select_reference(x, jnp.broadcast_to(k, (B, H)), K)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("path", ["row", "sample", "ordered", "fused"])
def test_k_per_leading_row_lowers_without_a_broadcast(path):
    """k [B, 1, 1] over rows [B, Hkv, 1]: the kernels read it as [B] (no broadcast op to every row, which was an XLA
    kernel of its own in each layer of a decode scan)."""
    N = 6256 if path == "row" else 131072
    shape, K = (4, 8, 1, N), 64 if path == "row" else 2080
    sds = jax.ShapeDtypeStruct
    check = jax.export.DisabledSafetyCheck.custom_call(plgpu.CUSTOM_CALL_TARGET_NAME)
    f = functools.partial(gpu.topk_select_gpu, K=K, config=gpu.SelectConfig(path=path))
    with abstract_device(*H100):
        exp = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[check])(
            sds(shape, jnp.float32), sds((4, 1, 1), jnp.int32))
    text = exp.mlir_module()
    assert "stablehlo.custom_call" in text
    ops = set(re.findall(r"= stablehlo\.(\w+)", text)) - {"custom_call", "reshape", "constant"}
    assert not ops, ops

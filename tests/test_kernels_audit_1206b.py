"""Gaps a mutation audit of the stacked gathered decode (`pallas_kernels.sparse_attention.stacked`, its head-map and
every-layer paths) and of the sampled top-k (`pallas_kernels.topk_select.gpu_sample`) found (Pallas Triton kernels in
interpret mode): a traced layer outside [0, L) read through the head-map table, every layer's index rows and the
cache (wrapped and clamped, inside the blocks); a known head map one value past either end refused; the last, partial
split's entries of blocks of 8 read inside the row; a row whose length runs past N sees no token past the cache;
the sampled bracket's lower end at every key for k near N and a band of exactly `cap` keys resolved without the
streaming fallback; a band of cap + 1 keys (one dropped from the buffer) taking it."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_bounds import checked_memory
from pallas_kernels.layers import layer_index
from pallas_kernels.sparse_attention import gpu, sparse_decode, stacked
from pallas_kernels.sparse_attention import reference as ref
from pallas_kernels.sparse_attention.testing import random_decode_indices
from pallas_kernels.topk_select import gpu_fused, gpu_sample, topk_select_reference
from pallas_kernels.topk_select.common import INT_MIN, float_keys

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def _inputs(seed, L, B, T, Hq, Hkv, D, N, lengths):
    rng = np.random.default_rng(seed)
    f = lambda shape: jnp.asarray(rng.standard_normal(shape, np.float32))  # noqa: E731
    return rng, f((B, T, Hq, D)), f((L, B, Hkv, N, D)), f((L, B, Hkv, N, D)), jnp.asarray(lengths, jnp.int32)


def _close(got, want, what):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=what)


# ---------------------------------------------------------------------------------------------------------
# Stacked gathered decode.


def test_stacked_decode_layer_outside_the_stack_reads_inside_its_blocks():
    """A traced layer outside [0, L) (-1 and -L wrap, L + 2 and -L - 3 clamp, as `layer_index`) reads that layer's
    cache, the head-map table's row of that layer, and every layer's index rows at that layer, every access inside
    its block (`checked_memory`), equal to the reference on the slice (mutations: the table's row read at the raw
    layer, `hm_ref[layer_ref[0], h]`; the index rows' layer taken raw, `head = layer_ref[0]`; `layer_index` clamping
    to L instead of L - 1: the interpreter wraps or clamps such an index, so the values alone hid them)."""
    L, B, T, Hq, Hkv, D, N, K = 3, 2, 1, 4, 2, 16, 32, 6
    lengths = [32, 19]
    rng, q, k_all, v_all, lens = _inputs(41, L, B, T, Hq, Hkv, D, N, lengths)
    idx = jnp.asarray(random_decode_indices(rng, lengths, Hkv, T, K))
    rows = jnp.stack([jnp.asarray(random_decode_indices(rng, lengths, Hkv, T, K)) for _ in range(L)])
    table = jnp.asarray([[1, 0], [1, 1], [0, 0]], jnp.int32)
    cfg = gpu.DecodeConfig(block_k=16, num_splits=1)
    decode = functools.partial(stacked.sparse_decode_stacked_gpu.__wrapped__, q, k_all, v_all, config=cfg,
                               interpret=True)  # unjitted: traced under the check
    for layer in (-1, -L, L + 2, -L - 3):
        at = int(layer_index(jnp.int32(layer), L))
        with checked_memory():  # the layer traced (a known one outside [-L, L) is refused), the kernel traced here
            got_map = jax.jit(lambda lay: decode(lay, idx, lens, head_map=table))(jnp.int32(layer))
            got_rows = jax.jit(lambda lay: decode(lay, rows, lens))(jnp.int32(layer))
        want_map = ref.sparse_decode_reference(q, k_all[at], v_all[at], jnp.take(idx, table[at], axis=1), lens)
        want_rows = ref.sparse_decode_reference(q, k_all[at], v_all[at], rows[at], lens)
        _close(got_map, want_map, f"head-map table, layer {layer} (reads {at})")
        _close(got_rows, want_rows, f"every layer's rows, layer {layer} (reads {at})")


def test_head_map_one_value_past_either_end_is_refused():
    """A known head map with one value just outside [0, Hkv) (-1 alone, or Hkv alone), as a row [Hkv] or in one row of
    every layer's table [L, Hkv], is refused by `check_head_map` and by the kernel's wrapper; [0, Hkv - 1] is accepted
    (mutations: `min() < -1`, `max() > Hkv`: the existing refusal used [-1, 0, 3, 4], out at both ends at once)."""
    L, Hkv = 3, 4
    stacked.check_head_map(jnp.asarray([0, 3, 3, 1], jnp.int32), Hkv)
    stacked.check_head_map(jnp.zeros((L, Hkv), jnp.int32).at[2, 1].set(Hkv - 1), Hkv, L)
    for bad in ([-1, 0, 1, 2], [0, 1, 2, Hkv]):
        with pytest.raises(ValueError, match=re.escape(f"head_map={bad}: expected values in [0, Hkv={Hkv})")):
            stacked.check_head_map(jnp.asarray(bad, jnp.int32), Hkv)
        table = jnp.zeros((L, Hkv), jnp.int32).at[1].set(jnp.asarray(bad, jnp.int32))
        with pytest.raises(ValueError, match=r"expected values in \[0, Hkv=4\)"):
            stacked.check_head_map(table, Hkv, L)
    _, q, k_all, v_all, lens = _inputs(42, L, 1, 1, 4, Hkv, 16, 16, [16])
    idx = jnp.zeros((1, Hkv, 1, 2), jnp.int32)
    for bad in ([-1, 0, 1, 2], [0, 1, 2, Hkv]):
        with pytest.raises(ValueError, match=r"expected values in \[0, Hkv=4\)"):
            sparse_decode(q, k_all, v_all, idx, lens, layer=jnp.int32(0), head_map=jnp.asarray(bad, jnp.int32),
                          implementation="xla")


def test_stacked_decode_partial_last_split_of_blocks_reads_inside_the_row():
    """Blocks of 8 tokens, K = 13 entries in 3 splits of 6 (two entries per iteration of 16 lanes): the last split
    holds one entry, which is useful (every entry is a distinct visible block), so its iteration's lanes for entry 13
    (past the row) must be masked; with and without a head map, inside every block (`checked_memory`) and equal to
    the reference (mutation: the multi-token gather's entry mask `e <= n_valid`, which read entry K; the existing
    bounds case had no useful entry in the last split)."""
    L, B, T, Hq, Hkv, D, N, K, bs = 2, 2, 1, 4, 2, 16, 128, 13, 8
    lengths = [128, 120]
    rng, q, k_all, v_all, lens = _inputs(43, L, B, T, Hq, Hkv, D, N, lengths)
    idx = np.stack([[[rng.permutation(15)[:K] for _ in range(T)] for _ in range(Hkv)] for _ in range(B)])
    idx = jnp.asarray(idx.astype(np.int32))  # blocks 0..14: all visible (blocks start at or before 119)
    hm = jnp.asarray([1, 1], jnp.int32)
    cfg = gpu.DecodeConfig(block_k=16, num_splits=3)
    decode = functools.partial(stacked.sparse_decode_stacked_gpu.__wrapped__, q, k_all, v_all, jnp.int32(1), idx,
                               lens, block_size=bs, config=cfg, interpret=True)
    with checked_memory():
        got = decode()
        got_map = decode(head_map=hm)
    _close(got, ref.sparse_decode_reference(q, k_all[1], v_all[1], idx, lens, block_size=bs), "rows")
    _close(got_map, ref.sparse_decode_reference(q, k_all[1], v_all[1], jnp.take(idx, hm, axis=1), lens,
                                                block_size=bs), "head map")


def test_stacked_decode_length_past_the_cache_sees_no_token_past_it():
    """A row whose length runs past N (traced lengths are not checked): its queries' last visible token is clamped to
    N - 1: the entries of the last token / block attend up to N - 1, and an entry of token N (or block N / 8) attends
    nothing, inside every block (`checked_memory`), equal to the reference (which drops tokens >= N) (mutation:
    `limit = min(pos, N)`, which let token N through; within the contract lengths <= N it makes no difference, but
    the kernel clamps, as the anchor kernel does for a row past N)."""
    L, B, T, Hq, Hkv, D, N, K = 2, 2, 2, 4, 2, 16, 32, 5
    rng, q, k_all, v_all, _ = _inputs(44, L, B, T, Hq, Hkv, D, N, [N, N])
    lens = jnp.asarray([N + 3, 20], jnp.int32)
    row = lambda e: jnp.asarray(np.tile(np.asarray(e, np.int32), (B, Hkv, T, 1)))  # noqa: E731
    for bs, entries in ((1, row([N - 1, 3, N, 17, -1])), (8, row([3, 0, N // 8, 2, -1]))):
        with checked_memory():
            got = stacked.sparse_decode_stacked_gpu.__wrapped__(q, k_all, v_all, jnp.int32(0), entries, lens,
                                                                 block_size=bs, config=gpu.DecodeConfig(block_k=16),
                                                                 interpret=True)
        want = ref.sparse_decode_reference(q, k_all[0], v_all[0], entries, lens, block_size=bs)
        _close(got, want, f"block_size {bs}")


# ---------------------------------------------------------------------------------------------------------
# Sampled top-k (gpu_sample).

SN, SS, SK = 2048, 256, 2048  # row length, sample, width of the sample path's cases


@pytest.fixture
def no_fallback(monkeypatch):
    """The resolve kernel's streaming fallback poisoned (threshold INT32_MAX, count 0, for the rows it is active
    for): a row that takes it selects nothing, so a row equal to the reference was resolved from its bracket."""
    orig = gpu_fused.stream_threshold

    def poisoned(x_ref, kk, active, **kw):
        lo, cnt = orig(x_ref, kk, active, **kw)
        return jnp.where(active, jnp.int32(np.iinfo(np.int32).max), lo), jnp.where(active, 0, cnt)

    jax.clear_caches()
    monkeypatch.setattr(gpu_fused, "stream_threshold", poisoned)
    yield
    jax.clear_caches()


def _sample_select(x, k, K, *, cap, programs):
    """`gpu_sample.topk_select_sample` (unjitted: traced here), 128-score chunks; programs 24: splits sharing each
    row's band; 1: one program per row (the band counted in a register, the tie quota from the resolve kernel)."""
    return np.asarray(gpu_sample.topk_select_sample(jnp.asarray(x), jnp.asarray(k), K, sample=SS, sigmas=4.0, cap=cap,
                                                    block_n=128, target_programs=programs, interpret=True))


def _band_row(rng, kk, n_band):
    """A row of SN scores whose bracket at k = kk (sample SS, sigmas 4) holds exactly n_band keys strictly inside,
    with the kk-th largest in the middle of the band, the band's keys ascending with their position (so the last one
    written, the one a buffer one slot short drops, is the band's largest). The sampled positions hold 1..SS; the
    bracket depends on them alone, and the other positions are filled above A, inside and below B afterwards."""
    at = np.asarray(gpu_sample.sample_positions(SN, SS))
    rest = np.setdiff1d(np.arange(SN), at)
    x = np.zeros(SN, np.float32)
    x[at] = rng.permutation(SS).astype(np.float32) + 1.0
    br = np.asarray(gpu_sample.sample_bracket(jnp.asarray(x[None]), jnp.asarray([[kk]], jnp.int32), SK, sample=SS,
                                              sigmas=4.0, bits=2, interpret=True))[0]
    assert br[2] == 1, br  # A is on
    vals = x[at]
    a_val, b_val = (float(vals[np.asarray(float_keys(jnp.asarray(vals))) == br[i]][0]) for i in (0, 1))
    s_in = int(((vals > b_val) & (vals < a_val)).sum())
    n_mid, n_hi = n_band - s_in, kk - int((vals >= a_val).sum()) - n_band // 2
    assert n_mid >= 0 and n_hi >= 0 and n_mid + n_hi <= rest.size, (s_in, n_mid, n_hi)
    n_lo = rest.size - n_mid - n_hi
    fill = np.concatenate([rng.uniform(b_val + 0.01, a_val - 0.01, n_mid), a_val + 1.0 + rng.random(n_hi) * 100,
                           -1.0 - rng.random(n_lo)]).astype(np.float32)
    x[rest] = fill[rng.permutation(rest.size)]
    band = np.flatnonzero((x > b_val) & (x < a_val))  # ascending positions; values in [1, SS] in the sample's slots
    inside_sample = np.isin(band, at)
    x[band] = np.sort(x[band])  # the sample's slots keep values strictly inside the bracket: the bracket is the same
    assert inside_sample.sum() == s_in and (x[at] > b_val).sum() == (vals > b_val).sum()
    return x


def test_sample_band_of_exactly_cap_keys_resolves_without_fallback(no_fallback):
    """A band holding exactly `cap` keys (cap = 128: the whole buffer) is searched in registers, not streamed: with the
    fallback poisoned the rows still equal the reference, with splits sharing the band and one program per row; so
    are rows at k = N and N - 3, whose bracket's lower end is every key (r + m past the sample: B = INT_MIN, checked)
    (mutations: `n_band < cap`, which sent a full band to the fallback, and the lower sample rank clipped to ns - 1,
    which made B the smallest sample key and every k near N stream; both exact, so only this tells them)."""
    rng = np.random.default_rng(51)
    cap = 128
    rows = [_band_row(rng, 1000, cap), _band_row(rng, 700, cap)]
    cont = rng.standard_normal((2, SN)).astype(np.float32)
    x = np.stack(rows + list(cont))
    k = np.array([1000, 700, SN, SN - 3], np.int32)
    want = np.asarray(topk_select_reference(jnp.asarray(x), jnp.asarray(k), SK))
    br = np.asarray(gpu_sample.sample_bracket(jnp.asarray(x), jnp.asarray(k)[:, None], SK, sample=SS, sigmas=4.0,
                                              bits=2, interpret=True))
    assert (br[2:, 1] == INT_MIN).all(), br
    for programs in (24, 1):
        np.testing.assert_array_equal(_sample_select(x[:2], k[:2], SK, cap=cap, programs=programs), want[:2],
                                      err_msg=f"band of cap keys, target_programs={programs}")
        np.testing.assert_array_equal(_sample_select(x[2:], k[2:], SK, cap=512, programs=programs), want[2:],
                                      err_msg=f"k near N, target_programs={programs}")


def test_sample_band_one_key_over_cap_is_exact():
    """A band of cap + 1 keys (cap = 128): the buffer drops the last one written (here the band's largest, above the
    threshold), so the row must take the streaming fallback; it equals the reference with splits sharing the band and
    with one program per row (mutation: the resolve kernel's fit test `n_band <= cap + 1`, which searched the 128 kept
    keys for a threshold one rank off; the random cases never hit a band of exactly cap + 1)."""
    rng = np.random.default_rng(52)
    cap = 128
    x = np.stack([_band_row(rng, 1000, cap + 1), _band_row(rng, 700, cap + 1)])
    k = np.array([1000, 700], np.int32)
    want = np.asarray(topk_select_reference(jnp.asarray(x), jnp.asarray(k), SK))
    for programs in (24, 1):
        np.testing.assert_array_equal(_sample_select(x, k, SK, cap=cap, programs=programs), want,
                                      err_msg=f"target_programs={programs}")

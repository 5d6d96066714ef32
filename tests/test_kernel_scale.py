"""Every CPU path of the attention ops honours a custom softmax `scale` (and the lse at that scale): local_attention,
sparse_decode / sparse_prefill and tsa_scores, each against float64 numpy at a non-default scale (a mutation audit
found that a path falling back to 1/sqrt(D) passed every other test: no library caller passes a scale)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.local_attention import local_attention
from pallas_kernels.sparse_attention import sparse_decode, sparse_prefill
from pallas_kernels.tsa_scoring import tsa_scores

SCALE = 0.07


def _numpy_local(q, k, v, window, sinks, scale):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    i = np.arange(T)
    mask = (i[None] <= i[:, None]) & ((i[:, None] - i[None] < window) | (i[None] < sinks))
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(Hq):
            s = q[b, :, h] @ k[b, :, h // G].T * scale
            s = np.where(mask, s, -np.inf)
            p = np.exp(s - s.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            out[b, :, h] = p @ v[b, :, h // G]
    return out


@pytest.mark.parametrize("scale", [0.05, 0.9])
def test_local_attention_xla_uses_the_given_scale(scale):
    rng = np.random.default_rng(0)
    B, T, Hq, Hkv, D, window, sinks = 2, 45, 4, 2, 16, 8, 3
    q = rng.standard_normal((B, T, Hq, D)).astype(np.float32)
    k = rng.standard_normal((B, T, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((B, T, Hkv, D)).astype(np.float32)
    got = local_attention(q, k, v, window=window, sinks=sinks, scale=scale, implementation="xla")
    want = _numpy_local(q, k, v, window, sinks, scale)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-5)
    # and the default really differs from these scales on these inputs (the test can tell them apart)
    default = local_attention(q, k, v, window=window, sinks=sinks, implementation="xla")
    assert np.abs(np.asarray(default, np.float64) - want).max() > 1e-2




def _np_softmax_attend(qv, K, V, keep, scale):
    """qv [D], K/V [N, D], keep bool[N] -> (out [D], lse)."""
    if not keep.any():
        return np.zeros(K.shape[1]), -np.inf
    s = np.where(keep, K @ qv * scale, -np.inf)
    m = s.max()
    e = np.exp(s - m)
    return e @ V / e.sum(), m + np.log(e.sum())


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_sparse_decode_custom_scale(impl):
    rng = np.random.default_rng(1)
    B, T, Hq, Hkv, N, D, K, bs = 2, 2, 4, 2, 32, 16, 5, 4
    q = rng.standard_normal((B, T, Hq, D)).astype(np.float32) * 2
    k = rng.standard_normal((B, Hkv, N, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, N, D)).astype(np.float32)
    lengths = np.array([30, 13], np.int32)
    idx = np.full((B, Hkv, T, K), -1, np.int32)
    for b in range(B):
        for h in range(Hkv):
            for t in range(T):
                sel = np.sort(rng.choice(N // bs, size=3, replace=False))
                idx[b, h, t, :3] = sel
    out, lse = sparse_decode(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(idx), jnp.asarray(lengths),
                             block_size=bs, scale=SCALE, return_lse=True, implementation=impl)
    G = Hq // Hkv
    for b in range(B):
        for t in range(T):
            pos = lengths[b] - T + t
            for h in range(Hq):
                blocks = idx[b, h // G, t]
                keep = np.zeros(N, bool)
                for j in blocks[blocks >= 0]:
                    keep[j * bs:(j + 1) * bs] = True
                keep &= (np.arange(N) <= pos) & (np.arange(N) < lengths[b])
                want_o, want_l = _np_softmax_attend(q[b, t, h].astype(np.float64), k[b, h // G].astype(np.float64),
                                                    v[b, h // G].astype(np.float64), keep, SCALE)
                np.testing.assert_allclose(np.asarray(out[b, t, h], np.float64), want_o, rtol=1e-4, atol=1e-5)
                np.testing.assert_allclose(float(lse[b, t, h]), want_l, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_sparse_prefill_custom_scale(impl):
    rng = np.random.default_rng(2)
    B, T, Hq, Hkv, D, tile, K = 1, 24, 2, 1, 8, 8, 2
    q = rng.standard_normal((B, T, Hq, D)).astype(np.float32) * 2
    k = rng.standard_normal((B, T, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((B, T, Hkv, D)).astype(np.float32)
    lengths = np.array([T], np.int32)
    idx = np.array([[[[-1, -1], [3, -1], [1, 9]]]], np.int32)  # tile 2's entry 9 is past its start: ignored
    out = sparse_prefill(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(idx), jnp.asarray(lengths),
                         tile=tile, scale=SCALE, implementation=impl)
    for r in range(T):
        start = (r // tile) * tile
        keep = (np.arange(T) >= start) & (np.arange(T) <= r)
        sel = idx[0, 0, r // tile]
        sel = sel[(sel >= 0) & (sel < start)]
        keep[sel] = True
        for h in range(Hq):
            want, _ = _np_softmax_attend(q[0, r, h].astype(np.float64), k[0, :, 0].astype(np.float64),
                                         v[0, :, 0].astype(np.float64), keep, SCALE)
            np.testing.assert_allclose(np.asarray(out[0, r, h], np.float64), want, rtol=1e-4, atol=1e-5)


def _tsa_brute(q, k, window, pool, lengths, scale):
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    out = np.zeros((B, Hq, T))
    half = pool // 2
    for b in range(B):
        n = int(lengths[b])
        for h in range(Hq):
            s = q[b, :n, h] @ k[b, :n, h // G].T * scale
            s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
            p = np.exp(s - s.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            mean = p[max(0, n - window):].mean(0)
            for j in range(n):
                out[b, h, j] = mean[max(0, j - half):min(n, j + half + 1)].sum() / pool
    return out


@pytest.mark.parametrize("scale", [0.03, 1.0])
def test_tsa_scores_xla_uses_the_given_scale(scale):
    rng = np.random.default_rng(3)
    B, T, Hq, Hkv, D, W, pool = 2, 30, 4, 2, 16, 8, 3
    q = (2 * rng.standard_normal((B, T, Hq, D))).astype(np.float32)
    k = rng.standard_normal((B, T, Hkv, D)).astype(np.float32)
    lengths = np.array([30, 17], np.int32)
    got = tsa_scores(q, k, window=W, pool_kernel=pool, lengths=lengths, scale=scale, implementation="xla")
    want = _tsa_brute(q, k, W, pool, lengths, scale)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-4, atol=1e-6)

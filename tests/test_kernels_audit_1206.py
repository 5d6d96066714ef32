"""Gaps a mutation audit of `pallas_kernels.kv_write` and `pallas_kernels.anchor_attention.gpu` found (Pallas Triton
kernels in interpret mode): the cache write's boundary positions (0 and N - 1 written, exactly N and -1 dropped),
`norm_heads`' eps inside the root (an all-zero head stays zero), the anchor scoring kernel's last visible key clamped
to the cache (a row whose length runs past N sees the N keys and no phantom key past them), and its traced layer
clamped as well as wrapped (a layer outside [-L, L) reads the last or the first layer, inside its block)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_bounds import checked_memory
from pallas_kernels.anchor_attention import gpu as agpu
from pallas_kernels.anchor_attention.reference import anchor_decode_reference, decode_scores_reference
from pallas_kernels.kv_write import norm_heads, rope_write
from pallas_kernels.kv_write import gpu as kgpu
from pallas_kernels.kv_write.reference import rms_norm, rope_write_reference

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def _kv_inputs(seed, B, T, Hq, Hkv, D, L, N, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 4)
    qkv = jax.random.normal(ks[0], (B * T, Hq + 2 * Hkv, D), jnp.float32).astype(dtype)
    ck = jax.random.normal(ks[1], (L, B, Hkv, N, D), jnp.float32).astype(dtype)
    cv = jax.random.normal(ks[2], (L, B, Hkv, N, D), jnp.float32).astype(dtype)
    inv_freq = jnp.asarray(1.0 / (10000.0 ** (np.arange(0, D, 2, dtype=np.float32) / D)))
    norms = (1.0 + 0.3 * jax.random.normal(ks[3], (2, D))).astype(dtype)
    return qkv, inv_freq, ck, cv, norms


def test_kv_write_kernel_writes_the_cache_edges_and_drops_just_past_them():
    """Positions 0 and N - 1 (the first and last slots) are written, exactly N and -1 (one past either end) are
    dropped: the kernel equals the reference, and only the written tokens' rows change, bit for bit elsewhere
    (mutations: the keep mask `p > 0`, which dropped a token at position 0, and `p <= N`, which wrote a token at
    position N into slot N - 1 over the last key; the existing cases drop only N + 5 and -3)."""
    B, T, Hq, Hkv, D, L, N, layer = 4, 1, 4, 2, 32, 2, 16, 1
    qkv, inv_freq, ck, cv, _ = _kv_inputs(31, B, T, Hq, Hkv, D, L, N)
    pos = jnp.array([[0], [N - 1], [N], [-1]], jnp.int32)
    want = rope_write_reference(qkv, pos, inv_freq, ck, cv, layer, Hq, Hkv)
    got = kgpu.rope_write_gpu(qkv, pos, inv_freq, ck, cv, jnp.int32(layer), Hq, Hkv, interpret=True)
    for g, w, name in zip(got, want, ("q", "cache_k", "cache_v")):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5, err_msg=name)
    wrote = {(layer, 0, h, 0) for h in range(Hkv)} | {(layer, 1, h, N - 1) for h in range(Hkv)}
    for g, c, name in ((got[1], ck, "cache_k"), (got[2], cv, "cache_v")):
        changed = {tuple(int(i) for i in r) for r in np.argwhere(np.any(np.asarray(g != c), axis=-1))}
        assert changed == wrote, (name, sorted(changed ^ wrote))
    np.testing.assert_array_equal(np.asarray(got[2][layer, 0, :, 0]), np.asarray(qkv[0, Hq + Hkv:]))
    np.testing.assert_array_equal(np.asarray(got[2][layer, 1, :, N - 1]), np.asarray(qkv[1, Hq + Hkv:]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_norm_heads_keeps_an_all_zero_head_zero(monkeypatch, dtype):
    """`norm_heads` (the GPU path's q/k norm in XLA) puts eps inside the root as `reference.rms_norm` does: a q head
    and a k head of all zeros stay zero, not NaN; every q and k head equals `rms_norm` with its own weight bit for bit
    and the v heads are untouched; and `rope_write` on the kernel path (interpreted) returns zero q and k rows for
    them, equal to the reference (mutation: eps dropped from norm_heads, which the random heads' mean square ~1 hid,
    and the zero-head check in test_kv_write.py runs the reference, not norm_heads)."""
    B, T, Hq, Hkv, D, L, N, eps = 2, 1, 4, 2, 32, 2, 16, 1e-6
    qkv, inv_freq, ck, cv, norms = _kv_inputs(32, B, T, Hq, Hkv, D, L, N, dtype)
    qkv = qkv.at[0, 1].set(0).at[1, Hq].set(0)  # row 0's q head 1, row 1's k head 0
    normed = norm_heads(qkv, Hq, Hkv, norms[0], norms[1], eps)
    assert normed.dtype == qkv.dtype and bool(jnp.all(jnp.isfinite(normed.astype(jnp.float32))))
    np.testing.assert_array_equal(np.asarray(normed[:, :Hq]), np.asarray(rms_norm(qkv[:, :Hq], norms[0], eps)))
    np.testing.assert_array_equal(np.asarray(normed[:, Hq:Hq + Hkv]),
                                  np.asarray(rms_norm(qkv[:, Hq:Hq + Hkv], norms[1], eps)))
    np.testing.assert_array_equal(np.asarray(normed[:, Hq + Hkv:]), np.asarray(qkv[:, Hq + Hkv:]))
    assert not np.asarray(normed[0, 1], np.float32).any() and not np.asarray(normed[1, Hq], np.float32).any()

    monkeypatch.setattr(kgpu, "rope_write_gpu", functools.partial(kgpu.rope_write_gpu, interpret=True))
    pos = jnp.array([[3], [9]], jnp.int32)
    got = rope_write(qkv, pos, inv_freq, ck, cv, 1, Hq, Hkv, norms[0], norms[1], eps, implementation="pallas_gpu")
    want = rope_write_reference(qkv, pos, inv_freq, ck, cv, 1, Hq, Hkv, norms[0], norms[1], eps)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    for g, w, name in zip(got, want, ("q", "cache_k", "cache_v")):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.isfinite(g).all(), name
        np.testing.assert_allclose(g, w, err_msg=name, **tol)
    assert not np.asarray(got[0][0, 0, 1], np.float32).any()
    assert not np.asarray(got[1][1, 1, 0, 9], np.float32).any()


def _check_scores(q, k, v, lens, cfg, layer=None, clean=None):
    """decode_scores_gpu (unjitted, interpreted) against the reference's scores and dense output on `clean` (the
    one-layer cache the call should read)."""
    kr, vr = clean if clean is not None else (k, v)
    scores, out = agpu.decode_scores_gpu.__wrapped__(q, k, v, lens, layer=layer, dense_output=True, config=cfg,
                                                     interpret=True)
    want = np.asarray(decode_scores_reference(q, kr, lens))
    want_out = anchor_decode_reference(q, kr, vr, lens, budget=1.0, min_tokens=0, dense_output=True)[0]
    scores = np.asarray(scores)
    np.testing.assert_array_equal(np.isneginf(scores), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(scores[fin], want[fin], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)


def _anchor_inputs(seed, shape_q, shape_kv):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(s, np.float32)) for s in (shape_q, shape_kv, shape_kv))


@pytest.mark.parametrize("pool", ["xla", "triton"])
def test_anchor_scores_of_a_row_past_the_cache(pool):
    """A row whose length runs past the cache (kv_write drops such positions, so the cache holds its N newest-written
    keys): its queries, at positions N - 1 and N, see the N keys and nothing past them; N = 72 is not a multiple of
    block_n 16, so the last chunk holds lanes past N. Scores and the dense output equal the reference's (every key
    visible), and no access leaves its block (mutation: the last visible key clamped to N instead of N - 1, which
    counted a phantom zero key at N in the softmax and read V past the block)."""
    B, T, Hq, Hkv, D, N = 2, 2, 6, 2, 16, 72
    q, k, v = _anchor_inputs(41, (B, T, Hq, D), (B, Hkv, N, D))
    lens = jnp.array([N + 1, 40], jnp.int32)
    with checked_memory():
        _check_scores(q, k, v, lens, agpu.AnchorConfig(block_n=16, target_programs=16, pool=pool, pool_block=32))


@pytest.mark.parametrize("layer,row", [(5, 2), (-5, 0), (-1, 2)])
def test_anchor_scoring_clamps_a_layer_outside_the_stack(layer, row):
    """A traced layer is wrapped once and then clamped in-kernel (`pallas_kernels.layers`' contract, as kv_write's
    kernel is tested): with L = 3, layer 5 reads the last layer and -5 the first, -1 the last. Under `checked_memory`
    (the interpreter clamps a dynamic index itself, where a GPU reads past the stacked cache) the K and V reads stay
    inside their block, and the scores and dense output equal the reference on that layer (mutation: the wrap without
    the clamp)."""
    B, T, Hq, Hkv, D, N, L = 2, 1, 4, 2, 16, 64, 3
    q, k, v = _anchor_inputs(42, (B, T, Hq, D), (L, B, Hkv, N, D))
    lens = jnp.array([64, 23], jnp.int32)
    cfg = agpu.AnchorConfig(block_n=16, target_programs=8)
    with checked_memory():
        _check_scores(q, k, v, lens, cfg, layer=jnp.int32(layer), clean=(k[row], v[row]))

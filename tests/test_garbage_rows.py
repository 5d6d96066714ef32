"""Cache rows past `lengths` are garbage (a rolled-back speculative row, a padding token's K/V) and are never read:
an attention's output is the same whatever they hold, NaN included. A weight of 0 times a NaN value is NaN, so the
kernels zero (or do not load) the values no query sees rather than weight them by 0. Every implementation of the
gathered decode and prefill and of the dense anchor decode, compiled kernels in interpret mode on the CPU.
`pallas_kernels.dense.dense_decode` (the "sliced" path: the CPU and TPU default of a plain dense decode, and the
speculative verification's T > 1 queries) too: `jax.nn.dot_product_attention` weights the rows past the lengths
by 0, so it is handed their values zeroed.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.anchor_attention import gpu as anchor_gpu
from pallas_kernels.anchor_attention import reference as anchor_ref
from pallas_kernels.anchor_attention import tpu as anchor_tpu
from pallas_kernels import dense
from pallas_kernels.anchor_attention import xla as anchor_xla
from pallas_kernels.dense_decode import gpu as dense_gpu
from pallas_kernels.dense_decode import reference as dense_ref
from pallas_kernels.sparse_attention import gpu as sparse_gpu
from pallas_kernels.sparse_attention import reference as sparse_ref
from pallas_kernels.sparse_attention import tpu as sparse_tpu
from pallas_kernels.sparse_attention import xla as sparse_xla


def _interpret(f):
    return lambda *a, **kw: f(*a, interpret=True, **kw)


SPARSE_DECODE = {"reference": sparse_ref.sparse_decode_reference, "xla": sparse_xla.sparse_decode_xla,
                 "pallas_tpu": _interpret(sparse_tpu.sparse_decode_tpu),
                 "pallas_gpu": _interpret(sparse_gpu.sparse_decode_gpu)}
SPARSE_PREFILL = {"reference": sparse_ref.sparse_prefill_reference, "xla": sparse_xla.sparse_prefill_xla,
                  "pallas_tpu": _interpret(sparse_tpu.sparse_prefill_tpu),
                  "pallas_gpu": _interpret(sparse_gpu.sparse_prefill_gpu)}
ANCHOR_DECODE = {"reference": anchor_ref.anchor_decode_reference, "xla": anchor_xla.anchor_decode_xla,
                 "pallas_tpu": _interpret(anchor_tpu.anchor_decode_tpu),
                 "pallas_gpu": _interpret(anchor_gpu.anchor_decode_gpu)}


def _poisoned(x: np.ndarray, rows) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(x with `rows` zeroed, x with them NaN) as jnp arrays; rows: an index expression."""
    clean, nan = x.copy(), x.copy()
    clean[rows] = 0.0
    nan[rows] = np.nan
    return jnp.asarray(clean), jnp.asarray(nan)


@pytest.mark.parametrize("impl", list(SPARSE_DECODE))
def test_sparse_decode_ignores_nan_past_the_length(impl):
    """Block 1 (tokens 8..15) straddles length 9, and an index points past it: tokens 9.. are garbage."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 1, 4, 64)), jnp.float32)
    kv = rng.standard_normal((1, 1, 32, 64)).astype(np.float32)
    k, k_nan = _poisoned(kv, np.s_[:, :, 9:])
    v, v_nan = _poisoned(kv[::-1].copy(), np.s_[:, :, 9:])
    idx, lens = jnp.array([[[[0, 1, 3, -1]]]], jnp.int32), jnp.array([9], jnp.int32)
    f = SPARSE_DECODE[impl]
    want = np.asarray(f(q, k, v, idx, lens, block_size=8))
    got = np.asarray(f(q, k_nan, v_nan, idx, lens, block_size=8))
    assert np.isfinite(want).all()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", list(SPARSE_PREFILL))
def test_sparse_prefill_ignores_nan_past_the_length(impl):
    """Length 20 in tiles of 16: the last tile's valid rows 16..19 see its keys 20..31 (garbage) in their diagonal
    tile; the padding rows' output is zeros either way."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((1, 32, 4, 64)), jnp.float32)
    kv = rng.standard_normal((1, 32, 1, 64)).astype(np.float32)
    k, k_nan = _poisoned(kv, np.s_[:, 20:])
    v, v_nan = _poisoned(kv[:, ::-1].copy(), np.s_[:, 20:])
    idx, lens = jnp.array([[[[-1], [0]]]], jnp.int32), jnp.array([20], jnp.int32)
    f = SPARSE_PREFILL[impl]
    want = np.asarray(f(q, k, v, idx, lens, tile=16, block_size=8))
    got = np.asarray(f(q, k_nan, v_nan, idx, lens, tile=16, block_size=8))
    assert np.isfinite(want).all()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", list(ANCHOR_DECODE) + ["dense_reference", "dense_gpu"])
def test_dense_decode_ignores_nan_past_the_length(impl):
    """Kascade's dense anchor (layer 0) and the dense decode, GQA groups of 3 (SmolLM2's heads): row 0 has 27
    garbage cache rows."""
    rng = np.random.default_rng(2)
    B, Hq, Hkv, D, N = 2, 9, 3, 64, 64
    q = jnp.asarray(rng.standard_normal((B, 1, Hq, D)), jnp.float32)
    kv = rng.standard_normal((1, B, Hkv, N, D)).astype(np.float32)
    k, k_nan = _poisoned(kv, np.s_[:, 0, :, 37:])
    v, v_nan = _poisoned(-kv, np.s_[:, 0, :, 37:])
    lens = jnp.array([37, 64], jnp.int32)
    if impl == "dense_reference":
        def f(k, v):
            return dense_ref.dense_decode_stacked_reference(q, k, v, jnp.int32(0), lens)
    elif impl == "dense_gpu":
        def f(k, v):
            return dense_gpu.dense_decode_stacked_gpu(q, k, v, jnp.int32(0), lens, interpret=True)
    else:
        def f(k, v):
            return ANCHOR_DECODE[impl](q, k[0], v[0], lens, budget=0.5, min_tokens=4, dense_output=True)[0]
    want, got = np.asarray(f(k, v)), np.asarray(f(k_nan, v_nan))
    assert np.isfinite(want).all()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("T, window", [(1, None), (3, None), (3, 8)])
def test_sliced_dense_decode_ignores_nan_past_the_length(T, window):
    """`dense.dense_decode`: one new token (the key_value_seq_lengths call), T = 3 verification rows (the masked
    call) and a sliding window of 8; row 0 has 27 garbage cache rows."""
    rng = np.random.default_rng(3)
    B, Hq, Hkv, D, N = 2, 9, 3, 64, 64
    q = jnp.asarray(rng.standard_normal((B, T, Hq, D)), jnp.float32)
    kv = rng.standard_normal((B, Hkv, N, D)).astype(np.float32)
    k, k_nan = _poisoned(kv, np.s_[0, :, 37:])
    v, v_nan = _poisoned(-kv, np.s_[0, :, 37:])
    lens = jnp.array([37, 64], jnp.int32)
    want = np.asarray(dense.dense_decode(q, k, v, lens, window=window))
    got = np.asarray(dense.dense_decode(q, k_nan, v_nan, lens, window=window))
    assert np.isfinite(want).all()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)

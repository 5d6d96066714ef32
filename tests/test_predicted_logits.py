"""pallas_kernels.predicted_logits: the Triton kernel (interpret mode) equals the jnp reference, which equals the
plain q . k^T / sqrt(d); one layer's logits equal its row of a stack's."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.predicted_logits import predicted_logits
from pallas_kernels.predicted_logits.gpu import predicted_logits_gpu
from pallas_kernels.predicted_logits.reference import predicted_logits_reference
from host_rounding import assert_same_or_close
from pallas_bounds import checked_memory


def _rand(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("lead,Hk,G,T,N,d",
                         [((3, 2), 4, 1, 1, 300, 32), ((2,), 2, 2, 3, 257, 16), ((), 1, 4, 1, 64, 64)])
def test_kernel_equals_the_reference(lead, Hk, G, T, N, d):
    q = _rand(0, lead + (Hk, G, T, d))
    k = _rand(1, lead + (Hk, N, d))
    want = predicted_logits_reference(q, k)
    np.testing.assert_allclose(want, np.einsum("...kgtd,...knd->...kgtn", np.asarray(q, np.float64),
                                               np.asarray(k, np.float64)) / math.sqrt(d), rtol=1e-5, atol=1e-5)
    got = predicted_logits_gpu(q, k, block_n=128, interpret=True)  # N = 300, 257: a partial last block
    assert got.shape == lead + (Hk, G, T, N)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    if lead:  # a layer alone equals its row of the stack: bit for bit on a CPU host
        assert_same_or_close(predicted_logits_gpu(q[0], k[0], block_n=128, interpret=True), got[0], rtol=1e-6,
                             atol=1e-6)
        assert_same_or_close(predicted_logits(q[0], k[0]), want[0], rtol=1e-6, atol=1e-6)


def test_bf16_keys_are_upcast():
    """Keys held in bf16 (TokenButler's key_dtype="bfloat16"): the kernel and the reference give the logits of the
    keys upcast to f32, summed in f32."""
    q = _rand(2, (2, 2, 2, 1, 32))
    k = _rand(3, (2, 2, 300, 32)).astype(jnp.bfloat16)
    want = predicted_logits_reference(q, k.astype(jnp.float32))
    np.testing.assert_array_equal(predicted_logits_reference(q, k), want)
    np.testing.assert_allclose(predicted_logits_gpu(q, k, block_n=128, interpret=True), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("lead,Hk,G,T,N", [((3, 2), 4, 1, 1, 300), ((2,), 2, 2, 3, 257)])
def test_bounds_in_the_kernel_equal_masking_after(lead, Hk, G, T, N):
    """last / keep_first / keep_from (TokenButler's visibility and forced keys, applied as the kernel writes its
    tiles) equal the plain logits masked afterwards: -inf past each row's last key, +inf on the visible kept keys
    (a sink wider than a short row stays -inf past its end); random rows, a window starting past `last` too."""
    d = 32
    rng = np.random.default_rng(4)
    q, k = _rand(5, lead + (Hk, G, T, d)), _rand(6, lead + (Hk, N, d))
    rows = lead[-1:] + (1, 1, T)  # per (b, t), broadcast over the heads and the query group, as TokenButler's
    last = jnp.asarray(rng.integers(40, N, rows), jnp.int32).at[0].set(2)  # row 0 sees 3 keys: sink 5 > 3
    start = jnp.asarray(last - rng.integers(-1, 40, rows), jnp.int32)
    plain = np.asarray(predicted_logits_reference(q, k))
    n = np.arange(N)
    lst, st = np.asarray(last)[..., None], np.asarray(start)[..., None]
    want = np.where(n > lst, -np.inf, np.where((n < 5) | (n >= st), np.inf, plain))
    for got in (predicted_logits_reference(q, k, last=last, keep_first=5, keep_from=start),
                predicted_logits_gpu(q, k, last=last, keep_first=5, keep_from=start, block_n=128, interpret=True)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    only_last = predicted_logits_gpu(q, k, last=last, block_n=128, interpret=True)
    np.testing.assert_allclose(only_last, np.where(n > lst, -np.inf, plain), rtol=1e-6, atol=1e-6)
    assert np.isposinf(want).any() and np.isneginf(want).any() and np.isfinite(want).any()


def test_kernel_stays_in_its_blocks():
    """Every load and store of the kernel stays inside its block (`pallas_bounds.checked_memory`: the interpreter
    pads stray loads and drops stray stores, where a GPU reads past the keys or writes into the next row's logits):
    N = 150 keys in blocks of 128 (a partial last block), G * T = 6 query rows padded to 8, with and without the
    per-row bounds."""
    q, k = _rand(7, (2, 2, 3, 2, 16)), _rand(8, (2, 2, 150, 16))
    last = jnp.asarray(np.random.default_rng(9).integers(0, 150, (2, 1, 1, 2)), jnp.int32)
    with checked_memory():
        np.testing.assert_allclose(predicted_logits_gpu(q, k, block_n=128, interpret=True),
                                   predicted_logits_reference(q, k), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(predicted_logits_gpu(q, k, last=last, keep_first=3, block_n=128, interpret=True),
                                   predicted_logits_reference(q, k, last=last, keep_first=3), rtol=1e-6, atol=1e-6)


def test_errors():
    with pytest.raises(ValueError, match=r"expected q \[..., Hk, G, T, d\] and k \[..., Hk, N, d\]"):
        predicted_logits(jnp.zeros((2, 1, 1, 32)), jnp.zeros((3, 10, 32)))
    with pytest.raises(ValueError, match="head_dim=24: the kernel takes a power of two"):
        predicted_logits(jnp.zeros((2, 1, 1, 24)), jnp.zeros((2, 10, 24)), implementation="pallas_gpu")
    q, k = jnp.zeros((2, 1, 1, 32)), jnp.zeros((2, 10, 32))
    with pytest.raises(ValueError, match=r"last of shape \(3,\): expected an i32 array broadcastable"):
        predicted_logits(q, k, last=jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="last of dtype float32: expected integer key positions"):  # was truncated
        predicted_logits(q, k, last=jnp.full((1,), 3.9, jnp.float32))
    with pytest.raises(ValueError, match="keep_first=-1: expected an int >= 0"):
        predicted_logits(q, k, last=jnp.zeros((1,), jnp.int32), keep_first=-1)
    with pytest.raises(ValueError, match="keep_first / keep_from without last"):
        predicted_logits(q, k, keep_first=4)
    with pytest.raises(ValueError, match="implementation='triton'"):
        predicted_logits(jnp.zeros((2, 1, 1, 32)), jnp.zeros((2, 10, 32)), implementation="triton")


def test_keep_from_without_last_is_named():
    q, k = jnp.zeros((2, 1, 1, 32)), jnp.zeros((2, 10, 32))
    with pytest.raises(ValueError, match="keep_first / keep_from without last"):
        predicted_logits(q, k, keep_from=jnp.zeros((1,), jnp.int32))


def test_kernel_bounds_without_a_window_keep_no_last_key():
    """`last` alone (no keep_from, keep_first 0): no key is forced to +inf, the last key of the cache included (the
    kernel's "no window" sentinel must lie past every key)."""
    q, k = _rand(7, (2, 2, 1, 32)), _rand(8, (2, 200, 32))
    last = jnp.full((1,), 199, jnp.int32)  # every row sees every key
    plain = np.asarray(predicted_logits_reference(q, k))
    np.testing.assert_allclose(predicted_logits_gpu(q, k, last=last, block_n=128, interpret=True), plain,
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(predicted_logits_reference(q, k, last=last), plain, rtol=1e-6, atol=1e-6)

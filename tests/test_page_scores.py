"""pallas_kernels.page_scores: the Triton kernel (interpret mode) equals the jnp reference, which equals the plain
sum over d of max(q kmax, q kmin); one layer's scores equal its row of a stack's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.page_scores import page_scores
from pallas_kernels.page_scores.gpu import page_scores_gpu
from pallas_kernels.page_scores.reference import page_scores_reference
from pallas_bounds import checked_memory


def _rand(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("L,B,Hkv,R,P,D,layer",
                         [(3, 2, 2, 4, 100, 16, 1), (1, 1, 3, 6, 64, 32, 0), (2, 2, 1, 1, 33, 64, 5)])
def test_kernel_equals_the_reference(L, B, Hkv, R, P, D, layer):
    q = _rand(0, (B, Hkv, R, D))
    a, b = _rand(1, (L, B, Hkv, P, D)), _rand(2, (L, B, Hkv, P, D))
    kmin, kmax = jnp.minimum(a, b), jnp.maximum(a, b)
    want = page_scores_reference(q, kmin, kmax, layer)
    i = min(layer, L - 1)  # the layer index is clamped
    qn, lo, hi = (np.asarray(x, np.float64) for x in (q, kmin[i], kmax[i]))
    plain = np.maximum(qn[:, :, :, None] * hi[:, :, None], qn[:, :, :, None] * lo[:, :, None]).sum(-1)
    np.testing.assert_allclose(want, plain, rtol=1e-5, atol=1e-5)
    got = page_scores_gpu(q, kmin, kmax, layer, block_p=32, interpret=True)  # P = 100, 33: a partial last block
    assert got.shape == (B, Hkv, R, P)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    # One layer's bounds alone give its row of the stack's, bit for bit.
    np.testing.assert_array_equal(page_scores_gpu(q, kmin[i][None], kmax[i][None], 0, block_p=32, interpret=True), got)
    np.testing.assert_array_equal(page_scores(q, kmin[i][None], kmax[i][None], 0, implementation="reference"), want)


def test_errors():
    with pytest.raises(ValueError, match=r"expected q \[B, Hkv, R, D\] and bounds \[L, B, Hkv, P, D\]"):
        page_scores(jnp.zeros((2, 2, 1, 16)), jnp.zeros((1, 2, 3, 8, 16)), jnp.zeros((1, 2, 3, 8, 16)), 0)
    with pytest.raises(ValueError, match="head_dim=24: the kernel takes a power of two"):
        page_scores(jnp.zeros((2, 2, 1, 24)), jnp.zeros((1, 2, 2, 8, 24)), jnp.zeros((1, 2, 2, 8, 24)), 0,
                    implementation="pallas_gpu")


def test_layer_is_checked_and_read_alike():
    """A known layer outside [-L, L) is an error naming it; -1 is the last layer and -L the first, in the reference
    and the kernel alike (as every stacked op reads a layer: pallas_kernels.layers)."""
    q = _rand(0, (1, 2, 3, 16))
    a, b = _rand(1, (3, 1, 2, 40, 16)), _rand(2, (3, 1, 2, 40, 16))
    kmin, kmax = jnp.minimum(a, b), jnp.maximum(a, b)
    for layer in (3, -4):
        with pytest.raises(ValueError, match=rf"layer={layer}: expected a layer in \[-L, L\) of the L=3"):
            page_scores(q, kmin, kmax, layer)
    last = page_scores_reference(q, kmin, kmax, 2)
    np.testing.assert_array_equal(page_scores(q, kmin, kmax, -1, implementation="reference"), last)
    np.testing.assert_allclose(page_scores_gpu(q, kmin, kmax, -1, block_p=32, interpret=True), last, rtol=1e-6,
                               atol=1e-5)
    first = page_scores_reference(q, kmin, kmax, 0)
    for layer in (-3, jnp.int32(-3)):  # the range's lower bound, static and traced
        np.testing.assert_array_equal(page_scores(q, kmin, kmax, layer, implementation="reference"), first)
    assert not np.array_equal(first, last)


def test_kernel_stores_only_the_valid_pages():
    """The store mask writes pages < P of each row and nothing past them. The wrapper's output is [.., Rp, P], so
    the interpreter drops out-of-bounds lanes whatever the mask (pads, writes, unpads): dropping the mask, or
    widening it to pages <= P, passes every test through `page_scores_gpu`; on a GPU those lanes of row r land in
    row r + 1's first pages (row stride P), a race with the program writing them. So run the kernel into a row
    wider than P (a whole number of blocks, prefilled with a sentinel): pages past P must keep the sentinel
    (their lanes computed page 0's scores), the pages before it the reference's scores."""
    from jax.experimental import pallas as pl

    from pallas_kernels.page_scores.gpu import _kernel

    L, B, Hkv, R, P, D, bp, layer = 2, 1, 2, 3, 37, 16, 16, 1
    Rp, W = 4, 48  # rows padded to a power of two; 3 blocks of 16 pages
    q = _rand(0, (B, Hkv, R, D))
    a, b = _rand(1, (L, B, Hkv, P, D)), _rand(2, (L, B, Hkv, P, D))
    kmin, kmax = jnp.minimum(a, b), jnp.maximum(a, b)
    sentinel = 12345.0
    bounds = pl.BlockSpec((L, None, None, P, D), lambda b, h, j: (0, b, h, 0, 0))
    out = pl.BlockSpec((None, None, Rp, W), lambda b, h, j: (b, h, 0, 0))
    got = pl.pallas_call(
        lambda lay, q_, lo, hi, _init, o: _kernel(lay, q_, lo, hi, o, n=P, rows=Rp, block_p=bp, L=L),
        grid=(B, Hkv, pl.cdiv(P, bp)),
        in_specs=[pl.BlockSpec((1,), lambda b, h, j: (0,)),
                  pl.BlockSpec((None, None, Rp, D), lambda b, h, j: (b, h, 0, 0)), bounds, bounds, out],
        out_specs=out, out_shape=jax.ShapeDtypeStruct((B, Hkv, Rp, W), jnp.float32),
        input_output_aliases={4: 0}, interpret=True,
    )(jnp.array([layer], jnp.int32), jnp.pad(q, ((0, 0), (0, 0), (0, Rp - R), (0, 0))), kmin, kmax,
      jnp.full((B, Hkv, Rp, W), sentinel, jnp.float32))
    np.testing.assert_array_equal(got[..., P:], sentinel)  # lanes past P: not stored
    np.testing.assert_allclose(got[:, :, :R, :P], page_scores_reference(q, kmin, kmax, layer), rtol=1e-6, atol=1e-5)


def test_kernel_stays_in_its_blocks():
    """Every load and store of the kernel stays inside its block (`pallas_bounds.checked_memory`, which sees what
    the sentinel above sees through any wrapper: a lane that a GPU would store into the next row's pages): 37 pages
    in blocks of 16 (a partial last block), 3 query rows padded to 4, the last layer named -1."""
    q = _rand(0, (2, 2, 3, 16))
    a, b = _rand(1, (2, 2, 2, 37, 16)), _rand(2, (2, 2, 2, 37, 16))
    kmin, kmax = jnp.minimum(a, b), jnp.maximum(a, b)
    with checked_memory():
        got = page_scores_gpu(q, kmin, kmax, jnp.int32(-1), block_p=16, interpret=True)
        np.testing.assert_allclose(got, page_scores_reference(q, kmin, kmax, 1), rtol=1e-6, atol=1e-5)

"""Comparisons of two computations that round alike on a CPU host and differently on an accelerator."""

import jax
import numpy as np


def assert_same_or_close(got, want, *, rtol: float, atol: float) -> None:
    """Bit for bit on a CPU host (the two sides run the same XLA ops); within rtol / atol on a GPU or TPU host,
    whose compiled kernels and fusions sum f32 in another order (on an H200, 1 ulp to 8e-6 apart)."""
    got, want = np.asarray(got), np.asarray(want)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)

"""The Mosaic GPU decode GEMM of eval/results/h200/mgpu_gemm/ (an experiment, not shipped: NOTES.md there) against
x @ w[layer] on random inputs, in the Mosaic GPU interpreter."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "eval", "results", "h200", "mgpu_gemm", "mgpu_gemm.py")
_spec = importlib.util.spec_from_file_location("mgpu_gemm_experiment", _PATH)
mg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mg)


@pytest.mark.parametrize("config", [mg.Config(64, 64, 1, 2), mg.Config(64, 64, 2, 2), mg.Config(64, 64, 2, 2, pdl=True)])
def test_mgpu_gemm_equals_the_layer_matmul(config):
    L, K, N, M = 3, 256, 128, 16
    w = jax.random.normal(jax.random.key(0), (L, K, N), jnp.float32).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (M, K), jnp.float32).astype(jnp.bfloat16)
    got = mg.mgpu_gemm(x, w, 2, config, interpret=True)
    want = x.astype(jnp.float32) @ w[2].astype(jnp.float32)
    assert got.shape == (M, N) and got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=1e-2, atol=0.25)
    other = x.astype(jnp.float32) @ w[1].astype(jnp.float32)  # the layer index is honoured
    assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - other))) > 1.0


def test_mgpu_gemm_rejects_shapes_it_cannot_tile():
    w = jnp.zeros((2, 256, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="rows M=12"):
        mg.mgpu_gemm(jnp.zeros((12, 256), jnp.bfloat16), w, 0)
    with pytest.raises(ValueError, match="tile_k\\*split_k=512"):
        mg.mgpu_gemm(jnp.zeros((8, 256), jnp.bfloat16), w, 0, mg.Config(64, 128, 4, 2))
    with pytest.raises(ValueError, match="x has K=128, w has K=256"):
        mg.mgpu_gemm(jnp.zeros((8, 128), jnp.bfloat16), w, 0)

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
from pallas_kernels.topk_select.testing import adversarial
from lowering import H100, abstract_device

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


@pytest.mark.parametrize("cap", [512, 32])  # 32: every band overflows, so every row takes the fallback
def test_sample_matches_reference(cap):
    rng = np.random.default_rng(cap)
    config = gpu.SelectConfig(**{**SAMPLE, "band_cap": cap})
    R, N, K = 12, 2048, 300
    fn = jax.jit(lambda x, k: gpu.topk_select_gpu(x, k, K, config=config, interpret=True))
    _check(fn, rng, R, N, K)
    x = rng.standard_normal((R, N)).astype(np.float32)  # continuous rows, k from 0 to K
    k = np.linspace(0, K, R).astype(np.int32)
    want = np.asarray(topk_select_reference(jnp.asarray(x), jnp.asarray(k), K))
    np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(x), jnp.asarray(k))), want)


def test_sample_bracket_holds_on_continuous_rows():
    """White box: on continuous scores the sampled bracket holds the threshold and the band fits, so the exact
    in-register search (not the fallback) decides; a periodic row aligned with the sample stride misses."""
    from pallas_kernels.topk_select import gpu_sample
    rng = np.random.default_rng(3)
    R, N, K = 8, 8192, 600
    x = rng.standard_normal((R, N)).astype(np.float32)
    x[-1] = np.where(np.arange(N) % 8 == 0, 5.0, rng.random(N)).astype(np.float32)  # stride 8 sees only 5.0
    k = np.array([1, 10, 100, 300, 409, 500, 600, 300], np.int32)
    above, n_band, _ = gpu_sample.sample_band(
        jnp.asarray(x), jnp.asarray(k)[:, None], K, sample=1024, sigmas=4.0, cap=2048, bits=2, block_n=128,
        target_programs=24, params=None, interpret=True)
    u, nb = np.asarray(above).sum(1), np.asarray(n_band)[:, 0]
    fast = (u < k) & (k <= u + nb) & (nb <= 2048)
    assert fast[:-1].all() and not fast[-1], (u, nb, k)
    assert (nb[:-1] < N // 8).all()  # the band is a small part of the row
    got = gpu.topk_select_gpu(jnp.asarray(x), jnp.asarray(k), K, interpret=True,
                              config=gpu.SelectConfig(**{**SAMPLE, "sample_size": 1024, "band_cap": 2048}))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(topk_select_reference(jnp.asarray(x), jnp.asarray(k), K)))


def test_dispatch_and_config_errors():
    assert gpu.SelectConfig().pick_path(16384) == "row"
    assert gpu.SelectConfig().pick_path(16385) == "sample"
    assert gpu.SelectConfig(row_max=1000).pick_path(6256) == "fused"  # shorter than the sample (8192)
    assert gpu.SelectConfig(path="passes").pick_path(10) == "passes"
    assert gpu.SelectConfig(path="sample").pick_path(8191) == "fused"  # shorter than the sample
    assert gpu.SelectConfig(path="sample").pick_path(8192) == "sample"
    x = jnp.zeros((2, 40), jnp.float32)
    for bad, match in [(dict(path="tree"), "path='tree'"), (dict(row_max=1 << 16), "row_max=65536"),
                       (dict(row_bits=3), "row_bits=3"), (dict(row_warps=6), "row_warps=6"),
                       (dict(sample_size=1000), "sample_size=1000"), (dict(band_cap=65536), "band_cap=65536"),
                       (dict(sample_sigmas=0.0), "sample_sigmas=0.0")]:
        with pytest.raises(ValueError, match=match):
            gpu.topk_select_gpu(x, 1, 4, config=gpu.SelectConfig(**bad), interpret=True)
    with pytest.raises(ValueError, match="N=40000"):
        gpu_row.topk_select_rows(jnp.zeros((1, 40000), jnp.float32), jnp.zeros((1,), jnp.int32), 8)


@pytest.mark.parametrize("path,shape,K,launches", [
    ("row", (32, 6256), 64, 1), ("fused", (64, 131072), 13108, 10), ("sample", (64, 131072), 13108, 5)])
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

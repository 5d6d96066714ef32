"""Sliding-window attention with sinks: the Triton and TPU kernels (interpret mode) and the blocked jnp version
against a dense masked reference on random inputs, CUDA lowering for an H100, TPU lowering, dispatch and argument
errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import triton as plgpu

from host_rounding import assert_same_or_close
from pallas_kernels.local_attention import (BlockSizes, banded_mask, default_implementation, local_attention,
                                            local_attention_gpu, local_attention_reference, local_attention_tpu)
from pallas_kernels.sparse_attention.reference import masked_attention_reference
from lowering import H100, TPU_V5E, abstract_device
from pallas_bounds import checked_memory


def _inputs(seed, T, Hq, Hkv, D, dtype, B=2):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = (2.0 * jax.random.normal(ks[0], (B, T, Hq, D))).astype(dtype)
    k = (2.0 * jax.random.normal(ks[1], (B, T, Hkv, D))).astype(dtype)
    v = jax.random.normal(ks[2], (B, T, Hkv, D)).astype(dtype)
    return q, k, v


def _dense_reference(q, k, v, window, sinks, scale=None):
    B, T, Hq, _ = q.shape
    f = lambda x: x.astype(jnp.float32)  # noqa: E731
    mask = jnp.broadcast_to(jnp.asarray(banded_mask(T, window, sinks)), (B, Hq, T, T))
    return masked_attention_reference(f(q), f(k).transpose(0, 2, 1, 3), f(v).transpose(0, 2, 1, 3), mask,
                                      scale=scale)


CASES = [  # T, Hq, Hkv, D, window, sinks, dtype, block sizes
    (100, 4, 2, 16, 16, 4, jnp.float32, None),
    (130, 3, 1, 64, 64, 4, jnp.float32, None),  # T not a multiple of the block, window = block
    (37, 2, 2, 8, 8, 0, jnp.float32, None),  # no sinks, D padded to 16
    (50, 2, 1, 16, 7, 60, jnp.float32, None),  # sinks past T: every key visible (causal)
    (200, 2, 1, 32, 100, 3, jnp.bfloat16, BlockSizes(block_q=32, block_k=128)),  # window > block, bf16
    (96, 2, 1, 16, 1, 0, jnp.float32, None),  # window 1: each query sees itself
    (200, 2, 1, 16, 8, 70, jnp.float32, BlockSizes(block_q=32, block_k=16)),  # sinks over several key blocks
]


@pytest.mark.parametrize("T,Hq,Hkv,D,window,sinks,dtype,bs", CASES)
def test_kernel_interpret_and_blocked_jnp_match_dense_reference(T, Hq, Hkv, D, window, sinks, dtype, bs):
    q, k, v = _inputs(T, T, Hq, Hkv, D, dtype)
    want = _dense_reference(q, k, v, window, sinks)
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
    got = local_attention_gpu(q, k, v, window=window, sinks=sinks, block_sizes=bs, interpret=True)
    assert got.shape == q.shape and got.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol)
    blocked = local_attention_reference(q, k, v, window=window, sinks=sinks)
    np.testing.assert_allclose(np.asarray(blocked, np.float32), want, rtol=tol, atol=tol)


def test_kernel_stays_in_its_blocks():
    """Every load of the Triton kernel stays inside its block (`pallas_bounds.checked_memory`: the interpreter pads
    stray loads, where a GPU reads another head's rows or past the keys): T = 45 in query and key blocks of 16 (a
    partial last block of each), D = 8 padded to 16, G = 3, sinks and a window that cross block edges."""
    q, k, v = _inputs(45, 45, 3, 1, 8, jnp.float32)
    with checked_memory():  # unjitted: traced under the check
        got = local_attention_gpu.__wrapped__(q, k, v, window=7, sinks=5, interpret=True,
                                              block_sizes=BlockSizes(block_q=16, block_k=16))
        np.testing.assert_allclose(got, _dense_reference(q, k, v, 7, 5), rtol=2e-5, atol=2e-5)


TPU_CASES = [  # T, Hq, Hkv, D, window, sinks, dtype: the kernel serves window <= 129, sinks <= 128
    (300, 4, 2, 128, 64, 4, jnp.float32),  # D = 128: blocks read from the caller's layout
    (200, 2, 1, 64, 129, 0, jnp.float32),  # the widest window, D < 128: head-major copies
    (130, 3, 1, 16, 1, 128, jnp.float32),  # window 1, the most sinks
    (260, 2, 2, 128, 100, 7, jnp.bfloat16),
]


@pytest.mark.parametrize("T,Hq,Hkv,D,window,sinks,dtype", TPU_CASES)
def test_tpu_kernel_interpret_matches_dense_reference(T, Hq, Hkv, D, window, sinks, dtype):
    q, k, v = _inputs(T + 1, T, Hq, Hkv, D, dtype)
    got = local_attention_tpu(q, k, v, window=window, sinks=sinks, interpret=True)
    assert got.shape == q.shape and got.dtype == q.dtype
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(np.asarray(got, np.float32), _dense_reference(q, k, v, window, sinks), rtol=tol,
                               atol=tol)


@pytest.mark.parametrize("D", [128, 64])
def test_tpu_lowering(D):
    q = jax.ShapeDtypeStruct((1, 4096, 32, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 4096, 8, D), jnp.bfloat16)
    with abstract_device(*TPU_V5E):
        exported = jax.export.export(jax.jit(lambda q, k, v: local_attention_tpu(q, k, v, window=64, sinks=4)),
                                     platforms=["tpu"])(q, k, k)
    assert exported.mlir_module().count("tpu_custom_call") == 1


@pytest.mark.parametrize("window", [64, 10**6])  # a window past T: blocks of T, not of the window
def test_window_covering_everything_is_causal_dense(window):
    q, k, v = _inputs(1, 64, 2, 1, 16, jnp.float32)
    got = local_attention(q, k, v, window=window, sinks=np.int64(2))  # numpy integers are integers
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_cuda_lowering_for_h100():
    q = jax.ShapeDtypeStruct((1, 4096, 32, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16)
    with abstract_device(*H100):
        exported = jax.export.export(
            jax.jit(lambda q, k, v: local_attention_gpu(q, k, v, window=64, sinks=4)), platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(plgpu.CUSTOM_CALL_TARGET_NAME)],
        )(q, k, k)
    assert exported.mlir_module().count("xla.gpu.triton") == 1


def test_dispatch_and_errors():
    q, k, v = _inputs(2, 40, 2, 1, 8, jnp.float32)
    assert_same_or_close(local_attention(q, k, v, window=8, sinks=2),  # cpu -> "xla", the reference's ops
                         local_attention_reference(q, k, v, window=8, sinks=2), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="window=0"):
        local_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="sinks=-1"):
        local_attention(q, k, v, window=8, sinks=-1)
    with pytest.raises(ValueError, match="window=2.0"):
        local_attention(q, k, v, window=2.0)
    with pytest.raises(ValueError, match="implementation='cuda'"):
        local_attention(q, k, v, window=8, implementation="cuda")
    with pytest.raises(ValueError, match="Hq a multiple"):
        local_attention(q[:, :, :1].repeat(3, axis=2), jnp.concatenate([k, k], axis=2),
                        jnp.concatenate([v, v], axis=2), window=8)
    with pytest.raises(ValueError, match="one dtype"):
        local_attention(q, k.astype(jnp.bfloat16), v, window=8)
    for scale in (0.0, -1.0, float("nan")):  # a bad scale ran (0: uniform weights; < 0: the least similar keys)
        with pytest.raises(ValueError, match="scale=.*expected a finite positive number"):
            local_attention(q, k, v, window=8, scale=scale)
    with pytest.raises(ValueError, match="q has dtype int32: expected a floating dtype"):
        local_attention(*(x.astype(jnp.int32) for x in (q, k, v)), window=8)
    with pytest.raises(ValueError, match="BlockSizes.block_q"):
        BlockSizes(block_q=48)
    if jax.default_backend() == "cpu":
        assert default_implementation(64, 4) == "xla"
    with pytest.raises(ValueError, match="window=200, sinks=4: the TPU kernel serves window <= 129"):
        local_attention(q, k, v, window=200, sinks=4, implementation="pallas_tpu")


@pytest.mark.parametrize("scale", [0.05, 0.9])
def test_xla_path_uses_the_given_scale(scale):
    """The CPU default honours a custom softmax scale (no library caller passes one, so a path falling back to
    1/sqrt(D) had passed every other test; a mutation audit's survivor)."""
    q, k, v = _inputs(0, 45, 4, 2, 16, jnp.float32)
    got = local_attention(q, k, v, window=8, sinks=3, scale=scale, implementation="xla")
    want = _dense_reference(q, k, v, 8, 3, scale=scale)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    default = local_attention(q, k, v, window=8, sinks=3, implementation="xla")
    assert float(jnp.max(jnp.abs(default - want))) > 1e-2  # the test tells the scales apart

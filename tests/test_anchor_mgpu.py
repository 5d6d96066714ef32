"""Mosaic GPU anchor scoring kernels (`anchor_attention.mgpu_prefill`): in the Mosaic GPU interpreter (simulated
warpgroups, barriers, TMA and shared memory) against the jnp references, their CUDA lowering, dispatch and
errors."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as mgpu_interpreter
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.anchor_attention import gpu_prefill, mgpu_prefill, tile_scores_reference

# A miscounted barrier makes the interpreter wait forever: fail instead.
pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("mosaic_interpreter_on_the_cpu")]


def _inputs(seed, B, T, Hq, Hkv, D):
    kq, kk = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(kq, (B, T, Hq, D), jnp.bfloat16), jax.random.normal(kk, (B, T, Hkv, D), jnp.bfloat16))


def _lse_reference(q, k):
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    kr = jnp.repeat(k.astype(jnp.float32), G, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kr) / np.sqrt(D)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
    return jax.nn.logsumexp(s, axis=-1)


@pytest.mark.parametrize("B,T,Hq,Hkv,D,opts", [
    (1, 300, 4, 2, 64, dict(rows=128)),  # T padded to 512; the default layout
    (2, 200, 3, 1, 64, dict(rows=64, block_kv=64, stages=2, schedule=False, tile=32)),  # GQA of 3, short steps
    (1, 384, 2, 2, 128, dict(rows=64)),  # no GQA, D 128
    (1, 150, 2, 1, 64, dict(rows=128, tile=64)),
    # buffers wrap around with turns taken, a drain of several steps (rows 128, block_kv 64), tile 32
    (2, 257, 2, 1, 64, dict(rows=128, block_kv=64, stages=2, tile=32)),
])
def test_interpret_matches_reference(B, T, Hq, Hkv, D, opts):
    q, k = _inputs(T, B, T, Hq, Hkv, D)
    interp = dict(interpret=True, rows=opts["rows"], schedule=opts.get("schedule", True))
    lse = mgpu_prefill.prefill_lse_mgpu(q, k, block_kv=opts.get("block_kv", 128), stages=opts.get("stages", 4),
                                        **interp)
    want_lse = _lse_reference(q, k)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=2e-5, rtol=1e-5)
    tile = opts.get("tile", 128)
    got = np.asarray(mgpu_prefill.tile_scores_mgpu(q, k, lse, tile=tile, stages=opts.get("stages", 2), **interp))
    want = np.asarray(tile_scores_reference(q, k, tile=tile))
    assert got.shape == want.shape
    fin = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), fin)  # -inf at and after each tile's start
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-4, atol=1e-6)
    assert np.all(got[~fin] == -np.inf)


@pytest.mark.parametrize("rows", [64, 128])
def test_no_shared_memory_races(rows):
    """The interpreter's race detector: no shared-memory access of one thread (warpgroup or TMA) unordered with a
    conflicting one of another (e.g. a buffer overwritten by TMA while still being read)."""
    q, k = _inputs(3, 1, 300, 2, 1, 64)
    params = plgpu.InterpretGPUParams(detect_races=True)
    lse = jax.block_until_ready(mgpu_prefill.prefill_lse_mgpu(q, k, rows=rows, block_kv=64, stages=2,
                                                              interpret=params))
    assert not mgpu_interpreter.get_races().races_found, "lse pass"
    jax.block_until_ready(mgpu_prefill.tile_scores_mgpu(q, k, lse, tile=32, rows=rows, interpret=params))
    assert not mgpu_interpreter.get_races().races_found, "pooling pass"


def test_lowers_for_cuda():
    sds = jax.ShapeDtypeStruct
    q, k = sds((1, 1024, 32, 128), jnp.bfloat16), sds((1, 1024, 8, 128), jnp.bfloat16)
    lse = sds((1, 32, 1024), jnp.float32)
    text = jax.export.export(mgpu_prefill.prefill_lse_mgpu, platforms=["cuda"])(q, k).mlir_module()
    assert "anchor_prefill_lse_mgpu" in text and "mosaic_gpu" in text
    for tile in (128, 32):  # (32: each step's row sums split into four tiles by static column slices)
        f = jax.jit(lambda q, k, lse, tile=tile: mgpu_prefill.tile_scores_mgpu(q, k, lse, tile=tile))
        text = jax.export.export(f, platforms=["cuda"])(q, k, lse).mlir_module()
        assert "anchor_prefill_pool_mgpu" in text and "mosaic_gpu" in text


def test_dispatch_and_errors():
    q, k = _inputs(0, 1, 256, 4, 2, 64)
    assert mgpu_prefill.mgpu_shapes_ok(q, k, 128) and mgpu_prefill.mgpu_shapes_ok(q, k, 32)
    assert mgpu_prefill.mgpu_shapes_ok(q[..., :32].repeat(4, -1), k[..., :32].repeat(4, -1))  # D 128
    assert not mgpu_prefill.mgpu_shapes_ok(q, k, 16)  # tile
    assert not mgpu_prefill.mgpu_shapes_ok(q.astype(jnp.float32), k.astype(jnp.float32))  # dtype
    assert not mgpu_prefill.mgpu_shapes_ok(q, k.astype(jnp.float16))  # q and k differ
    q256 = jax.ShapeDtypeStruct((1, 256, 4, 256), jnp.bfloat16)  # D 256: its buffers exceed shared memory
    assert not mgpu_prefill.mgpu_shapes_ok(q256, jax.ShapeDtypeStruct((1, 256, 2, 256), jnp.bfloat16))
    # interpret mode and mosaic=False never take the Mosaic kernels; compiled calls do only on Hopper
    cfg = gpu_prefill.PrefillScoresConfig()
    assert not gpu_prefill._use_mosaic(q, k, 128, cfg, interpret=True)
    assert not gpu_prefill._use_mosaic(q, k, 128, gpu_prefill.PrefillScoresConfig(mosaic=False), interpret=False)
    assert gpu_prefill._use_mosaic(q, k, 128, cfg, interpret=False) == mgpu_prefill.hopper()
    with pytest.raises(ValueError, match="tile=16"):
        mgpu_prefill.tile_scores_mgpu(q, k, jnp.zeros((1, 4, 256)), tile=16, interpret=True)
    with pytest.raises(ValueError, match="rows=32"):
        mgpu_prefill.prefill_lse_mgpu(q, k, rows=32, interpret=True)
    with pytest.raises(ValueError, match="block_kv=256"):
        mgpu_prefill.prefill_lse_mgpu(q, k, block_kv=256, interpret=True)
    with pytest.raises(ValueError, match="bf16 or f16"):
        mgpu_prefill.prefill_lse_mgpu(q.astype(jnp.float32), k.astype(jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="D=48"):
        mgpu_prefill.prefill_lse_mgpu(q[..., :48], k[..., :48], interpret=True)

"""Mosaic GPU tile-gathered sparse prefill (`sparse_attention.mgpu_prefill`): in the Mosaic GPU interpreter
(simulated warpgroups, barriers, TMA and shared memory) against `sparse_prefill_reference`, its CUDA lowering,
the entry compaction, the API's `implementation="mosaic_gpu"` and the errors."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as mgpu_interpreter
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.sparse_attention import mgpu_prefill as mg
from pallas_kernels.sparse_attention import sparse_decode, sparse_prefill, supported
from pallas_kernels.sparse_attention.reference import sparse_prefill_reference
from pallas_kernels.sparse_attention.testing import random_prefill_indices

# A miscounted barrier makes the interpreter wait forever: fail instead.
pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("mosaic_interpreter_on_the_cpu")]


def _inputs(seed, B, T, Hq, Hkv, D, dtype=jnp.bfloat16):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (B, T, Hq, D), dtype), jax.random.normal(kk, (B, T, Hkv, D), dtype),
            jax.random.normal(kv, (B, T, Hkv, D), dtype))


def _indices(seed, B, T, Hkv, K, tile, bs, shuffle=False):
    idx = random_prefill_indices(np.random.default_rng(seed), T, Hkv, B, K, tile=tile, block_size=bs)
    if shuffle:  # the contract lets -1 and the ignored entries sit anywhere
        idx = np.random.default_rng(seed + 1).permutation(idx, axis=-1)
    return jnp.asarray(idx)


def _check(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    tol = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3}[dtype]
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert err < tol, f"relative max error {err:.3g} >= {tol}"


# (B, T, Hq, Hkv, D, tile, block_size, K entries, config, dtype, shuffled)
CASES = [
    # tile 128: a CTA is one query head's tile (two warpgroups of 64 rows), turns taken on the tensor cores
    (1, 256, 2, 1, 64, 128, 16, 6, dict(), jnp.bfloat16, False),
    # tile 64, two rows (the second shorter), T padded to whole tiles, 8-token blocks, 3 stages (ring wraps)
    (2, 150, 2, 1, 64, 64, 8, 7, dict(block_kv=64, stages=3), jnp.bfloat16, True),
    # tile 32, G = 2: one warpgroup (64 rows = two heads of 32), no turns; D 128; f16
    (1, 160, 2, 1, 128, 32, 16, 5, dict(block_kv=64), jnp.float16, True),
    # tile 32, G = 4: both warpgroups hold two heads each; blocks of a whole tile
    (1, 96, 4, 1, 64, 32, 32, 2, dict(block_kv=64), jnp.bfloat16, False),
]


@pytest.mark.parametrize("B,T,Hq,Hkv,D,tile,bs,K,cfg,dtype,shuffle", CASES)
def test_interpret_matches_reference(B, T, Hq, Hkv, D, tile, bs, K, cfg, dtype, shuffle):
    q, k, v = _inputs(T + tile, B, T, Hq, Hkv, D, dtype)
    idx = _indices(T, B, T, Hkv, K, tile, bs, shuffle)
    lengths = jnp.asarray([T, T - 41][:B], jnp.int32)
    got = mg.sparse_prefill_mgpu(q, k, v, idx, lengths, tile=tile, block_size=bs,
                                 config=mg.MosaicPrefillConfig(**cfg), interpret=True)
    want = sparse_prefill_reference(q, k, v, idx, lengths, tile=tile, block_size=bs)
    assert got.dtype == q.dtype
    _check(got, want, dtype)
    if B > 1:  # rows at or beyond the length are zeros
        assert not np.any(np.asarray(got[1, T - 41:], np.float32))


def test_no_shared_memory_races():
    """The interpreter's race detector: no shared-memory access of one thread (warpgroup or TMA) unordered with a
    conflicting one of another (e.g. a K/V buffer refilled while still being read)."""
    q, k, v = _inputs(5, 1, 128, 2, 1, 64)
    idx = _indices(5, 1, 128, 1, 4, 64, 16)
    params = plgpu.InterpretGPUParams(detect_races=True)
    jax.block_until_ready(mg.sparse_prefill_mgpu(q, k, v, idx, jnp.asarray([128], jnp.int32), tile=64,
                                                 block_size=16, config=mg.MosaicPrefillConfig(block_kv=64),
                                                 interpret=params))
    assert not mgpu_interpreter.get_races().races_found


def test_compact_entries():
    idx = jnp.asarray([[[[3, -1, 0, 9, 1], [-1, -1, -1, -1, -1], [7, 2, -1, 5, 6]]]], jnp.int32)  # [1, 1, 3, 5]
    ent, count = mg.compact_entries(idx, tile=32, block_size=8)  # tile starts 0, 32, 64: blocks < 0, 4, 8
    np.testing.assert_array_equal(np.asarray(count), [[[0, 0, 4]]])
    np.testing.assert_array_equal(np.asarray(ent[0, 0, 2]), [7, 2, 5, 6, 0])  # valid first, in order, then 0
    ent, count = mg.compact_entries(idx, tile=64, block_size=8)  # starts 0, 64, 128: blocks < 0, 8, 16
    np.testing.assert_array_equal(np.asarray(count), [[[0, 0, 4]]])
    # An entry whose block start overflows int32 (2^28 * 8 = 2^31 wraps to -2^31 < every start) is past every
    # tile, not before it: compared as ind < ceil(start / block_size), never multiplied.
    huge = jnp.asarray([[[[2 ** 28, 1], [2 ** 29 + 1, 3], [2 ** 30, 9]]]], jnp.int32)
    ent, count = mg.compact_entries(huge, tile=32, block_size=8)
    np.testing.assert_array_equal(np.asarray(count), [[[0, 1, 0]]])
    np.testing.assert_array_equal(np.asarray(ent[0, 0, 1]), [3, 0])


def test_useful_end_never_counts_an_index_whose_block_start_overflows():
    """`gpu_common._useful_end` (1 + the last entry whose block starts at or before the limit), the tile-gathered
    prefill's and the decode's bound on the entries they read: an index past 2^31 / block_size is past every limit
    (its start, multiplied out, would wrap around int32 to a negative and count as usable), and limit -1 (nothing
    visible) takes no entry."""
    from pallas_kernels.sparse_attention.gpu_common import _useful_end
    idx = jnp.asarray([[0, 2, 2 ** 28, 5], [2 ** 29 + 1, 1, -1, 2 ** 28 + 3], [0, 1, 2, 3]], jnp.int32)
    end = _useful_end(idx, jnp.asarray([40, 15, -1], jnp.int32), block_size=8)  # blocks <= 5, <= 1, none
    np.testing.assert_array_equal(np.asarray(end), [4, 2, 0])
    end = _useful_end(idx, jnp.asarray([39, 7, 0], jnp.int32), block_size=8)  # blocks <= 4, <= 0, <= 0
    np.testing.assert_array_equal(np.asarray(end), [2, 0, 1])


@pytest.mark.parametrize("tile,bs,block_kv", [(128, 64, 128), (32, 8, 64)])
def test_lowers_for_cuda(tile, bs, block_kv):
    sds = jax.ShapeDtypeStruct
    T = 2048
    q, kv = sds((1, T, 32, 128), jnp.bfloat16), sds((1, T, 8, 128), jnp.bfloat16)
    idx, lens = sds((1, 8, T // tile, 40), jnp.int32), sds((1,), jnp.int32)
    cfg = mg.MosaicPrefillConfig(block_kv=block_kv)
    f = jax.jit(lambda q, k, v, i, l: mg.sparse_prefill_mgpu(q, k, v, i, l, tile=tile, block_size=bs, config=cfg))
    text = jax.export.export(f, platforms=["cuda"])(q, kv, kv, idx, lens).mlir_module()
    assert "sparse_prefill_mgpu" in text and "mosaic_gpu" in text


def test_errors_and_dispatch():
    q, k, v = _inputs(0, 1, 128, 4, 1, 64)
    idx = _indices(0, 1, 128, 1, 4, 64, 16)
    lens = jnp.asarray([128], jnp.int32)
    call = lambda **kw: mg.sparse_prefill_mgpu(*kw.pop("qkv", (q, k, v)), kw.pop("idx", idx), lens, **kw)
    with pytest.raises(ValueError, match="block_size=1 .*Triton"):
        call(tile=64, block_size=1, idx=_indices(0, 1, 128, 1, 4, 64, 1), interpret=True)
    with pytest.raises(ValueError, match="tile=16"):
        call(tile=16, block_size=16, idx=_indices(0, 1, 128, 1, 4, 16, 16), interpret=True)
    with pytest.raises(ValueError, match="dtype float32"):
        call(tile=64, block_size=16, qkv=(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)),
             interpret=True)
    with pytest.raises(ValueError, match="D=32"):
        call(tile=64, block_size=16, qkv=(q[..., :32], k[..., :32], v[..., :32]), interpret=True)
    with pytest.raises(ValueError, match="G \\* tile = 1 \\* 32"):
        call(tile=32, block_size=16, qkv=_inputs(0, 1, 128, 1, 1, 64), idx=_indices(0, 1, 128, 1, 4, 32, 16),
             interpret=True)
    with pytest.raises(ValueError, match="block_kv=96"):
        call(tile=64, block_size=16, config=mg.MosaicPrefillConfig(block_kv=96), interpret=True)
    with pytest.raises(ValueError, match="stages=1"):
        call(tile=64, block_size=16, config=mg.MosaicPrefillConfig(stages=1), interpret=True)
    # The API: picked by default only on Hopper (tests/test_kascade_blocks.py); named explicitly, it runs only on
    # Hopper (clear errors elsewhere).
    assert not supported("mosaic_gpu", q, block_size=1, tile=64)
    assert supported("mosaic_gpu", q, block_size=16, tile=64) == mg.hopper()
    if not mg.hopper():
        with pytest.raises(ValueError, match="implementation='mosaic_gpu' cannot run.*Hopper"):
            sparse_prefill(q, k, v, idx, lens, tile=64, block_size=16, implementation="mosaic_gpu")
    with pytest.raises(ValueError, match="implementation='mosaic_gpu' cannot run.*decode"):
        sparse_decode(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), jnp.zeros((1, 1, 128, 2), jnp.int32),
                      lens, implementation="mosaic_gpu")

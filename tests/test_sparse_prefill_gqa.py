"""GQA-packed tile-gathered prefill (`gpu_prefill_gqa.sparse_prefill_gqa_gpu`): interpret mode equals
`reference.sparse_prefill_reference` (odd T, short rows, -1 anywhere in the indices, block_size 1 and 4, G 2
and 4, 1 / 2 / 4 parts per tile, f32 and bf16), bad configs raise, and the kernel lowers for CUDA at
Llama-3.1-8B shapes."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.sparse_attention import reference as ref
from pallas_kernels.sparse_attention.gpu_prefill_gqa import PrefillGQAConfig, plan, sparse_prefill_gqa_gpu
from pallas_kernels.sparse_attention.testing import random_prefill_indices

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _assert_close(got, want, dtype, what):
    got = np.asarray(jnp.asarray(got, jnp.float32))
    want = np.asarray(jnp.asarray(want, jnp.float32))
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.all(np.isfinite(got)), f"{what}: non-finite output"
    tol = TOL[dtype] * max(1.0, float(np.max(np.abs(want))))
    err = float(np.max(np.abs(got - want)))
    assert err <= tol, f"{what}: max abs err {err:.3g} > {tol:.3g}"


def _inputs(seed, B, T, Hq, Hkv, D, K, lengths, tile, block_size, dtype):
    rng = np.random.default_rng(seed)
    randn = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32)).astype(dtype)  # noqa: E731
    q, k, v = randn(B, T, Hq, D), randn(B, T, Hkv, D), randn(B, T, Hkv, D)
    idx = random_prefill_indices(rng, T, Hkv, B, K, tile=tile, block_size=block_size, fill=0.8)
    idx[rng.random(idx.shape) < 0.15] = -1  # -1 may sit anywhere, not only at the end
    return q, k, v, jnp.asarray(idx), jnp.asarray(np.asarray(lengths, np.int32))


# (B, T, Hq, Hkv, D, K, lengths, tile, block_size), rows_per_program M, block_k, dtype; parts = G * tile / M.
CASES = [
    ((2, 45, 8, 2, 16, 6, [45, 30], 8, 1), 16, 8, jnp.float32),  # G 4, parts 2, odd T, short row
    ((1, 37, 4, 2, 16, 5, [29], 8, 4), 16, 8, jnp.float32),  # G 2, parts 1, block_size 4
    ((1, 40, 4, 2, 16, 6, [40], 16, 1), 8, 8, jnp.float32),  # G 2, parts 4, 2 diagonal chunks per tile
    ((2, 50, 8, 2, 32, 5, [0, 41], 16, 4), 32, 16, jnp.bfloat16),  # G 4, parts 2, empty row, bf16
    ((1, 29, 8, 2, 16, 7, [29], 8, 1), 64, 16, jnp.bfloat16),  # G 4, M above G * tile: parts 1
]


@pytest.mark.parametrize("case,M,block_k,dtype", CASES)
def test_matches_reference(case, M, block_k, dtype):
    B, T, Hq, Hkv, D, K, lengths, tile, bs = case
    q, k, v, idx, lens = _inputs(hash((T, M, block_k)) % 1000, B, T, Hq, Hkv, D, K, lengths, tile, bs, dtype)
    cfg = PrefillGQAConfig(block_k=block_k, rows_per_program=M)
    got = sparse_prefill_gqa_gpu(q, k, v, idx, lens, tile=tile, block_size=bs, config=cfg, interpret=True)
    want = ref.sparse_prefill_reference(q, k, v, idx, lens, tile=tile, block_size=bs)
    _assert_close(got, want, dtype, f"gqa prefill {case}")
    out = np.asarray(got, np.float32)
    for b, n in enumerate(lengths):
        assert np.all(out[b, n:] == 0), "rows at or beyond the length must be zeros"


def test_plan():
    assert plan(PrefillGQAConfig(), 4, 128, 1) == (256, 2, 64, 64)
    assert plan(PrefillGQAConfig(rows_per_program=128), 4, 128, 1) == (128, 4, 32, 64)
    assert plan(PrefillGQAConfig(rows_per_program=512, block_k=32), 4, 128, 4) == (512, 1, 128, 32)
    assert plan(PrefillGQAConfig(block_k=2), 2, 8, 4, interpret=True) == (16, 1, 8, 4)  # block_k >= block_size


def test_config_errors():
    q, k, v, idx, lens = _inputs(0, 1, 32, 4, 2, 16, 4, [32], 16, 1, jnp.float32)
    call = functools.partial(sparse_prefill_gqa_gpu, q, k, v, idx, lens, tile=16, interpret=True)
    for cfg, match in [(PrefillGQAConfig(block_k=48), "block_k=48"),
                       (PrefillGQAConfig(rows_per_program=96), "rows_per_program=96"),
                       (PrefillGQAConfig(rows_per_program=0), "rows_per_program=0"),
                       (PrefillGQAConfig(rows_per_program=1), "rows_per_program=1: expected >= G=2"),
                       (PrefillGQAConfig(num_warps=6), "num_warps=6"),
                       (PrefillGQAConfig(num_stages=0), "num_stages=0")]:
        with pytest.raises(ValueError, match=match):
            call(config=cfg)
    with pytest.raises(ValueError, match="rows_per_program=8: the Triton kernel needs >= 16"):
        plan(PrefillGQAConfig(rows_per_program=8), 4, 128, 1)
    q3 = jnp.zeros((1, 32, 6, 16))  # G = 3
    with pytest.raises(ValueError, match="G=3"):
        sparse_prefill_gqa_gpu(q3, k, v, idx, lens, tile=16, interpret=True)
    with pytest.raises(ValueError, match="tile=12"):
        sparse_prefill_gqa_gpu(q, k, v, jnp.zeros((1, 2, 3, 4), jnp.int32), lens, tile=12, interpret=True)


@pytest.mark.parametrize("M", [128, 256])
def test_lowers_for_cuda(M):
    # Triton lowering (to the TTIR carried by the custom call) runs without a GPU; PTX compilation does not.
    from lowering import export_for
    sds = jax.ShapeDtypeStruct
    B, T, Hq, Hkv, D, tile = 1, 4096, 32, 8, 128, 128
    f = functools.partial(sparse_prefill_gqa_gpu, tile=tile, config=PrefillGQAConfig(rows_per_program=M))
    kv = sds((B, T, Hkv, D), jnp.bfloat16)
    exp = export_for("cuda", f, sds((B, T, Hq, D), jnp.bfloat16), kv, kv, sds((B, Hkv, T // tile, 410), jnp.int32),
                     sds((B,), jnp.int32))
    assert "sparse_prefill_gathered_gqa" in exp.mlir_module()

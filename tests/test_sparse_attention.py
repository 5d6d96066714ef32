"""Gathered sparse attention: references vs brute force, XLA / Pallas GPU / Pallas TPU (interpret) vs references."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp


from pallas_kernels.sparse_attention import gpu, tpu
from pallas_kernels.sparse_attention import reference as ref
from pallas_kernels.sparse_attention import sparse_decode, sparse_prefill
from pallas_kernels.sparse_attention.xla import sparse_decode_xla, sparse_prefill_xla
from pallas_kernels.sparse_attention.testing import random_decode_indices, random_prefill_indices
from lowering import export_for
from pallas_bounds import checked_memory

# Triton-backed Pallas is deprecated upstream in favour of Mosaic GPU; the warning is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def assert_close(got, want, dtype, what=""):
    got = np.asarray(jnp.asarray(got, jnp.float32))
    want = np.asarray(jnp.asarray(want, jnp.float32))
    assert got.shape == want.shape, (got.shape, want.shape)
    # Non-finite values only where the reference has the same ones (lse = -inf on an empty row).
    fin = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), fin) and np.array_equal(got[~fin], want[~fin]), f"{what}: non-finite"
    got, want = got[fin], want[fin]
    # Error relative to the output's magnitude (outputs are convex mixes of unit-normal values).
    tol = TOL[dtype] * max(1.0, float(np.max(np.abs(want))))
    err = float(np.max(np.abs(got - want)))
    assert err <= tol, f"{what}: max abs err {err:.3g} > {tol:.3g}"


def randn(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)


def decode_inputs(seed, B, T, Hq, Hkv, D, N, K, lengths, block_size, dtype, fill=0.8):
    rng = np.random.default_rng(seed)
    q = randn(rng, (B, T, Hq, D), dtype)
    k = randn(rng, (B, Hkv, N, D), dtype)
    v = randn(rng, (B, Hkv, N, D), dtype)
    lengths = np.asarray(lengths, np.int32)
    idx = random_decode_indices(rng, lengths, Hkv, T, K, block_size=block_size, fill=fill)
    return q, k, v, jnp.asarray(idx), jnp.asarray(lengths)


def prefill_inputs(seed, B, T, Hq, Hkv, D, K, lengths, tile, block_size, dtype, fill=0.8):
    rng = np.random.default_rng(seed)
    q = randn(rng, (B, T, Hq, D), dtype)
    k = randn(rng, (B, T, Hkv, D), dtype)
    v = randn(rng, (B, T, Hkv, D), dtype)
    idx = random_prefill_indices(rng, T, Hkv, B, K, tile=tile, block_size=block_size, fill=fill)
    return q, k, v, jnp.asarray(idx), jnp.asarray(np.asarray(lengths, np.int32))


# (B, T, Hq, Hkv, D, N, K, lengths, block_size)
DECODE_CASES = [
    (2, 1, 4, 2, 16, 64, 12, [37, 64], 1),
    (1, 3, 6, 2, 32, 96, 20, [51], 1),
    (2, 1, 4, 1, 16, 128, 4, [33, 128], 16),
    (2, 2, 8, 2, 16, 160, 5, [97, 20], 16),
]
# (B, T, Hq, Hkv, D, K, lengths, tile, block_size)
PREFILL_CASES = [
    (2, 45, 4, 2, 16, 10, [45, 30], 8, 1),
    (1, 64, 2, 1, 32, 3, [61], 16, 16),
    (2, 40, 6, 3, 16, 2, [40, 23], 16, 8),
]


# --------------------------------------------------------------------------------------------------
# The references against a brute-force dense masked softmax.


@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_reference_equals_masked_dense(case):
    B, T, Hq, Hkv, D, N, K, lengths, bs = case
    q, k, v, idx, lens = decode_inputs(0, B, T, Hq, Hkv, D, N, K, lengths, bs, jnp.float32)
    out, lse = ref.sparse_decode_reference(q, k, v, idx, lens, block_size=bs, return_lse=True)
    mask = ref.indices_to_mask(idx, lens, N, block_size=bs)
    want, want_lse = ref.masked_attention_reference(q, k, v, mask, return_lse=True)
    assert_close(out, want, jnp.float32, "decode ref vs masked")
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)
    assert mask.any(-1).all(), "every test row should attend to something"
    assert (~mask).any(), "the mask must drop keys"


def test_decode_reference_semantics_by_hand():
    # One row, one head, N = 8, length 6, T = 1: index 7 lies past the length and index 5 is the query
    # itself; -1 is padding. The output must be the softmax over keys {1, 5} only.
    rng = np.random.default_rng(1)
    D = 4
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in [(1, 1, 1, D), (1, 1, 8, D), (1, 1, 8, D)])
    idx = np.array([[[[1, 5, 7, -1]]]], np.int32)
    out, lse = ref.sparse_decode_reference(*map(jnp.asarray, (q, k, v, idx)), jnp.array([6]), return_lse=True)
    s = (k[0, 0, [1, 5]] @ q[0, 0, 0]) / 2.0
    p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    np.testing.assert_allclose(out[0, 0, 0], p @ v[0, 0, [1, 5]], rtol=1e-5)
    np.testing.assert_allclose(lse[0, 0, 0], s.max() + np.log(np.exp(s - s.max()).sum()), rtol=1e-5)
    # A selected key's probability is recovered from lse, as methods do.
    np.testing.assert_allclose(np.exp(s - np.asarray(lse[0, 0, 0])), p, rtol=1e-5)


def test_decode_reference_empty_row_is_zero():
    q, k, v, idx, lens = decode_inputs(3, 2, 1, 4, 2, 16, 32, 4, [20, 32], 1, jnp.float32)
    idx = idx.at[0, 1].set(-1).at[1, 0].set(jnp.array([[31 + 1, -1, -1, -1]]))  # all padding / out of range
    out, lse = ref.sparse_decode_reference(q, k, v, idx, lens, return_lse=True)
    assert np.all(np.asarray(out[0, 0, 2:]) == 0) and np.all(np.asarray(out[1, 0, :2]) == 0)
    assert np.all(np.isneginf(np.asarray(lse[0, 0, 2:]))) and np.all(np.asarray(out[0, 0, :2]) != 0)


@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_reference_equals_masked_dense(case):
    B, T, Hq, Hkv, D, K, lengths, tile, bs = case
    q, k, v, idx, lens = prefill_inputs(1, B, T, Hq, Hkv, D, K, lengths, tile, bs, jnp.float32)
    out = ref.sparse_prefill_reference(q, k, v, idx, lens, tile=tile, block_size=bs)
    mask = ref.indices_to_mask(idx, lens, T, block_size=bs, tile=tile)
    want = ref.masked_attention_reference(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask)
    assert_close(out, want, jnp.float32, "prefill ref vs masked")
    # Padding rows are zero; the diagonal is always there, so every valid row attends to something.
    for b, n in enumerate(lengths):
        assert np.all(np.asarray(out[b, n:]) == 0)
        assert np.asarray(mask[b, :, :n].any(-1)).all()


def test_prefill_full_selection_equals_causal_dense():
    B, T, H, D, tile = 1, 40, 2, 16, 8
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((B, T, H, D)).astype(np.float32) for _ in range(3))
    idx = np.broadcast_to(np.arange(T, dtype=np.int32), (B, H, T // tile, T))  # everything (later ones ignored)
    out = ref.sparse_prefill_reference(*map(jnp.asarray, (q, k, v, idx)), jnp.array([T]), tile=tile)
    s = np.einsum("bthd,bshd->bhts", q, k) / 4.0 + np.triu(np.full((T, T), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), v)
    assert_close(out, want, jnp.float32, "full selection vs causal")


def test_reference_errors_name_bad_values():
    q, k, v, idx, lens = decode_inputs(0, 1, 1, 4, 2, 16, 64, 4, [40], 1, jnp.float32)
    with pytest.raises(ValueError, match="block_size=3"):
        ref.sparse_decode_reference(q, k, v, idx, lens, block_size=3)
    with pytest.raises(ValueError, match="Hq=4 .* Hkv=3"):
        ref.sparse_decode_reference(q, k[:, :1].repeat(3, 1), v[:, :1].repeat(3, 1), idx, lens)
    with pytest.raises(ValueError, match="indices has shape"):
        ref.sparse_decode_reference(q, k, v, idx[:, :1], lens)
    with pytest.raises(ValueError, match="float32"):
        ref.sparse_decode_reference(q, k, v, idx.astype(jnp.float32), lens)
    with pytest.raises(ValueError, match=r"lengths is a list: expected an integer array \(int32\) of shape \(1,\)"):
        ref.sparse_decode_reference(q, k, v, idx, [40])  # an AttributeError before
    with pytest.raises(ValueError, match="block_size=True"):  # a bool is not a block size (it read as 1)
        ref.sparse_decode_reference(q, k, v, idx, lens, block_size=True)
    with pytest.raises(ValueError, match="k has dtype int32: expected a floating dtype"):  # integer products ran
        ref.sparse_decode_reference(q, k.astype(jnp.int32), v, idx, lens)
    qp, kp, vp, idxp, lensp = prefill_inputs(0, 1, 32, 4, 2, 16, 4, [32], 16, 1, jnp.float32)
    with pytest.raises(ValueError, match="tile=12 is not a multiple of block_size=8"):
        ref.sparse_prefill_reference(qp, kp, vp, idxp, lensp, tile=12, block_size=8)
    with pytest.raises(ValueError, match="scale=-1"):
        ref.sparse_prefill_reference(qp, kp, vp, idxp, lensp, tile=16, scale=-1.0)


# --------------------------------------------------------------------------------------------------
# XLA implementations against the references.


@pytest.mark.parametrize("case,dtype", [(c, jnp.float32) for c in DECODE_CASES]
                         + [(DECODE_CASES[1], jnp.bfloat16), (DECODE_CASES[3], jnp.bfloat16)])
def test_decode_xla_matches_reference(case, dtype):
    B, T, Hq, Hkv, D, N, K, lengths, bs = case
    q, k, v, idx, lens = decode_inputs(2, B, T, Hq, Hkv, D, N, K, lengths, bs, dtype)
    out, lse = sparse_decode_xla(q, k, v, idx, lens, block_size=bs, return_lse=True)
    want, want_lse = ref.sparse_decode_reference(q, k, v, idx, lens, block_size=bs, return_lse=True)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    assert_close(out, want, dtype, "decode xla")
    assert_close(lse, want_lse, dtype, "decode xla lse")


@pytest.mark.parametrize("case,dtype", [(PREFILL_CASES[0], jnp.float32), (PREFILL_CASES[1], jnp.bfloat16),
                                        (PREFILL_CASES[2], jnp.float32), (PREFILL_CASES[2], jnp.bfloat16)])
def test_prefill_xla_matches_reference(case, dtype):
    B, T, Hq, Hkv, D, K, lengths, tile, bs = case
    q, k, v, idx, lens = prefill_inputs(3, B, T, Hq, Hkv, D, K, lengths, tile, bs, dtype)
    want = ref.sparse_prefill_reference(q, k, v, idx, lens, tile=tile, block_size=bs)
    # The first case also runs chunked over tiles (a tiny chunk budget: one tile per lax.map step).
    chunk = 1 if case is PREFILL_CASES[0] else 1 << 30
    got = sparse_prefill_xla(q, k, v, idx, lens, tile=tile, block_size=bs, max_chunk_bytes=chunk)
    assert_close(got, want, dtype, "prefill xla")


# --------------------------------------------------------------------------------------------------
# The entry points.


def test_api_dispatch_and_errors():
    q, k, v, idx, lens = decode_inputs(4, 1, 1, 4, 2, 16, 64, 8, [50], 1, jnp.float32)
    want = ref.sparse_decode_reference(q, k, v, idx, lens)
    for impl in (None, "xla", "reference"):  # None on CPU is XLA
        assert_close(sparse_decode(q, k, v, idx, lens, implementation=impl), want, jnp.float32, str(impl))
    with pytest.raises(ValueError, match="implementation='cuda'"):
        sparse_decode(q, k, v, idx, lens, implementation="cuda")
    qp, kp, vp, idxp, lensp = prefill_inputs(4, 1, 24, 4, 2, 16, 4, [24], 8, 1, jnp.float32)
    want = ref.sparse_prefill_reference(qp, kp, vp, idxp, lensp, tile=8)
    assert_close(sparse_prefill(qp, kp, vp, idxp, lensp, tile=8), want, jnp.float32, "prefill api")


# --------------------------------------------------------------------------------------------------
# Pallas GPU (Triton) kernels in interpret mode, and their CUDA lowering.


@pytest.mark.parametrize("case,dtype,config", [
    (DECODE_CASES[0], jnp.float32, gpu.DecodeConfig(block_k=16, num_splits=2)),
    (DECODE_CASES[1], jnp.bfloat16, gpu.DecodeConfig(block_k=16)),  # heuristic splits
    (DECODE_CASES[2], jnp.bfloat16, gpu.DecodeConfig(block_k=32, num_splits=3)),  # bs 16: 2 entries / step
    (DECODE_CASES[3], jnp.float32, gpu.DecodeConfig(block_k=16, num_splits=2)),  # bs 16 = block_k, T = 2
])
def test_decode_gpu_interpret_matches_reference(case, dtype, config):
    B, T, Hq, Hkv, D, N, K, lengths, bs = case
    q, k, v, idx, lens = decode_inputs(5, B, T, Hq, Hkv, D, N, K, lengths, bs, dtype)
    out, lse = gpu.sparse_decode_gpu(q, k, v, idx, lens, block_size=bs, return_lse=True, config=config,
                                     interpret=True)
    want, want_lse = ref.sparse_decode_reference(q, k, v, idx, lens, block_size=bs, return_lse=True)
    assert out.dtype == dtype
    assert_close(out, want, dtype, "decode gpu")
    assert_close(lse, want_lse, dtype, "decode gpu lse")


def test_decode_gpu_interpret_empty_rows_and_empty_splits():
    # Row 0 head 1: all padding; row 1: one real entry and one far past the cache end (ignored, never read),
    # so most splits are empty.
    q, k, v, idx, lens = decode_inputs(6, 2, 1, 4, 2, 16, 64, 12, [40, 64], 1, jnp.float32)
    idx = idx.at[0, 1].set(-1).at[1].set(jnp.full((2, 1, 12), -1).at[:, :, 0].set(63).at[:, :, 1].set(10**6))
    out, lse = gpu.sparse_decode_gpu(q, k, v, idx, lens, return_lse=True, interpret=True,
                                     config=gpu.DecodeConfig(block_k=16, num_splits=3))
    want, want_lse = ref.sparse_decode_reference(q, k, v, idx, lens, return_lse=True)
    assert_close(out, want, jnp.float32, "decode gpu empty")
    assert np.all(np.asarray(out[0, 0, 2:]) == 0) and np.all(np.isneginf(np.asarray(lse[0, 0, 2:])))
    np.testing.assert_allclose(np.asarray(out[1, 0]), np.asarray(v[1, :, 63].repeat(2, 0)), rtol=1e-6)


def test_an_entry_whose_tokens_wrap_int32_is_no_block_in_every_path():
    """An index entry past 2^31 / block_size names tokens past int32, so no token of any cache: (2^28 + 1) * 16 =
    2^32 + 16 wraps around to token 16. The reference, XLA and the Triton kernels (interpret; the decode with its
    in-kernel entry check) give what the same call with that entry -1 gives, not what entry 1 (the wrapped
    block) gives; so does the API's default implementation (on a GPU host: the compiled kernels)."""
    huge = 2 ** 28 + 1
    B, T, Hq, Hkv, D, N, K, lengths, bs = DECODE_CASES[3]
    q, k, v, idx, lens = decode_inputs(5, B, T, Hq, Hkv, D, N, K, lengths, bs, jnp.float32)
    at = (0, 0, 0, 1)  # row 0 (97 tokens: block 1 is visible), in the middle of the row
    calls = {
        "reference": lambda i: ref.sparse_decode_reference(q, k, v, i, lens, block_size=bs),
        "xla": lambda i: sparse_decode_xla(q, k, v, i, lens, block_size=bs),
        "gpu": lambda i: gpu.sparse_decode_gpu(q, k, v, i, lens, block_size=bs, interpret=True,
                                               config=gpu.DecodeConfig(block_k=16, num_splits=2)),
        "default": lambda i: sparse_decode(q, k, v, i, lens, block_size=bs),
    }
    want = ref.sparse_decode_reference(q, k, v, idx.at[at].set(-1), lens, block_size=bs)
    wrapped = ref.sparse_decode_reference(q, k, v, idx.at[at].set(1), lens, block_size=bs)
    assert float(jnp.max(jnp.abs(wrapped - want))) > 1e-3  # reading block 1 would show
    for name, call in calls.items():
        assert_close(call(idx.at[at].set(huge)), want, jnp.float32, f"decode {name}")

    B, T, Hq, Hkv, D, K, lengths, tile, bs = PREFILL_CASES[2]  # block_size 8
    huge = 2 ** 29 + 1  # * 8 = 2^32 + 8: block 1
    q, k, v, idx, lens = prefill_inputs(7, B, T, Hq, Hkv, D, K, lengths, tile, bs, jnp.float32)
    at = (0, 0, 2, 0)  # tile 2 (rows 32..39): block 1 lies before it
    want = ref.sparse_prefill_reference(q, k, v, idx.at[at].set(-1), lens, tile=tile, block_size=bs)
    wrapped = ref.sparse_prefill_reference(q, k, v, idx.at[at].set(1), lens, tile=tile, block_size=bs)
    assert float(jnp.max(jnp.abs(wrapped - want))) > 1e-3
    bad = idx.at[at].set(huge)
    assert_close(ref.sparse_prefill_reference(q, k, v, bad, lens, tile=tile, block_size=bs), want, jnp.float32,
                 "prefill reference")
    assert_close(sparse_prefill_xla(q, k, v, bad, lens, tile=tile, block_size=bs), want, jnp.float32, "prefill xla")
    got = gpu.sparse_prefill_gpu(q, k, v, bad, lens, tile=tile, block_size=bs, interpret=True,
                                 config=gpu.PrefillConfig(block_k=16))
    assert_close(got, want, jnp.float32, "prefill gpu")
    got = sparse_prefill(q, k, v, bad, lens, tile=tile, block_size=bs)
    assert_close(got, want, jnp.float32, "prefill default")


@pytest.mark.parametrize("case,dtype", [
    (PREFILL_CASES[0], jnp.float32),
    (PREFILL_CASES[1], jnp.bfloat16),
    (PREFILL_CASES[2], jnp.float32),
])
def test_prefill_gpu_interpret_matches_reference(case, dtype):
    B, T, Hq, Hkv, D, K, lengths, tile, bs = case
    q, k, v, idx, lens = prefill_inputs(7, B, T, Hq, Hkv, D, K, lengths, tile, bs, dtype)
    want = ref.sparse_prefill_reference(q, k, v, idx, lens, tile=tile, block_size=bs)
    # one program per query head (gqa_rows=0), and the default, which packs a power-of-two GQA group
    for cfg in (gpu.PrefillConfig(block_k=16, gqa_rows=0), gpu.PrefillConfig(block_k=16)):
        got = gpu.sparse_prefill_gpu(q, k, v, idx, lens, tile=tile, block_size=bs, interpret=True, config=cfg)
        assert_close(got, want, dtype, f"prefill gpu {cfg}")


def test_gpu_kernels_stay_in_their_blocks():
    """Every load and store of the Triton decode and prefill kernels stays inside its block
    (`pallas_bounds.checked_memory`: the interpreter pads stray loads and drops stray stores, where a GPU reads or
    overwrites another program's rows): decode with G = 3 (query rows padded to 16), 13 entries in 3 splits (the
    last one partial), a query with no visible key, entries past the cache end, blocks of 1 and 8 tokens; prefill
    of T = 45 in tiles of 8 (a partial last tile) with a row ending mid-tile, one program per query head (G = 3)
    and the GQA-packed kernel (G = 2). The kernels' wrappers unjitted, so that they are traced under the check."""
    with checked_memory():
        for bs in (1, 8):
            q, k, v, idx, lens = decode_inputs(8, 2, 2, 6, 2, 16, 72, 13, [72, 1], bs, jnp.float32)
            idx = idx.at[0, 1, 1].set(jnp.full((13,), -1).at[0].set(2).at[1].set(10 ** 6))  # past the cache end
            out, lse = gpu.sparse_decode_gpu.__wrapped__(q, k, v, idx, lens, block_size=bs, return_lse=True,
                                                         config=gpu.DecodeConfig(block_k=16, num_splits=3),
                                                         interpret=True)
            want, want_lse = ref.sparse_decode_reference(q, k, v, idx, lens, block_size=bs, return_lse=True)
            assert_close(out, want, jnp.float32, f"decode, block_size {bs}")
            assert_close(lse, want_lse, jnp.float32, f"decode lse, block_size {bs}")
        for Hq, bs in ((6, 8), (4, 1)):  # G = 3: a program per query head; G = 2: the GQA-packed kernel
            q, k, v, idx, lens = prefill_inputs(9, 2, 45, Hq, 2, 16, 6, [45, 30], 8, bs, jnp.float32)
            got = gpu.sparse_prefill_gpu.__wrapped__(q, k, v, idx, lens, tile=8, block_size=bs, interpret=True,
                                                     config=gpu.PrefillConfig(block_k=16))
            want = ref.sparse_prefill_reference(q, k, v, idx, lens, tile=8, block_size=bs)
            assert_close(got, want, jnp.float32, f"prefill, G = {Hq // 2}")


@pytest.mark.parametrize("block_size", [1, 16])
def test_gpu_kernels_lower_for_cuda(block_size):
    # Triton lowering (to the TTIR carried by the custom call) runs without a GPU; PTX compilation does not.
    sds = jax.ShapeDtypeStruct
    B, Hq, Hkv, D, N, T = 2, 32, 8, 128, 2048, 256
    cache = sds((B, Hkv, N, D), jnp.bfloat16)
    exp = export_for("cuda", functools.partial(gpu.sparse_decode_gpu, block_size=block_size, return_lse=True),
                       sds((B, 1, Hq, D), jnp.bfloat16), cache, cache, sds((B, Hkv, 1, 200 // block_size), jnp.int32),
                       sds((B,), jnp.int32))
    assert "sparse_decode_gathered" in exp.mlir_module()
    kv = sds((B, T, Hkv, D), jnp.bfloat16)
    exp = export_for("cuda", functools.partial(gpu.sparse_prefill_gpu, tile=128, block_size=block_size),
                       sds((B, T, Hq, D), jnp.bfloat16), kv, kv, sds((B, Hkv, 2, 64 // block_size), jnp.int32),
                       sds((B,), jnp.int32))
    assert "sparse_prefill_gathered" in exp.mlir_module()


# --------------------------------------------------------------------------------------------------
# Pallas TPU kernels in interpret mode, and their TPU lowering.

TPU_DECODE_CASES = [  # (B, T, Hq, Hkv, D, N, K, lengths, block_size), dtype, blocks_per_step
    ((2, 1, 4, 2, 16, 128, 5, [77, 128], 8), jnp.float32, 2),
    ((2, 2, 8, 2, 128, 160, 5, [97, 20], 16), jnp.bfloat16, 3),
]
TPU_PREFILL_CASES = [  # (B, T, Hq, Hkv, D, K, lengths, tile, block_size), dtype, blocks_per_step
    ((2, 40, 4, 2, 16, 3, [40, 23], 16, 8), jnp.float32, 2),
    ((1, 64, 2, 1, 128, 3, [61], 32, 16), jnp.bfloat16, 4),
]


@pytest.mark.parametrize("case,dtype,n", TPU_DECODE_CASES)
def test_decode_tpu_interpret_matches_reference(case, dtype, n):
    B, T, Hq, Hkv, D, N, K, lengths, bs = case
    q, k, v, idx, lens = decode_inputs(8, B, T, Hq, Hkv, D, N, K, lengths, bs, dtype)
    idx = idx.at[0, 0].set(-1)  # an empty row
    out, lse = tpu.sparse_decode_tpu(q, k, v, idx, lens, block_size=bs, return_lse=True,
                                     config=tpu.TpuConfig(blocks_per_step=n), interpret=True)
    want, want_lse = ref.sparse_decode_reference(q, k, v, idx, lens, block_size=bs, return_lse=True)
    assert_close(out, want, dtype, "decode tpu")
    assert_close(lse, want_lse, dtype, "decode tpu lse")


@pytest.mark.parametrize("case,dtype,n", TPU_PREFILL_CASES)
def test_prefill_tpu_interpret_matches_reference(case, dtype, n):
    B, T, Hq, Hkv, D, K, lengths, tile, bs = case
    q, k, v, idx, lens = prefill_inputs(9, B, T, Hq, Hkv, D, K, lengths, tile, bs, dtype)
    got = tpu.sparse_prefill_tpu(q, k, v, idx, lens, tile=tile, block_size=bs,
                                 config=tpu.TpuConfig(blocks_per_step=n), interpret=True)
    want = ref.sparse_prefill_reference(q, k, v, idx, lens, tile=tile, block_size=bs)
    assert_close(got, want, dtype, "prefill tpu")


@pytest.mark.parametrize("dtype,block_size", [(jnp.bfloat16, 16), (jnp.float32, 8)])
def test_tpu_kernels_lower_for_tpu(dtype, block_size):
    sds = jax.ShapeDtypeStruct
    B, Hq, Hkv, D, N, T = 2, 32, 8, 128, 2048, 256
    cache = sds((B, Hkv, N, D), dtype)
    exp = export_for("tpu", functools.partial(tpu.sparse_decode_tpu, block_size=block_size, return_lse=True),
                      sds((B, 1, Hq, D), dtype), cache, cache, sds((B, Hkv, 1, 40), jnp.int32), sds((B,), jnp.int32))
    assert "tpu_custom_call" in exp.mlir_module()
    kv = sds((B, T, Hkv, D), dtype)
    exp = export_for("tpu", functools.partial(tpu.sparse_prefill_tpu, tile=128, block_size=block_size),
                      sds((B, T, Hq, D), dtype), kv, kv, sds((B, Hkv, 2, 8), jnp.int32), sds((B,), jnp.int32))
    assert "tpu_custom_call" in exp.mlir_module()


def test_kernel_argument_errors():
    q, k, v, idx, lens = decode_inputs(0, 1, 1, 4, 2, 16, 64, 4, [40], 1, jnp.float32)
    with pytest.raises(ValueError, match="block_size=1 .*multiple of 8"):
        tpu.sparse_decode_tpu(q, k, v, idx, lens, block_size=1, interpret=True)
    with pytest.raises(ValueError, match="implementation='pallas_tpu' cannot run"):
        sparse_decode(q, k, v, idx, lens, implementation="pallas_tpu")
    q24 = jnp.zeros((1, 1, 4, 24)), jnp.zeros((1, 2, 64, 24))
    with pytest.raises(ValueError, match="D=24"):
        gpu.sparse_decode_gpu(q24[0], q24[1], q24[1], idx, lens, interpret=True)
    with pytest.raises(ValueError, match="tile=12"):
        qp, kp, vp, idxp, lensp = prefill_inputs(0, 1, 24, 4, 2, 16, 4, [24], 12, 1, jnp.float32)
        gpu.sparse_prefill_gpu(qp, kp, vp, idxp, lensp, tile=12, interpret=True)


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_custom_scale_reaches_every_cpu_path(impl):
    """sparse_decode (output and lse) and sparse_prefill honour a custom softmax scale on the CPU paths, against
    the masked dense softmax at that scale (no library caller passes one, so an implementation ignoring it had
    passed every other test; a mutation audit's survivor)."""
    scale = 0.07
    B, T, Hq, Hkv, D, N, K, lengths, bs = DECODE_CASES[3]
    q, k, v, idx, lens = decode_inputs(5, B, T, Hq, Hkv, D, N, K, lengths, bs, jnp.float32)
    out, lse = sparse_decode(q, k, v, idx, lens, block_size=bs, scale=scale, return_lse=True, implementation=impl)
    mask = ref.indices_to_mask(idx, lens, N, block_size=bs)
    want, want_lse = ref.masked_attention_reference(q, k, v, mask, scale=scale, return_lse=True)
    assert_close(out, want, jnp.float32, "decode at a custom scale")
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)
    default = sparse_decode(q, k, v, idx, lens, block_size=bs, implementation=impl)
    assert float(jnp.max(jnp.abs(default - want))) > 1e-2  # the test tells the scales apart

    B, T, Hq, Hkv, D, K, lengths, tile, bs = PREFILL_CASES[0]
    q, k, v, idx, lens = prefill_inputs(6, B, T, Hq, Hkv, D, K, lengths, tile, bs, jnp.float32)
    out = sparse_prefill(q, k, v, idx, lens, tile=tile, block_size=bs, scale=scale, implementation=impl)
    mask = ref.indices_to_mask(idx, lens, T, block_size=bs, tile=tile)
    want = ref.masked_attention_reference(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask, scale=scale)
    assert_close(out, want, jnp.float32, "prefill at a custom scale")
    default = sparse_prefill(q, k, v, idx, lens, tile=tile, block_size=bs, implementation=impl)
    assert float(jnp.max(jnp.abs(default - want))) > 1e-2

"""In-place decode over the stacked KV cache [L, B, Hkv, N, D] with a traced layer index.

Gathered sparse decode (stacked.py: Triton and TPU kernels in interpret mode) against slicing the layer and
running the reference; the split-K dense decode (pallas_kernels.dense_decode, Triton in interpret mode)
against `pallas_kernels.dense.dense_decode` on the slice; the entry points; CUDA / TPU lowering; and the
methods' use of the in-place paths inside the model's layer scan.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.dense import dense_decode
from pallas_kernels.dense_decode import dense_decode_stacked, dense_decode_stacked_reference
from pallas_kernels.dense_decode import gpu as dgpu
from pallas_kernels.sparse_attention import gpu, sparse_decode, stacked, tpu
from pallas_kernels.sparse_attention import reference as ref
from pallas_kernels.sparse_attention.testing import random_decode_indices
from lowering import export_for
from pallas_bounds import checked_memory

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def assert_close(got, want, dtype, what=""):
    got = np.asarray(jnp.asarray(got, jnp.float32))
    want = np.asarray(jnp.asarray(want, jnp.float32))
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.isfinite(got).all(), f"{what}: non-finite output"
    tol = TOL[dtype] * max(1.0, float(np.max(np.abs(want))))
    err = float(np.max(np.abs(got - want)))
    assert err <= tol, f"{what}: max abs err {err:.3g} > {tol:.3g}"


def randn(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)


def stacked_inputs(seed, L, B, T, Hq, Hkv, D, N, lengths, dtype):
    rng = np.random.default_rng(seed)
    return (rng, randn(rng, (B, T, Hq, D), dtype), randn(rng, (L, B, Hkv, N, D), dtype),
            randn(rng, (L, B, Hkv, N, D), dtype), jnp.asarray(np.asarray(lengths, np.int32)))


# --------------------------------------------------------------------------------------------------
# Gathered sparse decode over the stacked cache.

# (L, B, T, Hq, Hkv, D, N, K, lengths, block_size), dtype, layers, config
SPARSE_GPU_CASES = [
    ((3, 2, 1, 4, 2, 16, 64, 12, [37, 64], 1), jnp.float32, (0, 2, -1), gpu.DecodeConfig(block_k=16, num_splits=2)),
    ((2, 2, 2, 8, 2, 16, 96, 5, [97 - 20, 20], 16), jnp.bfloat16, (1,), gpu.DecodeConfig(block_k=32)),
]


@pytest.mark.parametrize("case,dtype,layers,config", SPARSE_GPU_CASES)
def test_sparse_stacked_gpu_interpret_matches_sliced_reference(case, dtype, layers, config):
    L, B, T, Hq, Hkv, D, N, K, lengths, bs = case
    rng, q, k_all, v_all, lens = stacked_inputs(10, L, B, T, Hq, Hkv, D, N, lengths, dtype)
    idx = jnp.asarray(random_decode_indices(rng, lengths, Hkv, T, K, block_size=bs))
    for layer in layers:
        out, lse = stacked.sparse_decode_stacked_gpu(q, k_all, v_all, jnp.int32(layer), idx, lens, block_size=bs,
                                                     return_lse=True, config=config, interpret=True)
        want, want_lse = ref.sparse_decode_reference(q, k_all[layer], v_all[layer], idx, lens, block_size=bs,
                                                     return_lse=True)
        assert out.dtype == dtype
        assert_close(out, want, dtype, f"sparse stacked gpu layer {layer}")
        assert_close(lse, want_lse, dtype, f"sparse stacked gpu lse layer {layer}")
    # The layers differ, so reading the wrong one would show.
    other_layer = (layers[-1] % L + 1) % L
    other = ref.sparse_decode_reference(q, k_all[other_layer], v_all[other_layer], idx, lens, block_size=bs)
    assert float(jnp.max(jnp.abs(other.astype(jnp.float32) - want.astype(jnp.float32)))) > 0.1


def test_sparse_stacked_gpu_entry_whose_tokens_wrap_int32_is_no_block():
    """An entry past 2^31 / block_size ((2^28 + 1) * 16 = 2^32 + 16, which wraps around to token 16) is no block
    for the stacked kernel's in-kernel checks: the call equals the one with that entry -1, as the reference,
    whether it sits mid-row or last. One split per row, so a mid-row entry is inside its split's useful end and
    only the gather's own check drops it."""
    L, B, T, Hq, Hkv, D, N, K, lengths, bs = SPARSE_GPU_CASES[1][0]
    rng, q, k_all, v_all, lens = stacked_inputs(10, L, B, T, Hq, Hkv, D, N, lengths, jnp.float32)
    idx = jnp.asarray(random_decode_indices(rng, lengths, Hkv, T, K, block_size=bs))
    for at in ((0, 0, 0, 1), (0, 1, 1, K - 1)):
        want = ref.sparse_decode_reference(q, k_all[1], v_all[1], idx.at[at].set(-1), lens, block_size=bs)
        wrapped = ref.sparse_decode_reference(q, k_all[1], v_all[1], idx.at[at].set(1), lens, block_size=bs)
        assert float(jnp.max(jnp.abs(wrapped - want))) > 1e-3  # reading block 1 would show
        got = stacked.sparse_decode_stacked_gpu(q, k_all, v_all, jnp.int32(1), idx.at[at].set(2 ** 28 + 1), lens,
                                                block_size=bs, config=gpu.DecodeConfig(block_k=16, num_splits=1),
                                                interpret=True)
        assert_close(got, want, jnp.float32, f"entry at {at}")
        got = sparse_decode(q, k_all, v_all, idx.at[at].set(2 ** 28 + 1), lens, layer=jnp.int32(1), block_size=bs)
        assert_close(got, want, jnp.float32, f"default implementation, entry at {at}")  # a GPU host: compiled


# (L, B, T, Hq, Hkv, D, N, K, lengths, block_size), dtype, config: one index row for the T queries
SHARED_CASES = [
    ((2, 3, 5, 8, 2, 16, 64, 20, [64, 23, 9], 1), jnp.float32, gpu.DecodeConfig(block_k=16)),  # T x G = 20 rows
    ((2, 2, 3, 6, 2, 16, 96, 5, [96, 40], 16), jnp.bfloat16, gpu.DecodeConfig(block_k=32, num_splits=2)),  # G 3
    ((2, 1, 2, 4, 4, 16, 64, 9, [50], 1), jnp.float32, gpu.DecodeConfig(block_k=16, num_splits=1)),  # G 1
    ((2, 1, 17, 16, 2, 16, 64, 24, [60], 1), jnp.float32, gpu.DecodeConfig(block_k=16)),  # 136 rows: per query
]


@pytest.mark.parametrize("case,dtype,config", SHARED_CASES)
def test_sparse_stacked_gpu_one_row_for_all_queries_equals_the_broadcast_rows(case, dtype, config):
    """Index rows [B, Hkv, 1, K] shared by the T queries (an STS verification's keys): the kernel's one program
    over the T x G query rows equals the reference on the rows broadcast to [B, Hkv, T, K], each query masked
    at its own position (the newest keys are in the rows, so a query that saw its successors would differ);
    the entry point takes the same rows on every implementation; with return_mass, a head map or more query rows
    than one program takes the rows are broadcast first; and the launch has one program per (row, KV head, split),
    not per query."""
    L, B, T, Hq, Hkv, D, N, K, lengths, bs = case
    rng, q, k_all, v_all, lens = stacked_inputs(23, L, B, T, Hq, Hkv, D, N, lengths, dtype)
    one = np.asarray(random_decode_indices(rng, lengths, Hkv, 1, K, block_size=bs))  # [B, Hkv, 1, K]
    last = (np.asarray(lengths) - 1) // bs  # the newest token's block in every row: causal masking matters
    one[:, :, 0, 0] = last[:, None]
    one = jnp.asarray(one)
    rows = jnp.broadcast_to(one, (B, Hkv, T, K))
    for layer in (0, 1):
        want, want_lse = ref.sparse_decode_reference(q, k_all[layer], v_all[layer], rows, lens, block_size=bs,
                                                     return_lse=True)
        out, lse = stacked.sparse_decode_stacked_gpu(q, k_all, v_all, jnp.int32(layer), one, lens, block_size=bs,
                                                     return_lse=True, config=config, interpret=True)
        assert out.dtype == dtype
        assert_close(out, want, dtype, f"shared rows, layer {layer}")
        assert_close(lse, want_lse, dtype, f"shared rows lse, layer {layer}")
        for impl in ("reference", "xla"):
            got = sparse_decode(q, k_all, v_all, one, lens, layer=jnp.int32(layer), block_size=bs,
                                implementation=impl)
            assert_close(got, want, dtype, f"shared rows through the API, {impl}")
        hm = jnp.arange(Hkv, dtype=jnp.int32)[::-1]
        got = stacked.sparse_decode_stacked_gpu(q, k_all, v_all, jnp.int32(layer), one, lens, block_size=bs,
                                                head_map=hm, config=config, interpret=True)
        assert_close(got, ref.sparse_decode_reference(q, k_all[layer], v_all[layer], rows[:, ::-1], lens,
                                                      block_size=bs), dtype, "shared rows with a head map")
    if T > 1:  # a query seeing its successors' keys would differ
        causal = ref.sparse_decode_reference(q, k_all[1], v_all[1], rows, lens, block_size=bs)
        blind = ref.sparse_decode_reference(q, k_all[1], v_all[1], rows,
                                            jnp.minimum(lens + T, N).astype(jnp.int32), block_size=bs)
        assert float(jnp.max(jnp.abs(causal.astype(jnp.float32) - blind.astype(jnp.float32)))) > 1e-3
    partials = functools.partial(stacked.decode_partials_stacked, q, k_all, v_all, jnp.int32(0), one, lens,
                                 block_size=bs, scale=None, config=config, head_map=None, interpret=True)
    if T * Hq // Hkv <= stacked.SHARED_MAX_ROWS:
        parts = partials(return_mass=False)
        assert parts[0].shape[1:4] == (B, Hkv, 1)  # one program per (row, KV head, split) for the T queries
        assert parts[0].shape[4] >= T * Hq // Hkv
    else:
        with pytest.raises(ValueError, match=f"more than {stacked.SHARED_MAX_ROWS} query rows"):
            partials(return_mass=False)
    with pytest.raises(ValueError, match="one row for all"):
        partials(return_mass=True)
    if T > 1:  # the entry mass and every layer's rows [L, B, Hkv, T, K] take a row per query, as their references
        with pytest.raises(ValueError, match=r"indices has shape .*expected \[B=.*T=%d" % T):
            stacked.sparse_decode_stacked_gpu(q, k_all, v_all, jnp.int32(0), one, lens, block_size=bs,
                                              return_mass=True, config=config, interpret=True)
        with pytest.raises(ValueError, match="indices has shape"):
            stacked.sparse_decode_stacked_gpu(q, k_all, v_all, jnp.int32(0), jnp.stack([one] * L), lens,
                                              block_size=bs, config=config, interpret=True)


def test_decode_rows_shared_only_where_a_call_takes_them():
    """[B, Hkv, 1, K] is a decode's shared row only for the sparse decode ops; a row count other than 1 or T is
    an error naming the shape."""
    rng, q, k_all, v_all, lens = stacked_inputs(3, 2, 1, 4, 4, 2, 16, 64, [40], jnp.float32)
    with pytest.raises(ValueError, match=r"indices has shape \(1, 2, 2, 3\).*or \[B, Hkv, 1, K\]"):
        sparse_decode(q, k_all, v_all, jnp.zeros((1, 2, 2, 3), jnp.int32), lens, layer=jnp.int32(0),
                      implementation="xla")
    from pallas_kernels.sparse_attention.common import check_decode_args
    with pytest.raises(ValueError, match=r"expected \[B=1, Hkv=2, T=4, K>=1\]$"):
        check_decode_args(q, k_all[0], v_all[0], jnp.zeros((1, 2, 1, 3), jnp.int32), lens, 1)


@pytest.mark.parametrize("case,dtype,layers,config", SPARSE_GPU_CASES)
def test_sparse_stacked_gpu_every_layers_head_map_reads_the_layers_row(case, dtype, layers, config):
    """Every layer's map i32[L, Hkv] (what Kascade's reuse layers hand the kernel inside the layer scan): the kernel
    reads row `layer` (wrapped and clamped as the cache's layer), clips its values, and equals the call with that
    row, in the kernel and through the API's XLA path alike; the rows differ, so reading another would show."""
    L, B, T, Hq, Hkv, D, N, K, lengths, bs = case
    Hq, Hkv = Hq * 2, Hkv * 2
    rng, q, k_all, v_all, lens = stacked_inputs(17, L, B, T, Hq, Hkv, D, N, lengths, dtype)
    idx = jnp.asarray(random_decode_indices(rng, lengths, Hkv, T, K, block_size=bs))
    rows = [[1, 0, 3, 2], [2, 2, 0, 1], [3, 3, 3, 0]][:L]
    table = jnp.asarray(rows, jnp.int32)
    kernel = jax.jit(lambda table, layer: stacked.sparse_decode_stacked_gpu(
        q, k_all, v_all, layer, idx, lens, block_size=bs, config=config, head_map=table, interpret=True))
    for layer in layers + (L + 5,):  # past the end: clamped to the last layer, as the cache
        row = rows[min(layer % L if layer < 0 else layer, L - 1)]
        want = ref.sparse_decode_reference(q, k_all[min(layer, L - 1)], v_all[min(layer, L - 1)],
                                           jnp.take(idx, jnp.asarray(row), axis=1), lens, block_size=bs)
        assert_close(kernel(table, jnp.int32(layer)), want, dtype, f"layer {layer}")
        for impl in ("xla", None):  # None: the default (on a GPU host the compiled kernel)
            api = jax.jit(lambda layer: sparse_decode(q, k_all, v_all, idx, lens, layer=layer, block_size=bs,
                                                      head_map=table, implementation=impl))(jnp.int32(layer))
            assert_close(api, want, dtype, f"api {impl}, layer {layer}")
    # A traced table's values outside [0, Hkv) are clipped in-kernel, as the XLA path clips them.
    bad = table.at[layers[0]].set(jnp.asarray([-1, 0, 3, 4], jnp.int32)[:Hkv])
    clipped = jnp.take(idx, jnp.clip(bad[layers[0]], 0, Hkv - 1), axis=1)
    want = ref.sparse_decode_reference(q, k_all[layers[0]], v_all[layers[0]], clipped, lens, block_size=bs)
    assert_close(kernel(bad, jnp.int32(layers[0])), want, dtype, "traced table, clipped")
    with pytest.raises(ValueError, match=re.escape(f"expected an integer [Hkv={Hkv}] or [L={L}, Hkv={Hkv}] array")):
        stacked.sparse_decode_stacked_gpu(q, k_all, v_all, jnp.int32(0), idx, lens, block_size=bs,
                                          head_map=jnp.zeros((L + 1, Hkv), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match=r"expected values in \[0, Hkv=4\)"):
        sparse_decode(q, k_all, v_all, idx, lens, layer=jnp.int32(0), block_size=bs, head_map=bad,
                      implementation="xla")


@pytest.mark.parametrize("case,dtype,layers,config", SPARSE_GPU_CASES)
def test_sparse_stacked_gpu_head_map_equals_taken_indices(case, dtype, layers, config):
    """head_map read in-kernel (Kascade's reuse layers) = the call on jnp.take(indices, head_map, axis=1)."""
    L, B, T, Hq, Hkv, D, N, K, lengths, bs = case
    Hq, Hkv = Hq * 2, Hkv * 2  # 4 KV heads: a map that is not a permutation too
    rng, q, k_all, v_all, lens = stacked_inputs(13, L, B, T, Hq, Hkv, D, N, lengths, dtype)
    idx = jnp.asarray(random_decode_indices(rng, lengths, Hkv, T, K, block_size=bs))
    for hm in ([1, 0, 3, 2], [2, 2, 0, 1]):
        hm = jnp.asarray(hm, jnp.int32)
        got = stacked.sparse_decode_stacked_gpu(q, k_all, v_all, jnp.int32(layers[0]), idx, lens, block_size=bs,
                                                config=config, head_map=hm, interpret=True)
        want = ref.sparse_decode_reference(q, k_all[layers[0]], v_all[layers[0]], jnp.take(idx, hm, axis=1), lens,
                                           block_size=bs)
        assert_close(got, want, dtype, f"head map {hm}")
        # the API applies the map for every implementation
        api = sparse_decode(q, k_all, v_all, idx, lens, layer=jnp.int32(layers[0]), block_size=bs, head_map=hm,
                            implementation="xla")
        assert_close(api, want, dtype, "api head map")
    with pytest.raises(ValueError, match="head_map has shape"):
        stacked.sparse_decode_stacked_gpu(q, k_all, v_all, jnp.int32(0), idx, lens, block_size=bs,
                                          head_map=jnp.zeros((3,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="head_map with return_mass"):
        stacked.sparse_decode_stacked_gpu(q, k_all, v_all, jnp.int32(0), idx, lens, block_size=bs,
                                          head_map=jnp.zeros((Hkv,), jnp.int32), return_mass=True, interpret=True)
    # Values outside [0, Hkv): refused when known; a traced map is clipped by the kernel and the XLA path alike
    # (jnp.take wrapped -1 to the last head and filled Hkv with zeros before).
    with pytest.raises(ValueError, match=r"head_map=\[-1, 0, 3, 4\]: expected values in \[0, Hkv=4\)"):
        sparse_decode(q, k_all, v_all, idx, lens, layer=jnp.int32(layers[0]), block_size=bs,
                      head_map=jnp.asarray([-1, 0, 3, 4], jnp.int32), implementation="xla")
    bad = jnp.asarray([-1, 0, 3, 4], jnp.int32)
    api = jax.jit(lambda hm: sparse_decode(q, k_all, v_all, idx, lens, layer=jnp.int32(layers[0]), block_size=bs,
                                           head_map=hm, implementation="xla"))(bad)
    clipped = jnp.take(idx, jnp.clip(bad, 0, Hkv - 1), axis=1)
    want = ref.sparse_decode_reference(q, k_all[layers[0]], v_all[layers[0]], clipped, lens, block_size=bs)
    assert_close(api, want, dtype, "traced map, clipped")


@pytest.mark.parametrize("case,dtype,layers,config", SPARSE_GPU_CASES)
def test_sparse_stacked_gpu_query_heads_equals_each_head_alone(case, dtype, layers, config):
    """query_heads (one index row per query head, Quest's pages and TokenButler's keys): one launch over the query
    heads equals the reference of each query head alone over its KV head's cache, with its lse; the API's
    `sparse_decode_query_heads` gives the same on XLA and the reference (one call per position in the group)."""
    from pallas_kernels.sparse_attention import sparse_decode_query_heads

    L, B, T, Hq, Hkv, D, N, K, lengths, bs = case
    rng, q, k_all, v_all, lens = stacked_inputs(14, L, B, T, Hq, Hkv, D, N, lengths, dtype)
    idx = jnp.asarray(random_decode_indices(rng, lengths, Hq, T, K, block_size=bs))  # [B, Hq, T, K]
    G = Hq // Hkv
    for layer in layers:
        out, lse = stacked.sparse_decode_stacked_gpu(q, k_all, v_all, jnp.int32(layer), idx, lens, block_size=bs,
                                                     return_lse=True, config=config, query_heads=True,
                                                     interpret=True)
        for h in range(Hq):  # query head h alone: one KV head (h // G) and its own row
            kv = slice(h // G, h // G + 1)
            want, want_lse = ref.sparse_decode_reference(q[:, :, h:h + 1], k_all[layer][:, kv], v_all[layer][:, kv],
                                                         idx[:, h:h + 1], lens, block_size=bs, return_lse=True)
            assert_close(out[:, :, h:h + 1], want, dtype, f"query head {h} layer {layer}")
            assert_close(lse[:, :, h:h + 1], want_lse, dtype, f"query head {h} lse layer {layer}")
        for impl in ("xla", "reference"):
            api = sparse_decode_query_heads(q, k_all, v_all, idx, lens, layer=jnp.int32(layer), block_size=bs,
                                            implementation=impl)
            assert_close(api, out, dtype, f"api {impl} layer {layer}")
    for bad, match in [(dict(return_mass=True), "query_heads with return_mass"),
                       (dict(head_map=jnp.zeros((Hkv,), jnp.int32)), "query_heads with head_map")]:
        with pytest.raises(ValueError, match=match):
            stacked.sparse_decode_stacked_gpu(q, k_all, v_all, jnp.int32(0), idx, lens, block_size=bs,
                                              query_heads=True, interpret=True, **bad)
    with pytest.raises(ValueError, match=r"with query_heads expected one row per query head \[B, Hq="):
        stacked.sparse_decode_stacked_gpu(q, k_all, v_all, jnp.int32(0), idx[:, :Hkv], lens, block_size=bs,
                                          query_heads=True, interpret=True)
    with pytest.raises(ValueError, match="expected one row per query head"):
        sparse_decode_query_heads(q, k_all, v_all, idx[:, :Hkv], lens, layer=jnp.int32(0), block_size=bs)


def test_sparse_stacked_gpu_stays_in_its_blocks():
    """Every load and store of the stacked gathered-decode kernel stays inside its block
    (`pallas_bounds.checked_memory`: the interpreter pads stray loads and drops stray stores, where a GPU reads or
    overwrites another program's rows): G = 3 (query rows padded to 16), 13 entries in 3 splits (the last one
    partial: the unpadded row is read in place), a query with no visible key, an entry past the cache end; every
    layer's rows with the per-entry mass (blocks of 1 token), a head map and one row per query head (blocks of 8)."""
    from pallas_kernels.block_scores.reference import sparse_decode_mass_reference

    L, B, T, Hq, Hkv, D, N, K, lengths = 2, 2, 2, 6, 2, 16, 72, 13, [72, 1]
    rng, q, k_all, v_all, lens = stacked_inputs(17, L, B, T, Hq, Hkv, D, N, lengths, jnp.float32)
    cfg, layer = gpu.DecodeConfig(block_k=16, num_splits=3), jnp.int32(1)
    decode = functools.partial(stacked.sparse_decode_stacked_gpu.__wrapped__, q, k_all, v_all, layer,
                               config=cfg, interpret=True)  # unjitted: traced under the check
    with checked_memory():
        rows = jnp.stack([jnp.asarray(random_decode_indices(rng, lengths, Hkv, T, K)) for _ in range(L)])
        rows = rows.at[1, 0, 1, 1].set(jnp.full((K,), -1).at[0].set(3).at[1].set(10 ** 6))  # past the cache end
        out, lse, mass = decode(rows, lens, return_lse=True, return_mass=True)
        want, want_lse = ref.sparse_decode_reference(q, k_all[1], v_all[1], rows[1], lens, return_lse=True)
        assert_close(out, want, jnp.float32, "every layer's rows")
        np.testing.assert_allclose(lse, want_lse, rtol=1e-5)  # -inf for the query with no visible key
        np.testing.assert_allclose(mass, sparse_decode_mass_reference(q, k_all, v_all, layer, rows[1], lens)[1],
                                   rtol=1e-4, atol=1e-6)
        idx = jnp.asarray(random_decode_indices(rng, lengths, Hkv, T, K, block_size=8))
        hm = jnp.asarray([1, 1], jnp.int32)
        want = ref.sparse_decode_reference(q, k_all[1], v_all[1], jnp.take(idx, hm, axis=1), lens, block_size=8)
        assert_close(decode(idx, lens, block_size=8, head_map=hm), want, jnp.float32, "head map")
        idx = jnp.asarray(random_decode_indices(rng, lengths, Hq, T, K, block_size=8))  # [B, Hq, T, K]
        out = decode(idx, lens, block_size=8, query_heads=True)
        for h in range(Hq):  # query head h alone: its KV head and its own row
            kv = slice(h // 3, h // 3 + 1)
            want = ref.sparse_decode_reference(q[:, :, h:h + 1], k_all[1][:, kv], v_all[1][:, kv], idx[:, h:h + 1],
                                               lens, block_size=8)
            assert_close(out[:, :, h:h + 1], want, jnp.float32, f"query head {h}")


def test_sparse_stacked_tpu_interpret_matches_sliced_reference():
    L, B, T, Hq, Hkv, D, N, K, lengths, bs = 3, 2, 1, 4, 2, 16, 128, 5, [77, 128], 8
    rng, q, k_all, v_all, lens = stacked_inputs(11, L, B, T, Hq, Hkv, D, N, lengths, jnp.float32)
    idx = jnp.asarray(random_decode_indices(rng, lengths, Hkv, T, K, block_size=bs)).at[0, 0].set(-1)
    for layer in (2, 0):
        out, lse = stacked.sparse_decode_stacked_tpu(q, k_all, v_all, jnp.int32(layer), idx, lens, block_size=bs,
                                                     return_lse=True, config=tpu.TpuConfig(blocks_per_step=2),
                                                     interpret=True)
        want, want_lse = ref.sparse_decode_reference(q, k_all[layer], v_all[layer], idx, lens, block_size=bs,
                                                     return_lse=True)
        assert_close(out, want, jnp.float32, f"sparse stacked tpu layer {layer}")
        fin = np.isfinite(np.asarray(want_lse))
        assert np.array_equal(np.isfinite(np.asarray(lse)), fin)  # the empty row stays -inf
        assert_close(np.asarray(lse)[fin], np.asarray(want_lse)[fin], jnp.float32, "sparse stacked tpu lse")


def test_sparse_decode_api_with_layer_equals_slice():
    L, B, T, Hq, Hkv, D, N, K, lengths = 3, 2, 1, 4, 2, 16, 64, 8, [50, 21]
    rng, q, k_all, v_all, lens = stacked_inputs(12, L, B, T, Hq, Hkv, D, N, lengths, jnp.float32)
    idx = jnp.asarray(random_decode_indices(rng, lengths, Hkv, T, K))
    want = sparse_decode(q, k_all[1], v_all[1], idx, lens)
    for impl in (None, "xla", "reference"):  # None on CPU is XLA
        got = jax.jit(lambda l: sparse_decode(q, k_all, v_all, idx, lens, layer=l, implementation=impl))(1)
        assert_close(got, want, jnp.float32, f"api layer= {impl}")
    with pytest.raises(ValueError, match=r"k_all has shape \(2, 64, 16\)"):
        sparse_decode(q, k_all[1, 0], v_all[1, 0], idx, lens, layer=1)
    with pytest.raises(ValueError, match="layer has shape"):
        sparse_decode(q, k_all, v_all, idx, lens, layer=jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="indices has shape"):
        sparse_decode(q, k_all, v_all, idx[:, :1], lens, layer=0)
    with pytest.raises(ValueError, match=r"layer=3: expected a layer in \[-L, L\) of the L=3"):  # a known value
        sparse_decode(q, k_all, v_all, idx, lens, layer=3)
    assert_close(sparse_decode(q, k_all, v_all, idx, lens, layer=-2), want, jnp.float32, "layer -2 is layer 1")


# --------------------------------------------------------------------------------------------------
# Split-K dense decode over the stacked cache.

# (L, B, T, Hq, Hkv, D, N, lengths), dtype, config: N not a multiple of block_k, a short row (empty splits),
# several new tokens (causal among them), and T * G rows over several query blocks.
DENSE_CASES = [
    ((3, 2, 1, 8, 2, 16, 70, [37, 70]), jnp.float32, dgpu.DenseDecodeConfig(block_k=16, num_splits=3)),
    ((2, 2, 3, 6, 2, 32, 64, [5, 64]), jnp.bfloat16, dgpu.DenseDecodeConfig(block_k=16)),
    ((2, 1, 24, 4, 1, 16, 48, [40]), jnp.float32, dgpu.DenseDecodeConfig(block_k=16, block_q=32, num_splits=2)),
    ((2, 2, 1, 8, 2, 64, 300, [300, 129]), jnp.bfloat16, None),  # head_dim 64's default: 128-key blocks
]


@pytest.mark.parametrize("case,dtype,config", DENSE_CASES)
def test_dense_stacked_gpu_interpret_matches_dense_decode(case, dtype, config):
    L, B, T, Hq, Hkv, D, N, lengths = case
    _, q, k_all, v_all, lens = stacked_inputs(13, L, B, T, Hq, Hkv, D, N, lengths, dtype)
    layer = L - 1
    got = dgpu.dense_decode_stacked_gpu(q, k_all, v_all, jnp.int32(layer), lens, config=config, interpret=True)
    want = dense_decode(q, k_all[layer], v_all[layer], lens)
    assert got.dtype == dtype
    assert_close(got, want, dtype, "dense stacked vs dense_decode")
    spec = dense_decode_stacked_reference(q, k_all, v_all, jnp.int32(layer), lens)
    assert_close(got, spec, dtype, "dense stacked vs reference")
    plan = dgpu.plan(B, T, Hq, Hkv, N, config or dgpu.default_config(D))
    assert plan["splits"] > 1 and plan["splits"] * plan["chunk"] >= N


def test_dense_stacked_gpu_wraps_a_traced_layer_and_prepares_nothing_in_xla():
    # The kernel wraps and clamps a traced layer as jnp reads one (-1: the last layer, past either end: clamped),
    # finds each row's limit from the lengths and gathers its query rows from q itself: before the launch only free
    # reshapes and casts of the arguments run (each of the regrouped queries, the limits and the layer stack was
    # an XLA kernel a layer). T = 3 over G = 3 rows: the gathered rows cross tokens and a partial tile.
    L, B, T, Hq, Hkv, D, N, lengths = 3, 2, 3, 6, 2, 16, 40, [40, 2]
    _, q, k_all, v_all, lens = stacked_inputs(16, L, B, T, Hq, Hkv, D, N, lengths, jnp.float32)
    config = dgpu.DenseDecodeConfig(block_k=16, num_splits=2)
    run = jax.jit(lambda layer: dgpu.dense_decode_stacked_gpu(q, k_all, v_all, layer, lens, config=config,
                                                              interpret=True))
    for layer, read in ((-1, L - 1), (L + 2, L - 1), (-L - 3, 0), (1, 1)):
        got = run(jnp.int32(layer))
        assert_close(got, dense_decode(q, k_all[read], v_all[read], lens), jnp.float32, f"layer {layer}")
    jaxpr = jax.make_jaxpr(lambda q, layer, lens: dgpu.dense_decode_stacked_gpu(q, k_all, v_all, layer, lens))(
        q.astype(jnp.bfloat16), jnp.int32(0), lens).jaxpr
    while [e.primitive.name for e in jaxpr.eqns] in (["pjit"], ["jit"]):  # the jitted entry point's own body
        jaxpr = jaxpr.eqns[0].params["jaxpr"].jaxpr
    names = [e.primitive.name for e in jaxpr.eqns]
    before = names[:names.index("pallas_call")]
    assert set(before) <= {"reshape", "convert_element_type"}, before


def test_dense_stacked_masks_garbage_and_empty_rows():
    # NaN past each row's length must not leak (masked loads, not multiply-by-zero); a query whose position
    # is negative (lengths < T) sees no key and outputs zeros, as the reference says.
    L, B, T, Hq, Hkv, D, N = 2, 2, 2, 4, 2, 16, 48
    _, q, k_all, v_all, _ = stacked_inputs(14, L, B, T, Hq, Hkv, D, N, [1, 1], jnp.float32)
    lens = jnp.array([1, 33], jnp.int32)
    past = jnp.arange(N)[None, :] >= lens[:, None]  # [B, N]
    k_all = jnp.where(past[None, :, None, :, None], jnp.nan, k_all)
    v_all = jnp.where(past[None, :, None, :, None], jnp.nan, v_all)
    got = dgpu.dense_decode_stacked_gpu(q, k_all, v_all, jnp.int32(1), lens, interpret=True,
                                        config=dgpu.DenseDecodeConfig(block_k=16, num_splits=3))
    want = dense_decode_stacked_reference(q, jnp.nan_to_num(k_all), jnp.nan_to_num(v_all), jnp.int32(1), lens)
    assert_close(got, want, jnp.float32, "dense stacked with NaN past lengths")
    assert np.all(np.asarray(got[0, 0]) == 0) and np.all(np.asarray(got[0, 1]) != 0)


def test_dense_decode_stacked_api():
    L, B, T, Hq, Hkv, D, N, lengths = 2, 2, 1, 4, 2, 16, 32, [20, 32]
    _, q, k_all, v_all, lens = stacked_inputs(15, L, B, T, Hq, Hkv, D, N, lengths, jnp.float32)
    want = dense_decode(q, k_all[0], v_all[0], lens)
    for impl in (None, "sliced", "reference"):  # None on CPU slices
        assert_close(dense_decode_stacked(q, k_all, v_all, jnp.int32(0), lens, implementation=impl), want,
                     jnp.float32, f"dense api {impl}")
    with pytest.raises(ValueError, match="implementation='cudnn'"):
        dense_decode_stacked(q, k_all, v_all, 0, lens, implementation="cudnn")
    with pytest.raises(ValueError, match=r"layer=-3: expected a layer in \[-L, L\) of the L=2"):
        dense_decode_stacked(q, k_all, v_all, -3, lens)
    with pytest.raises(ValueError, match="v_all has dtype int8: expected a floating dtype"):
        dense_decode_stacked(q, k_all, v_all.astype(jnp.int8), 0, lens)
    with pytest.raises(ValueError, match=r"Hq=4 .* Hkv=3"):
        dense_decode_stacked(q, k_all[:, :, :1].repeat(3, 2), v_all[:, :, :1].repeat(3, 2), 0, lens)
    with pytest.raises(ValueError, match="head_dim D=24"):
        dgpu.dense_decode_stacked_gpu(jnp.zeros((1, 1, 2, 24)), jnp.zeros((1, 1, 1, 8, 24)),
                                      jnp.zeros((1, 1, 1, 8, 24)), 0, jnp.array([8]), interpret=True)
    with pytest.raises(ValueError, match="block_k=24"):
        dgpu.dense_decode_stacked_gpu(q, k_all, v_all, 0, lens, config=dgpu.DenseDecodeConfig(block_k=24),
                                      interpret=True)
    with pytest.raises(ValueError, match="num_stages=0"):
        dgpu.dense_decode_stacked_gpu(q, k_all, v_all, 0, lens, config=dgpu.DenseDecodeConfig(num_stages=0),
                                      interpret=True)


# (L, B, Hq, Hkv, D, N, lengths, Lw, block), config: G = 4 and G = 3 (not a power of two), N not a multiple of
# block_k, rows of one key and of a partial last block, the record buffer with more layers than the cache.
RECORD_CASES = [
    ((3, 2, 8, 2, 16, 300, [300, 5], 2, 16), dgpu.DenseDecodeConfig(block_k=64, target_programs=8)),
    ((2, 3, 9, 3, 32, 129, [1, 129, 70], 3, 8), dgpu.DenseDecodeConfig(block_k=32, num_splits=3)),
    ((1, 1, 16, 2, 64, 1000, [1000], 2, 16), None),  # head_dim 64's default: 128-key blocks
]


@pytest.mark.parametrize("case,config", RECORD_CASES)
def test_dense_record_gpu_interpret_matches_reference(case, config):
    """`dense_decode_record`: the kernel's output, log-sum-exps, the logits it writes into the record buffer in
    place (the keys each row sees; the rest of the buffer untouched) and their block maxima (-inf past each row's
    length, written into the block buffer's row in place) equal the reference."""
    from pallas_kernels.dense_decode.reference import dense_decode_record_reference

    L, B, Hq, Hkv, D, N, lengths, Lw, block = case
    rng, q, k_all, v_all, lens = stacked_inputs(16, L, B, 1, Hq, Hkv, D, N, lengths, jnp.bfloat16)
    record = randn(rng, (B, Hq, Lw, N), jnp.float32)
    bmax = randn(rng, (B, Hq, Lw, -(-N // block)), jnp.float32)
    layer, row = jnp.int32(L - 1), jnp.int32(Lw - 1)
    want = dense_decode_record_reference(q, k_all, v_all, layer, lens, record, bmax, row, block=block)
    got = dgpu.dense_decode_record_gpu(q, k_all, v_all, layer, lens, jnp.array(record), jnp.array(bmax), row,
                                       block=block, config=config, interpret=True)
    assert_close(got[0], want[0], jnp.bfloat16, "record out")
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-5, atol=1e-5)
    for g, old in ((got[2], record), (got[3], bmax)):  # the other layers untouched
        assert np.array_equal(np.asarray(g)[:, :, :-1], np.asarray(old)[:, :, :-1])
    gb, wb = np.asarray(got[3])[:, :, -1], np.asarray(want[3])[:, :, -1]
    assert np.array_equal(np.isneginf(gb), np.isneginf(wb))
    assert np.isneginf(gb).any() == (min(lengths) + block <= N)  # blocks past a row's length: -inf
    np.testing.assert_allclose(np.where(np.isinf(gb), 0, gb), np.where(np.isinf(wb), 0, wb), rtol=1e-5, atol=1e-5)
    p = np.exp(np.asarray(got[2])[:, :, -1] - np.asarray(got[1])[..., None])  # the weights the logits give
    p = np.where(np.arange(N)[None, None] < np.asarray(lens)[:, None, None], p, 0.0)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-4)


def test_dense_stacked_gpu_stays_in_its_blocks():
    """Every load and store of the dense decode kernels stays inside its block (`pallas_bounds.checked_memory`: the
    interpreter pads stray loads and drops stray stores, where a GPU reads or overwrites another program's rows):
    N = 70 (a partial last key block), 3 splits, a row shorter than T (a query with no visible key, splits with
    nothing to read); T * G = 18 rows over two query blocks of 16 (the second mostly padding) with the logits
    written (`return_probs`); the record kernel with G = 3 (rows padded to 16), blocks of 8 keys, a record buffer
    of more layers than the cache."""
    from pallas_kernels.dense_decode.reference import dense_decode_record_reference
    from pallas_kernels.head_probs import head_probs_stacked_reference

    L, B, Hq, Hkv, D, N, lengths = 2, 2, 6, 2, 16, 70, [70, 2]
    layer = jnp.int32(1)
    with checked_memory():  # the wrappers unjitted: traced under the check
        for T, config in ((3, dgpu.DenseDecodeConfig(block_k=16, num_splits=3)),
                          (6, dgpu.DenseDecodeConfig(block_k=16, block_q=16, num_splits=3))):
            _, q, k_all, v_all, lens = stacked_inputs(18, L, B, T, Hq, Hkv, D, N, lengths, jnp.float32)
            out, lse, probs = dgpu.dense_decode_stacked_gpu.__wrapped__(q, k_all, v_all, layer, lens, return_lse=True,
                                                                        return_probs=True, config=config,
                                                                        interpret=True)
            want, want_lse = dense_decode_stacked_reference(q, k_all, v_all, layer, lens, return_lse=True)
            assert_close(out, want, jnp.float32, f"T = {T}")
            np.testing.assert_allclose(lse, want_lse, rtol=1e-5)  # -inf for a query with no visible key
            assert_close(probs, head_probs_stacked_reference(q, k_all, layer, lens, want_lse), jnp.float32, "probs")
        rng, q, k_all, v_all, lens = stacked_inputs(19, L, B, 1, Hq, Hkv, D, N, [70, 5], jnp.bfloat16)
        record = randn(rng, (B, Hq, 3, N), jnp.float32)
        bmax = randn(rng, (B, Hq, 3, -(-N // 8)), jnp.float32)
        want = dense_decode_record_reference(q, k_all, v_all, layer, lens, record, bmax, jnp.int32(2), block=8)
        got = dgpu.dense_decode_record_gpu.__wrapped__(q, k_all, v_all, layer, lens, record, bmax, jnp.int32(2),
                                                       block=8, config=dgpu.DenseDecodeConfig(block_k=16,
                                                                                              num_splits=3),
                                                       interpret=True)
        assert_close(got[0], want[0], jnp.bfloat16, "record out")
        for g, w in zip(got[1:], want[1:]):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_dense_record_api_and_errors():
    """`dense_decode_record` off a GPU ("sliced": `dense_decode` on the slice, the record in XLA) equals the reference,
    names bad arguments, and lowers for CUDA with both record buffers aliased to the kernel's outputs (in place)."""
    from pallas_kernels.dense_decode import dense_decode_record, dense_decode_record_reference

    L, B, Hq, Hkv, D, N = 2, 2, 4, 2, 16, 40
    rng, q, k_all, v_all, lens = stacked_inputs(17, L, B, 1, Hq, Hkv, D, N, [40, 9], jnp.float32)
    record, bmax = randn(rng, (B, Hq, 3, N), jnp.float32), randn(rng, (B, Hq, 3, 5), jnp.float32)
    want = dense_decode_record_reference(q, k_all, v_all, 1, lens, record, bmax, 2, block=8)
    for impl in (None, "sliced", "reference"):  # copies: a GPU's kernel takes the buffers (donated, in place)
        got = dense_decode_record(q, k_all, v_all, 1, lens, jnp.array(record), jnp.array(bmax), 2, block=8,
                                  implementation=impl)
        assert_close(got[0], want[0], jnp.float32, f"record api {impl}")
        for g, w in zip(got[1:], want[1:]):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="T=2 new tokens"):
        dense_decode_record(jnp.zeros((B, 2, Hq, D)), k_all, v_all, 0, lens, record, bmax, 0)
    with pytest.raises(ValueError, match=r"record has shape \(2, 4, 3, 39\)"):
        dense_decode_record(q, k_all, v_all, 0, lens, record[..., :-1], bmax, 0)
    with pytest.raises(ValueError, match=r"bmax has shape \(2, 4, 3, 4\) .* expected f32\[2, 4, 3, 5\]"):
        dense_decode_record(q, k_all, v_all, 0, lens, record, bmax[..., :-1], 0, block=8)
    with pytest.raises(ValueError, match="block=12"):
        dense_decode_record(q, k_all, v_all, 0, lens, record, bmax, 0, block=12)
    with pytest.raises(ValueError, match="block=256: expected a power of two <= the kernel's block_k=64"):
        dgpu.dense_decode_record_gpu(q.astype(jnp.bfloat16), k_all.astype(jnp.bfloat16), v_all.astype(jnp.bfloat16),
                                     0, lens, record, bmax, 0, block=256, interpret=True)
    with pytest.raises(ValueError, match="G=32 query heads per KV head.*block_q=16"):
        dgpu.dense_decode_record_gpu(jnp.zeros((1, 1, 32, 16), jnp.bfloat16), jnp.zeros((1, 1, 1, 32, 16), jnp.bfloat16),
                                     jnp.zeros((1, 1, 1, 32, 16), jnp.bfloat16), 0, jnp.array([32]),
                                     jnp.zeros((1, 32, 1, 32)), jnp.zeros((1, 32, 1, 2)), 0,
                                     config=dgpu.DenseDecodeConfig(block_q=16), interpret=True)
    sds = jax.ShapeDtypeStruct
    big = sds((16, 7, 8, 100000, 64), jnp.bfloat16)  # the STS draft at 100K, batch 7
    exp = export_for("cuda", functools.partial(dgpu.dense_decode_record_gpu, block=16), sds((7, 1, 32, 64), jnp.bfloat16),
                     big, big, sds((), jnp.int32), sds((7,), jnp.int32), sds((7, 32, 16, 100000), jnp.float32),
                     sds((7, 32, 16, 6250), jnp.float32), sds((), jnp.int32))
    text = exp.mlir_module()
    assert "dense_decode_stacked_record" in text
    for out, operand in ((3, 5), (4, 6)):
        assert f"output_operand_alias<output_tuple_indices = [{out}], operand_index = {operand}" in text


@pytest.mark.parametrize("T, config, stages", [(1, dgpu.DenseDecodeConfig(), 4), (5, dgpu.DenseDecodeConfig(), 3),
                                               (1, dgpu.DenseDecodeConfig(num_stages=2), 2)])
def test_dense_stacked_pipeline_stages_follow_the_tile(T, config, stages):
    """Plain decoding's 16-row tiles (the group's G = 4 rows padded) pipeline 4 stages by default, larger tiles 3
    (eval/results/h200/dense_decode_t1/); an explicit num_stages wins. Read off the Triton call lowered for an H100."""
    q, k = jnp.zeros((2, T, 8, 64), jnp.bfloat16), jnp.zeros((2, 2, 2, 256, 64), jnp.bfloat16)
    fn = lambda q, k: dgpu.dense_decode_stacked_gpu(q, k, k, jnp.int32(1), jnp.array([100, 200], jnp.int32),  # noqa: E731
                                                    config=config)
    text = export_for("cuda", fn, q, k).mlir_module()
    assert text.count(f"num_stages = {stages} : i32") == 1, text[text.find("num_stages") - 20:][:60]


def test_dense_decode_default_config_per_head_dim():
    """Without a config the kernel takes `default_config(head_dim)`: head_dim 64's own (128-key blocks, 1024 target
    programs; eval/results/h200/dense_decode_d64/), `DenseDecodeConfig()` at 128. Compared as lowered Triton calls."""
    def lowered(D, config):
        q, k = jnp.zeros((2, 1, 8, D), jnp.bfloat16), jnp.zeros((2, 2, 2, 4096, D), jnp.bfloat16)
        fn = lambda q, k: dgpu.dense_decode_stacked_gpu(q, k, k, jnp.int32(1), jnp.array([100, 4000], jnp.int32),  # noqa: E731
                                                        config=config)
        text = export_for("cuda", fn, q, k).mlir_module()
        return re.sub(r"#loc\d*", "", "\n".join(line for line in text.splitlines() if not line.startswith("#loc")))

    d64 = dgpu.default_config(64)
    assert (d64.block_k, d64.target_programs) == (128, 1024) and dgpu.default_config(128) == dgpu.DenseDecodeConfig()
    # the record kernel's own default at head_dim 64 (eval/results/h200/record_blocks/sweep.json), else the same
    assert dgpu.default_config(64, record=True) == dgpu.DenseDecodeConfig(block_k=128, target_programs=2048)
    assert dgpu.default_config(128, record=True) == dgpu.DenseDecodeConfig()
    assert lowered(64, None) == lowered(64, d64) != lowered(64, dgpu.DenseDecodeConfig())
    assert lowered(128, None) == lowered(128, dgpu.DenseDecodeConfig()) != lowered(128, d64)


def test_dense_decode_api_config_per_head_dim(monkeypatch):
    """`dense_decode.api.CONFIGS` sets the Pallas kernel's config for one head_dim (the STS draft's) and leaves the
    others at the default: read off the Triton calls lowered for an H100."""
    from pallas_kernels.dense_decode import api as dapi

    monkeypatch.setitem(dapi.CONFIGS, 64, dgpu.DenseDecodeConfig(num_stages=2))

    def stages(D):
        q, k = jnp.zeros((2, 1, 8, D), jnp.bfloat16), jnp.zeros((2, 2, 2, 256, D), jnp.bfloat16)
        fn = lambda q, k: dense_decode_stacked(q, k, k, jnp.int32(1), jnp.array([100, 200], jnp.int32),  # noqa: E731
                                               implementation="pallas_gpu")
        text = export_for("cuda", fn, q, k).mlir_module()
        return [n for n in (2, 3, 4) if f"num_stages = {n} : i32" in text]

    assert stages(64) == [2] and stages(128) == [4]


# --------------------------------------------------------------------------------------------------
# Lowering for CUDA and TPU on this CPU-only machine.


def test_stacked_kernels_lower_for_cuda_and_tpu():
    sds = jax.ShapeDtypeStruct
    # Llama-3.1-8B decode shapes at 128K and batch 8: the stacked cache is 64 GiB, so the kernels' offsets
    # are 64-bit (Triton lowering switches above 4 GiB).
    big = sds((32, 8, 8, 131072, 128), jnp.bfloat16)
    q, layer, lens = sds((8, 1, 32, 128), jnp.bfloat16), sds((), jnp.int32), sds((8,), jnp.int32)
    exp = export_for("cuda", functools.partial(stacked.sparse_decode_stacked_gpu, block_size=16, return_lse=True),
                  q, big, big, layer, sds((8, 8, 1, 819), jnp.int32), lens)
    assert "sparse_decode_gathered_stacked" in exp.mlir_module()
    exp = export_for("cuda", functools.partial(stacked.sparse_decode_stacked_gpu, block_size=16, query_heads=True),
                     q, big, big, layer, sds((8, 32, 1, 819), jnp.int32), lens)  # one launch over the query heads
    text = exp.mlir_module()
    assert "sparse_decode_gathered_stacked_query_heads" in text and text.count("stablehlo.custom_call") == 1
    verify = sds((32, 3, 8, 100352, 128), jnp.bfloat16)  # an STS verification at 100K, batch 3, gamma 4
    exp = export_for("cuda", stacked.sparse_decode_stacked_gpu, sds((3, 5, 32, 128), jnp.bfloat16), verify, verify,
                     layer, sds((3, 8, 1, 517), jnp.int32), sds((3,), jnp.int32))  # one row for the 5 queries
    text = exp.mlir_module()
    assert "sparse_decode_gathered_stacked" in text and text.count("stablehlo.custom_call") == 1
    exp = export_for("cuda", dgpu.dense_decode_stacked_gpu, q, big, big, layer, lens)
    assert "dense_decode_stacked" in exp.mlir_module()
    small = sds((4, 2, 8, 2000, 128), jnp.bfloat16)  # N not a multiple of block_k, T = 3
    exp = export_for("cuda", dgpu.dense_decode_stacked_gpu, sds((2, 3, 32, 128), jnp.bfloat16), small, small, layer,
                  sds((2,), jnp.int32))
    assert "dense_decode_stacked" in exp.mlir_module()
    cache = sds((4, 2, 8, 2048, 128), jnp.bfloat16)
    exp = export_for("tpu", functools.partial(stacked.sparse_decode_stacked_tpu, block_size=16, return_lse=True),
                  sds((2, 1, 32, 128), jnp.bfloat16), cache, cache, layer, sds((2, 8, 1, 40), jnp.int32),
                  sds((2,), jnp.int32))
    assert "tpu_custom_call" in exp.mlir_module()


# --------------------------------------------------------------------------------------------------
# The methods inside the model's layer scan.


def test_methods_use_stacked_cache_inside_the_scan():
    from flax import struct

    from jsparse.methods import make_method
    from jsparse.methods.common import attend_dense, attend_selected
    from models import llama
    from models.attention import LayerKV
    from models.cache import init_cache
    from models.config import ModelConfig
    from models.params import random_params

    # attend_selected with the stacked view equals the sliced call.
    L, B, Hq, Hkv, D, N, K, lengths = 2, 2, 4, 2, 16, 32, 6, [20, 32]
    rng, q, k_all, v_all, lens = stacked_inputs(16, L, B, 1, Hq, Hkv, D, N, lengths, jnp.float32)
    idx = jnp.asarray(random_decode_indices(rng, lengths, Hkv, 1, K))
    view = LayerKV(k=k_all[1], v=v_all[1], k_all=k_all, v_all=v_all, layer=jnp.int32(1))
    assert_close(attend_selected(q, view, idx, lens), sparse_decode(q, k_all[1], v_all[1], idx, lens),
                 jnp.float32, "attend_selected stacked")
    assert_close(attend_dense(q, view, lens), dense_decode(q, k_all[1], v_all[1], lens), jnp.float32,
                 "attend_dense stacked (CPU: the slice)")

    # A method that selects every visible key through attend_selected decodes like dense in the model.
    @struct.dataclass
    class AllKeys:
        def init_state(self, cfg, batch, max_len):
            return None

        def layer_info(self, cfg):
            return None

        def decode(self, ctx, q, cache, state):
            n = cache.k.shape[2]
            idx = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (q.shape[0], cache.k.shape[1], 1, n))
            return attend_selected(q, cache, jnp.where(idx < ctx.lengths[:, None, None, None], idx, -1),
                                   ctx.lengths), state

    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, max_position_embeddings=64)
    params = random_params(cfg, jax.random.key(0), jnp.float32)
    empty = init_cache(cfg, 2, 16, jnp.float32)
    filled = jax.random.normal(jax.random.key(1), empty.k.shape, jnp.float32)
    cache = empty.replace(k=filled, v=filled[::-1], lengths=jnp.array([4, 9], jnp.int32))
    tok = jnp.array([[11], [12]], jnp.int32)
    step = jax.jit(lambda m: llama.decode(params, cfg, m, tok, cache, None)[0])
    want, got = step(make_method("dense")), step(AllKeys())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_bench_fixed_selection_and_hlo_copy_counter():
    from eval.bench.decode_step import fixed_indices, slice_copies

    idx = np.asarray(fixed_indices(jnp.array([100, 10]), 16, 4))
    np.testing.assert_array_equal(idx[0], np.r_[0:4, 88:100])  # sinks, then the last 12 tokens
    real = idx[1][idx[1] >= 0]  # a short row: the windows overlap, every token once
    np.testing.assert_array_equal(real, np.arange(10))
    # The copy counter finds materialised dynamic slices (outside fusion bodies), not their consumers. Compiled for
    # the CPU on any machine: a GPU compile fuses these two slices into their consumers (no copy to count).
    f = jax.jit(lambda x, i, y: (jnp.sort(x[i], axis=-1), jnp.dot(x[i + 1], y)))
    cpu = jax.devices("cpu")[0]
    x, y = (jax.device_put(jnp.ones(s, jnp.bfloat16), cpu) for s in ((4, 64, 64), (64, 64)))
    hlo = f.lower(x, jax.device_put(jnp.int32(1), cpu), y).compile().as_text()
    assert slice_copies(hlo, {"w": {64 * 64}, "other": {7}}) == {"w": 2, "other": 0}


def test_dense_method_on_gpu_branch_reads_stacked_cache(monkeypatch):
    # The GPU branch of attend_dense (taken by Dense.decode), exercised on CPU: the backend reported as "gpu"
    # and the kernel run in the interpreter, inside the model's layer scan, against the plain path.
    from jsparse.methods import common, make_method
    from models import llama
    from models.cache import init_cache
    from models.config import ModelConfig
    from models.params import random_params

    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64)
    params = random_params(cfg, jax.random.key(0), jnp.bfloat16)
    empty = init_cache(cfg, 2, 40, jnp.bfloat16)
    filled = jax.random.normal(jax.random.key(1), empty.k.shape, jnp.bfloat16)
    cache = empty.replace(k=filled, v=filled[::-1], lengths=jnp.array([5, 33], jnp.int32))
    tok = jnp.array([[11], [12]], jnp.int32)
    dense = make_method("dense")
    want = llama.decode(params, cfg, dense, tok, cache, None)[0]
    calls = []

    def interpreted(q, k_all, v_all, layer, lengths, implementation):
        calls.append((k_all.shape, implementation))
        return dgpu.dense_decode_stacked_gpu(q, k_all, v_all, layer, lengths, interpret=True,
                                             config=dgpu.DenseDecodeConfig(block_k=16))

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(common, "dense_decode_stacked", interpreted)
    got = llama.decode(params, cfg, dense, tok, cache, None)[0]
    assert calls == [(empty.k.shape, "pallas_gpu")]  # traced once, in the scan body, on the stacked cache
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=0.01)  # wrong layer: 0.4 off


def test_dense_reference_ignores_nan_values_no_query_sees():
    """The reference's output does not read V rows no query sees: NaN there (a cache's unwritten tail) leaves every
    output finite and equal to the clean cache's, a row with no visible key included."""
    L, B, T, Hq, Hkv, D, N = 2, 2, 2, 4, 2, 16, 32
    _, q, k_all, v_all, _ = stacked_inputs(18, L, B, T, Hq, Hkv, D, N, [1, 1], jnp.float32)
    lens = jnp.array([1, 20], jnp.int32)
    past = jnp.arange(N)[None, :] >= lens[:, None]
    nan_v = jnp.where(past[None, :, None, :, None], jnp.nan, v_all)
    got = np.asarray(dense_decode_stacked_reference(q, k_all, nan_v, jnp.int32(1), lens))
    want = np.asarray(dense_decode_stacked_reference(q, k_all, v_all, jnp.int32(1), lens))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)
    assert not got[0, 0].any()


def test_dense_decode_more_new_tokens_than_the_cache_is_named():
    L, B, Hq, Hkv, D, N = 1, 1, 4, 2, 16, 8
    _, q, k_all, v_all, lens = stacked_inputs(19, L, B, N + 1, Hq, Hkv, D, N, [N], jnp.float32)
    with pytest.raises(ValueError, match=r"T=9 new tokens: expected 1 <= T <= N=8"):
        dense_decode_stacked(q, k_all, v_all, 0, lens, implementation="reference")


def test_dense_record_block_not_a_power_of_two_is_named():
    from pallas_kernels.dense_decode import dense_decode_record

    L, B, Hq, Hkv, D, N = 2, 2, 4, 2, 16, 40
    rng, q, k_all, v_all, lens = stacked_inputs(20, L, B, 1, Hq, Hkv, D, N, [40, 9], jnp.float32)
    record, bmax = randn(rng, (B, Hq, 3, N), jnp.float32), randn(rng, (B, Hq, 3, 4), jnp.float32)  # ceil(40 / 12)
    with pytest.raises(ValueError, match="block=12: expected a power of two"):
        dense_decode_record(q, k_all, v_all, 0, lens, record, bmax, 0, block=12)

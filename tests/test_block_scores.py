"""pallas_kernels.block_scores: the Triton kernels (interpret mode) and the XLA fallback equal the reference
(retrieval block max over odd lengths, several R, masked heads and padding; gathered decode with per-entry mass),
both kernels lower for CUDA, and bad arguments raise."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.block_scores import (block_max_scores, gpu, pending_shapes, reference, sparse_decode_heat,
                                         sparse_decode_mass, xla)
from pallas_kernels.sparse_attention import sparse_decode, stacked
from lowering import H100, abstract_device
from pallas_bounds import checked_memory

L, B, HQ, HKV, D, N, BS = 3, 2, 8, 2, 16, 256, 8
G = HQ // HKV


def _cache(seed, T=1, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, T, HQ, D), dtype)
    k = jax.random.normal(ks[1], (L, B, HKV, N, D), dtype)
    v = jax.random.normal(ks[2], (L, B, HKV, N, D), dtype)
    return q, k, v


@pytest.mark.parametrize("R,T", [(1, 1), (2, 2), (3, 1)])
def test_block_max_matches_reference_and_numpy(R, T):
    q, k, _ = _cache(R + 10 * T, T)
    kvh = jnp.array([1, 0, 1][:R], jnp.int32)
    hm = jnp.array([[True, False, True, False], [False, False, False, True], [False] * 4][:R])  # r=2: padding
    pos = jnp.array([[200, 201][:T], [37, 38][:T]], jnp.int32)  # odd lengths, mid-block
    lo = jnp.array([[1, 1][:T], [0, 2][:T]], jnp.int32)
    hi = pos // BS + 1 - jnp.array([[2, 2][:T], [1, 0][:T]], jnp.int32)
    args = (q, k, jnp.int32(1), kvh, hm, pos, lo, hi)
    want = reference.block_max_scores_reference(*args, block_size=BS)
    got = gpu.block_max_scores_gpu(*args, block_size=BS, interpret=True,
                                   config=gpu.BlockMaxConfig(blocks_per_program=16))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(xla.block_max_scores_xla(*args, block_size=BS), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(block_max_scores(*args, block_size=BS), want, rtol=1e-5, atol=1e-5)
    # NumPy, brute force
    qn, kn = np.asarray(q, np.float64), np.asarray(k[1], np.float64)
    for b in range(B):
        for t in range(T):
            p, a, z = int(pos[b, t]), int(lo[b, t]), int(hi[b, t])
            tok = np.full(N, -np.inf)
            for r in range(R):
                for g in range(G):
                    if hm[r, g]:
                        h = int(kvh[r])
                        tok = np.maximum(tok, kn[b, h] @ qn[b, t, h * G + g] / np.sqrt(D))
            tok[p + 1:] = -np.inf
            bmax = tok.reshape(-1, BS).max(-1)
            bmax[:a] = -np.inf
            bmax[z:] = -np.inf
            np.testing.assert_allclose(want[b, t], bmax, rtol=1e-5, atol=1e-5)
            assert np.isfinite(bmax).sum() == max(z - a, 0)


def _indices(T, K=7, used=5):
    rng = np.random.default_rng(0)
    idx = np.full((B, HKV, T, K), -1, np.int32)
    for b in range(B):
        for h in range(HKV):
            for t in range(T):
                idx[b, h, t, :used] = np.sort(rng.choice(N // BS, used, replace=False))
    return jnp.asarray(idx)


@pytest.mark.parametrize("T,block_k", [(1, 16), (2, 32)])
def test_decode_mass_matches_reference(T, block_k):
    q, k, v = _cache(3, T)
    idx = _indices(T)
    lengths = jnp.array([200, 77], jnp.int32)
    want_o, want_m = reference.sparse_decode_mass_reference(q, k, v, jnp.int32(2), idx, lengths, block_size=BS)
    o, m = gpu.sparse_decode_mass_gpu(q, k, v, jnp.int32(2), idx, lengths, block_size=BS, interpret=True,
                                      config=gpu.sgpu.DecodeConfig(block_k=block_k, num_splits=2))
    np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(m, want_m, rtol=1e-4, atol=1e-6)
    o, m = xla.sparse_decode_mass_xla(q, k, v, jnp.int32(2), idx, lengths, block_size=BS)
    np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(m, want_m, rtol=1e-4, atol=1e-6)
    # the output is the gathered decode's; the mass of each query sums to 1 over its entries (0 for -1 entries)
    np.testing.assert_allclose(want_o, sparse_decode(q, k, v, idx, lengths, layer=jnp.int32(2), block_size=BS,
                                                     implementation="reference"), rtol=1e-5, atol=1e-5)
    sums = np.asarray(want_m).sum(-1)  # 1, or 0 for a query none of whose blocks is visible yet
    assert np.all(np.isclose(sums, 1.0, rtol=1e-5) | (sums == 0.0)) and np.isclose(sums, 1.0).sum() >= 4
    assert float(jnp.abs(want_m[..., 5:]).max()) == 0.0


def test_decode_mass_reads_every_layers_rows_at_the_layer():
    """indices [L, B, Hkv, T, K], every layer's rows (H2O's kept keys): the kernel (interpret mode) reads layer
    `layer`'s in place and equals the call on that layer's rows, with and without the mass, at a negative layer
    too; so do the dispatcher's XLA and reference paths. A head map with them, or a wrong leading axis, raises."""
    q, k, v = _cache(5)
    rows = jnp.stack([_indices(1, K=7, used=u) for u in (5, 3, 6)])  # [L, B, Hkv, 1, K], a different row per layer
    rows = rows.at[1].set(jnp.flip(rows[1], 1))  # layer 1's rows differ from layer 0's by head too
    lengths = jnp.array([200, 77], jnp.int32)
    cfg = gpu.sgpu.DecodeConfig(block_k=16, num_splits=2)
    for layer in (1, 2, -2):
        one = rows[layer]
        want = gpu.sparse_decode_mass_gpu(q, k, v, jnp.int32(layer), one, lengths, block_size=BS, interpret=True,
                                          config=cfg)
        got = gpu.sparse_decode_mass_gpu(q, k, v, jnp.int32(layer), rows, lengths, block_size=BS, interpret=True,
                                         config=cfg)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        ref = reference.sparse_decode_mass_reference(q, k, v, jnp.int32(layer), one, lengths, block_size=BS)
        for impl in ("xla", "reference"):
            for g, w in zip(sparse_decode_mass(q, k, v, jnp.int32(layer), rows, lengths, block_size=BS,
                                               implementation=impl), ref):
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
        plain = stacked.sparse_decode_stacked_gpu(q, k, v, jnp.int32(layer), rows, lengths, block_size=BS,
                                                  config=cfg, interpret=True)
        np.testing.assert_array_equal(plain, stacked.sparse_decode_stacked_gpu(
            q, k, v, jnp.int32(layer), one, lengths, block_size=BS, config=cfg, interpret=True))
    with pytest.raises(ValueError, match=r"head_map with every layer's index rows"):
        stacked.sparse_decode_stacked_gpu(q, k, v, jnp.int32(0), rows, lengths, block_size=BS,
                                          head_map=jnp.arange(HKV, dtype=jnp.int32), interpret=True)
    with pytest.raises(ValueError, match=r"expected every layer's index rows \[L=3"):
        sparse_decode_mass(q, k, v, jnp.int32(0), rows[:2], lengths, block_size=BS)


def test_decode_mass_with_no_visible_key_is_zero():
    q, k, v = _cache(4)
    idx = _indices(1)
    lengths = jnp.array([0, 0], jnp.int32)  # lengths 0: the query sees nothing (a dense layer run branchless)
    o, m = gpu.sparse_decode_mass_gpu(q, k, v, jnp.int32(0), idx, lengths, block_size=BS, interpret=True)
    assert float(jnp.abs(o).max()) == 0.0 and float(jnp.abs(m).max()) == 0.0
    o, m = sparse_decode_mass(q, k, v, jnp.int32(0), idx, lengths, block_size=BS)
    assert float(jnp.abs(o).max()) == 0.0 and float(jnp.abs(m).max()) == 0.0


@pytest.mark.parametrize("splits,block_k,K,layer", [(2, 16, 7, 2), (3, 32, 9, -1), (1, 16, 5, 0)])
def test_decode_heat_matches_reference(splits, block_k, K, layer):
    """The gathered decode + in-place heat step (`sparse_decode_heat`): the Triton pair (interpret mode) and the
    XLA fallback equal the reference (odd entry counts, -1 padding, split counts that do not divide K, a row
    whose length is 0, negative layer); only row `layer` of the heat changes, by the block sums of the mass."""
    q, k, v = _cache(6)
    idx = _indices(1, K=K, used=min(5, K - 1))
    lengths = jnp.array([200, 0], jnp.int32)  # row 1 sees nothing: its heat must not move
    heat = jax.random.uniform(jax.random.key(9), (L, B, HKV, N // BS))
    args = (q, k, v, jnp.int32(layer), idx, lengths, heat)
    want_o, want_h = reference.sparse_decode_heat_reference(*args, block_size=BS)
    o, h = gpu.sparse_decode_heat_gpu(*args, block_size=BS, interpret=True,
                                      config=gpu.sgpu.DecodeConfig(block_k=block_k, num_splits=splits))
    np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=1e-6)
    # In one launch (tickets): the last program of each row finishes it, and hands the counters back as zeros.
    tickets = jnp.zeros((B, HKV, 1), jnp.int32)
    o1, h1, t1 = gpu.sparse_decode_heat_gpu(*args, block_size=BS, interpret=True, tickets=tickets,
                                            config=gpu.sgpu.DecodeConfig(block_k=block_k, num_splits=splits))
    np.testing.assert_allclose(o1, o, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(h1, h, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(t1, tickets)
    o, h = xla.sparse_decode_heat_xla(*args, block_size=BS)
    np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=1e-6)
    # A cache of one layer (a bare view) with the heat row named apart: the same result.
    one = (q, k[row := layer % L][None], v[row][None], jnp.int32(0), idx, lengths, heat, jnp.int32(layer))
    o, h = gpu.sparse_decode_heat_gpu(*one, block_size=BS, interpret=True,
                                      config=gpu.sgpu.DecodeConfig(block_k=block_k, num_splits=splits))
    np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=1e-6)
    changed = np.flatnonzero(np.any(np.asarray(want_h) != np.asarray(heat), axis=(1, 2, 3)))
    assert list(changed) == [row]
    np.testing.assert_array_equal(want_h[row, 1], heat[row, 1])  # length 0: unchanged
    _, mass = reference.sparse_decode_mass_reference(q, k, v, jnp.int32(layer), idx, lengths, block_size=BS)
    np.testing.assert_allclose(np.asarray(want_h[row]).sum() - np.asarray(heat[row]).sum(), float(mass.sum()),
                               rtol=1e-5)
    assert np.isclose(float(mass[0].sum()), HKV, rtol=1e-5)  # each KV head's masses sum to 1
    with pytest.raises(ValueError, match="one"):
        gpu.sparse_decode_heat_gpu(*_cache(6, 2)[:1], k, v, jnp.int32(0), _indices(2), lengths, heat, block_size=BS)
    with pytest.raises(ValueError, match="heat has shape"):
        xla_h = heat[:, :, :, :5]
        from pallas_kernels.block_scores import sparse_decode_heat
        sparse_decode_heat(q, k, v, jnp.int32(0), idx, lengths, xla_h, block_size=BS)


def test_decode_heat_in_one_launch_in_chunks_and_its_limit(monkeypatch):
    """The one-launch finish's last program adds a row's entries in static chunks (FINISH_CHUNK; 16 here, so the
    row's 31 entries take two): the same output and heat as the two launches; with rows_out the output in the
    GEMMs' padded rows (zeros past the batch). Rows of more than
    FINISH_MAX_ENTRIES entries are refused by name (H2O's keep the two launches)."""
    monkeypatch.setattr(gpu, "FINISH_CHUNK", 16)
    q, k, v = _cache(12)
    idx = _indices(1, K=31, used=29)
    lengths = jnp.array([256, 140], jnp.int32)
    heat = jax.random.uniform(jax.random.key(3), (L, B, HKV, N // BS))
    cfg = gpu.sgpu.DecodeConfig(block_k=16, num_splits=3)
    args = (q, k, v, jnp.int32(2), idx, lengths, heat)
    o, h = gpu.sparse_decode_heat_gpu(*args, block_size=BS, config=cfg, interpret=True)
    o1, h1, t1 = gpu.sparse_decode_heat_gpu(*args, block_size=BS, config=cfg, interpret=True,
                                            tickets=jnp.zeros((B, HKV, 1), jnp.int32))
    np.testing.assert_allclose(o1, o, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(h1, h, rtol=1e-6, atol=1e-7)
    assert float(jnp.abs(h1 - heat).sum()) > 0 and not np.asarray(t1).any()
    # The output in the GEMMs' padded rows (`LayerContext.rows_out`): token row b, then zero rows.
    padded = jax.ShapeDtypeStruct((1, 8, HQ, D), q.dtype)
    o2, h2, _ = gpu.sparse_decode_heat_gpu(*args, block_size=BS, config=cfg, interpret=True, rows_out=8,
                                           tickets=jnp.zeros((B, HKV, 1), jnp.int32))
    assert o2.shape == padded.shape
    np.testing.assert_allclose(o2[0, :B], o[:, 0], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(o2[0, B:], 0)
    np.testing.assert_allclose(h2, h, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="rows_out=1: expected at least the batch of 2 token rows"):
        gpu.sparse_decode_heat_gpu(*args, block_size=BS, config=cfg, interpret=True, rows_out=1,
                                   tickets=jnp.zeros((B, HKV, 1), jnp.int32))
    monkeypatch.setattr(gpu, "FINISH_MAX_ENTRIES", 16)
    with pytest.raises(ValueError, match="31 index entries a row: the one-launch finish takes at most 16"):
        gpu.sparse_decode_heat_gpu(*args, block_size=BS, config=cfg, interpret=True,
                                   tickets=jnp.zeros((B, HKV, 1), jnp.int32))
    with pytest.raises(ValueError, match=r"tickets int32\[2, 2\]: expected int32\[2, 2, 1\] zeros"):
        gpu.sparse_decode_heat_gpu(*args, block_size=BS, config=cfg, interpret=True,
                                   tickets=jnp.zeros((B, HKV), jnp.int32))


def test_decode_heat_reads_every_layers_rows_at_the_layer():
    """indices [L, B, Hkv, 1, K] (H2O's kept keys of every layer): the Triton pair (interpret mode) reads layer
    `layer`'s rows in place, in both launches, and equals the call on that layer's rows, the heat row named apart
    (`heat_layer`); so do the dispatcher's XLA and reference paths. Splits of several entries each (the finish
    kernel's one program per split) and one split of every entry give the same heat."""
    from pallas_kernels.block_scores import sparse_decode_heat
    q, k, v = _cache(8)
    rows = jnp.stack([_indices(1, K=11, used=u) for u in (9, 4, 10)])  # [L, B, Hkv, 1, K], a different row per layer
    rows = rows.at[2].set(jnp.flip(rows[2], 1))  # layer 2's rows differ from layer 1's by head too
    lengths = jnp.array([231, 0], jnp.int32)
    heat = jax.random.uniform(jax.random.key(4), (L, B, HKV, N // BS))
    for layer, heat_layer, splits in ((1, 0, 3), (-1, 2, 1), (2, -3, 4)):
        one = rows[layer]
        want_o, want_h = reference.sparse_decode_heat_reference(q, k, v, jnp.int32(layer), one, lengths, heat,
                                                               jnp.int32(heat_layer), block_size=BS)
        cfg = gpu.sgpu.DecodeConfig(block_k=16, num_splits=splits)
        for idx in (one, rows):
            o, h = gpu.sparse_decode_heat_gpu(q, k, v, jnp.int32(layer), idx, lengths, heat, jnp.int32(heat_layer),
                                              block_size=BS, config=cfg, interpret=True)
            np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=1e-6)
            tickets = jnp.zeros((B, HKV, 1), jnp.int32)  # the one-launch finish, twice on the same counters
            for _ in range(2):
                o, h, tickets = gpu.sparse_decode_heat_gpu(q, k, v, jnp.int32(layer), idx, lengths, heat,
                                                           jnp.int32(heat_layer), block_size=BS, config=cfg,
                                                           tickets=tickets, interpret=True)
                np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=1e-5)
                np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=1e-6)
                assert not np.asarray(tickets).any()
        for impl in ("xla", "reference"):
            o, h = sparse_decode_heat(q, k, v, jnp.int32(layer), rows, lengths, heat, jnp.int32(heat_layer),
                                      block_size=BS, implementation=impl)
            np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=1e-6)
        changed = np.flatnonzero(np.any(np.asarray(want_h) != np.asarray(heat), axis=(1, 2, 3)))
        assert list(changed) == [heat_layer % L]
    with pytest.raises(ValueError, match=r"expected every layer's index rows \[L=3"):
        sparse_decode_heat(q, k, v, jnp.int32(0), rows[:2], lengths, heat, block_size=BS, implementation="xla")


def test_kernels_lower_for_cuda():
    sds = jax.ShapeDtypeStruct
    check = jax.export.DisabledSafetyCheck.custom_call(plgpu.CUSTOM_CALL_TARGET_NAME)
    Bn, Hq, Hkv, Dn, Nn = 2, 32, 8, 128, 4096
    q, cache = sds((Bn, 1, Hq, Dn), jnp.bfloat16), sds((4, Bn, Hkv, Nn, Dn), jnp.bfloat16)
    i32 = lambda *s: sds(s, jnp.int32)  # noqa: E731
    with abstract_device(*H100):
        f = functools.partial(gpu.block_max_scores_gpu, block_size=16)
        text = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[check])(
            q, cache, i32(), i32(2), sds((2, 4), jnp.bool_), i32(Bn, 1), i32(Bn, 1), i32(Bn, 1)).mlir_module()
        assert "evosparse_block_max" in text
        f = functools.partial(gpu.sparse_decode_mass_gpu, block_size=16)
        text = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[check])(
            q, cache, cache, i32(), i32(Bn, Hkv, 1, 128), i32(Bn)).mlir_module()
        assert "sparse_decode_gathered_stacked_mass" in text
        text = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[check])(  # every layer's rows
            q, cache, cache, i32(), i32(4, Bn, Hkv, 1, 128), i32(Bn)).mlir_module()
        assert "sparse_decode_gathered_stacked_mass" in text and "dynamic_slice" not in text
        f = functools.partial(gpu.sparse_decode_heat_gpu, block_size=16)
        text = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[check])(
            q, cache, cache, i32(), i32(Bn, Hkv, 1, 128), i32(Bn), sds((4, Bn, Hkv, Nn // 16), jnp.float32)
        ).mlir_module()
        assert "evosparse_finish_heat" in text
        text = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[check])(  # every layer's rows
            q, cache, cache, i32(), i32(4, Bn, Hkv, 1, 128), i32(Bn), sds((4, Bn, Hkv, Nn // 16), jnp.float32)
        ).mlir_module()
        assert "evosparse_finish_heat" in text and "dynamic_slice" not in text
        # EvoSparse's rank kernel at the benchmark's shape (100K / 16 blocks, budget 2048: 40 retrieval and 80
        # candidate blocks, width 128), stacked with a layer index.
        f = functools.partial(gpu.select_from_candidates_gpu, num_kv_heads=Hkv, width=128, heat_width=80)
        text = jax.export.export(jax.jit(lambda h, c, r, *a: f(h, c, r, *a, layer=jnp.int32(3))), platforms=["cuda"],
                                 disabled_checks=[check])(
            sds((32, Bn, Hkv, 6256), jnp.float32), i32(32, Bn, Hkv, 80), i32(Bn, 40), i32(Bn), i32(Bn), i32(Bn),
            i32(Bn), sds((Bn,), jnp.bool_)).mlir_module()
        assert "evosparse_select_candidates" in text


def test_errors():
    q, k, v = _cache(5)
    pos = jnp.zeros((B, 1), jnp.int32)
    with pytest.raises(ValueError, match=r"head_mask has shape \(2, 3\)"):
        block_max_scores(q, k, jnp.int32(0), jnp.zeros((2,), jnp.int32), jnp.zeros((2, 3), bool), pos, pos, pos,
                         block_size=BS)
    with pytest.raises(ValueError, match="block_size=7"):
        block_max_scores(q, k, jnp.int32(0), jnp.zeros((1,), jnp.int32), jnp.zeros((1, G), bool), pos, pos, pos,
                         block_size=7)
    with pytest.raises(ValueError, match="implementation='cuda'"):
        sparse_decode_mass(q, k, v, jnp.int32(0), _indices(1), jnp.array([3, 4]), block_size=BS,
                           implementation="cuda")
    with pytest.raises(ValueError, match="block_size=12"):
        gpu.block_max_scores_gpu(q, jnp.zeros((L, B, HKV, 240, D)), jnp.int32(0), jnp.zeros((1,), jnp.int32),
                                 jnp.zeros((1, G), bool), pos, pos, pos, block_size=12, interpret=True)


def test_decode_heat_with_a_gqa_group_of_three():
    """G = 3 (not a power of two: the partials' padded rows and the finish kernel's masked rows)."""
    ks = jax.random.split(jax.random.key(11), 4)
    q = jax.random.normal(ks[0], (B, 1, 6, D))
    k = jax.random.normal(ks[1], (L, B, HKV, N, D))
    v = jax.random.normal(ks[2], (L, B, HKV, N, D))
    idx = _indices(1, K=9, used=6)
    lengths = jnp.array([150, 231], jnp.int32)
    heat = jax.random.uniform(ks[3], (L, B, HKV, N // BS))
    args = (q, k, v, jnp.int32(-1), idx, lengths, heat)
    want_o, want_h = reference.sparse_decode_heat_reference(*args, block_size=BS)
    o, h = gpu.sparse_decode_heat_gpu(*args, block_size=BS, interpret=True,
                                      config=gpu.sgpu.DecodeConfig(block_k=16, num_splits=3))
    np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(want_h - heat).max()) > 0  # the mass really moved the heat


def test_kernels_stay_in_their_blocks():
    """Every load and store of the block-max and heat kernels stays inside its block
    (`pallas_bounds.checked_memory`: the interpreter pads stray loads and drops stray stores, where a GPU reads or
    overwrites another program's rows): G = 3 (query rows padded to 16) and 25 blocks (N = 200), so the second
    program of 16 blocks is partial; a head mask with a row of no head, positions mid-block; the decode with heat
    with 9 entries in 2 splits (the split partials' padded rows and entries, the finish kernel's masked rows and
    lanes), a row of length 0."""
    n, nb = 200, 200 // BS
    ks = jax.random.split(jax.random.key(23), 4)
    q = jax.random.normal(ks[0], (B, 1, 6, D))
    k = jax.random.normal(ks[1], (L, B, HKV, n, D))
    v = jax.random.normal(ks[2], (L, B, HKV, n, D))
    pos = jnp.array([[197], [37]], jnp.int32)
    args = (q, k, jnp.int32(1), jnp.array([1, 0], jnp.int32), jnp.array([[True, False, True], [False] * 3]), pos,
            jnp.array([[1], [0]], jnp.int32), pos // BS + jnp.array([[1], [0]], jnp.int32))
    rng = np.random.default_rng(23)
    idx = np.full((B, HKV, 1, 9), -1, np.int32)
    for b, h in np.ndindex(B, HKV):
        idx[b, h, 0, :6] = np.sort(rng.choice(nb, 6, replace=False))
    heat_args = (q, k, v, jnp.int32(-1), jnp.asarray(idx), jnp.array([197, 0], jnp.int32),
                 jax.random.uniform(ks[3], (L, B, HKV, nb)))
    with checked_memory():
        got = gpu.block_max_scores_gpu.__wrapped__(*args, block_size=BS, interpret=True,  # unjitted: traced here
                                                   config=gpu.BlockMaxConfig(blocks_per_program=16))
        np.testing.assert_allclose(got, reference.block_max_scores_reference(*args, block_size=BS), rtol=1e-5,
                                   atol=1e-5)
        o, h = gpu.sparse_decode_heat_gpu(*heat_args, block_size=BS, interpret=True,
                                          config=gpu.sgpu.DecodeConfig(block_k=16, num_splits=2))
        want_o, want_h = reference.sparse_decode_heat_reference(*heat_args, block_size=BS)
        np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=1e-6)


def test_decode_mass_xla_drops_entries_past_the_cache():
    """An entry past the cache (index >= N / bs) with a length past N: the gathered decode drops it, and so does the
    mass the XLA path recomputes from its lse (the reference's rule), instead of scoring the clipped last block."""
    q, k, v = _cache(3, 1)
    idx = np.asarray(_indices(1)).copy()
    idx[:, :, :, 5] = N // BS + 1  # one more entry, past the cache
    idx = jnp.asarray(idx)
    lengths = jnp.array([N + 40, 77], jnp.int32)
    want_o, want_m = reference.sparse_decode_mass_reference(q, k, v, jnp.int32(2), idx, lengths, block_size=BS)
    o, m = xla.sparse_decode_mass_xla(q, k, v, jnp.int32(2), idx, lengths, block_size=BS)
    np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(m, want_m, rtol=1e-4, atol=1e-6)
    assert np.all(np.asarray(m)[..., 5] == 0.0)


def test_block_max_clamps_kv_heads_like_the_reference():
    """kv_heads values outside [0, Hkv) are clamped (the reference's contract) in the XLA path and the kernel too:
    -1 reads KV head 0 and its query group, Hkv + 3 KV head Hkv - 1 (neither wraps to the last head nor reads
    queries past Hq or NaN)."""
    q, k, _ = _cache(21, 1)
    hm = jnp.array([[True, False, True, False], [False, True, False, True]])
    pos, lo = jnp.array([[200], [37]], jnp.int32), jnp.zeros((B, 1), jnp.int32)
    hi = jnp.full((B, 1), N // BS, jnp.int32)
    want = reference.block_max_scores_reference(q, k, jnp.int32(1), jnp.array([0, HKV - 1], jnp.int32), hm, pos, lo,
                                                hi, block_size=BS)
    for bad in ([-1, HKV + 3], [-5, HKV]):
        bad = jnp.array(bad, jnp.int32)
        for got in (xla.block_max_scores_xla(q, k, jnp.int32(1), bad, hm, pos, lo, hi, block_size=BS),
                    reference.block_max_scores_reference(q, k, jnp.int32(1), bad, hm, pos, lo, hi, block_size=BS),
                    gpu.block_max_scores_gpu(q, k, jnp.int32(1), bad, hm, pos, lo, hi, block_size=BS, interpret=True,
                                             config=gpu.BlockMaxConfig(blocks_per_program=16))):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_heat_add_drops_padding_entries():
    """`heat_add`: each valid entry's value added into its block of row `layer`; the -1 padding adds nothing
    anywhere (its values are dropped, block 0 included), the other layers untouched."""
    heat = jnp.asarray(np.random.default_rng(22).uniform(size=(2, 1, 2, 6)), jnp.float32)
    idx = jnp.array([[[1, 4, -1, -1], [0, 5, -1, -1]]], jnp.int32)
    vals = jnp.array([[[0.5, 0.25, 7.0, 9.0], [1.0, 2.0, 3.0, 4.0]]], jnp.float32)
    got = np.asarray(xla.heat_add(heat, jnp.int32(1), idx, vals))
    want = np.asarray(heat).copy()
    want[1, 0, 0, [1, 4]] += [0.5, 0.25]
    want[1, 0, 1, [0, 5]] += [1.0, 2.0]
    np.testing.assert_allclose(got, want, rtol=1e-6)


# Where the cases above leave a gap (a mutation audit): the block-max kernel at program edges, GQA
# groups of one and three on the mass path, the heat kernel's full rows and -1 padding beside the last block, and the
# dispatcher's Triton paths passing every argument.


def test_block_max_kernel_ranges_at_program_edges():
    """cb = 16 blocks a program over nb = 25 blocks (the last program holds 9): a middle range that is only the
    last block of program 0 and the first of program 1 (lo = 15, hi = 17), only program 1's first block
    (lo = 16, hi = 17), the whole row read to a mid-block position, and only the row's last block. Every block in
    [lo, hi) and visible is scored, the others are -inf, and the last program writes none of the blocks before
    it."""
    n = 200  # 25 blocks of 8
    q, k, _ = _cache(31, 2)
    k = k[:, :, :, :n]
    kvh = jnp.array([1, 0], jnp.int32)
    hm = jnp.array([[True, False, True, True], [False, True, False, False]])
    pos = jnp.array([[199, 199], [150, 199]], jnp.int32)
    lo = jnp.array([[15, 16], [0, 24]], jnp.int32)
    hi = jnp.array([[17, 17], [25, 25]], jnp.int32)
    args = (q, k, jnp.int32(2), kvh, hm, pos, lo, hi)
    want = reference.block_max_scores_reference(*args, block_size=BS)
    got = gpu.block_max_scores_gpu(*args, block_size=BS, interpret=True,
                                   config=gpu.BlockMaxConfig(blocks_per_program=16))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    finite = np.isfinite(np.asarray(want))
    np.testing.assert_array_equal(finite.sum(-1), [[2, 1], [150 // BS + 1, 1]])  # the ranges above, visible part


def test_decode_mass_kernel_with_groups_of_one_and_three():
    """The mass path (`sparse_decode_mass_gpu`: the stacked decode's entry sums and the epilogue's mean over the
    group) for G = 1 (one query head per KV head) and G = 3 (not a power of two: padded partial rows): equal to
    the reference, and each query's masses sum to 1 over its entries."""
    _, k, v = _cache(12)
    idx = _indices(1, K=9, used=6)
    lengths = jnp.array([150, 231], jnp.int32)
    for g in (1, 3):
        q = jax.random.normal(jax.random.key(g), (B, 1, HKV * g, D))
        want_o, want_m = reference.sparse_decode_mass_reference(q, k, v, jnp.int32(1), idx, lengths, block_size=BS)
        o, m = gpu.sparse_decode_mass_gpu(q, k, v, jnp.int32(1), idx, lengths, block_size=BS, interpret=True,
                                          config=gpu.sgpu.DecodeConfig(block_k=16, num_splits=2))
        np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(m, want_m, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(np.asarray(want_m).sum(-1), 1.0, rtol=1e-5)


def test_decode_heat_kernel_full_rows_and_padding_next_to_the_last_block():
    """Splits whose written count runs past their entries (block_k = 32: 4 entries an iteration; K = 9 in splits of
    4, 4, 1): rows of K valid entries (the last split's lanes past K must not add into entry K - 1's block again)
    and a row [0, 31, -1, ...] (its -1 lanes inside the written count add nothing, not into block 0 or the last
    block nb - 1 = 31). The heat equals the reference's, and each visible entry's block gained its mass."""
    q, k, v = _cache(17)
    pad = [-1] * 7
    idx = jnp.array([[[1, 5, 7, 11, 13, 25, 26, 28, 31], [0, 31] + pad],
                     [[2, 4, 6, 8, 10, 12, 14, 16, 18], [0, 3, 30, 31] + pad[:5]]], jnp.int32)[:, :, None]
    lengths = jnp.array([256, 150], jnp.int32)  # row 1 sees blocks 0 .. 18
    heat = jax.random.uniform(jax.random.key(5), (L, B, HKV, N // BS))
    args = (q, k, v, jnp.int32(1), idx, lengths, heat)
    want_o, want_h = reference.sparse_decode_heat_reference(*args, block_size=BS)
    for splits in (3, 1):
        o, h = gpu.sparse_decode_heat_gpu(*args, block_size=BS, interpret=True,
                                          config=gpu.sgpu.DecodeConfig(block_k=32, num_splits=splits))
        np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=1e-6)
    gained = np.asarray(want_h[1] - heat[1]) > 0  # [B, Hkv, nb]
    for b, h_, blocks in ((0, 0, idx[0, 0, 0]), (0, 1, [0, 31]), (1, 0, idx[1, 0, 0]), (1, 1, [0, 3])):
        np.testing.assert_array_equal(np.flatnonzero(gained[b, h_]), np.asarray(blocks))


def test_dispatcher_triton_paths_pass_every_argument(monkeypatch):
    """implementation="pallas_gpu" through `api` (each kernel run interpreted): block_max_scores and
    sparse_decode_mass with a scale, and sparse_decode_heat with a heat row named apart from the cache layer,
    equal the reference; the other heat rows do not move."""
    for name in ("block_max_scores_gpu", "sparse_decode_mass_gpu", "sparse_decode_heat_gpu"):
        real = getattr(gpu, name)
        monkeypatch.setattr(gpu, name, lambda *a, _f=real, **kw: _f(*a, interpret=True, **kw))
    q, k, v = _cache(14)
    scale = 0.3
    hm = jnp.array([[True, False, True, True]])
    pos = jnp.array([[200], [77]], jnp.int32)
    lo, hi = jnp.ones((B, 1), jnp.int32), jnp.full((B, 1), N // BS - 1, jnp.int32)
    bm = (q, k, jnp.int32(1), jnp.array([1], jnp.int32), hm, pos, lo, hi)
    np.testing.assert_allclose(block_max_scores(*bm, block_size=BS, scale=scale, implementation="pallas_gpu"),
                               reference.block_max_scores_reference(*bm, block_size=BS, scale=scale),
                               rtol=1e-5, atol=1e-5)
    idx, lengths = _indices(1), jnp.array([200, 77], jnp.int32)
    got = sparse_decode_mass(q, k, v, jnp.int32(2), idx, lengths, block_size=BS, scale=scale,
                             implementation="pallas_gpu")
    want = reference.sparse_decode_mass_reference(q, k, v, jnp.int32(2), idx, lengths, block_size=BS, scale=scale)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
    heat = jax.random.uniform(jax.random.key(3), (L, B, HKV, N // BS))
    args = (q, k, v, jnp.int32(2), idx, lengths, heat, jnp.int32(0))
    got_o, got_h = sparse_decode_heat(*args, block_size=BS, scale=scale, implementation="pallas_gpu")
    want_o, want_h = reference.sparse_decode_heat_reference(*args, block_size=BS, scale=scale)
    np.testing.assert_allclose(got_o, want_o, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got_h, want_h, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(want_h)[1:], np.asarray(heat)[1:])  # only row 0 moved
    assert float(jnp.abs(want_h[0] - heat[0]).max()) > 0


@pytest.mark.parametrize("splits,block_k,first", [(3, 16, 0), (1, 32, 1), (4, 16, 2)])
def test_decode_pending_then_every_layers_mass_at_once(splits, block_k, first):
    """H2O's one launch a layer (`sparse_decode_pending_gpu`, interpret mode): blocks of one token, every layer's rows
    [L, B, Hkv, 1, K] read in place, each layer's partials kept in its slot of buffers holding NaN where nothing was
    written; the last program of each row merges the output (the counters handed back as zeros), and after the
    layers first .. L - 1 ran, one launch (`add_pending_mass_gpu`) adds their entry mass into their heat rows. The
    outputs and the heat equal the reference's layer-by-layer heat step; rows below `first` and a row with no
    visible key keep their heat; with rows_out the output lies in the GEMMs' padded rows."""
    q, k, v = _cache(14)
    K = 37  # keys a row: several splits of whole iterations, the last one short
    rows = np.full((L, B, HKV, 1, K), -1, np.int32)
    rng = np.random.default_rng(15)
    for layer in range(L):
        for h in range(HKV):
            used = K - 2 * layer - h  # a different count and set a layer and head, then -1
            rows[layer, :, h, 0, :used] = np.sort(rng.choice(N, used, replace=False))
    idx = jnp.asarray(rows)
    lengths = jnp.array([N, 0], jnp.int32)  # row 1 sees nothing
    heat = jax.random.uniform(jax.random.key(16), (L, B, HKV, N))
    cfg = gpu.sgpu.DecodeConfig(block_k=block_k, num_splits=splits)
    pending = tuple(jnp.full(s.shape, jnp.nan if s.dtype == jnp.float32 else 10 ** 6, s.dtype)
                    for s in pending_shapes(q.shape, K, L, HKV, config=cfg))
    assert pending[3].shape[1] == min(splits, -(-K // block_k))  # splits of whole iterations
    want_h, tickets = heat, jnp.zeros((B, HKV, 1), jnp.int32)
    for layer in range(first, L):
        want_o, want_h = reference.sparse_decode_heat_reference(q, k, v, jnp.int32(layer), idx[layer], lengths,
                                                               want_h, block_size=1)
        o, pending, tickets = gpu.sparse_decode_pending_gpu(q, k, v, jnp.int32(layer), idx, lengths, pending,
                                                            tickets, config=cfg, rows_out=None if layer % 2 else 4,
                                                            interpret=True)
        got = o[:, 0] if layer % 2 else o[0, :B]
        np.testing.assert_allclose(got, want_o[:, 0], rtol=1e-4, atol=1e-5)
        if not layer % 2:
            np.testing.assert_array_equal(o[0, B:], 0)
        assert not np.asarray(tickets).any()
    h = gpu.add_pending_mass_gpu(idx, pending, heat, group=G, first=first, interpret=True)
    np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(h[:first], heat[:first])
    np.testing.assert_array_equal(h[:, 1], heat[:, 1])
    assert float(jnp.abs(h - heat).sum()) > 0
    with pytest.raises(ValueError, match=r"expected every layer's rows \[L, B, Hkv, 1, K\]"):
        gpu.sparse_decode_pending_gpu(q, k, v, jnp.int32(0), idx[0], lengths, pending, tickets, config=cfg,
                                      interpret=True)
    with pytest.raises(ValueError, match=r"partials .* expected a finish, one token and"):
        gpu.sparse_decode_pending_gpu(q, k, v, jnp.int32(0), idx[..., :5], lengths, pending, tickets,
                                      config=cfg, interpret=True)
    with pytest.raises(ValueError, match="first=3: expected"):
        gpu.add_pending_mass_gpu(idx, pending, heat, group=G, first=L, interpret=True)
    with pytest.raises(ValueError, match=r"group=17: expected the query heads a KV head, 1 \.\. 16"):
        gpu.add_pending_mass_gpu(idx, pending, heat, group=17, first=0, interpret=True)

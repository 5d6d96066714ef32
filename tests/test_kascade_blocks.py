"""Kascade's block-selection prefill (`prefill_block_size`): the anchors' block choice equals a numpy reference
(tile-pooled mass summed per block, top ceil(k / bs) blocks), reuse layers attend the mapped anchor's blocks, a
full budget is dense, block size 1 is the token mode, the GPU path (interpreted) agrees, `sparse_prefill` picks
the Mosaic GPU kernel for block selections on Hopper, and bad block sizes / budgets / tsa+kascade raise."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jsparse.methods.base import make_method
from jsparse.methods.kascade import Kascade, KascadeState, ROLE_REUSE
from models.attention import LayerContext
from models.config import ModelConfig
from pallas_kernels.anchor_attention import anchor_prefill, anchor_prefill_reference
from pallas_kernels.sparse_attention.reference import sparse_prefill_reference

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

B, HQ, HKV, D, L = 2, 6, 2, 16, 4
CFG = ModelConfig(architecture="llama", vocab_size=48, hidden_size=48, intermediate_size=64, num_layers=L,
                  num_heads=HQ, num_kv_heads=HKV, head_dim=D, max_position_embeddings=512)
HEAD_MAP = np.array([[0, 1], [1, 0], [0, 1], [1, 1]], np.int32)


def _inputs(seed, T, Hq=HQ, Hkv=HKV):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, Hq, D), np.float32))
    k, v = (jnp.asarray(rng.standard_normal((B, T, Hkv, D), np.float32)) for _ in range(2))
    return q, k, v


def _numpy_block_selection(q, k, tile, bs, budget, min_tokens, lengths=None):
    """The specification in numpy: causal softmax per query head, summed over the GQA group and the tile's rows
    (those below the row's length),
    summed per key block; tile i keeps the ceil(k_i / bs) best blocks wholly before its start (ties to the lower
    block), k_i = min(max(ceil(budget * i * tile), min_tokens), i * tile). Returns a list [b][h][i] of sets."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    Bn, T, Hq, _ = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    logits = np.einsum("bthd,bnhd->bhtn", q, np.repeat(k, G, axis=2)) / math.sqrt(D)
    logits = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)  # [B, Hq, T, T]
    pooled = p.reshape(Bn, Hkv, G, T, T).sum(2)  # [B, Hkv, T, T]
    if lengths is not None:  # a row's padding queries add nothing
        pooled = np.where((np.arange(T)[None, :] < np.asarray(lengths)[:, None])[:, None, :, None], pooled, 0.0)
    out = []
    for b in range(Bn):
        rows = []
        for h in range(Hkv):
            tiles = []
            for i in range(-(-T // tile)):
                start = i * tile
                mass = pooled[b, h, start:start + tile].sum(0)  # [T] the tile's mass on each key
                nb = start // bs  # blocks wholly before the tile
                block_mass = np.array([mass[j * bs:(j + 1) * bs].sum() for j in range(nb)])
                kk = min(max(math.ceil(budget * start), min_tokens), start)
                order = sorted(range(nb), key=lambda j: (-block_mass[j], j))
                tiles.append(set(order[:-(-kk // bs)]))
            rows.append(tiles)
        out.append(rows)
    return out


@pytest.mark.parametrize("bs,T", [(4, 70), (8, 64), (16, 80)])
def test_block_selection_equals_numpy_reference(bs, T):
    tile, budget, mt = 16, 0.3, 8
    q, k, v = _inputs(bs, T)
    lengths = jnp.array([T, T - 13], jnp.int32)
    want = _numpy_block_selection(q, k, tile, bs, budget, mt, lengths)
    for name, fn in (("xla", anchor_prefill), ("reference", anchor_prefill_reference)):
        out, idx = fn(q, k, v, lengths, tile=tile, budget=budget, min_tokens=mt, block_size=bs)
        idx = np.asarray(idx)
        assert idx.shape == (B, HKV, -(-T // tile), -(-min(max(math.ceil(budget * T), mt), T) // bs)), name
        for b in range(B):
            for h in range(HKV):
                for i, chosen in enumerate(want[b][h]):
                    row = idx[b, h, i]
                    got = row[row >= 0]
                    assert (np.diff(got) > 0).all(), (name, b, h, i, row)  # ascending, unique
                    assert set(got.tolist()) == chosen, (name, b, h, i, row, chosen)
        ref_out = sparse_prefill_reference(q, k, v, jnp.asarray(idx), lengths, tile=tile, block_size=bs)
        np.testing.assert_allclose(np.asarray(out[0]), np.asarray(ref_out[0]), rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(np.asarray(out[1, :T - 13]), np.asarray(ref_out[1, :T - 13]), rtol=2e-5,
                                   atol=2e-5)


def test_gpu_block_path_interpreted_equals_reference():
    from pallas_kernels.anchor_attention.gpu_prefill import anchor_prefill_gpu

    T, tile, bs = 64, 16, 8
    q, k, v = _inputs(3, T, Hq=4)
    lengths = jnp.array([T, 41], jnp.int32)
    kw = dict(tile=tile, budget=0.25, min_tokens=8, block_size=bs)
    out, idx = anchor_prefill_gpu(q, k, v, lengths, **kw, interpret=True)
    want, want_idx = anchor_prefill_reference(q, k, v, lengths, **kw)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
    np.testing.assert_allclose(np.asarray(out[0]), np.asarray(want[0]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(out[1, :41]), np.asarray(want[1, :41]), rtol=1e-4, atol=1e-4)


def _prefill_logits(method, params, toks, lengths, N):
    from models import llama
    from models.cache import init_cache

    return jax.jit(lambda p, t, l: llama.prefill(p, CFG, method, t, l, init_cache(CFG, B, N, jnp.float32),
                                                 method.init_state(CFG, B, N), all_logits=True)[0])(
        params, toks, lengths)


def _model_inputs(T):
    from models.params import random_params

    params = random_params(CFG, jax.random.key(0), jnp.float32, scale=0.3)
    toks = jax.random.randint(jax.random.key(1), (B, T), 0, CFG.vocab_size)
    return params, toks, jnp.array([T, T - 11], jnp.int32)


def _close_rows(got, want, n1, tol=1e-4):
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(got[1, :n1]), np.asarray(want[1, :n1]), rtol=tol, atol=tol)


@pytest.mark.parametrize("bs", [8, 16])
def test_full_budget_block_mode_is_dense(bs):
    T = 64
    params, toks, lengths = _model_inputs(T)
    kascade = Kascade.from_anchors(CFG, [0, 2], HEAD_MAP, budget=1.0, min_tokens=0, tile=16,
                                   prefill_block_size=bs)
    got = _prefill_logits(kascade, params, toks, lengths, T)
    want = _prefill_logits(make_method("dense"), params, toks, lengths, T)
    _close_rows(got, want, T - 11)


def test_block_size_one_is_token_mode():
    """prefill_block_size=1 runs today's token selection: the same logits as the default, and a block mode at
    bs > 1 differs (the test can fail)."""
    T = 64
    params, toks, lengths = _model_inputs(T)
    kw = dict(budget=0.2, min_tokens=8, tile=16, reuse_scale=2.0)
    token = Kascade.from_anchors(CFG, [0, 2], HEAD_MAP, **kw)
    one = Kascade.from_anchors(CFG, [0, 2], HEAD_MAP, prefill_block_size=1, **kw)
    blocks = Kascade.from_anchors(CFG, [0, 2], HEAD_MAP, prefill_block_size=8, **kw)
    assert token.prefill_block_size == 1
    want = _prefill_logits(token, params, toks, lengths, T)
    _close_rows(_prefill_logits(one, params, toks, lengths, T), want, T - 11, tol=0)
    assert not np.allclose(np.asarray(_prefill_logits(blocks, params, toks, lengths, T)), np.asarray(want),
                           atol=1e-4)


@pytest.mark.parametrize("reuse_scale", [1.0, 2.0])
def test_reuse_layers_read_the_mapped_anchor_blocks(reuse_scale):
    T, tile, bs = 70, 16, 8
    q, k, v = _inputs(7, T)
    lengths = jnp.array([T, 53], jnp.int32)
    m = Kascade.from_anchors(CFG, [0, 2], HEAD_MAP, budget=0.25, min_tokens=8, tile=tile, prefill_block_size=bs,
                             reuse_scale=reuse_scale)
    info = m.layer_info(CFG)
    state = m.start(CFG, m.init_state(CFG, B, T), "prefill", B, T, T)
    assert state.indices.shape == (B, HKV, -(-T // tile), -(-m.k_reuse(T) // bs))
    step = jax.jit(lambda layer, info, s: m.prefill(LayerContext(layer=layer, lengths=lengths, info=info),
                                                    q, k, v, s))
    anchor_idx = None
    for layer in range(L):
        layer_info = jax.tree_util.tree_map(lambda x: x[layer], info)
        out, new = step(jnp.int32(layer), layer_info, state)
        if int(info.role[layer]) == ROLE_REUSE:
            np.testing.assert_array_equal(np.asarray(new.indices), np.asarray(anchor_idx))  # the anchor's, kept
            mapped = jnp.take(anchor_idx, info.head_map[layer], axis=1)
            want = sparse_prefill_reference(q, k, v, mapped, lengths, tile=tile, block_size=bs)
            _close_rows(out, want, 53, tol=2e-5)
        else:  # an anchor hands its top blocks at r * budget to the reuse layers
            _, wide = anchor_prefill_reference(q, k, v, lengths, tile=tile, budget=m.reuse_budget, min_tokens=8,
                                               K=m.k_reuse(T), block_size=bs)
            np.testing.assert_array_equal(np.asarray(new.indices), np.asarray(wide))
            anchor_idx = new.indices
        state = KascadeState(indices=new.indices)


def test_decode_after_block_prefill_stays_token_level():
    from models import llama
    from models.cache import init_cache

    T, N = 48, 64
    params, toks, lengths = _model_inputs(T)
    m = Kascade.from_anchors(CFG, [0, 2], HEAD_MAP, budget=0.2, min_tokens=8, tile=16, prefill_block_size=8)
    state = m.start(CFG, m.init_state(CFG, B, N), "decode", B, 1, N)
    assert state.indices.shape == (B, HKV, 1, m.k_reuse(N))  # tokens, not blocks
    _, cache, _ = jax.jit(lambda p, t, l: llama.prefill(p, CFG, m, t, l, init_cache(CFG, B, N, jnp.float32),
                                                        None))(params, toks, lengths)
    tok = jnp.zeros((B, 1), jnp.int32)
    got = jax.jit(lambda p, t, c: llama.decode(p, CFG, m, t, c, None)[0])(params, tok, cache)
    token = Kascade.from_anchors(CFG, [0, 2], HEAD_MAP, budget=0.2, min_tokens=8, tile=16)
    want = jax.jit(lambda p, t, c: llama.decode(p, CFG, token, t, c, None)[0])(params, tok, cache)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_bad_block_sizes_and_budgets_raise():
    with pytest.raises(ValueError, match=r"prefill_block_size=3: expected a power of two"):
        Kascade.from_anchors(CFG, [0, 2], tile=16, prefill_block_size=3)
    with pytest.raises(ValueError, match=r"prefill_block_size=0: expected a power of two"):
        Kascade.from_anchors(CFG, [0, 2], tile=16, prefill_block_size=0)
    with pytest.raises(ValueError, match=r"prefill_block_size=32 does not divide tile=16"):
        Kascade.from_anchors(CFG, [0, 2], tile=16, prefill_block_size=32)
    for budget in (0.0, 1.5):
        with pytest.raises(ValueError, match=f"budget={budget}"):
            Kascade.from_anchors(CFG, [0, 2], tile=16, prefill_block_size=8, budget=budget)
    q, k, v = _inputs(0, 32)
    lengths = jnp.array([32, 32], jnp.int32)
    with pytest.raises(ValueError, match=r"block_size=6: expected a power of two"):
        anchor_prefill(q, k, v, lengths, tile=16, budget=0.5, block_size=6)
    with pytest.raises(ValueError, match=r"block_size=32 does not divide tile=16"):
        anchor_prefill_reference(q, k, v, lengths, tile=16, budget=0.5, block_size=32)


def test_tsa_kascade_rejects_block_mode(tmp_path):
    with pytest.raises(ValueError, match=r"tsa\+kascade does not take prefill_block_size=16"):
        make_method("tsa+kascade", cfg=CFG, artifact=str(tmp_path), prefill_block_size=16)


def test_sparse_prefill_picks_mosaic_for_blocks_on_hopper(monkeypatch):
    from pallas_kernels.sparse_attention import api, mgpu_prefill

    q = jax.ShapeDtypeStruct((1, 256, 32, 128), jnp.bfloat16)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(mgpu_prefill, "hopper", lambda: True)
    assert api._pick(None, q, 16, 128, group=4) == "mosaic_gpu"
    assert api._pick(None, q, 64, 32, group=4) == "mosaic_gpu"
    assert api._pick(None, q, 1, 128, group=4) == "pallas_gpu"  # token selections: Triton
    assert api._pick(None, q, 16, None) == "pallas_gpu"  # decode: Triton
    assert api._pick(None, q, 16, 32, group=1) == "pallas_gpu"  # G * tile = 32 rows: not the Mosaic layout
    assert api._pick(None, jax.ShapeDtypeStruct((1, 256, 32, 128), jnp.float32), 16, 128, group=4) == "pallas_gpu"
    monkeypatch.setattr(mgpu_prefill, "hopper", lambda: False)
    assert api._pick(None, q, 16, 128, group=4) == "pallas_gpu"  # not Hopper


def test_bench_attention_rejects_a_bad_block_size():
    from eval.bench import attention

    for bs, match in ((3, "--block-size=3: expected a power of two"), (256, "--block-size=256 does not divide")):
        with pytest.raises(ValueError, match=match):
            attention.main(["--phase", "prefill", "--interpret", "--context", "64", "--tile", "128",
                            "--block-size", str(bs)])


@pytest.mark.timeout(600)
def test_anchor_block_selection_runs_on_the_mosaic_kernel_interpreted():
    """The anchor's block indices (what Kascade's reuse layers hand `sparse_prefill` on Hopper) in the Mosaic GPU
    kernel (its interpreter) equal the reference attention over them."""
    from pallas_kernels.sparse_attention import mgpu_prefill as mg

    T, tile, bs = 192, 64, 16
    kq, kk, kv = jax.random.split(jax.random.key(4), 3)
    q = jax.random.normal(kq, (1, T, 2, 64), jnp.bfloat16)
    k, v = (jax.random.normal(x, (1, T, 1, 64), jnp.bfloat16) for x in (kk, kv))
    lengths = jnp.array([T - 5], jnp.int32)
    _, idx = anchor_prefill(q, k, v, lengths, tile=tile, budget=0.2, min_tokens=16, block_size=bs)
    assert int(jnp.sum(idx >= 0)) > 0
    # The interpreter runs on the host's CPU device (as conftest's mosaic_interpreter_on_the_cpu says why), the
    # selection where the backend puts it.
    cpu = jax.devices("cpu")[0]
    got = mg.sparse_prefill_mgpu(*(jax.device_put(x, cpu) for x in (q, k, v, idx, lengths)), tile=tile,
                                 block_size=bs, config=mg.MosaicPrefillConfig(block_kv=64), interpret=True)
    want = sparse_prefill_reference(q, k, v, idx, lengths, tile=tile, block_size=bs)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-2


@pytest.mark.parametrize("hopper", [False, True])
def test_gpu_anchor_block_path_lowers_for_cuda(hopper, monkeypatch):
    """Kascade's anchor at 128 queries per tile with blocks of 16 on Llama-3.1-8B heads: its attention runs on the
    Mosaic GPU kernel when the device is Hopper, on the Triton kernel otherwise."""
    from lowering import export_for
    from pallas_kernels.anchor_attention.gpu_prefill import anchor_prefill_gpu
    from pallas_kernels.sparse_attention import mgpu_prefill as mg

    monkeypatch.setattr(mg, "hopper", lambda: hopper)
    sds, T = jax.ShapeDtypeStruct, 2048
    q, kv, lens = sds((1, T, 32, 128), jnp.bfloat16), sds((1, T, 8, 128), jnp.bfloat16), sds((1,), jnp.int32)
    f = functools.partial(anchor_prefill_gpu, tile=128, budget=0.1, block_size=16)
    anchor_prefill_gpu.clear_cache()  # the device check runs at trace time: no trace of another parametrization
    try:
        text = export_for("cuda", f, q, kv, kv, lens).mlir_module()
    finally:
        anchor_prefill_gpu.clear_cache()
    assert "anchor_prefill_pool" in text and "topk_select" in text
    assert ("sparse_prefill_mgpu" in text) == hopper
    assert ("sparse_prefill_gathered" in text) == (not hopper)


@pytest.mark.parametrize("block_size", [1, 8])
def test_bench_attention_prefill_checks_pass_and_cover_the_reuse_kernel(block_size):
    """The bench's compiled prefill checks (interpret mode on the CPU): the tile scores, the anchor prefill and the
    reuse layers' gathered prefill kernel on the anchor's selection, each against its jnp reference."""
    import argparse
    import dataclasses

    from eval.bench import attention
    from models.presets import preset

    cfg = dataclasses.replace(preset("llama3-8b"), num_heads=4, num_kv_heads=2, head_dim=32)
    run = attention.Bench(argparse.Namespace(interpret=True, time_budget=1e9))
    attention.check_prefill(run, cfg, 0.25, 4, 128, block_size)
    whats = [c["what"] for c in run.checks]
    assert "sparse_prefill" in whats and "anchor_prefill" in whats, run.checks
    assert all(c["ok"] for c in run.checks), run.checks

"""The decode queries' post-softmax weights over the stacked cache (pallas_kernels.head_probs) and STS's use of it.

The Triton kernel in interpret mode against the jnp reference and against STS's XLA weights (`head_probs` summed
over T); the dense decode kernel's log-sum-exp against its reference; the entry points; CUDA lowering at the
draft's shapes; and `StsDraft.decode` through the in-place path (kernels interpreted, the backend reported as
"gpu") recording what the XLA path records.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jsparse import selection as sel
from jsparse.methods import sts
from pallas_kernels.dense_decode import dense_decode_stacked, dense_decode_stacked_reference
from pallas_kernels.dense_decode import gpu as dgpu
from pallas_kernels.head_probs import head_probs_stacked, head_probs_stacked_reference
from pallas_kernels.head_probs import gpu
from lowering import export_for
from pallas_bounds import checked_memory

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def assert_close(got, want, dtype, what=""):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.isfinite(got).all(), f"{what}: non-finite output"
    tol = TOL[dtype] * max(1.0, float(np.max(np.abs(want))))
    err = float(np.max(np.abs(got - want)))
    assert err <= tol, f"{what}: max abs err {err:.3g} > {tol:.3g}"


def inputs(seed, L, B, T, Hq, Hkv, D, N, lengths, dtype):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, Hq, D), np.float32).astype(dtype))  # cast in numpy: no XLA compile
    k_all = jnp.asarray(rng.standard_normal((L, B, Hkv, N, D), np.float32).astype(dtype))
    v_all = jnp.asarray(rng.standard_normal((L, B, Hkv, N, D), np.float32).astype(dtype))
    return q, k_all, v_all, jnp.asarray(np.asarray(lengths, np.int32))


# (L, B, T, Hq, Hkv, D, N, lengths), dtype, config. N is never a multiple of block_k; every case has a row whose
# length is below N (blocks past it written as zeros, splits with nothing to read) and one near T.
CASES = [
    ((3, 2, 1, 8, 2, 16, 70, [37, 2]), jnp.float32, gpu.HeadProbsConfig(block_k=16, num_splits=3)),
    ((2, 2, 2, 6, 2, 32, 50, [50, 3]), jnp.bfloat16, gpu.HeadProbsConfig(block_k=16)),  # G = 3
    ((2, 1, 5, 8, 2, 16, 45, [7]), jnp.float32, gpu.HeadProbsConfig(block_k=16, block_q=16, num_splits=2)),  # R = 2
    ((2, 3, 5, 4, 4, 16, 40, [40, 5, 21]), jnp.bfloat16, gpu.HeadProbsConfig(block_k=32)),  # G = 1
]


@pytest.mark.parametrize("case,dtype,config", CASES)
def test_head_probs_gpu_interpret_matches_reference(case, dtype, config):
    L, B, T, Hq, Hkv, D, N, lengths = case
    q, k_all, _, lens = inputs(1, L, B, T, Hq, Hkv, D, N, lengths, dtype)
    layer = 1
    lse = dense_decode_stacked_reference(q, k_all, k_all, jnp.int32(layer), lens, return_lse=True)[1]
    got = gpu.head_probs_stacked_gpu(q, k_all, jnp.int32(layer), lens, lse, config=config, interpret=True)
    want = head_probs_stacked_reference(q, k_all, jnp.int32(layer), lens, lse)
    assert got.dtype == jnp.float32 and got.shape == (B, Hq, N)
    assert_close(got, want, jnp.float32, "kernel vs reference")  # f32 weights whatever the input dtype
    # What STS's XLA path records: the softmax rows (jsparse.methods.sts.head_probs) summed over the T queries.
    xla = jax.jit(lambda q, k: sts.head_probs(q, k, sel.decode_positions(lens, T)).sum(axis=2))(q, k_all[layer])
    assert_close(got, xla, dtype, "kernel vs softmax rows")
    got = np.asarray(got)
    np.testing.assert_allclose(got.sum(-1), T, rtol=TOL[dtype])  # each query's row sums to 1
    for b, n in enumerate(lengths):
        assert np.all(got[b, :, n:] == 0) and np.all(got[b, :, :n] > 0)  # exactly 0 past the row's length
    plan = gpu.plan(B, T, Hq, Hkv, N, config)
    assert plan["splits"] * plan["chunk"] >= N and N % config.block_k
    # The layers differ, so reading the wrong one would show.
    other = head_probs_stacked_reference(q, k_all, jnp.int32(0), lens, lse)
    assert float(np.max(np.abs(np.asarray(other) - np.asarray(want)))) > 0.05


def test_head_probs_gpu_never_reads_past_lengths():
    # NaN past each row's length (and in the other layers) must not leak: masked loads, not multiply-by-zero.
    L, B, T, Hq, Hkv, D, N = 2, 2, 2, 4, 2, 16, 48
    q, k_all, _, _ = inputs(2, L, B, T, Hq, Hkv, D, N, [1, 1], jnp.float32)
    lens = jnp.array([2, 33], jnp.int32)
    clean = k_all
    past = np.arange(N)[None, :] >= np.asarray(lens)[:, None]  # [B, N]
    k_all = np.where(past[None, :, None, :, None], np.nan, np.asarray(k_all)).astype(np.float32)
    k_all[0] = np.nan
    k_all = jnp.asarray(k_all)
    lse = dense_decode_stacked_reference(q, clean, clean, jnp.int32(1), lens, return_lse=True)[1]
    got = gpu.head_probs_stacked_gpu(q, k_all, jnp.int32(1), lens, lse, interpret=True,
                                     config=gpu.HeadProbsConfig(block_k=16, num_splits=3))
    assert_close(got, head_probs_stacked_reference(q, clean, jnp.int32(1), lens, lse), jnp.float32, "NaN cache")
    # row 0: query 0 sees key 0 alone (weight 1), query 1 keys 0 and 1
    got = np.asarray(got)
    np.testing.assert_allclose(got[0, :, :2].sum(-1), 2.0, rtol=1e-6)
    assert np.all(got[0, :, 0] >= 1.0)


def test_head_probs_gpu_stays_in_its_blocks():
    """Every load and store of the kernel stays inside its block (`pallas_bounds.checked_memory`: the interpreter
    pads stray loads and drops stray stores, where a GPU reads another head's keys or writes into the next row's
    weights): N = 70 in blocks of 16 (a partial last block, splits past every row's last key), G = 3; T * G = 9
    rows in a tile of 16, and 18 rows in two tiles of 16 (the second mostly padding); a row shorter than T."""
    L, B, Hq, Hkv, D, N, layer = 2, 2, 6, 2, 16, 70, jnp.int32(1)
    with checked_memory():  # unjitted: traced under the check
        for T, config in ((3, gpu.HeadProbsConfig(block_k=16, num_splits=3)),
                          (6, gpu.HeadProbsConfig(block_k=16, block_q=16, num_splits=2))):
            q, k_all, _, lens = inputs(5, L, B, T, Hq, Hkv, D, N, [70, T - 1], jnp.float32)
            lse = dense_decode_stacked_reference(q, k_all, k_all, layer, lens, return_lse=True)[1]
            got = gpu.head_probs_stacked_gpu.__wrapped__(q, k_all, layer, lens, lse, config=config, interpret=True)
            assert_close(got, head_probs_stacked_reference(q, k_all, layer, lens, lse), jnp.float32, f"T = {T}")


@pytest.mark.parametrize("case,dtype", [((3, 2, 1, 8, 2, 16, 70, [37, 70]), jnp.float32),
                                        ((2, 2, 3, 6, 2, 32, 64, [5, 64]), jnp.bfloat16)])
def test_dense_decode_lse_matches_reference(case, dtype):
    L, B, T, Hq, Hkv, D, N, lengths = case
    q, k_all, v_all, lens = inputs(3, L, B, T, Hq, Hkv, D, N, lengths, dtype)
    out, lse = dgpu.dense_decode_stacked_gpu(q, k_all, v_all, jnp.int32(2 % L), lens, return_lse=True,
                                             interpret=True, config=dgpu.DenseDecodeConfig(block_k=16, num_splits=3))
    want_out, want_lse = dense_decode_stacked_reference(q, k_all, v_all, jnp.int32(2 % L), lens, return_lse=True)
    assert lse.shape == (B, T, Hq) and lse.dtype == jnp.float32
    assert_close(out, want_out, dtype, "out")
    assert_close(lse, want_lse, jnp.float32, "lse")
    # the spec: logsumexp of the visible scaled logits, per query row
    k = np.asarray(k_all[2 % L], np.float64)
    qq = np.asarray(q, np.float64)
    b, t, h = B - 1, T - 1, Hq - 1
    logits = k[b, h // (Hq // Hkv), :lengths[b] - T + t + 1] @ qq[b, t, h] / np.sqrt(D)
    np.testing.assert_allclose(float(lse[b, t, h]), np.log(np.exp(logits - logits.max()).sum()) + logits.max(),
                               rtol=1e-4)
    # the entry point: every implementation returns the same pair (sliced: XLA's own log-sum-exp)
    for impl in ("sliced", "reference"):
        o2, l2 = dense_decode_stacked(q, k_all, v_all, jnp.int32(2 % L), lens, return_lse=True, implementation=impl)
        assert_close(o2, want_out, dtype, f"api out {impl}")
        assert_close(l2, want_lse, jnp.float32, f"api lse {impl}")


def test_dense_decode_lse_of_a_row_with_no_visible_key_is_minus_inf():
    q, k_all, v_all, _ = inputs(4, 2, 2, 2, 4, 2, 16, 32, [1, 1], jnp.float32)
    lens = jnp.array([1, 20], jnp.int32)  # row 0, query 0 sits at position -1
    _, lse = dgpu.dense_decode_stacked_gpu(q, k_all, v_all, jnp.int32(0), lens, return_lse=True, interpret=True,
                                           config=dgpu.DenseDecodeConfig(block_k=16))
    _, want = dense_decode_stacked_reference(q, k_all, v_all, jnp.int32(0), lens, return_lse=True)
    lse, want = np.asarray(lse), np.asarray(want)
    assert np.all(np.isneginf(lse[0, 0])) and np.all(np.isneginf(want[0, 0]))
    np.testing.assert_allclose(lse[:, 1], want[:, 1], rtol=1e-5)
    # Its output is zeros on every implementation (XLA's dot_product_attention alone would average every value),
    # and so is a T = 1 row of length 0.
    want_out = np.asarray(dense_decode_stacked_reference(q, k_all, v_all, jnp.int32(0), lens))
    assert not np.asarray(want_out[0, 0]).any()
    for impl in ("sliced", "reference"):
        out = np.asarray(dense_decode_stacked(q, k_all, v_all, jnp.int32(0), lens, implementation=impl))
        np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6, err_msg=impl)
    zero = jnp.array([0, 20], jnp.int32)
    out = np.asarray(dense_decode_stacked(q[:, :1], k_all, v_all, jnp.int32(0), zero, implementation="sliced"))
    assert not out[0].any() and out[1].any()


@pytest.mark.parametrize("case,dtype,config", [
    ((3, 2, 1, 8, 2, 16, 70, [37, 2]), jnp.float32, dgpu.DenseDecodeConfig(block_k=16, num_splits=3)),
    ((2, 2, 2, 6, 2, 32, 50, [50, 3]), jnp.bfloat16, dgpu.DenseDecodeConfig(block_k=16)),  # G = 3
    ((2, 1, 5, 8, 2, 16, 45, [7]), jnp.float32, dgpu.DenseDecodeConfig(block_k=16, block_q=16, num_splits=2)),
])
def test_dense_decode_probs_are_head_probs(case, dtype, config):
    """`return_probs`: the weights from the logits the dense decode kernel writes equal head_probs' reference
    (out and lse unchanged), exactly 0 past each query's last key even where the cache holds NaN there (the
    logits past a program's last key are never written); every implementation of the entry point agrees."""
    L, B, T, Hq, Hkv, D, N, lengths = case
    q, k_all, v_all, lens = inputs(8, L, B, T, Hq, Hkv, D, N, lengths, dtype)
    past = np.arange(N)[None, :] >= np.asarray(lens)[:, None]
    nan_k = jnp.asarray(np.where(past[None, :, None, :, None], np.nan, np.asarray(k_all)).astype(k_all.dtype))
    layer = jnp.int32(1)
    out, lse, probs = dgpu.dense_decode_stacked_gpu(q, nan_k, v_all, layer, lens, return_lse=True,
                                                    return_probs=True, interpret=True, config=config)
    want_out, want_lse = dense_decode_stacked_reference(q, k_all, v_all, layer, lens, return_lse=True)
    want = head_probs_stacked_reference(q, k_all, layer, lens, want_lse)
    assert probs.shape == (B, Hq, N) and probs.dtype == jnp.float32
    assert_close(out, want_out, dtype, "out")
    assert_close(lse, want_lse, jnp.float32, "lse")
    assert_close(probs, want, jnp.float32, "probs vs head_probs reference")
    got = np.asarray(probs)
    np.testing.assert_allclose(got.sum(-1), T, rtol=TOL[dtype])
    for b, n in enumerate(lengths):
        assert np.all(got[b, :, n:] == 0) and np.all(got[b, :, :n] > 0)
    for impl in ("sliced", "reference"):
        o2, p2 = dense_decode_stacked(q, k_all, v_all, layer, lens, return_probs=True, implementation=impl)
        assert_close(o2, want_out, dtype, f"api out {impl}")
        assert_close(p2, want, jnp.float32, f"api probs {impl}")


def test_head_probs_api():
    L, B, T, Hq, Hkv, D, N, lengths = 2, 2, 2, 4, 2, 16, 40, [40, 9]
    q, k_all, v_all, lens = inputs(5, L, B, T, Hq, Hkv, D, N, lengths, jnp.float32)
    lse = dense_decode_stacked_reference(q, k_all, v_all, jnp.int32(1), lens, return_lse=True)[1]
    want = head_probs_stacked_reference(q, k_all, jnp.int32(1), lens, lse)
    for impl in (None, "reference"):  # None on CPU is the reference
        got = jax.jit(lambda l, impl=impl: head_probs_stacked(q, k_all, l, lens, lse, implementation=impl))(1)
        assert_close(got, want, jnp.float32, f"api {impl}")
    assert_close(head_probs_stacked(q, k_all, -1, lens, lse), want, jnp.float32, "layer -1 counts from the end")
    with pytest.raises(ValueError, match="implementation='xla'"):
        head_probs_stacked(q, k_all, 1, lens, lse, implementation="xla")
    with pytest.raises(ValueError, match=r"lse has shape \(2, 4\)"):
        head_probs_stacked(q, k_all, 1, lens, lse[:, 0])
    with pytest.raises(ValueError, match="head_dim D=24"):
        gpu.head_probs_stacked_gpu(jnp.zeros((1, 1, 2, 24)), jnp.zeros((1, 1, 1, 8, 24)), 0, jnp.array([8]),
                                   jnp.zeros((1, 1, 2)), interpret=True)
    with pytest.raises(ValueError, match="block_k=24"):
        gpu.head_probs_stacked_gpu(q, k_all, 0, lens, lse, config=gpu.HeadProbsConfig(block_k=24), interpret=True)


def test_head_probs_and_lse_lower_for_cuda_at_the_draft_shapes():
    # Llama-3.2-1B-shaped draft at 100K, batch 2 (T = 1 and the round-opening T = 2), and a G = 3 group with
    # T * G over several query tiles.
    sds = jax.ShapeDtypeStruct
    layer = sds((), jnp.int32)
    for B, T, Hq, Hkv, D, N, L in ((2, 1, 32, 8, 64, 100000, 16), (2, 2, 32, 8, 64, 100000, 16),
                                   (1, 30, 9, 3, 64, 2000, 4)):
        q, k_all, lens = sds((B, T, Hq, D), jnp.bfloat16), sds((L, B, Hkv, N, D), jnp.bfloat16), sds((B,), jnp.int32)
        exp = export_for("cuda", gpu.head_probs_stacked_gpu, q, k_all, layer, lens, sds((B, T, Hq), jnp.float32))
        assert "head_probs_stacked" in exp.mlir_module()
        assert exp.out_avals[0].shape == (B, Hq, N)
        exp = export_for("cuda", functools.partial(dgpu.dense_decode_stacked_gpu, return_lse=True), q, k_all, k_all,
                         layer, lens)
        assert [a.shape for a in exp.out_avals] == [(B, T, Hq, D), (B, T, Hq)]
        exp = export_for("cuda", functools.partial(dgpu.dense_decode_stacked_gpu, return_probs=True), q, k_all,
                         k_all, layer, lens)
        assert [a.shape for a in exp.out_avals] == [(B, T, Hq, D), (B, Hq, N)]
    assert gpu.plan(1, 30, 9, 3, 2000, gpu.HeadProbsConfig())["R"] == 2


# --------------------------------------------------------------------------------------------------
# STS's draft record through the in-place path.


def interpreted_kernels(monkeypatch, calls):
    """Routes sts's kernel entry point to the Triton kernel in the interpreter (recording each call)."""
    def decode(q, k_all, v_all, layer, lengths, implementation, **returns):
        calls.append(("dense_decode_stacked", k_all.shape, implementation))
        return dgpu.dense_decode_stacked_gpu(q, k_all, v_all, layer, lengths, interpret=True,
                                             config=dgpu.DenseDecodeConfig(block_k=16), **returns)

    monkeypatch.setattr(sts, "dense_decode_stacked", decode)


@pytest.mark.parametrize("T,carry", [(2, 0.5), (1, 0.0)])
def test_sts_draft_decode_in_place_records_what_xla_records(monkeypatch, T, carry):
    """StsDraft.decode on a stacked layer view: the in-place path (forced) and the XLA path give the same output,
    the same recorded keys and the same weights (f32, random inputs: no near-ties in the top W)."""
    from models.attention import LayerContext, LayerKV

    calls = []
    interpreted_kernels(monkeypatch, calls)
    L, B, Hq, Hkv, D, N = 3, 2, 8, 2, 16, 56
    q, k_all, v_all, lens = inputs(6, L, B, T, Hq, Hkv, D, N, [51, T + 2], jnp.float32)
    view = LayerKV(k=k_all[2], v=v_all[2], k_all=k_all, v_all=v_all, layer=jnp.int32(2))
    draft = sts.StsDraft(budget=10, min_tokens=0, tile=16, slack=2, carry=carry, selection="top_k")
    W = draft.decode_width(N)
    rng = np.random.default_rng(7)
    rec = sts.empty_record(L, B, Hq, 1, W)
    old_idx = np.sort(np.stack([rng.permutation(30)[:W] for _ in range(L * B * Hq)]), -1).reshape(L, B, Hq, 1, W)
    rec = rec.replace(idx=jnp.asarray(old_idx, jnp.int32), val=jnp.asarray(rng.random(old_idx.shape), jnp.float32))
    ctx = LayerContext(layer=jnp.int32(2), lengths=lens)

    monkeypatch.setattr(sts, "in_place_probs", lambda q, cache: True)
    out_p, rec_p = draft.decode(ctx, q, view, rec)
    assert [c[0] for c in calls] == ["dense_decode_stacked"]
    assert all(c[1] == k_all.shape and c[2] == "pallas_gpu" for c in calls)  # the stacked cache, in place
    monkeypatch.setattr(sts, "in_place_probs", lambda q, cache: False)
    out_x, rec_x = draft.decode(ctx, q, view, rec)
    assert len(calls) == 1  # the XLA path calls no kernel

    np.testing.assert_allclose(np.asarray(out_p), np.asarray(out_x), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(rec_p.idx), np.asarray(rec_x.idx))
    np.testing.assert_allclose(np.asarray(rec_p.val), np.asarray(rec_x.val), rtol=1e-5, atol=1e-6)
    assert not np.array_equal(np.asarray(rec_p.idx[2]), old_idx[2])  # the layer's record was rewritten
    np.testing.assert_array_equal(np.asarray(rec_p.idx[:2]), old_idx[:2])  # the other layers kept
    # the short row (T + 2 keys) records all its keys below the forward's second new one (`sts.record_limit`: 3 of
    # them at T = 1 and T = 2), then -1
    short = np.asarray(rec_p.idx[2, 1, :, 0])
    n = T + 2 - (T - 1)
    np.testing.assert_array_equal(short[:, :n], np.broadcast_to(np.arange(n), (Hq, n)))
    assert np.all(short[:, n:] == -1)


def test_sts_draft_in_the_model_scan_uses_the_kernels_on_gpu(monkeypatch):
    """The draft's decode inside the model's layer scan, the backend reported as "gpu" (kernels interpreted):
    the in-place path is taken on the stacked cache and records the keys of the CPU (XLA) run."""
    from models import llama
    from models.cache import init_cache
    from models.config import ModelConfig
    from models.params import random_params

    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64)
    params = random_params(cfg, jax.random.key(0), jnp.bfloat16)
    empty = init_cache(cfg, 2, 40, jnp.bfloat16)
    filled = jax.random.normal(jax.random.key(1), empty.k.shape, jnp.bfloat16)
    cache = empty.replace(k=filled, v=filled[::-1], lengths=jnp.array([7, 33], jnp.int32))
    tok = jnp.array([[11, 5], [12, 9]], jnp.int32)  # T = 2: a round's opening draft step
    draft = sts.StsDraft(budget=6, min_tokens=0, tile=16, slack=2, selection="top_k")
    state = draft.init_state(cfg, 2, 40)
    want_logits, _, want = llama.decode(params, cfg, draft, tok, cache, state)

    calls = []
    interpreted_kernels(monkeypatch, calls)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert sts.in_place_probs(jnp.zeros((1, 1, 4, 16), jnp.bfloat16), cache=type("V", (), {"layer": 0})())
    got_logits, _, got = llama.decode(params, cfg, draft, tok, cache, state)
    assert [c[:2] for c in calls] == [("dense_decode_stacked", empty.k.shape)]
    np.testing.assert_allclose(np.asarray(got_logits, np.float32), np.asarray(want_logits, np.float32), atol=0.05)
    # Same keys per layer and head up to near-ties of bf16 weights: compare the sets' overlap and the weights.
    gi, wi = np.asarray(got.idx), np.asarray(want.idx)
    overlap = np.mean([len(set(a) & set(b)) / len(set(b)) for a, b in zip(gi.reshape(-1, gi.shape[-1]),
                                                                        wi.reshape(-1, wi.shape[-1]))])
    assert overlap >= 0.95, overlap
    same = gi == wi
    np.testing.assert_allclose(np.asarray(got.val)[same], np.asarray(want.val)[same], atol=2e-2)


def test_sts_later_step_with_dense_attention_in_place_equals_xla(monkeypatch):
    """`mask_attention=False`: the later draft step's dense attention and its pool weights through the in-place
    kernel (its log-sum-exp; interpreted, forced) equal the XLA path's (attend_dense + decode_lse)."""
    from models.attention import LayerContext, LayerKV

    calls = []
    interpreted_kernels(monkeypatch, calls)
    L, B, Hq, Hkv, D, N = 2, 2, 8, 2, 16, 48
    q, k_all, v_all, lens = inputs(9, L, B, 1, Hq, Hkv, D, N, [40, 9], jnp.float32)
    view = LayerKV(k=k_all[1], v=v_all[1], k_all=k_all, v_all=v_all, layer=jnp.int32(1))
    rng = np.random.default_rng(3)
    P = 12
    idx = np.full((B, Hq, P), -1, np.int32)
    for b, h in np.ndindex(B, Hq):
        n = min(P - 2, int(lens[b]) - 1)
        idx[b, h, :n] = np.sort(rng.choice(int(lens[b]) - 1, n, replace=False))
    idx = jnp.asarray(idx)
    monkeypatch.setattr(sts, "in_place_probs", lambda q, cache: True)
    out_p, p_p = sts.dense_step_pool_weights(q, view, lens, idx)
    assert [c[0] for c in calls] == ["dense_decode_stacked"]
    monkeypatch.setattr(sts, "in_place_probs", lambda q, cache: False)
    out_x, p_x = sts.dense_step_pool_weights(q, view, lens, idx)
    assert len(calls) == 1
    np.testing.assert_allclose(np.asarray(out_p), np.asarray(out_x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(p_p), np.asarray(p_x), rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(p_p)[np.asarray(idx) < 0] == 0) and float(p_p.max()) > 0


def test_head_probs_default_on_gpu_falls_back_for_an_unsupported_head_dim(monkeypatch):
    """implementation=None on a GPU backend with a head_dim the kernel does not take (24): the reference runs."""
    q, k_all, v_all, lens = inputs(9, 2, 2, 1, 4, 2, 24, 32, [32, 7], jnp.float32)
    lse = dense_decode_stacked_reference(q, k_all, v_all, jnp.int32(1), lens, return_lse=True)[1]
    want = head_probs_stacked_reference(q, k_all, jnp.int32(1), lens, lse)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert_close(head_probs_stacked(q, k_all, 1, lens, lse), want, jnp.float32, "gpu backend, D=24")


def test_head_probs_lse_of_the_wrong_heads_or_dtype_is_named():
    q, k_all, v_all, lens = inputs(10, 2, 2, 2, 4, 2, 16, 40, [40, 9], jnp.float32)
    lse = dense_decode_stacked_reference(q, k_all, v_all, jnp.int32(1), lens, return_lse=True)[1]
    with pytest.raises(ValueError, match=r"lse has shape \(2, 2, 2\) .*expected f32\[B=2, T=2, Hq=4\]"):
        head_probs_stacked(q, k_all, 1, lens, lse[..., :2])
    with pytest.raises(ValueError, match=r"lse has shape \(2, 2, 4\) and dtype int32"):
        head_probs_stacked(q, k_all, 1, lens, lse.astype(jnp.int32))

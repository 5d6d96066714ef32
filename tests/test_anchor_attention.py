"""Anchor decode layer: the reference against jsparse's Kascade anchor (oracle selection + attention), the XLA,
Pallas GPU and Pallas TPU implementations (interpret mode) against the reference, and their lowerings."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.anchor_attention import (anchor_decode, anchor_decode_reference, anchor_prefill,
                                             anchor_prefill_reference, gpu, gpu_prefill, tile_scores_reference, tpu,
                                             tpu_prefill)
from pallas_kernels.anchor_attention.common import budget_count, tile_counts
from pallas_kernels.anchor_attention.reference import decode_scores_reference
from pallas_kernels.anchor_attention.xla import anchor_decode_xla
from pallas_kernels.sparse_attention.reference import sparse_decode_reference, sparse_prefill_reference
from lowering import H100, TPU_V5E, abstract_device
from pallas_bounds import checked_memory

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def inputs(seed, B, T, Hq, Hkv, D, N, lengths, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, Hq, D), np.float32)).astype(dtype)
    k = jnp.asarray(rng.standard_normal((B, Hkv, N, D), np.float32)).astype(dtype)
    v = jnp.asarray(rng.standard_normal((B, Hkv, N, D), np.float32)).astype(dtype)
    return q, k, v, jnp.asarray(np.asarray(lengths, np.int32))


def assert_close(got, want, dtype, what):
    got = np.asarray(jnp.asarray(got, jnp.float32))
    want = np.asarray(jnp.asarray(want, jnp.float32))
    err = float(np.max(np.abs(got - want)))
    assert err <= TOL[dtype] * max(1.0, float(np.max(np.abs(want)))), f"{what}: max abs err {err:.3g}"


def assert_valid_selection(idx, scores, kk, tol):
    """idx int32[..., K] is a top-kk choice of scores f32[..., N] up to `tol` (ties at the threshold may fall
    either way when the scores differ by rounding), ascending, unique, -1 padded, never a -inf key."""
    idx, scores = np.asarray(idx), np.asarray(scores)
    kk = np.broadcast_to(np.asarray(kk), idx.shape[:-1])
    for row in np.ndindex(idx.shape[:-1]):
        sel = idx[row][idx[row] >= 0]
        s = scores[row]
        n_ok = int(np.sum(s > -np.inf))
        assert len(sel) == min(int(kk[row]), n_ok), (row, len(sel), kk[row])
        assert np.all(idx[row][len(sel):] == -1) and np.all(np.diff(sel) > 0), row
        if len(sel) == 0:
            continue
        assert np.all(s[sel] > -np.inf), row
        rest = np.setdiff1d(np.arange(s.shape[0]), sel)
        if rest.size:
            assert s[sel].min() >= s[rest].max() - tol, (row, s[sel].min(), s[rest].max())


# (B, T, Hq, Hkv, D, N, lengths, budget, min_tokens)
CASES = [
    (2, 1, 8, 2, 16, 200, [150, 77], 0.1, 16),
    (1, 2, 4, 1, 32, 96, [61], 0.25, 4),
    (2, 1, 6, 3, 16, 70, [64, 3], 0.5, 8),  # row 1: kk = 3 = every visible key (min_tokens above pos + 1)
]


@pytest.mark.parametrize("case", [CASES[2]])
def test_reference_equals_kascade_anchor(case):
    from jsparse import selection as sel
    from jsparse.methods.oracle import select_decode

    B, T, Hq, Hkv, D, N, lengths, budget, mt = case
    q, k, v, lens = inputs(0, B, T, Hq, Hkv, D, N, lengths)
    out, idx = anchor_decode_reference(q, k, v, lens, budget=budget, min_tokens=mt)
    K = sel.budget_tokens(budget, N, mt)
    pos = sel.decode_positions(lens, T)
    want_idx = select_decode(q, k, pos, budget, mt, K)
    assert idx.shape == (B, Hkv, T, K)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
    assert_close(out, sparse_decode_reference(q, k, v, want_idx, lens), jnp.float32, "sparse out")
    # The dense anchor attends to every visible key: the full selection's attention.
    dense, idx2 = anchor_decode_reference(q, k, v, lens, budget=budget, min_tokens=mt, dense_output=True)
    np.testing.assert_array_equal(np.asarray(idx2), np.asarray(idx))
    every = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, Hkv, T, N))
    assert_close(dense, sparse_decode_reference(q, k, v, every, lens), jnp.float32, "dense out")
    scores = decode_scores_reference(q, k, lens)
    np.testing.assert_allclose(np.asarray(jnp.where(jnp.isfinite(scores), scores, 0).sum(-1)), Hq // Hkv,
                               rtol=1e-5)  # each query head's weights sum to 1


def check_impl(fn, case, dtype, dense, seed):
    B, T, Hq, Hkv, D, N, lengths, budget, mt = case
    q, k, v, lens = inputs(seed, B, T, Hq, Hkv, D, N, lengths, dtype)
    out, idx = fn(q, k, v, lens, budget=budget, min_tokens=mt, dense_output=dense)
    want, want_idx = anchor_decode_reference(q, k, v, lens, budget=budget, min_tokens=mt, dense_output=dense)
    assert out.dtype == dtype and idx.shape == want_idx.shape and idx.dtype == jnp.int32
    pos = lens[:, None] - T + jnp.arange(T)
    kk = budget_count(budget, pos + 1, mt)[:, None, :]
    assert_valid_selection(idx, decode_scores_reference(q, k, lens), kk, tol=1e-2 if dtype == jnp.bfloat16 else 1e-6)
    if dtype == jnp.float32:  # random f32 scores have no near-ties: the very same choice
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
    # The output is the attention over the implementation's own choice (dense: over everything).
    want = want if dense else sparse_decode_reference(q, k, v, idx, lens)
    assert_close(out, want, dtype, "anchor out")


def test_xla_matches_reference():
    check_impl(anchor_decode_xla, CASES[1], jnp.float32, True, 1)  # (the sparse one: test_api_dispatch_and_errors)


@pytest.mark.parametrize("case,dtype,dense", [(CASES[1], jnp.float32, True), (CASES[2], jnp.bfloat16, False)])
def test_gpu_interpret_matches_reference(case, dtype, dense):
    fn = functools.partial(gpu.anchor_decode_gpu, config=gpu.AnchorConfig(block_n=32, target_programs=16),
                           interpret=True)  # N = 96, 70: several splits, and a masked tail
    check_impl(fn, case, dtype, dense, 2)


@pytest.mark.parametrize("case,dtype,dense", [(CASES[0], jnp.float32, False), (CASES[1], jnp.bfloat16, True)])
def test_tpu_interpret_matches_reference(case, dtype, dense):
    fn = functools.partial(tpu.anchor_decode_tpu, config=tpu.TpuAnchorConfig(chunk=128), interpret=True)
    check_impl(fn, case, dtype, dense, 3)


def test_stacked_cache_read_in_place():
    # Inside the model's scan the cache is [L, B, Hkv, N, D] and the layer traced: the kernels read it in place.
    B, T, Hq, Hkv, D, N, lengths, budget, mt = CASES[0]
    L = 3
    q, k, v, lens = inputs(8, B, T, Hq, Hkv, D, N * L, lengths)
    k, v = (x.reshape(B, Hkv, L, N, D).transpose(2, 0, 1, 3, 4) for x in (k, v))
    for dense, layer, fn in [
        (False, -2, functools.partial(gpu.anchor_decode_gpu, interpret=True,
                                      config=gpu.AnchorConfig(block_n=32, target_programs=16))),
        (True, 1, functools.partial(tpu.anchor_decode_tpu, interpret=True, config=tpu.TpuAnchorConfig(chunk=128)))]:
        want, want_idx = anchor_decode_reference(q, k[1], v[1], lens, budget=budget, min_tokens=mt,
                                                 dense_output=dense)
        out, idx = fn(q, k, v, lens, layer=jnp.int32(layer), budget=budget, min_tokens=mt, dense_output=dense)
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
        assert_close(out, want, jnp.float32, f"stacked dense={dense}")
    with pytest.raises(ValueError, match="stacked cache"):
        anchor_decode(q, k[0], v[0], lens, budget=budget, layer=jnp.int32(0))


# The GPU scoring pass on the inputs the cases above miss: scores (both pooling passes) and the dense anchor's output
# against the reference, with several splits of several key chunks each (block_n 16).

def gpu_scores_config(pool, target_programs):
    return gpu.AnchorConfig(block_n=16, target_programs=target_programs, pool=pool, pool_block=32)


def check_gpu_scores(q, k, v, lens, cfg, scale=None, clean=None, rtol=1e-5, decode_scores=None):
    """decode_scores_gpu (interpret) against the reference's scores and dense output (on `clean`, the cache the
    reference reads, when the kernel's one holds garbage past the rows' lengths)."""
    kr, vr = clean if clean is not None else (k, v)
    scores, out = (decode_scores or gpu.decode_scores_gpu)(q, k, v, lens, scale=scale, dense_output=True, config=cfg,
                                                           interpret=True)
    want = np.asarray(decode_scores_reference(q, kr, lens, scale=scale))
    want_out = anchor_decode_reference(q, kr, vr, lens, budget=1.0, min_tokens=0, scale=scale, dense_output=True)[0]
    scores = np.asarray(scores)
    np.testing.assert_array_equal(np.isneginf(scores), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(scores[fin], want[fin], rtol=rtol, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("pool", ["xla", "triton"])
def test_gpu_scores_at_split_and_chunk_edges(pool):
    """G = 3 (padded rows), N = 72 (a masked tail), two splits of 3 and 2 chunks. Row 0's positions 31, 32 end
    mid-split, the last on a chunk's first key (mutation: `lim + 1` -> `lim` in the chunk count dropped key 32);
    row 1 (length 1 < T = 2) has a query with no visible key: scores all -inf, dense output 0 (mutations: reading
    key 0 for it, or dividing by its zero sum); row 2 sees every key, the tail's last."""
    q, k, v, lens = inputs(13, 3, 2, 6, 2, 16, 72, [33, 1, 72])
    check_gpu_scores(q, k, v, lens, gpu_scores_config(pool, 24))


@pytest.mark.parametrize("pool", ["xla", "triton"])
def test_gpu_scores_ignore_garbage_past_the_length(pool):
    """The cache past a row's length is garbage (NaN here): the scores and the dense output equal the reference's
    on a clean cache (mutations: dropping the logits' visibility mask, whose NaN then became the running max, or
    loading V up to N instead of the position)."""
    q, k, v, lens = inputs(14, 2, 1, 4, 2, 16, 64, [40, 9])
    past = (jnp.arange(64)[None, :] >= lens[:, None])[:, None, :, None]  # [B, 1, N, 1]
    check_gpu_scores(q, jnp.where(past, jnp.nan, k), jnp.where(past, jnp.nan, v), lens,
                     gpu_scores_config(pool, 8), clean=(k, v))


def test_gpu_scores_with_logits_far_from_zero():
    """Logits of +-150 (exp overflows f32 at 89): the online (max, sum) and the splits' merge must rescale by the
    running max. Split 0 holds a chunk of +150 logits then one of -150 for one head (the reverse for the other);
    row 1 sees one chunk of -150 logits only for its second head (mutations: each chunk's own max instead of the
    running one, a running max starting at 0, the dense merge's weights exp(m) without the max: inf or 0)."""
    B, Hq, Hkv, D, N = 2, 4, 2, 16, 64
    rng = np.random.default_rng(15)
    u = np.full(D, 0.25, np.float32)  # |u| = 1
    sign = np.where(np.arange(N) // 16 % 2 == 0, 1.0, -1.0).astype(np.float32)  # chunks +, -, +, -
    k = sign[None, None, :, None] * u + 0.05 * rng.standard_normal((B, Hkv, N, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, N, D)).astype(np.float32)
    q = np.broadcast_to(np.array([150.0, -150.0] * Hkv, np.float32)[:, None] * u, (B, 1, Hq, D))
    lens = jnp.asarray([64, 14], jnp.int32)
    check_gpu_scores(*(jnp.asarray(x) for x in (q, k, v)), lens, gpu_scores_config("xla", 8), scale=1.0, rtol=1e-4)


def test_gpu_kernels_never_touch_memory_outside_their_blocks():
    """On the GPU a lane that loads or stores outside its block reads or overwrites another program's rows (the
    interpreter drops such stores, and such loads give values the kernels mask anyway: nothing else shows it).
    Under `checked_memory` every load and store of the scoring and pooling kernels that lets a lane outside its
    block through is reported and turns its values into NaN, and the results must still equal the reference: G = 3
    (padded query rows), N = 72 (a partial last key chunk and pooling block), a row that sees every key (mutations:
    the logits' store without the row mask or the key mask, the K load without its mask, the pooling load without
    its row mask)."""
    q, k, v, lens = inputs(16, 2, 1, 6, 2, 16, 72, [72, 30])
    with checked_memory():
        # Unjitted, so that no trace cached by another test runs instead of the checked kernels.
        check_gpu_scores(q, k, v, lens, gpu_scores_config("triton", 8), decode_scores=gpu.decode_scores_gpu.__wrapped__)


def test_api_dispatch_and_errors():
    q, k, v, lens = inputs(4, 1, 1, 4, 2, 16, 64, [50])
    want = anchor_decode_reference(q, k, v, lens, budget=0.2, min_tokens=4)
    for impl in (None, "xla", "reference"):
        out, idx = anchor_decode(q, k, v, lens, budget=0.2, min_tokens=4, implementation=impl)
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(want[1]))
        assert_close(out, want[0], jnp.float32, str(impl))
    with pytest.raises(ValueError, match="implementation='cuda'"):
        anchor_decode(q, k, v, lens, budget=0.2, implementation="cuda")
    with pytest.raises(ValueError, match="budget=0"):
        anchor_decode(q, k, v, lens, budget=0)
    with pytest.raises(ValueError, match="K=65"):
        anchor_decode(q, k, v, lens, budget=0.2, K=65)
    with pytest.raises(ValueError, match="min_tokens=-1"):
        anchor_decode(q, k, v, lens, budget=0.2, min_tokens=-1)
    with pytest.raises(ValueError, match="Hq=4 .* Hkv=3"):
        anchor_decode(q, k[:, :1].repeat(3, 1), v[:, :1].repeat(3, 1), lens, budget=0.2)
    with pytest.raises(ValueError, match="block_n=24"):
        gpu.decode_scores_gpu(q, k, v, lens, config=gpu.AnchorConfig(block_n=24), interpret=True)


def _args(dtype):
    sds = jax.ShapeDtypeStruct
    B, Hq, Hkv, D, N = 2, 32, 8, 128, 4096
    cache = sds((B, Hkv, N, D), dtype)
    return sds((B, 1, Hq, D), dtype), cache, cache, sds((B,), jnp.int32)


@pytest.mark.parametrize("dense,stacked", [(False, True), (True, False)])
def test_gpu_lowers_for_cuda(dense, stacked):
    check = jax.export.DisabledSafetyCheck.custom_call(plgpu.CUSTOM_CALL_TARGET_NAME)
    f = functools.partial(gpu.anchor_decode_gpu, budget=0.1, dense_output=dense)
    args = _args(jnp.bfloat16)
    if stacked:  # a 4-layer stacked cache and a traced layer index
        f = functools.partial(f, layer=jnp.int32(2))
        cache = jax.ShapeDtypeStruct((4,) + args[1].shape, args[1].dtype)
        args = (args[0], cache, cache, args[3])
    with abstract_device(*H100):
        text = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[check])(*args).mlir_module()
    assert "anchor_decode_logits" in text and "topk_select" in text  # (the kernel name depends on its path)
    assert ("sparse_decode_gathered" in text) == (not dense)  # a dense anchor reads V in the scoring pass
    assert ("sparse_decode_gathered_stacked" in text) == (stacked and not dense)


@pytest.mark.parametrize("dense", [False, True])
def test_tpu_lowers_for_tpu(dense):
    f = functools.partial(tpu.anchor_decode_tpu, budget=0.1, dense_output=dense)
    with abstract_device(*TPU_V5E):
        text = jax.export.export(jax.jit(f), platforms=["tpu"])(*_args(jnp.bfloat16)).mlir_module()
    assert text.count("tpu_custom_call") >= 9  # the scoring kernel + 8 counting passes


# --------------------------------------------------------------------------------------------------
# Prefill: tile-pooled scores without [T, T].

def prefill_inputs(seed, B, T, Hq, Hkv, D, lengths, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, h, D), np.float32)).astype(dtype) for h in (Hq, Hkv, Hkv))
    return q, k, v, jnp.asarray(np.asarray(lengths, np.int32))


def test_prefill_reference_equals_kascade_anchor():
    from jsparse import selection as sel
    from jsparse.methods.oracle import select_prefill

    T, tile, budget, mt = 45, 8, 0.3, 2
    q, k, v, lens = prefill_inputs(0, 2, T, 8, 2, 16, [45, 30])
    for lengths in (None, lens):
        np.testing.assert_allclose(np.asarray(tile_scores_reference(q, k, tile=tile, lengths=lengths)),
                                   np.asarray(sel.before_tile_scores(sel.prefill_tile_probs(q, k, tile, lengths),
                                                                     tile)), rtol=1e-5, atol=1e-6)
    out, idx = anchor_prefill_reference(q, k, v, lens, tile=tile, budget=budget, min_tokens=mt)
    want = select_prefill(q, k, tile, sel.budget_tokens(budget, sel.tile_starts(T, tile), mt),
                          sel.budget_tokens(budget, T, mt), lens)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want))
    assert_close(out, sparse_prefill_reference(q, k, v, want, lens, tile=tile), jnp.float32, "prefill out")


def test_prefill_padding_rows_choose_no_keys():
    """A row's right padding (queries at or past its length) adds nothing to the tile scores: whatever tokens fill
    it, every implementation keeps the same keys for every tile and gives the same output on the valid rows, which
    equal those of the unpadded row. Before, the tile that holds the prompt's end pooled its padding queries too, so
    the prompt's last tokens (the first generated token's) depended on the padding (up to 2.08 apart here)."""
    from jsparse import selection as sel
    from jsparse.methods.oracle import select_prefill
    from pallas_kernels.anchor_attention import gpu_prefill, tpu_prefill, xla

    B, T, Hq, Hkv, D, n, tile = 1, 128, 8, 2, 32, 100, 16
    q, k, v, lens = prefill_inputs(5, B, T, Hq, Hkv, D, [n])
    q = 2 * q
    other = q.at[:, n:].set(5 * jax.random.normal(jax.random.key(9), (B, T - n, Hq, D)))  # only the padding differs
    kw = dict(tile=tile, budget=0.2, min_tokens=8)
    impls = {"reference": anchor_prefill_reference, "xla": xla.anchor_prefill_xla,
             "gpu": functools.partial(gpu_prefill.anchor_prefill_gpu, interpret=True),
             "tpu": functools.partial(tpu_prefill.anchor_prefill_tpu, interpret=True)}
    short, short_idx = anchor_prefill_reference(q[:, :n], k[:, :n], v[:, :n], lens, **kw)
    for name, f in impls.items():
        o1, i1 = f(q, k, v, lens, **kw)
        o2, i2 = f(other, k, v, lens, **kw)
        np.testing.assert_array_equal(np.asarray(i1), np.asarray(i2), err_msg=name)
        assert_close(o1[:, :n], o2[:, :n], jnp.float32, f"{name} valid rows")
        assert_close(o1[:, :n], short, jnp.float32, f"{name} against the unpadded row")
    tb = sel.budget_tokens(0.2, sel.tile_starts(T, tile), 8)
    np.testing.assert_array_equal(np.asarray(select_prefill(q, k, tile, tb, 40, lens)),
                                  np.asarray(select_prefill(other, k, tile, tb, 40, lens)))


@pytest.mark.parametrize("dense", [False, True])
def test_prefill_xla_in_chunks_of_tiles_matches_reference(dense):
    """The CPU's anchor prefill scores chunks of whole tiles (256 rows) against the keys up to each chunk's end:
    T = 300 with tile 32 is two chunks, the second one short and ending in a partial tile."""
    from pallas_kernels.anchor_attention import xla

    assert xla.SCORE_CHUNK_ROWS < 300
    check_prefill(xla.anchor_prefill_xla, xla.tile_scores_xla, jnp.float32, dense, T=300, tile=32,
                  lengths=(300, 170))
    q, k, _, _ = prefill_inputs(2, 1, 300, 4, 2, 16, [300])
    want = tile_scores_reference(q, k, tile=32, scale=0.3)
    got = xla.tile_scores_xla(q, k, tile=32, scale=0.3)
    fin = np.isfinite(np.asarray(want))
    np.testing.assert_array_equal(np.isfinite(np.asarray(got)), fin)
    np.testing.assert_allclose(np.asarray(got)[fin], np.asarray(want)[fin], rtol=1e-5, atol=1e-6)


def check_prefill(fn, scores_fn, dtype, dense, T=45, tile=8, lengths=(45, 30)):
    budget, mt = 0.3, 2
    q, k, v, lens = prefill_inputs(5, 2, T, 8, 2, 16, list(lengths), dtype)
    want_scores = tile_scores_reference(q, k, tile=tile, lengths=lens)  # a row's padding adds nothing
    scores = scores_fn(q, k, tile=tile, lengths=lens)
    fin = np.isfinite(np.asarray(want_scores))
    np.testing.assert_array_equal(np.isfinite(np.asarray(scores)), fin)
    np.testing.assert_allclose(np.asarray(scores)[fin], np.asarray(want_scores)[fin], rtol=TOL[dtype],
                               atol=TOL[dtype])
    out, idx = fn(q, k, v, lens, tile=tile, budget=budget, min_tokens=mt, dense_output=dense)
    kk = tile_counts(budget, T, tile, mt)[None, None, :]
    assert_valid_selection(idx, want_scores, kk, tol=1e-2 if dtype == jnp.bfloat16 else 1e-5)
    want = (jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla") if dense
            else sparse_prefill_reference(q, k, v, idx, lens, tile=tile))
    assert_close(out, want, dtype, "prefill anchor out")


@pytest.mark.parametrize("dtype,dense", [(jnp.float32, False), (jnp.bfloat16, True)])
def test_prefill_gpu_interpret_matches_reference(dtype, dense):
    cfg = gpu_prefill.PrefillScoresConfig(lse_block_m=16, block_n=8, pool_block_n=8)
    check_prefill(functools.partial(gpu_prefill.anchor_prefill_gpu, config=cfg, interpret=True),
                  functools.partial(gpu_prefill.tile_scores_gpu, config=cfg, interpret=True), dtype, dense)


@pytest.mark.parametrize("tile", [8, 16])
def test_prefill_gpu_kernels_stay_in_their_blocks(tile):
    """Every read and write of the Triton prefill lse and pooling kernels stays inside its block
    (`pallas_bounds.checked_memory`): their key loops index the zero-padded rows unmasked, so a loop bound one block
    too far reads or writes past the block, which the interpreter pads or drops and a GPU does not. T = 45, a
    multiple of no block (lse blocks of 16 rows, tiles of 8 or 16, key blocks of 8), G = 3 query heads per KV head,
    a row of length 30 (its padding rows add nothing); the tile scores, the selection and the sparse anchor's output
    against the reference (mutations: the lse pass's key loop or the pooling pass's -inf fill one block longer).
    The wrappers unjitted, so that they are traced under the check."""
    cfg = gpu_prefill.PrefillScoresConfig(lse_block_m=16, block_n=8, pool_block_n=8)
    q, k, v, lens = prefill_inputs(21, 2, 45, 6, 2, 16, [45, 30])
    kw = dict(tile=tile, budget=0.3, min_tokens=2)
    want_scores = np.asarray(tile_scores_reference(q, k, tile=tile, lengths=lens))
    want, want_idx = anchor_prefill_reference(q, k, v, lens, **kw)
    with checked_memory():
        scores = np.asarray(gpu_prefill.tile_scores_gpu.__wrapped__(q, k, tile=tile, lengths=lens, config=cfg,
                                                                    interpret=True))
        out, idx = gpu_prefill.anchor_prefill_gpu.__wrapped__(q, k, v, lens, config=cfg, interpret=True, **kw)
    fin = np.isfinite(want_scores)
    np.testing.assert_array_equal(np.isfinite(scores), fin)
    np.testing.assert_allclose(scores[fin], want_scores[fin], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
    assert_close(out, want, jnp.float32, f"anchor prefill, tile {tile}")


def test_prefill_tpu_interpret_matches_reference():
    cfg = tpu_prefill.TpuPrefillScoresConfig(block_m=64, block_n=128, chunk=128)
    check_prefill(functools.partial(tpu_prefill.anchor_prefill_tpu, config=cfg, interpret=True),
                  functools.partial(tpu_prefill.tile_scores_tpu, config=cfg, interpret=True), jnp.float32, False,
                  T=200, tile=64, lengths=(200, 151))


def test_prefill_api_and_errors():
    q, k, v, lens = prefill_inputs(6, 1, 24, 4, 2, 16, [24])
    want = anchor_prefill_reference(q, k, v, lens, tile=8, budget=0.5, min_tokens=2)
    out, idx = anchor_prefill(q, k, v, lens, tile=8, budget=0.5, min_tokens=2)  # CPU: "xla"
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want[1]))
    with pytest.raises(ValueError, match="implementation='cuda'"):
        anchor_prefill(q, k, v, lens, tile=8, budget=0.5, implementation="cuda")
    with pytest.raises(ValueError, match="tile=12"):
        gpu_prefill.tile_scores_gpu(q, k, tile=12, interpret=True)
    with pytest.raises(ValueError, match="tile=12"):
        tpu_prefill.tile_scores_tpu(q, k, tile=12, interpret=True)
    with pytest.raises(ValueError, match="k has shape"):
        anchor_prefill(q, k[:, :20], v[:, :20], lens, tile=8, budget=0.5)


def _prefill_args():
    sds = jax.ShapeDtypeStruct
    B, T, Hq, Hkv, D = 1, 1024, 32, 8, 128
    kv = sds((B, T, Hkv, D), jnp.bfloat16)
    return sds((B, T, Hq, D), jnp.bfloat16), kv, kv, sds((B,), jnp.int32)


def test_prefill_gpu_lowers_for_cuda():
    # The sparse anchor (the dense one calls cuDNN, which lowers only with a GPU present).
    check = jax.export.DisabledSafetyCheck.custom_call(plgpu.CUSTOM_CALL_TARGET_NAME)
    f = functools.partial(gpu_prefill.anchor_prefill_gpu, tile=128, budget=0.1)
    with abstract_device(*H100):
        text = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[check])(
            *_prefill_args()).mlir_module()
    for name in ("anchor_prefill_lse", "anchor_prefill_pool", "topk_select", "sparse_prefill_gathered"):
        assert name in text, name


@pytest.mark.parametrize("block_size", [1, 16])  # token rows, and Kascade's block-selection prefill
def test_prefill_tpu_lowers_for_tpu(block_size):
    f = functools.partial(tpu_prefill.anchor_prefill_tpu, tile=128, budget=0.1, block_size=block_size)
    with abstract_device(*TPU_V5E):
        text = jax.export.export(jax.jit(f), platforms=["tpu"])(*_prefill_args()).mlir_module()
    assert text.count("tpu_custom_call") >= 10  # lse + pooling + 8 counting passes


def test_scoring_block_fits_the_gpus_shared_memory():
    """The GPU scoring pass halves block_n until its pipelined tiles fit: at f32, head_dim 128, with the dense
    output (K and V tiles) the default block_n 128 asked an H200 for 272 KiB of its 227 and failed to launch."""
    from pallas_kernels.anchor_attention.gpu import SMEM_BUDGET, AnchorConfig, fitted_block_n
    cfg = AnchorConfig()
    assert (cfg.block_n, cfg.num_stages) == (128, 3)
    assert fitted_block_n(cfg, 128, 4, True) == 64  # the failing case: 2 copies x (K + V) x 64 KiB = 256 KiB
    for itemsize, dense in ((2, True), (2, False), (4, False)):  # the timed bf16 kernels keep their tuning
        assert fitted_block_n(cfg, 128, itemsize, dense) == 128
    assert fitted_block_n(cfg, 256, 4, True) == 32
    assert fitted_block_n(AnchorConfig(block_n=16), 1024, 4, True) == 16  # never below 16
    for D in (64, 128, 256):
        for itemsize in (2, 4):
            for dense in (False, True):
                bn = fitted_block_n(cfg, D, itemsize, dense)
                assert 2 * (1 + dense) * bn * D * itemsize + 16 * 1024 <= SMEM_BUDGET < 227 * 1024


def test_dense_anchor_decode_in_bf16_on_the_host():
    """The XLA path's dense output of a bf16 cache: its dot once ended in the layout "btkgd", which the CPU's dot
    refused (UNIMPLEMENTED: DotThunk BF16 x BF16 = F32), so a bf16 Kascade's layer 0 could not run on a CPU."""
    B, T, Hq, Hkv, D, N = 2, 1, 8, 2, 32, 96
    ks = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(ks[0], (B, T, Hq, D), jnp.float32)
    k = jax.random.normal(ks[1], (B, Hkv, N, D), jnp.float32)
    v = jax.random.normal(ks[2], (B, Hkv, N, D), jnp.float32)
    lengths = jnp.array([80, 41], jnp.int32)
    want, _ = anchor_decode_reference(q, k, v, lengths, budget=0.25, min_tokens=8, dense_output=True)
    bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    got, _ = anchor_decode(bf(q), bf(k), bf(v), lengths, budget=0.25, min_tokens=8, dense_output=True,
                           implementation="xla")
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=3e-2, atol=3e-2)


def test_prefill_xla_chunks_whole_tiles_when_the_tile_does_not_divide_the_chunk():
    """tile_scores_xla scores rows in chunks of whole tiles (SCORE_CHUNK_ROWS rounded down to a multiple of the
    tile). With tile 48 (which does not divide 256) and T = 300, a chunk of exactly 256 rows would split tile 5
    (rows 240..287) across two chunks and pool each half as its own tile (mutation: `rows = SCORE_CHUNK_ROWS`)."""
    from pallas_kernels.anchor_attention import xla

    T, tile = 300, 48
    assert xla.SCORE_CHUNK_ROWS % tile and xla.SCORE_CHUNK_ROWS < T
    q, k, _, lens = prefill_inputs(11, 1, T, 4, 2, 16, [290])
    want = np.asarray(tile_scores_reference(q, k, tile=tile, lengths=lens))
    got = np.asarray(xla.tile_scores_xla(q, k, tile=tile, lengths=lens))
    fin = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), fin)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dense", [False, True])
def test_prefill_xla_honours_a_custom_scale_in_its_attention(dense):
    """anchor_prefill_xla's output (sparse: sparse_prefill; dense: causal attention) uses the caller's softmax scale,
    as anchor_prefill_reference does (mutations: dropping scale= from the sparse_prefill call, or always taking
    dense_prefill(q, k, v) at 1/sqrt(D), both survived; only the scores saw a custom scale before)."""
    from pallas_kernels.anchor_attention import xla

    scale = 0.7  # 1/sqrt(16) = 0.25: far enough apart to tell
    q, k, v, lens = prefill_inputs(12, 2, 40, 4, 2, 16, [40, 29])
    kw = dict(tile=8, budget=0.3, min_tokens=2, scale=scale, dense_output=dense)
    want, want_idx = anchor_prefill_reference(q, k, v, lens, **kw)
    got, idx = xla.anchor_prefill_xla(q, k, v, lens, **kw)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
    n = np.asarray(lens)
    for b in range(2):  # valid rows (a dense anchor's padding rows are not specified as zeros)
        assert_close(got[b, :n[b]], want[b, :n[b]], jnp.float32, f"anchor prefill at scale {scale}, row {b}")
    default, _ = anchor_prefill_reference(q, k, v, lens, **{**kw, "scale": None})
    assert float(jnp.max(jnp.abs(default[:, :29] - want[:, :29]))) > 1e-2  # the test tells the scales apart

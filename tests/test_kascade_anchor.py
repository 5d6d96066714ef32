"""Kascade's anchors through the fused anchor ops equal the selection they replaced (oracle.select_decode with
the forced diagonal tile, oracle.select_prefill), layer by layer (one layer's cache and the stacked cache read
in place, T = 1 and T = 3) and through the whole model; so does the oracle's decode, which runs the same op
(`common.topk_decode`); the anchor ops' diagonal_tile / with_output / xla prefill against their references."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import struct

from jsparse import selection as sel
from jsparse.methods.common import attend_dense, attend_selected, dense_prefill, sparse_prefill
from jsparse.methods.kascade import Kascade, KascadeState
from jsparse.methods.oracle import Oracle, select_decode, select_prefill
from models.attention import LayerContext, LayerKV
from models.config import ModelConfig
from pallas_kernels.anchor_attention import anchor_decode, anchor_decode_reference, anchor_prefill, gpu
from pallas_kernels.anchor_attention.reference import anchor_prefill_reference, decode_scores_reference
from pallas_kernels.anchor_attention.common import DIAGONAL_SCORE

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

B, HQ, HKV, D, L = 2, 6, 2, 16, 4
CFG = ModelConfig(architecture="llama", vocab_size=48, hidden_size=48, intermediate_size=64, num_layers=L,
                  num_heads=HQ, num_kv_heads=HKV, head_dim=D, max_position_embeddings=512)


@struct.dataclass
class KascadeBefore(Kascade):
    """Kascade's anchors as they were: select_decode / select_prefill, then the attention ops. With reuse_scale r,
    an anchor hands the reuse layers select_prefill / select_decode at budget r * budget (width k_reuse)."""

    def prefill(self, ctx, q, k, v, state):
        T = q.shape[1]
        K = self.k_static(T)

        def anchor(dense):
            def fn():
                idx = select_prefill(q, k, self.tile, self.tile_budget(T), K, ctx.lengths)
                out = dense_prefill(q, k, v) if dense else sparse_prefill(q, k, v, idx, ctx.lengths, tile=self.tile)
                wide = select_prefill(q, k, self.tile, sel.budget_tokens(self.reuse_budget, sel.tile_starts(
                    T, self.tile), self.min_tokens), self.k_reuse(T), ctx.lengths)
                return out, wide
            return fn

        def reuse():
            idx = jnp.take(state.indices, ctx.info.head_map, axis=1)
            return sparse_prefill(q, k, v, idx, ctx.lengths, tile=self.tile), state.indices

        out, idx = jax.lax.switch(ctx.info.role, [anchor(True), anchor(False), reuse])
        return out, KascadeState(indices=idx)

    def decode(self, ctx, q, cache, state):
        T, N = q.shape[1], cache.k.shape[2]
        pos = sel.decode_positions(ctx.lengths, T)

        def anchor(dense):
            def fn():
                idx = select_decode(q, cache.k, pos, self.budget, self.min_tokens, self.k_static(N), self.tile)
                out = attend_dense(q, cache, ctx.lengths) if dense else attend_selected(q, cache, idx, ctx.lengths)
                wide = select_decode(q, cache.k, pos, self.reuse_budget, self.min_tokens, self.k_reuse(N), self.tile)
                return out, wide
            return fn

        def reuse():
            idx = jnp.take(state.indices, ctx.info.head_map, axis=1)
            return attend_selected(q, cache, idx, ctx.lengths), state.indices

        out, idx = jax.lax.switch(ctx.info.role, [anchor(True), anchor(False), reuse])
        return out, KascadeState(indices=idx)


def _methods(**kw):
    head_map = np.array([[0, 1], [1, 0], [0, 1], [1, 1]], np.int32)
    new = Kascade.from_anchors(CFG, [0, 2], head_map, **kw)
    old = KascadeBefore.from_anchors(CFG, [0, 2], head_map, **kw)
    return new, old


def _close(got, want, what, tol=2e-5):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol, err_msg=what)


def _decode_layer(method, stacked, layer, info, lengths, q, k_all, v_all, state):
    cache = (LayerKV(k=k_all[layer], v=v_all[layer], k_all=k_all, v_all=v_all, layer=layer) if stacked
             else LayerKV(k=k_all[layer], v=v_all[layer]))
    return method.decode(LayerContext(layer=layer, lengths=lengths, info=info), q, cache, state)


@pytest.mark.parametrize("T,stacked", [(1, True), (3, True), (3, False)])
def test_decode_layers_equal_select_decode(T, stacked):
    # budget 0.1 with min_tokens 4 < tile 8: at short rows the diagonal tile alone overfills the budget.
    N, lengths = 80, jnp.array([77, 11], jnp.int32)
    ks = jax.random.split(jax.random.key(T), 3)
    q = jax.random.normal(ks[0], (B, T, HQ, D))
    k_all = jax.random.normal(ks[1], (L, B, HKV, N, D))
    v_all = jax.random.normal(ks[2], (L, B, HKV, N, D))
    new, old = _methods(budget=0.1, min_tokens=4, tile=8)
    info = new.layer_info(CFG)
    states = [m.start(CFG, m.init_state(CFG, B, N), "decode", B, T, N) for m in (new, old)]
    steps = [jax.jit(functools.partial(_decode_layer, m, stacked)) for m in (new, old)]
    for layer in range(L):
        layer_info = jax.tree_util.tree_map(lambda x: x[layer], info)
        args = (jnp.int32(layer), layer_info, lengths, q, k_all, v_all)
        (out_n, states[0]), (out_o, states[1]) = (f(*args, s) for f, s in zip(steps, states))
        np.testing.assert_array_equal(np.asarray(states[0].indices), np.asarray(states[1].indices),
                                      err_msg=f"layer {layer}")
        _close(out_n, out_o, f"layer {layer}")
    # The diagonal tile was forced: every row's own tile is in the anchor's selection.
    idx = np.asarray(states[0].indices)
    for b, n in enumerate(np.asarray(lengths)):
        for t in range(T):
            p = n - T + t
            kk = sel.budget_tokens(0.1, p + 1, 4)
            diag = np.arange((p // 8) * 8, p + 1)[:kk]
            assert np.isin(diag, idx[b, :, t]).all() or kk == 0, (b, t)


def test_prefill_layers_equal_select_prefill():
    T, tile = 70, 16
    ks = jax.random.split(jax.random.key(9), 3)
    q = jax.random.normal(ks[0], (B, T, HQ, D))
    k, v = (jax.random.normal(x, (B, T, HKV, D)) for x in ks[1:])
    lengths = jnp.array([T, 53], jnp.int32)
    new, old = _methods(budget=0.25, min_tokens=8, tile=tile)
    info = new.layer_info(CFG)
    states = [m.start(CFG, m.init_state(CFG, B, T), "prefill", B, T, T) for m in (new, old)]
    steps = [jax.jit(lambda layer, info, s, m=m: m.prefill(LayerContext(layer=layer, lengths=lengths, info=info),
                                                             q, k, v, s)) for m in (new, old)]
    for layer in range(L):
        layer_info = jax.tree_util.tree_map(lambda x: x[layer], info)
        (out_n, states[0]), (out_o, states[1]) = (f(jnp.int32(layer), layer_info, s) for f, s in zip(steps, states))
        np.testing.assert_array_equal(np.asarray(states[0].indices), np.asarray(states[1].indices))
        _close(out_n[0], out_o[0], f"layer {layer} row 0")
        _close(out_n[1, :53], out_o[1, :53], f"layer {layer} row 1")


@pytest.mark.parametrize("reuse_scale", [1.0, 2.0])
def test_whole_model_prefill_then_decode_equals_before(reuse_scale):
    """Also with reuse_scale 2: the anchors attend their own top-k and hand top-(2k) to the reuse layers."""
    from models import llama
    from models.cache import init_cache
    from models.params import random_params

    params = random_params(CFG, jax.random.key(0), jnp.float32, scale=0.3)
    T, N = 48, 64
    toks = jax.random.randint(jax.random.key(1), (B, T), 0, CFG.vocab_size)
    lengths = jnp.array([T, 37], jnp.int32)
    step_tok = jax.random.randint(jax.random.key(2), (B, 1), 0, CFG.vocab_size)
    res = []
    methods = _methods(budget=0.2, min_tokens=8, tile=16, reuse_scale=reuse_scale)
    assert methods[0].k_reuse(N) == sel.budget_tokens(min(0.2 * reuse_scale, 1.0), N, 8)
    for m in methods:
        logits, cache, state = jax.jit(lambda p, t, l: llama.prefill(
            p, CFG, m, t, l, init_cache(CFG, B, N, jnp.float32), None, all_logits=True))(params, toks, lengths)
        one = jax.jit(lambda p, t, c: llama.decode(p, CFG, m, t, c, None)[0])(params, step_tok, cache)
        res.append((logits, one))
    (p_new, d_new), (p_old, d_old) = res
    _close(p_new[0], p_old[0], "prefill row 0", tol=1e-4)
    _close(p_new[1, :37], p_old[1, :37], "prefill row 1", tol=1e-4)
    _close(d_new, d_old, "decode T=1 (stacked cache in place)", tol=1e-4)


@struct.dataclass
class OracleBefore(Oracle):
    """The oracle's decode as it was: select_decode (f32 weights of every key), then attend_selected; one layer
    scan with a `lax.cond` per layer."""

    def segments(self, cfg, phase):
        return None

    def sparse_decode(self, ctx, q, cache, state):
        T, N = q.shape[1], cache.k.shape[2]
        pos = sel.decode_positions(ctx.lengths, T)
        idx = select_decode(q, cache.k, pos, self.budget, self.min_tokens, self.k_static(N), self.tile)
        return attend_selected(q, cache, idx, ctx.lengths), state


def test_oracle_decode_through_the_anchor_op_equals_before():
    """The oracle's decode (T = 1 gathered from the stacked cache in place, T = 3 through a mask) equals
    select_decode + attend_selected, with its dense and sparse layers scanned apart: no conditional."""
    from models import llama
    from models.cache import init_cache
    from models.params import random_params

    params = random_params(CFG, jax.random.key(4), jnp.float32, scale=0.3)
    T, N = 40, 64
    toks = jax.random.randint(jax.random.key(5), (B, T), 0, CFG.vocab_size)
    lengths = jnp.array([T, 29], jnp.int32)
    kw = dict(budget=0.2, min_tokens=8, tile=16, dense_layers=2)
    new, old = Oracle(**kw), OracleBefore(**kw)
    assert new.segments(CFG, "decode") == ((0, 2, "dense"), (2, L, "sparse")) and new.segments(CFG, "prefill") is None
    _, cache, _ = jax.jit(lambda p, t, l: llama.prefill(p, CFG, new, t, l, init_cache(CFG, B, N, jnp.float32),
                                                        None))(params, toks, lengths)
    for n_new in (1, 3):
        step = jax.random.randint(jax.random.key(6 + n_new), (B, n_new), 0, CFG.vocab_size)
        got, want = (jax.jit(lambda p, t, c, m=m: llama.decode(p, CFG, m, t, c, None)[0])(params, step, cache)
                     for m in (new, old))
        _close(got, want, f"decode T={n_new}", tol=1e-4)
    text = {name: jax.jit(lambda p, t, c, m=m: llama.decode(p, CFG, m, t, c, None)[0]).lower(
        params, step[:, :1], cache).as_text() for name, m in (("new", new), ("old", old))}
    assert "stablehlo.case" in text["old"] and "stablehlo.case" not in text["new"]
    assert text["new"].count("stablehlo.while") == text["old"].count("stablehlo.while") + 1


# ---------------------------------------------------------------------------------------------------------
# The anchor ops' new arguments against their references.

def _decode_inputs(seed, T, N, lengths, Hq=8, Hkv=2):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, Hq, D), np.float32))
    k, v = (jnp.asarray(rng.standard_normal((B, Hkv, N, D), np.float32)) for _ in range(2))
    return q, k, v, jnp.asarray(lengths, jnp.int32)


@pytest.mark.parametrize("T,mt", [(1, 4), (2, 40)])
def test_diagonal_tile_equals_select_decode(T, mt):
    q, k, v, lens = _decode_inputs(1, T, 96, [90, 21])
    K = sel.budget_tokens(0.1, 96, mt)
    want = select_decode(q, k, sel.decode_positions(lens, T), 0.1, mt, K, 32)
    for impl in ("reference", "xla"):
        out, idx = anchor_decode(q, k, v, lens, budget=0.1, min_tokens=mt, diagonal_tile=32, implementation=impl)
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(want), err_msg=impl)
        none, idx2 = anchor_decode(q, k, v, lens, budget=0.1, min_tokens=mt, diagonal_tile=32, with_output=False,
                                   implementation=impl)
        assert none is None
        np.testing.assert_array_equal(np.asarray(idx2), np.asarray(want))
    with pytest.raises(ValueError, match="diagonal_tile=-1"):
        anchor_decode(q, k, v, lens, budget=0.1, diagonal_tile=-1)


@pytest.mark.parametrize("pool,G,dense,dt", [("triton", 4, False, 8), ("triton", 3, True, 0), ("xla", 4, False, 8)])
def test_gpu_pool_variants_interpret(pool, G, dense, dt):
    # G = 3: the pooling pass pads the group to 4 rows. N = 100: a masked tail; lengths 100 / 9.
    q, k, v, lens = _decode_inputs(3, 1, 100, [100, 9], Hq=2 * G)
    cfg = gpu.AnchorConfig(block_n=16, target_programs=16, pool=pool, pool_block=32)
    out, idx = gpu.anchor_decode_gpu(q, k, v, lens, budget=0.2, min_tokens=4, diagonal_tile=dt,
                                     dense_output=dense, config=cfg, interpret=True)
    want, want_idx = anchor_decode_reference(q, k, v, lens, budget=0.2, min_tokens=4, diagonal_tile=dt,
                                             dense_output=dense)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
    _close(out, want, "out", tol=1e-5)
    if pool == "xla":
        return
    scores, _ = gpu.decode_scores_gpu(q, k, v, lens, diagonal_tile=dt, config=cfg, interpret=True)
    ref = np.asarray(decode_scores_reference(q, k, lens, diagonal_tile=dt))
    scores = np.asarray(scores)
    np.testing.assert_array_equal(np.isneginf(scores), np.isneginf(ref))
    diagonal = ref >= DIAGONAL_SCORE  # the diagonal tile's keys, the most recent highest
    assert diagonal.any() == bool(dt)
    np.testing.assert_array_equal(scores[diagonal], ref[diagonal])
    fin = np.isfinite(ref)
    np.testing.assert_allclose(scores[fin], ref[fin], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="pool='cuda'"):
        gpu.decode_scores_gpu(q, k, v, lens, config=gpu.AnchorConfig(pool="cuda"), interpret=True)


@pytest.mark.parametrize("S,G,Gm", [(5, 3, 16), (4, 4, 4), (1, 2, 2)])
def test_gpu_pool_merges_partials_interpret(S, G, Gm):
    # The Triton pooling pass merges the scoring pass's split partials itself: S = 5 (not a power of two) with
    # one split empty (l = 0, m = the kernel's -1e30), G = 3 of Gm = 16 rows (the rest garbage), against
    # combine_lse + pool_scores + force_diagonal; S = 1, l = 1 is one given logsumexp.
    from pallas_kernels.anchor_attention.common import combine_lse, force_diagonal, pool_scores

    rng = np.random.default_rng(S * 10 + G)
    Bq, H, T, N = 2, 2, 2, 70
    logits = jnp.asarray(rng.standard_normal((Bq, H, T, G, N)) * 3, jnp.float32)
    m = jnp.asarray(rng.standard_normal((S, Bq, H, T, Gm)), jnp.float32)
    l = jnp.asarray(rng.uniform(0.5, 4.0, (S, Bq, H, T, Gm)), jnp.float32)
    if S > 1:
        m, l = m.at[2].set(-1e30), l.at[2].set(0.0)
    pos = jnp.array([[68, 69], [-1, 10]], jnp.int32)  # a row with nothing visible
    got = np.asarray(gpu.pool_gpu(logits, m, l, pos, diagonal_tile=8, interpret=True,
                                  config=gpu.AnchorConfig(pool="triton", pool_block=32)))
    mg, lg = m[..., :G], l[..., :G]
    lse = combine_lse(jnp.where(lg > 0, mg, -jnp.inf), lg)
    want = np.asarray(force_diagonal(pool_scores(logits, lse, pos), pos, 8))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    assert np.isneginf(got[1, :, 0]).all() and np.isfinite(got[0, :, 1]).all()
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="expected equal shapes"):
        gpu.pool_gpu(logits, m, l[..., :1], pos, interpret=True)


def test_gpu_stacked_with_output_false_interpret():
    q, k, v, lens = _decode_inputs(4, 1, 64, [64, 30])
    k_all, v_all = jnp.stack([v, k, v]), jnp.stack([k, v, k])
    cfg = gpu.AnchorConfig(block_n=16, target_programs=8, pool="triton", pool_block=16)
    out, idx = gpu.anchor_decode_gpu(q, k_all, v_all, lens, layer=jnp.int32(1), budget=0.2, min_tokens=4,
                                     diagonal_tile=16, with_output=False, config=cfg, interpret=True)
    assert out is None
    want = anchor_decode_reference(q, v, k, lens, budget=0.2, min_tokens=4, diagonal_tile=16)[1]
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want))


@pytest.mark.parametrize("dense", [False, True])
def test_prefill_xla_equals_reference(dense):
    rng = np.random.default_rng(5)
    T = 40
    q = jnp.asarray(rng.standard_normal((B, T, 8, D), np.float32))
    k, v = (jnp.asarray(rng.standard_normal((B, T, 2, D), np.float32)) for _ in range(2))
    lens = jnp.array([40, 27], jnp.int32)
    kw = dict(tile=8, budget=0.3, min_tokens=2, dense_output=dense)
    out, idx = anchor_prefill(q, k, v, lens, **kw)  # CPU: "xla"
    want, want_idx = anchor_prefill_reference(q, k, v, lens, **kw)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
    _close(out[0], want[0], "row 0")
    _close(out[1, :27], want[1, :27], "row 1")


def test_api_passes_gpu_config():
    q, k, v, lens = _decode_inputs(6, 1, 64, [50, 64])
    cfg = gpu.AnchorConfig(pool="nope")
    with pytest.raises(ValueError, match="pool='nope'"):
        jax.eval_shape(functools.partial(anchor_decode, budget=0.2, implementation="pallas_gpu", config=cfg),
                       q, k, v, lens)


def test_gpu_pool_variant_lowers_for_cuda():
    from lowering import export_for

    sds = jax.ShapeDtypeStruct
    cache = sds((4, 2, 8, 4096, 128), jnp.bfloat16)  # a stacked cache, layer traced
    args = (sds((2, 1, 32, 128), jnp.bfloat16), cache, cache, sds((2,), jnp.int32))
    f = functools.partial(gpu.anchor_decode_gpu, budget=0.1, layer=jnp.int32(2), diagonal_tile=32,
                          config=gpu.AnchorConfig(pool="triton"))
    text = export_for("cuda", f, *args).mlir_module()
    for name in ("anchor_decode_logits", "anchor_decode_pool", "topk_select", "sparse_decode_gathered_stacked"):
        assert name in text, name


def test_gpu_pool_auto_takes_triton_for_one_query_row():
    """AnchorConfig(pool="auto") (the default) pools in Triton for at most POOL_TRITON_ROWS query rows (B * T: the
    batch-1 decode, eval/results/h100/pool_b1/) and in XLA above; explicit choices stand. The traced scoring pass
    holds the pooling kernel exactly where the path is Triton, and both paths give the same scores."""
    assert gpu.AnchorConfig().pool == "auto"
    assert gpu.pool_path(gpu.AnchorConfig(), 1) == "triton" and gpu.pool_path(gpu.AnchorConfig(), 2) == "xla"
    assert gpu.pool_path(gpu.AnchorConfig(pool="xla"), 1) == "xla"
    assert gpu.pool_path(gpu.AnchorConfig(pool="triton"), 8) == "triton"
    rng = np.random.default_rng(7)
    for rows, lens in ((1, [50]), (2, [64, 30])):
        q = jnp.asarray(rng.standard_normal((rows, 1, 8, D)), jnp.float32)
        k, v = (jnp.asarray(rng.standard_normal((rows, 2, 64, D)), jnp.float32) for _ in range(2))
        lengths = jnp.asarray(lens, jnp.int32)
        with pytest.raises(ValueError, match="AnchorConfig.pool='fast': expected 'xla', 'triton' or 'auto'"):
            gpu.decode_scores_gpu(q, k, v, lengths, config=gpu.AnchorConfig(pool="fast"), interpret=True)
        cfg = dict(block_n=16, target_programs=8, pool_block=16)
        run = lambda pool: gpu.decode_scores_gpu(q, k, v, lengths, config=gpu.AnchorConfig(pool=pool, **cfg),  # noqa
                                                 interpret=True)
        jaxpr = str(jax.make_jaxpr(lambda: run("auto"))())
        assert ("anchor_decode_pool" in jaxpr) == (rows == 1)
        got, want = np.asarray(run("auto")[0]), np.asarray(run("xla")[0])
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
        np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-5, atol=1e-7)

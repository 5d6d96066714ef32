"""`pallas_kernels.kv_write.rope_write` (a decode step's rotation and cache write in one launch): the Triton kernel in
interpret mode against its jnp reference on random inputs (bf16 and f32, T = 1 and 3, padding rows, a position past
the cache and a negative one dropped, the other layers and positions untouched), the entry point's dispatch and
errors (a q/k norm normed in XLA, then the kernel), CUDA lowering with both caches aliased, and the model's decode
through it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowering import export_for
from pallas_bounds import checked_memory
from pallas_kernels.kv_write import rope_write
from pallas_kernels.kv_write import gpu as kgpu
from pallas_kernels.kv_write.reference import rope_write_reference

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def _inputs(seed, B, T, Hq, Hkv, D, L, N, dtype, pad=0, positions=None):
    ks = jax.random.split(jax.random.key(seed), 5)
    qkv = jax.random.normal(ks[0], (B * T + pad, Hq + 2 * Hkv, D), jnp.float32).astype(dtype)
    ck = jax.random.normal(ks[1], (L, B, Hkv, N, D), jnp.float32).astype(dtype)
    cv = jax.random.normal(ks[2], (L, B, Hkv, N, D), jnp.float32).astype(dtype)
    if positions is None:
        positions = jax.random.randint(ks[3], (B, 1), 0, N - T) + jnp.arange(T)[None]
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, D, 2, dtype=np.float32) / D))
    norms = (1.0 + 0.3 * jax.random.normal(ks[4], (2, D))).astype(dtype)
    return qkv, jnp.asarray(positions, jnp.int32), jnp.asarray(inv_freq), ck, cv, norms


CASES = [  # (B, T, Hq, Hkv, D, dtype, pad)
    (4, 1, 8, 2, 32, jnp.bfloat16, 4),
    (3, 1, 8, 4, 64, jnp.float32, 0),
    (2, 3, 4, 2, 32, jnp.bfloat16, 2),
    (1, 1, 16, 8, 32, jnp.float32, 0),
]


@pytest.mark.parametrize("B, T, Hq, Hkv, D, dtype, pad", CASES)
def test_kernel_matches_reference(B, T, Hq, Hkv, D, dtype, pad):
    L, N, layer = 3, 48, 1
    qkv, pos, inv_freq, ck, cv, _ = _inputs(B * 7 + T, B, T, Hq, Hkv, D, L, N, dtype, pad)
    pos = pos.at[0, -1].set(N + 5)  # past the cache: dropped
    if B > 1:
        pos = pos.at[1, 0].set(-3)  # before it: dropped (the reference wrapped it to N - 3, the kernel clamped to 0)
    want = rope_write_reference(qkv, pos, inv_freq, ck, cv, layer, Hq, Hkv)
    got = jax.jit(functools.partial(kgpu.rope_write_gpu, num_q_heads=Hq, num_kv_heads=Hkv,
                                    interpret=True))(qkv, pos, inv_freq, ck, cv, jnp.int32(layer))
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for g, w, name in zip(got, want, ("q", "cache_k", "cache_v")):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), err_msg=name, **tol)
    # Only the written rows changed: the other layers and positions keep their values bit for bit, and so does
    # the dropped token's row (v is copied, not computed).
    for g, c in ((got[1], ck), (got[2], cv)):
        changed = np.argwhere(np.any(np.asarray(g != c), axis=-1))
        wrote = {(layer, b, h, int(pos[b, t])) for b in range(B) for t in range(T) for h in range(Hkv)
                 if 0 <= pos[b, t] < N}
        assert {tuple(int(i) for i in r) for r in changed} <= wrote
    b = B - 1  # its first token (position < N unless it is the dropped one)
    if (b, 0) != (0, T - 1) and int(pos[b, 0]) >= 0:
        np.testing.assert_array_equal(np.asarray(got[2][layer, b, :, int(pos[b, 0])]),
                                      np.asarray(qkv[b * T, Hq + Hkv:]))


def test_entry_point_dispatch_and_errors():
    B, T, Hq, Hkv, D = 2, 1, 4, 2, 32
    qkv, pos, inv_freq, ck, cv, norms = _inputs(3, B, T, Hq, Hkv, D, 2, 16, jnp.float32)
    want = rope_write_reference(qkv, pos, inv_freq, ck, cv, 0, Hq, Hkv)
    for impl in (None, "reference"):  # None off a GPU: the reference
        for g, w in zip(rope_write(qkv, pos, inv_freq, ck, cv, 0, Hq, Hkv, implementation=impl), want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(ValueError, match=r"qkv \(2, 8, 32\): expected \[R >= B \* T = 2, Hq \+ 2 Hkv = 10, D\]"):
        rope_write(qkv[:, :8], pos, inv_freq, ck, cv, 0, 6, Hkv)
    with pytest.raises(ValueError, match=r"cache_k \(2, 2, 2, 16, 32\), cache_v \(2, 2, 2, 15, 32\): expected equal"):
        rope_write(qkv, pos, inv_freq, ck, cv[:, :, :, :15], 0, Hq, Hkv)
    with pytest.raises(ValueError, match=r"inv_freq \(15,\): expected \[D / 2\] = \[16\]"):
        rope_write(qkv, pos, inv_freq[:15], ck, cv, 0, Hq, Hkv)
    with pytest.raises(ValueError, match="q_norm and k_norm: expected both"):
        rope_write(qkv, pos, inv_freq, ck, cv, 0, Hq, Hkv, q_norm=norms[0])
    # Named (an integer qkv returned a truncated rotation; the others failed inside jnp with no argument named).
    with pytest.raises(ValueError, match="qkv of dtype int32: expected a floating dtype"):
        rope_write(qkv.astype(jnp.int32), pos, inv_freq, ck, cv, 0, Hq, Hkv)
    for bad in (pos[0], pos.astype(jnp.float32)):
        with pytest.raises(ValueError, match=r"positions .*: expected an integer array \[B, T\]"):
            rope_write(qkv, bad, inv_freq, ck, cv, 0, Hq, Hkv)
    with pytest.raises(ValueError, match=r"k_norm \(16,\): expected \[D\] = \[32\]"):
        rope_write(qkv, pos, inv_freq, ck, cv, 0, Hq, Hkv, q_norm=norms[0], k_norm=norms[1][:16])
    q48, pos48, f48, ck48, cv48, _ = _inputs(3, B, T, Hq, Hkv, 48, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match="cannot run this call: head_dim=48: the kernel takes a power of two >= 32"):
        rope_write(q48, pos48, f48, ck48, cv48, 0, Hq, Hkv, implementation="pallas_gpu")
    want = rope_write_reference(qkv, pos, inv_freq, ck, cv, 0, Hq, Hkv, norms[0], norms[1])
    for g, w in zip(rope_write(qkv, pos, inv_freq, ck, cv, 0, Hq, Hkv, norms[0], norms[1]), want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(ValueError, match="cannot run this call: num_q_heads=6: the kernel takes a power of two"):
        rope_write(jnp.zeros((2, 10, 32)), pos, inv_freq, ck, cv, 0, 6, Hkv, implementation="pallas_gpu")
    with pytest.raises(ValueError, match="head_dim=16: the kernel takes a power of two >= 32"):
        kgpu.rope_write_gpu(qkv[..., :16], pos, inv_freq[:8], ck[..., :16], cv[..., :16], 0, Hq, Hkv)


def test_layer_is_checked_and_written_alike():
    """A known layer outside [-L, L) is an error naming it; -1 writes the last layer, in the reference and the kernel
    alike (the kernel clamped it to layer 0 while the reference wrapped it)."""
    B, T, Hq, Hkv, D, L = 2, 1, 4, 2, 32, 3
    qkv, pos, inv_freq, ck, cv, _ = _inputs(5, B, T, Hq, Hkv, D, L, 16, jnp.float32)
    for layer in (3, -4):
        with pytest.raises(ValueError, match=rf"layer={layer}: expected a layer in \[-L, L\) of the L=3"):
            rope_write(qkv, pos, inv_freq, ck, cv, layer, Hq, Hkv)
    want = rope_write_reference(qkv, pos, inv_freq, ck, cv, L - 1, Hq, Hkv)
    for got in (rope_write(qkv, pos, inv_freq, ck, cv, -1, Hq, Hkv),
                kgpu.rope_write_gpu(qkv, pos, inv_freq, ck, cv, jnp.int32(-1), Hq, Hkv, interpret=True)):
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    # A traced layer is wrapped and clamped in-kernel (no XLA op before the launch): -1 and L + 4 write the last
    # layer, -L - 2 the first, as a traced index into the stacked cache reads.
    kernel = jax.jit(lambda layer: kgpu.rope_write_gpu(qkv, pos, inv_freq, ck, cv, layer, Hq, Hkv, interpret=True))
    for layer, row in ((-1, L - 1), (L + 4, L - 1), (-L - 2, 0)):
        want = rope_write_reference(qkv, pos, inv_freq, ck, cv, row, Hq, Hkv)
        for g, w in zip(kernel(jnp.int32(layer)), want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5, err_msg=f"layer {layer}")


def test_kernel_stays_in_its_blocks():
    """Every store of the kernel stays inside its block (`pallas_bounds.checked_memory`: the interpreter drops stray
    stores, where a GPU writes into another row's or layer's cache): positions past the cache and before it (their
    stores masked off), T = 3, padding rows of qkv, the last layer named -1."""
    B, T, Hq, Hkv, D, L, N = 2, 3, 4, 2, 32, 2, 16
    qkv, pos, inv_freq, ck, cv, _ = _inputs(9, B, T, Hq, Hkv, D, L, N, jnp.float32, pad=2)
    pos = pos.at[0, -1].set(N + 5).at[1, 0].set(-3)
    want = rope_write_reference(qkv, pos, inv_freq, ck, cv, L - 1, Hq, Hkv)
    with checked_memory():
        got = kgpu.rope_write_gpu(qkv, pos, inv_freq, ck, cv, jnp.int32(-1), Hq, Hkv, interpret=True)
        for g, w, name in zip(got, want, ("q", "cache_k", "cache_v")):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5, err_msg=name)


def test_lowers_for_cuda_with_both_caches_aliased():
    """Llama-3.1-8B's decode at 128K, batch 8 (a 64 GiB stacked cache: 64-bit offsets), rows padded to 16."""
    sds = jax.ShapeDtypeStruct
    big = sds((32, 8, 8, 131072, 128), jnp.bfloat16)
    fn = functools.partial(kgpu.rope_write_gpu, num_q_heads=32, num_kv_heads=8)
    exp = export_for("cuda", fn, sds((16, 48, 128), jnp.bfloat16), sds((8, 1), jnp.int32), sds((64,), jnp.float32),
                     big, big, sds((), jnp.int32))
    text = exp.mlir_module()
    assert "rope_write" in text
    for out, operand in ((1, 4), (2, 5)):
        assert f"output_operand_alias<output_tuple_indices = [{out}], operand_index = {operand}" in text


@pytest.mark.parametrize("qk_norm", [False, True])
def test_model_decode_through_the_kernel_equals_the_separate_layout(monkeypatch, qk_norm):
    """The model's decode with fused q/k/v weights goes through `rope_write` (here the kernel in interpret mode; with
    a q/k norm the heads normed first, `norm_heads`): the same logits and cache as the reference, and as the separate
    layout's XLA rotation and scatters (batch 3: rows padded to 8)."""
    from jsparse.methods import make_method
    from models import llama, params as P
    from models.cache import init_cache
    from models.config import ModelConfig

    cfg = ModelConfig(architecture="qwen3" if qk_norm else "llama", vocab_size=64, hidden_size=64,
                      intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                      max_position_embeddings=256, qk_norm=qk_norm)
    params = P.random_params(cfg, jax.random.key(0), jnp.float32, scale=0.3)
    cache = init_cache(cfg, 3, 32, jnp.float32)
    ks = jax.random.split(jax.random.key(1))
    cache = cache.replace(k=jax.random.normal(ks[0], cache.k.shape), v=jax.random.normal(ks[1], cache.v.shape),
                          lengths=jnp.array([5, 17, 30], jnp.int32))
    tok = jnp.array([[3], [9], [11]], jnp.int32)
    m = make_method("dense")
    calls = []

    def kernel(*args, **kw):  # the entry point, made to take the kernel (interpreted) as on a GPU
        calls.append(1)
        return rope_write(*args, implementation="pallas_gpu", **kw)
    monkeypatch.setattr(kgpu, "rope_write_gpu", functools.partial(kgpu.rope_write_gpu, interpret=True))
    monkeypatch.setattr(llama, "gemm_row_padding", lambda rows, dtype: -rows % 8)  # as on a GPU
    step = lambda p: jax.jit(lambda p, t, c: llama.decode(p, cfg, m, t, c, None))(p, tok, cache)  # noqa: E731
    separate = step(P.with_layout(params, "separate"))
    want = step(P.with_layout(params, "fused"))  # through the reference
    monkeypatch.setattr(llama, "rope_write", kernel)
    got = step(P.with_layout(params, "fused"))
    assert calls  # with a q/k norm too
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)  # the q/k norm's sum
    np.testing.assert_allclose(np.asarray(got[1].k), np.asarray(want[1].k), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got[1].v[0]), np.asarray(want[1].v[0]))  # layer 0: v copied as is
    np.testing.assert_allclose(np.asarray(got[1].v), np.asarray(want[1].v), rtol=1e-5, atol=1e-5)
    for g, w in ((got[0], separate[0]), (got[1].k, separate[1].k), (got[1].v, separate[1].v)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_default_on_a_gpu_backend_norms_a_qk_norm_in_xla_then_runs_the_kernel(monkeypatch, dtype):
    """implementation=None on a GPU backend with a q/k norm: the heads are normed (`norm_heads`, each head by its own
    weight, v untouched) and the kernel rotates and writes them; the reference's q, k and v within f32 rounding, and
    in bf16 within the normed heads' one rounding before the rotation (the reference's XLA may keep them in f32)."""
    from pallas_kernels.kv_write import norm_heads

    B, T, Hq, Hkv, D = 2, 1, 4, 2, 32
    qkv, pos, inv_freq, ck, cv, norms = _inputs(7, B, T, Hq, Hkv, D, 2, 16, dtype)
    want = rope_write_reference(qkv, pos, inv_freq, ck, cv, 0, Hq, Hkv, norms[0], norms[1])
    normed = norm_heads(qkv, Hq, Hkv, norms[0], norms[1], 1e-6)
    assert normed.dtype == qkv.dtype
    np.testing.assert_array_equal(np.asarray(normed[:, Hq + Hkv:]), np.asarray(qkv[:, Hq + Hkv:]))
    unit = lambda a: np.sqrt(np.mean(np.asarray(a, np.float64) ** 2, axis=-1))  # noqa: E731  (the normed heads' rms)
    np.testing.assert_allclose(unit(normed[:, :Hq] / norms[0].astype(jnp.float32)), 1.0, rtol=2e-2)
    np.testing.assert_allclose(unit(normed[:, Hq:Hq + Hkv] / norms[1].astype(jnp.float32)), 1.0, rtol=2e-2)
    seen, original = [], kgpu.rope_write_gpu

    def kernel(qkv_in, *args, **kw):
        seen.append(qkv_in)
        return original(qkv_in, *args, interpret=True, **kw)
    monkeypatch.setattr(kgpu, "rope_write_gpu", kernel)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    got = rope_write(qkv, pos, inv_freq, ck, cv, 0, Hq, Hkv, norms[0], norms[1])
    assert len(seen) == 1
    np.testing.assert_array_equal(np.asarray(seen[0]), np.asarray(normed))  # the kernel got the normed heads
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    for g, w, name in zip(got, want, ("q", "cache_k", "cache_v")):
        assert g.dtype == w.dtype, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), err_msg=name, **tol)


def test_qkv_with_fewer_rows_than_tokens_is_named():
    B, T, Hq, Hkv, D = 2, 3, 4, 2, 32
    qkv, pos, inv_freq, ck, cv, _ = _inputs(8, B, T, Hq, Hkv, D, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match=r"qkv \(5, 8, 32\): expected \[R >= B \* T = 6"):
        rope_write(qkv[:5], pos, inv_freq, ck, cv, 0, Hq, Hkv)


def test_qk_norm_reference_equals_numpy():
    """Qwen3's q/k norms: q normed with q_norm, k with k_norm (distinct weights), eps inside the root (an all-zero
    head stays zero, not NaN), then the rotate-half rotation; k and v written at [layer, b, :, position]."""
    B, T, Hq, Hkv, D, L, N, eps = 2, 1, 4, 2, 32, 2, 16, 1e-6
    qkv, pos, inv_freq, ck, cv, norms = _inputs(9, B, T, Hq, Hkv, D, L, N, jnp.float32)
    qkv = qkv.at[0, 1].set(0.0).at[1, Hq].set(0.0)  # a zero q head and a zero k head
    q, k_out, v_out = rope_write(qkv, pos, inv_freq, ck, cv, 1, Hq, Hkv, norms[0], norms[1], eps)
    x, w, f = np.asarray(qkv, np.float64), np.asarray(norms, np.float64), np.asarray(inv_freq, np.float64)

    def norm_rope(a, weight, p):  # a: [H, D]
        a = a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + eps) * weight
        ang = p * np.concatenate([f, f])
        rot = np.concatenate([-a[:, D // 2:], a[:, :D // 2]], axis=-1)
        return a * np.cos(ang) + rot * np.sin(ang)
    for b in range(B):
        p = int(pos[b, 0])
        np.testing.assert_allclose(np.asarray(q[b, 0]), norm_rope(x[b, :Hq], w[0], p), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(k_out[1, b, :, p]), norm_rope(x[b, Hq:Hq + Hkv], w[1], p),
                                   rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(v_out[1, b, :, p]), np.asarray(qkv[b, Hq + Hkv:]))
    assert not np.asarray(q[0, 0, 1]).any() and not np.asarray(k_out[1, 1, 0, int(pos[1, 0])]).any()
